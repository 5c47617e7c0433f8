"""Every random draw of a video, derived from (seed, block, step, role) with its own generator.

Running the drafter therefore changes nothing the target draws: the block noise is shared
(role "init"), and each model's re-noising draws have their own stream."""
from __future__ import annotations

import hashlib
import threading
from typing import Literal

import torch

from sdvg.models.device_constants import to_device_async

NoiseRole = Literal["init", "drafter", "target", "router"]


def derive_seed(seed: int, block: int, step: int, role: str) -> int:
    digest = hashlib.sha256(f"sdvg/{seed}/{block}/{step}/{role}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(seed: int, block: int, step: int, role: str) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(derive_seed(seed, block, step, role))


def gaussian(shape, seed: int, block: int, step: int, role: NoiseRole, device=None) -> torch.Tensor:
    """Standard normal float32 tensor, drawn on the CPU so every device sees the same numbers (or
    copied ahead to `device` by `copy_ahead`)."""
    ahead = _prefetched(shape, seed, block, step, role, device)
    if ahead is not None:
        return ahead
    out = torch.randn(tuple(shape), generator=generator(seed, block, step, role), dtype=torch.float32)
    return to_device_async(out, device) if device is not None else out


def block_noise(shape, seed: int, block: int, device=None) -> torch.Tensor:
    """noise_b: the initial noise of block `block`, shared by drafter and target."""
    return gaussian(shape, seed, block, 0, "init", device)


# Re-noising draws copied ahead: (seed, block, step, role, shape, device) -> the draw on `device`.
_AHEAD: dict = {}
_AHEAD_LOCK = threading.Lock()


def _ahead(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, its copy queued on the current stream (from pinned memory on CUDA)."""
    return to_device_async(host, device)


def copy_ahead(noise: torch.Tensor, seed: int, block: int, num_steps: int, role: NoiseRole, device) -> torch.Tensor:
    """A role's draws of `block`, copied ahead: returns the block noise `noise` (CPU) on `device`, and
    draws the re-noising noise of steps 1 .. num_steps - 1 now, on the CPU (the numbers `gaussian`
    draws), queueing their copies too, so that `gaussian` hands them out without a blocking copy.
    Draws of an earlier block of this role still waiting are dropped. Call on the thread (stream)
    that denoises the block."""
    device = torch.device(device)
    shape = tuple(noise.shape)
    ahead = {(seed, block, step, role, shape, device): _ahead(gaussian(shape, seed, block, step, role), device)
             for step in range(1, num_steps)}
    with _AHEAD_LOCK:
        for key in [k for k in _AHEAD if k[3] == role]:
            del _AHEAD[key]
        _AHEAD.update(ahead)
    return _ahead(noise, device)


def _prefetched(shape, seed: int, block: int, step: int, role: str, device) -> torch.Tensor | None:
    if device is None or not _AHEAD:
        return None
    with _AHEAD_LOCK:
        return _AHEAD.pop((seed, block, step, role, tuple(shape), torch.device(device)), None)
