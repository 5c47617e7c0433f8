"""The pattern verifier: a fixed, seeded share of the tokens exits at each step, aimed at a mean step
count. For benchmarks and tests without real weights (it reads nothing of the model's output).

A constant hazard q per step gives E[k*] = sum_{k=0}^{K-1} (1 - q)^k; q is solved for the requested
mean and the exits of step k are the cumulative round(S * (1 - (1 - q)^k)) tokens of a permutation
drawn from (seed, block, role)."""
from __future__ import annotations

import torch

from sdvg.generation.early_exit.view import BlockContext, StepView
from sdvg.generation.noise import generator


def expected_steps(q: float, num_steps: int) -> float:
    return sum((1.0 - q) ** k for k in range(num_steps))


def hazard_for(mean_steps: float, num_steps: int) -> float:
    """The per-step exit probability whose expected step count is `mean_steps` (clamped to [1, K])."""
    if mean_steps >= num_steps:
        return 0.0
    if mean_steps <= 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if expected_steps(mid, num_steps) > mean_steps else (lo, mid)
    return 0.5 * (lo + hi)


def exit_steps(num_tokens: int, num_steps: int, mean_steps: float, gen: torch.Generator) -> torch.Tensor:
    """k*(i) for every token [S] (int64, 1..K)."""
    q = hazard_for(mean_steps, num_steps)
    order = torch.randperm(num_tokens, generator=gen)
    steps = torch.full((num_tokens,), num_steps, dtype=torch.long)
    done = 0
    for k in range(1, num_steps):
        upto = min(num_tokens, round(num_tokens * (1.0 - (1.0 - q) ** k)))
        steps[order[done:upto]] = k
        done = max(done, upto)
    return steps


class PatternVerifier:
    name = "pattern"
    needs_hidden = False

    def __init__(self, mean_steps: float):
        self.mean_steps = float(mean_steps)
        self.steps: torch.Tensor | None = None

    def start(self, ctx: BlockContext) -> None:
        _, _, nF, H, W = ctx.shape
        S = (nF // ctx.patch[0]) * (H // ctx.patch[1]) * (W // ctx.patch[2])
        self.steps = exit_steps(S, ctx.num_steps, self.mean_steps, generator(ctx.seed, ctx.block, 0,
                                                                            f"exit-pattern/{ctx.role}"))

    def converged(self, view: StepView) -> torch.Tensor:
        return self.steps.to(view.active.device)[view.active] == view.step + 1
