#!/usr/bin/env bash
# The test suite: C++ unit tests (ctest) and the Python tests (pytest), offline, CPU.
#   scripts/test.sh            the whole suite, as CI runs it
#   scripts/test.sh --fast     the fast tier: pytest without the `slow` tests (whole videos, sweeps,
#                              exports), no C++ build, on 2 pytest-xdist workers (-n 2; the lock has it);
#                              under 3 minutes on 2 cores (134 s quiet, 229 s on one worker)
# Further arguments go to pytest (e.g. scripts/test.sh --fast tests/test_options.py -x).
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [[ "${1:-}" == "--fast" ]]; then
    fast=1
    shift
fi
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if (( fast )); then
    # two workers (each test process sets 2 torch threads; much of the tier waits on sockets and child processes)
    exec python -m pytest -q -m "not slow" -n "${SDVG_TEST_WORKERS:-2}" "$@"  # no path given: tests/ (testpaths)
fi
cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release -DSDVG_WITH_TORCH=ON >/dev/null
cmake --build build/cmake -j2 >/dev/null
ctest --test-dir build/cmake --output-on-failure
python -m pytest -q tests "$@"
