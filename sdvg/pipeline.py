"""Diffusers-like API of sdvg.

    from sdvg import SpeculativeVideoPipeline
    pipe = SpeculativeVideoPipeline.from_preset("tiny")
    out = pipe("a red fox in the snow", mode="sdvg", tau=-0.7, num_blocks=9, seed=42)
    out.frames  # uint8 [F, H, W, 3]
    for block in pipe.stream("...", tau=-0.7): ...
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from sdvg.config import Preset, get_preset

SCHEDULERS = ("cpp", "reference")
from sdvg.models import Components, build_random, load_pretrained
from sdvg.reference import BlockResult, GenerationConfig, generate_blocks
from sdvg.routers import Router


@dataclass
class PipelineOutput:
    frames: torch.Tensor  # uint8 [F, H, W, 3]
    latents: torch.Tensor  # float32 [1, z, B*frames_per_block, h, w], the emitted latents
    stats: dict
    blocks: list[BlockResult]


class StatsCollector:
    """Builds the statistics dict (same in the API and the JSON file) while blocks arrive."""

    def __init__(self, prompt: str, cfg: GenerationConfig, preset: Preset):
        self.t0 = time.perf_counter()
        self.stats = {
            "prompt": prompt, "mode": cfg.mode, "preset": preset.name, "seed": cfg.seed,
            "tau": cfg.router.tau, "router": cfg.router.kind, "aggregation": cfg.aggregation,
            "drafter_context": cfg.drafter_context, "force_first_reject": cfg.force_first_reject,
            "num_blocks": cfg.num_blocks, "blocks": [], "frames": 0, "interrupted": False,
        }

    def add(self, block: BlockResult) -> None:
        self.stats["blocks"].append(block.stats())
        self.stats["frames"] += int(block.frames.shape[0])

    def finish(self, counters: dict, interrupted: bool = False) -> dict:
        s = self.stats
        later = [b for b in s["blocks"] if b["index"] > 0]
        accepted = sum(b["decision"] == "accepted" for b in later)
        s["acceptance_rate"] = accepted / len(later) if later and s["mode"] == "sdvg" else None
        s["accepted_blocks"] = accepted
        s["blocks_done"] = len(s["blocks"])
        for k in ("target_forwards", "drafter_forwards", "skipped_drafter_forwards", "skipped_target_commits",
                  "skipped_drafter_commits", "redrafts", "speculative_drafts"):
            s[k] = counters.get(k, 0)
        for k in ("scheduler_wall_s", "stage_call_s", "main_stage_s"):
            if k in counters:
                s[k] = counters[k]
        # every stage call on a timeline (seconds from the loop's start; thread main|drafter)
        s["trace"] = list(counters.get("trace", []))
        s["wall_s"] = time.perf_counter() - self.t0
        s["stage_totals"] = {k: sum(b["times"].get(k, 0.0) for b in s["blocks"])
                             for k in ("draft", "decode", "score", "target", "commit")}
        s["interrupted"] = interrupted
        return s


class SpeculativeVideoPipeline:
    def __init__(self, components: Components, backend: str = "eager", engines=None):
        self.components = components
        self.preset = components.preset
        self._runners: dict = {}  # stage backend -> StageRunners (compiled modules / engines), built on first use
        self.default_backend = backend
        self.engines = engines

    def runners(self, backend: str | None = None):
        from sdvg.backends import StageRunners

        backend = backend or self.default_backend
        if backend not in self._runners:
            self._runners[backend] = StageRunners(self.components, backend, self.engines)
        return self._runners[backend]

    @classmethod
    def from_preset(cls, name: str | Preset = "tiny", seed: int = 0, device: str = "cpu",
                    target_device: str | None = None, backend: str = "eager", engines=None,
                    **preset_changes) -> "SpeculativeVideoPipeline":
        """A pipeline with random weights of a named preset (`tiny`, `cpu-bench`, `real-size`)."""
        preset = get_preset(name) if isinstance(name, str) else name
        if preset_changes:
            preset = dataclasses.replace(preset, **preset_changes)
        preset.validate()
        return cls(build_random(preset, seed=seed, drafter_device=device, target_device=target_device), backend,
                   engines)

    @classmethod
    def from_pretrained(cls, drafter, target, vae, reward, text_encoder, preset: str | Preset = "wan2.1",
                        reward_tokenizer=None, drafter_device="cuda:0", target_device=None, backend: str = "eager",
                        engines=None) -> "SpeculativeVideoPipeline":
        """Real weights from local paths or HF-cache folders (see sdvg.checkpoints for the formats)."""
        preset = get_preset(preset) if isinstance(preset, str) else preset
        return cls(load_pretrained(preset, drafter, target, vae, reward, text_encoder, reward_tokenizer,
                                   drafter_device, target_device), backend, engines)

    def make_config(self, mode="sdvg", tau=-0.7, num_blocks=None, seed=0, router="reward", accept_prob=0.731,
                    pattern=(), aggregation="min", force_first_reject=True, drafter_context="committed",
                    skip_first_draft=True, lazy_target_commit=True, score_emitted=False) -> GenerationConfig:
        cfg = GenerationConfig(
            mode=mode, num_blocks=self.preset.video.num_blocks if num_blocks is None else num_blocks, seed=seed,
            router=Router(router, float(tau), accept_prob, tuple(bool(x) for x in pattern)),
            aggregation=aggregation, force_first_reject=force_first_reject, drafter_context=drafter_context,
            skip_first_draft=skip_first_draft, lazy_target_commit=lazy_target_commit, score_emitted=score_emitted)
        cfg.validate()
        return cfg

    def stream(self, prompt: str, stats: dict | None = None, scheduler: str = "cpp", run_ahead: bool = False,
               backend: str | None = None, _threaded: bool = True, **kwargs) -> Iterator[BlockResult]:
        """Yield each block as soon as its frames are final; `stats` (if given) is filled at the end.

        scheduler: "cpp" (the native scheduler, default) or "reference" (the plain Python loop; the
        oracle). run_ahead (cpp only): the drafter drafts block b+1 while block b is decoded, scored
        and committed; the output is identical. backend: how stages run, "eager" | "compile" |
        "tensorrt" (default: the pipeline's)."""
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {SCHEDULERS}")
        if run_ahead and scheduler != "cpp":
            raise ValueError("run_ahead needs scheduler='cpp'")
        cfg = self.make_config(**kwargs)
        runners = self.runners(backend)
        collector = StatsCollector(prompt, cfg, self.preset)
        collector.stats.update(scheduler=scheduler, run_ahead=run_ahead, backend=runners.backend)
        counters: dict = {}
        if scheduler == "cpp":
            from sdvg.cpp_backend import generate_blocks_cpp

            blocks = generate_blocks_cpp(self.components, prompt, cfg, counters, run_ahead=run_ahead, runners=runners,
                                         threaded=_threaded)
        else:
            blocks = generate_blocks(self.components, prompt, cfg, counters, runners=runners)
        for block in blocks:
            collector.add(block)
            yield block
        if stats is not None:
            stats.update(collector.finish(counters))

    def __call__(self, prompt: str, scheduler: str = "cpp", run_ahead: bool = False, backend: str | None = None,
                 **kwargs) -> PipelineOutput:
        stats: dict = {}
        # the whole video is returned at once: run the scheduler on this thread (no streaming needed)
        blocks = list(self.stream(prompt, stats=stats, scheduler=scheduler, run_ahead=run_ahead, backend=backend,
                                  _threaded=False, **kwargs))
        return PipelineOutput(frames=torch.cat([b.frames for b in blocks]),
                              latents=torch.cat([b.latents for b in blocks], dim=2), stats=stats, blocks=blocks)
