"""Causal Wan2.1 DiT: diffusers' `WanTransformer3DModel` weights with sdvg's block-causal forward.

The forward processes one block of latent frames at an absolute frame offset:
per-frame timesteps [B, F] drive per-frame adaLN modulation, RoPE uses the absolute frame
index, self-attention covers the block plus every visible cached frame (K stored after RoPE),
and cross-attention uses text K/V computed once per prompt (`TextKV`).

`forward(..., cache=None, attn_mask=...)` is the plain full-sequence reference (teacher forcing
with an explicit block-causal mask); `forward(..., cache=kv)` is the incremental path (its frame
offset is the cache's write position; a mask over the visible frames may restrict it too).

Conditioning follows Wan2.1 (`wan/modules/model.py`) and Self-Forcing's `CausalWanModel` exactly:
text embeddings are zero-padded to `text_len` (512) tokens, all of them attended, and the timestep
sinusoid is computed in float64 (`timestep_sinusoid`) before the fp32 time-embedding MLP.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from sdvg.config import DiTConfig, Precision, torch_dtype
from sdvg.models.device_constants import device_constant
from sdvg.models.dit_block import EAGER_REGIONS, BlockRegions, modulated_norm
from sdvg.models.kv_cache import pending_token_positions, write_positions
from sdvg.models.rope import rope_angles, rope_cos_sin

# Modules diffusers keeps in fp32 when the rest of the Wan DiT runs in bf16/fp16.
_FP32_PARTS = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")


def timestep_sinusoid(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """Wan's `sinusoidal_embedding_1d` in float64: timesteps [...] -> [..., dim], cos half first.

    The layout equals diffusers' `Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)`;
    the values differ from it by fp32 rounding (diffusers computes the angles in fp32)."""
    if dim % 2:
        raise ValueError(f"timestep embedding width {dim} must be even")
    half = dim // 2
    position = timesteps.to(torch.float64)
    freqs = torch.pow(10000, -torch.arange(half, dtype=torch.float64, device=position.device).div(half))
    sinusoid = position[..., None] * freqs  # Wan: torch.outer(position, freqs)
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=-1)


def cache_frame_offset(frame_offset: int | None, cache) -> int:
    """The absolute frame of a cached forward's first frame: the cache's write position
    (`cache.committed_frames`). A given `frame_offset` must agree with it, or RoPE would rotate the
    block's queries and keys for frames other than the ones its K/V are written to."""
    at = int(cache.committed_frames)
    if frame_offset is None:
        return at
    if int(frame_offset) != at:
        raise ValueError(
            f"frame_offset {int(frame_offset)} disagrees with the KV cache's write position {at} (its committed "
            f"frames): the block's K/V are written from frame {at} on; pass frame_offset=None (or {at}), or "
            f"commit / roll back the cache to frame {int(frame_offset)} first"
        )
    return at


@dataclass
class TextKV:
    """Cross-attention keys/values of one prompt for every layer: each [B, H, L_text, D]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def by_row(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`, row by row when x holds several videos' rows (`forward_rows`): the operations whose kernel the
    batch size may change (a Conv3d, a linear over a few rows: the CPU's picks differ at some sizes) run as alone, so
    that each row equals its video's forward by itself. One row: `module(x)`."""
    if x.shape[0] == 1:
        return module(x)
    return torch.cat([module(row) for row in x.split(1)])


class PerRow(list):
    """What `attend` returns for a batch of videos that each keep their own KV cache: one (k_all, v_all, mask)
    per batch row ([1, H, S_visible_j, Dh]; the rows' visible lengths may differ), so that each row's attention
    is its own video's, as alone; every other operation of the forward runs on the whole batch."""


