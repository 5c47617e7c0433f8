"""Latents crossing between the drafter's and the target's GPUs on a copy stream.

A block's latents are copied to the other device as soon as they are produced (`prefetch`), on a
dedicated copy stream of the destination, so the copy overlaps whatever runs next; a consumer
(`get`) makes its own stream wait for the copy's event. Same-device or CPU transfers are plain
`.to()` (exact either way)."""
from __future__ import annotations

import threading

import torch


class LatentTransfer:
    def __init__(self, devices):
        self.streams = {}
        for d in {torch.device(x) for x in devices}:
            if d.type == "cuda":
                self.streams[d] = torch.cuda.Stream(device=d)
        self._copies: dict = {}  # (id(source), destination) -> (source, copy, event)
        self._lock = threading.Lock()  # the drafter thread (run-ahead) prefetches while the main one releases

    def _async(self, x: torch.Tensor, dest: torch.device) -> bool:
        return x.device != dest and x.device.type == "cuda" and dest in self.streams

    def prefetch(self, x: torch.Tensor, dest) -> None:
        dest = torch.device(dest)
        if not self._async(x, dest):
            return
        with self._lock:
            if (id(x), dest) in self._copies:
                return
        stream = self.streams[dest]
        stream.wait_stream(torch.cuda.current_stream(x.device))  # the producer's work comes first
        with torch.cuda.stream(stream):
            y = x.to(dest, non_blocking=True)
            x.record_stream(stream)  # keep the source alive until the copy has run
            event = torch.cuda.Event()
            event.record(stream)
        with self._lock:
            self._copies[(id(x), dest)] = (x, y, event)

    def get(self, x: torch.Tensor, dest) -> torch.Tensor:
        dest = torch.device(dest)
        if x.device == dest:
            return x
        with self._lock:
            entry = self._copies.get((id(x), dest))
        if entry is None:
            return x.to(dest)
        _, y, event = entry
        current = torch.cuda.current_stream(dest)
        current.wait_event(event)
        y.record_stream(current)
        return y

    def in_flight(self) -> int:
        """Copies prefetched and not yet released."""
        with self._lock:
            return len(self._copies)

    def release(self, x) -> None:
        if x is None:
            return
        with self._lock:
            for key in [k for k in self._copies if k[0] == id(x)]:
                del self._copies[key]
