"""The block plan: what both loops are told before each block, and the rule that forces a block.

Both loops ask a plan before every block (`Plan.begin(b)`): the reference loop itself
(sdvg/generation/reference.py), the native scheduler through `StageCalls.plan` (one Python call per
block). A whole video's plan is a `FixedPlan` of its options; a live session (sdvg/live/session.py)
is a plan whose router, prompt and forcing change between blocks. The step says whether the video
stops before the block, whether the block is its last, whether it is forced to the target, which
router decides its draft, the text conditioning the block is made under (a value: both loops pass
its K/V to every forward of the block) and which roles re-cache their context under it first. The
native scheduler gets the same step as a `_C.BlockPlan` (`native_plan`): the decision of a router
that does not look at the draft, or the threshold a scored draft is held to, and the re-caches; it
keeps no routing rule of its own.

A plan also says, once for the video, what the loops set up around it: `recaches` (a full-context
role may be asked to re-cache: its clean latents are kept), `max_held_commits` (lazy target commits
held at most; None: no cap) and `record_blocks` (the per-block times and trace spans kept; None: all).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sdvg._native import _C
from sdvg.generation.routers import Router
from sdvg.options import GenerationOptions


@dataclass(frozen=True, eq=False)
class Conditioning:
    """The text a block is made under, as a value: `key` (equal keys <=> equal embeddings, so a role's K/V of it is
    made once: `calls.TextKVCache`), `prompt` (what a score is judged against), `emb` (the umT5 embedding
    [1, L, d]). A whole video's is its prompt's (`prepare`); a live session's changes between blocks, blended
    over a few after a switch (sdvg/live/conditioning.py)."""

    key: tuple
    prompt: str
    emb: torch.Tensor


@dataclass(frozen=True)
class BlockStep:
    """Before a block: stop here, or produce it (last? forced to the target? under which router and which
    conditioning? which roles re-cache under it first?)."""

    stop: bool
    last: bool = False
    forced: bool = False  # sdvg mode: the target makes the block whatever the router says (`forced_block`)
    router: Router | None = None
    conditioning: Conditioning | None = None
    recache: frozenset = frozenset()  # roles that re-cache their context under `conditioning` first (`recaching_roles`)


STOP = BlockStep(stop=True)


class Plan(Protocol):
    recaches: bool
    max_held_commits: int | None
    record_blocks: int | None

    def begin(self, block: int) -> BlockStep:
        """Block `block`'s step; asked once per block, in order, by whichever loop runs the video."""


def forced_block(opts: GenerationOptions, block: int, after_switch: bool = False) -> bool:
    """The one rule of forcing (sdvg mode only; the other modes have no draft to route): block 0 under
    `force_first_reject`, and a live session's first block under a new prompt under
    `force_reject_after_switch` (`after_switch`: the session's table says the block's prompt is new)."""
    if opts.mode != "sdvg":
        return False
    return (block == 0 and opts.force_first_reject) or (after_switch and block > 0 and opts.force_reject_after_switch)


def recaching_roles(opts: GenerationOptions, block: int, key, previous_key) -> frozenset:
    """The one rule of re-caching (LongLive's re-cache on a switch, docs/live.md): under `recache`, each role
    with a full context re-caches its visible frames under block `block`'s conditioning (`key`) when it
    differs from the block before's (`previous_key`), before the role's first forward of the block. Block 0
    of a video has nothing before it to re-cache."""
    if not opts.recache or block == 0 or key == previous_key:
        return frozenset()
    return frozenset(r for r in opts.roles if opts.context_mode(r) == "full")


class FixedPlan:
    """A whole video: `opts.num_blocks` blocks under the video's one router and one conditioning (its prompt's,
    `prepare`), block 0 forced by the rule."""

    recaches = False
    max_held_commits = None
    record_blocks = None

    def __init__(self, opts: GenerationOptions, conditioning: Conditioning):
        if opts.num_blocks is None:
            raise ValueError("a whole video's plan needs resolved options (num_blocks set)")
        self.opts, self.router, self.conditioning = opts, Router.from_options(opts), conditioning

    def begin(self, block: int) -> BlockStep:
        n = self.opts.num_blocks
        if block >= n:
            return STOP
        return BlockStep(False, block == n - 1, forced_block(self.opts, block), self.router, self.conditioning)


def native_plan(step: BlockStep, block: int, seed: int) -> _C.BlockPlan:
    """`step` for the native scheduler: a router that does not look at the draft hands over its decision
    (`accept`), one that does its threshold (`scored`, `tau`: accepted when the block score >= tau); the
    roles that re-cache before their first work on the block (`drafter_recache`, `target_recache`)."""
    if step.stop:
        return _C.BlockPlan(stop=True)
    router = step.router
    return _C.BlockPlan(last=step.last, forced=step.forced, drafter_recache="drafter" in step.recache,
                        target_recache="target" in step.recache, scored=router.scored,
                        tau=router.tau if router.scored else 0.0,
                        accept=not router.scored and router.accept(block, None, seed))
