"""The reference SDVG loop in plain Python: the oracle for every faster path.

Per block b (docs/method.md):
  1. noise_b from (seed, b) -- shared by drafter and target;
  2. the drafter denoises noise_b in 4 steps -> x_hat;
  3. snapshot the VAE cache, decode x_hat;
  4. ImageReward per frame, aggregated (default: the worst frame) -> q_b;
  5. b == 0 (forced) or the router says no -> restore the VAE cache, the target denoises the same
     noise_b -> x_b, decode; else x_b = x_hat and its frames are emitted as decoded;
  6. commit the block into each model's context and emit the frames: the drafter takes its own
     draft (`own`, the paper's rule) or x_b (`committed`); the target takes x_b (a t = 0 forward
     under a full context; under recompute its latents join the context and the next target
     denoise rebuilds the cache from them).
Modes `target` and `draft` run the same code with only one model. Every stage output goes through
the video's `StageGuard` (`guard.py`): NaN/inf is an error naming the stage and the block, except in
a draft, which is then rejected with a warning (its score is NaN) and the target makes the block.
"""
from __future__ import annotations

import time
from typing import Iterator

import torch

from sdvg.generation.early_exit.record import block_exits
from sdvg.generation.noise import block_noise, copy_ahead
from sdvg.generation.prepare import prepare, sync
from sdvg.generation.routers import Router
from sdvg.generation.stage_timing import StageEvents
from sdvg.generation.types import STAGE_NAMES, BlockRecord, Counters, LoopReport, block_times
from sdvg.models.components import Components
from sdvg.models.vae import to_uint8_frames, to_unit_frames
from sdvg.options import GenerationOptions


