"""The oracle verifier: runs the full schedule first and lets a token exit at step k when its clean
estimate is already close to the final one, `rel_k(i) = ||x0^(k)(i) - x0^(K)(i)||_2 / sigma < eps`, sigma
the median token norm of the full schedule's output. Strict: eps = 0 never exits early. For calibration
and tests: it costs a full rollout per block (counted apart, `ExitRecord.oracle_forwards`)."""
from __future__ import annotations

import torch

from sdvg.generation.early_exit.tokens import to_tokens, token_norms
from sdvg.generation.early_exit.view import BlockContext, StepView


def relative_gaps(x0s: list[torch.Tensor], patch) -> torch.Tensor:
    """rel_k for every step of a full rollout: [K, S] (the last row is 0)."""
    final = to_tokens(x0s[-1], patch)  # [S, D]
    sigma = token_norms(final).median().clamp_min(torch.finfo(torch.float32).tiny)
    return torch.stack([token_norms(to_tokens(x, patch) - final) for x in x0s]) / sigma


class OracleVerifier:
    name = "oracle"
    needs_hidden = False

    def __init__(self, eps: float):
        self.eps = float(eps)
        self.gaps: torch.Tensor | None = None  # [K, S] of the current block
        self.rollouts = 0  # forwards of the full rollouts, for the record

    def start(self, ctx: BlockContext) -> None:
        x0s = ctx.rollout()
        self.rollouts = len(x0s)
        self.gaps = relative_gaps(x0s, ctx.patch)

    def converged(self, view: StepView) -> torch.Tensor:
        return self.gaps[view.step].to(view.active.device)[view.active] < self.eps
