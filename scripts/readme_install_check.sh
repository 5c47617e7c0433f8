#!/usr/bin/env bash
# CI: the README's install into an environment that already has torch, run as written:
#   pip install -r requirements.txt
#   pip install --no-build-isolation .
# in the venv whose interpreter is $1 (default .compat/bin/python: scripts/compat_check.sh's torch 2.11
# stack, so this runs after it). Checks that pip's dry run would install no torch, that the torch
# version (and every other package that was there) is unchanged afterwards, and that the installed
# sdvg imports its own sdvg._C, built against that torch, from outside the checkout. Then it removes
# what it added (sdvg and any new package), so the venv is left as it was.
# SDVG_CUDA: passed to the build; unset by default, as a user runs the README (auto: the CUDA build only
# where a GPU is visible, so here the CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.compat/bin/python}
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
unset PYTHONPATH
quiet_pip() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip freeze --all > "$work/before.txt"
torch_before=$("$PY" -c "import torch; print(torch.__version__)")
echo "readme_install_check: $("$PY" -V), torch $torch_before, in $(dirname "$(dirname "$PY")")"

quiet_pip "$PY" -m pip install --dry-run -r requirements.txt > "$work/dry-run.txt"
if grep -E "^Would install" "$work/dry-run.txt" | grep -qiE "(^| )(torch|torchvision|triton)-[0-9]"; then
  echo "readme_install_check: pip would replace torch:"; grep -E "^Would install" "$work/dry-run.txt"; exit 1
fi

quiet_pip "$PY" -m pip install -q -r requirements.txt
quiet_pip "$PY" -m pip install -q --no-build-isolation .
"$PY" -m pip freeze --all > "$work/after.txt"

# from outside the checkout, so that the installed package is the one imported
(cd "$work" && "$PY" - "$torch_before" <<'PYEOF'
import sys
import torch
import sdvg
import sdvg._native as native
assert torch.__version__ == sys.argv[1], f"torch changed: {sys.argv[1]} -> {torch.__version__}"
assert "site-packages" in sdvg.__file__, f"imported the checkout, not the installed sdvg: {sdvg.__file__}"
print("readme_install_check: installed", sdvg.__file__, "| torch", torch.__version__, "| sdvg._C",
      native._C.build_info())
PYEOF
)

added=$("$PY" - "$work/before.txt" "$work/after.txt" <<'PYEOF'
import re
import sys


def read(path):
    out = {}
    for line in open(path):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, version = re.split(r"\s*(==| @ )\s*", line, maxsplit=1) if re.search(r"==| @ ", line) else (line, "", "")
        out[name.lower().replace("_", "-")] = version
    return out


before, after = read(sys.argv[1]), read(sys.argv[2])
changed = [f"{n}: {before[n]} -> {after.get(n, 'removed')}" for n in before if after.get(n) != before[n]]
if changed:
    sys.exit("readme_install_check: the README route changed installed packages: " + "; ".join(changed))
print(" ".join(n for n in after if n not in before))
PYEOF
)
echo "readme_install_check: added: $added"
case " $added " in *" sdvg "*) ;; *) echo "readme_install_check: sdvg was not installed"; exit 1;; esac
quiet_pip "$PY" -m pip uninstall -q -y $added
echo "readme_install_check: ok (torch $torch_before kept; the venv is back as it was)"
