"""The `cpp` backend: the SDVG loop run by the native scheduler (`sdvg._C.Scheduler`).

The scheduler decides, orders and times everything, owns the KV-cache pointer moves and runs the
drafter ahead on its own thread when asked (`run_ahead`); Python is entered only for the stage
calls below, which are the very primitives of the reference loop, so the outputs are identical.
Blocks come back through a queue as soon as the scheduler emits them.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator

import torch

from sdvg._native import _C
from sdvg.models import Components
from sdvg.noise import block_noise, generator
from sdvg.reference import BlockResult, Counters, GenerationConfig, prepare
from sdvg.transfer import LatentTransfer
from sdvg.vae import to_uint8_frames, to_unit_frames

_DONE = object()


class _Stages:
    """The stage calls the scheduler makes (each runs on the current thread's stream)."""

    def __init__(self, comps: Components, prompt: str, cfg: GenerationConfig, setup, sink: queue.Queue,
                 sync_stages: bool):
        self.comps, self.prompt, self.cfg, self.setup, self.sink = comps, prompt, cfg, setup, sink
        self.F = setup.frames_per_block
        self.sync = sync_stages
        self.transfer = LatentTransfer([comps.drafter_device, comps.target_device])
        self.drafter_dev, self.target_dev, self.vae_dev = comps.drafter_device, comps.target_device, comps.vae.device

    def _done(self, out=None):
        if self.sync and torch.cuda.is_available() and "cuda" in (self.drafter_dev.type, self.target_dev.type):
            torch.cuda.current_stream().synchronize()  # this role's stream only: roles still overlap
        return out

    def _noise(self, b):
        return block_noise(self.setup.block_shape, self.cfg.seed, b)

    def draft(self, b):
        x = self.setup.drafter.denoise(self._noise(b), b, b * self.F, self.cfg.seed)
        if self.setup.target is not None:
            self.transfer.prefetch(x, self.target_dev)  # an accepted draft goes into the target's cache
        return self._done(x)

    def drafter_commit(self, b, x):
        self._done(self.setup.drafter.commit_forward(self.transfer.get(x, self.drafter_dev), b * self.F))

    def target(self, b):
        x = self.setup.target.denoise(self._noise(b), b, b * self.F, self.cfg.seed)
        self.transfer.prefetch(x, self.vae_dev)  # decoded, and committed into the drafter, over there
        return self._done(x)

    def target_commit(self, b, x):
        self._done(self.setup.target.commit_forward(self.transfer.get(x, self.target_dev), b * self.F))

    def decode(self, x):
        return self._done(self.setup.runners.decode(self.transfer.get(x, self.vae_dev), self.setup.vae_cache))

    def score(self, pixels):
        if self.comps.scorer is None:
            return None
        s = self.setup.runners.score(self.prompt, to_unit_frames(pixels))
        self._done()
        return self.setup.aggregator(s), [float(v) for v in s.cpu()]

    def vae_snapshot(self):
        return self.setup.vae_cache.snapshot()

    def vae_restore(self, snap):
        self.setup.vae_cache.restore(snap)

    def emit(self, rec: dict):
        times = dict(rec["times"])
        times["commit"] = times["drafter_commit"] + times["target_commit"]
        draft = rec["draft_latents"]
        self.transfer.release(rec["latents"])
        self.transfer.release(draft)
        self.sink.put(BlockResult(
            rec["index"], rec["decision"], rec["latents"].float().cpu(), to_uint8_frames(rec["frames"]),
            rec["score"], list(rec["frame_scores"]), times,
            draft_latents=None if draft is None else draft.float().cpu(),
            emitted_scores=list(rec["emitted_scores"]) if self.cfg.score_emitted else None))


def scheduler_config(cfg: GenerationConfig, frames_per_block: int, num_steps: int, run_ahead: bool) -> dict:
    r = cfg.router
    uniforms = []
    if r.kind == "random":  # the same draws as the reference router
        uniforms = [torch.rand((), generator=generator(cfg.seed, b, 0, "router")).item()
                    for b in range(cfg.num_blocks)]
    return dict(mode=cfg.mode, num_blocks=cfg.num_blocks, frames_per_block=frames_per_block, num_steps=num_steps,
                router=r.kind, tau=float(r.tau), accept_prob=float(r.accept_prob), uniforms=uniforms,
                pattern=list(r.pattern), force_first_reject=cfg.force_first_reject,
                own_context=cfg.drafter_context == "own", skip_first_draft=cfg.skip_first_draft,
                lazy_target_commit=cfg.lazy_target_commit, score_emitted=cfg.score_emitted, run_ahead=run_ahead)


def generate_blocks_cpp(comps: Components, prompt: str, cfg: GenerationConfig, out_stats: dict | None = None,
                        run_ahead: bool = False, sync_stages: bool = True, runners=None, threaded: bool = True
                        ) -> Iterator[BlockResult]:
    """Same contract as `reference.generate_blocks`, run by the native scheduler.

    threaded=True runs the scheduler on a worker thread and yields each block as it is emitted;
    threaded=False runs it on the calling thread and yields the blocks at the end (CPU compute on a
    thread other than the main one measured 15-20% slower here, so whole-video calls use this)."""
    counters = Counters()
    setup = prepare(comps, prompt, cfg, counters, slack_frames=setup_slack(comps, run_ahead), runners=runners)
    sink: queue.Queue = queue.Queue()
    stages = _Stages(comps, prompt, cfg, setup, sink, sync_stages)
    sched = _C.Scheduler(
        scheduler_config(cfg, setup.frames_per_block, setup.schedule.num_steps, run_ahead), stages,
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
    if errors and "cancelled" not in str(errors[0]):
        raise errors[0]
    if out_stats is not None:
        out_stats.update(sched.counters())
        out_stats["drafter_cache"] = setup.drafter.cache if setup.drafter else None
        out_stats["target_cache"] = setup.target.cache if setup.target else None
        out_stats["final_block_times"] = sched.block_times()
        out_stats["trace"] = sched.trace()


def setup_slack(comps: Components, run_ahead: bool) -> int:
    """Run-ahead rolls the drafter back over one speculative block and the draft written after it:
    a windowed cache needs two blocks of slack for that rollback to be exact."""
    return 2 * comps.preset.video.frames_per_block if run_ahead else 0
