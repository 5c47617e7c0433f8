"""Nothing produced is lost or corrupted (docs/invariants.md, "Outputs and interruptions"): output paths
checked before any model loads, encoder failures raised, videos renamed into place when closed,
resumable JSON Lines that survive a crash, one run per output, signals that follow Ctrl-C's path, and
the exit-status convention (2 bad input, 1 runtime failure, 128 + signal when interrupted)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sdvg import cli
from sdvg.io.outputs import (OutputLock, OutputPathError, append_jsonl, check_output_paths, prompt_sha256,
                             repair_jsonl, write_text_atomic)
from sdvg.io.video_writer import IncrementalMP4Writer, VideoWriteError, partial_path, read_mp4_frames

PROMPT = "a paper boat on a rainy street"


def _frames(n=4, h=32, w=32, value=100):
    return torch.full((n, h, w, 3), value, dtype=torch.uint8)


def _main(*argv, load=None) -> int:
    """`sdvg ARGV`; `load` (args -> pipeline) replaces loading from the flags."""
    return cli.main(list(argv), load_pipeline=load)


# ------------------------------------------------------------------ output paths, before any model loads
@pytest.fixture
def no_model_load():
    """A loader that fails the test: the checks must come first."""
    def boom(args):
        raise AssertionError("a model was loaded before the output paths were checked")

    return boom


def test_stats_equal_to_out_is_refused_before_loading(tmp_path, no_model_load, capsys):
    video = tmp_path / "v.mp4"
    video.write_bytes(b"an earlier video")
    assert _main("generate", "--prompt", PROMPT, "--out", str(video), "--stats", str(video), load=no_model_load) == 2
    assert "are the same file" in capsys.readouterr().err
    assert video.read_bytes() == b"an earlier video"


@pytest.mark.parametrize("target", ["dir", "devnull", "symlink_to_dev"])
def test_non_regular_outputs_are_refused(tmp_path, no_model_load, capsys, target):
    if target == "dir":
        out = tmp_path / "d.mp4"
        out.mkdir()
        argv = ["--out", str(out)]
    elif target == "devnull":
        argv = ["--out", str(tmp_path / "v.mp4"), "--stats", "/dev/null"]
    else:
        link = tmp_path / "full.mp4"
        link.symlink_to("/dev/full")
        argv = ["--out", str(link)]
    assert _main("generate", "--prompt", PROMPT, *argv, load=no_model_load) == 2
    err = capsys.readouterr().err
    assert "is a folder" in err or "not a regular file" in err


def test_prompts_file_that_is_a_folder_exits_2(tmp_path, no_model_load, capsys):
    assert _main("generate", "--prompts-file", str(tmp_path), "--out", str(tmp_path / "v.mp4"), load=no_model_load) == 2
    assert "is not a file" in capsys.readouterr().err


def test_check_output_paths_unit(tmp_path):
    got = check_output_paths(out=tmp_path / "a" / "b" / "v.mp4", stats=tmp_path / "s.json", timeline=None)
    assert set(got) == {"out", "stats"}  # a missing folder is fine (created later), None is skipped
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError) as e:
        check_output_paths(out=tmp_path / "f" / "v.mp4")
    assert all(s in str(e.value) for s in (str(tmp_path / "f"), "is a file")), e.value
    os.symlink(tmp_path / "s.json", tmp_path / "alias.json")
    with pytest.raises(OutputPathError) as e:
        check_output_paths(stats=tmp_path / "s.json", timeline=tmp_path / "alias.json")
    assert all(s in str(e.value) for s in ("alias.json", "same file")), e.value


# ------------------------------------------------------------------ the video writer
def test_writer_renames_into_place_and_leaves_no_file_without_frames(tmp_path):
    out = tmp_path / "v.mp4"
    with IncrementalMP4Writer(out) as w:
        w.write(_frames())
        assert not out.exists()  # written under a temporary name until closed
    assert out.exists() and not partial_path(out).exists()
    assert read_mp4_frames(out).shape == (4, 32, 32, 3)
    empty = tmp_path / "e.mp4"
    with IncrementalMP4Writer(empty):
        pass
    assert not empty.exists() and not partial_path(empty).exists()


def test_writer_raises_on_encoder_failure_and_keeps_the_previous_file(tmp_path, monkeypatch):
    import imageio_ffmpeg

    out = tmp_path / "v.mp4"
    out.write_bytes(b"the previous video")
    partial_path(out).mkdir()  # something not a file at the partial name: refused by name, never written
    with pytest.raises(ValueError) as e:
        IncrementalMP4Writer(out)
    assert all(s in str(e.value) for s in ("partial video", "is a folder")), e.value
    partial_path(out).rmdir()
    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: "false")  # an encoder that fails at once
    w = IncrementalMP4Writer(out)
    with pytest.raises(VideoWriteError, match=r"writing .*v.mp4 failed: .*ffmpeg exit status [1-9]"):
        w.write(_frames())
        w.close()
    assert out.read_bytes() == b"the previous video"
    assert not partial_path(out).exists()


def test_odd_sizes_are_padded_not_refused(tmp_path):
    out = tmp_path / "odd.mp4"
    with IncrementalMP4Writer(out) as w:
        w.write(_frames(2, 33, 47))
    assert read_mp4_frames(out).shape[0] == 2


# ------------------------------------------------------------------ JSON Lines and the lock
def test_torn_last_line_is_cut_and_appends_are_whole_lines(tmp_path):
    f = tmp_path / "s.jsonl"
    append_jsonl(f, json.dumps({"prompt_index": 0}))
    with open(f, "a") as h:
        h.write('{"prompt_index": 1, "wal')  # a crash mid-write
    assert repair_jsonl(f) == len('{"prompt_index": 1, "wal')
    assert f.read_text() == '{"prompt_index": 0}\n'
    assert repair_jsonl(f) == 0 and repair_jsonl(tmp_path / "none.jsonl") == 0
    with pytest.raises(ValueError, match="one line"):
        append_jsonl(f, "a\nb")


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    f = tmp_path / "s.json"
    write_text_atomic(f, "old")

    def fail(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="No space"):
        write_text_atomic(f, "new")
    assert f.read_text() == "old" and not list(tmp_path.glob(".*.tmp"))


def test_second_run_on_the_same_outputs_is_refused(tmp_path, capsys):
    stats = tmp_path / "s.jsonl"
    with OutputLock(stats):
        assert _main("generate", "--prompt", PROMPT, "--out", str(tmp_path / "v.mp4"), "--stats", str(stats),
                     load=lambda args: pytest.fail("loaded although locked")) == 2
    assert "another sdvg run is writing" in capsys.readouterr().err
    assert not (tmp_path / "s.jsonl.lock").exists()  # released and removed


# ------------------------------------------------------------------ resume
def _prompts_file(tmp_path, lines):
    pf = tmp_path / "p.txt"
    pf.write_text("\n".join(lines) + "\n")
    return pf


@pytest.mark.slow
def test_resume_repairs_a_torn_record_and_redoes_that_prompt_once(tmp_path, tiny_pipe, capsys):
    pf = _prompts_file(tmp_path, ["a fox", "a cat", "a dog"])
    stats = tmp_path / "s.jsonl"
    base = ["generate", "--prompts-file", str(pf), "--out", str(tmp_path / "v.mp4"), "--stats", str(stats),
            "--num-blocks", "1", "--quiet"]
    assert _main(*base, "--limit", "2", load=lambda args: tiny_pipe) == 0
    lines = stats.read_text().splitlines()
    stats.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # prompt 1's record torn by a crash
    assert _main(*base, "--resume", load=lambda args: tiny_pipe) == 0
    assert "cut" in capsys.readouterr().err
    recs = [json.loads(x) for x in stats.read_text().splitlines()]
    assert [r["cli"]["prompt_index"] for r in recs] == [0, 1, 2]  # 0 kept, 1 redone once, 2 new
    assert all(r["cli"]["prompt_sha256"] == prompt_sha256(r["video"]["prompt"]) for r in recs)


def test_resume_refuses_an_edited_prompts_file_or_other_options(tmp_path, tiny_pipe, capsys):
    pf = _prompts_file(tmp_path, ["a fox", "a cat"])
    stats = tmp_path / "s.jsonl"
    base = ["generate", "--prompts-file", str(pf), "--out", str(tmp_path / "v.mp4"), "--stats", str(stats),
            "--num-blocks", "1", "--quiet"]
    assert _main(*base, load=lambda args: tiny_pipe) == 0
    before = stats.read_text()
    _prompts_file(tmp_path, ["a fox", "a horse"])  # same length, line 1 edited
    assert _main(*base, "--resume", load=lambda args: tiny_pipe) == 2
    assert "prompt 1 was 'a cat'" in capsys.readouterr().err
    _prompts_file(tmp_path, ["a fox", "a cat"])
    assert _main(*base, "--resume", "--seed", "5", load=lambda args: tiny_pipe) == 2
    assert "seed=0 now 5" in capsys.readouterr().err
    assert stats.read_text() == before  # nothing overwritten


# ------------------------------------------------------------------ signals (real processes)
def _spawn(tmp_path, *extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "sdvg.cli", "generate", "--preset", "tiny", "--prompt", PROMPT,
                             "--out", str(tmp_path / "v.mp4"), "--stats", str(tmp_path / "s.json"), "--quiet",
                             *extra], stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(path: Path, proc, timeout=120.0):
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_signal_mid_video_closes_the_mp4_and_marks_the_stats(tmp_path, sig, code):
    proc = _spawn(tmp_path, "--num-blocks", "200")
    _wait_for(partial_path(tmp_path / "v.mp4"), proc)  # the first block is being written
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "Traceback" not in err
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["video"]["interrupted"] is True and stats["cli"]["interrupted_by"] == signal.Signals(sig).name
    assert read_mp4_frames(tmp_path / "v.mp4").shape[0] == stats["video"]["frames"] > 0
    assert not partial_path(tmp_path / "v.mp4").exists()


@pytest.mark.slow
def test_ctrl_c_before_the_first_block_leaves_no_video(tmp_path):
    from sdvg.io.locks import lock_path

    proc = _spawn(tmp_path, "--num-blocks", "2")
    _wait_for(lock_path(tmp_path / "v.mp4"), proc)  # the outputs are locked once the signal handler is in: loading
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the video finished before the signal arrived (a very fast machine)")
    assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err[-3000:])
    assert not (tmp_path / "v.mp4").exists() and not partial_path(tmp_path / "v.mp4").exists()


# ------------------------------------------------------------------ engines and exit statuses
def test_unknown_engine_family_is_refused(tmp_path, capsys):
    from build_engines.__main__ import main as build

    assert build(["--stages", "bogus,vae_decode", "--format", "onnx", "--out", str(tmp_path)]) == 2
    assert "unknown engine family bogus in --stages" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_engine_manifest_may_not_name_a_file_outside_its_entry(tmp_path):
    from sdvg.engines.cache import CorruptEngineError, EngineCache, EngineKey

    key = EngineKey(stage="reward", config_hash="c", weights_hash="w", shapes=(("x", (1,), "float32"),),
                    precision="fp32", gpu_name="cpu", compute_capability="-", trt_version="-", artifact="onnx")
    cache = EngineCache(tmp_path)
    art = tmp_path / "model.onnx"
    art.write_bytes(b"onnx")
    cache.store(key, art, "rebuild")
    d = cache.entry_dir(key)
    m = json.loads((d / "manifest.json").read_text())
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x")
    m["file"] = "../secret.bin"
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CorruptEngineError) as e:
        cache.load(key, "rebuild")
    assert all(s in str(e.value) for s in ("onnx", "model.onnx")), e.value


def test_exit_statuses_follow_the_convention(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:  # by the parser: nothing imported, nothing loaded
        _main("generate", "--prompt", PROMPT, "--preset", "nope", "--out", str(tmp_path / "v.mp4"))
    assert refused.value.code == 2 and "unknown preset 'nope'" in capsys.readouterr().err

    def disk_full(args):
        raise OSError(28, "No space left on device")

    assert _main("generate", "--prompt", PROMPT, "--out", str(tmp_path / "v.mp4"), load=disk_full) == 1
    assert "No space left" in capsys.readouterr().err


def test_option_rules_needing_the_preset_are_checked_before_loading(tmp_path, no_model_load, capsys):
    assert _main("generate", "--prompt", PROMPT, "--preset", "tiny", "--target-context", "recompute",
                 "--kv-cache-frames", "50", "--out", str(tmp_path / "v.mp4"), load=no_model_load) == 2
    assert "kv_cache_frames 50 is larger than the video" in capsys.readouterr().err


def test_legacy_format_checkpoints_are_read_without_mmap(tmp_path):
    from sdvg.models.checkpoints import _read_file

    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    torch.save(state, tmp_path / "new.pt")
    for name in ("old.pt", "new.pt"):
        assert torch.equal(_read_file(tmp_path / name)["w"], state["w"])