class CausalWanDiT(nn.Module):
    def __init__(self, config: DiTConfig):
        super().__init__()
        from diffusers import WanTransformer3DModel

        config.validate("dit")
        self.config = config
        self.model = WanTransformer3DModel(**config.diffusers_kwargs())
        with torch.device("cpu"):  # a host table (rope() builds cos/sin from it there), whatever device builds us
            self._angles = rope_angles(config.head_dim, config.rope_max_seq_len)  # float64, never cast

    # ----------------------------------------------------------------- setup
    def set_precision(self, precision: Precision) -> "CausalWanDiT":
        dtype = torch_dtype(precision)
        nn.Module.to(self.model, dtype)  # fp32 parts are restored below (ModelMixin.to would warn)
        for name, p in self.model.named_parameters():
            if any(part in name.split(".") for part in _FP32_PARTS):
                p.data = p.data.float()
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.model.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.proj_out.weight.device

    @property
    def angle_table(self) -> torch.Tensor:
        """The float64 RoPE angle table (`rope_angles`) that `rope` builds each block's cos/sin from: on the host
        whatever the model's device, never cast, shared by a quantized copy. Read-only; for observation (host
        memory, what a copy shares)."""
        return self._angles

    # ------------------------------------------------------------------ text
    @torch.no_grad()
    def encode_text(self, text_embeds: torch.Tensor) -> TextKV:
        """text_embeds [B, L_text, text_dim] -> per-layer cross-attention K/V over `text_len` tokens.

        As in Wan, embeddings shorter than `config.text_len` are zero-padded to it; the padded rows go
        through the text MLP and are attended like the others. Longer ones are refused."""
        m = self.model
        if text_embeds.dim() != 3:
            raise ValueError(f"text_embeds must be [B, L_text, text_dim], got {list(text_embeds.shape)}")
        length, text_len = text_embeds.shape[1], self.config.text_len
        if length > text_len:
            raise ValueError(
                f"text embeddings have {length} tokens but this DiT's text_len is {text_len}: Wan checkpoints take "
                f"the umT5 embeddings of at most {text_len} tokens, zero-padded to {text_len}; truncate the prompt's "
                f"tokens to {text_len} (sdvg's TextEncoder does) or pass embeddings of at most {text_len} tokens"
            )
        if length < text_len:
            text_embeds = F.pad(text_embeds, (0, 0, 0, text_len - length))  # zero rows after the prompt
        ctx = m.condition_embedder.text_embedder(text_embeds.to(self.device, self.dtype))  # [B, text_len, dim]
        keys, values = [], []
        heads = self.config.num_heads
        for block in m.blocks:
            attn = block.attn2
            k = attn.norm_k(attn.to_k(ctx)).unflatten(2, (heads, -1)).transpose(1, 2)  # [B, H, L, D]
            v = attn.to_v(ctx).unflatten(2, (heads, -1)).transpose(1, 2)
            keys.append(k.contiguous())
            values.append(v.contiguous())
        return TextKV(keys, values)

    # --------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, text: TextKV, frame_offset: int | None = None,
                cache=None, attn_mask: torch.Tensor | None = None, active: torch.Tensor | None = None,
                hidden: list | None = None, regions: BlockRegions = EAGER_REGIONS) -> torch.Tensor:
        """latents [B, C, F, H, W], timesteps [B, F] -> flow prediction [B, C, F, H, W] (model dtype).

        With `cache`, the block's K/V are written into the cache's pending slots (claimed here) and
        attention covers every visible frame (the committed ones kept by the cache, then the block);
        the caller commits. The block starts at the cache's write position `cache.committed_frames`:
        `frame_offset` None means that, a different value is an error. `attn_mask` ([S_new, S_visible]
        bool, True = attend; S_visible counts the block's own tokens) restricts that attention, e.g.
        a block-causal mask for a context forward over several blocks at once.

        Without a cache, attention covers the given frames only (starting at `frame_offset`, None
        meaning 0), restricted by `attn_mask` ([S, S] bool, True = attend) if given.

        `active` ([A] int64, ascending token indices of the block, frame-major; early exit) runs the
        sparse forward: queries, modulation, cross-attention and MLP for those tokens only. With a
        cache only their K/V are written (`write_positions`: `KVCache.write_tokens` with the positions built once): the other tokens' pending K/V stay as an
        earlier pass wrote them and are attended to as they are. The output keeps the dense layout,
        zero at the tokens not computed. `hidden`, a list, receives the last transformer block's
        hidden states [B, S or A, dim] (the learned exit verifier's input). `regions`: how each block's
        regions run (`sdvg.models.dit_block`: eager, or compiled by the `compile` backend)."""
        _, _, nF, H, W = latents.shape
        p = self.config.patch_size
        tpf = (H // p[1]) * (W // p[2])
        mask = None if attn_mask is None else attn_mask.to(latents.device)
        if active is not None:
            active = check_active(active, nF * tpf, latents.device)
        if cache is not None:
            frame_offset = cache_frame_offset(frame_offset, cache)
            cache.begin_write(nF)
            if mask is not None:
                want = (nF * tpf, len(cache.visible_frames()) * tpf)
                if tuple(mask.shape) != want:
                    raise ValueError(
                        f"attn_mask with a cache must be [S_new, S_visible] = {list(want)} ({nF} new frames, "
                        f"{want[1] // tpf} visible frames of {tpf} tokens), got {list(mask.shape)}; take the rows "
                        "of the new frames and the columns of the visible ones of the full-sequence mask"
                    )

            positions = None if active is None else pending_token_positions(cache, active)  # once per forward

            def attend(layer, k, v):
                if active is None:
                    cache.write(layer, k, v)
                else:
                    write_positions(cache, layer, k, v, positions)
                k_all, v_all = cache.visible(layer)  # [B, H, S_visible, Dh]
                return k_all, v_all, mask
        else:
            frame_offset = 0 if frame_offset is None else int(frame_offset)
            if active is not None:
                raise ValueError("a sparse forward (active tokens) needs a cache: the other tokens' K/V are read "
                                 "from its pending slots")

            def attend(layer, k, v):
                return k, v, mask
        if mask is not None and active is not None:
            mask = mask[active]  # the active queries' rows
        cos, sin = self.rope(frame_offset, nF, H, W, latents.device)
        t_freq = self.timestep_freqs(timesteps)
        return self.forward_with(latents, t_freq, text.keys, text.values, cos, sin, attend, active=active,
                                 hidden=hidden, regions=regions)

    @torch.no_grad()
    def forward_rows(self, latents: torch.Tensor, timesteps: torch.Tensor, text: TextKV, caches: list,
                     regions: BlockRegions = EAGER_REGIONS) -> torch.Tensor:
        """Several videos' cached forwards in one call: latents [B, C, F, H, W] and timesteps [B, F] row j being
        video j's block, text's K/V [B, H, L_text, D] row j its conditioning, `caches[j]` its KV cache (the
        block starts at that cache's write position, as `forward` with `cache` and `frame_offset=None`) ->
        flow [B, C, F, H, W]. Each row's RoPE position and self-attention are its own video's (`PerRow`); the
        linears, norms and cross-attention run batched. Dense forwards without a mask only (no early exit)."""
        B, _, nF, H, W = latents.shape
        if len(caches) != B:
            raise ValueError(f"forward_rows: {len(caches)} caches for {B} rows; give one KV cache per row")
        offsets = []
        for cache in caches:
            offsets.append(cache_frame_offset(None, cache))
            cache.begin_write(nF)
        tables = [self.rope(f, nF, H, W, latents.device) for f in offsets]
        cos, sin = torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])  # [B, S, Dh/2]

        def attend(layer, k, v):  # k, v [B, H, S, Dh]: row j's K/V into cache j; row j attends to cache j
            rows = PerRow()
            for j, cache in enumerate(caches):
                cache.write(layer, k[j:j + 1], v[j:j + 1])
                rows.append((*cache.visible(layer), None))
            return rows

        return self.forward_with(latents, self.timestep_freqs(timesteps), text.keys, text.values, cos, sin, attend,
                                 regions=regions)

    def timestep_freqs(self, timesteps: torch.Tensor) -> torch.Tensor:
        """timesteps [B, F] -> the float64 sinusoid [B, F, freq_dim] cast to the time embedder's dtype
        (fp32): the input of the time-embedding MLP, computed outside any exported graph."""
        dtype = self.model.condition_embedder.time_embedder.linear_1.weight.dtype
        return timestep_sinusoid(timesteps, self.config.freq_dim).to(dtype)

    def rope(self, frame_offset: int, frames: int, height: int, width: int, device):
        """cos/sin [S, head_dim/2] of a block at `frame_offset` (latent height/width): built from the float64
        table on the host once per (offset, frame count, grid, device) and then kept on the device
        (sdvg/models/device_constants.py), so a forward makes no host copy. Treat them as read-only."""
        p = self.config.patch_size
        gh, gw = height // p[1], width // p[2]
        if self._angles.is_meta or torch.device(device).type == "meta":  # shapes only (memory plans, signatures)
            return rope_cos_sin(self._angles, self.config.head_dim, frame_offset, frames, gh, gw, device)
        key = ("rope", self.config.head_dim, self.config.rope_max_seq_len, int(frame_offset), frames, gh, gw)
        return device_constant(key, device, lambda: rope_cos_sin(self._angles, self.config.head_dim, frame_offset,
                                                                 frames, gh, gw, "cpu"))

    def forward_with(self, latents, t_freq, text_keys, text_values, cos, sin, attend, active=None,
                     hidden=None, regions: BlockRegions = EAGER_REGIONS) -> torch.Tensor:
        """The DiT body with self-attention keys/values supplied by `attend(layer, k, v) -> (k_all,
        v_all, mask)`: a KV cache, a full-sequence mask, or static cache tensors (the DiT engines).
        `t_freq` [B, F, freq_dim] is the timestep sinusoid (`timestep_freqs`).

        `active` [A] (checked by the caller) computes those tokens only: each active token is then
        treated as a frame of one token with its own frame's modulation, which is elementwise the
        arithmetic of the dense path (so all tokens active gives the dense result)."""
        m, cfg = self.model, self.config
        B, C, nF, H, W = latents.shape
        if t_freq.shape != (B, nF, cfg.freq_dim):
            raise ValueError(f"t_freq must be [B, F, freq_dim] = [{B}, {nF}, {cfg.freq_dim}] (timestep_freqs of "
                             f"[B, F] timesteps), got {list(t_freq.shape)}")
        p_t, p_h, p_w = cfg.patch_size
        gh, gw = H // p_h, W // p_w
        tpf = gh * gw  # tokens per latent frame
        # [B, S, dim], token-major in memory: every block then sees one layout (a compiled region one graph)
        x = by_row(m.patch_embedding, latents.to(self.dtype)).flatten(2).transpose(1, 2).contiguous()

        emb = m.condition_embedder
        t_freq = t_freq.to(emb.time_embedder.linear_1.weight.dtype)  # Wan's fp64 sinusoid, not timesteps_proj
        temb = by_row(emb.time_embedder, t_freq)  # [B, F, dim]
        t_mod = by_row(emb.time_proj, emb.act_fn(temb).to(emb.time_proj.weight.dtype))  # [B, F, 6*dim]
        t_mod = t_mod.unflatten(2, (6, -1)).float()  # [B, F, 6, dim]
        groups, group_len = nF, tpf  # modulation groups (frames) and tokens per group
        if active is not None:  # one group per active token, with its frame's modulation
            frame_of = torch.div(active, tpf, rounding_mode="floor")  # [A]
            x, cos, sin = x[:, active], cos[active], sin[active]  # [B, A, dim], [A, Dh/2]
            temb, t_mod = temb[:, frame_of], t_mod[:, frame_of]  # [B, A, dim], [B, A, 6, dim]
            groups, group_len = active.numel(), 1

        for layer, block in enumerate(m.blocks):
            x = self._block(block, layer, x, t_mod, text_keys[layer], text_values[layer], cos, sin, groups,
                            group_len, attend, regions)
        if hidden is not None:
            hidden.append(x)

        shift, scale = (m.scale_shift_table.float()[:, None] + temb.float()[:, :, None]).chunk(2, dim=2)  # [B,G,1,d]
        h = modulated_norm(m.norm_out, x, scale, shift, groups, group_len)  # [B, S or A, dim]
        out = m.proj_out(h)  # [B, S or A, C * prod(patch)]
        if active is not None:  # back to the dense token layout, zero where not computed
            dense = out.new_zeros((B, nF * tpf, out.shape[-1]))
            dense[:, active] = out
            out = dense
        out = out.reshape(B, nF // p_t, gh, gw, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return out.flatten(6, 7).flatten(4, 5).flatten(2, 3)  # [B, C, F, H, W]

    def _block(self, block, layer: int, x, t_mod, text_k, text_v, cos, sin, groups: int, group_len: int, attend,
               regions: BlockRegions):
        """One transformer block (`sdvg.models.dit_block`): its regions around the self-attention over the
        visible tokens that `attend` gives."""
        heads = self.config.num_heads
        q, k, v, mod = regions.before_attention(block, x, t_mod, cos, sin, heads, groups, group_len)
        kv = attend(layer, k, v)
        if isinstance(kv, PerRow):  # videos batched together: each row attends to its own cache
            o = torch.cat([F.scaled_dot_product_attention(q[j:j + 1], k_j, v_j, attn_mask=m_j)
                           for j, (k_j, v_j, m_j) in enumerate(kv)])
        else:
            k, v, mask = kv  # [B, H, S_visible, Dh]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, S, Dh]
        return regions.after_attention(block, x, o, mod, text_k, text_v, heads, groups, group_len)


def check_active(active: torch.Tensor, num_tokens: int, device) -> torch.Tensor:
    """Active token indices of a sparse forward: 1-D int64, strictly ascending, inside the block."""
    if not isinstance(active, torch.Tensor) or active.dim() != 1 or active.dtype != torch.long:
        raise ValueError("active tokens must be a 1-D int64 tensor of token indices (frame-major)")
    if active.numel() == 0:
        raise ValueError("a sparse forward needs at least one active token (skip the call instead)")
    if int(active[0]) < 0 or int(active[-1]) >= num_tokens or (active.numel() > 1 and
                                                             bool((active[1:] <= active[:-1]).any())):
        raise ValueError(f"active token indices must be strictly ascending within [0, {num_tokens})")
    return active.to(device)


def block_causal_mask(num_blocks: int | None, frames_per_block: int, tokens_per_frame: int, window_frames: int = 0,
                      sink_frames: int = 0, *, num_frames: int | None = None) -> torch.Tensor:
    """[S, S] bool mask of the full-sequence reference: a token of block b attends to every frame the
    KV-cache path keeps visible while block b is processed (True = attend).

    The frames are `num_blocks * frames_per_block`, or `num_frames` (then `num_blocks` may be None):
    groups of `frames_per_block` frames from frame 0, the last one partial when `num_frames` is not
    a multiple. Rows [a, b) of it, restricted to the columns of the cache's visible frames, are the
    `attn_mask` of a cached context forward over those frames."""
    if num_frames is None:
        if num_blocks is None:
            raise ValueError("block_causal_mask needs num_blocks or num_frames")
        n = num_blocks * frames_per_block
    else:
        n = num_frames
        if num_blocks is not None and num_blocks != -(-n // frames_per_block):
            raise ValueError(f"num_blocks {num_blocks} disagrees with num_frames {n} in groups of {frames_per_block} "
                             f"({-(-n // frames_per_block)} blocks); pass num_blocks=None with num_frames")
    q_frame = torch.arange(n)[:, None]
    k_frame = torch.arange(n)[None, :]
    end = ((q_frame // frames_per_block + 1) * frames_per_block).clamp(max=n)  # end of the query's block
    allowed = k_frame < end
    if window_frames > 0:
        recent = k_frame >= torch.clamp(end - window_frames, min=sink_frames)
        allowed &= (k_frame < sink_frames) | recent
    return allowed.repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1)
