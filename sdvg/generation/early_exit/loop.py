"""The early-exit denoising loop of one block (Speculative Forcing), for either role.

At each model call k < K the verifier judges the still-active tokens; those it calls converged are
committed: their output is frozen at this step's clean estimate x0^(k), their K/V of this step stay in
the block's pending cache slot for the others to attend to, and later calls compute queries for the
active tokens only (`CausalWanDiT.forward(active=...)`). The others are re-noised to the next level
as without early exit (the same noise draws). At k = K every remaining token commits. With nothing
exiting early, every call is dense and the result is bitwise the plain loop's.

The block's latents then commit as usual: under a `full` context the clean t = 0 forward over the
assembled block refreshes the cache; under `recompute` the next block's context rebuild does."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sdvg.generation.early_exit.record import ExitRecord
from sdvg.generation.early_exit.tokens import token_grid, token_mask_to_latents
from sdvg.generation.early_exit.view import BlockContext, StepView


@dataclass(frozen=True)
class ExitPlan:
    """How one role's tokens exit: the verifier's name and its settings (from the options)."""

    verifier: str
    eps: float
    thresholds: tuple[float, float]
    pattern_steps: float
    head: object = None  # the loaded ExitHead (verifier 'head')

    @classmethod
    def from_options(cls, opts, head=None) -> "ExitPlan":
        return cls(opts.exit_verifier, opts.exit_eps, tuple(opts.exit_thresholds), opts.exit_pattern_steps, head)


def make_verifier(plan: ExitPlan):
    """A fresh verifier for one role (verifiers keep per-block state; one per role and video)."""
    if plan.verifier == "stability":
        from sdvg.generation.early_exit.stability import StabilityVerifier

        return StabilityVerifier(*plan.thresholds)
    if plan.verifier == "oracle":
        from sdvg.generation.early_exit.oracle import OracleVerifier

        return OracleVerifier(plan.eps)
    if plan.verifier == "pattern":
        from sdvg.generation.early_exit.pattern import PatternVerifier

        return PatternVerifier(plan.pattern_steps)
    if plan.verifier == "head":
        from sdvg.generation.early_exit.head import HeadVerifier

        if plan.head is None:
            raise ValueError("the head verifier needs a loaded exit head (exit_head=FILE)")
        return HeadVerifier(plan.head, plan.eps)
    raise ValueError(f"unknown exit verifier {plan.verifier!r}")


def dense_rollout(model, noise: torch.Tensor, block: int, position: int, seed: int, text_kv) -> list[torch.Tensor]:
    """The full schedule without exits: every call's x0 [1, C, F, H, W] (float32). Writes the pending
    cache slot like any denoise (a following denoise of the block overwrites it at its first call)."""
    x = noise.to(model.device)
    out = []
    for i in range(model.schedule.num_steps):
        x0 = model.x0_at(x, i, position, text_kv)
        out.append(x0)
        if i + 1 < model.schedule.num_steps:
            x = model.renoised(x0, i + 1, block, seed)
    return out


def denoise_with_exit(model, verifier, noise: torch.Tensor, block: int, position: int, seed: int, text_kv,
                      history) -> tuple[torch.Tensor, ExitRecord]:
    """Denoise `noise` [1, C, F, H, W] (float32) for block `block` at RoPE position `position` with
    early exit -> (x0 [1, C, F, H, W] float32 on the model's device, its ExitRecord). `model` is the
    RoleModel (x0_at, renoised, schedule, role, device, patch); `history()` gives the clean history tokens
    the attention window sees [N, D]; `text_kv`: the block's conditioning."""
    device, patch = model.device, model.patch
    x = noise.to(device)
    K = model.schedule.num_steps
    grid = token_grid(tuple(x.shape), patch)
    num_tokens = grid[0] * grid[1] * grid[2]
    verifier.start(BlockContext(model.role, block, seed, K, tuple(x.shape), patch, history,
                                lambda: dense_rollout(model, noise, block, position, seed, text_kv)))
    oracle_forwards = getattr(verifier, "rollouts", 0)
    active = torch.arange(num_tokens, device=device)  # [A], ascending
    steps = torch.full((num_tokens,), K, dtype=torch.int16, device=device)  # k*(i)
    frozen = torch.zeros((num_tokens,), dtype=torch.bool, device=device)
    out = torch.zeros_like(x)  # the committed tokens' x0
    prev_x0, forwards = None, 0
    for i in range(K):
        dense = active.numel() == num_tokens
        hidden = [] if verifier.needs_hidden else None
        x0 = model.x0_at(x, i, position, text_kv, active=None if dense else active, hidden=hidden)  # at the active tokens
        forwards += 1
        if i + 1 == K:
            break
        view = StepView(i, K, x0, prev_x0, active, hidden[0][0] if hidden else None, patch)
        exits = verifier.converged(view).to(device)  # [A] bool
        if bool(exits.any()):
            leaving = active[exits]
            steps[leaving] = i + 1
            frozen[leaving] = True
            newly = torch.zeros_like(frozen)
            newly[leaving] = True
            out = torch.where(token_mask_to_latents(newly, tuple(x.shape), patch), x0, out)  # frozen at x0^(k)
            active = active[~exits]
            if active.numel() == 0:
                break
        x = model.renoised(x0, i + 1, block, seed)
        prev_x0 = x0
    if active.numel():
        keep = token_mask_to_latents(frozen, tuple(x.shape), patch)
        out = torch.where(keep, out, x0)  # tokens that never exited: the last call's x0
    record = ExitRecord(model.role, block, verifier.name, K, steps.reshape(grid).cpu(), forwards, oracle_forwards)
    return out, record
