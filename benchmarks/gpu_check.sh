#!/usr/bin/env bash
# One-command GPU check on a bare GPU machine with torch (>= 2.11) and none of sdvg's other
# dependencies, sized for one short device session (15 minutes of device time in all, at most 8
# files returned):
#   0. the carried wheels (.whl/, benchmarks/gpu-wheels.txt) are checked first: one missing stops
#      the check before anything is built (NO_WHEELS=1: the interpreter already has them);
#   1. installs them, builds sdvg._C with CUDA (CUDA_HOME from the nvcc found; without one, or when
#      that build fails, the CPU build, and the reason is recorded; SKIP_BUILD=1 uses the one in place);
#   2. runs the GPU tests (tests/test_gpu.py, TESTS_S);
#   3. benchmarks/gpu_check.py in ONE process: the models are built once, then the eager baseline
#      (target-only, SDVG at 73.1%, draft-only) and each variant against it: compile (its warm-up, the
#      compilation, in its own box; persistent inductor cache), fp8 (quantization, quality gate),
#      fp8 + compile (its own warm-up box), the FP8 quality gate, a kernel-class profile of each variant,
#      the drafter's CUDA graphs, 4 live sessions batched against one after another; every step in its own
#      time box (EAGER_S, COMPILE_WARMUP_S, COMPILE_S, FP8_S, FP8_COMPILE_WARMUP_S, FP8_COMPILE_S, FP8_QUALITY_S,
#      PROFILE_S, GRAPHS_S, SESSIONS_S; STEPS picks steps).
# Everything it writes goes to a work folder, packed at the end (also when a step fails or time runs
# out) into $OUT/results.tar.gz; $OUT/summary.log is this script's own output and $OUT/summary.md the
# table of every variant against the eager baseline. Nothing else is left in $OUT (default
# results/gpu-<date>): 3 files, and inductor-cache.tar.gz when something compiled (a cache, not a result:
# git-ignored; the next check carries it as .inductor-cache.tar.gz and starts warm). SDVG_COMMIT: the commit the tree was copied from (provenance; a copy
# without its .git cannot tell).
#   bash benchmarks/gpu_check.sh --dry-run   # the plan with a time estimate per step; runs nothing
# On the CPU: PRESET=tiny DEVICE=cpu (scripts/compat_check.sh does it, with longer boxes).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run]  (settings are environment variables)"; exit 2 ;;
esac
OUT=${OUT:-results/gpu-$(date -u +%Y%m%d)}
BLOCKS=${BLOCKS:-9}
PRESET=${PRESET:-real-size}
DEVICE=${DEVICE:-cuda:0}
PY=${PYTHON:-python3}
SITE_DIR=${SITE_DIR:-/tmp/sdvg-site}
WHEEL_DIR=${WHEEL_DIR:-.whl}
STEPS=${STEPS:-eager,compile_warmup,compile,fp8,fp8_compile_warmup,fp8_compile,fp8_quality,profile,graphs,sessions}
TESTS_S=${TESTS_S:-45}
SESSION_S=${SESSION_S:-900}   # device time of one session, every start and call included
START_S=${START_S:-150}       # a machine's start (estimate)
EXT_S=${EXT_S:-60}            # building sdvg._C with nvcc -j16 (50 s measured; a warm machine keeps the build: EXT_RERUN_S)
EXT_RERUN_S=${EXT_RERUN_S:-20}
INSTALL_S=15; PACK_S=10
TOTAL_S=${TOTAL_S:-}          # a hard end for the whole run (the device call's limit): every step ends in time to pack
TESTS_K=${TESTS_K:-}          # pytest -k expression for the GPU tests (default: all of tests/test_gpu.py)
T_START=$(date +%s)
export TORCHINDUCTOR_CACHE_DIR=${INDUCTOR_CACHE:-$PWD/.inductor-cache}  # persistent: reruns reuse compiled kernels
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
# The inductor cache travels between sessions (each starts a bare machine): the run leaves it in
# $OUT/inductor-cache.tar.gz (CACHE_OUT=0: not; only when at most CACHE_MAX_MB, the device tool's per-file limit
# being 16 MiB); copied to CACHE_TAR (.inductor-cache.tar.gz, git-ignored) and carried, it is unpacked into the
# cache folder before anything compiles, and the compile warm-ups get their warm boxes.
CACHE_TAR=${CACHE_TAR:-.inductor-cache.tar.gz}
CACHE_MAX_MB=${CACHE_MAX_MB:-15}
cache_state=cold  # a dry run plans a device session: only a carried CACHE_TAR travels there
if [ -s "$CACHE_TAR" ] || { [ "$DRY" = 0 ] && [ -n "$(ls -A "$TORCHINDUCTOR_CACHE_DIR" 2>/dev/null)" ]; }; then
  cache_state=warm
