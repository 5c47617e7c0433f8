"""The native scheduler (scheduler="cpp") against the reference loop, bitwise."""
import math
import threading

import numpy as np
import pytest
import torch

from sdvg.generation.native import generate_blocks_native
from sdvg.generation.reference import generate_blocks
from sdvg.generation.types import BLOCK_TIME_KEYS, LoopReport
from sdvg.options import GenerationOptions

PROMPT = "a red fox running through fresh snow"
NB = 4

CASES = {
    "tau=+inf": dict(tau=math.inf),
    "tau=-inf": dict(tau=-math.inf),
    "tau=mixed": dict(tau=None),  # set from the reference scores below
    "pattern": dict(router="pattern", pattern=(False, True, False, True)),
    "random": dict(router="random", accept_prob=0.5),
    "eager target commits": dict(tau=None, lazy_target_commit=False),
    "score emitted": dict(tau=None, score_emitted=True),
}


def _run_both(pipe, opts: GenerationOptions, run_ahead: bool = False):
    """The reference loop and the native scheduler on the same resolved options, with their reports."""
    opts = pipe.resolve(opts)
    ref_report, cpp_report = LoopReport(), LoopReport()
    ref = list(generate_blocks(pipe.components, PROMPT, opts, ref_report))
    got = list(generate_blocks_native(pipe.components, PROMPT, opts.replace(run_ahead=run_ahead), cpp_report))
    return ref, got, ref_report, cpp_report


def _same(ref, got):
    """Every field of every block record: bitwise for tensors and scores; stage times by key and sign
    (their values are wall-clock)."""
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert a.index == b.index and a.decision == b.decision
        assert torch.equal(a.latents, b.latents)
        assert torch.equal(a.frames, b.frames)
        assert a.score == b.score and a.frame_scores == b.frame_scores
        assert a.emitted_scores == b.emitted_scores
        assert tuple(a.times) == tuple(b.times) == BLOCK_TIME_KEYS
        assert all(v >= 0 for v in (*a.times.values(), *b.times.values()))
        assert (a.draft_latents is None) == (b.draft_latents is None)
        if a.draft_latents is not None:
            assert torch.equal(a.draft_latents, b.draft_latents)


def _mixed_tau(pipe):
    out = pipe(PROMPT, tau=-math.inf, num_blocks=NB, seed=3, scheduler="reference")
    scores = sorted(b["score"] for b in out.stats["blocks"][1:])
    return (scores[0] + scores[1]) / 2  # rejects the lowest-scoring draft, accepts the rest


# The fast tier keeps the oracle on both decisions and both drafter contexts, one without run-ahead and
# one with it; the other cases run in the whole suite.
FAST_CASES = {(False, "pattern", "committed"), (True, "tau=mixed", "own")}


def _oracle_cases():
    for run_ahead in (False, True):
        for case in CASES:
            for policy in ("committed", "own"):
                yield pytest.param(case, policy, run_ahead, id=f"{run_ahead}-{case}-{policy}",
                                   marks=() if (run_ahead, case, policy) in FAST_CASES else pytest.mark.slow)


@pytest.mark.parametrize("case,policy,run_ahead", list(_oracle_cases()))
def test_cpp_equals_reference(tiny_pipe, case, policy, run_ahead):
    kw = dict(CASES[case])
    if kw.get("tau", 0) is None:
        kw["tau"] = _mixed_tau(tiny_pipe)
    opts = GenerationOptions(num_blocks=NB, seed=3, drafter_context=policy, **kw)
    ref, got, ref_report, cpp_report = _run_both(tiny_pipe, opts, run_ahead)
    _same(ref, got)
    if kw.get("tau") is not None and math.isfinite(kw["tau"]):
        assert {b.decision for b in ref[1:]} == {"accepted", "rejected"}
    if opts.score_emitted:
        assert all(b.emitted_scores for b in ref)
    rc, cc = ref_report.counters, cpp_report.counters
    for k in ("target_forwards", "skipped_target_commits", "skipped_drafter_forwards", "skipped_drafter_commits"):
        assert getattr(rc, k) == getattr(cc, k), k
    if not run_ahead:
        assert rc.drafter_forwards == cc.drafter_forwards
    # the drafter's cache holds the same context at the end
    n = (NB - 1) * 3 * 16
    assert torch.equal(ref_report.drafter_cache.buffer[..., :n, :], cpp_report.drafter_cache.buffer[..., :n, :])


