"""What a verifier sees at one denoising step of one block."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepView:
    step: int  # 0-based model call of the schedule (k = step + 1 evaluations so far for an active token)
    num_steps: int  # K
    x0: torch.Tensor  # [1, C, F, H, W] float32: this step's clean estimate (meaningful at the active tokens)
    prev_x0: torch.Tensor | None  # the previous step's (meaningful at the active tokens; None at step 0)
    active: torch.Tensor  # [A] int64: the tokens computed at this step (ascending)
    hidden: torch.Tensor | None  # [A, dim]: their last transformer block's hidden states (head verifier)
    patch: tuple[int, int, int]

    @property
    def grid(self) -> tuple[int, int, int]:
        _, _, nF, H, W = self.x0.shape
        return nF // self.patch[0], H // self.patch[1], W // self.patch[2]


@dataclass(frozen=True)
class BlockContext:
    """What a verifier may read about the block before its first step."""

    role: str
    block: int
    seed: int
    num_steps: int
    shape: tuple[int, ...]  # the block's latents [1, C, F, H, W]
    patch: tuple[int, int, int]
    history: object  # () -> [N, D] clean history tokens the attention window sees (float32)
    rollout: object  # () -> list of K x0 [1, C, F, H, W] of the full schedule (dense, no exit)
