"""The SDVG method on one page: the plain Python loop, the oracle of every faster path.

It is the native scheduler's main loop (`csrc/scheduler.cpp`, `Scheduler::run_main`) written out
step for step over the same stage calls (`calls.StageCalls`: timing, trace, copy-ahead and the
NaN/inf guard live there), so both give bitwise the same video. Per block b (docs/method.md):

  1. draft: the drafter denoises noise_b (seed, b; shared by both roles) in its few steps -> x_hat;
  2. decode + score: snapshot the VAE cache, decode x_hat, ImageReward per frame, aggregated
     (default: the worst frame) -> q_b;
  3. route: block 0 is forced to the target; later blocks are accepted when the router says so
     (reward: q_b >= tau);
  4. target on reject: restore the VAE cache, the target denoises the same noise_b -> x_b, decode;
  5. commit: the block enters each model's context (the drafter takes its own draft under `own`, the
     paper's rule, or x_b under `committed`; the target takes x_b, lazily when it was accepted) and
     this loop moves each full-context cache's write pointer; the frames are emitted.

Every forward of block b runs under the conditioning of b's step (the plan's); where the step asks
it, a role first re-caches its context under that conditioning, before its first work on b (the
drafter: its draft, or its commit of a block it did not draft; the target: its denoise, or its
commit of b, held or not).

Modes `target` and `draft` run steps 4 and 1 alone.
"""
from __future__ import annotations

import itertools
import time
from typing import Iterator

import torch

from sdvg.generation.calls import StageCalls
from sdvg.generation.plan import FixedPlan
from sdvg.generation.prepare import prepare
from sdvg.generation.types import BlockRecord, Counters, LoopReport
from sdvg.models.components import Components
from sdvg.options import GenerationOptions


