#!/usr/bin/env bash
# One-command GPU check on a bare GPU machine that has torch (>= 2.11) but none of sdvg's other
# dependencies: installs the wheels shipped in .whl/ (see benchmarks/README.md for how to fill it),
# builds sdvg._C with CUDA, runs the GPU tests, then the real-size latency benchmark.
# Everything lands in $OUT (default results/gpu-<date>), at most 8 files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu-$(date -u +%Y%m%d)}
BLOCKS=${BLOCKS:-9}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sdvg-site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/sdvg-site:$PWD
else
  export PYTHONPATH=$PWD
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
t0=$(date +%s)
SDVG_CUDA=1 "$PY" setup.py build_ext --inplace -j 16 > "$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
echo "extension built in $(( $(date +%s) - t0 )) s"
"$PY" - > "$OUT/env.json" <<'PYEOF'
import json, platform, torch, diffusers, transformers
import sdvg._native
from sdvg._native import _C
print(json.dumps({"gpu": torch.cuda.get_device_name(0), "capability": torch.cuda.get_device_capability(0),
                  "torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": diffusers.__version__,
                  "transformers": transformers.__version__, "python": platform.python_version(),
                  "sdvg_C": _C.build_info()}, indent=2))
PYEOF
cat "$OUT/env.json"
"$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kv_cache.py tests/test_dit.py tests/test_scheduler.py \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -5
PYTHONUNBUFFERED=1 timeout "${LATENCY_TIMEOUT:-330}" "$PY" benchmarks/latency.py --preset "${PRESET:-real-size}" \
  --device "${DEVICE:-cuda:0}" --num-blocks "$BLOCKS" --repeats "${REPEATS:-1}" --variants "${VARIANTS:-run-ahead}" \
  --out "$OUT" 2>&1 | grep -v pkg_resources | tail -20
rm -f "$OUT/results.csv"  # derivable from results.json; keeps $OUT within 8 files
PYTHONUNBUFFERED=1 timeout "${STAGES_TIMEOUT:-150}" "$PY" benchmarks/stages.py --preset "${PRESET:-real-size}" \
  --device "${DEVICE:-cuda:0}" --repeats 5 --out "$OUT" 2>&1 | grep -v pkg_resources | tail -8
echo "total $(( $(date +%s) - t0 )) s"
