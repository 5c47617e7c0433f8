"""Live sessions on the native scheduler (`scheduler="cpp"`): the same video as the reference loop, bitwise,
with the prompt, router and seed changing between blocks, re-cache on, run-ahead on and off, both drafter
contexts; updates sent from another thread while the scheduler runs ahead replay bitwise from the recorded
schedule (docs/live.md)."""
import threading
import time

import pytest
import torch

# windowed full contexts (re-cache runs on both roles), the pattern router (known rejections before each switch)
KW = dict(seed=5, target_context="full", drafter_cache="full", window_frames=6, sink_frames=3, router="pattern",
          pattern="0101101", interp_blocks=2)
# a blend towards "an owl" from block 2 (weights 0, 1: re-cache at 3), "a cat" at once at 5 (re-cache at 5), the
# reward router from 6, a restart with a new seed at 7
SCHEDULE = [(0, "a red fox"), {"block": 2, "prompt": "an owl"}, {"block": 5, "prompt": "a cat", "interp_blocks": 1},
            {"block": 6, "router": "reward", "tau": -0.7}, {"block": 7, "seed": 11}]
# (the drafter's forwards also count a committed run-ahead's speculative commits undone after a rejection)
FORWARDS = ("target_forwards", "skipped_drafter_forwards", "skipped_target_commits", "skipped_drafter_commits")


def _run(pipe, num_blocks=9, schedule=SCHEDULE, **kw):
    return pipe(prompt_schedule=schedule, num_blocks=num_blocks, output_type="uint8", **{**KW, **kw})


def _assert_same_video(native, ref):
    assert torch.equal(native.latents, ref.latents) and torch.equal(native.frames, ref.frames)
    nb, rb = native.blocks[0], ref.blocks[0]
    assert [b.decision for b in nb] == [b.decision for b in rb]
    assert [b.live for b in nb] == [b.live for b in rb]  # blend weights, segments, forced, re-cache forwards
    assert [b.score for b in nb] == [b.score for b in rb]
    ns, rs = native.stats, ref.stats
    assert {k: ns.counters[k] for k in FORWARDS} == {k: rs.counters[k] for k in FORWARDS}
    speculative = native.stats.options.run_ahead and native.stats.options.drafter_context == "committed"
    extra = ns.counters["drafter_forwards"] - rs.counters["drafter_forwards"]
    assert extra >= 0 if speculative else extra == 0
    for key in ("updates", "segments", "recache_forwards", "prompts", "blocks_started"):
        assert ns.extra[key] == rs.extra[key], key
    assert len(ns.blocks) == len(nb) and all(b["times"]["draft"] >= 0 for b in ns.blocks)


def test_a_native_session_equals_the_reference_loop_on_a_short_switch(tiny_pipe):
    """The fast tier's oracle: committed context, run-ahead, block 1 rejected and a switch at block 2, drafted (not
    forced): the run-ahead drafter waits for block 1's decision before it re-caches, instead of speculating."""
    schedule = [(0, "a red fox"), {"block": 2, "prompt": "an owl", "interp_blocks": 1}]
    kw = dict(num_blocks=3, schedule=schedule, pattern="001", drafter_context="committed",
              force_reject_after_switch=False)
    ref = _run(tiny_pipe, scheduler="reference", **kw)
    native = _run(tiny_pipe, scheduler="cpp", run_ahead=True, **kw)
    _assert_same_video(native, ref)
    assert [b.decision for b in ref.blocks[0]] == ["forced", "rejected", "accepted"]
    assert [b.live["recache_forwards"] for b in ref.blocks[0]] == [0, 0, 1]  # the drafter's, for block 2
    # no speculative draft of block 2 over block 1's commit, so nothing was rolled back or drafted twice
    assert native.stats.counters["speculative_drafts"] == 0 and native.stats.counters["redrafts"] == 0


def test_a_forced_switch_block_is_emitted_with_the_drafters_recache(tiny_pipe, monkeypatch):
    """Committed run-ahead, a forced switch block (no draft): the lane re-caches the drafter for it beside the
    target's block, and the block waits for that re-cache before it is emitted, so its record counts both
    roles' re-cache forwards as the reference loop's does, however slow the drafter's re-cache (made slow here;
    before, it landed on the next block's record whenever the block was emitted first)."""
    from sdvg.generation.role_model import RoleModel

    recache = RoleModel.recache

    def slow_recache(self, text_kv):
        if self.role == "drafter":
            time.sleep(0.5)
        recache(self, text_kv)

    schedule = [(0, "a red fox"), {"block": 2, "prompt": "an owl", "interp_blocks": 1}]
    kw = dict(num_blocks=4, schedule=schedule, pattern="0111", drafter_context="committed")
    ref = _run(tiny_pipe, scheduler="reference", **kw)
    monkeypatch.setattr(RoleModel, "recache", slow_recache)  # the native run's drafter re-cache only
    native = _run(tiny_pipe, scheduler="cpp", run_ahead=True, **kw)
    _assert_same_video(native, ref)
    assert [b.decision for b in ref.blocks[0]] == ["forced", "accepted", "forced", "accepted"]
    assert [b.live["recache_forwards"] for b in native.blocks[0]] == [0, 0, 2, 0]  # the target's and the drafter's