@pytest.mark.slow
def test_eager_target_commits_cost_more_target_forwards(tiny_pipe):
    tau = _mixed_tau(tiny_pipe)
    lazy = _run_both(tiny_pipe, GenerationOptions(num_blocks=NB, seed=3, tau=tau))[2].counters
    eager = _run_both(tiny_pipe, GenerationOptions(num_blocks=NB, seed=3, tau=tau, lazy_target_commit=False))[2]
    # the same decisions; only a trailing run of accepted blocks differs: eager commits them, lazy skips them
    assert eager.counters.target_forwards >= lazy.target_forwards
    assert eager.counters.skipped_target_commits <= lazy.skipped_target_commits


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["target", "draft"])
@pytest.mark.parametrize("run_ahead", [False, True])
def test_single_model_modes(tiny_pipe, mode, run_ahead):
    ref, got, _, _ = _run_both(tiny_pipe, GenerationOptions(mode=mode, num_blocks=3, seed=1), run_ahead)
    _same(ref, got)


@pytest.mark.slow
def test_run_ahead_with_local_window_rolls_back_exactly():
    import dataclasses

    from sdvg import SpeculativeVideoPipeline
    from sdvg.config import KVWindow, get_preset

    preset = dataclasses.replace(get_preset("tiny"), kv_window=KVWindow(window_frames=6, sink_frames=3))
    pipe = SpeculativeVideoPipeline.from_preset(preset)
    opts = GenerationOptions(router="pattern", pattern="010101", num_blocks=6, seed=2, drafter_context="committed")
    ref, got, _, report = _run_both(pipe, opts, run_ahead=True)
    _same(ref, got)
    assert report.counters.redrafts >= 2


@pytest.mark.slow
def test_pipeline_switch_and_stats(tiny_pipe):
    a = tiny_pipe(PROMPT, tau=-0.1, num_blocks=3, seed=0, scheduler="cpp", run_ahead=True)
    b = tiny_pipe(PROMPT, tau=-0.1, num_blocks=3, seed=0, scheduler="reference")
    assert np.array_equal(a.frames, b.frames)
    assert a.stats["options"]["scheduler"] == "cpp"
    assert a.stats["options"]["run_ahead"] is True and a.stats["options"]["backend"] == "eager"
    assert set(a.stats[0]["result"]) >= {"redrafts", "speculative_drafts", "stage_call_s", "main_stage_s"}
    with pytest.raises(ValueError, match="unknown scheduler"):
        tiny_pipe(PROMPT, scheduler="rust")
    with pytest.raises(ValueError, match="unknown backend"):
        tiny_pipe(PROMPT, backend="rust")


