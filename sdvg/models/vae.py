"""Streaming Wan2.1 VAE decode with an explicit causal-conv cache.

diffusers' `AutoencoderKLWan.decode()` clears its feature cache on every call, so sdvg drives
`vae.decoder` itself one latent frame at a time and owns the cache (`VAEDecodeCache`).
The decoder *replaces* cache entries (`feat_cache[i] = new_tensor`), it never writes into
them, so `snapshot()` is a shallow copy of the entry list: no tensor is copied.

Two rules for the temporal upsamplers' cache (`vae_decoder`, the cache's `time_rule`):
- `wan` (Wan2.1, Self-Forcing, diffusers): after latent frame t, the `time_conv` cache holds the
  upsampler's inputs [x_{t-1}, x_t], so frame t+1's causal conv sees [x_{t-1}, x_t, x_{t+1}];
- `krea` (krea-ai/realtime-video, `wan/modules/vae.py` and `demo_utils/vae_block3.py`): the cache
  becomes [where(old_last == 0, 0, x_t), x_t], i.e. [x_t, x_t] once the first frame is past (zeros
  before), so frame t+1 sees [x_t, x_t, x_{t+1}]. Krea's rule only acts on an upsampler fed one frame
  per latent frame (the first; the later ones take 2 or more, and keep their own last 2 under both
  rules). The two agree on latent frames 0..2 and differ from latent frame 3 on. Applied after each frame's decoder call (`VAEDecodeCache.settle`), so
  every decode path (plain, fast, compiled, engines) follows the same rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sdvg.models.checkpoints import (CheckpointError, _read_file, _unwrap, check_weights, load_strict,
                                     read_checked_files)
from sdvg.config import VAE_DECODERS, VAEConfig
from sdvg.models.device_constants import device_constant




@dataclass(frozen=True)
class VAECacheSnapshot:
    entries: tuple  # the decoder's per-conv feature tensors (or None / "Rep" markers)
    frames_decoded: int


def krea_time_cache(old, new):
    """Krea's temporal-upsample cache after one latent frame, from the cache before the frame (`old`) and
    the one the Wan rule left (`new` = [old_last, x_t], [B, C, 2, h, w]): [where(old_last == 0, 0, x_t), x_t].
    A first-frame marker (None / "Rep") before the frame: Krea's zeros give what the Wan rule gives."""
    if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor):
        return new
    current = new[:, :, -1:]
    return torch.cat([torch.where(old[:, :, -1:] == 0, torch.zeros_like(current), current), current], dim=2)


class VAEDecodeCache:
    """The decoder's causal-conv feature cache between blocks, plus how many latent frames it has seen.
    `time_rule`: "wan" or "krea", applied to the entries at `time_slots` (the temporal upsamplers')."""

    def __init__(self, num_convs: int, time_rule: str = "wan", time_slots: tuple[int, ...] = ()):
        if time_rule not in VAE_DECODERS:
            raise ValueError(f"unknown vae_decoder {time_rule!r}; choose one of {', '.join(VAE_DECODERS)}")
        self.entries: list = [None] * num_convs
        self.frames_decoded = 0
        self.time_rule = time_rule
        self.time_slots = tuple(time_slots)

    def settle(self, before: list) -> None:
        """After one latent frame's decoder call (`before`: the entries it started from): the temporal
        upsamplers' entries follow `time_rule` (the decoder itself writes the Wan rule)."""
        if self.time_rule == "krea":
            for slot in self.time_slots:
                self.entries[slot] = krea_time_cache(before[slot], self.entries[slot])

    def snapshot(self) -> VAECacheSnapshot:
        return VAECacheSnapshot(tuple(self.entries), self.frames_decoded)

    def restore(self, snap: VAECacheSnapshot) -> None:
        self.entries = list(snap.entries)
        self.frames_decoded = snap.frames_decoded


