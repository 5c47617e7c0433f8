"""--config files, `sdvg config`, and the output flags of `generate`."""
import json

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
    assert stats["num_blocks"] == 1 and stats["tau"] == 0.0


@pytest.mark.parametrize("text,match", [
    ("tau: -0.7\ntemperature: 1\n", "unknown option.*temperature"),
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
