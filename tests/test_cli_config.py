"""--config files, `sdvg config`, and the output flags of `generate`."""
import json
import re

import pytest
import yaml

from sdvg import cli
from sdvg.options import OptionError, load_options_file


def _config(tmp_path, text: str, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_config_sets_defaults_and_flags_win(tmp_path, capsys):
    path = _config(tmp_path, "tau: -inf\nrouter: pattern\npattern: '0110'\nnum_blocks: 4\nrun_ahead: true\n")
    assert cli.main(["config", "--config", str(path), "--seed", "5"]) == 0
    got = yaml.safe_load(capsys.readouterr().out)
    assert got["tau"] == float("-inf") and got["pattern"] == "0110" and got["num_blocks"] == 4
    assert got["run_ahead"] is True and got["seed"] == 5 and got["mode"] == "sdvg"
    assert cli.main(["config", "--config", str(path), "--num-blocks", "2", "--no-run-ahead"]) == 0
    got = yaml.safe_load(capsys.readouterr().out)
    assert got["num_blocks"] == 2 and got["run_ahead"] is False


def test_json_config_and_generate(tmp_path):
    path = _config(tmp_path, json.dumps({"num_blocks": 1, "tau": 0.0}), "c.json")
    assert cli.main(["generate", "--config", str(path), "--prompt", "a cat", "--quiet",
                     "--out", str(tmp_path / "v.mp4"), "--fps", "8", "--crf", "0"]) == 0
    stats = json.loads((tmp_path / "v.json").read_text())
    assert stats["options"]["num_blocks"] == 1 and stats["options"]["tau"] == 0.0


@pytest.mark.parametrize("text,match", [
    ("tau: -0.7\ntemperature: 1\n", "unknown key.*temperature"),
    ("- tau\n", "must hold a mapping"),
    ("tau: nan\n", "NaN"),
    ("pattern: '012'\n", "only 0 and 1"),
    ("seed: -3\n", "seed -3"),
    ("tau: [1\n", "not valid YAML"),
    ("!!python/object/apply:os.system ['true']\n", "not valid YAML"),  # safe_load builds no objects
])
def test_bad_config_files_are_refused_by_name(tmp_path, text, match, capsys):
    path = _config(tmp_path, text)
    with pytest.raises(OptionError, match=match):
        load_options_file(path)
    with pytest.raises(SystemExit) as exc:
        cli.main(["config", "--config", str(path)])
    assert exc.value.code == 2 and str(path) in capsys.readouterr().err


def test_missing_config_and_bad_output_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["config", "--config", str(tmp_path / "none.yaml")])
    assert exc.value.code == 2 and "not found" in capsys.readouterr().err
    for flags, match in ((["--crf", "60"], "must lie in [0, 51]"), (["--fps", "x"], "invalid float")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["generate", "--prompt", "x", *flags])
        assert exc.value.code == 2 and match in capsys.readouterr().err


# ------------------------------------------------------------------ model flags in --config
def _parsed(tmp_path, text: str, *argv):
    from sdvg.cli.args import config_values

    path = tmp_path / "c.yaml"
    path.write_text(text)
    full = ["generate", "--config", str(path), "--prompt", "a cat", *argv]
    return cli.build_parser(config_values(full)).parse_args(full)


def test_config_takes_model_and_placement_flags(tmp_path):
    args = _parsed(tmp_path, "preset: cpu-bench\ndrafter: org/drafter@v1\ndevice: cuda:1\ntarget_device: cuda:2\n"
                             "dtype: bfloat16\noffload_text_encoder: true\ntau: -1.5\n")
    assert (args.preset, args.drafter, args.device, args.target_device) == ("cpu-bench", "org/drafter@v1", "cuda:1",
                                                                          "cuda:2")
    assert args.dtype == "bfloat16" and args.offload_text_encoder is True and args.tau == -1.5
    flags_win = _parsed(tmp_path, "preset: cpu-bench\ndtype: bfloat16\n", "--preset", "tiny", "--dtype", "float32")
    assert (flags_win.preset, flags_win.dtype) == ("tiny", "float32")


@pytest.mark.parametrize("text,match", [
    ("preset: nope\n", "preset: unknown preset 'nope'"),
    ("device: meta\n", "device: .*meta"),
    ("dtype: int8\n", "dtype: 'int8'; choose one of float32"),
    ("offload_text_encoder: 'yes'\n", "offload_text_encoder: 'yes' must be true or false"),
    ("drafter: 3\n", "drafter: 3 is not a path or hub repo"),
    ("gpu: 0\n", "unknown key.*gpu"),
])
def test_bad_model_keys_in_a_config_are_refused_by_name(tmp_path, text, match, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--config", str(path), "--prompt", "a cat"],
                 load_pipeline=lambda args: pytest.fail("a model was loaded"))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and re.search(match, err), err


def test_build_engines_takes_no_loading_flags():
    import argparse

    from sdvg.cli.args import add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p, engines=False, loading=False)
    assert not {"dtype", "offload_text_encoder"} & set(vars(p.parse_args([])))


@pytest.mark.slow
def test_dtype_and_offload_flags_reach_the_pipeline(tmp_path):
    import torch

    from sdvg.cli.pipelines import pipeline_from_flags

    args = cli.build_parser().parse_args(["generate", "--prompt", "a cat", "--dtype", "bfloat16",
                                          "--offload-text-encoder"])
    pipe = pipeline_from_flags(args)
    assert pipe.drafter.dtype == torch.bfloat16 and pipe.text_encoder.offload_device == torch.device("cpu")


@pytest.mark.slow
def test_resume_with_nothing_left_answers_before_loading(tmp_path, tiny_pipe, capsys):
    pf = tmp_path / "p.txt"
    pf.write_text("a fox\na cat\n")
    base = ["generate", "--prompts-file", str(pf), "--num-blocks", "1", "--out", str(tmp_path / "v.mp4"), "--quiet"]
    assert cli.main(base, load_pipeline=lambda args: tiny_pipe) == 0
    capsys.readouterr()
    assert cli.main(base + ["--resume"], load_pipeline=lambda args: pytest.fail("a model was loaded")) == 0
    assert "nothing to resume" in capsys.readouterr().err
    assert cli.main(base + ["--resume", "--tau", "0.5"],  # other options: refused, still before loading
                    load_pipeline=lambda args: pytest.fail("a model was loaded")) == 2
    assert "other options" in capsys.readouterr().err
