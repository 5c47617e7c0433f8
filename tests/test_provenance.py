"""The commit in the benchmarks' provenance is sdvg's own: git's only when the project root is a git checkout's
toplevel; a tree copied without its .git into a folder of another repository reports $SDVG_COMMIT or "unknown",
never that repository's HEAD."""
import importlib.util
import shutil
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def git(cwd: Path, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=sdvg", "-c", "user.email=sdvg@localhost", *args], cwd=cwd,
                          capture_output=True, text=True, check=True).stdout.strip()


def repository(folder: Path) -> str:
    """A git repository at `folder` with one commit of one file; its HEAD."""
    folder.mkdir(parents=True, exist_ok=True)
    git(folder, "init", "-q")
    (folder / "README.md").write_text("another project\n")
    git(folder, "add", "README.md")
    git(folder, "commit", "-q", "-m", "another project's commit")
    return git(folder, "rev-parse", "HEAD")


def load(path: Path):
    """A provenance.py imported from `path` (its ROOT is the folder above its benchmarks/)."""
    spec = importlib.util.spec_from_file_location(f"provenance_at_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def project_copy(root: Path):
    """This tree's benchmarks/provenance.py copied into a project tree at `root`, imported from there."""
    (root / "benchmarks").mkdir(parents=True)
    (root / "sdvg").mkdir()
    shutil.copy(ROOT / "benchmarks" / "provenance.py", root / "benchmarks" / "provenance.py")
    module = load(root / "benchmarks" / "provenance.py")
    assert module.ROOT == root.resolve()
    return module


def test_a_copy_inside_another_repository_is_not_that_repository(tmp_path, monkeypatch):
    other_head = repository(tmp_path / "outer")
    prov = project_copy(tmp_path / "outer" / "inner")
    monkeypatch.delenv("SDVG_COMMIT", raising=False)
    p = prov.provenance()
    assert p["commit"] != other_head, "the enclosing repository's HEAD was reported as sdvg's commit"
    assert (p["commit"], p["dirty"], p["commit_source"]) == ("unknown", None, None)
    monkeypatch.setenv("SDVG_COMMIT", "488ec13")
    p = prov.provenance()
    assert (p["commit"], p["dirty"], p["commit_source"]) == ("488ec13", None, "SDVG_COMMIT")
    assert "(from SDVG_COMMIT)" in prov.provenance_line({**p, "seed": 0, "prompt": "p"})


def test_a_checkout_reports_its_own_head(tmp_path, monkeypatch):
    repository(tmp_path / "project")
    prov = project_copy(tmp_path / "project")
    git(tmp_path / "project", "add", "benchmarks/provenance.py")
    git(tmp_path / "project", "commit", "-q", "-m", "provenance")
    head = git(tmp_path / "project", "rev-parse", "HEAD")
    monkeypatch.delenv("SDVG_COMMIT", raising=False)
    assert prov.commit_of() == {"commit": head, "dirty": False, "commit_source": "git"}
    (tmp_path / "project" / "README.md").write_text("changed\n")
    assert prov.commit_of()["dirty"] is True
    # the caller's word wins: a copied tree may carry a stale .git (git's HEAD is kept beside it)
    monkeypatch.setenv("SDVG_COMMIT", "e139029")
    assert prov.commit_of() == {"commit": "e139029", "dirty": None, "commit_source": "SDVG_COMMIT", "git_head": head}


def test_this_checkout_reports_its_head():
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True)
    if top.returncode or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip("this tree is not a git checkout of its own")
    p = load(ROOT / "benchmarks" / "provenance.py").provenance()
    if os.environ.get("SDVG_COMMIT"):
        pytest.skip("SDVG_COMMIT is set: it names the commit instead of git")
    assert (p["commit"], p["commit_source"]) == (git(ROOT, "rev-parse", "HEAD"), "git")
