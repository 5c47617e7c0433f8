"""requirements.txt is sdvg's runtime requirements: ranges that keep an installed torch, every package sdvg
imports and nothing else, the same list as setup.py's install_requires. The exact development stack is
requirements-lock.txt, and it satisfies those ranges. (CI installs sdvg by the README's existing-torch
route into the torch 2.11 venv of scripts/compat_check.sh and checks that torch stays.)"""
import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name -> distribution name, where they differ
DISTRIBUTION = {"yaml": "pyyaml", "PIL": "pillow", "imageio_ffmpeg": "imageio-ffmpeg"}
# imported only behind an optional-import gate with an install hint (extras, evaluators, a psutil fallback)
OPTIONAL = {"tensorrt", "torch_tensorrt", "cuda", "onnx", "onnxruntime", "onnxscript", "pyiqa", "vbench", "psutil",
            "torchao"}  # torchao: the fp8 extra (sdvg/models/fp8.py falls back to torch._scaled_mm without it)
# the serve and serve-ray extras (setup.py): imported by sdvg/serve/ only, behind `sdvg serve`
SERVE_EXTRA = {"fastapi", "uvicorn", "websockets", "msgpack", "pydantic", "prometheus_client", "starlette", "ray",
               "multipart"}
OPTIONAL |= SERVE_EXTRA
DEV_AND_BUILD = {"pytest", "pytest-timeout", "setuptools", "pybind11", "ninja", "wheel", "onnx", "onnxruntime",
                 "onnxscript", "torchvision", "triton"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _lines(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith(("#", "-"))]


def _install_requires() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "INSTALL_REQUIRES":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no INSTALL_REQUIRES list")


def _imported_distributions() -> set[str]:
    """The third-party top-level modules that sdvg and build_engines import, as distribution names."""
    found = set()
    for folder in ("sdvg", "build_engines"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods = [node.module]
                else:
                    continue
                for mod in mods:
                    top = mod.split(".")[0]
                    if top in sys.stdlib_module_names or top in ("sdvg", "build_engines", "__future__"):
                        continue
                    found.add(top)
    return {_name(DISTRIBUTION.get(m, m)) for m in found - OPTIONAL}


def test_requirements_txt_is_install_requires():
    assert _lines(ROOT / "requirements.txt") == _install_requires()


def test_runtime_requirements_are_ranges_that_keep_torch():
    reqs = _lines(ROOT / "requirements.txt")
    assert not [r for r in reqs if "==" in r or "===" in r], "requirements.txt pins; pins belong in requirements-lock.txt"
    names = {_name(r) for r in reqs}
    assert not names & DEV_AND_BUILD, names & DEV_AND_BUILD
    torch = [r for r in reqs if _name(r) == "torch"]
    assert torch == ["torch>=2.11"], torch  # a lower bound only: any installed torch >= 2.11 satisfies it


def test_every_imported_package_is_declared_and_nothing_else():
    declared = {_name(r) for r in _lines(ROOT / "requirements.txt")}
    imported = _imported_distributions()
    assert imported - declared == set(), f"imported but not in requirements.txt: {sorted(imported - declared)}"
    assert declared - imported == set(), f"declared but never imported: {sorted(declared - imported)}"


def test_the_lock_pins_everything_and_satisfies_the_ranges():
    specifiers = pytest.importorskip("packaging.specifiers")
    lock = {}
    for line in _lines(ROOT / "requirements-lock.txt"):
        name, sep, version = line.partition("==")
        assert sep, f"requirements-lock.txt: {line!r} is not pinned"
        lock[_name(name)] = version
    assert lock["torch"] == (ROOT / "requirements-torch.txt").read_text().split("torch==")[1].split()[0]
    for req in _lines(ROOT / "requirements.txt"):
        name = _name(req)
        spec = specifiers.SpecifierSet(req[len(re.match(r"[A-Za-z0-9_.\-]+", req).group(0)):])
        assert name in lock, f"{name} is a runtime requirement the lock does not pin"
        assert lock[name] in spec, f"the lock's {name}=={lock[name]} is outside requirements.txt's {spec}"


def test_eval_requirements_pin_one_opencv():
    names = {_name(r) for r in _lines(ROOT / "requirements-eval.txt")}
    assert len(names & {"opencv-python", "opencv-python-headless"}) == 1
    assert "-c requirements-lock.txt" in (ROOT / "requirements-eval.txt").read_text()
