"""Streaming Wan2.1 VAE encode with an explicit causal-conv cache: video-to-video's input, block by block.

diffusers' `AutoencoderKLWan.encode()` encodes a whole clip, clearing its encoder cache before and after:
the first pixel frame alone, then chunks of `temporal_stride` (4) frames, each chunk one latent frame,
the causal convolutions carrying their last frames from chunk to chunk in `_enc_feat_map`. A live video
has no whole clip, so sdvg drives `vae.encoder` itself in exactly those chunks and keeps the cache between
calls (`VAEEncodeCache`): a video's block 0 takes 1 + 4 (F - 1) pixel frames (9 for F = 3 latent frames
per block), every later block 4 F (12), the decoder's counts mirrored (Krea's webcam path encodes the
same 9, then 12). Encoding a clip block by block therefore runs the very chunks the whole-clip encode runs
(`tests/test_video_input.py` compares the two)."""
from __future__ import annotations

import torch

from sdvg.models.vae import latent_stats


class VAEEncodeCache:
    """The encoder's causal-conv feature cache between calls, and how many pixel frames it has seen."""

    def __init__(self, num_convs: int):
        self.entries: list = [None] * num_convs
        self.frames_encoded = 0


class StreamingVAEEncoder:
    """Encodes pixel frames [B, 3, T, H, W] in [-1, 1] into normalised latents [B, z, F, h, w] (the posterior's
    mean, `(mu - mean) / std`, as the DiT reads latents; float32), carrying the causal cache across calls."""

    def __init__(self, vae):
        self.vae = vae
        cfg = vae.config
        self.z_dim = cfg.z_dim
        self.temporal_stride = 2 ** sum(bool(x) for x in cfg.temperal_downsample)
        self.num_convs = vae._cached_conv_counts["encoder"] if hasattr(vae, "_cached_conv_counts") else sum(
            1 for m in vae.encoder.modules() if type(m).__name__ == "WanCausalConv3d")

    @property
    def device(self) -> torch.device:
        return self.vae.quant_conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.quant_conv.weight.dtype

    def new_cache(self) -> VAEEncodeCache:
        return VAEEncodeCache(self.num_convs)

    def frames_for(self, latent_frames: int, cache: VAEEncodeCache) -> int:
        """Pixel frames that give `latent_frames` latent frames from this cache: 1 + s (n - 1) first, s n after."""
        s = self.temporal_stride
        return 1 + s * (latent_frames - 1) if cache.frames_encoded == 0 else s * latent_frames

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor, cache: VAEEncodeCache) -> torch.Tensor:
        """pixels [B, 3, T, H, W] in [-1, 1] -> latents [B, z, F, h, w], normalised, float32. T = 1 + 4 (F - 1) for
        the first call on a cache, 4 F after (the chunks of diffusers' whole-clip encode)."""
        s = self.temporal_stride
        if pixels.ndim != 5 or pixels.shape[1] != 3:
            raise ValueError(f"pixels must be [B, 3, T, H, W], got {list(pixels.shape)}")
        first = cache.frames_encoded == 0
        frames = pixels.shape[2]
        if (first and (frames - 1) % s) or (not first and (frames % s or not frames)):
            rule = f"1 + {s} k frames first" if first else f"a multiple of {s} frames after the first call"
            raise ValueError(f"the streaming encoder takes {rule}, got {frames}")
        x = pixels.to(self.device, self.dtype)
        starts = ([0] + list(range(1, frames, s))) if first else list(range(0, frames, s))
        outs = []
        for i, start in enumerate(starts):
            end = 1 if first and i == 0 else start + s
            outs.append(self.vae.encoder(x[:, :, start:end], feat_cache=cache.entries, feat_idx=[0]))
        cache.frames_encoded += frames
        h = self.vae.quant_conv(torch.cat(outs, dim=2))
        mu = h[:, : self.z_dim].float()  # DiagonalGaussianDistribution's mean: the first z channels
        mean, std = latent_stats(self.vae.config, self.device)
        return (mu - mean) / std

    @torch.no_grad()
    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        """Whole-clip encode through diffusers' own public path (the oracle of `encode`), normalised."""
        mu = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist.mode().float()
        mean, std = latent_stats(self.vae.config, self.device)
        return (mu - mean) / std
