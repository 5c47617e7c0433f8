"""The shared fake of the stage calls (`sdvg._C.StageCalls`): the native scheduler without models.

Used by the scheduler's tests (CPU and GPU) and by `benchmarks/scheduler.py`. Each stage call does
a controlled amount of work: sleep for a set time (releases the GIL like device work), or keep the
GPU busy on the calling thread's current stream (`spin_cycles`); latents are tiny tensors that
carry the block index, so the emitted records show which model produced a block.

    stages = FakeStages(costs={"target": 0.01, "draft": 0.001})
    sched = fake_scheduler(stages, GenerationOptions(router="pattern", pattern="0110", num_blocks=4))
    sched.run()
"""
from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from sdvg._native import _C
from sdvg.generation.plan import Conditioning
from sdvg.generation.native import scheduler_config
from sdvg.generation.plan import FixedPlan, native_plan
from sdvg.generation.types import STAGE_NAMES
from sdvg.options import GenerationOptions

NO_TEXT = Conditioning(("none",), "", torch.zeros(0))  # the fake stages run no model: no text is read

FRAMES_PER_BLOCK = 3
NUM_STEPS = 4


class FakeStages(_C.StageCalls):
    """costs: seconds per stage name (a number for all, or a mapping; missing stages cost 0).
    spin_cycles: instead of sleeping, keep the GPU busy for that many cycles per call on the current
    stream and wait for that stream (records which stream each role ran on in `streams`).
    fail_at: the block whose draft raises. score: the (aggregated, per-frame) score every draft gets.
    options: the video whose fixed plan (sdvg/generation/plan.py) the scheduler is told, block by block
    (`fake_scheduler` sets it from its options)."""

    def __init__(self, costs: float | Mapping[str, float] = 0.0, fail_at: int | None = None,
                 score: tuple[float, list[float]] | None = (1.0, [1.0, 2.0]), spin_cycles: int | None = None,
                 device: str | torch.device = "cpu", options: GenerationOptions | None = None):
        _C.StageCalls.__init__(self)
        unknown = set(costs) - set(STAGE_NAMES) if isinstance(costs, Mapping) else set()
        if unknown:
            raise ValueError(f"unknown stages {sorted(unknown)}; stages are {STAGE_NAMES}")
        self.costs = dict(costs) if isinstance(costs, Mapping) else {k: float(costs) for k in STAGE_NAMES}
        self.fail_at, self._score, self.spin_cycles = fail_at, score, spin_cycles
        self.device = torch.device(device)
        self.calls: list[tuple[str, int | None]] = []
        self.producers: list[tuple[str, str, int]] = []  # (stage, producer, block) of each decode and score
        self.emitted: list = []  # the _C.EmittedBlock of each block
        self.streams: dict[str, int] = {}  # role -> CUDA stream handle (spin mode)
        self.caches: dict[str, object] = {}  # role -> native KV cache (set by fake_scheduler)
        self.options = options
        self.planned: list[int] = []  # the blocks the scheduler asked the plan for, in order

    def _forward(self, role: str) -> None:
        """What a DiT forward does to its cache: write the block's pending slot (pointer unchanged)."""
        cache = self.caches.get(role)
        if cache is not None:
            cache.begin_write(FRAMES_PER_BLOCK)

    def _work(self, stage: str, block: int | None, role: str) -> None:
        self.calls.append((stage, block))
        if self.spin_cycles is not None:
            stream = torch.cuda.current_stream()
            self.streams.setdefault(role, stream.cuda_stream)
            torch.cuda._sleep(self.spin_cycles)
            stream.synchronize()
        elif self.costs.get(stage, 0.0) > 0:
            time.sleep(self.costs[stage])

    def draft(self, block: int):
        if block == self.fail_at:
            raise RuntimeError(f"draft of block {block} failed")
        self._work("draft", block, "drafter")
        self._forward("drafter")
        return torch.tensor([float(block)], device=self.device)

    def drafter_commit(self, block: int, latents) -> None:
        self._work("drafter_commit", block, "drafter")
        self._forward("drafter")

    def target(self, block: int):
        self._work("target", block, "target")
        self._forward("target")
        return torch.tensor([-float(block)], device=self.device)

    def target_commit(self, block: int, latents) -> None:
        self._work("target_commit", block, "target")
        self._forward("target")

    def decode(self, latents, producer: str, block: int):
        self.producers.append(("decode", producer, block))
        self._work("decode", block, "vae")
        return latents * 2

    def score(self, frames, producer: str, block: int):
        self.producers.append(("score", producer, block))
        self._work("score", block, "vae")
        return None if self._score is None else _C.Scored(*self._score)

    def vae_snapshot(self):
        return len(self.calls)

    def vae_restore(self, snapshot) -> None:
        pass

    def emit(self, block) -> None:
        self.emitted.append(block)

    def plan(self, block: int):
        if self.options is None:
            raise RuntimeError("FakeStages has no video to plan: give it options (fake_scheduler does)")
        self.planned.append(block)
        return native_plan(FixedPlan(self.options, NO_TEXT).begin(block), block, self.options.seed)


def fake_caches(num_blocks: int):
    """Tiny native KV caches (1 layer, 1 head, 1 token per frame): the scheduler's pointer moves on
    them are real (commit, rollback), the buffers are a few bytes."""
    def cache():
        layout = _C.SlotLayout(num_blocks * FRAMES_PER_BLOCK)
        return _C.KVCache(1, 1, 1, 2, 1, layout, torch.float32, torch.device("cpu"))

    return cache(), cache()


def fake_scheduler(stages: FakeStages, options: GenerationOptions, device: str | torch.device = "cpu",
                   log_streams: bool = False):
    """A native scheduler over `stages` with the run's options (num_blocks must be set). `log_streams`:
    every lane's stream operation is written down instead of made (`stream_log()`), on any device."""
    if options.num_blocks is None:
        raise ValueError("fake_scheduler needs options with num_blocks set")
    drafter_cache, target_cache = fake_caches(options.num_blocks)
    stages.caches = {"drafter": drafter_cache, "target": target_cache}
    stages.options = options
    dev = torch.device(device)
    return _C.Scheduler(scheduler_config(options, FRAMES_PER_BLOCK, NUM_STEPS), stages, drafter_cache,
                        target_cache, dev, dev, log_streams=log_streams)
