"""The command line answers at once: bad arguments, presets and output paths are refused before torch is
imported (exit 2, naming the value and the fix, a close name offered); `--version`; `python -m sdvg`; the
default output shown in --help; an existing output kept (the run takes the next free name, or --overwrite);
a missing output folder refused unless --create-dirs. The timing against `import torch` is
benchmarks/startup.py's."""
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import sdvg
from sdvg.cli import main

ROOT = Path(__file__).resolve().parents[1]

# argv -> what stderr must say; all refused with exit 2 in one fresh interpreter that never imports torch
REFUSALS = {
    ("generate", "--preset", "tinyy", "--prompt", "a fox"): "argument --preset: unknown preset 'tinyy' (did you "
                                                            "mean 'tiny'?); choose one of",
    ("generate", "--preset", "tiny"): "give --prompt TEXT, --prompts-file FILE or --prompt-schedule FILE",
    ("generate", "--prompt", "a fox", "--out", "a.avi"): "--out a.avi must end in .mp4",
    ("generate", "--promt", "a fox"): "sdvg generate: error: unrecognized arguments: --promt a fox (did you mean "
                                      "'--prompt'",
    ("generate", "--prompt", "a fox", "--out", "missing/dir/a.mp4"): "missing/dir/a.mp4: the folder missing/dir does "
                                                                     "not exist; create it (mkdir -p missing/dir) or "
                                                                     "pass --create-dirs",
    ("generate", "--prompt", "a fox", "--mode", "sdgv"): "invalid choice: 'sdgv' (did you mean 'sdvg'?)",
    ("generat", "--prompt", "a fox"): "invalid choice: 'generat' (did you mean 'generate'?)",
    ("download", "wan21"): "(did you mean 'wan2.1'?)",
}
PROBE = """
import contextlib, io, json, sys
from sdvg.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    out.append([code, err.getvalue()])
print(json.dumps({"runs": out, "torch": "torch" in sys.modules}))
"""


def test_bad_input_is_refused_before_torch_is_imported(tmp_path):
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps([list(a) for a in REFUSALS])], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    for (argv, says), (code, err) in zip(REFUSALS.items(), got["runs"]):
        assert code == 2 and says in err, (argv, code, err)
        assert "loading" not in err and "Traceback" not in err, err
        assert len(err.splitlines()) <= 3, err  # the error, and a one-line usage at most: no wall of flags
    assert got["torch"] is False  # nothing above imported torch
    assert not (tmp_path / "missing").exists()  # a refused folder is not created


def test_version_and_python_m_sdvg(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sdvg", "--version"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0
    assert r.stdout.strip() == (f"sdvg {sdvg.__version__} (Python {platform.python_version()}, torch "
                                f"{metadata.version('torch')})")
    r = subprocess.run([sys.executable, "-m", "sdvg", "generate", "--preset", "nope", "--prompt", "x"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2 and "unknown preset 'nope'" in r.stderr


def test_help_shows_the_default_output_and_what_happens_to_an_existing_one(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the MP4 (default: video.mp4 in the current folder;" in text
    assert "--overwrite replace outputs that exist; without it an existing output is kept" in text
    assert "--create-dirs create the outputs' missing folders (without it a missing folder is refused)" in text


def _names(tmp_path, *flags, indices=range(0, 1), many=False):
    from sdvg.cli.generate_outputs import output_names
    from sdvg.cli.main import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "a fox", *flags])
    out, stats = output_names(args, indices, many)
    return out, stats, args


def test_an_existing_output_is_kept_and_the_run_takes_the_next_free_names(tmp_path, capsys):
    out = tmp_path / "fox.mp4"
    first = _names(tmp_path, "--out", str(out), "--timeline", str(tmp_path / "t.png"))
    assert first[:2] == (out, tmp_path / "fox.json") and capsys.readouterr().err == ""  # nothing there: as given
    (tmp_path / "fox.json").write_text("{}")  # the stats of an earlier run: its video and stats are both kept
    moved, stats, args = _names(tmp_path, "--out", str(out), "--timeline", str(tmp_path / "t.png"))
    assert (moved, stats, args.timeline) == (tmp_path / "fox-1.mp4", tmp_path / "fox-1.json", str(tmp_path / "t-1.png"))
    assert (f"{tmp_path / 'fox.json'} exists: kept; this run writes {tmp_path / 'fox-1.mp4'} and "
            f"{tmp_path / 'fox-1.json'} instead (--overwrite replaces the old ones)") in capsys.readouterr().err
    (tmp_path / "t-1.png").write_bytes(b"")  # any output of the numbered set taken: the next set
    assert _names(tmp_path, "--out", str(out), "--timeline", str(tmp_path / "t.png"))[0] == tmp_path / "fox-2.mp4"
    assert _names(tmp_path, "--out", str(out), "--overwrite")[:2] == (out, tmp_path / "fox.json")
    # a prompts file: one video per line, <stem>_<line>.mp4; --resume continues the files it finds
    (tmp_path / "v_0003.mp4").write_bytes(b"")
    many = _names(tmp_path, "--out", str(tmp_path / "v.mp4"), indices=range(2, 5), many=True)
    assert many[:2] == (tmp_path / "v-1.mp4", tmp_path / "v-1.jsonl") and "v-1_NNNN.mp4" in capsys.readouterr().err
    resumed = _names(tmp_path, "--out", str(tmp_path / "v.mp4"), "--resume", indices=range(2, 5), many=True)
    assert resumed[:2] == (tmp_path / "v.mp4", tmp_path / "v.jsonl")


def test_missing_folders_are_created_only_with_create_dirs(tmp_path, capsys):
    def loader(args):
        raise ValueError("stub loader: the checks passed")

    out = tmp_path / "new" / "deeper" / "a.mp4"
    assert main(["generate", "--prompt", "a fox", "--out", str(out)], load_pipeline=loader) == 2
    assert "does not exist; create it (mkdir -p" in capsys.readouterr().err and not (tmp_path / "new").exists()
    assert main(["generate", "--prompt", "a fox", "--out", str(out), "--create-dirs"], load_pipeline=loader) == 2
    assert "stub loader: the checks passed" in capsys.readouterr().err and out.parent.is_dir()


@pytest.mark.slow
def test_the_readme_first_command_runs_twice_in_a_fresh_folder(tmp_path, monkeypatch):
    from test_readme_examples import command_lines

    (where, argv), *_ = command_lines()
    assert where == "README.md:4" and argv[:1] == ["generate"] and "--create-dirs" in argv
    monkeypatch.chdir(tmp_path)  # a fresh clone has no out/
    assert main(argv) == 0 and main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.endswith(".lock")) == [
        "fox-1.json", "fox-1.mp4", "fox.json", "fox.mp4"]


@pytest.mark.slow  # times `import torch` in a subprocess; the refusal before torch is checked by the tests above
def test_the_startup_benchmark_times_a_refusal_against_import_torch(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import startup

    res = startup.main(["--repeats", "1", "--cases", f"import torch,{startup.BAD_PRESET}", "--out", str(tmp_path)])
    bad = res["rows"][startup.BAD_PRESET]
    assert res["rows"]["import torch"]["imports_torch"] and not bad["imports_torch"]
    assert bad["exit"] == 2 and not bad["loading_line"] and "did you mean 'tiny'" in bad["said"]
    assert res["check"]["passed"] and res["check"]["ratio"] < 0.6  # ~0.1 measured; torch alone takes ~2 s
    assert "Check: a bad preset refused in" in (tmp_path / "results.md").read_text()
