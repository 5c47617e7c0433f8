import csv
import json
import math
import statistics
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from sdvg import cli
from sdvg.evaluation.sweep import (PAPER_TAUS, calibrate_acceptance, calibrate_retention, pareto, read_records,
                                   run_sweep, shard, summarise)
from sdvg.options import GenerationOptions


def _run(*args, load=None):
    """`sdvg ARGS`; `load` (args -> pipeline) replaces loading from the flags."""
    return cli.main(list(args), load_pipeline=load)


def _prompts(tmp_path, text="a cat on a mat\na dog in the park\n", name="p.txt"):
    pf = tmp_path / name
    pf.write_text(text)
    return pf


def _sweep(pf, out, *extra):
    return ["sweep", "--preset", "tiny", "--prompts-file", str(pf), "--num-blocks", "2", "--out", str(out),
            "--quiet", "--no-warmup", *extra]


def _no_model(monkeypatch):
    """Any model load fails: proves an error comes before it."""
    from sdvg.pipeline import SpeculativeVideoPipeline

    def fail(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(SpeculativeVideoPipeline, "from_preset", fail)
    monkeypatch.setattr(SpeculativeVideoPipeline, "from_pretrained", fail)


@pytest.mark.slow
def test_sweep_records_resume_refusal_and_reports(tmp_path, monkeypatch, capsys):
    from sdvg.generation.routers import Router
    from sdvg.models.text_encoder import TextEncoder

    encoded = []  # the prompts the encoder ran on: the calls of `encode` not answered from its cache
    real_encode = TextEncoder.encode

    def encode(self, prompt):
        miss = prompt not in self.cache
        emb = real_encode(self, prompt)
        if miss:
            encoded.append(prompt)
        return emb

    monkeypatch.setattr(TextEncoder, "encode", encode)
    pf = _prompts(tmp_path)
    out = tmp_path / "sweep"
    args = _sweep(pf, out, "--taus=-0.7", "--router", "random", "--accept-prob", "0.5", "--aggregation", "mean")
    assert _run(*args) == 0
    lines = (out / "sweep.rank0.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    assert len(recs) == 2 * 3  # target-only, draft-only and one tau per prompt
    assert sorted((r["prompt_index"], r["mode"]) for r in recs) == [(i, m) for i in (0, 1)
                                                                     for m in ("draft", "sdvg", "target")]
    assert encoded == ["a cat on a mat", "a dog in the park"]  # once per prompt, before the timed runs
    manifest = json.loads((out / "sweep.json").read_text())
    assert manifest["options"]["router"] == "random" and "tau" not in manifest["options"]
    assert manifest["checkpoints"]["target"].startswith("random:tiny")
    for r in recs:
        assert r["options"]["router"] == "random" and r["options"]["accept_prob"] == 0.5
        assert r["options"]["aggregation"] == "mean" and r["options"]["num_blocks"] == 2
        assert {"preset_fingerprint", "checkpoints", "sdvg_version", "prompt_sha256", "wall_s_min",
                "wall_s_median", "quality"} <= set(r)
        if r["mode"] == "sdvg":  # the random router's draw decides block 1, whatever the score
            want = "accepted" if Router("random", -0.7, 0.5, ()).uniform(1, r["options"]["seed"]) < 0.5 else "rejected"
            assert r["decisions"] == ["forced", want]
            assert r["block_scores"][1] == pytest.approx(statistics.mean(r["frame_scores"][1]), abs=1e-6)
    # reports
    rows = list(csv.DictReader((out / "report.csv").open()))
    assert [r["method"] for r in rows] == ["target-only", "draft-only", "SDVG (tau=-0.7)"]
    assert float(rows[0]["speedup"]) == 1.0
    rep = json.loads((out / "report.json").read_text())
    assert rep["retention_kind"] == "difference" and rep["acceptance_by_block"]["blocks"] == [1]
    assert "| SDVG (tau=-0.7) |" in (out / "report.md").read_text()
    for name in ("pareto.png", "acceptance_by_block.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"

    # a crash cut the last line: exactly that pair is redone
    cut = lines[-1]
    (out / "sweep.rank0.jsonl").write_text("\n".join(lines[:-1]) + "\n" + cut[: len(cut) // 2])
    assert _run(*args) == 0
    again = [json.loads(x) for x in (out / "sweep.rank0.jsonl").read_text().splitlines()]
    assert len(again) == 6
    assert sorted((r["prompt_index"], str(r["tau"])) for r in again) == sorted(
        (r["prompt_index"], str(r["tau"])) for r in recs)
    assert again[:5] == recs[:5]

    # another configuration is refused, naming the field, before any model loads
    _no_model(monkeypatch)
    capsys.readouterr()
    assert _run(*[a if a != "mean" else "min" for a in args]) == 2
    assert "options.aggregation" in capsys.readouterr().err
    assert _run(*args, "--seed", "3") == 2
    assert "options.seed" in capsys.readouterr().err
    pf.write_text("a cat on a mat\na bird in the sky\n")
    assert _run(*args) == 2
    assert "prompts_sha256" in capsys.readouterr().err
    pf.write_text("a cat on a mat\na dog in the park\n")
    assert _run(*args) == 0  # the same configuration again: nothing to run, no model loaded


def test_bad_input_fails_before_any_model(tmp_path, monkeypatch, capsys):
    _no_model(monkeypatch)
    pf = _prompts(tmp_path)
    for bad in ("--taus=abc", "--taus=-0.7,x", "--taus="):
        with pytest.raises(SystemExit) as exc:
            _run(*_sweep(pf, tmp_path / "s", bad))
        assert exc.value.code == 2
    empty = _prompts(tmp_path, "", "empty.txt")
    assert _run(*_sweep(empty, tmp_path / "s")) == 2
    assert "no prompt" in capsys.readouterr().err
    legacy = tmp_path / "legacy"  # records without a manifest: their configuration is unknown
    legacy.mkdir()
    (legacy / "sweep.rank0.jsonl").write_text(json.dumps({"prompt_index": 0, "tau": "target", "wall_s": 1.0,
                                                          "quality": 0.0, "acceptance_rate": None}) + "\n")
    assert _run(*_sweep(pf, legacy)) == 2
    assert "sweep.json" in capsys.readouterr().err


def test_taus_paper():
    from sdvg.cli.sweep import unpublished

    args = cli.build_parser().parse_args(["sweep", "--taus", "paper"])
    assert args.taus == [-0.7, -1.0, -1.25, -1.5, -1.75, -2.0, -2.5] == list(PAPER_TAUS)
    assert unpublished(args.taus) == [-1.25, -1.75, -2.0]
    assert unpublished([-0.7, -1.25]) == []  # only `--taus paper` is flagged
    assert cli.build_parser().parse_args(["sweep", "--taus=-inf,0"]).taus == [-math.inf, 0.0]


class _FakePipe:
    """Records every call: generate returns a two-block video with a known wall time."""

    def __init__(self, walls):
        self.calls, self.walls = [], walls if callable(walls) else iter(walls)
        self.components = SimpleNamespace(text_encoder=SimpleNamespace(encode=lambda p: self.calls.append(("encode", p))))

    def provenance(self):
        import sdvg
        from sdvg.config import config_hash, get_preset

        return {"preset_fingerprint": config_hash(get_preset("tiny")), "checkpoints": {"target": "t"}, "devices": {},
                "sdvg_version": sdvg.__version__, "torch_version": torch.__version__}

    def generate(self, prompt, opts):
        self.calls.append((opts.mode, prompt, opts.tau))
        import dataclasses

        from sdvg.config import get_preset

        tiny = get_preset("tiny")
        opts = opts.resolved(dataclasses.replace(tiny, video=dataclasses.replace(tiny.video, num_blocks=2)))
        wall = self.walls(opts) if callable(self.walls) else next(self.walls)
        dec = {"sdvg": "accepted", "target": "target", "draft": "draft"}[opts.mode]
        blocks = [{"score": None, "frame_scores": [], "decision": "forced" if opts.mode == "sdvg" else dec},
                  {"score": 0.0, "frame_scores": [0.0], "decision": dec}]
        stats = SimpleNamespace(wall_s=wall, options=opts, acceptance_rate=1.0 if opts.mode == "sdvg" else None,
                                accepted_blocks=1, blocks=blocks, frames=21, preset="tiny")  # RunStats' attributes
        return SimpleNamespace(stats=stats, frames=torch.zeros(21, 2, 2, 3, dtype=torch.uint8))


def test_warmup_encoding_repeats_and_torn_line(tmp_path):
    pipe = _FakePipe(walls=[9.0] * 3 + [3.0, 1.0, 2.0] * 6)
    recs = run_sweep(pipe, ["p0", "p1"], [-0.7], tmp_path, lambda p, f: -1.0, GenerationOptions(), repeats=3)
    gens = [c for c in pipe.calls if c[0] != "encode"]
    assert gens[:3] == [("target", "p0", -0.7), ("draft", "p0", -0.7), ("sdvg", "p0", -0.7)]  # warm-up, untimed
    assert len(gens) == 3 + 2 * 3 * 3 and len(recs) == 6
    after_warmup = pipe.calls[pipe.calls.index(("encode", "p0")) + 4:]
    for k in range(0, len(after_warmup), 4):  # each variant: encode, then its three timed runs
        assert after_warmup[k][0] == "encode" and all(c[0] != "encode" for c in after_warmup[k + 1:k + 4])
    assert [r["tau"] for r in recs[:3]] == ["target", "draft", -0.7]  # interleaved per prompt
    assert all(r["wall_s_min"] == 1.0 and r["wall_s_median"] == r["wall_s"] == 2.0 for r in recs)
    path = tmp_path / "sweep.rank0.jsonl"
    text = path.read_text()
    path.write_text(text[:-10])  # torn last line
    assert len(read_records(tmp_path)) == 5
    pipe = _FakePipe(walls=[1.0] * 10)
    redo = run_sweep(pipe, ["p0", "p1"], [-0.7], tmp_path, lambda p, f: -1.0, GenerationOptions(), warmup=False)
    assert [(r["prompt_index"], r["tau"]) for r in redo] == [(1, -0.7)]
    assert len(path.read_text().splitlines()) == 6 and len(read_records(tmp_path)) == 6


def test_calibrate_quality_drop(tmp_path, monkeypatch, capsys):
    """--quality-drop D: the fastest tau within D of target-only's quality (a difference for ImageReward)."""
    from sdvg.evaluation import evaluators

    pipe = _FakePipe(walls=lambda o: {"target": 4.0, "draft": 0.5}.get(o.mode, 4.0 + o.tau * 1.5))
    last = lambda: [c for c in pipe.calls if c[0] != "encode"][-1]  # noqa: E731
    monkeypatch.setattr(evaluators, "load_evaluator", lambda spec, p: lambda prompt, frames: (
        -0.5 if last()[0] == "target" else -0.5 + 0.1 * last()[2]))
    pf = _prompts(tmp_path)
    base = ["calibrate", "--preset", "tiny", "--prompts-file", str(pf), "--num-blocks", "2", "--quiet",
            "--no-warmup", "--taus=-2,-1", "--out", str(tmp_path / "cal")]
    assert _run(*base, "--quality-drop", "0.15", load=lambda args: pipe) == 0
    res = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert res["tau"] == -1.0 and res["retention_kind"] == "difference" and res["least_retention"] == -0.15
    assert res["achieved"]["retention"] == pytest.approx(-0.1) and res["achieved"]["speedup"] == pytest.approx(1.6)
    assert not any(r["mode"] == "draft" for r in read_records(tmp_path / "cal"))
    # the calibrated run as a file --config accepts: the model flags, the options given, the tau found
    from sdvg.cli.args import config_values

    cfg = config_values(["generate", "--config", str(tmp_path / "cal" / "config.json")])
    assert cfg["preset"] == "tiny" and cfg["tau"] == -1.0 and cfg["num_blocks"] == 2 and cfg["device"] == "cpu"
    args = cli.build_parser(cfg).parse_args(["generate", "--prompt", "a cat"])
    assert (args.tau, args.num_blocks, args.preset) == (-1.0, 2, "tiny")
    assert _run(*base, "--retention=-0.25", load=lambda args: pipe) == 0  # the same folder: resumed, nothing rerun
    assert json.loads((tmp_path / "cal" / "calibration.json").read_text())["tau"] == -2.0
    assert _run(*base, "--quality-drop", "0.05", load=lambda args: pipe) == 2
    assert "no swept tau" in capsys.readouterr().err


def _rec(i, tau, quality, wall, positive=False, acc=None, decisions=()):
    return {"prompt_index": i, "tau": tau, "quality": quality, "wall_s": wall, "acceptance_rate": acc,
            "quality_positive": positive, "decisions": list(decisions)}


def test_retention_is_a_difference_unless_positive():
    recs = [_rec(0, "target", -0.5, 4.0), _rec(0, "draft", -1.0, 1.0),
            _rec(0, -1.0, -0.8, 2.0, acc=0.5, decisions=["forced", "accepted", "rejected"])]
    s = summarise(recs)
    row = s["taus"][0]
    assert s["retention_kind"] == "difference"
    assert row["retention"] == pytest.approx(-0.3) and row["retention"] < 0  # worse negative score: negative
    assert row["speedup"] == 2.0 and row["acceptance_by_block"] == {"1": 1.0, "2": 0.0}
    assert s["draft"]["retention"] == pytest.approx(-0.5) and s["target"]["retention"] == 0.0
    assert calibrate_retention(s, quality_drop=0.31)["tau"] == -1.0
    with pytest.raises(ValueError) as e:
        calibrate_retention(s, quality_drop=0.29)
    assert all(s in str(e.value) for s in ("no swept tau", "0.29")), e.value
    assert calibrate_retention(s, retention=-0.31)["tau"] == -1.0
    pos = summarise([{**r, "quality": -r["quality"], "quality_positive": True} for r in recs])
    assert pos["retention_kind"] == "ratio" and pos["taus"][0]["retention"] == pytest.approx(0.8 / 0.5)
    assert calibrate_retention(pos, quality_drop=0.0)["tau"] == -1.0


@pytest.mark.slow
def test_calibrate_acceptance(tmp_path, capsys):
    pf = _prompts(tmp_path)
    # under the `own` drafter context the drafts do not depend on tau; their scores move only through the
    # VAE's causal cache, so the rounds land on the goal within one score of the four
    assert _run("calibrate", "--preset", "tiny", "--prompts-file", str(pf), "--acceptance", "0.5",
                "--num-blocks", "3", "--drafter-context", "own", "--out", str(tmp_path / "cal"), "--quiet") == 0
    res = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert res["draft_scores"] == 4 and math.isfinite(res["tau"])
    assert abs(res["achieved_acceptance"] - 0.5) <= 0.25 and res["drafts_independent_of_tau"] is True
    assert "own" in res["note"] and 1 <= len(res["rounds"]) <= 3 and res["options"]["tau"] == res["tau"]
    assert res["achieved_acceptance"] == min((r["achieved_acceptance"] for r in res["rounds"]),
                                             key=lambda a: abs(a - 0.5))


def test_calibrate_for_acceptance_rederives_tau_over_rounds():
    """Under the committed context the drafts depend on the decisions: tau is re-derived from the scores
    drafted under the previous tau, and the round nearest the goal wins."""
    from sdvg.evaluation.calibration import calibrate_for_acceptance

    def generate(prompt, opts):
        scores = [0.1, 0.2] if opts.tau == -math.inf else [0.25, 0.3]  # drafts shift once blocks are rejected
        acc = sum(x >= opts.tau for x in scores) / len(scores)
        blocks = [{"score": None}] + [{"score": x} for x in scores]
        return SimpleNamespace(stats=SimpleNamespace(blocks=blocks, acceptance_rate=acc))

    lines, bars = [], []

    @contextmanager
    def phase(desc, total, unit, initial=0):  # a progress bar per round, over its videos
        bars.append([desc, total, 0])
        yield SimpleNamespace(update=lambda n=1: bars[-1].__setitem__(2, bars[-1][2] + n))

    res = calibrate_for_acceptance(SimpleNamespace(generate=generate), [(0, "a cat"), (1, "a dog")],
                                   GenerationOptions(mode="sdvg", drafter_context="committed"), 0.5, say=lines.append,
                                   phase=phase)
    assert [r["tau"] for r in res["rounds"]] == [0.2, 0.3] and [r["achieved_acceptance"] for r in res["rounds"]] == [
        1.0, 0.5]
    assert res["tau"] == 0.3 and res["options"]["tau"] == 0.3 and res["prompts"] == 2
    assert res["drafts_independent_of_tau"] is False and "committed" in res["note"]
    assert res["draft_scores"] == 4  # the scores tau 0.3 was derived from: round 1's two prompts x two drafts
    assert bars == [["calibrate: every draft scored, all accepted", 2, 2], ["calibrate: check tau=0.2000", 2, 2],
                    ["calibrate: check tau=0.3000", 2, 2]]
    assert lines == ["calibrate: tau=0.2000 gives acceptance 100.0% (goal 50.0%)",
                     "calibrate: tau=0.3000 gives acceptance 50.0% (goal 50.0%)"]


def test_calibrate_for_quality_names_the_goal_and_the_retention_kind():
    from sdvg.evaluation.calibration import calibrate_for_quality

    summary = summarise([_rec(0, "target", -0.5, 4.0), _rec(0, "draft", -1.0, 1.0),
                         _rec(0, -1.0, -0.8, 2.0, acc=0.5, decisions=["forced", "accepted", "rejected"])])
    res = calibrate_for_quality(summary, quality_drop=0.31, unpublished_taus=[-1.25])
    assert res["tau"] == -1.0 and res["goal"] == {"quality_drop": 0.31} and res["least_retention"] == -0.31
    assert res["retention_kind"] == "difference" and "may be negative" in res["note"]
    assert res["achieved"]["speedup"] == 2.0 and res["unpublished_taus"] == [-1.25]
    with pytest.raises(ValueError) as e:
        calibrate_for_quality(summary, retention=0.0)
    assert all(s in str(e.value) for s in ("no swept tau", "retention of 0", "sweep higher taus")), e.value


def test_calibration_math():
    scores = [0.1, 0.2, 0.3, 0.4]
    assert calibrate_acceptance(scores, 0.5) == 0.3
    assert sum(s >= calibrate_acceptance(scores, 0.75) for s in scores) == 3
    assert calibrate_acceptance(scores, 0.0) == math.inf
    rows = {"taus": [{"tau": -1, "retention": 0.9, "speedup": 2.0}, {"tau": 0, "retention": 0.99, "speedup": 1.4},
                     {"tau": 1, "retention": 1.0, "speedup": 1.1}], "quality_positive": True}
    assert calibrate_retention(rows, 0.98)["tau"] == 0
    assert calibrate_retention(rows, quality_drop=0.02)["tau"] == 0
    with pytest.raises(ValueError) as e:
        calibrate_retention(rows, 1.01)
    assert all(s in str(e.value) for s in ("no swept tau", "1.01")), e.value
    front = pareto([{"speedup": 1, "quality": 1}, {"speedup": 2, "quality": 0.5}, {"speedup": 0.5, "quality": 0.4}])
    assert [r["speedup"] for r in front] == [1, 2]


def test_sharding_covers_every_prompt_once():
    prompts = [f"p{i}" for i in range(7)]
    got = sorted(i for r in range(3) for i, _ in shard(prompts, r, 3))
    assert got == list(range(7))
    with pytest.raises(ValueError):
        shard(prompts, 3, 3)


def test_sweep_protocol_paper_sets_the_papers_loop(tmp_path, monkeypatch, capsys):
    """--protocol paper: the paper's options reach every run and the folder's manifest, and the command says
    what it set (a random-weight preset keeps its resolution); explicit flags win."""
    from sdvg.evaluation import evaluators

    pipe = _FakePipe(walls=lambda o: 1.0)
    monkeypatch.setattr(evaluators, "load_evaluator", lambda spec, p: lambda prompt, frames: 0.5)
    seen = []
    real_generate = pipe.generate
    monkeypatch.setattr(pipe, "generate", lambda prompt, opts: (seen.append(opts), real_generate(prompt, opts))[1])
    pf = _prompts(tmp_path)
    assert _run("sweep", "--protocol", "paper", "--preset", "tiny", "--prompts-file", str(pf), "--no-warmup",
                "--taus=-0.7", "--limit", "1", "--out", str(tmp_path / "s"), load=lambda args: pipe) == 0
    err = capsys.readouterr().err
    assert "protocol paper:" in err and "resolution kept at the preset's 64x64" in err
    assert {(o.drafter_context, o.force_first_reject, o.num_blocks, o.seed, o.aggregation) for o in seen} == {
        ("own", True, 9, 42, "min")}
    manifest = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert manifest["options"]["seed"] == 42 and manifest["options"]["num_blocks"] == 9
    seen.clear()
    assert _run("sweep", "--protocol", "paper", "--seed", "7", "--preset", "tiny", "--prompts-file", str(pf),
                "--no-warmup", "--taus=-0.7", "--limit", "1", "--out", str(tmp_path / "s7"), load=lambda args: pipe) == 0
    assert {o.seed for o in seen} == {7}
