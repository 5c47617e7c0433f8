#!/usr/bin/env bash
# sdvg's ported ImageReward scorer against the image-reward package itself. The package runs only on
# transformers <= 4.55.4, so it lives in an environment of its own, .oracle/ (ignored by git), pinned by
# scripts/reward-oracle-requirements.txt and never part of the runtime stack. There it writes small
# random ImageReward weights in the package's format, frames and the package's scores
# (scripts/reward_oracle.py -> .oracle/out/); then tests/test_reward_oracle.py scores the same files with
# sdvg in the runtime environment (.venv, from scripts/setup.sh) and requires max |diff| <= 5e-4.
# SIZE=real uses ImageReward's real ViT-L/16 and BERT-base sizes (about 2 GB of weights; slower).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-.oracle/out}
# pip warns about each of this machine's local index folders that lacks a package; keep errors only
quiet_pip() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
[ -x .venv/bin/python ] || { echo "reward_oracle: no .venv; run bash scripts/setup.sh first"; exit 1; }
t0=$(date +%s)
[ -x .oracle/bin/python ] || "$PY" -m venv .oracle
quiet_pip .oracle/bin/python -m pip install -q -r scripts/reward-oracle-requirements.txt
t1=$(date +%s)
echo "reward_oracle: environment ready in $(( t1 - t0 )) s ($(.oracle/bin/python -c 'import importlib.metadata as m; print("image-reward", m.version("image-reward"), "| transformers", m.version("transformers"))'))"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rm -rf "$OUT"
PYTHONPATH=$PWD .oracle/bin/python -W ignore scripts/reward_oracle.py --out "$OUT" --size "${SIZE:-tiny}"
t2=$(date +%s)
SDVG_REWARD_ORACLE=$OUT/scores.json .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/test_reward_oracle.py \
  | grep -v "^$"
echo "reward_oracle: ok (package scores $(( t2 - t1 )) s, comparison $(( $(date +%s) - t2 )) s, total $(( $(date +%s) - t0 )) s)"
