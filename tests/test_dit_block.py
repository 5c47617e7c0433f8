"""The block's arithmetic with its casts folded in (`sdvg.models.dit_block`, `apply_rope`) is bitwise the
plain op-by-op form (tests/dit_reference.py), per dtype, on every forward the loops make."""
import pytest
import torch
from diffusers.models.normalization import FP32LayerNorm

from dit_reference import REFERENCE_REGIONS, rope_reference
from sdvg.config import DiTConfig
from sdvg.models.dit import CausalWanDiT
from sdvg.models.dit_block import EAGER_REGIONS, gated_residual, modulated_norm
from sdvg.models.kv_cache import KVCacheSpec
from sdvg.models.rope import apply_rope

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GH = GW = 4
TPF = GH * GW


def _dit(dtype) -> CausalWanDiT:
    torch.manual_seed(0)
    dit = CausalWanDiT(DiTConfig(dim=48, ffn_dim=96, num_heads=4, num_layers=2, text_dim=32)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # O(1) values everywhere, so a single rounding difference would show
        for p in dit.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return dit.set_precision({torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rope_is_bitwise_the_stacked_fp32_rotation(dtype):
    x = torch.randn(2, 24, 3, 12).to(dtype)
    cos, sin = torch.randn(24, 6), torch.randn(24, 6)
    out = apply_rope(x, cos, sin)
    assert out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, rope_reference(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_folded_norms_and_residuals_are_bitwise_the_op_by_op_form(dtype):
    x, y = torch.randn(2, 12, 16).to(dtype), torch.randn(2, 12, 16).to(dtype)
    scale, shift, gate = (torch.randn(2, 3, 1, 16) for _ in range(3))
    norm = FP32LayerNorm(16, 1e-6, elementwise_affine=False)
    plain = (norm(x.float()).unflatten(1, (3, 4)) * (1 + scale) + shift).flatten(1, 2).to(dtype)
    assert torch.equal(modulated_norm(norm, x, scale, shift, 3, 4), plain)
    plain = (x.float() + (y.float().unflatten(1, (3, 4)) * gate).flatten(1, 2)).to(dtype)
    assert torch.equal(gated_residual(x, y, gate, 3, 4), plain)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cached_and_full_forwards_are_bitwise_the_reference(dtype):
    """Two cached blocks (the second attending to the first), a full-sequence forward with a mask, and a
    sparse forward over some tokens: the folded regions give exactly the reference's outputs."""
    dit = _dit(dtype)
    text = dit.encode_text(torch.randn(1, 7, 32))
    spec = KVCacheSpec.for_dit(dit.config, TPF, max_frames=6)
    caches = {name: spec.allocate(dtype, "cpu") for name in ("eager", "reference")}
    regions = {"eager": EAGER_REGIONS, "reference": REFERENCE_REGIONS}
    x = [torch.randn(1, 16, 3, 2 * GH, 2 * GW) for _ in range(2)]
    t = torch.tensor([[750.0, 500.0, 250.0]])
    for block in range(2):
        out = {}
        for name in regions:
            out[name] = dit(x[block], t, text, cache=caches[name], regions=regions[name])
            caches[name].commit()
        assert out["eager"].dtype == dtype and torch.equal(out["eager"], out["reference"]), block
    assert torch.equal(caches["eager"].buffer, caches["reference"].buffer)

    full = torch.cat(x, dim=2)
    mask = torch.ones(6 * TPF, 6 * TPF, dtype=torch.bool).tril()
    a = dit(full, t.repeat(1, 2), text, attn_mask=mask)
    b = dit(full, t.repeat(1, 2), text, attn_mask=mask, regions=REFERENCE_REGIONS)
    assert torch.equal(a, b)

    active = torch.tensor([0, 5, 17, 40])
    for name in regions:
        caches[name].rollback(3)
    a = dit(x[1], t, text, cache=caches["eager"], active=active)
    b = dit(x[1], t, text, cache=caches["reference"], active=active, regions=REFERENCE_REGIONS)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_regions_under_autograd_give_the_same_values_and_gradients(dtype):
    """With autograd recording (a forward outside no_grad, e.g. through `forward_with`), the folded casts
    fall back to the plain form: the same values, and gradients flow to the weights."""
    dit = _dit(dtype)
    block = dit.model.blocks[0]
    x = torch.randn(1, 48, 48).to(dtype)
    t_mod, cos, sin = torch.randn(1, 3, 6, 48), torch.randn(48, 6), torch.randn(48, 6)
    with torch.no_grad():
        want = EAGER_REGIONS.before_attention(block, x, t_mod, cos, sin, 4, 3, 16)
    got = EAGER_REGIONS.before_attention(block, x, t_mod, cos, sin, 4, 3, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    q, k, v, mod = got
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out = EAGER_REGIONS.after_attention(block, x, o, mod, k, v, 4, 3, 16)
    out.float().square().mean().backward()
    assert block.attn1.to_q.weight.grad is not None and block.ffn.net[2].weight.grad.abs().sum() > 0
