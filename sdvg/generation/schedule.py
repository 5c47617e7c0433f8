"""The few-step flow-matching schedule of Self-Forcing-style causal Wan models."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def warp_timestep(t: float, shift: float) -> float:
    """Shifted flow-matching timestep: sigma' = shift * s / (1 + (shift - 1) * s), s = t / 1000."""
    s = t / 1000.0
    return 1000.0 * shift * s / (1.0 + (shift - 1.0) * s)


@dataclass(frozen=True)
class FlowSchedule:
    """Denoising timesteps (already warped) and the update rules. The model predicts v = noise - x0."""

    timesteps: tuple[float, ...]

    @classmethod
    def from_base(cls, base: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0), shift: float = 5.0):
        return cls(tuple(warp_timestep(t, shift) for t in base))

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    def sigma(self, step: int) -> float:
        return self.timesteps[step] / 1000.0

    def to_x0(self, x_t: torch.Tensor, flow: torch.Tensor, step: int) -> torch.Tensor:
        """x0 = x_t - sigma_t * v (in float32)."""
        return x_t.float() - self.sigma(step) * flow.float()

    def renoise(self, x0: torch.Tensor, eps: torch.Tensor, step: int) -> torch.Tensor:
        """x_{t_step} = (1 - sigma) * x0 + sigma * eps."""
        s = self.sigma(step)
        return (1.0 - s) * x0 + s * eps.float()
