"""Reliability, round two (docs/invariants.md, "Outputs and interruptions" and "Bad input"): no write
through a planted symlink, every output locked, resumable training state validated, sizes that cannot
wrap, bounded parsing, text input handled, and the documented exit statuses. Each test is a few seconds
on `tiny` or needs no model at all."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from sdvg import cli
from sdvg.io.locks import lock_outputs
from sdvg.io.outputs import OutputPathError, write_text_atomic
from sdvg.io.video_writer import IncrementalMP4Writer, partial_log_path, partial_path

PROMPT = "a paper boat on a rainy street"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# What `_main` loads a pipeline with: None is the CLI's own loader; fixtures swap in a stand-in.
LOAD_PIPELINE = None


def _main(*argv) -> int:
    return cli.main(list(argv), load_pipeline=LOAD_PIPELINE)


@pytest.fixture
def no_model_load(monkeypatch):
    def boom(args):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(sys.modules[__name__], "LOAD_PIPELINE", boom)


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


# ------------------------------------------------------------------ 3. resumable state
def _checkpoint(tmp_path):
    from sdvg.evaluation import exit_calibration as ec

    config = ec.TrainConfig(steps=4, batch_size=2, checkpoint_every=2)
    state = ec.new_state(8, config)
    state.step, state.losses = 2, [0.5, 0.4]
    for p in state.head.parameters():  # Adam state as after two steps
        state.optimizer.state[p] = {"step": torch.tensor(2.0), "exp_avg": torch.zeros_like(p),
                                    "exp_avg_sq": torch.ones_like(p)}
    path = tmp_path / "checkpoint.safetensors"
    ec.save_checkpoint(path, state, config)
    return ec, config, path


def _rewrite(path, tensors=None, **meta):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        old_meta, old = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    old.update(tensors or {})
    old_meta.update(meta)
    save_file(old, str(path), metadata=old_meta)


def test_a_valid_checkpoint_resumes(tmp_path):
    ec, config, path = _checkpoint(tmp_path)
    state, _ = ec.load_checkpoint(path, config, dim=8)
    assert state.step == 2 and state.losses == [0.5, 0.4]


@pytest.mark.parametrize("damage,match", [
    ("nan", "NaN or inf"), ("negative_step", "step '-5'"), ("step_past", "past --steps"),
    ("losses", "finite numbers"), ("unknown_key", "unknown"), ("bad_json", "not valid JSON"),
    ("dim", "head width 1000000"), ("truncated", "not a readable safetensors"), ("foreign", "not a readable"),
    ("adam_step", "whole number of steps")])
def test_a_damaged_checkpoint_is_refused_before_use(tmp_path, damage, match):
    ec, config, path = _checkpoint(tmp_path)
    if damage == "nan":
        t = torch.zeros(8)
        t[3] = float("nan")
        _rewrite(path, {"head.norm.weight": t})
    elif damage == "negative_step":
        _rewrite(path, step="-5", losses="[]")
    elif damage == "step_past":
        _rewrite(path, step="9", losses=json.dumps([0.1] * 9))
    elif damage == "losses":
        _rewrite(path, losses="[0.5, NaN]")
    elif damage == "unknown_key":
        _rewrite(path, surprise="1")
    elif damage == "bad_json":
        _rewrite(path, config="{")
    elif damage == "dim":
        _rewrite(path, head_config=json.dumps({"dim": 1000000}))  # refused before allocating a 1e6-wide head
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "foreign":
        path.write_bytes(b"\x00" * 64)
    elif damage == "adam_step":
        _rewrite(path, {"adam.0.step": torch.tensor(-3.0)})
    with pytest.raises(ValueError, match=match):
        ec.load_checkpoint(path, config, dim=8)


def test_a_non_finite_or_worse_head_never_replaces_the_last_good_one(tmp_path):
    from sdvg.models.exit_head import ExitHead, ExitHeadConfig

    path = tmp_path / "head.safetensors"
    good = ExitHead(ExitHeadConfig(8))
    extra = {"generator": {"role": "target"}, "training_prompts": 1, "training_seeds": [0], "eps": 0.05}
    assert good.save(path, extra={**extra, "final_loss": 0.1})
    before = path.read_bytes()
    bad = ExitHead(ExitHeadConfig(8))
    with torch.no_grad():
        bad.out.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN or inf"):
        bad.save(path, extra={**extra, "final_loss": 0.05})
    with pytest.warns(RuntimeWarning, match="lower loss"):
        assert not ExitHead(ExitHeadConfig(8)).save(path, extra={**extra, "final_loss": 0.2})
    assert path.read_bytes() == before
    assert ExitHead(ExitHeadConfig(8)).save(path, extra={**extra, "final_loss": 0.01})  # better: replaced


def test_damaged_records_are_refused(tmp_path):
    from sdvg.evaluation import exit_calibration as ec

    n, grid = 3, (1, 2, 2)
    rec = ec.Records(torch.zeros(n, 4), torch.zeros(n, 4), torch.tensor([0, 1, 2]), torch.zeros(n, dtype=torch.long),
                     torch.zeros(n, dtype=torch.long), grid, 4, torch.zeros(n, 4, 8))
    path = tmp_path / "records.safetensors"
    ec.save_records(path, rec, {"prompts": ["a"]})
    got, meta = ec.load_records(path)
    assert len(got) == n and meta == {"prompts": ["a"]}
    _rewrite(path, {"steps": torch.tensor([0, 1, 7])})
    with pytest.raises(ValueError, match="num_steps"):
        ec.load_records(path)
    ec.save_records(path, rec, {})
    _rewrite(path, grid="[1, 2, 3]")
    with pytest.raises(ValueError, match="hidden has shape"):
        ec.load_records(path)


def test_exit_head_metadata_is_bounded_before_allocation(tmp_path):
    from safetensors.torch import save_file

    from sdvg.models.exit_head import ExitHead, HEAD_FORMAT

    path = tmp_path / "h.safetensors"
    for config, match in (({"dim": 8, "channels": [10_000_000, 48], "pool": 2}, "channels 10000000"),
                          ({"dim": 8, "channels": [1e7, 48], "pool": 2}, "channels 10000000.0"),
                          ({"dim": 10**6, "channels": [96, 48], "pool": 2}, "dim 1000000")):
        save_file({"x": torch.zeros(1)}, str(path), metadata={"format": HEAD_FORMAT, "version": "1",
                                                              "config": json.dumps(config)})
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=match):
            ExitHead.load(path)
        assert time.monotonic() - t0 < 5


# ------------------------------------------------------------------ 4. sizes that cannot wrap
def test_kv_sizes_beyond_2_63_are_refused_naming_the_value():
    from sdvg.config import ConfigError, KVWindow
    from sdvg.models.kv_cache import KVCacheSpec

    spec = KVCacheSpec(num_layers=40, heads=40, head_dim=128, tokens_per_frame=1 << 24, max_frames=1 << 40,
                       window=KVWindow())
    with pytest.raises(ConfigError, match=r"passes 2\^63"):
        spec.nbytes(torch.bfloat16)


def test_native_kv_bytes_are_checked():
    from sdvg._native import _C

    layout = _C.SlotLayout(1 << 40, 0, 0, 0)
    with pytest.raises(ValueError, match=r"exceeds 2\^63"):
        _C.kv_cache_nbytes(40, 1, 40, 128, 1 << 24, layout, 2)
    assert _C.kv_cache_nbytes(2, 1, 2, 4, 3, _C.SlotLayout(9, 0, 0, 0), 4) == 2 * 2 * 2 * 9 * 3 * 4 * 4


@pytest.mark.parametrize("argv", [
    ["memory", "--num-blocks", "1e19"], ["memory", "--num-blocks", "10000000000000000000"],
    ["memory", "--budget-gib", "1e300"], ["memory", "--window-frames", "99999999999999"],
    ["generate", "--prompt", PROMPT, "--memory-budget-gib", "1e300"],
    ["generate", "--prompt", PROMPT, "--fps", "inf"], ["generate", "--prompt", PROMPT, "--fps", "nan"],
    ["generate", "--prompt", PROMPT, "--num-blocks", "1" + "0" * 5000]])
def test_numeric_options_are_bounded_before_loading(argv, no_model_load, capsys):
    with pytest.raises(SystemExit) as exc:
        _main(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()[-1]) < 300  # usage, then a bounded error


# ------------------------------------------------------------------ 5. bounded parsing
BILLION_LAUGHS = "\n".join(['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'] +
                           [f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]"
                            for i in range(8)] + ["tau: *i"]) + "\n"


def test_billion_laughs_config_is_refused_in_bounded_time_and_memory(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BILLION_LAUGHS)
    code = ("from sdvg.options import load_options_file, OptionError\n"
            f"try:\n    load_options_file({str(cfg)!r})\nexcept OptionError as e:\n    print('refused:', e)\n")
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", f"ulimit -v 1000000; exec {sys.executable} -c \"$0\"", code], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "alias" in r.stdout and len(r.stdout) < 500


@pytest.mark.parametrize("text,match", [
    ("tau: -0.7\ntau: 1.0\n", "appears twice"),
    ("exit_head: [1, 2]\n", "exit_head must be a path"),
    ("exit_head: {a: 1}\n", "exit_head must be a path"),
    ("mode: [sdvg]\n", "mode must be one of"),
    ("run_ahead: 1\n", "run_ahead must be true or false"),
    ("tau: &x 1\n", "anchor"),
    ("tau: " + "[" * 100 + "]" * 100 + "\n", "deeper"),
    ("tau: '" + "x" * 100_000 + "'\n", "is not a number"),
])
def test_yaml_configs_are_read_with_bounds_and_types(tmp_path, text, match):
    from sdvg.options import OptionError, load_options_file

    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(OptionError, match=match) as exc:
        load_options_file(cfg)
    assert len(str(exc.value)) < 1500  # a bounded prefix of the value, never the value


def test_json_configs_refuse_duplicates_and_deep_nesting(tmp_path):
    from sdvg.options import OptionError, load_options_file

    cfg = tmp_path / "c.json"
    cfg.write_text('{"tau": 1, "tau": 2}')
    with pytest.raises(OptionError, match="appears twice"):
        load_options_file(cfg)
    cfg.write_text('{"tau": ' + "[" * 10000 + "]" * 10000 + "}")
    with pytest.raises(OptionError, match="deeper"):
        load_options_file(cfg)
    cfg.write_bytes(b'{"tau": 1,\n "mode": "\xff"}')
    with pytest.raises(OptionError, match="line 2"):
        load_options_file(cfg)


def test_a_bad_config_exits_2_without_traceback(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BILLION_LAUGHS)
    with pytest.raises(SystemExit) as exc:
        _main("generate", "--config", str(cfg), "--prompt", PROMPT)
    assert exc.value.code == 2 and "alias" in capsys.readouterr().err


# ------------------------------------------------------------------ 6. text input
def test_prompts_files_bom_and_every_line_end(tmp_path):
    from sdvg.io.text_input import read_prompts

    f = tmp_path / "p.txt"
    f.write_bytes(b"\xef\xbb\xbfa fox\r\na cat\ra dog\na bird")
    assert read_prompts(f) == ["a fox", "a cat", "a dog", "a bird"]
    f.write_bytes(b"a fox\r\n")
    assert read_prompts(f) == ["a fox"]


def test_invalid_utf8_prompts_are_refused_with_the_line(tmp_path, no_model_load, capsys):
    f = tmp_path / "p.txt"
    f.write_bytes(b"a fox\na \xff cat\n")
    assert _main("generate", "--prompts-file", str(f), "--out", str(tmp_path / "v.mp4")) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "UTF-8" in err and "Traceback" not in err
    surrogate = "a fox \udcff"  # what Python makes of an undecodable command-line byte
    assert _main("generate", "--prompt", surrogate, "--out", str(tmp_path / "v.mp4")) == 2
    assert "not valid UTF-8" in capsys.readouterr().err


# ------------------------------------------------------------------ 7. exit statuses
@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs")
def test_an_unwritable_folder_is_found_by_trying_before_loading(no_model_load, capsys):
    assert _main("generate", "--prompt", PROMPT, "--out", "/sys/kernel/v.mp4",
                 "--stats", "/tmp/sdvg-rel2-unused.json") == 2
    err = capsys.readouterr().err
    assert "/sys/kernel" in err and "Traceback" not in err


def test_infinite_tau_round_trips_through_resume_and_the_protocol_is_recorded(tmp_path, tiny_pipe, monkeypatch,
                                                                               capsys):
    monkeypatch.setattr(sys.modules[__name__], "LOAD_PIPELINE", lambda args: tiny_pipe)
    pf = tmp_path / "p.txt"
    pf.write_text("a fox\n")
    stats = tmp_path / "s.jsonl"
    base = ["generate", "--prompts-file", str(pf), "--out", str(tmp_path / "v.mp4"), "--stats", str(stats),
            "--num-blocks", "1", "--quiet", "--protocol", "paper"]
    assert _main(*base, "--tau", "inf") == 0
    rec = json.loads(stats.read_text())
    assert rec["options"]["tau"] is None
    assert rec["cli"]["infinite_options"] == {"tau": "inf"} and rec["cli"]["protocol"] == "paper"
    assert _main(*base, "--tau", "inf", "--resume") == 0  # nothing redone
    assert len(stats.read_text().splitlines()) == 1
    assert _main(*base, "--tau=-inf", "--resume") == 2
    assert "tau=None now -inf" in capsys.readouterr().err


def test_protocol_overrides_are_printed_as_overrides():
    from sdvg.options import describe_protocol, protocol_options

    lines = describe_protocol("paper", protocol_options("paper", seed=3), 64, 64, random_weights=True)
    assert "seed=42" not in lines[0] and "overridden" in lines[1] and "seed=3 (the protocol's: 42)" in lines[1]


def test_engine_folder_refusals_and_odd_devices_exit_2(tmp_path, monkeypatch, capsys):
    from sdvg.engines.cache import StaleEngineError

    def stale(args):
        raise StaleEngineError(f"engine {tmp_path} does not match; rebuild")

    monkeypatch.setattr(sys.modules[__name__], "LOAD_PIPELINE", stale)
    assert _main("generate", "--prompt", PROMPT, "--out", str(tmp_path / "v.mp4")) == 2
    assert "does not match" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        _main("generate", "--prompt", PROMPT, "--drafter-device", "meta")
    assert exc.value.code == 2 and "device 'meta'" in capsys.readouterr().err


def test_per_prompt_derived_names_are_checked_against_the_other_outputs(tmp_path, no_model_load, capsys):
    pf = tmp_path / "p.txt"
    pf.write_text("a fox\na cat\n")
    stats = tmp_path / "t_0001.jsonl"
    stats.write_text("")
    assert _main("generate", "--prompts-file", str(pf), "--out", str(tmp_path / "v.mp4"), "--stats", str(stats),
                 "--timeline", str(tmp_path / "t.jsonl")) == 2
    assert "same file" in capsys.readouterr().err
    assert stats.read_text() == ""
