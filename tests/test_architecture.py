"""The shape of the code: imports run one way through the layers, the oracle and the production
scheduler stand side by side, `import sdvg` and `sdvg --help` stay torch-free, docs/layout.md's layout is
the tree's, and nothing refers outside the checkout."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import sdvg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import readme_layout  # noqa: E402

# Lowest first; a module may import modules of its own rank or lower ones.
RANKS = {
    "sdvg": 0, "sdvg.config": 0, "sdvg.options": 0, "sdvg.bounded": 0, "sdvg.names": 0, "sdvg.runtime": 0,
    "sdvg._native": 0, "sdvg._C": 0,
    "sdvg.models": 1, "sdvg.io": 1,
    "sdvg.engines": 2,
    "sdvg.generation": 3,
    "sdvg.evaluation": 4, "sdvg.live": 4,
    "sdvg.pipeline": 5,
    "sdvg.cli": 6, "sdvg.serve": 6, "sdvg.__main__": 6,
}


def rank_of(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANKS:
            return RANKS[".".join(parts[:n])]
    raise KeyError(module)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, lazily inside functions too."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            for a in node.names:
                if node.module == "sdvg" and a.name in sdvg.__all__:  # a lazy name: the module it comes from
                    out.add(sdvg.source_module(a.name))
                else:
                    out.add(f"{node.module}.{a.name}")  # `from sdvg import pipeline`
    return out


PACKAGE = sorted((ROOT / "sdvg").rglob("*.py"))


@pytest.mark.parametrize("path", PACKAGE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_imports_run_one_way(path):
    me = module_name(path)
    mine = rank_of(me)
    for target in imports_of(path):
        if target.startswith("build_engines"):
            pytest.fail(f"{me} imports the build tool {target}: the runtime never imports build_engines")
        if not target.startswith("sdvg"):
            continue
        try:
            theirs = rank_of(target)
        except KeyError:
            # `from sdvg.x import name`: the module is sdvg.x, `name` an attribute
            theirs = rank_of(target.rsplit(".", 1)[0])
        if me == "sdvg":  # the package root re-exports lazily; its imports run when an attribute is read
            continue
        assert theirs <= mine, f"{me} (layer {mine}) imports {target} (layer {theirs}), a higher layer"


def test_oracle_and_production_scheduler_stand_side_by_side():
    ref = imports_of(ROOT / "sdvg/generation/reference.py")
    native = imports_of(ROOT / "sdvg/generation/native.py")
    assert not any(m.startswith("sdvg.generation.native") for m in ref)
    assert not any(m.startswith("sdvg.generation.reference") for m in native)
    for imported in (ref, native):
        assert "sdvg.generation.types" in imported and "sdvg.generation.prepare" in imported


def test_build_engines_imports_sdvg_runtime():
    used = set().union(*(imports_of(p) for p in (ROOT / "build_engines").glob("*.py")))
    assert any(m.startswith("sdvg.engines") for m in used)


def _python(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_import_sdvg_and_cli_help_do_not_import_torch():
    assert _python("import sys, sdvg; print('torch' in sys.modules)") == "False"
    code = ("import sys, contextlib, io\nfrom sdvg import cli\n"
            "for cmd in ([], ['generate'], ['sweep'], ['calibrate'], ['memory'], ['download']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        cli.main(cmd + ['--help'])\n"
            "print('torch' in sys.modules)")
    assert _python(code) == "False"


def test_lazy_public_names_resolve():
    for name in sdvg.__all__:
        assert getattr(sdvg, name) is not None
    with pytest.raises(AttributeError, match="no attribute"):
        sdvg.not_a_name  # noqa: B018


def test_readme_layout_is_the_tree():
    """docs/layout.md's listing (the README's "Layout" section until the README became one page)."""
    assert readme_layout.PAGE == ROOT / "docs" / "layout.md"
    section = readme_layout.page_section(readme_layout.PAGE.read_text(encoding="utf-8"))
    assert section == readme_layout.layout(), "run `python scripts/readme_layout.py --write`"


def _tracked_text_files():
    out = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    skip = ("results/",)
    return [ROOT / f for f in out if f.endswith((".py", ".md", ".sh", ".toml", ".txt", ".cpp", ".h", ".cfg"))
            and not f.startswith(skip) and (ROOT / f).is_file()]


def test_nothing_refers_outside_the_checkout():
    offenders = []
    for path in _tracked_text_files():
        if path == Path(__file__):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for needle in ("../shared", "shared/data", "DESIGN.md", "parents[2]"):
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not offenders, offenders


def test_default_prompts_ship_with_the_package():
    import hashlib

    from sdvg.cli import DEFAULT_PROMPTS, read_prompts

    assert DEFAULT_PROMPTS.is_relative_to(ROOT / "sdvg")
    assert len(read_prompts(DEFAULT_PROMPTS)) == 1003
    digest = hashlib.sha256(DEFAULT_PROMPTS.read_bytes()).hexdigest()
    assert digest == "ae02a4bbebcb55067dbeea369e43d52a4817d57fd0ac223071b9aa236ac027c4"


def module_graph() -> dict[str, set[str]]:
    """sdvg's modules and the sdvg modules each imports (lazily inside functions too; `from a import b`
    names module a.b where it is one, else a). The package root is left out: it re-exports lazily; so is a
    module's own package (Python runs a package's __init__ before any of its modules, whatever they import)."""
    names = {module_name(p): p for p in PACKAGE}
    graph = {}
    for me, path in names.items():
        if me == "sdvg":
            continue
        targets = set()
        for target in imports_of(path):
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target and target != "sdvg" and not (me + ".").startswith(target + "."):
                targets.add(target)
        graph[me] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_import_cycles_are_found():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others():
    """No two modules of sdvg import each other, directly or through others (a lazy import inside a
    function counts: it is the same knot, only untied at call time)."""
    cycles = import_cycles(module_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)
