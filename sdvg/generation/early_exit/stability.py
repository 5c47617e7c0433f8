"""The training-free verifier of Speculative Forcing.

At the first step a token's redundancy is its distance to the nearest clean history token the
attention window sees, `s_red(i) = min_h ||x0^(1)(i) - h||_2`; at later steps its stability is the
change of its clean estimate, `s_stab(i) = ||x0^(k)(i) - x0^(k-1)(i)||_2`. Scores are smoothed over
space and time (`tokens.smooth_scores`) and a token exits when its smoothed score is below the
step's threshold (tau_red at k = 1, tau_stab after). Tokens that already exited count as score 0
(their output no longer changes). Without history (block 0) nothing exits at step 1."""
from __future__ import annotations

import math

import torch

from sdvg.generation.early_exit.tokens import nearest_distance, smooth_scores, to_tokens, token_norms
from sdvg.generation.early_exit.view import BlockContext, StepView


class StabilityVerifier:
    name = "stability"
    needs_hidden = False

    def __init__(self, tau_red: float, tau_stab: float):
        self.tau_red, self.tau_stab = float(tau_red), float(tau_stab)
        self._history = None

    def start(self, ctx: BlockContext) -> None:
        self._history = ctx.history

    def scores(self, view: StepView) -> torch.Tensor:
        """The raw score of each active token [A] (float32)."""
        tokens = to_tokens(view.x0, view.patch)[view.active]  # [A, D]
        if view.step == 0:
            history = self._history()
            if history.shape[0] == 0:
                return torch.full((tokens.shape[0],), math.inf, device=tokens.device)
            return nearest_distance(tokens, history.to(tokens.device))
        prev = to_tokens(view.prev_x0, view.patch)[view.active]
        return token_norms(tokens - prev)

    def smoothed(self, view: StepView) -> torch.Tensor:
        """The smoothed score of each active token [A] (float32): what the thresholds compare with."""
        raw = self.scores(view)
        full = torch.zeros(math.prod(view.grid), device=raw.device)  # exited tokens: 0
        full[view.active] = raw
        return smooth_scores(full.reshape(view.grid)).flatten()[view.active]

    def converged(self, view: StepView) -> torch.Tensor:
        return self.smoothed(view) < (self.tau_red if view.step == 0 else self.tau_stab)
