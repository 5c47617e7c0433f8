"""`stage_timing`: sync (a wait after every stage, today's timing) against events (no per-stage wait,
device time from CUDA event pairs): the same video. (The waits that events remove are
counted by `benchmarks/host_syncs.py`.)"""
import numpy as np
import pytest
import torch

from sdvg.generation.stage_timing import StageEvents

PROMPT = "a red fox"
KW = dict(router="pattern", pattern="0110", num_blocks=3, seed=3)


@pytest.mark.parametrize("scheduler,run_ahead", [pytest.param("cpp", False, marks=pytest.mark.slow),
                                               pytest.param("cpp", True, marks=pytest.mark.slow), ("reference", False)])
def test_events_give_the_same_video(tiny_pipe, scheduler, run_ahead):
    kw = dict(KW, scheduler=scheduler, run_ahead=run_ahead)
    synced = tiny_pipe(PROMPT, **kw)
    evented = tiny_pipe(PROMPT, stage_timing="events", **kw)
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

