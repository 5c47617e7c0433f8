"""NaN/inf in a stage output: an error naming the stage and the block, except for a draft.

Both schedulers call their stages through one `StageGuard` per video (`Setup.guard`, called by the
stage-call object of `calls.py`), so they make the same decisions:

- the target's latents, the VAE decode of the emitted block and the reward scores of emitted
  frames (`score_emitted`) must be finite, else `NonFiniteError` ("target output of block 3 holds
  12 NaN values; ...");
- a draft is only a proposal: when its latents, their decode or their reward scores are not finite,
  the draft is rejected with a `NonFiniteDraftWarning` naming the block, and the target makes the
  block. A draft whose latents are not finite is neither decoded nor scored. The decision is made
  where the native scheduler makes it, on the score stage's result: the score of such a draft is NaN
  (`NaN >= tau` is false for every tau, -inf included), so the reward router rejects it in both
  schedulers. The random and pattern routers decide without looking at the draft (a decision fixed
  per block in advance, which is what they are for): a non-finite draft that they reject anyway (or
  a forced block 0) is rejected with the warning; one they would accept raises `NonFiniteError`, as
  does any non-finite draft in mode `draft`, where the draft is the block. The router and the forcing
  are the block's own, as the loop's plan routes it (`route`: a live session's router changes between
  blocks, and an update can force a block), so the guard never says "rejected" of a block the scheduler accepts.

Under `drafter_context="own"` a rejected draft still enters the drafter's own context (the paper's
rule), so after a non-finite draft the drafter's later drafts are usually non-finite too: each is
rejected with a warning and the video continues from the target.

Cost: one reduction per stage output (`nonfinite_counts`: a sum, then a count only when it is not
finite); reading its result synchronises the stage's stream on CUDA, which both schedulers do after
every stage anyway."""
from __future__ import annotations

import math
import threading
import warnings

import torch

from sdvg.generation.routers import Router
from sdvg.models.checkpoints import nonfinite_counts
from sdvg.options import GenerationOptions


class NonFiniteError(RuntimeError):
    """A stage output holds NaN or inf; `stage` and `block` say where."""

    def __init__(self, message: str, stage: str, block: int):
        super().__init__(message)
        self.stage, self.block = stage, block


class NonFiniteDraftWarning(RuntimeWarning):
    """A draft held NaN or inf and was rejected; the target made its block."""


def describe(nan: int, inf: int) -> str:
    """'12 NaN values', '1 inf value', '3 NaN and 2 inf values'."""
    if nan and inf:
        return f"{nan} NaN and {inf} inf values"
    n, what = (nan, "NaN") if nan else (inf, "inf")
    return f"{n} {what} value{'' if n == 1 else 's'}"


_HINT = ("a numerical overflow (fp16: use bf16 or fp32) or bad weights (weights loaded from files were checked "
         "for NaN/inf on load)")


