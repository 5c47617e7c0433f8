"""Engine modules: the modules with static shapes that get exported, compiled or built into engines.

* `DiTStep` — one DiT forward of F new latent frames (a denoising step at t > 0, the commit at
  t = 0, or a recompute context forward over several clean frames): inputs the new frames, their
  per-frame timestep sinusoid (computed in float64 outside the graph, as Wan does, and fed in as
  fp32: TensorRT has no float64), the prompt's cross-attention K/V and the frames' RoPE tables,
  then, when cached frames are visible, the token index of the visible cached frames and each
  layer's K/V buffer as it lies in the cache (`KVCache.layer_buffer`, no copy). The engine gathers
  the visible tokens itself and attends over them and the new frames only (never over the whole
  capacity); outputs the flow and the new frames' K/V, which the caller writes into the pending
  slots of the cache. No input holds more than one layer's buffer (the 14B target's whole cache is
  8.6e9 elements, past the 2^31 an engine tensor may hold).
* `VAEDecodeStep` — one latent frame through the Wan decoder with its causal-conv cache as
  explicit tensors in and out (the steady state, from the third latent frame of a video on; the
  first frames run eagerly), so cache slots can be ping-ponged for snapshot/restore.
* `RewardStep` — preprocessed frames and the prompt's token ids/mask -> per-frame scores.

Each equals the eager path (tests/test_engine_modules.py). Their signatures (names, shapes, dtypes, the
dynamic dimensions of a cached DiT engine) live in `sdvg.engines.signatures`.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from sdvg.models.device_constants import device_constant
from sdvg.models.dit import CausalWanDiT, TextKV, block_causal_mask, cache_frame_offset


def new_frames_mask(frames: int, tokens_per_frame: int, frames_per_block: int | None):
    """[S, S] bool (True = attend) among the F new frames of a forward: block-causal in groups of
    `frames_per_block` from the first new frame (a recompute context forward over more than one
    block), or None when they form one group (every block forward)."""
    if frames_per_block is None or frames <= frames_per_block:
        return None
    return block_causal_mask(None, frames_per_block, tokens_per_frame, num_frames=frames)


def dit_engine_mask(frames: int, visible_frames: int, tokens_per_frame: int, frames_per_block: int | None):
    """The attention mask a DiT engine applies ([S_new, S_visible + S_new] bool, True = attend): every
    visible cached token, and the new frames block-causally (`new_frames_mask`); None = no mask."""
    m = new_frames_mask(frames, tokens_per_frame, frames_per_block)
    if m is None:
        return None
    return torch.cat([torch.ones(m.shape[0], visible_frames * tokens_per_frame, dtype=torch.bool), m], dim=1)


class DiTStep(nn.Module):
    """See the module docstring. `frames_per_block` sets the block-causal grouping of the new frames
    (None: one group, whatever their number)."""

    def __init__(self, dit: CausalWanDiT, frames_per_block: int | None = None):
        super().__init__()
        self.dit = dit
        self.frames_per_block = frames_per_block

    def forward(self, latents, t_freq, text_k, text_v, cos, sin, *cache):
        """latents [1, C, F, H, W]; t_freq [1, F, freq_dim] (`dit.timestep_freqs(timesteps)`);
        text_k/v [L, 1, H, Lt, D]; cos/sin [S, D/2] (S = F x tokens per frame); `cache` empty (no
        visible cached frame) or (cache_index [N_vis] int64: the buffer positions of the visible
        cached tokens in frame order, kv_0 .. kv_{L-1}: each layer's buffer [2, 1, H, S_cap, D],
        0 = K, 1 = V) -> flow [1, C, F, H, W], new_k/new_v [L, 1, H, S, D]."""
        num_layers = text_k.shape[0]
        if cache and len(cache) != num_layers + 1:
            raise ValueError(f"a cached DiT engine takes cache_index and {num_layers} layer buffers, got "
                             f"{len(cache)} cache inputs")
        index, buffers = (cache[0], cache[1:]) if cache else (None, ())
        S, F = cos.shape[0], latents.shape[2]
        mask = new_frames_mask(F, S // F, self.frames_per_block)
        if mask is not None:
            mask = mask.to(latents.device)
            if index is not None:
                mask = torch.cat([mask.new_ones(S, index.shape[0]), mask], dim=1)
        new_k, new_v = [], []

        def attend(layer, k, v):
            new_k.append(k)
            new_v.append(v)
            if index is None:
                return k, v, mask
            buf = buffers[layer]  # [2, 1, H, S_cap, D]
            keys = torch.cat([buf[0].index_select(2, index).to(k.dtype), k], dim=2)  # [1, H, N_vis + S, D]
            values = torch.cat([buf[1].index_select(2, index).to(v.dtype), v], dim=2)
            return keys, values, mask

        flow = self.dit.forward_with(latents, t_freq, text_k, text_v, cos, sin, attend)
        return flow, torch.stack(new_k), torch.stack(new_v)


def text_tensors(text: TextKV) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack(text.keys), torch.stack(text.values)  # [L, 1, H, Lt, D]


def visible_cache_index(cache, tokens_per_frame: int) -> torch.Tensor | None:
    """Buffer positions [N_vis] (int64, on the cache's device, built once per slot list and kept there) of the
    visible *committed* tokens in frame order (the pending block's slots excluded: an engine appends the block's
    fresh K/V itself), or None when no committed frame is visible."""
    committed = len(cache.visible_frames()) - cache.pending_frames  # pending frames come last
    slots = cache.visible_slots()[:committed]
    if not slots:
        return None
    return device_constant(("visible_cache_index", tuple(slots), tokens_per_frame), cache.buffer.device,
                           lambda: (torch.tensor(slots, dtype=torch.int64)[:, None] * tokens_per_frame
                                    + torch.arange(tokens_per_frame, dtype=torch.int64)).reshape(-1))


@torch.no_grad()
def dit_forward_static(step, dit: CausalWanDiT, latents, timesteps, text: TextKV, frame_offset: int | None, cache,
                       tokens_per_frame: int, attn_mask=None, frames_per_block: int | None = None, text_kv=None):
    """The cached DiT forward through a DiT engine (`step`: a DiTStep, compiled or not, or an
    engine executor with its signature): same contract as `dit(..., cache=cache, attn_mask=...)`,
    `frame_offset` included (None: the cache's write position; another value is an error).

    The engine reads the cache's layer buffers in place and the new frames' K/V are copied into the
    pending slots (`KVCache.write`): no copy of the cache is made. `attn_mask` must be the engine's
    own (`dit_engine_mask` with `frames_per_block`: block-causal new frames, every visible cached
    token), e.g. a recompute context forward's; another mask is refused. `text_kv` is the stacked
    (text_k, text_v) of `text` when the caller keeps it."""
    _, _, nF, H, W = latents.shape
    frame_offset = cache_frame_offset(frame_offset, cache)
    cache.begin_write(nF)
    index = visible_cache_index(cache, tokens_per_frame)
    visible = 0 if index is None else index.shape[0] // tokens_per_frame
    if attn_mask is not None:
        want = dit_engine_mask(nF, visible, tokens_per_frame, frames_per_block)
        shape = (nF * tokens_per_frame, (visible + nF) * tokens_per_frame)
        ok = tuple(attn_mask.shape) == shape and (bool(attn_mask.all()) if want is None
                                                   else torch.equal(attn_mask.cpu().bool(), want))
        if not ok:
            raise ValueError(f"the DiT engines take no free attention mask: they attend to every visible "
                             f"cached frame and block-causally (groups of {frames_per_block} frames) among the "
                             f"{nF} new ones; this {list(attn_mask.shape)} mask differs; use backend 'eager'")
    cos, sin = dit.rope(frame_offset, nF, H, W, latents.device)
    tk, tv = text_kv if text_kv is not None else text_tensors(text)
    cached = () if index is None else (index, *(cache.layer_buffer(i) for i in range(tk.shape[0])))
    flow, new_k, new_v = step(latents.to(dit.dtype), dit.timestep_freqs(timesteps), tk, tv, cos, sin, *cached)
    for layer in range(new_k.shape[0]):
        cache.write(layer, new_k[layer], new_v[layer])
    return flow


class VAEDecodeStep(nn.Module):
    """`decoder`'s modules and its latent statistics (buffers [1, z, 1, 1, 1] float32, on the decoder's device
    when the step is made; `.to()` moves them with the modules)."""

    def __init__(self, decoder, num_entries: int, tensor_slots: list[int]):
        super().__init__()
        self.vae = decoder.vae
        self.num_entries = num_entries
        self.tensor_slots = list(tensor_slots)  # cache positions that hold tensors (the rest stay None)
        mean, std = decoder.latent_stats()  # the shared device constants: the step keeps its own copies
        self.register_buffer("mean", mean.clone(), persistent=False)
        self.register_buffer("std", std.clone(), persistent=False)

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
    engine executor); the first frames of a video run eagerly."""
    outs = []
    for i in range(latents.shape[2]):
        frame = latents[:, :, i:i + 1]
        if not vae_cache_is_steady(cache):
            outs.append(decoder.decode(frame, cache))
            continue
        slots = [j for j, e in enumerate(cache.entries) if e is not None]
        pixels, *new_cache = step(frame.to(decoder.device), *(cache.entries[j] for j in slots))
        entries, before = [None] * len(cache.entries), cache.entries
        for j, t in zip(slots, new_cache):
            entries[j] = t
        cache.entries = entries
        cache.settle(before)  # the temporal upsamplers' cache rule (sdvg.models.vae, vae_decoder)
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
