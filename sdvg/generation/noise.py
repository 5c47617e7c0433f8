"""Every random draw of a video, derived from (seed, block, step, role) with its own generator.

Running the drafter therefore changes nothing the target draws: the block noise is shared
(role "init"), and each model's re-noising draws have their own stream."""
from __future__ import annotations

import hashlib
from typing import Literal

import torch

NoiseRole = Literal["init", "drafter", "target", "router"]


def derive_seed(seed: int, block: int, step: int, role: str) -> int:
    digest = hashlib.sha256(f"sdvg/{seed}/{block}/{step}/{role}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(seed: int, block: int, step: int, role: str) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(derive_seed(seed, block, step, role))


def gaussian(shape, seed: int, block: int, step: int, role: NoiseRole, device=None) -> torch.Tensor:
    """Standard normal float32 tensor, drawn on the CPU so every device sees the same numbers."""
    out = torch.randn(tuple(shape), generator=generator(seed, block, step, role), dtype=torch.float32)
    return out.to(device) if device is not None else out


def block_noise(shape, seed: int, block: int, device=None) -> torch.Tensor:
    """noise_b: the initial noise of block `block`, shared by drafter and target."""
    return gaussian(shape, seed, block, 0, "init", device)
