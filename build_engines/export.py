"""Stage instances with example inputs for a preset, ONNX export (dynamo exporter) and
onnxruntime verification against eager."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from sdvg._native import _C
from sdvg.config import config_hash
from sdvg.kv_cache import KVCacheSpec
from sdvg.models import Components
from sdvg.stages import DiTStep, RewardStep, VAEDecodeStep

# Max |onnxruntime - eager| / max(1, max |eager|) accepted by --verify, per precision.
VERIFY_TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}


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
    spec = KVCacheSpec.for_dit(dit.config, tpf, n * fpb, p.kv_window)
    slots = _C.FrameSlotTable(spec.layout()).num_slots
    L, H, D = dit.config.num_layers, dit.config.num_heads, dit.config.head_dim
    dt = dit.dtype
    g = torch.Generator().manual_seed(0)
    S = fpb * tpf
    cos, sin = dit.rope(fpb, fpb, lh, lw, dev)
    inputs = (
        torch.randn(1, p.vae.z_dim, fpb, lh, lw, generator=g).to(dev, dt),
        torch.full((1, fpb), 937.5, device=dev),
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
                     ["latents", "timesteps", "text_k", "text_v", "cache_k", "cache_v", "cache_mask", "cos", "sin"],
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


def export_onnx(stage: StageSpec, path: Path) -> Path:
    """torch.onnx.export with the dynamo exporter (the TorchScript exporter fails on rms_norm)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        program = torch.onnx.export(stage.module, stage.inputs, dynamo=True, input_names=stage.input_names,
                                    output_names=stage.output_names, optimize=True, verbose=False)
    program.save(str(path))
    return path


def eager_outputs(stage: StageSpec) -> list[torch.Tensor]:
    with torch.no_grad():
        out = stage.module(*stage.inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def verify_onnx(stage: StageSpec, path: Path) -> float:
    """Max |onnxruntime - eager| / max(1, max |eager|) over all outputs."""
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {}
    names = {i.name for i in sess.get_inputs()}
    for n, t in zip(stage.input_names, stage.inputs):
        if n in names:  # inputs the graph folded away (unused) are not fed
            feeds[n] = t.detach().cpu().float().numpy() if t.dtype == torch.bfloat16 else t.detach().cpu().numpy()
    got = sess.run(None, feeds)
    want = eager_outputs(stage)
    err = 0.0
    for g, w in zip(got, want):
        w = w.detach().float().cpu().numpy()
        err = max(err, float(np.abs(g.astype(np.float32) - w).max() / max(1.0, float(np.abs(w).max()))))
    return err

