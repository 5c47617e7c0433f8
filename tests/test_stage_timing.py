"""`stage_timing`: sync (a wait after every stage, today's timing) against events (no per-stage wait,
device time from CUDA event pairs): the same video, and the per-stage waits gone."""
import numpy as np
import pytest
import torch

from sdvg.generation.calls import StageCalls
from sdvg.generation.stage_timing import StageEvents

PROMPT = "a red fox"
KW = dict(router="pattern", pattern="0110", num_blocks=3, seed=3)


@pytest.mark.parametrize("scheduler,run_ahead", [("cpp", False), ("cpp", True), ("reference", False)])
def test_events_give_the_same_video_without_stage_waits(tiny_pipe, monkeypatch, scheduler, run_ahead):
    waits = {"n": 0}

    def counted(fn):
        def wrapped(*a, **k):
            waits["n"] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(StageCalls, "_wait", counted(StageCalls._wait))
    kw = dict(KW, scheduler=scheduler, run_ahead=run_ahead)
    synced = tiny_pipe(PROMPT, **kw)
    assert waits["n"] > 0  # sync: every stage waited for (a no-op on the CPU, counted all the same)
    waits["n"] = 0
    evented = tiny_pipe(PROMPT, stage_timing="events", **kw)
    assert waits["n"] == 0
    assert torch.equal(synced.latents, evented.latents) and np.array_equal(synced.frames, evented.frames)
    assert [b["decision"] for b in synced.stats["blocks"]] == [b["decision"] for b in evented.stats["blocks"]]
    assert evented.stats["stage_timing"] == "events" and synced.stats["stage_timing"] == "sync"
    assert synced.stats["stage_device_s"] is None and evented.stats["stage_device_s"] is None  # no CUDA here
    assert len(evented.stats["trace"]) == len(synced.stats["trace"])


def test_stage_events_off_cuda_record_nothing():
    ev = StageEvents([torch.device("cpu")])
    assert ev.start("cpu") is None
    ev.end("draft", None, "cpu")
    assert ev.resolve() is None

