"""`stage_timing`: sync (a wait after every stage, today's timing) against events (no per-stage wait,
device time from CUDA event pairs): the same video. (The waits that events remove are
counted by `benchmarks/host_syncs.py`.)"""
import contextlib
import time

import numpy as np
import pytest
import torch

from sdvg.generation import calls
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
    assert evented.stats["options"]["stage_timing"] == "events" and synced.stats["options"]["stage_timing"] == "sync"
    assert synced.stats["result"]["stage_device_s"] is None and evented.stats["result"]["stage_device_s"] is None  # no CUDA here
    assert len(evented.stats["trace"]) == len(synced.stats["trace"])


def test_stage_events_off_cuda_record_nothing():
    ev = StageEvents([torch.device("cpu")], "events")
    assert ev.start("cpu") is None
    ev.end("draft", None, "cpu")
    assert ev.resolve() is None


class HostClockEvent:
    """What StageEvents uses of torch.cuda.Event, on the host clock (a CUDA event's stand-in on the CPU)."""

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, as CUDA's


@pytest.fixture
def stages_on_cuda(monkeypatch):
    """Both loops' StageEvents as on a CUDA device: their stage devices read as cuda:0 and the events run on
    the host clock; everything else (the videos, the loops, the timing option) is the CPU's."""
    cuda = torch.device("cuda:0")

    class OnCuda(StageEvents):
        def __init__(self, devices, *timing):
            super().__init__([cuda for _ in devices], *timing)

        def start(self, device):
            return super().start(cuda)

        def end(self, stage, start, device):
            super().end(stage, start, cuda)

    monkeypatch.setattr(calls, "StageEvents", OnCuda)
    monkeypatch.setattr(torch.cuda, "Event", HostClockEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())


@pytest.mark.parametrize("scheduler", ["cpp", "reference"])
def test_sync_timing_has_no_device_times_on_any_device(tiny_pipe, stages_on_cuda, scheduler):
    """stage_device_s is null under sync whatever the device (CUDA's branch reached through the stand-in, which
    records under events: the control)."""
    kw = dict(KW, num_blocks=2, scheduler=scheduler)
    evented = tiny_pipe(PROMPT, stage_timing="events", **kw).stats["result"]["stage_device_s"]
    assert evented and {"draft", "decode", "target"} <= set(evented), evented
    synced = tiny_pipe(PROMPT, stage_timing="sync", **kw).stats["result"]["stage_device_s"]
    assert synced is None, f"{scheduler}: stage_device_s {synced!r} under sync (no event is recorded there)"

