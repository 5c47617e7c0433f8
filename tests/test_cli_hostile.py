"""The command line under hostile inputs (issue 35, item 10): a NUL byte in a --config file, a named pipe as
--exit-head, a file as train-exit-head's --out folder, a folder where its checkpoint goes, a frame rate ffmpeg
refuses only after the whole video. Each is refused with exit 2, naming the path or value and the fix, before
any model loads (the loader stand-in fails the test if it is called)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdvg import cli

ROOT = Path(__file__).resolve().parents[1]


def _no_model(args):
    raise AssertionError("a model was loaded before the inputs were checked")


def _main(capsys, *argv) -> tuple[int, str]:
    try:
        code = cli.main(list(argv), load_pipeline=_no_model)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


# ------------------------------------------------------------------ (a) a NUL byte in a YAML config
def test_a_nul_byte_in_a_yaml_config_is_exit_2_naming_the_file_and_the_byte(tmp_path):
    cfg = tmp_path / "f.yaml"
    cfg.write_bytes(b"tau: 0.5\nseed: 1\x00\n")
    r = subprocess.run([sys.executable, "-m", "sdvg", "generate", "--config", str(cfg), "--preset", "tiny", "--prompt",
                        "a fox", "--out", str(tmp_path / "v.mp4")], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "ReaderError" not in r.stderr, r.stderr
    assert f"config file {cfg} holds a NUL byte (0x00) at line 2, column 8, which YAML does not allow" in r.stderr
    assert not (tmp_path / "v.mp4").exists()


def test_other_control_characters_in_a_yaml_config_are_named_too(tmp_path):
    from sdvg.options import OptionError, load_options_file

    cfg = tmp_path / "g.yaml"
    cfg.write_bytes(b"tau: 0.5\x07\n")
    with pytest.raises(OptionError) as e:
        load_options_file(cfg)
    assert all(s in str(e.value) for s in ("U+0007", "line 1, column 9")), e.value


# ------------------------------------------------------------------ (b) a named pipe as --exit-head
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_a_named_pipe_as_exit_head_is_refused_before_anything_opens_it(tmp_path, capsys):
    fifo = tmp_path / "head.safetensors"
    os.mkfifo(fifo)
    code, err = _main(capsys, "generate", "--preset", "tiny", "--prompt", "a fox", "--mode", "target", "--early-exit",
                      "target", "--exit-verifier", "head", "--exit-head", str(fifo), "--out", str(tmp_path / "v.mp4"))
    assert code == 2 and f"--exit-head {fifo} is a named pipe, not a regular file; give the head's .safetensors " \
                          "file" in err, err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_the_head_reader_never_opens_a_named_pipe(tmp_path):
    from sdvg.models.exit_head import ExitHead

    fifo = tmp_path / "head.safetensors"
    os.mkfifo(fifo)
    # in a child (a blocked open holds the interpreter: the test must fail, not hang)
    probe = "import sys; from sdvg.models.exit_head import ExitHead; print(ExitHead.read_extra(sys.argv[1]))"
    try:
        r = subprocess.run([sys.executable, "-c", probe, str(fifo)], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    except subprocess.TimeoutExpired:
        pytest.fail("ExitHead.read_extra blocked on a named pipe")
    assert r.returncode == 0 and r.stdout.strip() == "{}", r.stderr
    with pytest.raises(ValueError) as e:
        ExitHead.load(fifo)
    assert all(s in str(e.value) for s in (str(fifo), "named pipe")), e.value
    with pytest.raises(ValueError, match="is a folder, not a regular file"):
        ExitHead.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        ExitHead.load(tmp_path / "none.safetensors")


# ------------------------------------------------------------------ (c), (d) train-exit-head's --out folder
TRAIN = ("train-exit-head", "--preset", "tiny", "--num-prompts", "1", "--steps", "2", "--num-blocks", "1", "--quiet")


def test_train_exit_head_refuses_a_file_as_its_out_folder_before_loading(tmp_path, capsys):
    out = tmp_path / "head-out"
    out.write_text("not a folder")
    code, err = _main(capsys, *TRAIN, "--out", str(out))
    assert code == 2 and f"training folder {out} (--out) is a regular file, not a folder: train-exit-head writes a " \
                          "folder there" in err, err
    assert out.read_text() == "not a folder"


@pytest.mark.parametrize("resume", [False, True])
def test_a_folder_where_the_checkpoint_goes_is_refused_before_the_work(tmp_path, capsys, resume):
    out = tmp_path / "run"
    (out / "checkpoint.safetensors").mkdir(parents=True)
    code, err = _main(capsys, *TRAIN, "--out", str(out), *(["--resume"] if resume else []))
    assert code == 2 and f"{out / 'checkpoint.safetensors'} is a folder, not a file: train-exit-head writes its " \
                          "checkpoint there; remove it or give another --out" in err, err


def test_a_planted_temporary_in_the_out_folder_is_refused_before_the_work(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".head.safetensors.tmp").symlink_to(tmp_path / "elsewhere")
    code, err = _main(capsys, *TRAIN, "--out", str(out))
    assert code == 2 and ".head.safetensors.tmp is a symbolic link" in err, err


# ------------------------------------------------------------------ (e) --fps
@pytest.mark.parametrize("fps", ["1e-9", "0.5", "241", "1000", "1e9"])
def test_fps_outside_what_an_mp4_plays_is_refused_at_parse_time(tmp_path, capsys, fps):
    code, err = _main(capsys, "generate", "--preset", "tiny", "--prompt", "a fox", "--fps", fps,
                      "--out", str(tmp_path / "v.mp4"))
    assert code == 2 and "must be a number of frames per second in [1, 240] (default: 16" in err, err


def test_the_writer_takes_the_same_range(tmp_path):
    from sdvg.io.video_writer import IncrementalMP4Writer

    for fps in (1e-9, 0.5, 241, float("nan"), True):
        with pytest.raises(ValueError, match=r"in \[1, 240\]"):
            IncrementalMP4Writer(tmp_path / "v.mp4", fps=fps)
    assert IncrementalMP4Writer(tmp_path / "v.mp4", fps=240).fps == 240.0
    assert IncrementalMP4Writer(tmp_path / "w.mp4", fps=1).fps == 1.0
