#!/usr/bin/env bash
# Create .venv with the pinned stack (requirements-torch.txt, then the lock requirements-lock.txt) and
# build sdvg (with its native core) into it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -r requirements-torch.txt
python -m pip install -q -r requirements-lock.txt
python -m pip install -q --no-build-isolation --no-deps -e .
python -c "import torch, sdvg._C as C; print('sdvg._C built:', C.build_info())"
