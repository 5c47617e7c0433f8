"""Stage modules with static shapes: what gets exported, compiled or built into engines.

* `DiTStep` — one DiT forward of a block (a denoising step at t > 0, or the commit at t = 0):
  inputs the noisy block, the per-frame timestep sinusoid (computed in float64 outside the graph,
  as Wan does, and fed in as fp32: TensorRT has no float64), the prompt's cross-attention K/V, the
  whole KV cache (fixed capacity) with a mask of the visible cached tokens, and the block's RoPE
  tables; outputs the flow and the block's new K/V, which the caller writes into the cache.
* `VAEDecodeStep` — one latent frame through the Wan decoder with its causal-conv cache as
  explicit tensors in and out (the steady state, from the third latent frame of a video on; the
  first frames run eagerly), so cache slots can be ping-ponged for snapshot/restore.
* `RewardStep` — preprocessed frames and the prompt's token ids/mask -> per-frame scores.

Each equals the eager path (tests/test_stages.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from sdvg.models.dit import CausalWanDiT, TextKV, cache_frame_offset


class DiTStep(nn.Module):
    def __init__(self, dit: CausalWanDiT):
        super().__init__()
        self.dit = dit

    def forward(self, latents, t_freq, text_k, text_v, cache_k, cache_v, cache_mask, cos, sin):
        """latents [1, C, F, H, W]; t_freq [1, F, freq_dim] (`dit.timestep_freqs(timesteps)`);
        text_k/v [L, 1, H, Lt, D]; cache_k/v [L, 1, H, S_cap, D]; cache_mask [S_cap] bool (True = visible);
        cos/sin [S, D/2]
        -> flow [1, C, F, H, W], new_k/new_v [L, 1, H, S, D]."""
        new_k, new_v = [], []

        def attend(layer, k, v):
            new_k.append(k)
            new_v.append(v)
            keys = torch.cat([cache_k[layer].to(k.dtype), k], dim=2)  # [1, H, S_cap + S, D]
            values = torch.cat([cache_v[layer].to(v.dtype), v], dim=2)
            mask = torch.cat([cache_mask, torch.ones(k.shape[2], dtype=torch.bool, device=k.device)])[None, :]
            return keys, values, mask

        flow = self.dit.forward_with(latents, t_freq, text_k, text_v, cos, sin, attend)
        return flow, torch.stack(new_k), torch.stack(new_v)


def text_tensors(text: TextKV) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack(text.keys), torch.stack(text.values)  # [L, 1, H, Lt, D]


def static_cache_inputs(cache, tokens_per_frame: int):
    """The cache's K/V buffers and the mask of its visible *committed* tokens (the pending block's
    slots excluded: a static step appends the block's fresh K/V itself)."""
    buf = cache.buffer  # [L, 2, B, H, S_cap, D]
    committed = len(cache.visible_frames()) - cache.pending_frames  # pending frames come last
    mask = torch.zeros(buf.shape[4], dtype=torch.bool)
    for slot in cache.visible_slots()[:committed]:
        mask[slot * tokens_per_frame:(slot + 1) * tokens_per_frame] = True
    return buf[:, 0], buf[:, 1], mask.to(buf.device)


@torch.no_grad()
def dit_forward_static(step, dit: CausalWanDiT, latents, timesteps, text: TextKV, frame_offset: int | None, cache,
                       tokens_per_frame: int):
    """The cached DiT forward through a static stage (`step` is a DiTStep, compiled or not, or an
    engine runner with the same signature): same contract as `dit(..., cache=cache)` (without a
    mask), `frame_offset` included (None: the cache's write position; another value is an error)."""
    _, _, nF, H, W = latents.shape
    frame_offset = cache_frame_offset(frame_offset, cache)
    cache.begin_write(nF)
    ck, cv, mask = static_cache_inputs(cache, tokens_per_frame)
    cos, sin = dit.rope(frame_offset, nF, H, W, latents.device)
    tk, tv = text_tensors(text)
    flow, new_k, new_v = step(latents.to(dit.dtype), dit.timestep_freqs(timesteps), tk, tv, ck, cv, mask, cos, sin)
    for layer in range(new_k.shape[0]):
        cache.write(layer, new_k[layer].contiguous(), new_v[layer].contiguous())
    return flow


class VAEDecodeStep(nn.Module):
    def __init__(self, decoder, num_entries: int, tensor_slots: list[int]):
        super().__init__()
        self.vae = decoder.vae
        self.num_entries = num_entries
        self.tensor_slots = list(tensor_slots)  # cache positions that hold tensors (the rest stay None)
        self.register_buffer("mean", decoder._mean.clone(), persistent=False)
        self.register_buffer("std", decoder._std.clone(), persistent=False)

    @classmethod
    def for_cache(cls, decoder, cache) -> "VAEDecodeStep":
        if not vae_cache_is_steady(cache):
            raise ValueError("the VAE cache is not in its steady state yet (decode two latent frames first)")
        return cls(decoder, len(cache.entries), [i for i, e in enumerate(cache.entries) if e is not None])

    def forward(self, latent_frame, *cache):
        """latent_frame [1, z, 1, h, w] (normalised) and the decoder's cache tensors ->
        (pixels [1, 3, 4, H, W] in [-1, 1], *new cache tensors)."""
        z = latent_frame.float() * self.std + self.mean
        x = self.vae.post_quant_conv(z.to(self.vae.post_quant_conv.weight.dtype))
        feat = [None] * self.num_entries
        for slot, t in zip(self.tensor_slots, cache):
            feat[slot] = t
        out = self.vae.decoder(x, feat_cache=feat, feat_idx=[0], first_chunk=False)
        return (out.float().clamp(-1.0, 1.0), *(feat[i] for i in self.tensor_slots))


def vae_cache_is_steady(cache) -> bool:
    """True once no decoder cache entry is a first-frame marker (from the third latent frame on)."""
    return cache.frames_decoded >= 2 and not any(isinstance(e, str) for e in cache.entries)


@torch.no_grad()
def vae_decode_static(step, decoder, latents, cache):
    """`decoder.decode` with the steady-state frames through `step` (a VAEDecodeStep, compiled or an
    engine runner); the first frames of a video run eagerly."""
    outs = []
    for i in range(latents.shape[2]):
        frame = latents[:, :, i:i + 1]
        if not vae_cache_is_steady(cache):
            outs.append(decoder.decode(frame, cache))
            continue
        slots = [j for j, e in enumerate(cache.entries) if e is not None]
        pixels, *new_cache = step(frame.to(decoder.device), *(cache.entries[j] for j in slots))
        entries = [None] * len(cache.entries)
        for j, t in zip(slots, new_cache):
            entries[j] = t
        cache.entries = entries
        cache.frames_decoded += 1
        outs.append(pixels)
    return torch.cat(outs, dim=2)


class RewardStep(nn.Module):
    def __init__(self, scorer):
        super().__init__()
        self.scorer = scorer
        self.model = scorer.model  # registered, so exporters see its parameters

    def forward(self, images, ids, mask):
        """images [N, 3, 224, 224] (preprocessed), ids/mask [1, L] -> scores float32 [N]."""
        return self.scorer.score_images(images, ids, mask)
