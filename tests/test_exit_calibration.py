"""Calibration of the early-exit verifiers: AUROC and threshold selection (pure functions), and the
`sdvg calibrate-exit` / `sdvg train-exit-head` commands on the tiny random-weight preset."""
import json
import math

import numpy as np
import pytest
import torch

from sdvg.cli import main
from sdvg.evaluation import exit_calibration as ec


# ------------------------------------------------------------------------------------------ pure functions
def test_auroc_hand_computed_cases():
    assert ec.auroc([0.9, 0.8, 0.2, 0.1], [1, 1, 0, 0]) == 1.0
    assert ec.auroc([0.1, 0.2, 0.8, 0.9], [1, 1, 0, 0]) == 0.0
    # pairs (pos, neg): (0.8, 0.5) win, (0.8, 0.9) lose, (0.3, 0.5) lose, (0.3, 0.9) lose -> 1/4
    assert ec.auroc([0.8, 0.3, 0.5, 0.9], [1, 1, 0, 0]) == 0.25
    # ties count one half: pos 0.5 vs neg 0.5 (tie), pos 0.5 vs neg 0.1 (win) -> 1.5 / 2
    assert ec.auroc([0.5, 0.5, 0.1], [1, 0, 0]) == 0.75
    assert ec.auroc([1.0, 1.0, 1.0, 1.0], [1, 0, 1, 0]) == 0.5
    # infinities rank like any value (a block without history scores inf at step 1)
    assert ec.auroc([-math.inf, -math.inf, 2.0], [0, 0, 1]) == 1.0
    assert ec.auroc([0.3, 0.4], [1, 1]) is None and ec.auroc([0.3, 0.4], [0, 0]) is None
    with pytest.raises(ValueError, match="NaN"):
        ec.auroc([float("nan"), 1.0], [1, 0])


