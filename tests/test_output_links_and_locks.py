"""Outputs are never written through a link nor by two runs at once (docs/invariants.md, "Outputs and
interruptions"): a symlink planted at any name a run creates is refused before any work and library writers never
follow one; one lock per output set, a second run refused naming the holder; an unwritable folder and a per-prompt
name that collides with another output are found before loading. No model is loaded."""
import os
import subprocess
import sys
import textwrap

import pytest

from sdvg import cli
from sdvg.io.locks import lock_outputs
from sdvg.io.outputs import OutputPathError, write_text_atomic
from sdvg.io.video_writer import IncrementalMP4Writer, partial_log_path, partial_path

PROMPT = "a paper boat on a rainy street"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


LOAD_PIPELINE = None  # what `_main` loads a pipeline with (None: the CLI's own); `no_model_load` (conftest) swaps it


def _main(*argv) -> int:
    return cli.main(list(argv), load_pipeline=LOAD_PIPELINE)


# ------------------------------------------------------------------ 1. planted symlinks
@pytest.mark.parametrize("name", ["lock", "tmp", "partial", "log", "stats_lock"])
def test_a_symlink_planted_at_a_created_name_is_refused_before_any_work(tmp_path, no_model_load, capsys, name):
    victim = tmp_path / "p.txt"
    victim.write_text("precious")
    out, stats = tmp_path / "v.mp4", tmp_path / "v.json"
    planted = {"lock": tmp_path / "v.mp4.lock", "stats_lock": tmp_path / "v.json.lock",
               "tmp": tmp_path / ".v.json.tmp", "partial": partial_path(out), "log": partial_log_path(out)}[name]
    planted.symlink_to(victim)
    assert _main("generate", "--prompt", PROMPT, "--num-blocks", "1", "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert str(planted) in err and "symbolic link" in err and "Traceback" not in err
    assert victim.read_text() == "precious" and planted.is_symlink()


def test_library_writers_never_follow_a_planted_link(tmp_path):
    victim = tmp_path / "p.txt"
    victim.write_text("precious")
    (tmp_path / ".s.json.tmp").symlink_to(victim)
    with pytest.raises(OutputPathError, match="symbolic link"):
        write_text_atomic(tmp_path / "s.json", "new")
    out = tmp_path / "v.mp4"
    partial_path(out).symlink_to(victim)
    with pytest.raises(ValueError, match="symbolic link"):
        IncrementalMP4Writer(out)
    fifo = tmp_path / ".w.partial.log"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="named pipe"):
        IncrementalMP4Writer(tmp_path / "w.mp4")
    assert victim.read_text() == "precious"


def test_a_stale_temporary_regular_file_is_replaced_not_appended(tmp_path):
    (tmp_path / ".s.json.tmp").write_text("left by a crash")
    write_text_atomic(tmp_path / "s.json", "new")
    assert (tmp_path / "s.json").read_text() == "new" and not (tmp_path / ".s.json.tmp").exists()


# ------------------------------------------------------------------ 2. one lock per output set
_HOLDER = textwrap.dedent("""
    import sys, time
    from sdvg.io.locks import lock_outputs
    with lock_outputs(sys.argv[1]):
        print("held", flush=True)
        time.sleep(60)
""")


@pytest.fixture
def holder(tmp_path):
    procs = []

    def hold(path):
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, text=True,
                                cwd=ROOT)
        assert proc.stdout.readline().strip() == "held"
        procs.append(proc)
        return proc

    yield hold
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.parametrize("command", ["generate_out", "generate_timeline", "sweep", "calibrate", "calibrate-exit",
                                     "train-exit-head"])
def test_a_second_run_on_any_output_is_refused_naming_the_holder(tmp_path, holder, no_model_load, capsys, command):
    out = tmp_path / "v.mp4"
    if command == "generate_out":  # another --stats, the same --out: still refused
        held, argv = out, ["generate", "--prompt", PROMPT, "--out", str(out), "--stats", str(tmp_path / "other.json")]
    elif command == "generate_timeline":
        held = tmp_path / "t.png"
        argv = ["generate", "--prompt", PROMPT, "--out", str(out), "--timeline", str(held)]
    elif command in ("sweep", "calibrate"):
        held = tmp_path / "folder"
        argv = [command, "--out", str(held), "--limit", "1"] + (["--acceptance", "0.5"] if command == "calibrate"
                                                                else [])
    else:
        held = tmp_path / ("report.json" if command == "calibrate-exit" else "head")
        argv = [command, "--out", str(held), "--prompt", PROMPT] if command == "calibrate-exit" else \
            [command, "--out", str(held)]
    proc = holder(held)
    assert _main(*argv) == 2
    err = capsys.readouterr().err
    assert f"process {proc.pid}" in err and "another sdvg run is writing" in err


def test_a_second_engine_build_into_a_held_folder_is_refused_before_any_export(tmp_path, holder, capsys):
    from build_engines.__main__ import cli as build_engines

    held = tmp_path / "engines"
    proc = holder(held)
    assert build_engines(["--preset", "tiny", "--format", "onnx", "--out", str(held)]) == 2
    err = capsys.readouterr().err
    assert f"process {proc.pid}" in err and "another sdvg run is writing" in err
    assert not held.exists() or not any(held.iterdir())  # nothing exported


def test_locks_are_reentrant_within_a_process_and_released(tmp_path):
    a = tmp_path / "a.mp4"
    with lock_outputs(a, tmp_path / "b.json"):
        with lock_outputs(a):
            assert (tmp_path / "a.mp4.lock").read_text().strip() == str(os.getpid())
        assert (tmp_path / "a.mp4.lock").exists()
    assert not (tmp_path / "a.mp4.lock").exists() and not (tmp_path / "b.json.lock").exists()


# ------------------------------------------------------------------ 3. folders and derived names
@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs")
def test_an_unwritable_folder_is_found_by_trying_before_loading(no_model_load, capsys):
    assert _main("generate", "--prompt", PROMPT, "--out", "/sys/kernel/v.mp4",
                 "--stats", "/tmp/sdvg-rel2-unused.json") == 2
    err = capsys.readouterr().err
    assert "/sys/kernel" in err and "Traceback" not in err


def test_per_prompt_derived_names_are_checked_against_the_other_outputs(tmp_path, no_model_load, capsys):
    pf = tmp_path / "p.txt"
    pf.write_text("a fox\na cat\n")
    stats = tmp_path / "t_0001.jsonl"
    stats.write_text("")
    assert _main("generate", "--prompts-file", str(pf), "--out", str(tmp_path / "v.mp4"), "--stats", str(stats),
                 "--timeline", str(tmp_path / "t.jsonl")) == 2
    assert "same file" in capsys.readouterr().err
    assert stats.read_text() == ""
