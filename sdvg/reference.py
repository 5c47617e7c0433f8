"""The reference SDVG loop in plain Python: the oracle for every faster path.

Per block b (DESIGN.md section 1):
  1. noise_b from (seed, b) -- shared by drafter and target;
  2. the drafter denoises noise_b in 4 steps -> x_hat;
  3. snapshot the VAE cache, decode x_hat;
  4. ImageReward per frame, aggregated (default: the worst frame) -> q_b;
  5. b == 0 (forced) or the router says no -> restore the VAE cache, the target denoises the same
     noise_b -> x_b, decode; else x_b = x_hat and its frames are emitted as decoded;
  6. commit x_b into the target's KV cache (t = 0 forward) and emit the frames.
Modes `target` and `draft` run the same code with only one model.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from sdvg.config import (AGGREGATIONS, DRAFTER_CONTEXTS, MODES, Aggregation, DrafterContext, Mode)
from sdvg.kv_cache import KVCacheSpec
from sdvg.models import Components
from sdvg.noise import block_noise, gaussian
from sdvg.reward import Aggregator
from sdvg.routers import Router
from sdvg.schedule import FlowSchedule
from sdvg.vae import to_uint8_frames, to_unit_frames

STAGES = ("draft", "decode", "score", "target", "commit", "drafter_commit", "target_commit")


@dataclass(frozen=True)
class GenerationConfig:
    mode: Mode = "sdvg"
    num_blocks: int = 9
    seed: int = 0
    router: Router = field(default_factory=Router)
    aggregation: Aggregation = "min"
    force_first_reject: bool = True
    drafter_context: DrafterContext = "committed"
    skip_first_draft: bool = True  # under `committed`, block 0's draft is never used
    lazy_target_commit: bool = True  # commit accepted blocks into the target only when it next runs
    score_emitted: bool = False  # also score rejected blocks' target frames (a quality proxy)

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {MODES}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; choose one of {AGGREGATIONS}")
        if self.drafter_context not in DRAFTER_CONTEXTS:
            raise ValueError(f"unknown drafter context {self.drafter_context!r}; choose one of {DRAFTER_CONTEXTS}")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"num_blocks {self.num_blocks!r} must be an integer >= 1")
        if isinstance(self.router.tau, float) and math.isnan(self.router.tau):
            raise ValueError("tau is NaN; give a number (or +inf / -inf)")

    @property
    def skips_first_draft(self) -> bool:
        return (self.mode == "sdvg" and self.skip_first_draft and self.force_first_reject
                and self.drafter_context == "committed")


@dataclass
class BlockResult:
    index: int
    decision: str  # forced | accepted | rejected | target | draft
    latents: torch.Tensor  # [1, z, F, h, w] float32, the emitted block
    frames: torch.Tensor  # uint8 [T, H, W, 3]
    score: float | None
    frame_scores: list[float]
    times: dict[str, float]
    draft_latents: torch.Tensor | None = None  # the drafter's proposal (sdvg mode)
    emitted_scores: list[float] | None = None

    def stats(self) -> dict:
        out = {"index": self.index, "decision": self.decision, "score": self.score,
               "frame_scores": self.frame_scores, "times": self.times, "frames": int(self.frames.shape[0])}
        if self.emitted_scores is not None:
            out["emitted_scores"] = self.emitted_scores
        return out


class Counters:
    def __init__(self):
        self.target_forwards = 0
        self.drafter_forwards = 0
        self.skipped_drafter_forwards = 0
        self.skipped_target_commits = 0
        self.skipped_drafter_commits = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Model:
    """One DiT with its KV cache and prompt K/V on its device."""

    def __init__(self, dit, role: str, cache, text_kv, device, schedule, counters: Counters, attr: str, runners):
        self.dit, self.role, self.cache, self.text_kv, self.device = dit, role, cache, text_kv, device
        self.schedule, self.counters, self.attr, self.runners = schedule, counters, attr, runners

    def forward(self, x, t, frame0: int):
        return self.runners.dit_forward(self.role, self.dit, x, t, self.text_kv, frame0, self.cache)

    def _count(self):
        setattr(self.counters, self.attr, getattr(self.counters, self.attr) + 1)

    def denoise(self, noise: torch.Tensor, block: int, frame0: int, seed: int) -> torch.Tensor:
        """Few-step denoising of `noise` (float32) at frame offset frame0 -> x0 (float32, on this device)."""
        x = noise.to(self.device)
        n_frames = x.shape[2]
        steps = self.schedule.num_steps
        for i in range(steps):
            t = torch.full((1, n_frames), self.schedule.timesteps[i], device=self.device)
            flow = self.forward(x, t, frame0)
            self._count()
            x0 = self.schedule.to_x0(x, flow, i)
            if i + 1 < steps:
                eps = gaussian(x.shape, seed, block, i + 1, self.role, self.device)
                x = self.schedule.renoise(x0, eps, i + 1)
            else:
                x = x0
        return x

    def commit_forward(self, latents: torch.Tensor, frame0: int) -> None:
        """Clean forward at t = 0 writes the block's K/V into the pending slots (pointer unchanged)."""
        x = latents.to(self.device)
        t = torch.zeros((1, x.shape[2]), device=self.device)
        self.forward(x, t, frame0)
        self._count()

    def commit(self, latents: torch.Tensor, frame0: int) -> None:
        """Clean forward at t = 0, then the write pointer moves on."""
        self.commit_forward(latents, frame0)
        self.cache.commit()