class StageGuard:
    """The finite checks of one video's stage outputs. The stage calls say whose output they hand over
    (`producer`: "drafter" or "target") and for which block; a draft found non-finite is remembered by
    its block until its score stage rejects it (a redraft of the block replaces the finding)."""

    def __init__(self, opts: GenerationOptions):
        self.mode, self.seed, self.own_context = opts.mode, opts.seed, opts.drafter_context == "own"
        self._problems: dict[int, str] = {}  # block -> what is wrong with its current draft
        # block -> (router, forced) as the loop's plan decided it (sdvg/generation/plan.py: both loops ask the plan
        # before any work on a block, so every draft's block is here)
        self._routes: dict[int, tuple[Router, bool]] = {}
        self._lock = threading.Lock()  # the drafter thread (run-ahead) checks drafts while the main one reads
        self.rejected: list[int] = []  # blocks whose draft was rejected for NaN/inf, in order

    def _set_problem(self, block: int, problem: str | None) -> None:
        with self._lock:
            if problem is None:
                self._problems.pop(block, None)
            else:
                self._problems[block] = problem

    def route(self, block: int, router: Router, forced: bool) -> None:
        """The loop's plan for `block`: the router that decides it and whether it is forced to the target. A
        non-finite draft of the block is judged by these, as the scheduler routes it."""
        with self._lock:
            self._routes[block] = (router, forced)
            self._routes.pop(block - 64, None)  # an unbounded session: only recent blocks can still be judged

    def _route(self, block: int) -> tuple[Router, bool]:
        with self._lock:
            planned = self._routes.get(block)
        if planned is None:
            raise RuntimeError(f"sdvg: block {block}'s draft was judged before the block was planned (both loops "
                               "ask the plan, StageCalls.step, before any work on a block)")
        return planned

    def _problem(self, producer: str, block: int) -> str | None:
        if producer != "drafter":
            return None
        with self._lock:
            return self._problems.get(block)

    # ---------------------------------------------------------------- stages
    def draft(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """The drafter's latents of `block`; in mode `draft` (the draft is the block) NaN/inf raises."""
        nan, inf = nonfinite_counts(x)
        problem = f"drafter output of block {block} holds {describe(nan, inf)}" if nan or inf else None
        if problem and self.mode != "sdvg":
            raise NonFiniteError(f"{problem}; in mode {self.mode!r} the draft is the block and nothing replaces it "
                                 f"({_HINT})", "draft", block)
        self._set_problem(block, problem)
        return x

    def target(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """The target's latents of `block`: NaN/inf raises."""
        nan, inf = nonfinite_counts(x)
        if nan or inf:
            raise NonFiniteError(f"target output of block {block} holds {describe(nan, inf)}; the block cannot be "
                                 f"emitted ({_HINT})", "target", block)
        return x

    def decode(self, fn, latents, producer: str, block: int):
        """`fn()` decodes `producer`'s `latents` of `block`; a draft already found non-finite is not
        decoded (its block is rejected and the VAE cache restored; `latents` comes back as its
        placeholder). NaN/inf in the pixels of a draft marks the draft; in those of an emitted block it raises."""
        if self._problem(producer, block) is not None:
            return latents
        pixels = fn()
        nan, inf = nonfinite_counts(pixels)
        if nan or inf:
            if producer == "drafter" and self.mode == "sdvg":
                self._set_problem(block, f"VAE decode of the draft of block {block} holds {describe(nan, inf)}")
                return pixels
            raise NonFiniteError(f"decode output of block {block} holds {describe(nan, inf)}; the block cannot be "
                                 "emitted (the latents were finite: the VAE overflowed or its weights are bad)",
                                 "decode", block)
        return pixels

    def score(self, fn, pixels, aggregator, producer: str, block: int) -> tuple[float, list[float]]:
        """(aggregated score, per-frame scores) of `producer`'s decoded `pixels` of `block` (`fn(pixels)`
        scores them). A non-finite draft is rejected (NaN, not scored when its latents or pixels were the
        problem); non-finite scores of emitted frames raise."""
        problem = self._problem(producer, block)
        if problem is not None:
            self.reject(block, problem)
            return math.nan, []
        s = fn(pixels)
        frame_scores = [float(v) for v in s.cpu()]
        bad = [v for v in frame_scores if not math.isfinite(v)]
        if bad:
            nan = sum(math.isnan(v) for v in bad)
            counts = describe(nan, len(bad) - nan)
            if producer == "drafter":
                self.reject(block, f"reward scores of the draft of block {block} hold {counts}")
                return math.nan, frame_scores
            raise NonFiniteError(f"reward scores of the emitted frames of block {block} hold {counts} (the frames "
                                 "were finite: the reward model overflowed or its weights are bad)", "score", block)
        return float(aggregator(s)), frame_scores

    def judge(self, producer: str, block: int) -> None:
        """The score stage without a reward model: a non-finite draft is rejected (or raises, see `reject`)."""
        problem = self._problem(producer, block)
        if problem is not None:
            self.reject(block, problem)

    def reject(self, block: int, problem: str) -> None:
        """Reject the non-finite draft of `block` with a warning, or raise when the run cannot reject it."""
        router, forced = self._route(block)
        if not forced and not router.scored and router.accept(block, None, self.seed):
            raise NonFiniteError(f"{problem}; router {router.kind!r} accepts block {block} by a decision fixed "
                                 "in advance and cannot reject it (router 'reward' rejects a non-finite draft; "
                                 f"{_HINT})", "draft", block)
        self.rejected.append(block)
        more = (" Under drafter_context 'own' this draft enters the drafter's context, so its later drafts may be "
                "non-finite too." if self.own_context else "")
        warnings.warn(f"{problem}: the draft is rejected and the target makes block {block}.{more}",
                      NonFiniteDraftWarning, stacklevel=2)
