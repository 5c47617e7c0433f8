"""The few-step flow-matching schedules of Self-Forcing-style causal Wan models.

Self-Forcing and Krea Realtime Video both build a 1000-entry table of shifted sigmas
(`FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True)`, in float32):

    s_i = 1 - i / 1000  (i = 0 .. 999),   sigma_i = shift * s_i / (1 + (shift - 1) * s_i),   t_i = 1000 * sigma_i

and a step list in the unshifted 0..1000 scale (`denoising_step_list`) is mapped through that table,
`t = [t_0 .. t_999, 0][1000 - step]`. Every x0 conversion and every re-noise looks its sigma up by the
nearest table timestep, so t = 0 uses sigma_999 = 0.0049801, not 0:

- Self-Forcing's drafter: steps (1000, 750, 500, 250) -> t = (1000, 937.5, 833.3, 625), then the
  clean t = 0 forward that commits the block (its K/V only; no x0 is taken from it);
- Krea's target: steps (1000, 750, 500, 250, 0) -> five model calls at (1000, 937.5, 833.3, 625, 0); the
  fifth is a denoising step at sigma 0.0049801 and its x0 is the block's output.

Another step count (`counted_steps`, the `target_steps` option, Krea's `num_denoising_steps`) follows
Krea's `v2v.get_denoising_schedule`: n calls at `linspace(1000, 0, n)` in float32, truncated to integers
(n = 5 is the list above; n = 4 gives 1000, 666, 333, 0). A full-context role, whose t = 0 forward only
commits, takes the first n of `linspace(1000, 0, n + 1)` (n = 4 is Self-Forcing's list above).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

NUM_TRAIN_TIMESTEPS = 1000


@lru_cache(maxsize=8)
def flow_table(shift: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(timesteps, sigmas) of the 1000-entry shifted table, computed in float32 as the reference
    schedulers do (values returned as Python floats of those float32 numbers)."""
    s = torch.linspace(1.0, 0.0, NUM_TRAIN_TIMESTEPS + 1, dtype=torch.float32)[:-1]
    sigmas = shift * s / (1 + (shift - 1) * s)
    timesteps = sigmas * NUM_TRAIN_TIMESTEPS
    return tuple(timesteps.tolist()), tuple(sigmas.tolist())


def warp_timestep(t: float, shift: float) -> float:
    """The analytic shift, t' = 1000 * shift * s / (1 + (shift - 1) * s) with s = t / 1000 (the table's
    entries equal it to float32 rounding)."""
    s = t / 1000.0
    return 1000.0 * shift * s / (1.0 + (shift - 1.0) * s)


def table_sigma(t: float, shift: float) -> float:
    """The sigma the reference schedulers use at model timestep `t`: the table entry whose timestep is
    nearest (`argmin |t_i - t|`, first index on a tie)."""
    timesteps, sigmas = flow_table(shift)
    best = min(range(len(timesteps)), key=lambda i: (abs(timesteps[i] - t), i))
    return sigmas[best]


def strength_steps(steps: tuple[float, ...], strength: float) -> tuple[float, ...]:
    """A step list started at `strength * 1000` (video-to-video), Krea's `v2v.get_denoising_schedule`:
    `torch.linspace(strength * 1000, 0, n, dtype=float32).long()` for a list that is `linspace(1000, 0, n)`
    (Krea's five steps). A list that is the first k entries of such a grid (Self-Forcing's 1000, 750, 500,
    250: four of linspace(1000, 0, 5)) takes the first k of the scaled grid, so both roles start at the
    same step. strength 1.0 gives `steps` back unchanged."""
    if strength == 1.0:
        return tuple(steps)
    n = _grid_size(steps)
    grid = torch.linspace(strength * NUM_TRAIN_TIMESTEPS, 0, n, dtype=torch.float32).to(torch.long)
    return tuple(float(x) for x in grid[: len(steps)].tolist())


def counted_steps(count: int, recompute: bool, strength: float = 1.0) -> tuple[float, ...]:
    """`count` denoising steps by Krea's rule (`get_denoising_schedule(timesteps, strength, steps=count)`):
    `linspace(strength * 1000, 0, count)` in float32, truncated to integers, for a recompute role (its last
    call, at 0, gives the block); a full-context role, committed by its own t = 0 forward after its steps,
    takes the first `count` of `linspace(strength * 1000, 0, count + 1)`."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"a step count must be an integer >= 1, got {count!r}")
    grid = torch.linspace(strength * NUM_TRAIN_TIMESTEPS, 0, count if recompute else count + 1,
                          dtype=torch.float32).to(torch.long)
    return tuple(float(x) for x in grid[:count].tolist())


def _grid_size(steps: tuple[float, ...]) -> int:
    """n such that `steps` are the first entries of linspace(1000, 0, n) (ValueError when there is none)."""
    if len(steps) >= 2 and steps[0] == NUM_TRAIN_TIMESTEPS and steps[0] > steps[1]:
        n = NUM_TRAIN_TIMESTEPS / (steps[0] - steps[1]) + 1
        if n == int(n) and int(n) >= len(steps):
            grid = torch.linspace(NUM_TRAIN_TIMESTEPS, 0, int(n), dtype=torch.float32).tolist()
            if list(map(float, steps)) == grid[: len(steps)]:
                return int(n)
    raise ValueError(f"video-to-video (strength < 1) scales a step list on the uniform grid from 1000 to 0, such as "
                     f"(1000, 750, 500, 250); this preset's steps are {tuple(steps)}")


@dataclass(frozen=True)
class FlowSchedule:
    """The model calls of one block's denoising: the timestep each call sees and the sigma of its x0
    conversion and of the re-noise to it. The model predicts v = noise - x0."""

    timesteps: tuple[float, ...]
    sigmas: tuple[float, ...]

    def __post_init__(self):
        if len(self.timesteps) != len(self.sigmas) or not self.timesteps:
            raise ValueError("a schedule needs one sigma per timestep (and at least one step)")

    @classmethod
    def from_steps(cls, steps: tuple[float, ...], shift: float = 5.0) -> "FlowSchedule":
        """Map a step list in the unshifted 0..1000 scale through the shifted table (see the module doc)."""
        timesteps, _ = flow_table(shift)
        padded = timesteps + (0.0,)
        out = []
        for step in steps:
            i = NUM_TRAIN_TIMESTEPS - int(step)
            if not 0 <= i <= NUM_TRAIN_TIMESTEPS:
                raise ValueError(f"denoising step {step} must lie in [0, 1000]")
            out.append(padded[i])
        return cls(tuple(out), tuple(table_sigma(t, shift) for t in out))


    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    def sigma(self, step: int) -> float:
        return self.sigmas[step]

    def to_x0(self, x_t: torch.Tensor, flow: torch.Tensor, step: int) -> torch.Tensor:
        """x0 = x_t - sigma_t * v (in float32)."""
        return x_t.float() - self.sigma(step) * flow.float()

    def renoise(self, x0: torch.Tensor, eps: torch.Tensor, step: int) -> torch.Tensor:
        """x_{t_step} = (1 - sigma) * x0 + sigma * eps."""
        s = self.sigma(step)
        return (1.0 - s) * x0 + s * eps.float()