@pytest.mark.slow
@pytest.mark.parametrize("force_after_switch", [True, False])
def test_native_sessions_equal_the_reference_loop_bitwise(tiny_pipe, force_after_switch):
    ref = _run(tiny_pipe, scheduler="reference", force_reject_after_switch=force_after_switch)
    decisions = [b.decision for b in ref.blocks[0]]
    assert "rejected" in decisions and "accepted" in decisions and ref.stats.extra["segments"] == 2
    assert ref.stats.extra["recache_forwards"] > 0
    for context, run_ahead in (("own", True), ("committed", False), ("committed", True)):
        native = _run(tiny_pipe, scheduler="cpp", run_ahead=run_ahead, drafter_context=context,
                      force_reject_after_switch=force_after_switch)
        ref_c = ref if context == "own" else _run(tiny_pipe, scheduler="reference", drafter_context=context,
                                                  force_reject_after_switch=force_after_switch)
        _assert_same_video(native, ref_c)


@pytest.mark.slow
def test_a_native_video_to_video_session_equals_the_reference_loop(tiny_pipe):
    v = tiny_pipe.preset.video
    frames = torch.randint(0, 256, (60, v.height, v.width, 3), generator=torch.Generator().manual_seed(3),
                           dtype=torch.uint8).numpy()
    kw = dict(num_blocks=5, schedule=[(0, "a red fox"), {"block": 2, "prompt": "an owl", "interp_blocks": 1}],
              input_video=frames, strength=0.7, drafter_context="committed", force_reject_after_switch=False)
    ref = _run(tiny_pipe, scheduler="reference", **kw)
    native = _run(tiny_pipe, scheduler="cpp", run_ahead=True, **kw)
    _assert_same_video(native, ref)


@pytest.mark.slow
@pytest.mark.parametrize("run_ahead", [False, True])
def test_updates_sent_while_the_native_scheduler_runs_ahead_replay_bitwise(tiny_pipe, run_ahead):
    """The scheduler may have started blocks the consumer has not seen: every ack names the block the update
    really took effect at, and the recorded schedule replays the video on the reference loop and on the native
    scheduler."""
    kw = {**KW, "router": "reward", "tau": -0.7, "drafter_context": "committed"}
    session = tiny_pipe.session("a red fox", num_blocks=8, scheduler="cpp", run_ahead=run_ahead, **kw)
    acks, seen = [], []
    for b in session:
        seen.append(b)
        if len(seen) == 1:
            acks.append(session.update(prompt="an owl at night"))
        elif len(seen) == 3:
            acks.append(threading_update(session, seed=11, prompt="a cat"))
        elif len(seen) == 5:
            acks.append(session.update(tau=float("inf")))  # every draft rejected from its block on
    started = session.stats.extra["blocks_started"]
    assert started == 8 and len(seen) == 8
    blocks = [a.block for a in acks]
    assert blocks == sorted(blocks) and blocks[0] >= 1  # each at a block not yet started when it was sent
    for run in ({"scheduler": "reference"}, {"scheduler": "cpp", "run_ahead": run_ahead}):
        replay = tiny_pipe(prompt_schedule=[(0, "a red fox")] + session.stats.extra["updates"], num_blocks=8,
                           output_type="latent", **run, **kw)
        assert torch.equal(torch.cat([b.latents for b in seen], dim=2), replay.latents), run
        assert [b.live for b in seen] == [b.live for b in replay.blocks[0]], run
    assert all(b.decision in ("forced", "rejected") for b in seen if b.live["block"] >= acks[2].block)


