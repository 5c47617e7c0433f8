"""The README's and docs' examples run as written: every ```python block is executed on the `tiny` preset
(slow), every `sdvg ...` command line of a ```bash block is parsed by the CLI's own parser (every flag and
subcommand exists), and the prompts-file example runs from a directory outside the clone (slow). The README
is one page that links into docs/ (the full API in docs/api.md, the command line in docs/cli.md, ...): its
relative links and the docs' resolve, and docs/README.md, the map, lists every page."""
import os
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(language: str) -> list[tuple[str, int, str]]:
    """(file, line, code) of every fenced block of `language` in the README and docs/."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M):
            found.append((path.relative_to(ROOT).as_posix(), text[:m.start()].count("\n") + 1, m.group(1)))
    return found


def command_lines() -> list[tuple[str, list[str]]]:
    """The sdvg command lines of the bash blocks, as argv (what follows `sdvg` / `-m sdvg.cli`)."""
    out = []
    for where, line, code in blocks("bash"):
        for i, text in enumerate(code.splitlines()):
            for part in text.split("&&"):
                words = shlex.split(part.replace('"..."', '"a prompt"'), comments=True)  # a quoted `...`: a value
                for k, w in enumerate(words):
                    if w.endswith("bin/sdvg") or w == "sdvg" or (w == "sdvg.cli" and k and words[k - 1] == "-m"):
                        argv = words[k + 1:]
                        if argv[-1:] == ["..."]:  # a trailing `...`: the reader fills in the rest
                            argv = argv[:-1]
                        out.append((f"{where}:{line + 1 + i}", argv))
                        break
    return out


def test_the_docs_have_examples_to_check():
    assert [w for w, _, _ in blocks("python")] == ["README.md", "docs/api.md", "docs/api.md", "docs/engines.md",
                                                   "docs/live.md", "docs/live.md", "docs/live.md", "docs/stats.md"]
    # the short API example, the whole API, live sessions, FP8, video-to-video, sessions batched together, reading
    # the statistics
    commands = command_lines()
    assert len(commands) >= 15 and any(argv[:1] == ["sweep"] for _, argv in commands)


@pytest.mark.parametrize("where,argv", command_lines(), ids=[w for w, _ in command_lines()])
def test_every_sdvg_command_line_parses(where, argv):
    from sdvg.cli import build_parser

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0 and argv in (["--version"], ["--help"]):  # answered by the parser itself
            return
        pytest.fail(f"{where}: `sdvg {shlex.join(argv)}` does not parse (exit {exc.code})")
    assert callable(args.func)


@pytest.mark.slow
@pytest.mark.parametrize("where,line,code", blocks("python"), ids=[f"{w}:{n}" for w, n, _ in blocks("python")])
def test_python_blocks_run_on_tiny(where, line, code, tmp_path, monkeypatch):
    assert 'from_preset("tiny")' in code  # the examples run on random tiny weights
    monkeypatch.chdir(tmp_path)  # files the example writes land here
    namespace = {"__name__": "__readme__"}
    exec(compile(code, f"{where}:{line}", "exec"), namespace)
    if "record" in namespace:  # the statistics: grouped, read back by read_stats as they are
        assert namespace["record"] == namespace["stats"] and namespace["stats"]["schema_version"] == 10
        return
    if "v2v" in namespace:  # video-to-video: a clip, and the same frames pushed live
        assert namespace["v2v"].frames.shape == (1, 33, 64, 64, 3) and len(namespace["blocks"]) == 2
        assert namespace["live"].stats["video"]["input_video"]["source"] == "live"
        return
    if 'quantization="fp8"' in code:  # the FP8 example: both DiTs' block linears in FP8
        stats = namespace["out"].stats
        assert stats["options"]["quantization"] == "fp8" and set(stats["run"]["fp8_impl"]) == {"drafter", "target"}
        return
    if "batcher" in namespace:  # sessions batched together: both sessions' drafts and scores in calls of two rows
        calls = namespace["batcher"].stats.calls
        assert len(namespace["sessions"]) == 2 and calls[("denoise", 2)] >= 2 and calls[("score", 2)] >= 1, calls
        return
    if "session" in namespace:  # the live-session examples: the replayed schedule is the session's video
        session, replay = namespace["session"], namespace["replay"]
        assert session.stats["live"]["updates"] and replay.stats["live"]["updates"] == session.stats["live"]["updates"]
        return
    if where == "README.md":  # the short example: one call, its statistics, a stream
        out = namespace["out"]
        assert out.frames.shape == (1, 9 + 12 * 2, 64, 64, 3) and len(out.blocks[0]) == 3
        assert 0.0 <= out.stats[0]["result"]["acceptance_rate"] <= 1.0 and namespace["block"].index == 1
        return
    assert (tmp_path / "fox.mp4").stat().st_size > 0
    out, stream = namespace["out"], namespace["stream"]
    assert out.frames.shape == (1, 9 + 12 * 2, 64, 64, 3) and stream.finished and len(stream.stats["blocks"]) == 2
    assert len(namespace["outs"].blocks[0]) == 1  # the interrupting callback stopped after block 0


@pytest.mark.slow
def test_the_prompts_file_example_runs_outside_the_clone(tmp_path, monkeypatch):
    from sdvg.cli import main

    (line,) = [argv for _, argv in command_lines() if "--prompts-file" in argv and argv[0] == "generate"]
    assert line[line.index("--prompts-file") + 1] == "moviegen"
    monkeypatch.chdir(tmp_path)
    assert not Path("sdvg/data/MovieGenVideoBench.txt").exists()
    # the README's line, made short: one prompt, one block (later flags win)
    assert main(line + ["--limit", "1", "--num-blocks", "1", "--quiet"]) == 0
    assert (tmp_path / "out" / "s.jsonl").read_text().count("\n") == 1
    assert [p.name for p in (tmp_path / "out").glob("*.mp4")] != []


def test_prompts_file_names_resolve_to_the_packaged_file(tmp_path, monkeypatch):
    from sdvg.cli import DEFAULT_PROMPTS
    from sdvg.io.prompts import prompts_file

    monkeypatch.chdir(tmp_path)
    for name in ("moviegen", "MovieGen", "MovieGenVideoBench.txt"):
        assert prompts_file(name) == DEFAULT_PROMPTS.resolve()
    (tmp_path / "moviegen").write_text("a cat\n")
    assert prompts_file("moviegen") == Path("moviegen")  # an existing file of that name wins
    assert prompts_file("nope.txt") == Path("nope.txt") and prompts_file(None) is None
    assert os.path.isfile(prompts_file("MOVIEGEN"))


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_relative_links_resolve():
    """Every relative link of the README and docs/ names a file of the checkout, and its #anchor a heading."""
    broken = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT).as_posix()}: ({target})"
            if not dest.is_relative_to(ROOT) or not dest.exists():
                broken.append(f"{where} names no file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text(encoding="utf-8")):
                broken.append(f"{where} names no heading of {dest.relative_to(ROOT).as_posix()}")
    assert not broken, broken


def test_the_readme_is_one_page_that_links_every_docs_page_it_needs():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) < 10_000, "the README is one page: the long sections live in docs/"
    for page in ("docs/README.md", "docs/api.md", "docs/cli.md", "docs/install.md", "docs/server.md",
                 "docs/layout.md"):
        assert f"]({page}" in text, page


def test_the_docs_map_lists_every_page():
    listed = set(re.findall(r"\]\(([\w-]+\.md)\)", (ROOT / "docs" / "README.md").read_text(encoding="utf-8")))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= listed, f"docs/README.md does not list {sorted(pages - listed)}"
