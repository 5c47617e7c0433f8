"""The native scheduler (scheduler="cpp") against the reference loop, bitwise."""
import math
import threading
import time

import pytest
import torch

from sdvg._native import _C
from sdvg.cpp_backend import generate_blocks_cpp
from sdvg.reference import generate_blocks

PROMPT = "a red fox running through fresh snow"
NB = 4

CASES = {
    "tau=+inf": dict(tau=math.inf),
    "tau=-inf": dict(tau=-math.inf),
    "tau=mixed": dict(tau=None),  # set from the reference scores below
    "pattern": dict(router="pattern", pattern=(False, True, False, True)),
    "random": dict(router="random", accept_prob=0.5),
}


def _same(ref, got):
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert a.index == b.index and a.decision == b.decision
        assert torch.equal(a.latents, b.latents)
        assert torch.equal(a.frames, b.frames)
        assert a.score == b.score and a.frame_scores == b.frame_scores
        assert (a.draft_latents is None) == (b.draft_latents is None)
        if a.draft_latents is not None:
            assert torch.equal(a.draft_latents, b.draft_latents)


def _mixed_tau(pipe):
    out = pipe(PROMPT, tau=-math.inf, num_blocks=NB, seed=3, scheduler="reference")
    scores = sorted(b["score"] for b in out.stats["blocks"][1:])
    return (scores[0] + scores[1]) / 2  # rejects the lowest-scoring draft, accepts the rest


