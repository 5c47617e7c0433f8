"""One Wan2.1 transformer block's arithmetic, in two regions around its self-attention.

`CausalWanDiT._block` runs, per layer:

    q, k, v, mod = regions.before_attention(block, x, t_mod, cos, sin, heads, groups, group_len)
    k_all, v_all, mask = attend(layer, k, v)        # the KV cache: write the block's K/V, read the visible ones
    o = scaled_dot_product_attention(q, k_all, v_all, mask)
    x = regions.after_attention(block, x, o, mod, text_k, text_v, heads, groups, group_len)

The KV cache (a growing, C++-owned buffer) and the attention over it stay outside both regions, so a
region's shapes depend only on the block's own tokens: a compiled region (`compiled_regions`, the
`compile` backend: one compilation shared by every layer of both DiTs of a dtype, as diffusers'
`compile_repeated_blocks`) never recompiles as the cache grows.

The arithmetic is Wan's (`wan/modules/model.py`, as Self-Forcing and Krea run it): the norms and the
modulation in fp32, the linears and attention in the model dtype. The casts around it are folded into
the operators (a bf16 operand of an fp32 operation is widened exactly; an fp32 result is rounded once
into a bf16 output with `out=`), which gives bitwise the results of the plain op-by-op form
(tests/dit_reference.py) with about a third of its copy kernels (benchmarks/copy_counts.py)."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from sdvg.models.rope import apply_rope


def folds(*tensors: torch.Tensor) -> bool:
    """Whether an fp32 result can be rounded straight into a preallocated output (`out=`): not while autograd
    records (`out=` is not differentiable); the plain `.to(dtype)` form gives the same values then."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def modulated_norm(norm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, groups: int,
                   group_len: int) -> torch.Tensor:
    """norm(x) * (1 + scale) + shift in fp32, rounded once into x's dtype. x [B, S, dim]; scale, shift
    [B, G, 1, dim] fp32 (one row per modulation group of `group_len` tokens) -> [B, S, dim]."""
    h = norm(x.float()).unflatten(1, (groups, group_len))  # [B, G, T, dim] fp32
    if not folds(h, scale, shift):
        return (h * (1 + scale) + shift).flatten(1, 2).to(x.dtype).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, whatever x's layout
    torch.add(h * (1 + scale), shift, out=out.unflatten(1, (groups, group_len)))
    return out


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, groups: int, group_len: int) -> torch.Tensor:
    """x + y * gate in fp32 (x and y widened exactly), rounded once into x's dtype. x, y [B, S, dim];
    gate [B, G, 1, dim] fp32 -> [B, S, dim] (contiguous)."""
    gated = y.unflatten(1, (groups, group_len)) * gate  # [B, G, T, dim] fp32
    if not folds(x, gated):
        return (x.unflatten(1, (groups, group_len)) + gated).flatten(1, 2).to(x.dtype).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.add(x.unflatten(1, (groups, group_len)), gated, out=out.unflatten(1, (groups, group_len)))
    return out


def before_attention(block, x: torch.Tensor, t_mod: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                     groups: int, group_len: int):
    """x [B, S, dim] (S = groups * group_len tokens), t_mod [B, G, 6, dim] fp32, cos/sin [S, Dh/2] ->
    q, k, v [B, H, S, Dh] (q, k rotated) and the block's modulation [B, G, 6, dim] fp32."""
    mod = block.scale_shift_table.float()[:, None] + t_mod  # [B, G, 6, dim] (table [1, 6, dim])
    shift, scale = mod[:, :, 0, None], mod[:, :, 1, None]  # [B, G, 1, dim]
    h = modulated_norm(block.norm1, x, scale, shift, groups, group_len)
    a = block.attn1
    q = a.norm_q(a.to_q(h)).unflatten(2, (heads, -1))  # [B, S, H, Dh]
    k = a.norm_k(a.to_k(h)).unflatten(2, (heads, -1))
    v = a.to_v(h).unflatten(2, (heads, -1))
    q = apply_rope(q, cos, sin).transpose(1, 2)  # [B, H, S, Dh]
    k = apply_rope(k, cos, sin).transpose(1, 2)
    return q, k, v.transpose(1, 2), mod


def after_attention(block, x: torch.Tensor, o: torch.Tensor, mod: torch.Tensor, text_k: torch.Tensor,
                    text_v: torch.Tensor, heads: int, groups: int, group_len: int) -> torch.Tensor:
    """The rest of the block from the self-attention's output o [B, H, S, Dh]: its projection and gated
    residual, the cross-attention to the prompt (text_k/v [B, H, L_text, Dh]), the feed-forward ->
    x [B, S, dim]."""
    gate_msa, c_shift, c_scale, c_gate = (mod[:, :, i, None] for i in (2, 3, 4, 5))  # [B, G, 1, dim]
    o = block.attn1.to_out[0](o.transpose(1, 2).flatten(2))
    x = gated_residual(x, o, gate_msa, groups, group_len)

    h = block.norm2(x.float()).to(x.dtype)
    c = block.attn2
    q = c.norm_q(c.to_q(h)).unflatten(2, (heads, -1)).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, text_k, text_v)
    x = x + c.to_out[0](o.transpose(1, 2).flatten(2))

    h = modulated_norm(block.norm3, x, c_scale, c_shift, groups, group_len)
    return gated_residual(x, block.ffn(h), c_gate, groups, group_len)


class BlockRegions(NamedTuple):
    """The two regions of a block, as called (eager functions, or their compiled form)."""

    before_attention: Callable
    after_attention: Callable


EAGER_REGIONS = BlockRegions(before_attention, after_attention)
