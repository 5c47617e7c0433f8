"""The native scheduler's driver: the SDVG loop run by `sdvg._C.Scheduler` (`scheduler="cpp"`).

The scheduler decides, orders and times everything, owns the KV-cache pointer moves and runs the
drafter ahead on its own thread when asked (`run_ahead`); Python is entered only for the stage
calls below, which are the very primitives of the reference loop, so the outputs are identical.
Blocks come back through a queue as soon as the scheduler emits them. The stage outputs go through
the video's `StageGuard` as in the reference loop: the scheduler rejects a non-finite draft on its
NaN score, and a non-finite target or emitted output raises from the stage call.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator

import torch

from sdvg._native import _C
from sdvg.generation.early_exit.record import block_exits
from sdvg.generation.noise import block_noise, copy_ahead
from sdvg.generation.prepare import prepare
from sdvg.generation.routers import Router
from sdvg.generation.stage_timing import StageEvents
from sdvg.generation.transfer import LatentTransfer
from sdvg.generation.types import BlockRecord, Counters, LoopReport, block_times
from sdvg.models.components import Components
from sdvg.models.vae import to_uint8_frames, to_unit_frames
from sdvg.options import GenerationOptions

_DONE = object()


class _Stages:
    """The stage calls the scheduler makes (`types.StageCalls`; each runs on the current thread's stream)."""

    def __init__(self, comps: Components, prompt: str, opts: GenerationOptions, setup, sink: queue.Queue):
        self.comps, self.prompt, self.opts, self.setup, self.sink = comps, prompt, opts, setup, sink
        self.F, self.guard = setup.frames_per_block, setup.guard
        self.transfer = LatentTransfer([comps.drafter_device, comps.target_device])
        self.drafter_dev, self.target_dev, self.vae_dev = comps.drafter_device, comps.target_device, comps.vae.device
        # stage_timing "events": no per-stage wait; the scheduler's handles carry an event recorded on the
        # producer's stream that the consumer's stream waits on (csrc/py_scheduler.cpp), and every output the
        # host reads (the guard's finite checks, the scores) is read by the stage itself
        self.sync = opts.stage_timing == "sync"
        self.events = StageEvents([self.drafter_dev, self.target_dev, self.vae_dev])

    def _wait(self):
        """stage_timing "sync": the stage's work has run when the call returns (the scheduler's stage
        times measure execution). This role's stream only: roles still overlap."""
        if "cuda" in (self.drafter_dev.type, self.target_dev.type):
            torch.cuda.current_stream().synchronize()

    def _begin(self, device):
        return None if self.sync else self.events.start(device)

    def _done(self, out=None, stage=None, start=None, device=None):
        if self.sync:
            self._wait()
        else:
            self.events.end(stage, start, device)
        return out

    def _noise(self, b):
        return block_noise(self.setup.block_shape, self.opts.seed, b)

    def _noise_for(self, model, b):  # cuda_graphs: the block's draws copied ahead (pinned, non-blocking)
        noise = self._noise(b)
        if not self.opts.cuda_graphs:
            return noise
        return copy_ahead(noise, self.opts.seed, b, model.schedule.num_steps, model.role, model.device)

    def draft(self, b):
        t0 = self._begin(self.drafter_dev)
        x = self.setup.drafter.denoise(self._noise_for(self.setup.drafter, b), b, b * self.F, self.opts.seed)
        if self.setup.target is not None:
            self.transfer.prefetch(x, self.target_dev)  # an accepted draft goes into the target's cache
        return self._done(self.guard.draft(x, b), "draft", t0, self.drafter_dev)

    def drafter_commit(self, b, x):
        t0 = self._begin(self.drafter_dev)
        self._done(self.setup.drafter.commit_forward(self.transfer.get(x, self.drafter_dev), b * self.F),
                   "drafter_commit", t0, self.drafter_dev)

    def target(self, b):
        t0 = self._begin(self.target_dev)
        x = self.setup.target.denoise(self._noise_for(self.setup.target, b), b, b * self.F, self.opts.seed)
        self.transfer.prefetch(x, self.vae_dev)  # decoded, and committed into the drafter, over there
        return self._done(self.guard.target(x, b), "target", t0, self.target_dev)

    def target_commit(self, b, x):
        t0 = self._begin(self.target_dev)
        self._done(self.setup.target.commit_forward(self.transfer.get(x, self.target_dev), b * self.F),
                   "target_commit", t0, self.target_dev)

    def decode(self, x):
        t0 = self._begin(self.vae_dev)
        return self._done(self.guard.decode(
            lambda: self.setup.runners.decode(self.transfer.get(x, self.vae_dev), self.setup.vae_cache), x),
            "decode", t0, self.vae_dev)

    def _score_frames(self, pixels):
        t0 = self._begin(self.vae_dev)
        s = self.setup.runners.score(self.prompt, to_unit_frames(pixels))
        return self._done(s, "score", t0, self.vae_dev)  # the guard then reads the scores

    def score(self, pixels):
        if self.comps.scorer is None:
            self.guard.judge(pixels)  # a non-finite draft: rejected (or an error) as with a reward model
            return None
        return self.guard.score(self._score_frames, pixels, self.setup.aggregator)

    def vae_snapshot(self):
        return self.setup.vae_cache.snapshot()

    def vae_restore(self, snap):
        self.setup.vae_cache.restore(snap)

    def emit(self, rec: dict):
        self.setup.observe(rec["frames"])  # before the next block's target denoise (same thread)
        draft = rec["draft_latents"]
        self.transfer.release(rec["latents"])
        self.transfer.release(draft)
        self.sink.put(BlockRecord(
            rec["index"], rec["decision"], rec["latents"].float().cpu(), to_uint8_frames(rec["frames"]),
            rec["score"], list(rec["frame_scores"]), block_times(rec["times"]),
            draft_latents=None if draft is None else draft.float().cpu(),
            emitted_scores=list(rec["emitted_scores"]) if self.opts.score_emitted else None,
            exits=block_exits(self.setup.drafter, self.setup.target, rec["index"], rec["decision"])))


def scheduler_config(opts: GenerationOptions, frames_per_block: int, drafter_steps: int, target_steps: int,
                     drafter_recompute: bool = False, target_recompute: bool = False):
    """The native scheduler's config: every field by name (the C++ side has no defaults and refuses an
    unknown or missing field). `*_steps`: model calls per denoise of each role; `*_recompute`: the role's
    context is rebuilt before each block (its commits only record latents)."""
    router = Router.from_options(opts)
    uniforms = [router.uniform(b, opts.seed) for b in range(opts.num_blocks)] if opts.router == "random" else []
    return _C.SchedulerConfig(
        mode=opts.mode, num_blocks=opts.num_blocks, frames_per_block=frames_per_block, drafter_steps=drafter_steps,
        target_steps=target_steps, drafter_recompute=drafter_recompute, target_recompute=target_recompute,
        router=opts.router, tau=opts.tau, accept_prob=opts.accept_prob, uniforms=uniforms,
        pattern=list(opts.pattern), force_first_reject=opts.force_first_reject,
        own_context=opts.drafter_context == "own", skip_first_draft=opts.skip_first_draft,
        lazy_target_commit=opts.lazy_target_commit, score_emitted=opts.score_emitted, run_ahead=opts.run_ahead,
        run_ahead_blocks=opts.run_ahead_blocks)


def setup_scheduler_config(opts: GenerationOptions, setup):
    """`scheduler_config` for a prepared video (each role's schedule and context mode)."""
    d, t = setup.drafter, setup.target
    return scheduler_config(opts, setup.frames_per_block, d.schedule.num_steps if d else 1,
                            t.schedule.num_steps if t else 1, bool(d and d.context.recompute),
                            bool(t and t.context.recompute))


def generate_blocks_native(comps: Components, prompt: str, opts: GenerationOptions, report: LoopReport | None = None,
                           runners=None, threaded: bool = True,
                           memory_budget_gib: float | None = None) -> Iterator[BlockRecord]:
    """Same contract as `reference.generate_blocks`, run by the native scheduler.

    threaded=True runs the scheduler on a worker thread and yields each block as it is emitted;
    threaded=False runs it on the calling thread and yields the blocks at the end (CPU compute on a
    thread other than the main one measured 15-20% slower here, so whole-video calls use this)."""
    counters = Counters()  # the prepared models count nothing here: the scheduler keeps the counts
    setup = prepare(comps, prompt, opts, counters, slack_frames=setup_slack(comps, opts.run_ahead), runners=runners,
                    memory_budget_gib=memory_budget_gib)
    sink: queue.Queue = queue.Queue()
    stages = _Stages(comps, prompt, opts, setup, sink)
    sched = _C.Scheduler(
        setup_scheduler_config(opts, setup), stages,
        setup.drafter.cache if setup.drafter else None, setup.target.cache if setup.target else None,
        comps.drafter_device, comps.target_device)
    errors: list[BaseException] = []

    def body():
        try:
            sched.run()
        except BaseException as exc:  # handed to the consumer
            errors.append(exc)
        finally:
            sink.put(_DONE)

    if not threaded:
        body()
        while (item := sink.get()) is not _DONE:
            yield item
    else:
        worker = threading.Thread(target=body, name="sdvg-scheduler", daemon=True)
        worker.start()
        try:
            while True:
                item = sink.get()
                if item is _DONE:
                    break
                yield item
        finally:
            sched.cancel()  # no-op when finished; stops the scheduler if the consumer went away
            worker.join()
    if errors:  # a consumer that left early never gets here (GeneratorExit at its yield): the run's own error
        raise errors[0]
    device_times = stages.events.resolve()  # events: waits for every stage's last work (caches final)
    if report is not None:
        report.stage_device_s = device_times
        report.counters = sched.counters()
        report.trace = sched.trace()
        report.final_times = sched.block_times()
        report.drafter_cache = setup.drafter.cache if setup.drafter else None
        report.target_cache = setup.target.cache if setup.target else None


def setup_slack(comps: Components, run_ahead: bool) -> int:
    """Run-ahead rolls the drafter back over one speculative block and the draft written after it:
    a windowed cache needs two blocks of slack for that rollback to be exact."""
    return 2 * comps.preset.video.frames_per_block if run_ahead else 0
