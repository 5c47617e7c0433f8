"""Routers decide, per block, whether the drafter's block is accepted.

`reward` (the method): accept when the aggregated ImageReward score >= tau.
`random`: accept with a fixed probability, seeded per (seed, block) (the paper's ablation).
`pattern`: a fixed decision list (benchmarks at a known acceptance rate).
Block 0 is forced to the target when `force_first_reject` is on, whatever the router."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sdvg.config import ROUTERS, RouterKind
from sdvg.noise import generator


@dataclass(frozen=True)
class Router:
    kind: RouterKind = "reward"
    tau: float = -0.7
    accept_prob: float = 0.731
    pattern: tuple[bool, ...] = ()

    def __post_init__(self):
        if self.kind not in ROUTERS:
            raise ValueError(f"unknown router {self.kind!r}; choose one of {ROUTERS}")
        if isinstance(self.tau, float) and math.isnan(self.tau):
            raise ValueError("tau is NaN; give a number (or +inf / -inf)")
        if not 0.0 <= self.accept_prob <= 1.0:
            raise ValueError(f"accept_prob {self.accept_prob} must lie in [0, 1]")
        if self.kind == "pattern" and not self.pattern:
            raise ValueError("router 'pattern' needs a non-empty decision pattern")

    def accept(self, block: int, score: float | None, seed: int) -> bool:
        if self.kind == "reward":
            if score is None:
                raise ValueError("router 'reward' needs a block score")
            return score >= self.tau
        if self.kind == "random":
            u = torch.rand((), generator=generator(seed, block, 0, "router")).item()
            return u < self.accept_prob
        return bool(self.pattern[block % len(self.pattern)])


def acceptance_pattern(num_blocks: int, rate: float, seed: int = 0) -> tuple[bool, ...]:
    """A fixed pattern for blocks 0..num_blocks-1 whose blocks 1.. accept round(rate*(B-1)) times,
    at seeded positions; block 0 is False (it goes to the target anyway)."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"acceptance rate {rate} must lie in [0, 1]")
    n = num_blocks - 1
    k = int(round(rate * n))
    order = torch.randperm(n, generator=generator(seed, 0, 0, "pattern")).tolist() if n else []
    accepted = set(order[:k])
    return (False,) + tuple(i in accepted for i in range(n))
