#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with the wheels in benchmarks/gpu-wheels.txt, for the GPU machine's
# Python (3.12, x86-64). Already downloaded wheels are kept. PYTHON: the interpreter whose pip
# downloads them; default .venv/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
# pip warns about each of this machine's local index folders that lacks a package; keep errors only
quiet_pip() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
grep -v '^#' benchmarks/gpu-wheels.txt | grep . | while read -r req; do
  quiet_pip "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$req"
done
ls .whl
