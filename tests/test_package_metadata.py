"""The package's metadata as pip and an index see it: built by setuptools' PEP 517 hook from a copy of
setup.py, pyproject.toml, the README, LICENSE and the package root (no compile), then read back."""
import re
import shutil
import subprocess
import sys
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def metadata(tmp_path_factory):
    """METADATA of the wheel `pip install .` would build, as an email message."""
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    (src / "sdvg").mkdir()
    shutil.copy(ROOT / "sdvg" / "__init__.py", src / "sdvg" / "__init__.py")
    out = tmp_path_factory.mktemp("meta")
    code = ("import sys\nfrom setuptools import build_meta\n"
            "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "SDVG_CUDA": "0", "HOME": str(src)})
    assert r.returncode == 0, r.stderr[-3000:]
    dist_info = out / r.stdout.strip().splitlines()[-1]
    return Parser().parsestr((dist_info / "METADATA").read_text(encoding="utf-8")), dist_info


def _setup_extras() -> set[str]:
    text = (ROOT / "setup.py").read_text(encoding="utf-8")
    block = text.split("extras_require={", 1)[1].split("\n    },", 1)[0]
    return set(re.findall(r'^\s+"([\w-]+)": \[', block, flags=re.M))


def _readme_extras() -> set[str]:
    """The first column of the README's extras table."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("| extra | what it adds | for |", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"^\| `([\w-]+)` \|", table, flags=re.M))


def test_the_license_is_apache_2_and_ships_with_the_package(metadata):
    meta, dist_info = metadata
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert (meta.get("License-Expression") or meta.get("License")) == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert (dist_info / "licenses" / "LICENSE").read_text(encoding="utf-8") == text


def test_metadata_says_what_sdvg_is(metadata):
    import sdvg

    meta, _ = metadata
    assert meta["Name"] == "sdvg" and meta["Version"] == sdvg.__version__  # one version: sdvg/__init__.py's
    assert meta["Summary"] == "Speculative decoding for block-autoregressive video diffusion"
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().startswith("# sdvg")  # the README is the long description
    classifiers = meta.get_all("Classifier")
    assert "Programming Language :: Python :: 3.12" in classifiers and "Environment :: GPU :: NVIDIA CUDA" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # the licence is the SPDX expression
    assert meta["Requires-Python"] == ">=3.10"


def test_every_extra_is_named_in_the_readme(metadata):
    meta, _ = metadata
    provided = set(meta.get_all("Provides-Extra"))
    assert provided == _setup_extras()
    assert _readme_extras() == provided, "README.md's extras table and setup.py's extras_require differ"
    requires = meta.get_all("Requires-Dist")
    assert 'torchao==0.18.0; extra == "fp8"' in requires and any(r.startswith("fastapi") and 'extra == "serve"' in r
                                                                 for r in requires)
