"""Streaming Wan2.1 VAE decode with an explicit causal-conv cache.

diffusers' `AutoencoderKLWan.decode()` clears its feature cache on every call, so sdvg drives
`vae.decoder` itself one latent frame at a time and owns the cache (`VAEDecodeCache`).
The decoder *replaces* cache entries (`feat_cache[i] = new_tensor`), it never writes into
them, so `snapshot()` is a shallow copy of the entry list: no tensor is copied.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sdvg.models.checkpoints import CheckpointError, _read_file, _unwrap, check_weights, load_strict
from sdvg.config import VAEConfig
from sdvg.models.device_constants import device_constant


@dataclass(frozen=True)
class VAECacheSnapshot:
    entries: tuple  # the decoder's per-conv feature tensors (or None / "Rep" markers)
    frames_decoded: int


class VAEDecodeCache:
    """The decoder's causal-conv feature cache between blocks, plus how many latent frames it has seen."""

    def __init__(self, num_convs: int):
        self.entries: list = [None] * num_convs
        self.frames_decoded = 0

    def snapshot(self) -> VAECacheSnapshot:
        return VAECacheSnapshot(tuple(self.entries), self.frames_decoded)

    def restore(self, snap: VAECacheSnapshot) -> None:
        self.entries = list(snap.entries)
        self.frames_decoded = snap.frames_decoded


def build_vae(config: VAEConfig):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=config.base_dim, z_dim=config.z_dim, dim_mult=list(config.dim_mult),
                            num_res_blocks=config.num_res_blocks,
                            temperal_downsample=list(config.temporal_downsample)).eval()


def load_vae_weights(vae, path: str | Path) -> None:
    """Original `Wan2.1_VAE.pth` keys or a diffusers folder/file; weights_only, strict keys; every tensor
    floating and finite (checked per file, by the file's key names)."""
    path = Path(path)
    if path.is_dir():
        folder = path / "vae" if (path / "vae").is_dir() else path
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder} holds no .safetensors VAE weights")
        state = {}
        for f in files:
            part = _read_file(f)
            check_weights(part, f)
            state.update(part)
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
        self._mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self._std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self._stats_key = ("vae_latent_stats", tuple(map(float, cfg.latents_mean)), tuple(map(float, cfg.latents_std)))
        self.num_convs = vae._cached_conv_counts["decoder"] if hasattr(vae, "_cached_conv_counts") else sum(
            1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")

    @property
    def device(self) -> torch.device:
        return self.vae.post_quant_conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.post_quant_conv.weight.dtype

    def latent_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) [1, z, 1, 1, 1] float32 on the VAE's device, copied there once (not per decode)."""
        return device_constant(self._stats_key, self.device, lambda: (self._mean, self._std))

    def new_cache(self) -> VAEDecodeCache:
        return VAEDecodeCache(self.num_convs)

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
            idx = [0]
            out = self.vae.decoder(x[:, :, i:i + 1], feat_cache=cache.entries, feat_idx=idx,
                                   first_chunk=cache.frames_decoded == 0)
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
        """Whole-video decode through diffusers' own public path (the oracle for streaming)."""
        z = latents.float().to(self.device) * self._std.to(self.device) + self._mean.to(self.device)
        return self.vae.decode(z.to(self.dtype)).sample.float().clamp(-1.0, 1.0)


def to_uint8_frames(pixels: torch.Tensor) -> torch.Tensor:
    """[B, 3, T, H, W] in [-1, 1] -> uint8 [B*T, H, W, 3]."""
    x = ((pixels.float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return x.permute(0, 2, 3, 4, 1).flatten(0, 1).cpu()


def to_unit_frames(pixels: torch.Tensor) -> torch.Tensor:
    """[B, 3, T, H, W] in [-1, 1] -> float [B*T, 3, H, W] in [0, 1] (the reward path; no uint8 round trip)."""
    return ((pixels.float() + 1.0) * 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).flatten(0, 1)
