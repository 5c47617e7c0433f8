"""Bad input to the CLI and the config readers (docs/invariants.md, "Bad input"): sizes that cannot wrap past 2^63,
numeric options bounded at parse time, bounded config parsing (billion laughs, duplicates, anchors, nesting, types),
prompts files and text that is not UTF-8, engine refusals and odd devices exiting 2, and an infinite --tau recorded
and resumed. Each needs no model but the last (`tiny`)."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from sdvg import cli

PROMPT = "a paper boat on a rainy street"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


LOAD_PIPELINE = None  # what `_main` loads a pipeline with (None: the CLI's own); `no_model_load` (conftest) swaps it


def _main(*argv) -> int:
    return cli.main(list(argv), load_pipeline=LOAD_PIPELINE)


# ------------------------------------------------------------------ 1. sizes that cannot wrap
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


# ------------------------------------------------------------------ 2. bounded parsing
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


# ------------------------------------------------------------------ 3. text input
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


# ------------------------------------------------------------------ 4. exit statuses and recorded options
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
