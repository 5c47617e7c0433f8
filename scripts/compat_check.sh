#!/usr/bin/env bash
# Run sdvg on the GPU machine's stack, on the CPU: Python 3.12 (where installed), torch 2.11 (the
# oldest torch sdvg supports), numpy 2.5, the image's transformers 5 / huggingface-hub 1, with the
# wheels of benchmarks/gpu-wheels.txt on top exactly as benchmarks/gpu_check.sh installs them there. First
# gpu_check.sh itself with the tiny preset on the CPU (a failure there would have cost a GPU
# session): its dry run, then the run, which must leave at most 3 files in $OUT (a device session
# returns at most 8), its tarball holding every result; then the test suite (arguments go to pytest: CI
# passes -m "not slow", the fast tier). Uses .compat/ (a venv) and .whl/; downloads ~3.5 GB once.
set -euo pipefail
cd "$(dirname "$0")/.."
# pip warns about each of this machine's local index folders that lacks a package; keep errors only
quiet_pip() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
py=""
for c in python3.12 "$(pyenv root 2>/dev/null || echo /none)"/versions/3.12*/bin/python3.12 python3; do
  if "$c" -V >/dev/null 2>&1; then py=$c; break; fi
done
echo "compat_check: $("$py" -V) from $py"
[ -x .compat/bin/python ] || "$py" -m venv .compat
quiet_pip .compat/bin/python -m pip install -q -r requirements-gpu-image.txt
PYTHON=.compat/bin/python bash scripts/fetch_wheels.sh >/dev/null
ret=$(mktemp -d)
cuda=0; [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] && cuda=1
PYTHON=.compat/bin/python PRESET=tiny DEVICE=cpu bash benchmarks/gpu_check.sh --dry-run  # the plan, nothing run
SDVG_CUDA=$cuda SITE_DIR=$PWD/.compat/sdvg-site PYTHON=.compat/bin/python OUT=$ret PRESET=tiny DEVICE=cpu \
  TESTS_S=900 LATENCY_S=900 COMPILE_S=600 HOST_SYNCS_S=600 STAGES_S=900 \
  bash benchmarks/gpu_check.sh  # CPU: generous boxes; the check is what ran
# what a device session gets back: at most 3 files (the tarball and the summary log)
n=$(find "$ret" -mindepth 1 | wc -l)
[ "$n" -le 3 ] && [ -s "$ret/results.tar.gz" ] && [ -s "$ret/summary.log" ] \
  || { echo "compat_check: gpu_check.sh left $n entries in \$OUT (at most 3: results.tar.gz, summary.log)"; ls -la "$ret"; exit 1; }
out=$(mktemp -d)
tar -xzf "$ret/results.tar.gz" -C "$out"
for f in env.json gpu_tests.log results.json results.md stages.json timeline.png host-syncs/results.json \
    compile/results.json summary.json; do
  [ -s "$out/$f" ] || { echo "compat_check: gpu_check.sh packed no $f"; exit 1; }
done
# tests/test_gpu.py only: on the CPU every test is skipped; none may fail
if ! grep -q -E "[0-9]+ (passed|skipped)" "$out/gpu_tests.log" || grep -q -E "[0-9]+ (failed|errors?)\b" "$out/gpu_tests.log"; then
  echo "compat_check: the GPU test subset failed under gpu_check.sh"; exit 1
fi
.compat/bin/python - "$out" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
lat, st = json.loads((out / "results.json").read_text()), json.loads((out / "stages.json").read_text())
assert lat["speedup_vs_target"] > 0 and lat["floor_ratio"] > 0 and not lat["skipped"], lat.get("skipped")
assert [r["mode"] for r in lat["runs"]][:2] == ["target", "draft"], lat["runs"]
hs = json.loads((out / "host-syncs" / "results.json").read_text())
for d in (lat, st, hs):
    assert d["provenance"]["commit"] and "tf32" in d["provenance"], d.get("provenance")
assert [r["variant"] for r in hs["runs"]][:2] == ["before (eager)", "after (cuda_graphs)"], hs["runs"]
comp = json.loads((out / "compile" / "results.json").read_text())
assert comp["reused"] and "eager, cpp" not in comp["warmup_s"] and comp["warmup_s"]["compile, cpp"] > 0, comp["warmup_s"]
assert not [r for r in lat["runs"] if r["mode"] == "target" and r["run_ahead"]], "a target-only run-ahead run"
summary = json.loads((out / "summary.json").read_text())
assert all(s["status"] == "done" for s in summary["steps"].values()), summary["steps"]
for name, row in st["stages"].items():
    assert row["eager_s"] > 0 and row["compile_s"] > 0 and row["compile_max_abs_diff"] < 1e-3, (name, row)
print("compat_check: gpu_check.sh results are complete")
PYEOF
# the same interpreter and site as gpu_check.sh, with the extension it built in place
export PYTHONPATH=$PWD/.compat/sdvg-site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.compat/bin/python -c "import torch, transformers, sdvg._native as n; print('compat stack: torch', torch.__version__, '| transformers', transformers.__version__, '| sdvg._C', n._C.build_info())"
.compat/bin/python -m pytest -q -p no:cacheprovider tests "$@"
echo "compat_check: ok"