def generate_blocks(comps: Components, prompt: str, opts: GenerationOptions, report: LoopReport | None = None,
                    runners=None, memory_budget_gib: float | None = None,
                    exit_verifiers: dict | None = None) -> Iterator[BlockRecord]:
    """Yields each block as soon as its frames are final; `report` is filled at the end.
    `opts` are resolved options (num_blocks set); `memory_budget_gib`, `exit_verifiers`: see `prepare`."""
    counters = Counters()
    router = Router.from_options(opts)
    setup = prepare(comps, prompt, opts, counters, runners=runners, memory_budget_gib=memory_budget_gib,
                    exit_verifiers=exit_verifiers)
    run = setup.runners
    agg, drafter, target, guard = setup.aggregator, setup.drafter, setup.target, setup.guard
    vae_cache = setup.vae_cache
    zf, shape = setup.frames_per_block, setup.block_shape
    pending_target_commits: list[tuple[torch.Tensor, int]] = []  # accepted blocks not yet in the target

    trace: list[dict] = []  # every stage call: the same spans as the native scheduler's trace()
    t_start = time.perf_counter()

    # stage_timing "sync": the device is idle before and after each stage (the times measure execution);
    # "events": no wait (one stream, one thread: stream order is enough), device time from event pairs
    waits = opts.stage_timing == "sync"
    events = StageEvents([comps.drafter_device, comps.target_device, comps.vae.device])

    def timed(times, name, device, fn):
        if waits:
            sync(device)
        start = None if waits else events.start(device)
        t0 = time.perf_counter()
        out = fn()
        if waits:
            sync(device)
        else:
            events.end(name, start, device)
        t1 = time.perf_counter()
        times[name] = times.get(name, 0.0) + t1 - t0
        # b: the block the loop below is producing when this call is made
        trace.append({"block": b, "stage": name, "thread": "main", "start_s": t0 - t_start,
                      "end_s": t1 - t_start})
        return out

    # the stage calls, each through the guard (NaN/inf checks), as the native scheduler's `_Stages`
    def ahead(noise, b, model):  # cuda_graphs: the block's draws copied ahead (pinned, non-blocking)
        if not opts.cuda_graphs:
            return noise
        return copy_ahead(noise, opts.seed, b, model.schedule.num_steps, model.role, model.device)

    def denoise_draft(noise, b, frame0):
        return guard.draft(drafter.denoise(ahead(noise, b, drafter), b, frame0, opts.seed), b)

    def denoise_target(noise, b, frame0):
        return guard.target(target.denoise(ahead(noise, b, target), b, frame0, opts.seed), b)

    def decode(latents):
        return guard.decode(lambda: run.decode(latents, vae_cache), latents)

    def score_frames(pixels):
        return run.score(prompt, to_unit_frames(pixels))

    def flush_target_commits(times):
        while pending_target_commits:
            lat, f0 = pending_target_commits.pop(0)
            timed(times, "target_commit", target.device, lambda: target.commit(lat, f0))

    for b in range(opts.num_blocks):
        times = {k: 0.0 for k in STAGE_NAMES}
        frame0 = b * zf
        last = b == opts.num_blocks - 1
        noise = block_noise(shape, opts.seed, b)
        draft = None
        score, frame_scores, emitted_scores = None, [], None

        if opts.mode == "target":
            flush_target_commits(times)
            x_b = timed(times, "target", target.device, lambda: denoise_target(noise, b, frame0))
            pixels = timed(times, "decode", comps.vae.device, lambda: decode(x_b))
            decision = "target"
        elif opts.mode == "draft":
            x_b = timed(times, "draft", drafter.device, lambda: denoise_draft(noise, b, frame0))
            pixels = timed(times, "decode", comps.vae.device, lambda: decode(x_b))
            decision = "draft"
        else:
            forced = b == 0 and opts.force_first_reject
            pixels_hat = None
            if forced and opts.skips_first_draft:
                counters.skipped_drafter_forwards += drafter.schedule.num_steps
            else:
                draft = timed(times, "draft", drafter.device, lambda: denoise_draft(noise, b, frame0))
                snap = vae_cache.snapshot()
                pixels_hat = timed(times, "decode", comps.vae.device, lambda: decode(draft))
                if comps.scorer is not None:
                    score, frame_scores = timed(times, "score", comps.vae.device,
                                                lambda: guard.score(score_frames, pixels_hat, agg))
                else:
                    guard.judge(pixels_hat)  # no score: a non-finite draft is rejected (or refused) all the same
            accepted = (not forced) and router.accept(b, score, opts.seed)
            if accepted:
                decision, x_b, pixels = "accepted", draft, pixels_hat
            else:
                decision = "forced" if forced else "rejected"
                if pixels_hat is not None:
                    vae_cache.restore(snap)
                flush_target_commits(times)
                x_b = timed(times, "target", target.device, lambda: denoise_target(noise, b, frame0))
                pixels = timed(times, "decode", comps.vae.device, lambda: decode(x_b))
                if opts.score_emitted and comps.scorer is not None:
                    emitted_scores = timed(times, "score", comps.vae.device,
                                           lambda: guard.score(score_frames, pixels, agg))[1]
            if accepted and opts.score_emitted:
                emitted_scores = list(frame_scores)

        setup.observe(pixels)  # the emitted pixel window a recompute role re-encodes its first frame from
        # Commit the emitted block into the caches that will read it.
        if not last:
            if drafter is not None:
                ctx = draft if (opts.drafter_context == "own" and draft is not None) else x_b
                timed(times, "drafter_commit", drafter.device, lambda: drafter.commit(ctx, frame0))
            if target is not None:
                pending_target_commits.append((x_b, frame0))
                if not (opts.lazy_target_commit and decision == "accepted"):
                    flush_target_commits(times)
        else:
            counters.skipped_target_commits += (target is not None) + len(pending_target_commits)
            counters.skipped_drafter_commits += drafter is not None
            pending_target_commits.clear()
        yield BlockRecord(b, decision, x_b.float().cpu(), to_uint8_frames(pixels), score, frame_scores,
                          block_times(times), draft_latents=None if draft is None else draft.float().cpu(),
                          emitted_scores=emitted_scores, exits=block_exits(drafter, target, b, decision))
    device_times = events.resolve() if not waits else None  # events: waits for the video's last work
    counters.scheduler_wall_s = time.perf_counter() - t_start
    counters.stage_call_s = counters.main_stage_s = sum(x["end_s"] - x["start_s"] for x in trace)  # one thread
    if report is not None:
        report.stage_device_s = device_times
        report.counters = counters
        report.trace = trace
        report.drafter_cache = drafter.cache if drafter else None
        report.target_cache = target.cache if target else None
