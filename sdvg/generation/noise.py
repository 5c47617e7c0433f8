"""Every random draw of a video, derived from (seed, block, step, role) with its own generator.

Running the drafter therefore changes nothing the target draws: the block noise is shared
(role "init"), and each model's re-noising draws have their own stream."""
from __future__ import annotations

import hashlib
import threading
from typing import Literal

import torch

NoiseRole = Literal["init", "drafter", "target", "router"]


def derive_seed(seed: int, block: int, step: int, role: str) -> int:
    digest = hashlib.sha256(f"sdvg/{seed}/{block}/{step}/{role}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(seed: int, block: int, step: int, role: str) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(derive_seed(seed, block, step, role))


def gaussian(shape, seed: int, block: int, step: int, role: NoiseRole, device=None) -> torch.Tensor:
    """Standard normal float32 tensor, drawn on the CPU so every device sees the same numbers (or
    copied ahead to `device` by `prefetch_renoise`)."""
    ahead = _prefetched(shape, seed, block, step, role, device)
    if ahead is not None:
        return ahead
    out = torch.randn(tuple(shape), generator=generator(seed, block, step, role), dtype=torch.float32)
    return out.to(device) if device is not None else out


def block_noise(shape, seed: int, block: int, device=None) -> torch.Tensor:
    """noise_b: the initial noise of block `block`, shared by drafter and target."""
    return gaussian(shape, seed, block, 0, "init", device)


# Re-noising draws copied ahead: (seed, block, step, role, shape, device) -> the draw on `device`.
_AHEAD: dict = {}
_AHEAD_LOCK = threading.Lock()


def prefetch_renoise(shape, seed: int, block: int, num_steps: int, role: NoiseRole, device) -> None:
    """Draw the re-noising noise of steps 1 .. num_steps - 1 of `block` now, on the CPU into pinned
    memory (the same numbers `gaussian` draws), and queue their copies to the CUDA `device` on the
    current stream (non-blocking), so `gaussian` hands them out without a host-side copy. Draws of an
    earlier block of this role still waiting are dropped. No-op off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    shape = tuple(shape)
    ahead = {}
    for step in range(1, num_steps):
        host = gaussian(shape, seed, block, step, role).pin_memory()
        ahead[(seed, block, step, role, shape, device)] = host.to(device, non_blocking=True)
    with _AHEAD_LOCK:
        for key in [k for k in _AHEAD if k[3] == role]:
            del _AHEAD[key]
        _AHEAD.update(ahead)


def _prefetched(shape, seed: int, block: int, step: int, role: str, device) -> torch.Tensor | None:
    if device is None or not _AHEAD:
        return None
    with _AHEAD_LOCK:
        return _AHEAD.pop((seed, block, step, role, tuple(shape), torch.device(device)), None)