def test_auroc_matches_the_pairwise_count():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, 60).astype(float)  # many ties
    y = rng.random(60) < 0.4
    pos, neg = s[y], s[~y]
    pairs = (pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()
    assert ec.auroc(s, y) == pytest.approx(pairs / (len(pos) * len(neg)))


def test_average_ranks_share_ties():
    assert ec.average_ranks([3.0, 1.0, 3.0, 2.0]).tolist() == [3.5, 1.0, 3.5, 2.0]


def test_select_threshold_separable_scores_exit_every_converged_token():
    scores = np.array([0.1, 0.2, 0.3, 0.7, 0.8])
    conv = np.array([1, 1, 1, 0, 0], bool)
    tau = ec.select_threshold(scores, conv, 0.95)
    assert 0.3 < tau < 0.7  # the midpoint between the last converged and the first other score
    assert ec.precision_recall(scores, conv, tau) == {"precision": 1.0, "recall": 1.0, "exit_share": 0.6}
    assert ec.select_threshold(scores, conv, 0.95, rule="f1") == tau


def test_select_threshold_meets_the_precision_goal_with_the_most_exits():
    # sorted by score: precision of the prefixes 1, 1, 2/3, 3/4, 4/5, 4/6
    scores = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    conv = np.array([1, 1, 0, 1, 1, 0], bool)
    tau = ec.select_threshold(scores, conv, 0.8)
    assert 0.5 < tau < 0.6  # precision 4/5: the largest prefix that reaches 0.8 (not only the first two)
    assert ec.precision_recall(scores, conv, tau)["precision"] >= 0.8
    assert 0.2 < ec.select_threshold(scores, conv, 0.9) < 0.3
    # no prefix reaches the goal: nothing exits
    assert ec.select_threshold(np.array([0.1, 0.2]), np.array([0, 1], bool), 0.95) == 0.0
    # every token converged: the threshold lies above the largest finite score, inf scores stay out
    tau = ec.select_threshold(np.array([0.1, 0.2, math.inf]), np.ones(3, bool), 0.95)
    assert 0.2 < tau < 0.21 and ec.precision_recall([0.1, 0.2, math.inf], [1, 1, 1], tau)["recall"] == 2 / 3


def test_select_threshold_is_monotone_in_the_precision_goal():
    rng = np.random.default_rng(1)
    gaps = rng.random(400)
    scores = gaps + 0.3 * rng.random(400)  # informative but noisy
    conv = gaps < 0.4
    taus = [ec.select_threshold(scores, conv, p) for p in (0.5, 0.7, 0.9, 0.99)]
    assert taus == sorted(taus, reverse=True) and taus[0] > taus[-1]
    for p, tau in zip((0.5, 0.7, 0.9, 0.99), taus):
        got = ec.precision_recall(scores, conv, tau)["precision"]
        assert got is None or got >= p


def test_calibrate_on_synthetic_records():
    g = torch.Generator().manual_seed(0)
    gaps = torch.rand((6, 48), generator=g)  # 2 blocks x 3 judged steps
    scores = gaps * 10  # perfectly ordered: AUROC 1; a precision goal of 1 exits exactly the converged tokens
    steps = torch.tensor([0, 1, 2, 0, 1, 2])
    rec = ec.Records(scores, gaps, steps, torch.tensor([0, 0, 0, 1, 1, 1]), torch.zeros(6, dtype=torch.long),
                     (3, 4, 4), 4)
    out = ec.calibrate(rec, 0.5, 1.0)
    assert [s["auroc"] for s in out["steps"]] == [1.0, 1.0, 1.0]
    assert all(s["precision"] == 1.0 and s["recall"] == 1.0 for s in out["steps"])
    assert out["dense_mean_steps"] == pytest.approx(out["oracle_mean_steps"])  # the same first exits
    # a lower goal takes more exits, some wrong: the pooled precision of k >= 2 still meets it
    loose = ec.calibrate(rec, 0.5, 0.9)
    assert loose["thresholds"][0] > out["thresholds"][0] and loose["thresholds"][1] > out["thresholds"][1]
    later = (steps > 0).numpy()
    pooled = ec.precision_recall(scores.numpy()[later].ravel(), (gaps < 0.5).numpy()[later].ravel(),
                                 loose["thresholds"][1])
    assert 0.9 <= pooled["precision"] < 1.0
    for bad in (float("nan"), -0.1):
        with pytest.raises(ValueError, match="eps"):
            ec.calibrate(rec, bad)


# ------------------------------------------------------------------------------------------------ the CLI
TINY = ["--preset", "tiny", "--num-blocks", "3", "--scheduler", "reference", "--quiet"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a cat on a wall\na dog in the rain\na red bird\nwaves at night\n", encoding="utf-8")
    return path


@pytest.mark.slow
def test_calibrate_exit_writes_the_report_and_the_measured_k_bar(tmp_path, prompts_file, capsys):
    out = tmp_path / "cal.json"
    rc = main(["calibrate-exit", *TINY, "--prompts-file", str(prompts_file), "--num-prompts", "2",
               "--exit-eps", "1.5", "--min-precision", "0.6", "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    red, stab = rep["thresholds"]
    assert rep["role"] == "target" and rep["eps"] == 1.5 and rep["num_steps"] == 4
    assert [s["k"] for s in rep["steps"]] == [1, 2, 3]
    assert [s["threshold"] for s in rep["steps"]] == [red, stab, stab]
    assert rep["steps"][0]["no_history_tokens"] == 2 * 48  # block 0 of each video: nothing to compare with
    for s in rep["steps"]:
        assert set(s) >= {"precision", "recall", "auroc", "exit_share", "converged_share"}
        assert s["tokens"] == 2 * 3 * 48
        if s["precision"] is not None:  # the rule's goal, per step (pooled for k >= 2, so checked pooled)
            assert 0 <= s["precision"] <= 1
    assert any(s["auroc"] is not None for s in rep["steps"])
    assert 1.0 <= rep["measured_mean_steps"] <= 4.0 and len(rep["measured_per_video"]) == 2
    assert rep["flags"] == (f"--mode target --early-exit target --exit-verifier stability --exit-thresholds "
                            f"{red!r},{stab!r}")
    assert rep["options"]["mode"] == "target" and rep["options"]["early_exit"] == "target"
    assert capsys.readouterr().out.strip() == rep["flags"]
    if (red, stab) == (0.0, 0.0):
        assert rep["measured_mean_steps"] == 4.0  # thresholds 0 never exit


def test_calibrate_exit_bad_input(tmp_path, prompts_file, capsys):
    out = str(tmp_path / "cal.json")
    assert main(["calibrate-exit", *TINY, "--prompts-file", str(tmp_path / "missing.txt"), "--out", out]) == 2
    assert "missing.txt" in capsys.readouterr().err
    for eps in ("nan", "-0.5"):
        with pytest.raises(SystemExit) as exc:
            main(["calibrate-exit", *TINY, "--prompts-file", str(prompts_file), "--exit-eps", eps, "--out", out])
        assert exc.value.code == 2
        assert "exit_eps" in capsys.readouterr().err
    assert main(["calibrate-exit", *TINY, "--prompts-file", str(prompts_file), "--num-prompts", "9",
                 "--out", out]) == 2
    assert "holds 4 prompts" in capsys.readouterr().err
    assert main(["train-exit-head", *TINY, "--prompts-file", str(prompts_file), "--seeds", "0,1",
                 "--heldout-seeds", "1", "--out", str(tmp_path / "h")]) == 2
    assert "not used in training" in capsys.readouterr().err


TRAIN = [*TINY, "--num-prompts", "2", "--heldout-prompts", "1", "--seeds", "0", "--heldout-seeds", "5",
         "--exit-eps", "1.5", "--checkpoint-every", "50"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, prompts_file):
    """A head trained 200 steps in one run, and one trained 80 steps then resumed to 200."""
    root = tmp_path_factory.mktemp("heads")
    assert main(["train-exit-head", *TRAIN, "--prompts-file", str(prompts_file), "--steps", "200",
                 "--out", str(root / "full")]) == 0
    resumed = root / "resumed"
    resumed.mkdir()
    for name in ("records.safetensors", "heldout.safetensors"):  # the same rollouts, not recorded again
        (resumed / name).write_bytes((root / "full" / name).read_bytes())
    assert main(["train-exit-head", *TRAIN, "--prompts-file", str(prompts_file), "--steps", "80", "--resume",
                 "--out", str(resumed)]) == 0
    first = json.loads((resumed / "train.json").read_text())
    assert main(["train-exit-head", *TRAIN, "--prompts-file", str(prompts_file), "--steps", "200", "--resume",
                 "--out", str(resumed)]) == 0
    return root / "full", resumed, first


@pytest.mark.slow
def test_train_exit_head_lowers_its_loss_and_reports_heldout_auroc(trained):
    full, _, _ = trained
    rep = json.loads((full / "train.json").read_text())
    assert rep["steps_done"] == 200 and rep["resumed_from"] is None
    assert rep["final_loss"] < 0.5 * rep["initial_loss"]
    assert rep["train"]["rows"] == 2 * 3 * 3 and rep["heldout"]["rows"] == 1 * 3 * 3
    for s in rep["heldout"]["steps"]:
        assert {"head_auroc", "stability_auroc", "converged_share"} <= set(s)
    assert any(s["head_auroc"] is not None for s in rep["heldout"]["steps"])
    assert any(s["stability_auroc"] is not None for s in rep["heldout"]["steps"])


@pytest.mark.slow
def test_train_exit_head_resume_continues_to_the_same_head(trained):
    from safetensors.torch import load_file

    full, resumed, first = trained
    rep = json.loads((resumed / "train.json").read_text())
    assert first["steps_done"] == 80 and rep["resumed_from"] == 80 and rep["steps_done"] == 200
    a, b = load_file(str(full / "head.safetensors")), load_file(str(resumed / "head.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert rep["final_loss"] == pytest.approx(json.loads((full / "train.json").read_text())["final_loss"], rel=1e-4)


@pytest.mark.slow
def test_trained_head_loads_and_runs_in_generate(trained, tiny_pipe, tmp_path, capsys):
    from sdvg.models.exit_head import ExitHead

    full, _, _ = trained
    path = full / "head.safetensors"
    head = ExitHead.load(path, dim=tiny_pipe.components.target.config.dim)
    extra = ExitHead.read_extra(path)
    assert extra["training_prompts"] == 2 and extra["steps"] == 200 and extra["generator"]["role"] == "target"
    stats = tiny_pipe.generate("a red bird", tiny_pipe.resolve(ec.role_options(
        _opts(num_blocks=2, scheduler="reference"), "target", 7, exit_verifier="head", exit_head=str(path),
        exit_eps=1.5))).stats
    assert 1.0 <= stats["result"]["mean_steps"] <= 4.0
    assert stats.blocks[0]["exit"]["target"]["verifier"] == "head"
    assert head.num_parameters > 0
    # a head for another width (the drafter's) is refused before anything is generated
    other = tmp_path / "narrow.safetensors"
    ExitHead(type(head.config)(dim=tiny_pipe.components.drafter.config.dim)).save(other)
    video = tmp_path / "v.mp4"
    rc = main(["generate", "--preset", "tiny", "--num-blocks", "2", "--mode", "target", "--early-exit", "target",
               "--exit-verifier", "head", "--exit-head", str(other), "--prompt", "a cat", "--out", str(video),
               "--quiet"])
    assert rc == 2 and "width" in capsys.readouterr().err and not video.exists()


def _opts(**kw):
    from sdvg import GenerationOptions

    return GenerationOptions(**kw)


def test_calibrate_exit_and_train_exit_head_derive_their_flags():
    from sdvg.cli import EXIT_CALIBRATION_EXCLUDE, build_parser
    from sdvg.options import OPTION_NAMES

    sub = {a.dest: a for a in build_parser()._subparsers._group_actions}["command"].choices
    for command in ("calibrate-exit", "train-exit-head"):
        dests = {a.dest for a in sub[command]._actions}
        assert set(OPTION_NAMES) - dests == set(EXIT_CALIBRATION_EXCLUDE), command
