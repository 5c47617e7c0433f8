#!/usr/bin/env bash
# One-command GPU check on a bare GPU machine with torch (>= 2.11) and none of sdvg's other
# dependencies: installs the wheels shipped in .whl/ (benchmarks/README.md), builds sdvg._C with
# CUDA (CUDA_HOME from the nvcc found; without one, or when that build fails, the CPU build, and
# the reason is recorded), runs the GPU tests (tests/test_gpu.py only), then measures, most
# important first, each writing its files as it finishes:
#   1. latency.py: target-only -> SDVG at 73.1% (pattern router) -> run-ahead -> compile -> the rest
#      (results.json / results.md / timeline.png / speedup.png, rewritten after every run);
#   2. host_syncs.py: the drafter lane before/after cuda_graphs, then stage_timing events, then fast_vae
#      (results written after each), launches and syncs counted, timed
#      (host-syncs/results.json, .md);
#   3. stages.py: per-stage eager vs compile (stages.json).
# Everything lands in $OUT (default results/gpu-<date>); the measurements end within TOTAL_S seconds
# (default 300) of the end of the build, so a rerun still fits one 15-minute lease. Every results
# file carries provenance (commit, build info, CUDA versions, seed, prompt, TF32 flags).
# Dry run on the CPU: PRESET=tiny DEVICE=cpu (scripts/compat_check.sh does it, with longer limits).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu-$(date -u +%Y%m%d)}
BLOCKS=${BLOCKS:-9}
PRESET=${PRESET:-real-size}
DEVICE=${DEVICE:-cuda:0}
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
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}

# CUDA_HOME: the toolkit of the nvcc on PATH (or under /usr/local/cuda*), unless given
if [ -z "${CUDA_HOME:-}" ]; then
  nvcc=$(command -v nvcc || ls -d /usr/local/cuda*/bin/nvcc 2>/dev/null | sort -V | tail -1 || true)
  if [ -n "$nvcc" ]; then  # nvcc's own TOP (a wrapper script's target too), else the folder above its bin/
    top=$("$nvcc" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
    CUDA_HOME=$(readlink -f "${top:-$(dirname "$(readlink -f "$nvcc")")/..}")
  fi
fi
want_cuda=${SDVG_CUDA:-1}
note="CUDA build with CUDA_HOME=${CUDA_HOME:-}"
if [ "$want_cuda" = 1 ] && [ ! -x "${CUDA_HOME:-/nonexistent}/bin/nvcc" ]; then
  want_cuda=0; note="no nvcc found (PATH, /usr/local/cuda*): CPU build of sdvg._C; test_native_cache_on_cuda fails"
fi
[ "$want_cuda" = 0 ] && [ "${SDVG_CUDA:-1}" = 0 ] && note="CPU build of sdvg._C (SDVG_CUDA=0 asked)"
[ -n "${CUDA_HOME:-}" ] && export CUDA_HOME
t_build=$(date +%s)
if ! SDVG_CUDA=$want_cuda "$PY" setup.py build_ext --inplace -j 16 > "$OUT/build.log" 2>&1; then
  if [ "$want_cuda" = 1 ]; then
    note="the CUDA build failed (CUDA_HOME=${CUDA_HOME:-}; see build.log): CPU build of sdvg._C; test_native_cache_on_cuda fails"
    SDVG_CUDA=0 "$PY" setup.py build_ext --inplace -j 16 >> "$OUT/build.log" 2>&1 \
      || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
  else
    echo "build failed"; tail -30 "$OUT/build.log"; exit 1
  fi
fi
export SDVG_BUILD_NOTE=$note
echo "extension built in $(( $(date +%s) - t_build )) s: $note"
t0=$(date +%s)
deadline=$(( t0 + ${TOTAL_S:-300} ))
"$PY" - "$DEVICE" > "$OUT/env.json" <<'PYEOF'
import json, sys
sys.path.insert(0, "benchmarks")
import diffusers, transformers
from provenance import provenance
print(json.dumps({**provenance(device=sys.argv[1]), "diffusers": diffusers.__version__,
                  "transformers": transformers.__version__}, indent=2))
PYEOF
cat "$OUT/env.json"

timeout "${TESTS_S:-60}" "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
[ "${PIPESTATUS[0]}" = 124 ] && echo "GPU tests stopped at their ${TESTS_S:-60} s limit (TESTS_S)" | tee -a "$OUT/gpu_tests.log"

# 1. latency: starts no run that would end past its deadline (measures in the order above and writes
# its files after each run); `timeout` is only the backstop. What is left goes to 2 and 3.
lat_deadline=$(( deadline - ${REST_S:-90} ))
lat_timeout=$(( lat_deadline - $(date +%s) + 30 )); [ "$lat_timeout" -lt 60 ] && lat_timeout=60
PYTHONUNBUFFERED=1 timeout "$lat_timeout" "$PY" benchmarks/latency.py --preset "$PRESET" --device "$DEVICE" \
  --num-blocks "$BLOCKS" --repeats "${REPEATS:-1}" --variants "${VARIANTS:-run-ahead,compile}" \
  --deadline "$lat_deadline" --out "$OUT" 2>&1 | tail -24
rm -f "$OUT/results.csv"  # derivable from results.json

# 2. the drafter lane without and with cuda_graphs, events, fast_vae (3 blocks)
left=$(( deadline - $(date +%s) ))
if [ "$left" -gt 40 ]; then
  PYTHONUNBUFFERED=1 timeout $(( left / 2 )) "$PY" benchmarks/host_syncs.py --preset "$PRESET" --device "$DEVICE" \
    --modes draft --num-blocks 3 --repeats "${REPEATS:-1}" --variants "${HS_VARIANTS:-eager,cuda_graphs,events,fast_vae}" \
    --out "$OUT/host-syncs" 2>&1 | tail -6
else
  echo "no time left for the host-sync benchmark"
fi

# 3. per-stage eager vs compile
left=$(( deadline - $(date +%s) ))
if [ "$left" -gt 20 ]; then
  PYTHONUNBUFFERED=1 timeout "$left" "$PY" benchmarks/stages.py --preset "$PRESET" \
    --device "$DEVICE" --repeats 5 --out "$OUT" 2>&1 | tail -8
else
  echo "no time left for the per-stage benchmark"
fi
echo "measured for $(( $(date +%s) - t0 )) s after the build"