@pytest.mark.parametrize("policy", ["committed", "own"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("run_ahead", [False, True])
def test_cpp_equals_reference(tiny_pipe, case, policy, run_ahead):
    kw = dict(CASES[case])
    if kw.get("tau", 0) is None:
        kw["tau"] = _mixed_tau(tiny_pipe)
    cfg = tiny_pipe.make_config(num_blocks=NB, seed=3, drafter_context=policy, **kw)
    ref_counts, cpp_counts = {}, {}
    ref = list(generate_blocks(tiny_pipe.components, PROMPT, cfg, ref_counts))
    got = list(generate_blocks_cpp(tiny_pipe.components, PROMPT, cfg, cpp_counts, run_ahead=run_ahead))
    _same(ref, got)
    if case == "tau=mixed":
        assert {b.decision for b in ref[1:]} == {"accepted", "rejected"}
    for k in ("target_forwards", "skipped_target_commits", "skipped_drafter_forwards"):
        assert ref_counts[k] == cpp_counts[k], k
    if not run_ahead:
        assert ref_counts["drafter_forwards"] == cpp_counts["drafter_forwards"]
    # the drafter's cache holds the same context at the end
    n = (NB - 1) * 3 * 16
    assert torch.equal(ref_counts["drafter_cache"].buffer[..., :n, :], cpp_counts["drafter_cache"].buffer[..., :n, :])


@pytest.mark.parametrize("mode", ["target", "draft"])
@pytest.mark.parametrize("run_ahead", [False, True])
def test_single_model_modes(tiny_pipe, mode, run_ahead):
    cfg = tiny_pipe.make_config(mode=mode, num_blocks=3, seed=1)
    _same(list(generate_blocks(tiny_pipe.components, PROMPT, cfg)),
          list(generate_blocks_cpp(tiny_pipe.components, PROMPT, cfg, run_ahead=run_ahead)))


def test_run_ahead_with_local_window_rolls_back_exactly():
    import dataclasses

    from sdvg import SpeculativeVideoPipeline
    from sdvg.config import KVWindow, get_preset

    preset = dataclasses.replace(get_preset("tiny"), kv_window=KVWindow(window_frames=6, sink_frames=3))
    pipe = SpeculativeVideoPipeline.from_preset(preset)
    cfg = pipe.make_config(router="pattern", pattern=(False, True, False, True, False, True), num_blocks=6, seed=2)
    counts = {}
    got = list(generate_blocks_cpp(pipe.components, PROMPT, cfg, counts, run_ahead=True))
    _same(list(generate_blocks(pipe.components, PROMPT, cfg)), got)
    assert counts["redrafts"] >= 2


def test_pipeline_switch_and_stats(tiny_pipe):
    a = tiny_pipe(PROMPT, tau=-0.1, num_blocks=3, seed=0, scheduler="cpp", run_ahead=True)
    b = tiny_pipe(PROMPT, tau=-0.1, num_blocks=3, seed=0, scheduler="reference")
    assert torch.equal(a.frames, b.frames)
    assert a.stats["scheduler"] == "cpp" and a.stats["run_ahead"] is True and a.stats["backend"] == "eager"
    assert set(a.stats) >= {"redrafts", "speculative_drafts", "scheduler_wall_s", "stage_call_s"}
    with pytest.raises(ValueError, match="unknown scheduler"):
        tiny_pipe(PROMPT, scheduler="rust")
    with pytest.raises(ValueError, match="unknown backend"):
        tiny_pipe(PROMPT, backend="rust")


def test_trace_is_the_same_timeline_in_both_schedulers(tiny_pipe):
    kw = dict(router="pattern", pattern=(False, True, False, True), num_blocks=4, seed=2)
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
            assert 0 <= x["start_s"] <= x["end_s"] <= stats["wall_s"]
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
    assert sum((x["block"], x["stage"]) == (3, "draft") for x in ahead["trace"]) == 1 + ahead["redrafts"]


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


class _SleepStages:
    """Stages that only sleep (releasing the GIL), with a stage that may fail."""

    def __init__(self, d=0.02, fail_at=None):
        self.d, self.fail_at, self.emitted, self.calls = d, fail_at, [], []

    def _work(self, name, b=None):
        self.calls.append((name, b))
        time.sleep(self.d)

    def draft(self, b):
        if b == self.fail_at:
            raise RuntimeError(f"draft of block {b} failed")
        self._work("draft", b)
        return torch.tensor([float(b)])

    def drafter_commit(self, b, x):
        self._work("drafter_commit", b)

    def target(self, b):
        self._work("target", b)
        return torch.tensor([-float(b)])

    def target_commit(self, b, x):
        self._work("target_commit", b)

    def decode(self, x):
        self._work("decode")
        return x * 2

    def score(self, frames):
        return 1.0, [1.0, 2.0]

    def vae_snapshot(self):
        return 0

    def vae_restore(self, s):
        pass

    def emit(self, rec):
        self.emitted.append(rec)


def _sched(stages, **cfg):
    base = dict(mode="sdvg", num_blocks=6, frames_per_block=3, num_steps=4, router="reward", tau=0.0)
    base.update(cfg)
    cpu = torch.device("cpu")
    return _C.Scheduler(base, stages, None, None, cpu, cpu)


def test_run_ahead_overlaps_drafter_with_main_stages():
    s = _SleepStages()
    sched = _sched(s, run_ahead=True)
    sched.run()
    c = sched.counters()
    assert [r["decision"] for r in s.emitted] == ["forced"] + ["accepted"] * 5
    # Time inside stage calls exceeds the wall time only if two stages ran at once.
    assert c["stage_call_s"] > c["scheduler_wall_s"] * 1.1
    seq = _SleepStages()
    sched = _sched(seq, run_ahead=False)
    sched.run()
    assert sched.counters()["stage_call_s"] <= sched.counters()["scheduler_wall_s"]


def test_stage_exception_surfaces_with_its_message():
    s = _SleepStages(d=0.0, fail_at=3)
    for run_ahead in (False, True):
        with pytest.raises(RuntimeError, match="draft of block 3 failed"):
            _sched(s, run_ahead=run_ahead).run()


def test_bad_scheduler_config():
    with pytest.raises(ValueError, match="num_blocks"):
        _sched(_SleepStages(), num_blocks=0)
    with pytest.raises(ValueError, match="unknown router"):
        _sched(_SleepStages(), router="oracle")
