"""The stage calls of one video: the one object both loops call (`reference.py` in Python, the
native scheduler through `sdvg._C.StageCalls`, its typed pybind11 boundary).

Each call runs one stage of the method on the calling thread's current stream and owns the glue
around it, once for both loops:

- timing: `stage_timing="sync"` waits for the stage's stream before and after the call (the stage
  times measure execution); `"events"` records a CUDA event pair around it instead (`StageEvents`);
- the trace: when the loop is Python (`record_trace=True`) every call is a span on the timeline and
  its seconds are charged to the block being produced (`begin_block`); the native scheduler keeps
  its own trace and block times;
- copy-ahead: under `cuda_graphs` a block's noise draws come from pinned memory, copied ahead;
- the NaN/inf guard (`StageGuard`), told explicitly whose output a decode or a score handles;
- device moves of latents between the roles (`LatentTransfer`);
- the text conditioning: `step(b)` keeps block b's step from the plan, and every forward of block b
  gets the K/V of that step's conditioning for its role (`TextKVCache`); a re-cache under a new
  conditioning is a stage of its own (`recache`), called by the loop where the plan asks it.

The KV write pointer is not moved here: a commit call runs the t = 0 forward only, and the loop that
runs (Python or C++) moves the pointer after it. The forwards are counted by the models as they make
them (`RoleModel`, into the run's counters).
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque

import torch

from sdvg._native import _C
from sdvg.generation.batching import why_alone
from sdvg.generation.early_exit.record import block_exits
from sdvg.generation.noise import block_noise, copy_ahead
from sdvg.generation.plan import BlockStep, Plan, native_plan
from sdvg.generation.stage_timing import StageEvents
from sdvg.generation.transfer import LatentTransfer
from sdvg.generation.types import STAGE_NAMES, BlockRecord, block_times
from sdvg.models.components import Components
from sdvg.models.vae import to_uint8_frames, to_unit_frames
from sdvg.options import GenerationOptions

ROLE_NAMES: tuple[str, ...] = tuple(_C.ROLE_NAMES)  # drafter, target: whose output a decode or score handles


class TextKVCache:
    """(conditioning key, role) -> the role's cross-attention K/V (`sdvg.models.dit.TextKV`) of a block's
    conditioning (`plan.Conditioning`), made by the role's DiT (`dits`: role -> the DiT the role runs this video,
    FP8 copy included) once while it is among the last `size` used. `made`: K/V already made (the prompt's, by
    `prepare`), reused as they are."""

    def __init__(self, dits: dict, made: dict | None = None, size: int = 8):
        self.dits, self.size = dits, size
        self._kv: dict[tuple, object] = dict(made or {})
        self.encodes = 0  # K/V made here

    def __call__(self, conditioning, role: str):
        k = (conditioning.key, role)
        if k not in self._kv:
            while len(self._kv) >= self.size:
                self._kv.pop(next(iter(self._kv)))
            self._kv[k] = self.dits[role].encode_text(conditioning.emb)
            self.encodes += 1
        return self._kv[k]


class StageCalls(_C.StageCalls):
    """The stages of one prepared video (`setup`, from `prepare`) under its block plan (`block_plan`).
    `record_trace`: the calling loop is Python and this object keeps the trace and the per-block times (of
    the plan's last `record_blocks` blocks); `sink`: where `emit` (the native scheduler's hand-over) puts
    each finished `BlockRecord`."""

    # block steps kept when the plan caps the held commits (a live session's few): a block's calls come at most
    # that many blocks, plus run-ahead's, after its step; a whole video keeps every step (its held commits wait
    # for the target's next block, however far)
    STEPS_KEPT = 16

    def __init__(self, comps: Components, opts: GenerationOptions, setup, block_plan: Plan,
                 record_trace: bool = False, sink: queue.Queue | None = None, video_input=None, batcher=None):
        _C.StageCalls.__init__(self)
        self.comps, self.opts, self.setup, self.sink = comps, opts, setup, sink
        self.guard, self.frames_per_block = setup.guard, setup.frames_per_block
        self.drafter_dev, self.target_dev, self.vae_dev = comps.drafter_device, comps.target_device, comps.vae.device
        self.transfer = LatentTransfer([self.drafter_dev, self.target_dev])
        self.waits = opts.stage_timing == "sync"
        self.events = StageEvents([self.drafter_dev, self.target_dev, self.vae_dev], opts.stage_timing)
        # backend compile: what compiling costs during this video (None: nothing is compiled)
        self.compile_clock = setup.runners.compile_clock() if hasattr(setup.runners, "compile_clock") else None
        self.trace: deque[dict] | None = deque() if record_trace else None
        self.times: dict[int, dict[str, float]] = {}  # record_trace: block -> seconds per stage
        # record_trace: the blocks whose spans and times are kept (None: all; a long live session keeps the last few)
        self.keep_blocks: int | None = block_plan.record_blocks
        self.stage_s = 0.0  # record_trace: seconds inside stage calls, every block (kept or not)
        self.block = 0  # record_trace: the block the loop is producing (its calls are charged to it)
        self.t_start = time.perf_counter()
        # video-to-video (sdvg/generation/video_input.py): each block's encoded input frames, noised to the
        # role's first sigma, replace its pure noise; None: text-to-video
        self.video_input = video_input
        # the video's block plan (sdvg/generation/plan.py: FixedPlan, or a live session), asked by both loops through
        # `step` (the native scheduler through `plan`); each block's step is kept for the calls of that block
        self.block_plan = block_plan
        self._steps: dict[int, BlockStep] = {}
        self._steps_lock = threading.Lock()
        # role -> the K/V of a conditioning (the prompt's, made by `prepare`, reused)
        self.text_kv = TextKVCache({m.role: m.dit for m in (setup.drafter, setup.target) if m is not None},
                                   setup.text_kv)
        self._recaches: dict[int, int] = {}  # re-cache forwards by the block whose conditioning they serve
        # several videos batched together (sdvg/generation/batching.py): the denoising and the scoring go through
        # the batcher, which runs them with the other videos' of its round (alone outside one); None: here
        self.batcher = batcher
        self.together = {part: why_alone(opts, part) is None for part in (*opts.roles, "vae", "reward")}

    def _kv(self, role: str, block: int):
        """`role`'s cross-attention K/V of block `block`'s conditioning (its step's)."""
        with self._steps_lock:
            step = self._steps.get(block)
        if step is None:
            raise RuntimeError(f"block {block}'s {role} forward before the block's step (StageCalls.step), or more "
                               f"than {self.STEPS_KEPT} blocks after it under a plan that caps held commits")
        return self.text_kv(step.conditioning, role)

    def take_recaches(self, block: int) -> int:
        """Re-cache forwards made for blocks <= `block` and not taken yet (a block's record reports them: the
        same count under either loop, whichever thread made them)."""
        with self._steps_lock:
            done = [b for b in self._recaches if b <= block]
            return sum(self._recaches.pop(b) for b in done)

    def step(self, block: int) -> BlockStep:
        """Block `block`'s step from the video's plan (sdvg/generation/plan.py), asked once per block by either
        loop and kept for the block's calls; the guard is told how the block is routed, so a non-finite draft
        is judged as the loop routes it."""
        step = self.block_plan.begin(block)
        if not step.stop:
            if step.conditioning is None:
                raise ValueError(f"the plan gave block {block} no conditioning")
            with self._steps_lock:
                self._steps[block] = step
                if self.block_plan.max_held_commits is not None:
                    self._steps.pop(block - self.STEPS_KEPT, None)
            self.guard.route(block, step.router, step.forced)
        return step

    def plan(self, block: int) -> _C.BlockPlan:
        """The native scheduler's question before every block: `step(block)` as a `_C.BlockPlan`, with the
        decision of a router that does not look at the draft, or the threshold a scored one is held to."""
        return native_plan(self.step(block), block, self.opts.seed)

    def _score_prompt(self, block: int) -> str:
        with self._steps_lock:
            return self._steps[block].conditioning.prompt

    # ------------------------------------------------------------------ glue
    def begin_block(self, block: int) -> None:
        """The Python loop starts producing `block`: the calls that follow are charged to it."""
        self.block = block
        self.times[block] = {k: 0.0 for k in STAGE_NAMES}
        if self.keep_blocks is not None:  # spans and times of the blocks before the kept ones
            oldest = block - self.keep_blocks
            self.times.pop(oldest, None)
            while self.trace and self.trace[0]["block"] <= oldest:
                self.trace.popleft()

    def _wait(self, device) -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def _call(self, stage: str, device, fn):
        """`fn()` as stage `stage` on `device`: waited for or timed by events, traced when the loop is Python."""
        if self.waits:
            self._wait(device)
        start = self.events.start(device)  # None unless events are on
        t0 = time.perf_counter()
        out = fn()
        if self.waits:
            self._wait(device)
        else:
            self.events.end(stage, start, device)
        if self.trace is not None:
            t1 = time.perf_counter()
            self.times[self.block][stage] += t1 - t0
            self.stage_s += t1 - t0
            self.trace.append({"block": self.block, "stage": stage, "thread": "main",
                               "start_s": t0 - self.t_start, "end_s": t1 - self.t_start})
        return out

    def _noise(self, model, block: int) -> torch.Tensor:
        """The block's first denoising input: its noise (shared by both roles), or under video-to-video
        (1 - sigma_0) E(input_b) + sigma_0 noise_b; under cuda_graphs its draws are copied ahead."""
        noise = block_noise(self.setup.block_shape, self.opts.seed, block)
        if self.opts.cuda_graphs:
            noise = copy_ahead(noise, self.opts.seed, block, model.schedule.num_steps, model.role, model.device)
        if self.video_input is not None:
            noise = self.video_input.noised(block, noise, model.schedule.sigmas[0], model.device)
        return noise

    def _denoise(self, model, block: int) -> torch.Tensor:
        """`model` denoises block `block`'s noise under the block's conditioning (with other videos' through the
        batcher, when there is one)."""
        noise, kv = self._noise(model, block), self._kv(model.role, block)
        if self.batcher is not None and self.together[model.role]:
            return self.batcher.denoise(model, noise, block, self.opts.seed, kv)
        return model.denoise(noise, block, model.frame_of(block), self.opts.seed, kv)

    # ---------------------------------------------------------------- stages
    def draft(self, block: int) -> torch.Tensor:
        """The drafter denoises noise_b -> x_hat (its K/V into the pending slot)."""
        def run():
            x = self._denoise(self.setup.drafter, block)
            if self.setup.target is not None:
                self.transfer.prefetch(x, self.target_dev)  # an accepted draft goes into the target's cache
            return self.guard.draft(x, block)
        return self._call("draft", self.drafter_dev, run)

    def target(self, block: int) -> torch.Tensor:
        """The target denoises the same noise_b -> x_b."""
        def run():
            x = self._denoise(self.setup.target, block)
            self.transfer.prefetch(x, self.vae_dev)  # decoded, and committed into the drafter, over there
            return self.guard.target(x, block)
        return self._call("target", self.target_dev, run)

    def _commit(self, model, block: int, latents: torch.Tensor) -> None:
        """`model`'s commit of block `block` (with other videos' through the batcher, when there is one)."""
        args = (latents, model.frame_of(block), self._kv(model.role, block))
        if self.batcher is not None and self.together[model.role]:
            return self.batcher.commit(model, *args)
        return model.commit_forward(*args)

    def drafter_commit(self, block: int, latents: torch.Tensor) -> None:
        """The drafter's t = 0 forward over the block (full) or its latents recorded (recompute)."""
        self._call("drafter_commit", self.drafter_dev, lambda: self._commit(
            self.setup.drafter, block, self.transfer.get(latents, self.drafter_dev)))

    def target_commit(self, block: int, latents: torch.Tensor) -> None:
        self._call("target_commit", self.target_dev, lambda: self._commit(
            self.setup.target, block, self.transfer.get(latents, self.target_dev)))

    def recache(self, role: str, block: int) -> None:
        """`role` re-caches its visible committed frames under block `block`'s conditioning (`RoleModel.recache`,
        docs/live.md), before its first forward of the block; the loop calls it where the block's plan asks
        (`BlockStep.recache`). Its forwards are reported with the block's record (`take_recaches`)."""
        model = self.setup.drafter if role == "drafter" else self.setup.target
        device = self.drafter_dev if role == "drafter" else self.target_dev
        before = model.recache_forwards
        self._call("recache", device, lambda: model.recache(self._kv(role, block)))
        with self._steps_lock:
            self._recaches[block] = self._recaches.get(block, 0) + model.recache_forwards - before

    def decode(self, latents: torch.Tensor, producer: str, block: int) -> torch.Tensor:
        """The VAE decodes `producer`'s latents of `block` (advances the VAE cache)."""
        runners, cache = self.setup.runners, self.setup.vae_cache

        def decoded():
            x = self.transfer.get(latents, self.vae_dev)
            if self.batcher is not None and self.batcher.batch_decode and self.together["vae"]:  # with others' decodes
                return self.batcher.decode(self.comps.vae, x, cache)
            return runners.decode(x, cache)
        return self._call("decode", self.vae_dev, lambda: self.guard.decode(decoded, latents, producer, block))

    def score(self, frames: torch.Tensor, producer: str, block: int):
        """ImageReward per frame, aggregated -> `_C.Scored`; None without a reward model."""
        if self.comps.scorer is None:
            self.guard.judge(producer, block)  # a non-finite draft: rejected (or an error) as with a reward model
            return None

        def run():
            def scores(pixels):
                if self.batcher is not None and self.together["reward"]:  # with other videos' scoring of its round
                    return self.batcher.score(self.comps.scorer, self._score_prompt(block), to_unit_frames(pixels))
                return self.setup.runners.score(self._score_prompt(block), to_unit_frames(pixels))
            return self.guard.score(scores, frames, self.setup.aggregator, producer, block)
        score, frame_scores = self._call("score", self.vae_dev, run)
        return _C.Scored(score, frame_scores)

    def vae_snapshot(self):
        return self.setup.vae_cache.snapshot()

    def vae_restore(self, snapshot) -> None:
        self.setup.vae_cache.restore(snapshot)

    # ----------------------------------------------------------------- blocks
    def block_record(self, index: int, decision: str, latents: torch.Tensor, frames: torch.Tensor,
                     draft_latents: torch.Tensor | None, score: float | None, frame_scores, emitted_scores,
                     times, redrafts: int = 0) -> BlockRecord:
        """One emitted block, as both loops yield it (host copies of the tensors)."""
        return BlockRecord(
            index, decision, latents.float().cpu(), to_uint8_frames(frames), score, list(frame_scores),
            block_times(times), draft_latents=None if draft_latents is None else draft_latents.float().cpu(),
            emitted_scores=list(emitted_scores) if self.opts.score_emitted else None,
            exits=block_exits(self.setup.drafter, self.setup.target, index, decision), redrafts=redrafts,
            recache_forwards=self.take_recaches(index))

    def emit(self, block: _C.EmittedBlock) -> None:
        """The native scheduler hands over a finished block (on the VAE lane, its tensors ready there)."""
        self.setup.observe(block.frames)  # before the next block's target denoise (same thread)
        self.transfer.release(block.latents)
        self.transfer.release(block.draft_latents)
        self.sink.put(self.block_record(block.index, block.decision, block.latents, block.frames,
                                        block.draft_latents, block.score, block.frame_scores, block.emitted_scores,
                                        block.times, block.redrafts))