def latent_stats(cfg, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) [1, z, 1, 1, 1] float32 of the latents of a VAE with config `cfg`, on `device`, copied there once
    (the encoder and the decoder normalise with the same pair)."""
    key = ("vae_latent_stats", tuple(map(float, cfg.latents_mean)), tuple(map(float, cfg.latents_std)))
    return device_constant(key, device, lambda: (
        torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1),
        torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)))


def build_vae(config: VAEConfig):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=config.base_dim, z_dim=config.z_dim, dim_mult=list(config.dim_mult),
                            num_res_blocks=config.num_res_blocks,
                            temperal_downsample=list(config.temporal_downsample)).eval()


WAN_VAE_FILE = "Wan2.1_VAE.pth"  # its name in Wan-AI/Wan2.1-T2V-1.3B (and -14B)


def load_vae_weights(vae, path: str | Path) -> None:
    """Original `Wan2.1_VAE.pth` keys (the file, or a folder holding it such as `Wan-AI/Wan2.1-T2V-1.3B`)
    or a diffusers folder/file; weights_only, strict keys; every tensor floating and finite (checked per
    file, by the file's key names)."""
    path = Path(path)
    if path.is_dir() and (path / WAN_VAE_FILE).is_file():  # the Wan2.1 release's folder, as it ships
        path = path / WAN_VAE_FILE
    if path.is_dir():
        folder = path / "vae" if (path / "vae").is_dir() else path
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder} holds no .safetensors VAE weights")
        state = read_checked_files(files)
    else:
        state = _unwrap(_read_file(path), str(path))
        check_weights(state, path)
    if any(k.startswith("decoder.middle.") or k.startswith("conv1.") for k in state):
        from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

        state = convert_wan_vae_to_diffusers(dict(state))
    load_strict(vae, state, str(path), describe_size="not a Wan2.1 VAE of this size")