def _allocate(comps: Components, dit, device, num_blocks: int, slack_frames: int = 0, runners=None):
    p = comps.preset
    if runners is not None and runners.backend != "eager":
        num_blocks = max(num_blocks, p.video.num_blocks)  # static stages were shaped for the preset's capacity
    tpf = p.video.tokens_per_frame(p.vae, dit.config)
    window = p.kv_window
    if window.window_frames and slack_frames > window.slack_frames:
        window = replace(window, slack_frames=slack_frames)  # exact rollback of a run-ahead draft
    spec = KVCacheSpec.for_dit(dit.config, tpf, num_blocks * p.video.frames_per_block, window)
    return spec.allocate(dit.dtype, device)


@dataclass
class Setup:
    """What one video needs besides the loop: schedule, models with fresh caches, VAE cache."""

    schedule: FlowSchedule
    aggregator: Aggregator
    drafter: _Model | None
    target: _Model | None
    vae_cache: object
    frames_per_block: int
    block_shape: tuple
    runners: object


def prepare(comps: Components, prompt: str, cfg: GenerationConfig, counters: Counters, slack_frames: int = 0,
            runners=None) -> Setup:
    cfg.validate()
    if runners is None:
        from sdvg.backends import StageRunners

        runners = StageRunners(comps, "eager")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("prompt is empty; give a non-empty text prompt")
    p = comps.preset
    need_drafter = cfg.mode in ("sdvg", "draft")
    need_target = cfg.mode in ("sdvg", "target")
    if need_drafter and comps.drafter is None:
        raise ValueError(f"mode {cfg.mode!r} needs a drafter, but none is loaded")
    if need_target and comps.target is None:
        raise ValueError(f"mode {cfg.mode!r} needs a target, but none is loaded")
    if cfg.mode == "sdvg" and cfg.router.kind == "reward" and comps.scorer is None:
        raise ValueError("router 'reward' needs the ImageReward model; load one or use router 'random'/'pattern'")
    schedule = FlowSchedule.from_base(p.timesteps, p.shift)
    emb = comps.text_encoder.encode(prompt)
    drafter = target = None
    if need_drafter:
        drafter = _Model(comps.drafter, "drafter", _allocate(comps, comps.drafter, comps.drafter_device,
                         cfg.num_blocks, slack_frames, runners), comps.drafter.encode_text(emb), comps.drafter_device,
                         schedule, counters, "drafter_forwards", runners)
    if need_target:
        target = _Model(comps.target, "target", _allocate(comps, comps.target, comps.target_device,
                        cfg.num_blocks, 0, runners), comps.target.encode_text(emb), comps.target_device, schedule,
                        counters, "target_forwards", runners)
    zf = p.video.frames_per_block
    lh, lw = p.video.latent_hw(p.vae)
    return Setup(schedule, Aggregator(cfg.aggregation), drafter, target, comps.vae.new_cache(), zf,
                 (1, p.vae.z_dim, zf, lh, lw), runners)


