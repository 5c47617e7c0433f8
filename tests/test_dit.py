import pytest
import torch

from sdvg.config import DiTConfig, KVWindow, get_preset
from sdvg.models.dit import CausalWanDiT, block_causal_mask, timestep_sinusoid
from sdvg.models.kv_cache import KVCacheSpec
from sdvg.models.rope import apply_rope, rope_angles, rope_cos_sin


FPB, GH, GW = 3, 4, 4
TPF = GH * GW
FP32_TOL = 1e-4  # per-dtype tolerance for reordered fp32 arithmetic (values are O(10))


def test_single_block_equals_diffusers_forward(dit, monkeypatch):
    x = torch.randn(1, 16, FPB, 2 * GH, 2 * GW)
    emb = torch.randn(1, 512, 32)
    ours = dit(x, torch.full((1, FPB), 937.5), dit.encode_text(emb))
    with torch.no_grad():
        fp32_sinusoid = dit.model(x, torch.full((1, FPB * TPF), 937.5), emb).sample  # per-token timesteps
        # diffusers with Wan's float64 sinusoid in place of its fp32 `timesteps_proj`
        proj = dit.model.condition_embedder.timesteps_proj
        monkeypatch.setattr(proj, "forward", lambda t: timestep_sinusoid(t, proj.num_channels).float())
        ref = dit.model(x, torch.full((1, FPB * TPF), 937.5), emb).sample
    assert (ours - ref).abs().max() < FP32_TOL
    # diffusers' own fp32 sinusoid moves the output by its rounding (measured 2e-4 to 2.5e-4 on values O(10))
    assert (ours - fp32_sinusoid).abs().max() < 1e-3


def test_per_frame_timesteps_modulate_per_frame(dit, text):
    x = torch.randn(1, 16, FPB, 2 * GH, 2 * GW)
    a = dit(x, torch.tensor([[1000.0, 500.0, 0.0]]), text)
    b = dit(x, torch.tensor([[1000.0, 500.0, 250.0]]), text)
    assert not torch.allclose(a[:, :, 2], b[:, :, 2])
    assert not torch.allclose(a[:, :, 0], b[:, :, 0])  # attention mixes frames


@pytest.mark.parametrize("window", [KVWindow(), KVWindow(window_frames=6, sink_frames=1)])
def test_blockwise_cache_equals_block_causal_full_forward(dit, text, window):
    nb = 4
    clean = torch.randn(1, 16, nb * FPB, 2 * GH, 2 * GW)
    noisy = torch.randn(1, 16, FPB, 2 * GH, 2 * GW)
    cache = KVCacheSpec.for_dit(dit.config, TPF, nb * FPB + FPB, window).allocate(torch.float32, "cpu")
    commits = []
    for b in range(nb):
        commits.append(dit(clean[:, :, b * FPB:(b + 1) * FPB], torch.zeros(1, FPB), text, b * FPB, cache=cache))
        cache.commit()
    step = dit(noisy, torch.full((1, FPB), 833.3), text, nb * FPB, cache=cache)  # a denoising pass of block nb

    # Teacher forcing: all clean blocks + the noisy one in one forward with a block-causal mask.
    seq = torch.cat([clean, noisy], dim=2)
    ts = torch.cat([torch.zeros(1, nb * FPB), torch.full((1, FPB), 833.3)], dim=1)
    mask = block_causal_mask(nb + 1, FPB, TPF, window.window_frames, window.sink_frames)
    full = dit(seq, ts, text, attn_mask=mask)
    assert (torch.cat(commits, 2) - full[:, :, : nb * FPB]).abs().max() < FP32_TOL
    assert (step - full[:, :, nb * FPB:]).abs().max() < FP32_TOL
    if window.window_frames:
        plain = block_causal_mask(nb + 1, FPB, TPF)
        assert not torch.allclose(dit(seq, ts, text, attn_mask=plain)[:, :, -FPB:], step, atol=1e-3)


def test_rope_offset_matches_full_sequence_phases():
    cfg = get_preset("tiny").target
    ang = rope_angles(cfg.head_dim, 64)
    full_cos, full_sin = rope_cos_sin(ang, cfg.head_dim, 0, 12, GH, GW, "cpu")
    for k in (3, 7):
        cos, sin = rope_cos_sin(ang, cfg.head_dim, k, 3, GH, GW, "cpu")
        assert torch.equal(cos, full_cos[k * TPF:(k + 3) * TPF])
        assert torch.equal(sin, full_sin[k * TPF:(k + 3) * TPF])
    x = torch.randn(1, 3 * TPF, 2, cfg.head_dim)
    assert torch.allclose(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # a rotation


def test_rope_table_bound_is_an_error():
    ang = rope_angles(16, 8)
    with pytest.raises(ValueError, match="RoPE table"):
        rope_cos_sin(ang, 16, 6, 3, 2, 2, "cpu")


def test_real_presets_have_the_published_dimensions():
    p = get_preset("wan2.1")
    assert (p.drafter.dim, p.drafter.ffn_dim, p.drafter.num_heads, p.drafter.num_layers, p.drafter.head_dim) == \
        (1536, 8960, 12, 30, 128)
    assert (p.target.dim, p.target.ffn_dim, p.target.num_heads, p.target.num_layers, p.target.head_dim) == \
        (5120, 13824, 40, 40, 128)
    assert p.video.tokens_per_frame(p.vae, p.target) == 1560
    assert 13.5e9 < p.target.num_params() < 14.5e9


def test_meta_param_count_matches_module():
    cfg = DiTConfig(dim=64, ffn_dim=96, num_heads=4, num_layers=2, text_dim=32)
    m = CausalWanDiT(cfg)
    assert cfg.num_params() == sum(p.numel() for p in m.model.parameters())
