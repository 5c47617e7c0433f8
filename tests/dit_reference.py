"""The plain op-by-op form of a Wan2.1 block's arithmetic: the oracle of `sdvg.models.dit_block`.

Every cast is its own operation, as Wan's code writes it (`x.float()`, `.to(dtype)`, a stacked fp32
RoPE result, diffusers' own RMSNorm and FP32LayerNorm modules); `dit_block` folds those casts into
the arithmetic and must give bitwise the same results (tests/test_dit_block.py)."""
from __future__ import annotations

import torch

from sdvg.models.dit_block import BlockRegions


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D], cos/sin [S, D/2]: widen, rotate pairs (2i, 2i+1) in fp32, stack, round back."""
    xf = x.float().unflatten(-1, (-1, 2))  # [B, S, H, D/2, 2]
    x1, x2 = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).to(x.dtype)


def _per_frame(fn, h, groups, group_len):
    return fn(h.unflatten(1, (groups, group_len))).flatten(1, 2)


def before_attention_reference(block, x, t_mod, cos, sin, heads, groups, group_len):
    mod = block.scale_shift_table.float()[:, None] + t_mod
    shift, scale = mod[:, :, 0, None], mod[:, :, 1, None]
    h = _per_frame(lambda t: block.norm1(t.float()) * (1 + scale) + shift, x, groups, group_len).to(x.dtype)
    a = block.attn1
    q = a.norm_q(a.to_q(h)).unflatten(2, (heads, -1))
    k = a.norm_k(a.to_k(h)).unflatten(2, (heads, -1))
    v = a.to_v(h).unflatten(2, (heads, -1))
    return (rope_reference(q, cos, sin).transpose(1, 2), rope_reference(k, cos, sin).transpose(1, 2),
            v.transpose(1, 2), mod)


def after_attention_reference(block, x, o, mod, text_k, text_v, heads, groups, group_len):
    gate, c_shift, c_scale, c_gate = (mod[:, :, i, None] for i in (2, 3, 4, 5))
    o = block.attn1.to_out[0](o.transpose(1, 2).flatten(2))
    x = (x.float() + _per_frame(lambda t: t * gate, o.float(), groups, group_len)).to(x.dtype)
    h = block.norm2(x.float()).to(x.dtype)
    c = block.attn2
    q = c.norm_q(c.to_q(h)).unflatten(2, (heads, -1)).transpose(1, 2)
    o = torch.nn.functional.scaled_dot_product_attention(q, text_k, text_v)
    x = x + c.to_out[0](o.transpose(1, 2).flatten(2))
    h = _per_frame(lambda t: block.norm3(t.float()) * (1 + c_scale) + c_shift, x, groups, group_len).to(x.dtype)
    f = block.ffn(h)
    return (x.float() + _per_frame(lambda t: t * c_gate, f.float(), groups, group_len)).to(x.dtype)


REFERENCE_REGIONS = BlockRegions(before_attention_reference, after_attention_reference)