fi

# ------------------------------------------------------------------ the wheels that must travel
missing=()
while read -r req; do
  name=${req%%==*}; version=${req#*==}
  ls "$WHEEL_DIR/${name//-/_}-${version}-"*.whl >/dev/null 2>&1 || missing+=("$req")
done < <(grep -v '^#' benchmarks/gpu-wheels.txt | grep .)
[ "${NO_WHEELS:-0}" = 1 ] && missing=()

# ------------------------------------------------------------------ the plan
plan=$(PYTHONPATH=$PWD "$PY" benchmarks/gpu_check.py --dry-run --preset "$PRESET" --steps "$STEPS" --cache "$cache_state" \
  --work /nonexistent)
[ -n "$plan" ] || { echo "gpu_check.py --dry-run failed (PYTHON=$PY)"; exit 2; }
boxes=$(echo "$plan" | awk '{s += $2} END {print s}')   # models + every step's box
# a rerun on the warm machine starts from the cache the run left: the warm boxes
rerun_boxes=$(PYTHONPATH=$PWD "$PY" benchmarks/gpu_check.py --dry-run --preset "$PRESET" --steps "$STEPS" --cache warm \
  --work /nonexistent | awk '{s += $2} END {print s}')
build=$EXT_S; [ "${SKIP_BUILD:-0}" = 1 ] && build=0
run_s=$(( INSTALL_S + build + TESTS_S + boxes + PACK_S ))
rerun_s=$(( INSTALL_S + (build < EXT_RERUN_S ? build : EXT_RERUN_S) + TESTS_S + rerun_boxes + PACK_S ))
need=$(( START_S + run_s + rerun_s ))
if [ "$need" -le "$SESSION_S" ]; then
  verdict="a rerun fits: start ${START_S} + run ${run_s} + rerun on the warm machine ${rerun_s} = ${need} s <= ${SESSION_S} s"
else
  verdict="a rerun does NOT fit: start ${START_S} + run ${run_s} + rerun on the warm machine ${rerun_s} = ${need} s > ${SESSION_S} s (lower the boxes or STEPS for a rerun)"
fi
header="gpu_check: $PRESET on $DEVICE, $BLOCKS blocks; one run ~${run_s} s of device time (+ ${START_S} s to start a machine); $verdict"
if [ "$cache_state" = warm ]; then
  cache_line="inductor cache: warm ($( [ -s "$CACHE_TAR" ] && echo "$CACHE_TAR, unpacked into $TORCHINDUCTOR_CACHE_DIR" || echo "$TORCHINDUCTOR_CACHE_DIR")): the compile warm-ups' warm boxes"
else
  cache_line="inductor cache: cold (no $CACHE_TAR carried$( [ "$DRY" = 0 ] && echo ", $TORCHINDUCTOR_CACHE_DIR empty")): the compile warm-ups' cold boxes; the run leaves $OUT/inductor-cache.tar.gz for the next check to carry as $CACHE_TAR"
fi

if [ "$DRY" = 1 ]; then
  echo "$header"
  echo "$cache_line"
  echo "steps (estimates and time boxes, s):"
  printf '  %-19s %5d s  %s\n' wheels "$INSTALL_S" "check ${WHEEL_DIR}/ then pip install --target $SITE_DIR$( [ ${#missing[@]} -gt 0 ] && echo " — MISSING: ${missing[*]}: the run would stop here")"
  printf '  %-19s %5d s  %s\n' extension "$build" "setup.py build_ext (CUDA when nvcc is found)$( [ "${SKIP_BUILD:-0}" = 1 ] && echo ': skipped, SKIP_BUILD=1')"
  printf '  %-19s %5d s  %s\n' gpu-tests "$TESTS_S" "pytest tests/test_gpu.py (TESTS_S)"
  echo "$plan"
  printf '  %-19s %5d s  %s\n' pack "$PACK_S" "tar the work folder into $OUT/results.tar.gz; $OUT/summary.log, $OUT/summary.md"
  echo "(dry run: nothing installed, built or measured)"
  exit 0
fi

mkdir -p "$OUT"
rm -f "$OUT/results.tar.gz" "$OUT/summary.log" "$OUT/summary.md" "$OUT/inductor-cache.tar.gz"
exec > >(tee "$OUT/summary.log") 2>&1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/sdvg-gpu-check.XXXXXX")
pack_cache() {  # the inductor cache, for the next check to carry (not a result: git-ignored)
  [ "${CACHE_OUT:-1}" = 1 ] && [ -n "$(ls -A "$TORCHINDUCTOR_CACHE_DIR" 2>/dev/null)" ] || return 0
  tar -czf "$OUT/inductor-cache.tar.gz" -C "$TORCHINDUCTOR_CACHE_DIR" . 2>/dev/null || { rm -f "$OUT/inductor-cache.tar.gz"; return 0; }
  local mb=$(( ($(stat -c %s "$OUT/inductor-cache.tar.gz") + 1048575) / 1048576 ))
  if [ "$mb" -gt "$CACHE_MAX_MB" ]; then
    rm -f "$OUT/inductor-cache.tar.gz"; echo "inductor cache: ${mb} MiB packed, over CACHE_MAX_MB=${CACHE_MAX_MB}: not kept"
  else
    echo "inductor cache: $OUT/inductor-cache.tar.gz (${mb} MiB): carry it as $CACHE_TAR next time"
  fi
}
pack() {
  pack_cache
  [ -f "$WORK/summary.md" ] && cp "$WORK/summary.md" "$OUT/summary.md"
  tar -czf "$OUT/results.tar.gz" -C "$WORK" . && rm -rf "$WORK"
  echo "packed: $OUT/results.tar.gz ($(du -h "$OUT/results.tar.gz" | cut -f1)), $OUT/summary.log, $OUT/summary.md"
}
trap pack EXIT
echo "$header"
if [ -s "$CACHE_TAR" ]; then  # a carried cache: unpacked before anything compiles
  mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && tar -xzf "$CACHE_TAR" -C "$TORCHINDUCTOR_CACHE_DIR" \
    || { cache_line="inductor cache: $CACHE_TAR could not be unpacked (a cold start)"; }
fi
echo "$cache_line"
if [ ${#missing[@]} -gt 0 ]; then
  echo "error: the carried wheels are missing from ${WHEEL_DIR}/: ${missing[*]} (benchmarks/gpu-wheels.txt); fill it with"
  echo "  bash scripts/fetch_wheels.sh   and carry it (the device tool's carry: [\".whl\"]), or NO_WHEELS=1 when $PY has them"
  exit 2
fi
if [ "${NO_WHEELS:-0}" != 1 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE_DIR" "$WHEEL_DIR"/*.whl \
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
skip_build=${SKIP_BUILD:-0}
if [ "$skip_build" = 1 ] && ! "$PY" -c "import torch, sdvg._native" > "$WORK/build.log" 2>&1; then
  skip_build=0  # the extension in place (carried, or built for another torch) does not load here: build it
  echo "SKIP_BUILD=1 but sdvg._C does not load here (build.log): building it" | tee -a "$WORK/build.log"
fi
if [ "$skip_build" = 1 ]; then
  note="sdvg._C as it was (SKIP_BUILD=1): $("$PY" -c "import sdvg._native as n; print(n._C.build_info())" 2>&1 | tail -1)"
elif ! SDVG_CUDA=$want_cuda "$PY" setup.py build_ext --inplace -j 16 > "$WORK/build.log" 2>&1; then
  if [ "$want_cuda" = 1 ]; then
    note="the CUDA build failed (CUDA_HOME=${CUDA_HOME:-}; see build.log): CPU build of sdvg._C; test_native_cache_on_cuda fails"
    SDVG_CUDA=0 "$PY" setup.py build_ext --inplace -j 16 >> "$WORK/build.log" 2>&1 \
      || { echo "build failed"; tail -30 "$WORK/build.log"; exit 1; }
  else
    echo "build failed"; tail -30 "$WORK/build.log"; exit 1
  fi
fi
export SDVG_BUILD_NOTE=$note
echo "extension built in $(( $(date +%s) - t_build )) s: $note"
"$PY" - "$DEVICE" > "$WORK/env.json" <<'PYEOF'
import json, sys
sys.path.insert(0, "benchmarks")
import diffusers, transformers
from provenance import provenance
print(json.dumps({**provenance(device=sys.argv[1]), "diffusers": diffusers.__version__,
                  "transformers": transformers.__version__}, indent=2))
PYEOF
head -c 2000 "$WORK/env.json"; echo

tests_s=$TESTS_S  # 0: no GPU tests
[ -n "$TOTAL_S" ] && tests_s=$(( tests_s < T_START + TOTAL_S - $(date +%s) - PACK_S - 60 ? tests_s : T_START + TOTAL_S - $(date +%s) - PACK_S - 60 ))
[ "$tests_s" -lt 1 ] && tests_s=1
if [ "$TESTS_S" = 0 ]; then
  echo "GPU tests skipped (TESTS_S=0)" > "$WORK/gpu_tests.log"; rc=0
else
  timeout "$tests_s" "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py ${TESTS_K:+-k "$TESTS_K"} > "$WORK/gpu_tests.log" 2>&1
  rc=$?
fi
[ "$rc" = 124 ] && echo "GPU tests stopped at their $tests_s s limit (TESTS_S, TOTAL_S)" >> "$WORK/gpu_tests.log"
tail -5 "$WORK/gpu_tests.log"

# the measurements: one process, the models built once; each step ends within its box
t0=$(date +%s)
deadline=$(( t0 + boxes + 30 ))
limit=$(( boxes + 120 ))
if [ -n "$TOTAL_S" ]; then  # the steps end by the run's hard end, less the packing
  end=$(( T_START + TOTAL_S - PACK_S - 5 ))
  deadline=$(( deadline < end - 25 ? deadline : end - 25 )); limit=$(( end - t0 > 1 ? end - t0 : 1 ))
fi
PYTHONUNBUFFERED=1 timeout "$limit" "$PY" benchmarks/gpu_check.py --preset "$PRESET" --device "$DEVICE" \
  --num-blocks "$BLOCKS" --repeats "${REPEATS:-1}" --steps "$STEPS" --deadline "$deadline" --work "$WORK" \
  --cache "$cache_state" \
  > "$WORK/gpu_check.log" 2>&1
rc=$?
grep -E "^\[|models built|speed-up|SDVG at" "$WORK/gpu_check.log" | tail -40
[ "$rc" = 0 ] || { echo "gpu_check.py exited $rc; its log:"; tail -30 "$WORK/gpu_check.log"; }
find "$WORK" -name results.csv -delete  # derivable from results.json
echo "measured for $(( $(date +%s) - t0 )) s after the build"
exit "$rc"