@pytest.mark.slow
def test_trace_is_the_same_timeline_in_both_schedulers(tiny_pipe):
    kw = dict(router="pattern", pattern=(False, True, False, True), num_blocks=4, seed=2, drafter_context="committed")
    ref = tiny_pipe(PROMPT, scheduler="reference", **kw).stats
    seq = tiny_pipe(PROMPT, scheduler="cpp", **kw).stats
    ahead = tiny_pipe(PROMPT, scheduler="cpp", run_ahead=True, **kw).stats
    calls = [(x["block"], x["stage"]) for x in ref["trace"]]
    assert calls == [(x["block"], x["stage"]) for x in seq["trace"]]  # the same calls in the same order
    assert calls[:4] == [(0, "target"), (0, "decode"), (0, "drafter_commit"), (0, "target_commit")]
    for stats in (ref, seq, ahead):
        spans = stats["trace"]
        per_block = {}
        for x in spans:
            assert 0 <= x["start_s"] <= x["end_s"] <= stats["result"]["wall_s"]
            per_block.setdefault(x["block"], {}).setdefault(x["stage"], 0.0)
            per_block[x["block"]][x["stage"]] += x["end_s"] - x["start_s"]
        main = sorted((x for x in spans if x["thread"] == "main"), key=lambda x: x["start_s"])
        assert all(a["end_s"] <= b["start_s"] + 1e-9 for a, b in zip(main, main[1:]))  # one call at a time
        for blk in stats["blocks"]:
            for stage, secs in per_block[blk["index"]].items():
                if stats is ahead:
                    # an emitted block's times are those known when it was emitted: under run-ahead the
                    # drafter thread may still be committing it, so they never exceed the traced total
                    assert blk["times"][stage] <= secs + 1e-6
                else:  # sequential: every call for a block ends before it is emitted, so they add up
                    assert blk["times"][stage] == pytest.approx(secs, rel=1e-6, abs=1e-6)
    assert {x["thread"] for x in ahead["trace"]} == {"main", "drafter"}
    assert {x["stage"] for x in ahead["trace"] if x["thread"] == "drafter"} == {"draft", "drafter_commit"}
    # the speculative commit of rejected block 2 and the redraft of block 3 are on the timeline too
    assert sum((x["block"], x["stage"]) == (3, "draft") for x in ahead["trace"]) == 1 + ahead["result"]["redrafts"]


@pytest.mark.slow
def test_consumer_thread_streams_without_deadlock(tiny_pipe):
    got, errors = [], []

    def consume():
        try:
            for block in tiny_pipe.stream(PROMPT, num_blocks=4, seed=1, run_ahead=True, tau=-0.1):
                got.append(block.index)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=consume)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "streaming consumer deadlocked"
    assert not errors and got == [0, 1, 2, 3]


def test_consumer_leaving_early_stops_the_scheduler(tiny_pipe):
    gen = tiny_pipe.stream(PROMPT, num_blocks=5, seed=1, run_ahead=True, tau=-0.1)
    first = next(gen)
    assert first.index == 0
    gen.close()  # cancels and joins the scheduler thread
    assert not any(t.name == "sdvg-scheduler" and t.is_alive() for t in threading.enumerate())


def _fake_run(stages, run_ahead: bool, **kw):
    from sdvg.generation.fake_stages import fake_scheduler

    kw.setdefault("drafter_context", "committed")
    sched = fake_scheduler(stages, GenerationOptions(num_blocks=6, tau=0.0, run_ahead=run_ahead, **kw))
    sched.run()
    return sched


def test_run_ahead_drafts_on_the_drafter_thread():
    from sdvg.generation.fake_stages import FakeStages

    s = FakeStages(costs=0.002)
    sched = _fake_run(s, run_ahead=True)
    assert [r.decision for r in s.emitted] == ["forced"] + ["accepted"] * 5
    c, trace = sched.counters(), sched.trace()
    assert c.speculative_drafts >= 1 and c.redrafts == 0
    assert {x["stage"] for x in trace if x["thread"] == "drafter"} == {"draft", "drafter_commit"}
    assert {x["stage"] for x in trace if x["thread"] == "main"} >= {"target", "decode", "score"}
    seq = FakeStages(costs=0.002)
    sched = _fake_run(seq, run_ahead=False)
    assert sched.counters().speculative_drafts == 0 and {x["thread"] for x in sched.trace()} == {"main"}
    assert [r.decision for r in seq.emitted] == [r.decision for r in s.emitted]


def test_stage_exception_surfaces_with_its_message():
    from sdvg.generation.fake_stages import FakeStages

    for run_ahead in (False, True):
        with pytest.raises(RuntimeError, match="draft of block 3 failed"):
            _fake_run(FakeStages(fail_at=3), run_ahead=run_ahead)


def test_fake_stages_refuse_unknown_stage_costs():
    from sdvg.generation.fake_stages import FakeStages

    with pytest.raises(ValueError, match="unknown stages"):
        FakeStages(costs={"drafter": 1.0})
