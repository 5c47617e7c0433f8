"""The learned verifier: a token exits when the exit head's predicted gap is below eps
(sdvg/models/exit_head.py). The head reads the last transformer block's hidden states of the whole
token grid; tokens that already exited keep the hidden state of their last step."""
from __future__ import annotations

import math

import torch

from sdvg.generation.early_exit.view import BlockContext, StepView


class HeadVerifier:
    name = "head"
    needs_hidden = True

    def __init__(self, head, eps: float):
        self.head, self.eps = head, float(eps)
        self._hidden: torch.Tensor | None = None  # [S, dim] of the current block

    def start(self, ctx: BlockContext) -> None:
        self._hidden = None

    @torch.no_grad()
    def predict(self, view: StepView) -> torch.Tensor:
        """The predicted gap of every token of the grid [S] after this step."""
        if view.hidden is None:
            raise RuntimeError("the head verifier needs the step's hidden states")
        hidden = view.hidden.float()
        if self._hidden is None:
            self._hidden = hidden.new_zeros((math.prod(view.grid), hidden.shape[-1]))
        self._hidden[view.active] = hidden
        device = next(self.head.parameters()).device
        return self.head(self._hidden[None].to(device), view.grid)[0].flatten()

    def converged(self, view: StepView) -> torch.Tensor:
        return self.predict(view).to(view.active.device)[view.active] < self.eps