def threading_update(session, **kw):
    """An update from another thread, as a server's event loop sends it."""
    out = []
    t = threading.Thread(target=lambda: out.append(session.update(**kw)))
    t.start()
    t.join(30)
    return out[0]


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["reference"])  # the native cap: csrc/tests/test_scheduler.cpp
def test_a_long_accepted_run_holds_at_most_four_target_commits(tiny_pipe, scheduler):
    """20 blocks, 18 accepted in a row, then a rejection: the held target commits are made oldest first past 4
    (before: the 18 held commits read conditioning the table had forgotten)."""
    pattern = "0" + "1" * 18 + "0"
    session = tiny_pipe.session("a red fox", num_blocks=20, scheduler=scheduler, router="pattern", pattern=pattern,
                                target_context="full", seed=5)
    blocks = list(session)
    assert len(blocks) == 20 and [b.decision for b in blocks] == ["forced"] + ["accepted"] * 18 + ["rejected"]
    plain = tiny_pipe("a red fox", num_blocks=20, scheduler=scheduler, router="pattern", pattern=pattern,
                      target_context="full", seed=5, output_type="latent")
    assert torch.equal(torch.cat([b.latents for b in blocks], dim=2), plain.latents)  # the same video
    # block 0's commit, then blocks 1..14 committed past the cap during the run, 15..18 when the target runs
    assert session.stats.counters["skipped_target_commits"] == 1
    assert plain.stats.counters["skipped_target_commits"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["reference", "cpp"])
def test_an_unbounded_session_keeps_its_last_blocks_and_exact_totals(tiny_pipe, monkeypatch, scheduler):
    """record_blocks=3 on an unbounded session ended by close(): the statistics keep 3 block entries and their spans,
    the rest folded into totals equal to those of every block the consumer received; the last segment's counters
    are recorded (the loop's report is made when the consumer leaves); the reference loop keeps 3 blocks' times."""
    from sdvg.generation import reference
    from sdvg.generation.calls import StageCalls

    made = []  # the reference loop's stage calls, one per segment

    class RecordedCalls(StageCalls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(reference, "StageCalls", RecordedCalls)
    session = tiny_pipe.session("a red fox", num_blocks=None, scheduler=scheduler, router="pattern", pattern="0110",
                                seed=5, record_blocks=3, target_context="recompute", drafter_cache="recompute")
    seen = []
    for block in session:
        seen.append((block.index, block.decision, block.frames.shape[0], block.live["segment"]))
        if block.live["block"] == 3:
            session.update(seed=7)  # a restart: the kept blocks may span two segments
        if block.live["block"] == 8:
            break
    if scheduler == "reference":
        assert len(made[-1].times) <= 3 + 1
    stats = session.close().as_dict()
    later = [s for s in seen if s[0] > 0]
    assert stats["video"]["blocks_done"] == len(seen) == 9 and stats["video"]["blocks_dropped"] == 6
    assert [(b["index"], b["live"]["segment"]) for b in stats["blocks"]] == [(s[0], s[3]) for s in seen[-3:]]
    assert stats["video"]["frames"] == sum(s[2] for s in seen)
    assert stats["result"]["accepted_blocks"] == sum(s[1] == "accepted" for s in later)
    assert stats["result"]["acceptance_rate"] == stats["result"]["accepted_blocks"] / len(later)
    assert stats["live"]["segments"] == 2 and stats["video"]["interrupted"] is False
    assert stats["result"]["target_forwards"] > 0 and stats["result"]["drafter_forwards"] > 0  # every segment's counters, the last too
    assert stats["trace"] and {s["block"] for s in stats["trace"]} <= {b["index"] for b in stats["blocks"]}


@pytest.mark.slow
def test_the_native_scheduler_keeps_the_records_of_the_last_blocks_only(tiny_pipe):
    """record_blocks=4 reaches the native scheduler (SchedulerConfig.record_blocks): over a 14-block segment it
    holds the records and spans of the last few blocks only, and the kept entries get their final times."""
    session = tiny_pipe.session("a red fox", num_blocks=None, scheduler="cpp", run_ahead=True, router="pattern",
                                pattern="0110", record_blocks=4, target_context="recompute",
                                drafter_cache="full", window_frames=6, sink_frames=3)
    report = None
    for block in session:
        if report is None:  # the one segment's report: its loop fills it at the end, then the session folds it
            report = session.segment_report
        if block.index == 13:
            break
    stats = session.close()
    assert session.segment_report is None and report is not None and report.final_times is not None
    seen = {"final": dict(report.final_times), "span_blocks": {span["block"] for span in report.trace}}
    kept = [b["index"] for b in stats.blocks]
    assert kept == [10, 11, 12, 13]
    # the last 4 emitted, and those in flight at close: one queued, one being made, run_ahead_blocks (2) planned
    # ahead by the lane (without the bound: every block, 14 or more)
    assert min(seen["final"]) >= 13 - 4 - 2 and max(seen["final"]) >= 13 and len(seen["final"]) <= 4 + 1 + 2 + 2 + 2
    assert seen["span_blocks"] and min(seen["span_blocks"]) >= min(seen["final"])
    for b in stats.blocks:  # the scheduler's final times, derived `commit` included
        assert b["times"]["draft"] == seen["final"][b["index"]]["draft"]
        assert b["times"]["commit"] == b["times"]["drafter_commit"] + b["times"]["target_commit"]
