"""The components of a speculative pipeline and how they are built or loaded."""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from sdvg.config import Preset, check_random_init, torch_dtype
from sdvg.models.dit import CausalWanDiT
from sdvg.models.reward import (MED_CONFIG, RewardScorer, build_image_reward, load_image_reward_weights,
                                reward_tokenizer)
from sdvg.models.text_encoder import TextEncoder
from sdvg.models.tokenizers import tiny_umt5_tokenizer
from sdvg.models.vae import StreamingVAEDecoder, build_vae, load_vae_weights


@dataclass
class Components:
    preset: Preset
    drafter: CausalWanDiT | None
    target: CausalWanDiT | None
    text_encoder: TextEncoder
    vae: StreamingVAEDecoder
    scorer: RewardScorer | None
    drafter_device: torch.device
    target_device: torch.device

    def check_compatible(self) -> None:
        """Drafter and target must agree on text width, latent channels and patch size."""
        if self.drafter is None or self.target is None:
            return
        d, t = self.drafter.config, self.target.config
        for field in ("text_dim", "in_channels", "out_channels", "patch_size"):
            if getattr(d, field) != getattr(t, field):
                raise ValueError(f"drafter and target disagree on {field}: {getattr(d, field)} vs "
                                 f"{getattr(t, field)}; they must share the text encoder and the VAE")
        if d.in_channels != self.vae.z_dim:
            raise ValueError(f"DiT latent channels {d.in_channels} != VAE z_dim {self.vae.z_dim}")


def _randomize_reward_model(model, seed: int) -> None:
    """Variance-preserving init (std 1/sqrt(fan_in)) of every linear layer of a random reward model:
    with transformers' default init (std 0.02) every frame of a random-weight preset scores alike."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * module.weight.shape[1] ** -0.5)


def _construct(cfg, device: torch.device, dtype: torch.dtype) -> CausalWanDiT:
    """A DiT created directly on `device` in `dtype` (big models are never materialised in fp32)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return CausalWanDiT(cfg)
    finally:
        torch.set_default_dtype(default)


def move_module(module: torch.nn.Module, device: torch.device) -> None:
    """`module`'s tensors, its submodules' included, onto `device` (`nn.Module.to`, not a subclass's own)."""
    torch.nn.Module.to(module, device)


def _draw_on_host(cfg, device: torch.device, dtype: torch.dtype, move=None) -> CausalWanDiT:
    """A random DiT drawn with the CPU generator whatever `device` is: bitwise the values of
    `_construct(cfg, cpu, dtype)` under the same seed, yet never whole on the host. Each submodule goes to
    `device` (`move(module, device)`, default `move_module`) the moment it is assigned to its parent (its own
    construction is then done and its values final: tests/test_random_weights.py checks it), the rest once the
    DiT is made; so at most about one transformer block is on the host at a time (the 14B target is 28 GB in
    bf16)."""
    move = move or move_module
    builder = threading.get_ident()

    def registered(parent, name, submodule):
        if submodule is not None and threading.get_ident() == builder:  # the hook is process-wide
            move(submodule, device)

    hook = torch.nn.modules.module.register_module_module_registration_hook(registered)
    try:
        model = _construct(cfg, torch.device("cpu"), dtype)
    finally:
        hook.remove()
    move(model, device)
    return model


