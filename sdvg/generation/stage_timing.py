"""Device time per stage from CUDA event pairs (`stage_timing="events"`).

Under `stage_timing="sync"` (the default) both loops wait for the device after every stage, so
their stage times (the native scheduler's C++ wall clocks, the reference loop's `timed`) measure
execution. Under `"events"` they do not wait: a stage call returns once its work is queued, or once
the host has read a value it needs (the finite checks of `StageGuard` on the draft, target and decode
outputs, the scores), and the stage times then measure the host's time in the call. The device's
time of each call is measured instead by a pair of CUDA events recorded on the stage's stream around
it; the pairs are read (`elapsed_time`, which waits for the end event) only when the video ends, so
no wait is added before then. Their totals per stage are the statistics' `stage_device_s`.

Under `"sync"` no event is recorded on any device, and on the CPU none under `"events"` either (nothing runs
asynchronously there): `stage_device_s` is then null (`StageEvents.on`, the one place that decides it)."""
from __future__ import annotations

import threading

import torch


class StageEvents:
    def __init__(self, devices, timing: str):
        """`timing`: the video's `stage_timing`; events are recorded under "events" when a stage device is CUDA."""
        self.on = timing == "events" and any(torch.device(d).type == "cuda" for d in devices if d is not None)
        self._pairs: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._lock = threading.Lock()  # the drafter thread (run-ahead) records beside the main one

    def start(self, device):
        """An event recorded on `device`'s current stream (the calling thread's), or None off CUDA."""
        if not self.on or torch.device(device).type != "cuda":
            return None
        with torch.cuda.device(device):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        return ev

    def end(self, stage: str, start, device) -> None:
        if start is None:
            return
        with torch.cuda.device(device):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        with self._lock:
            self._pairs.append((stage, start, ev))

    def resolve(self) -> dict[str, float] | None:
        """Seconds of device time per stage, summed over the video's calls (waits for every recorded
        end event: the one host wait of the video's timing); None when events are off (`on`: under sync, or off
        CUDA)."""
        if not self.on:
            return None
        with self._lock:
            pairs, self._pairs = self._pairs, []
        totals: dict[str, float] = {}
        for stage, start, end in pairs:
            end.synchronize()
            totals[stage] = totals.get(stage, 0.0) + start.elapsed_time(end) / 1000.0
        return totals
