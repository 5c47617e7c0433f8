#!/usr/bin/env bash
# The test suite: C++ unit tests (ctest) and the Python tests (pytest), offline, CPU.
#   scripts/test.sh            the whole suite, as CI runs it
#   scripts/test.sh --fast     the fast tier: pytest without the `slow` tests (whole videos, sweeps,
#                              exports), no C++ build; under 3 minutes on 2 cores
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
    exec python -m pytest -q -m "not slow" "$@"  # no path given: tests/ (pyproject testpaths)
fi
cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release -DSDVG_WITH_TORCH=ON >/dev/null
cmake --build build/cmake -j2 >/dev/null
ctest --test-dir build/cmake --output-on-failure
python -m pytest -q tests "$@"