def _device(d) -> torch.device:
    d = torch.device(d)
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {d} requested but CUDA is not available; use --device cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise RuntimeError(f"device {d} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    return d


log = logging.getLogger(__name__)


class LoadProgress:
    """Each component's load: an INFO record on the `sdvg` logger with its source and seconds, and one
    step of a progress bar on stderr when `show` (as diffusers' "Loading pipeline components")."""

    def __init__(self, names: list[str], show: bool):
        from sdvg.io.progress import progress_bar

        self.bar = progress_bar(len(names), show=show, desc="loading components", unit="component")

    @contextmanager
    def step(self, name: str, source):
        self.bar.set_postfix_str(name)
        t0 = time.perf_counter()
        yield
        log.info("loaded %s from %s in %.1f s", name, source, time.perf_counter() - t0)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def build_random(preset: Preset, seed: int = 0, drafter_device="cpu", target_device=None,
                 need_drafter: bool = True, need_target: bool = True, need_reward: bool = True,
                 random_init: str = "cpu") -> Components:
    """All components of `preset` with random weights (seeded), placed and cast. `random_init` (RANDOM_INITS):
    "cpu" draws the DiTs with the CPU generator (`_draw_on_host`: one model for a seed on every device; a
    real-size preset's 15.4B values take about 100 s), "device" on their device with its generator (no host
    draw; another model per device type). The text encoder, VAE and reward model are drawn on the CPU either way."""
    preset.validate()
    check_random_init(random_init)
    t0 = time.perf_counter()
    dd = _device(drafter_device)
    td = _device(target_device or drafter_device)
    dtype = torch_dtype(preset.precision)
    torch.manual_seed(seed)
    text = TextEncoder.random(preset.text_encoder, tiny_umt5_tokenizer(), seed=seed).to(dd)

    def dit(cfg, dev, s):
        torch.manual_seed(s)
        model = _draw_on_host(cfg, dev, dtype) if random_init == "cpu" else _construct(cfg, dev, dtype)
        return model.set_precision(preset.precision).eval()

    drafter = dit(preset.drafter, dd, seed + 1) if need_drafter else None
    target = dit(preset.target, td, seed + 2) if need_target else None
    torch.manual_seed(seed + 3)
    vae = StreamingVAEDecoder(torch.nn.Module.to(build_vae(preset.vae), dd, dtype))
    scorer = None
    if need_reward:
        tok = reward_tokenizer(preset.reward, tiny=True)
        torch.manual_seed(seed + 4)
        model = build_image_reward(preset.reward, tok)
        _randomize_reward_model(model, seed + 5)
        scorer = RewardScorer(model, preset.reward).to(dd, dtype if dd.type == "cuda" else torch.float32)
    comps = Components(preset, drafter, target, text, vae, scorer, dd, td)
    comps.check_compatible()
    log.info("built preset %r with random weights (seed %d, drawn on the %s) on %s / %s in %.2f s", preset.name, seed,
             random_init, dd, td, time.perf_counter() - t0)
    return comps


def load_pretrained(preset: Preset, drafter: str | Path, target: str | Path, vae: str | Path,
                    reward: str | Path | None, text_encoder: str | Path, reward_tokenizer_folder=None,
                    drafter_device="cuda:0", target_device=None, progress: bool = True) -> Components:
    """Real weights from local paths (files or diffusers / HF-cache folders). `progress`: a bar over the
    components on stderr (each load is logged at INFO either way)."""
    from sdvg.models.checkpoints import check_dit_checkpoint, load_dit

    preset.validate()
    # both checkpoints are checked against the preset before either model is allocated
    checked = {"drafter": check_dit_checkpoint(drafter, preset.drafter),
               "target": check_dit_checkpoint(target, preset.target)}
    dd = _device(drafter_device)
    td = _device(target_device or drafter_device)
    dtype = torch_dtype(preset.precision)
    steps = LoadProgress(["text_encoder", "drafter", "target", "vae"] + (["reward"] if reward is not None else []),
                         progress)

    def dit(role, cfg, path, dev):
        m = _construct(cfg, dev, dtype)  # on its device in its precision: no fp32 copy of a 14B model in RAM
        load_dit(m, path, checked.pop(role))
        return m.set_precision(preset.precision).eval()

    try:
        with steps.step("text_encoder", text_encoder):
            text = TextEncoder.from_pretrained(text_encoder, config=preset.text_encoder).to(dd, preset.precision)
        with steps.step("drafter", drafter):
            d = dit("drafter", preset.drafter, drafter, dd)
        with steps.step("target", target):
            t = dit("target", preset.target, target, td)
        with steps.step("vae", vae):
            v = build_vae(preset.vae)
            load_vae_weights(v, vae)
        scorer = None
        if reward is not None:
            with steps.step("reward", reward):
                tok = reward_tokenizer(preset.reward, folder=reward_tokenizer_folder)
                med = Path(reward).with_name(MED_CONFIG)  # ImageReward's own med_config.json, beside the weights
                model = build_image_reward(preset.reward, tok, med_config=med if med.is_file() else None)
                load_image_reward_weights(model, reward)
                scorer = RewardScorer(model, preset.reward).to(dd, dtype)
    finally:
        steps.close()
    comps = Components(preset, d, t, text, StreamingVAEDecoder(torch.nn.Module.to(v, dd, dtype)), scorer, dd, td)
    comps.check_compatible()
    return comps
