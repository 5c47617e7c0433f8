"""The DiT's conditioning as Wan2.1 and Self-Forcing's `CausalWanModel` compute it: text embeddings
zero-padded to `text_len`, the timestep sinusoid in float64, RoPE frame offsets taken from the KV
cache, and block-causal masks over a cache (a context forward over several blocks at once)."""
import dataclasses

import pytest
import torch

from sdvg.config import ConfigError, DiTConfig, TextEncoderConfig, get_preset
from sdvg.engines.modules import DiTStep, dit_forward_static
from sdvg.models.dit import CausalWanDiT, block_causal_mask, timestep_sinusoid
from sdvg.models.kv_cache import KVCacheSpec


FPB, GH, GW = 3, 4, 4
TPF = GH * GW
FP32_TOL = 1e-4  # reordered fp32 arithmetic (values are O(10))
TIMESTEPS = torch.tensor([0.0, 0.5, 1.0, 250.0, 625.0, 833.3333, 937.5, 999.9, 1000.0])


def new_cache(dit, frames=12):
    return KVCacheSpec.for_dit(dit.config, TPF, frames).allocate(torch.float32, "cpu")


def latents(frames, seed=0):
    return torch.randn(1, 16, frames, 2 * GH, 2 * GW, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ timestep sinusoid
def wan_sinusoidal_embedding_1d(dim, position):
    """`wan/modules/model.py::sinusoidal_embedding_1d`, written out in plain torch float64."""
    half = dim // 2
    position = position.type(torch.float64)
    sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


@pytest.mark.parametrize("dim", [256, 16])
def test_timestep_sinusoid_is_wans_float64_formula(dim):
    ours = timestep_sinusoid(TIMESTEPS, dim)
    assert ours.dtype == torch.float64 and ours.shape == (len(TIMESTEPS), dim)
    assert (ours - wan_sinusoidal_embedding_1d(dim, TIMESTEPS)).abs().max() <= 1e-7
    per_frame = TIMESTEPS[:8].reshape(2, 4)  # [B, F] -> [B, F, dim], row by row
    assert torch.equal(timestep_sinusoid(per_frame, dim), ours[:8].reshape(2, 4, dim))


def test_timestep_sinusoid_has_diffusers_layout_up_to_fp32_rounding():
    from diffusers.models.embeddings import Timesteps

    exact = timestep_sinusoid(TIMESTEPS, 256)
    diffusers = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)(TIMESTEPS).double()
    # cos half first, the same frequencies; diffusers' fp32 angles are off by O(t x fp32 epsilon)
    assert ((diffusers - exact).abs() <= 1e-6 + TIMESTEPS[:, None].double() * 1e-7).all()
    assert (diffusers - exact).abs()[-1].max() > 1e-6  # at t = 1000 that residual is real (measured 4.1e-5)
    assert (exact.float().double() - exact).abs().max() <= 6e-8  # what the time MLP gets: fp32 rounding only


def test_forward_feeds_wans_sinusoid_to_the_time_mlp(dit, text):
    t = torch.tensor([[937.5, 833.3333, 0.0]])
    seen = []
    hook = dit.model.condition_embedder.time_embedder.linear_1.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].clone()))
    try:
        dit(latents(FPB), t, text)
    finally:
        hook.remove()
    assert len(seen) == 1 and seen[0].dtype == torch.float32
    assert torch.equal(seen[0], wan_sinusoidal_embedding_1d(256, t.flatten()).float().reshape(1, FPB, 256))


# ------------------------------------------------------------------ text length
def test_short_text_is_zero_padded_to_text_len_and_attended(dit):
    emb = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(2))
    short = dit.encode_text(emb)
    padded = dit.encode_text(torch.cat([emb, torch.zeros(1, 512 - 16, 32)], dim=1))
    assert short.keys[0].shape[2] == 512
    for a, b in zip(short.keys + short.values, padded.keys + padded.values):
        assert torch.equal(a, b)
    # the padded rows take part in cross-attention: 16 raw tokens give another output
    raw16 = CausalWanDiT(dataclasses.replace(dit.config, text_len=16)).eval()
    raw16.model.load_state_dict(dit.model.state_dict())
    x, t = latents(FPB), torch.full((1, FPB), 625.0)
    assert not torch.allclose(dit(x, t, short), raw16(x, t, raw16.encode_text(emb)), atol=1e-2)


def test_text_longer_than_text_len_is_refused(dit):
    with pytest.raises(ValueError, match=r"513 tokens.*text_len is 512.*truncate"):
        dit.encode_text(torch.zeros(1, 513, 32))


def test_preset_text_len_checks():
    tiny = get_preset("tiny")
    tiny.validate()
    short = tiny.replace(drafter=dataclasses.replace(tiny.drafter, text_len=77),
                         target=dataclasses.replace(tiny.target, text_len=77),
                         text_encoder=dataclasses.replace(tiny.text_encoder, text_len=77))
    short.validate()  # random tiny weights: any length, as long as the encoder and the DiTs agree
    with pytest.raises(ConfigError, match=r"target text_len 512 != text encoder text_len 77"):
        short.replace(target=tiny.target).validate()
    with pytest.raises(ConfigError, match=r"text encoder text_len 0 must be >= 1"):
        tiny.replace(text_encoder=dataclasses.replace(tiny.text_encoder, text_len=0)).validate()
    with pytest.raises(ConfigError, match=r"drafter: text_len 0 must be >= 1"):
        tiny.replace(drafter=dataclasses.replace(tiny.drafter, text_len=0)).validate()
    for name, why in (("wan2.1", "loads Wan2.1 weights"), ("real-size", r"has Wan2\.1's width \(dim 1536\)")):
        p = get_preset(name)
        p.validate()
        bad = p.replace(drafter=dataclasses.replace(p.drafter, text_len=256),
                        target=dataclasses.replace(p.target, text_len=256),
                        text_encoder=dataclasses.replace(p.text_encoder, text_len=256))
        with pytest.raises(ConfigError, match=rf"drafter text_len 256: this DiT {why}.*set text_len=512"):
            bad.validate()
    assert DiTConfig(dim=64, ffn_dim=64, num_heads=4, num_layers=1).text_len == TextEncoderConfig().text_len == 512


