#!/usr/bin/env bash
# Run sdvg on the GPU machine's stack, on the CPU: Python 3.12 (where installed), torch 2.11 (the
# oldest torch sdvg supports), numpy 2.5, the image's transformers 5 / huggingface-hub 1, with the
# wheels of benchmarks/gpu-wheels.txt on top exactly as benchmarks/gpu_check.sh installs them there. First
# gpu_check.sh itself with the tiny preset on the CPU (a failure there would have cost a GPU
# session): its dry run, then the run of every step (the compile ones with inductor on the CPU), which must
# leave 4 files in $OUT (a device session returns at most 8): its tarball holding every result, the summary log
# and table, and the inductor cache for the next check to carry; then
# the test suite (arguments go to pytest: CI
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
  TESTS_S=900 EAGER_S=600 COMPILE_WARMUP_S=900 COMPILE_S=600 FP8_S=600 FP8_COMPILE_WARMUP_S=900 FP8_COMPILE_S=600 \
  FP8_QUALITY_S=600 GRAPHS_S=300 PROFILE_S=900 SESSIONS_S=600 bash benchmarks/gpu_check.sh  # CPU: generous boxes; the check is what ran
# what a device session gets back: the tarball, the summary log and table, and the inductor cache the compile
# steps filled (for the next check to carry): 4 files
n=$(find "$ret" -mindepth 1 | wc -l)
[ "$n" -le 4 ] && [ -s "$ret/results.tar.gz" ] && [ -s "$ret/summary.log" ] && [ -s "$ret/summary.md" ] \
  && [ -s "$ret/inductor-cache.tar.gz" ] \
  || { echo "compat_check: gpu_check.sh left $n entries in \$OUT (4: results.tar.gz, summary.log, summary.md, inductor-cache.tar.gz)"; ls -la "$ret"; exit 1; }
out=$(mktemp -d)
tar -xzf "$ret/results.tar.gz" -C "$out"
for f in env.json gpu_tests.log eager/results.json eager/results.md eager/timeline.png compile_warmup.json \
    compile/results.json fp8.json fp8/results.json fp8-quality/results.json fp8_quality.json fp8_compile_warmup.json \
    fp8-compile/results.json graphs/results.json profile/results.json sessions/results.json summary.json summary.md; do
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
lat = json.loads((out / "eager" / "results.json").read_text())
assert lat["speedup_vs_target"] > 0 and lat["floor_ratio"] > 0 and not lat["skipped"], lat.get("skipped")
assert sorted(r["mode"] for r in lat["runs"]) == ["draft", "sdvg", "target"], lat["runs"]
assert lat["provenance"]["commit"] and "tf32" in lat["provenance"], lat["provenance"]
summary = json.loads((out / "summary.json").read_text())
assert all(s["status"] == "done" for s in summary["steps"].values()), summary["steps"]
# every variant measured target-only and SDVG at 73.1% (graphs: SDVG only) against the reused eager runs
rows = {v["variant"]: v for v in summary["variants"]}
assert set(rows) == {"eager", "compile", "eager + fp8", "compile + fp8", "eager + cuda_graphs"}, rows
for name, row in rows.items():
    assert row["sdvg_s"] > 0 and (name == "eager + cuda_graphs" or row["target_s"] > 0), row
for name in ("compile", "fp8-compile"):
    comp = json.loads((out / name / "results.json").read_text())
    assert comp["reused"] and "eager, cpp" not in comp["warmup_s"], comp["warmup_s"]
    # compiled in its warm-up step: the measured runs compiled nothing
    assert all(r["compile"]["graphs"] == 0 for r in comp["runs"] if r["backend"] == "compile"), comp["runs"]
for name in ("compile_warmup", "fp8_compile_warmup"):
    w = json.loads((out / f"{name}.json").read_text())
    assert w["compile"]["graphs"] > 0 and w["compile"]["compile_s"] > 0, w
fp8 = json.loads((out / "fp8.json").read_text())
assert fp8["quantize_s"] > 0 and set(fp8["impl"]) == {"drafter", "target"}, fp8
assert json.loads((out / "fp8_quality.json").read_text())["passed"], "the FP8 quality gate failed"
prof = json.loads((out / "profile" / "results.json").read_text())
assert {p["variant"] for p in prof["runs"]} == {"eager", "compile", "fp8", "fp8-compile"}, prof["runs"]  # graphs: after
assert all("error" not in p and p["device_s"] > 0 for p in prof["runs"]), prof["runs"]
print("compat_check: gpu_check.sh results are complete")
PYEOF
# the same interpreter and site as gpu_check.sh, with the extension it built in place
export PYTHONPATH=$PWD/.compat/sdvg-site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.compat/bin/python -c "import torch, transformers, sdvg._native as n; print('compat stack: torch', torch.__version__, '| transformers', transformers.__version__, '| sdvg._C', n._C.build_info())"
.compat/bin/python -m pytest -q -p no:cacheprovider tests "$@"
echo "compat_check: ok"
