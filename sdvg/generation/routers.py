"""Routers decide, per block, whether the drafter's block is accepted.

`reward` (the method): accept when the aggregated ImageReward score >= tau.
`random`: accept with a fixed probability, seeded per (seed, block) (the paper's ablation).
`pattern`: a fixed decision list (benchmarks at a known acceptance rate).
Block 0 is forced to the target when `force_first_reject` is on, whatever the router."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sdvg.generation.noise import generator
from sdvg.options import GenerationOptions


@dataclass(frozen=True)
class Router:
    """The routing rule of a run; built from its (validated) options, it declares no defaults."""

    kind: str
    tau: float
    accept_prob: float
    pattern: tuple[bool, ...]

    @classmethod
    def from_options(cls, opts: GenerationOptions) -> "Router":
        return cls(opts.router, opts.tau, opts.accept_prob, opts.pattern)

    def uniform(self, block: int, seed: int) -> float:
        """The random router's U(0, 1) draw for a block (the native scheduler is handed the same draws)."""
        return torch.rand((), generator=generator(seed, block, 0, "router")).item()

    @property
    def scored(self) -> bool:
        """Whether the router looks at the draft (its block score); the others decide each block in advance."""
        return self.kind == "reward"

    def accept(self, block: int, score: float | None, seed: int) -> bool:
        if self.kind == "reward":
            if score is None:
                raise ValueError("router 'reward' needs a block score")
            return score >= self.tau
        if self.kind == "random":
            return self.uniform(block, seed) < self.accept_prob
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