# ------------------------------------------------------------------ frame offset from the cache
def test_frame_offset_comes_from_the_cache(dit, text):
    a, b = new_cache(dit), new_cache(dit)
    for block in range(2):
        x, t = latents(FPB, seed=block), torch.full((1, FPB), 0.0)
        assert torch.equal(dit(x, t, text, cache=a), dit(x, t, text, FPB * block, cache=b))
        a.commit()
        b.commit()
    with pytest.raises(ValueError, match=r"frame_offset 9 disagrees with the KV cache's write position 6"):
        dit(latents(FPB), torch.zeros(1, FPB), text, 9, cache=a)
    assert a.pending_frames == 0  # refused before any slot was claimed
    x = latents(FPB)
    assert torch.equal(dit(x, torch.zeros(1, FPB), text), dit(x, torch.zeros(1, FPB), text, 0))  # no cache: 0


def test_static_step_takes_its_frame_offset_from_the_cache(dit, text):
    step = DiTStep(dit).eval()
    eager, static = new_cache(dit), new_cache(dit)
    x, t = latents(FPB), torch.full((1, FPB), 937.5)
    for cache in (eager, static):
        dit(latents(FPB, seed=5), torch.zeros(1, FPB), text, cache=cache)
        cache.commit()
    a = dit(x, t, text, cache=eager)
    s = dit_forward_static(step, dit, x, t, text, None, static, TPF)
    assert (a - s).abs().max() <= 1e-5 * max(1.0, a.abs().max())
    with pytest.raises(ValueError, match=r"frame_offset 0 disagrees with the KV cache's write position 3"):
        dit_forward_static(step, dit, x, t, text, 0, static, TPF)


# ------------------------------------------------------------------ masks over a cache
def test_block_causal_mask_by_frames():
    assert torch.equal(block_causal_mask(None, FPB, TPF, num_frames=6), block_causal_mask(2, FPB, TPF))
    assert torch.equal(block_causal_mask(None, FPB, TPF, 4, 1, num_frames=9), block_causal_mask(3, FPB, TPF, 4, 1))
    frames = block_causal_mask(None, FPB, 1, num_frames=5)  # groups 0-2 and 3-4
    assert torch.equal(frames[:3], torch.tensor([[1, 1, 1, 0, 0]] * 3, dtype=torch.bool))
    assert frames[3:].all()
    assert block_causal_mask(2, FPB, TPF, num_frames=5).shape == (5 * TPF, 5 * TPF)
    with pytest.raises(ValueError, match="num_blocks 3 disagrees with num_frames 5"):
        block_causal_mask(3, FPB, TPF, num_frames=5)


@pytest.mark.parametrize("before, frames", [(0, 6), (0, 5), (FPB, 5)])
def test_masked_multi_block_forward_over_a_cache_equals_block_by_block(dit, text, before, frames):
    """One context forward over `frames` frames with a block-causal mask (groups of 3 from frame 0)
    writes the K/V and gives the outputs of one forward per group with a commit between."""
    x = latents(frames, seed=3)
    t = torch.rand(1, frames, generator=torch.Generator().manual_seed(4)) * 1000
    one, many = new_cache(dit), new_cache(dit)
    for cache in (one, many):
        if before:
            dit(latents(before, seed=6), torch.zeros(1, before), text, cache=cache)
            cache.commit()

    total = before + frames
    mask = block_causal_mask(None, FPB, TPF, num_frames=total)[before * TPF:]  # the new frames' rows
    whole = dit(x, t, text, cache=one, attn_mask=mask)
    one.commit()
    parts = []
    for start in range(0, frames, FPB):
        stop = min(start + FPB, frames)
        parts.append(dit(x[:, :, start:stop], t[:, start:stop], text, cache=many))
        many.commit()
    assert one.committed_frames == many.committed_frames == total
    for start, part in zip(range(0, frames, FPB), parts):
        assert (whole[:, :, start:start + part.shape[2]] - part).abs().max() < FP32_TOL
    written = slice(before * TPF, total * TPF)
    assert (one.buffer[..., written, :] - many.buffer[..., written, :]).abs().max() < FP32_TOL
    if not before:  # without the mask the first group would see the later frames
        plain = dit(x, t, text, cache=new_cache(dit))
        assert not torch.allclose(plain[:, :, :FPB], parts[0], atol=1e-2)


def test_mask_over_a_cache_must_cover_the_visible_frames(dit, text):
    cache = new_cache(dit)
    dit(latents(FPB), torch.zeros(1, FPB), text, cache=cache)
    cache.commit()
    with pytest.raises(ValueError, match=r"attn_mask with a cache must be \[S_new, S_visible\] = \[48, 96\]"):
        dit(latents(FPB), torch.zeros(1, FPB), text, cache=cache, attn_mask=block_causal_mask(1, FPB, TPF))
