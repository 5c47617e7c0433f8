#!/usr/bin/env bash
# The test suite: C++ unit tests (ctest) and the Python tests (pytest), offline, CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release -DSDVG_WITH_TORCH=ON >/dev/null
cmake --build build/cmake -j2 >/dev/null
ctest --test-dir build/cmake --output-on-failure
python -m pytest -q tests "$@"
