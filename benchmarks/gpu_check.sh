#!/usr/bin/env bash
# One-command GPU check on a bare GPU machine that has torch (>= 2.11) but none of sdvg's other
# dependencies: installs the wheels shipped in .whl/ (see benchmarks/README.md for how to fill it),
# builds sdvg._C with CUDA, runs the GPU tests, then the real-size latency benchmark.
# Everything lands in $OUT (default results/gpu-<date>), at most 8 files, within TOTAL_S seconds
# (default 510) of the start of the build.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu-$(date -u +%Y%m%d)}
BLOCKS=${BLOCKS:-9}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE_DIR=${SITE_DIR:-/tmp/sdvg-site}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE_DIR" .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=$SITE_DIR:$PWD
else
  export PYTHONPATH=$PWD
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
t0=$(date +%s)
deadline=$(( t0 + ${TOTAL_S:-510} ))  # the whole check ends by then (a device call may run 600 s)
SDVG_CUDA=${SDVG_CUDA:-1} "$PY" setup.py build_ext --inplace -j 16 > "$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
echo "extension built in $(( $(date +%s) - t0 )) s"
"$PY" - > "$OUT/env.json" <<'PYEOF'
import json, platform, torch, diffusers, transformers
import sdvg._native
from sdvg._native import _C
cuda = torch.cuda.is_available()
print(json.dumps({"gpu": torch.cuda.get_device_name(0) if cuda else None,
                  "capability": torch.cuda.get_device_capability(0) if cuda else None,
                  "torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": diffusers.__version__,
                  "transformers": transformers.__version__, "python": platform.python_version(),
                  "sdvg_C": _C.build_info()}, indent=2))
PYEOF
cat "$OUT/env.json"
timeout "${TESTS_S:-200}" "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kv_cache.py tests/test_dit.py tests/test_scheduler.py \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -5
[ "${PIPESTATUS[0]}" = 124 ] && echo "GPU tests stopped at their ${TESTS_S:-200} s limit (TESTS_S)" | tee -a "$OUT/gpu_tests.log"
# The latency benchmark starts no run that would end past its deadline (it measures the most
# important runs first and writes its files after each run); `timeout` is only the backstop.
# What is left after it goes to the per-stage benchmark, which also writes after each stage.
lat_deadline=$(( deadline - ${STAGES_S:-120} ))
lat_timeout=$(( lat_deadline - $(date +%s) + 60 )); [ "$lat_timeout" -lt 90 ] && lat_timeout=90
PYTHONUNBUFFERED=1 timeout "$lat_timeout" "$PY" benchmarks/latency.py --preset "${PRESET:-real-size}" \
  --device "${DEVICE:-cuda:0}" --num-blocks "$BLOCKS" --repeats "${REPEATS:-1}" --variants "${VARIANTS:-run-ahead}" \
  --deadline "$lat_deadline" --out "$OUT" 2>&1 | tail -24
rm -f "$OUT/results.csv"  # derivable from results.json; keeps $OUT within 8 files
left=$(( deadline - $(date +%s) ))
if [ "$left" -gt 30 ]; then
  PYTHONUNBUFFERED=1 timeout "$left" "$PY" benchmarks/stages.py --preset "${PRESET:-real-size}" \
    --device "${DEVICE:-cuda:0}" --repeats 5 --out "$OUT" 2>&1 | tail -8
else
  echo "no time left for the per-stage benchmark"
fi
echo "total $(( $(date +%s) - t0 )) s"
