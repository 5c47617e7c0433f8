"""The block plan: what both loops are told before each block, and the rule that forces a block.

Both loops ask a plan before every block (`Plan.begin(b)`): the reference loop itself
(sdvg/generation/reference.py), the native scheduler through `StageCalls.plan` (one Python call per
block). A whole video's plan is a `FixedPlan` of its options; a live session (sdvg/live/session.py)
is a plan whose router, prompt and forcing change between blocks. The step says whether the video
stops before the block, whether the block is its last, whether it is forced to the target, and
which router decides its draft. The native scheduler gets the same step as a `_C.BlockPlan`
(`native_plan`): the decision of a router that does not look at the draft, or the threshold a
scored draft is held to; it keeps no routing rule of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sdvg._native import _C
from sdvg.generation.routers import Router
from sdvg.options import GenerationOptions


@dataclass(frozen=True)
class BlockStep:
    """Before a block: stop here, or produce it (last? forced to the target? under which router)."""

    stop: bool
    last: bool = False
    forced: bool = False  # sdvg mode: the target makes the block whatever the router says (`forced_block`)
    router: Router | None = None


STOP = BlockStep(stop=True)


class Plan(Protocol):
    def begin(self, block: int) -> BlockStep:
        """Block `block`'s step; asked once per block, in order, by whichever loop runs the video."""


def forced_block(opts: GenerationOptions, block: int, after_switch: bool = False) -> bool:
    """The one rule of forcing (sdvg mode only; the other modes have no draft to route): block 0 under
    `force_first_reject`, and a live session's first block under a new prompt under
    `force_reject_after_switch` (`after_switch`: the session's table says the block's prompt is new)."""
    if opts.mode != "sdvg":
        return False
    return (block == 0 and opts.force_first_reject) or (after_switch and block > 0 and opts.force_reject_after_switch)


class FixedPlan:
    """A whole video: `opts.num_blocks` blocks under the video's one router, block 0 forced by the rule."""

    def __init__(self, opts: GenerationOptions):
        if opts.num_blocks is None:
            raise ValueError("a whole video's plan needs resolved options (num_blocks set)")
        self.opts, self.router = opts, Router.from_options(opts)

    def begin(self, block: int) -> BlockStep:
        n = self.opts.num_blocks
        if block >= n:
            return STOP
        return BlockStep(False, block == n - 1, forced_block(self.opts, block), self.router)


def native_plan(step: BlockStep, block: int, seed: int, recache: bool = False) -> _C.BlockPlan:
    """`step` for the native scheduler: a router that does not look at the draft hands over its decision
    (`accept`), one that does its threshold (`scored`, `tau`: accepted when the block score >= tau).
    `recache`: the drafter re-caches its context before the block (a live session's new conditioning)."""
    if step.stop:
        return _C.BlockPlan(stop=True)
    router = step.router
    return _C.BlockPlan(last=step.last, forced=step.forced, recache=recache, scored=router.scored,
                        tau=router.tau if router.scored else 0.0,
                        accept=not router.scored and router.accept(block, None, seed))