class StreamingVAEDecoder:
    """Decodes latent blocks [B, z, F, h, w] into pixel frames, carrying the causal cache across calls."""

    def __init__(self, vae):
        self.vae = vae
        cfg = vae.config
        self.z_dim = cfg.z_dim
        self._latent_config = cfg  # its latent statistics (`latent_stats`: on the VAE's device, wherever it is)
        self.num_convs = vae._cached_conv_counts["decoder"] if hasattr(vae, "_cached_conv_counts") else sum(
            1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")
        self.vae_decoder = "wan"  # the default rule of new caches (`new_cache(rule)` overrides it)
        self._time_slots: tuple[int, ...] | None = None  # found on first need (`time_slots`)

    @property
    def device(self) -> torch.device:
        return self.vae.post_quant_conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.post_quant_conv.weight.dtype

    def latent_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) [1, z, 1, 1, 1] float32 on the VAE's device, copied there once (not per decode)."""
        return latent_stats(self._latent_config, self.device)

    def new_cache(self, vae_decoder: str | None = None) -> VAEDecodeCache:
        """A fresh cache; `vae_decoder` ("wan" | "krea"; None: this decoder's default) picks the temporal
        upsamplers' cache rule."""
        rule = vae_decoder or self.vae_decoder
        if rule not in VAE_DECODERS:
            raise ValueError(f"unknown vae_decoder {rule!r}; choose one of {', '.join(VAE_DECODERS)}")
        return VAEDecodeCache(self.num_convs, rule, self.time_slots() if rule == "krea" else ())

    def time_slots(self) -> tuple[int, ...]:
        """The cache positions of the temporal upsamplers (`time_conv`) that take one frame per latent frame
        (the first in call order: a later one takes 2, 4, ... frames, whose cache is its own input under
        both rules). Found once by decoding two 1x1 latent frames with a hook on each 3-D upsampler that
        reads the cache index it is called at and its input's frame count (diffusers' numbering, whatever
        its version)."""
        if self._time_slots is None:
            calls: list[tuple[int, int]] = []

            def record(module, args, kwargs):
                idx = kwargs["feat_idx"] if "feat_idx" in kwargs else args[2]
                calls.append((idx[0], args[0].shape[2]))

            ups = [m for m in self.vae.decoder.modules() if getattr(m, "mode", None) == "upsample3d"]
            hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in ups]
            try:
                with torch.no_grad():
                    probe = torch.zeros(1, self.z_dim, 1, 1, 1, device=self.device, dtype=self.dtype)
                    feat = [None] * self.num_convs
                    for first in (True, False):
                        calls.clear()
                        self.vae.decoder(probe, feat_cache=feat, feat_idx=[0], first_chunk=first)
            finally:
                for h in hooks:
                    h.remove()
            if len(calls) != len(ups):
                raise RuntimeError(f"found {len(calls)} temporal-upsampler calls for {len(ups)} upsamplers; this "
                                   "diffusers version calls them differently (vae_decoder 'krea' cannot run)")
            self._time_slots = tuple(idx for idx, frames in calls if frames == 1)
        return self._time_slots

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cache: VAEDecodeCache) -> torch.Tensor:
        """latents [B, z, F, h, w] (normalised, as the DiT produces them) -> pixels [B, 3, T, H, W] in [-1, 1],
        float32. T = 1 + 4(F-1) for the first block of a video, 4F afterwards."""
        if latents.ndim != 5 or latents.shape[1] != self.z_dim:
            raise ValueError(f"latents must be [B, {self.z_dim}, F, h, w], got {list(latents.shape)}")
        mean, std = self.latent_stats()
        z = latents.float().to(self.device) * std + mean
        x = self.vae.post_quant_conv(z.to(self.dtype))
        outs = []
        for i in range(x.shape[2]):
            idx, before = [0], list(cache.entries)
            out = self.vae.decoder(x[:, :, i:i + 1], feat_cache=cache.entries, feat_idx=idx,
                                   first_chunk=cache.frames_decoded == 0)
            cache.settle(before)
            cache.frames_decoded += 1
            outs.append(out.float())
        return torch.cat(outs, dim=2).clamp(-1.0, 1.0)

    @torch.no_grad()
    def encode_frame(self, pixels: torch.Tensor) -> torch.Tensor:
        """One pixel frame [B, 3, 1, H, W] in [-1, 1], encoded alone (a fresh encoder cache, as the first
        frame of a video) -> its latent frame [B, z, 1, h, w], normalised as the DiT reads latents
        (the posterior's mean, (mu - mean) / std), float32. Krea re-encodes the moving first context
        frame this way."""
        if pixels.ndim != 5 or pixels.shape[1] != 3 or pixels.shape[2] != 1:
            raise ValueError(f"encode_frame takes one pixel frame [B, 3, 1, H, W], got {list(pixels.shape)}")
        mu = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist.mode().float()
        mean, std = self.latent_stats()
        return (mu - mean) / std

    @torch.no_grad()
    def decode_video(self, latents: torch.Tensor) -> torch.Tensor:
        """Whole-video decode through diffusers' own public path (the oracle for streaming under the
        `wan` rule; the `krea` rule has no whole-video form here)."""
        mean, std = self.latent_stats()
        z = latents.float().to(self.device) * std + mean
        return self.vae.decode(z.to(self.dtype)).sample.float().clamp(-1.0, 1.0)


def to_uint8_frames(pixels: torch.Tensor) -> torch.Tensor:
    """[B, 3, T, H, W] in [-1, 1] -> uint8 [B*T, H, W, 3]."""
    x = ((pixels.float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return x.permute(0, 2, 3, 4, 1).flatten(0, 1).cpu()


def to_unit_frames(pixels: torch.Tensor) -> torch.Tensor:
    """[B, 3, T, H, W] in [-1, 1] -> float [B*T, 3, H, W] in [0, 1] (the reward path; no uint8 round trip)."""
    return ((pixels.float() + 1.0) * 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).flatten(0, 1)
