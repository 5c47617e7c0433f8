#!/usr/bin/env bash
# Side by side, alternating: two checkouts of sdvg (each with its sdvg._C built in place:
# `python setup.py build_ext --inplace`), target-only, SDVG at 73.1% and SDVG run-ahead on cpu-bench, twice each.
#   OLD=/path/to/old-checkout NEW=$PWD OUT=/tmp/ab PY=$PWD/.venv/bin/python bash results/latency-cpu-ab/ab.sh
set -euo pipefail
mkdir -p "$OUT"
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then d="$OLD"; else d="$NEW"; fi
    (cd "$d" && PYTHONPATH="$d" HF_HUB_OFFLINE=1 "$PY" benchmarks/latency.py --preset cpu-bench --rates 0.731 \
       --variants run-ahead --repeats 1 --out "$OUT/$v$i" > "$OUT/$v$i.log" 2>&1)
    echo "$v$i $(date +%T)"
  done
done
