"""Logging and progress: the library logs to the `sdvg` logger and never prints, `--log-level` shows its
records on stderr (before or after the command), loads are logged per component, a prompts file has an
outer bar with an ETA, and an interrupted run's summary says so."""
from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from sdvg import cli

ROOT = Path(__file__).resolve().parents[1]
# Where printing is the job: the command line and one script run as its own process.
MAY_PRINT = ("sdvg/cli/", "sdvg/evaluation/vbench_job.py")


def test_library_code_never_prints():
    offenders = []
    for path in sorted((ROOT / "sdvg").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(MAY_PRINT):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, f"library code prints (log to the `sdvg` logger instead): {offenders}"


def test_the_sdvg_logger_has_a_null_handler_and_no_level_of_its_own():
    import sdvg  # noqa: F401

    logger = logging.getLogger("sdvg")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)


@pytest.mark.parametrize("argv", [["--log-level", "INFO", "config", "--tau", "-1"],
                                  ["config", "--tau", "-1", "--log-level", "info"]])
def test_log_level_before_or_after_the_command(argv, capsys):
    logger = logging.getLogger("sdvg")
    level = logger.level
    try:
        assert cli.main(argv) == 0
        assert logger.level == logging.INFO
        logging.getLogger("sdvg.test").info("a record")
        err = capsys.readouterr().err
        assert "INFO sdvg.test: a record" in err and "Logging error" not in err
        with capsys.disabled():  # another stream under sys.stderr: the handler follows it
            pass
        assert cli.main(argv) == 0
        logging.getLogger("sdvg.test").info("again")
        assert "INFO sdvg.test: again" in capsys.readouterr().err
    finally:
        logger.setLevel(level)


def test_a_bad_log_level_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--log-level", "loud", "config"])
    assert exc.value.code == 2 and "--log-level" in capsys.readouterr().err


def test_building_a_pipeline_is_logged(caplog):
    from sdvg.config import get_preset
    from sdvg.models.components import build_random

    with caplog.at_level(logging.INFO, logger="sdvg"):
        build_random(get_preset("tiny"), need_drafter=False, need_reward=False)
    assert any(r.name == "sdvg.models.components" and "random weights" in r.getMessage() for r in caplog.records)


def test_load_progress_logs_each_component_and_counts_it(caplog, monkeypatch):
    import sdvg.io.progress
    from sdvg.models.components import LoadProgress

    monkeypatch.setattr(sdvg.io.progress, "draws", lambda stream=None: True)  # stderr as a terminal

    with caplog.at_level(logging.INFO, logger="sdvg"):
        steps = LoadProgress(["a", "b"], show=True)
        with steps.step("a", "/x/a.safetensors"):
            pass
        with pytest.raises(RuntimeError):
            with steps.step("b", "/x/b.pth"):  # a failed load is not counted as loaded
                raise RuntimeError("bad file")
        steps.close()
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["loaded a from /x/a.safetensors"]
    assert steps.bar.n == 1


def test_an_interrupted_summary_says_so(capsys, tmp_path):
    from sdvg.cli.generate_outputs import summary

    stats = {"video": {"frames": 21, "interrupted": True, "blocks_done": 2}, "options": {"num_blocks": 5},
             "result": {"acceptance_rate": None, "wall_s": 1.5},
             "cli": {"video_path": str(tmp_path / "v.mp4"), "interrupted_by": "SIGINT"}}  # a record's groups (schema 9)
    summary(stats, tmp_path / "v.json")
    line = capsys.readouterr().err
    assert line.startswith("interrupted (SIGINT) after 2 of 5 blocks: ") and "21 frames" in line
    summary({**stats, "video": {"frames": 0, "interrupted": False, "blocks_done": 0}, "cli": {"video_path": None}},
            tmp_path / "v.json")
    assert capsys.readouterr().err.startswith("no video (no block was emitted): 0 frames")


@pytest.mark.slow
def test_a_prompts_file_has_an_outer_bar(tmp_path, tiny_pipe, capsys, monkeypatch):
    import sdvg.io.progress

    monkeypatch.setattr(sdvg.io.progress, "draws", lambda stream=None: True)  # stderr as a terminal
    prompts = tmp_path / "p.txt"
    prompts.write_text("a fox\na cat\n")
    assert cli.main(["generate", "--prompts-file", str(prompts), "--num-blocks", "1", "--out",
                          str(tmp_path / "v.mp4")], load_pipeline=lambda args: tiny_pipe) == 0
    err = capsys.readouterr().err
    assert "prompts: 100%" in err and "2/2" in err and ("video/s" in err or "s/video" in err)  # with its rate


@pytest.mark.slow  # a whole `sdvg generate` in a subprocess (imports torch, loads tiny)
def test_no_progress_bar_escapes_where_stderr_is_no_terminal(tmp_path):
    """`sdvg generate` with stderr to a file (a log, CI): no bar, so no carriage returns or escape codes; the
    summary lines are still there."""
    import os
    import subprocess
    import sys

    err = tmp_path / "err.log"
    with open(err, "wb") as f:
        done = subprocess.run([sys.executable, "-m", "sdvg", "generate", "--preset", "tiny", "--num-blocks", "1",
                               "--prompt", "a fox", "--out", str(tmp_path / "v.mp4")], stderr=f,
                              stdout=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    text = err.read_bytes()
    assert done.returncode == 0, text[-2000:]
    assert b"\r" not in text and b"\x1b[" not in text and b"block/s" not in text and b"s/block" not in text
    assert b"9 frames" in text  # the summary line


def test_the_api_bar_draws_only_on_a_terminal_unless_forced():
    """The API's bar: off into a file, forced with disable=False, and on where the stream is a terminal
    (sdvg.io.progress.draws)."""
    import io

    from sdvg.io.progress import draws, progress_bar

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert not draws(io.StringIO()) and draws(Tty())
    assert progress_bar(3, file=io.StringIO()).disable and not progress_bar(3, file=Tty()).disable
    assert not progress_bar(3, file=io.StringIO(), force=True).disable
    assert progress_bar(3, file=Tty(), show=False).disable