def generate_blocks(comps: Components, prompt: str, opts: GenerationOptions, report: LoopReport | None = None,
                    runners=None, memory_budget_gib: float | None = None,
                    exit_verifiers: dict | None = None, plan=None, video_input=None,
                    start_latents=None, batcher=None) -> Iterator[BlockRecord]:
    """Yields each block as soon as its frames are final; `report` is filled at the end.
    `opts` are resolved options (num_blocks set); `memory_budget_gib`, `exit_verifiers`: see `prepare`.
    `plan`: the video's block plan (sdvg/generation/plan.py; None: the `FixedPlan` of `opts`), asked before
    each block whether it is the last, forced, its router and conditioning, or that the video stops here. A live
    session (sdvg/live/session.py) is such a plan (num_blocks then only sizes the caches). `video_input`: video-to-video's
    input (`sdvg.generation.video_input.VideoInput`), None for text-to-video. `start_latents`: a start frame's
    clean latents before block 0 (`prepare`), None for none. `batcher`: the denoising and scoring go through it,
    batched with other videos' (sdvg/generation/batching.py); None: alone."""
    counters = Counters()  # the models count their forwards here; this loop counts what it skips
    setup = prepare(comps, prompt, opts, counters, runners=runners, memory_budget_gib=memory_budget_gib,
                    exit_verifiers=exit_verifiers, start_latents=start_latents,
                    keep_clean=plan is not None and plan.recaches)
    plan = plan if plan is not None else FixedPlan(opts, setup.conditioning)
    calls = StageCalls(comps, opts, setup, plan, record_trace=True, video_input=video_input, batcher=batcher)
    drafter, target = setup.drafter, setup.target
    # target commits not made yet (lazy_target_commit): (block, latents, the target re-caches before it)
    pending: list[tuple[int, torch.Tensor, bool]] = []
    # an unbounded session never reaches the last block, where held commits are dropped: it holds a few at most
    held_limit = plan.max_held_commits

    def commit_target(upto: list) -> None:
        for block, x, recache in upto:
            if recache:
                calls.recache("target", block)
            calls.target_commit(block, x)
            if not target.context.recompute:
                target.cache.commit()  # this loop moves the write pointer
        upto.clear()

    def run_target(b: int, step) -> torch.Tensor:  # 4. the target denoises noise_b (lazy commits first)
        commit_target(pending)
        if "target" in step.recache:
            calls.recache("target", b)
        return calls.target(b)

    def run_draft(b: int, step) -> torch.Tensor:  # 1. the drafter denoises noise_b
        if "drafter" in step.recache:
            calls.recache("drafter", b)
        return calls.draft(b)

    def produce() -> Iterator[BlockRecord]:
        for b in itertools.count():
            step = calls.step(b)  # the plan's step (the guard told how the block is routed)
            if step.stop:
                break
            calls.begin_block(b)
            last = step.last
            draft, score, frame_scores, emitted_scores = None, None, [], None
            accepted = False

            if opts.mode == "target":
                x_b = run_target(b, step)
                pixels = calls.decode(x_b, "target", b)
                decision = "target"
            elif opts.mode == "draft":
                x_b = draft = run_draft(b, step)  # 1.
                pixels = calls.decode(x_b, "drafter", b)
                decision, accepted = "draft", True
            else:
                forced = step.forced
                if forced and opts.skips_first_draft:
                    counters.skipped_drafter_forwards += drafter.schedule.num_steps
                else:
                    draft = run_draft(b, step)  # 1. draft
                    snapshot = setup.vae_cache.snapshot()  # 2. decode + score
                    pixels_hat = calls.decode(draft, "drafter", b)
                    scored = calls.score(pixels_hat, "drafter", b)
                    if scored is not None:
                        score, frame_scores = scored.score, list(scored.frame_scores)
                accepted = not forced and step.router.accept(b, score, opts.seed)  # 3. route
                if accepted:
                    decision, x_b, pixels = "accepted", draft, pixels_hat
                    emitted_scores = frame_scores
                else:
                    decision = "forced" if forced else "rejected"
                    if draft is not None:
                        setup.vae_cache.restore(snapshot)
                    x_b = run_target(b, step)  # 4. target on reject
                    pixels = calls.decode(x_b, "target", b)
                    if opts.score_emitted and (scored := calls.score(pixels, "target", b)) is not None:
                        emitted_scores = list(scored.frame_scores)

            setup.observe(pixels)  # the emitted pixel window a recompute role re-encodes its first frame from
            # 5. commit: the block enters the contexts that will read it
            if not last:
                if drafter is not None:
                    if draft is None and "drafter" in step.recache:  # a forced block it did not draft
                        calls.recache("drafter", b)
                    calls.drafter_commit(b, draft if (opts.drafter_context == "own" and draft is not None) else x_b)
                    if not drafter.context.recompute:
                        drafter.cache.commit()  # this loop moves the write pointer
                if target is not None:
                    # an accepted block's target re-cache is still to make (a target-made block's came before its denoise)
                    pending.append((b, x_b, "target" in step.recache and accepted))
                    if not (opts.lazy_target_commit and accepted and opts.mode == "sdvg"):
                        commit_target(pending)
                    elif held_limit is not None and len(pending) > held_limit:
                        commit_target([pending.pop(0)])  # the oldest, in order: the same cache, bitwise
            else:
                counters.skipped_target_commits += (target is not None) + len(pending)
                counters.skipped_drafter_commits += drafter is not None
                pending.clear()
            yield calls.block_record(b, decision, x_b, pixels, draft if opts.mode == "sdvg" else None, score,
                                     frame_scores, emitted_scores or [], calls.times[b])

    try:
        yield from produce()
    finally:  # also when the consumer stops early (a live session's close)
        device_times = calls.events.resolve()  # events: waits for the last work (None unless events are on)
        counters.scheduler_wall_s = time.perf_counter() - calls.t_start
        counters.stage_call_s = counters.main_stage_s = calls.stage_s
        if report is not None:
            report.stage_device_s = device_times
            report.compile = calls.compile_clock.since() if calls.compile_clock is not None else None
            report.counters = counters
            report.trace = list(calls.trace)
            report.drafter_cache = drafter.cache if drafter else None
            report.target_cache = target.cache if target else None
