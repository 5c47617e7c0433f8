"""Small read-only tensors built on the host once and then kept on their device, so that the hot loop
makes no host copy per forward: the RoPE tables of a block position, the VAE's latent statistics,
the visible-cache index of a DiT engine, a recompute context's block-causal mask, the pending
slots of a sparse KV write.

On a CUDA device an entry is built on the host, pinned and copied with `non_blocking=True` on the
current stream, and an event is recorded after the copy: a later lookup from another stream waits
for that event on the device (no host sync) and marks the tensor as used by that stream
(`record_stream`), so an evicted entry's memory is not reused under a reader. Elsewhere the host
tensor is the entry. Each cache holds at most `max_entries` entries (least recently used evicted)."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch


def to_device_async(host: torch.Tensor, device) -> torch.Tensor:
    """`host` on `device` without a blocking copy: from pinned memory with `non_blocking=True` on CUDA (the
    caching host allocator keeps the pinned buffer until the copy has run), `.to(device, non_blocking=True)`
    elsewhere (no copy when it is already there). Bitwise `host.to(device)`."""
    device = torch.device(device)
    if device.type == "cuda" and host.device.type == "cpu":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class DeviceConstants:
    def __init__(self, max_entries: int = 64):
        self.max_entries = max_entries
        self._entries: OrderedDict = OrderedDict()  # (key, device) -> (value, event or None, stream or None)
        self._lock = threading.Lock()
        self.built = 0  # entries built (host work and one async copy each)

    def get(self, key, device, build):
        """The entry `key` on `device`: `build()` -> a host tensor or a tuple of them, called once per
        (key, device) while the entry stays cached."""
        device = torch.device(device)
        with self._lock:
            held = self._entries.get((key, device))
            if held is not None:
                self._entries.move_to_end((key, device))
        if held is None:
            value = build()
            value = tuple(to_device_async(t, device) for t in value) if isinstance(value, tuple) \
                else to_device_async(value, device)
            event = stream = None
            if device.type == "cuda":
                stream = torch.cuda.current_stream(device)
                event = torch.cuda.Event()
                event.record(stream)
            held = (value, event, stream)
            with self._lock:
                self._entries[(key, device)] = held
                self.built += 1
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            return value
        value, event, stream = held
        if event is not None and not torch.cuda.is_current_stream_capturing():
            current = torch.cuda.current_stream(device)
            if current != stream:
                current.wait_event(event)
                for t in value if isinstance(value, tuple) else (value,):
                    t.record_stream(current)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_SHARED = DeviceConstants()


def device_constant(key, device, build):
    """`DeviceConstants.get` on the process-wide cache (keys name their owner: ("rope", ...), ...)."""
    return _SHARED.get(key, device, build)
