"""Stage signatures: each static stage of a pipeline (module, example inputs, input/output names,
device, what its engine depends on) and the engine-cache key derived from it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from sdvg._native import _C
from sdvg.config import config_hash
from sdvg.engines.cache import EngineKey, weights_fingerprint
from sdvg.models.kv_cache import KVCacheSpec
from sdvg.models.components import Components
from sdvg.engines.stages import DiTStep, RewardStep, VAEDecodeStep

STAGE_NAMES: tuple[str, ...] = ("drafter_dit", "target_dit", "vae_decode", "reward")  # every stage an engine may hold


@dataclass
class StageSpec:
    name: str  # drafter_dit | target_dit | vae_decode | reward
    module: torch.nn.Module
    inputs: tuple  # example inputs (the static shapes)
    input_names: list[str]
    output_names: list[str]
    device: torch.device
    config: object  # what the config hash covers
    weights: torch.nn.Module

    def shapes(self) -> tuple:
        return tuple((n, tuple(t.shape), str(t.dtype).replace("torch.", ""))
                     for n, t in zip(self.input_names, self.inputs))

    def config_hash(self) -> str:
        return config_hash(self.config) if dataclasses.is_dataclass(self.config) else str(self.config)


def dit_stage(comps: Components, role: str, num_blocks: int | None = None) -> StageSpec:
    p = comps.preset
    dit = comps.drafter if role == "drafter" else comps.target
    dev = comps.drafter_device if role == "drafter" else comps.target_device
    n = num_blocks or p.video.num_blocks
    fpb = p.video.frames_per_block
    lh, lw = p.video.latent_hw(p.vae)
    tpf = p.video.tokens_per_frame(p.vae, dit.config)
    spec = KVCacheSpec.for_preset(p, dit.config, n)
    slots = _C.FrameSlotTable(spec.layout()).num_slots
    L, H, D = dit.config.num_layers, dit.config.num_heads, dit.config.head_dim
    dt = dit.dtype
    g = torch.Generator().manual_seed(0)
    S = fpb * tpf
    cos, sin = dit.rope(fpb, fpb, lh, lw, dev)
    inputs = (
        torch.randn(1, p.vae.z_dim, fpb, lh, lw, generator=g).to(dev, dt),
        dit.timestep_freqs(torch.full((1, fpb), 937.5, device=dev)),  # the fp64 sinusoid, fed in as fp32
        torch.randn(L, 1, H, p.text_encoder.text_len, D, generator=g).to(dev, dt),
        torch.randn(L, 1, H, p.text_encoder.text_len, D, generator=g).to(dev, dt),
        torch.randn(L, 1, H, slots * tpf, D, generator=g).to(dev, dt),
        torch.randn(L, 1, H, slots * tpf, D, generator=g).to(dev, dt),
        (torch.arange(slots * tpf, device=dev) < fpb * tpf),
        cos, sin,
    )
    if inputs[-1].shape[0] != S:
        raise AssertionError("RoPE table does not match the block's token count")
    return StageSpec(f"{role}_dit", DiTStep(dit).eval(), inputs,
                     ["latents", "t_freq", "text_k", "text_v", "cache_k", "cache_v", "cache_mask", "cos", "sin"],
                     ["flow", "new_k", "new_v"], dev, dataclasses.replace(dit.config), dit.model)


def vae_stage(comps: Components) -> StageSpec:
    p = comps.preset
    dec = comps.vae
    lh, lw = p.video.latent_hw(p.vae)
    cache = dec.new_cache()
    g = torch.Generator().manual_seed(1)
    dec.decode(torch.randn(1, p.vae.z_dim, 2, lh, lw, generator=g), cache)  # reach the steady state
    frame = torch.randn(1, p.vae.z_dim, 1, lh, lw, generator=g).to(dec.device)
    step = VAEDecodeStep.for_cache(dec, cache).eval()
    tensors = [cache.entries[i] for i in step.tensor_slots]
    names = ["latent_frame"] + [f"cache_in_{i}" for i in step.tensor_slots]
    outs = ["pixels"] + [f"cache_out_{i}" for i in step.tensor_slots]
    return StageSpec("vae_decode", step, (frame, *tensors), names, outs, dec.device, p.vae, dec.vae)


def reward_stage(comps: Components, frames: int | None = None) -> StageSpec:
    p = comps.preset
    sc = comps.scorer
    n = frames or p.video.pixel_frames(p.vae, 2) - p.video.pixel_frames(p.vae, 1)  # frames of a later block
    g = torch.Generator().manual_seed(2)
    images = torch.randn(n, 3, p.reward.image_size, p.reward.image_size, generator=g).to(sc.device, sc.dtype)
    tok = sc.tokens("a calibration prompt")
    return StageSpec("reward", RewardStep(sc).eval(), (images, tok.ids, tok.mask), ["images", "ids", "mask"],
                     ["scores"], sc.device, p.reward, sc.model)


def all_stages(comps: Components, num_blocks: int | None = None) -> list[StageSpec]:
    out = [dit_stage(comps, "drafter", num_blocks), dit_stage(comps, "target", num_blocks), vae_stage(comps)]
    if comps.scorer is not None:
        out.append(reward_stage(comps))
    return out




def device_identity(device: torch.device) -> tuple[str, str]:
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return torch.cuda.get_device_name(device), f"{cap[0]}.{cap[1]}"
    return "cpu", "none"


def stage_key(stage: StageSpec, precision: str, artifact: str) -> EngineKey:
    """Everything the stage's engine depends on (see `sdvg.engines.cache`)."""
    from sdvg.engines.tensorrt import trt_version

    gpu, cc = device_identity(stage.device)
    return EngineKey(stage=stage.name, config_hash=stage.config_hash(), weights_hash=weights_fingerprint(stage.weights),
                     shapes=stage.shapes(), precision=precision, gpu_name=gpu, compute_capability=cc,
                     trt_version=trt_version() if artifact == "tensorrt" else "none", artifact=artifact)
