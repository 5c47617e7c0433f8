import json
import math

import pytest

from sdvg import cli
from sdvg.evaluation.sweep import calibrate_acceptance, calibrate_retention, pareto, shard


def _run(*args):
    return cli.main(list(args))


def test_sweep_resume_and_pareto(tmp_path, capsys):
    pf = tmp_path / "p.txt"
    pf.write_text("a cat on a mat\na dog in the park\n")
    out = tmp_path / "sweep"
    args = ["sweep", "--preset", "tiny", "--prompts-file", str(pf), "--taus=-inf,0.0", "--num-blocks", "2",
            "--out", str(out), "--quiet"]
    assert _run(*args) == 0
    lines = (out / "sweep.rank0.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 3  # target baseline + two taus per prompt
    summary = json.loads((out / "summary.json").read_text())
    rows = {float(r["tau"]): r for r in summary["taus"]}  # strict JSON: -inf is written "-inf"
    assert rows[-math.inf]["acceptance"] == 1.0
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    # resuming with one more tau runs only the new pairs
    assert _run(*[a if not a.startswith("--taus=") else "--taus=-inf,0.0,1.0" for a in args]) == 0
    lines = (out / "sweep.rank0.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 4
    assert sum(json.loads(x)["tau"] == 1.0 for x in lines) == 2
    assert all("Infinity" not in x and "NaN" not in x for x in lines)


def test_calibrate_acceptance(tmp_path, capsys):
    pf = tmp_path / "p.txt"
    pf.write_text("a cat on a mat\na dog in the park\n")
    # under the `own` drafter context the drafts do not depend on tau, so calibration is exact
    assert _run("calibrate", "--preset", "tiny", "--prompts-file", str(pf), "--acceptance", "0.5",
                "--num-blocks", "3", "--drafter-context", "own", "--out", str(tmp_path / "cal")) == 0
    res = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert res["draft_scores"] == 4 and math.isfinite(res["tau"])
    assert res["achieved_acceptance"] == 0.5


def test_calibration_math():
    scores = [0.1, 0.2, 0.3, 0.4]
    assert calibrate_acceptance(scores, 0.5) == 0.3
    assert sum(s >= calibrate_acceptance(scores, 0.75) for s in scores) == 3
    assert calibrate_acceptance(scores, 0.0) == math.inf
    rows = {"taus": [{"tau": -1, "retention": 0.9, "speedup": 2.0}, {"tau": 0, "retention": 0.99, "speedup": 1.4},
                     {"tau": 1, "retention": 1.0, "speedup": 1.1}]}
    assert calibrate_retention(rows, 0.98)["tau"] == 0
    with pytest.raises(ValueError, match="no swept tau"):
        calibrate_retention(rows, 1.01)
    front = pareto([{"speedup": 1, "quality": 1}, {"speedup": 2, "quality": 0.5}, {"speedup": 0.5, "quality": 0.4}])
    assert [r["speedup"] for r in front] == [1, 2]


def test_sharding_covers_every_prompt_once():
    prompts = [f"p{i}" for i in range(7)]
    got = sorted(i for r in range(3) for i, _ in shard(prompts, r, 3))
    assert got == list(range(7))
    with pytest.raises(ValueError):
        shard(prompts, 3, 3)