def generate_blocks(comps: Components, prompt: str, cfg: GenerationConfig, out_stats: dict | None = None,
                    runners=None) -> Iterator[BlockResult]:
    """Yields each block as soon as its frames are final. `out_stats` receives the counters at the end."""
    counters = Counters()
    setup = prepare(comps, prompt, cfg, counters, runners=runners)
    run = setup.runners
    schedule, agg, drafter, target = setup.schedule, setup.aggregator, setup.drafter, setup.target
    vae_cache = setup.vae_cache
    zf, shape = setup.frames_per_block, setup.block_shape
    pending_target_commits: list[tuple[torch.Tensor, int]] = []  # accepted blocks not yet in the target

    trace: list[dict] = []  # every stage call: the same spans as the native scheduler's trace()
    t_start = time.perf_counter()

    def timed(times, name, device, fn):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        t1 = time.perf_counter()
        times[name] = times.get(name, 0.0) + t1 - t0
        # b: the block the loop below is producing when this call is made
        trace.append({"block": b, "stage": name, "thread": "main", "start_s": t0 - t_start,
                      "end_s": t1 - t_start})
        return out

    def flush_target_commits(times):
        while pending_target_commits:
            lat, f0 = pending_target_commits.pop(0)
            timed(times, "target_commit", target.device, lambda: target.commit(lat, f0))

    for b in range(cfg.num_blocks):
        times = {k: 0.0 for k in STAGES}
        frame0 = b * zf
        last = b == cfg.num_blocks - 1
        noise = block_noise(shape, cfg.seed, b)
        draft = None
        score, frame_scores, emitted_scores = None, [], None

        if cfg.mode == "target":
            flush_target_commits(times)
            x_b = timed(times, "target", target.device, lambda: target.denoise(noise, b, frame0, cfg.seed))
            pixels = timed(times, "decode", comps.vae.device, lambda: run.decode(x_b, vae_cache))
            decision = "target"
        elif cfg.mode == "draft":
            x_b = timed(times, "draft", drafter.device, lambda: drafter.denoise(noise, b, frame0, cfg.seed))
            pixels = timed(times, "decode", comps.vae.device, lambda: run.decode(x_b, vae_cache))
            decision = "draft"
        else:
            forced = b == 0 and cfg.force_first_reject
            pixels_hat = None
            if forced and cfg.skips_first_draft:
                counters.skipped_drafter_forwards += schedule.num_steps
            else:
                draft = timed(times, "draft", drafter.device, lambda: drafter.denoise(noise, b, frame0, cfg.seed))
                snap = vae_cache.snapshot()
                pixels_hat = timed(times, "decode", comps.vae.device, lambda: run.decode(draft, vae_cache))
                if comps.scorer is not None:
                    scores = timed(times, "score", comps.vae.device,
                                   lambda: run.score(prompt, to_unit_frames(pixels_hat)))
                    frame_scores = [float(s) for s in scores.cpu()]
                    score = agg(scores)
            accepted = (not forced) and cfg.router.accept(b, score, cfg.seed)
            if accepted:
                decision, x_b, pixels = "accepted", draft, pixels_hat
            else:
                decision = "forced" if forced else "rejected"
                if pixels_hat is not None:
                    vae_cache.restore(snap)
                flush_target_commits(times)
                x_b = timed(times, "target", target.device, lambda: target.denoise(noise, b, frame0, cfg.seed))
                pixels = timed(times, "decode", comps.vae.device, lambda: run.decode(x_b, vae_cache))
                if cfg.score_emitted and comps.scorer is not None:
                    s = timed(times, "score", comps.vae.device,
                              lambda: run.score(prompt, to_unit_frames(pixels)))
                    emitted_scores = [float(v) for v in s.cpu()]
            if accepted and cfg.score_emitted:
                emitted_scores = list(frame_scores)

        # Commit the emitted block into the caches that will read it.
        if not last:
            if drafter is not None:
                ctx = draft if (cfg.drafter_context == "own" and draft is not None) else x_b
                timed(times, "drafter_commit", drafter.device, lambda: drafter.commit(ctx, frame0))
            if target is not None:
                pending_target_commits.append((x_b, frame0))
                if not (cfg.lazy_target_commit and decision == "accepted"):
                    flush_target_commits(times)
        else:
            counters.skipped_target_commits += (target is not None) + len(pending_target_commits)
            counters.skipped_drafter_commits += drafter is not None
            pending_target_commits.clear()
        times["commit"] = times["drafter_commit"] + times["target_commit"]
        yield BlockResult(b, decision, x_b.float().cpu(), to_uint8_frames(pixels), score, frame_scores, times,
                          draft_latents=None if draft is None else draft.float().cpu(),
                          emitted_scores=emitted_scores)
    if out_stats is not None:
        out_stats.update(vars(counters))
        out_stats["trace"] = trace
        out_stats["drafter_cache"] = drafter.cache if drafter else None
        out_stats["target_cache"] = target.cache if target else None
