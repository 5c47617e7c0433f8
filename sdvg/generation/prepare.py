"""What one video needs before either scheduler runs: the schedule, each role's DiT with a fresh KV
cache and its prompt K/V, the VAE cache and the stage runners. Shared by the reference loop and the
native driver (neither imports the other)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sdvg.generation.noise import gaussian
from sdvg.generation.schedule import FlowSchedule
from sdvg.models.components import Components
from sdvg.models.kv_cache import KVCacheSpec
from sdvg.models.reward import Aggregator
from sdvg.options import GenerationOptions


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RoleModel:
    """One DiT in its role (drafter or target) with its KV cache and prompt K/V on its device;
    every forward is counted into the run's counters (`<role>_forwards`)."""

    def __init__(self, dit, role: str, cache, text_kv, device, schedule: FlowSchedule, counters, runners):
        self.dit, self.role, self.cache, self.text_kv, self.device = dit, role, cache, text_kv, device
        self.schedule, self.counters, self.runners = schedule, counters, runners
        self.attr = f"{role}_forwards"

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


def allocate_cache(comps: Components, dit, device, num_blocks: int, slack_frames: int = 0, runners=None):
    p = comps.preset
    if runners is not None and runners.backend != "eager":
        num_blocks = max(num_blocks, p.video.num_blocks)  # static stages were shaped for the preset's capacity
    return KVCacheSpec.for_preset(p, dit.config, num_blocks, slack_frames).allocate(dit.dtype, device)


@dataclass
class Setup:
    """What one video needs besides the loop: schedule, models with fresh caches, VAE cache."""

    schedule: FlowSchedule
    aggregator: Aggregator
    drafter: RoleModel | None
    target: RoleModel | None
    vae_cache: object
    frames_per_block: int
    block_shape: tuple
    runners: object


def prepare(comps: Components, prompt: str, opts: GenerationOptions, counters, slack_frames: int = 0,
            runners=None) -> Setup:
    """`opts` are resolved options (num_blocks set); `counters` a `Counters` that the models count into."""
    if opts.num_blocks is None:
        raise ValueError("prepare() needs resolved options: call opts.resolved(preset.video.num_blocks) first")
    if runners is None:
        from sdvg.generation.backends import StageRunners

        runners = StageRunners(comps, "eager")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("prompt is empty; give a non-empty text prompt")
    p = comps.preset
    need_drafter = opts.mode in ("sdvg", "draft")
    need_target = opts.mode in ("sdvg", "target")
    if need_drafter and comps.drafter is None:
        raise ValueError(f"mode {opts.mode!r} needs a drafter, but none is loaded")
    if need_target and comps.target is None:
        raise ValueError(f"mode {opts.mode!r} needs a target, but none is loaded")
    if opts.mode == "sdvg" and opts.router == "reward" and comps.scorer is None:
        raise ValueError("router 'reward' needs the ImageReward model; load one or use router 'random'/'pattern'")
    schedule = FlowSchedule.from_base(p.timesteps, p.shift)
    emb = comps.text_encoder.encode(prompt)

    def role_model(role: str, dit, device, slack: int) -> RoleModel:
        cache = allocate_cache(comps, dit, device, opts.num_blocks, slack, runners)
        return RoleModel(dit, role, cache, dit.encode_text(emb), device, schedule, counters, runners)

    drafter = role_model("drafter", comps.drafter, comps.drafter_device, slack_frames) if need_drafter else None
    target = role_model("target", comps.target, comps.target_device, 0) if need_target else None
    zf = p.video.frames_per_block
    lh, lw = p.video.latent_hw(p.vae)
    return Setup(schedule, Aggregator(opts.aggregation), drafter, target, comps.vae.new_cache(), zf,
                 (1, p.vae.z_dim, zf, lh, lw), runners)
