"""The real-size preset (Wan2.1 1.3B drafter, 14B target, 832x480) on the meta device: every shape
of a block-by-block pass through both DiTs with their KV caches, and of the streaming VAE decode,
without allocating a byte. A shape bug that only shows at the real dimensions fails here, not in a
GPU session."""
import pytest
import torch

from sdvg.config import get_preset
from sdvg.models.dit import CausalWanDiT
from sdvg.models.kv_cache import KVCacheSpec
from sdvg.models.vae import StreamingVAEDecoder, build_vae

PRESET = get_preset("real-size")
LATENT_HW = (PRESET.video.height // 8, PRESET.video.width // 8)  # (60, 104)


@pytest.mark.parametrize("role,params_b", [("drafter", 1.42), ("target", 14.29)])
def test_real_size_dit_blocks_with_kv_cache_on_meta(role, params_b):
    cfg = getattr(PRESET, role)
    with torch.device("meta"):
        dit = CausalWanDiT(cfg)
    dit.set_precision("bf16")
    assert sum(p.numel() for p in dit.parameters()) / 1e9 == pytest.approx(params_b, abs=0.01)
    tpf = PRESET.video.tokens_per_frame(PRESET.vae, cfg)
    assert tpf == (LATENT_HW[0] // 2) * (LATENT_HW[1] // 2) == 1560
    nb, fpb = 3, PRESET.video.frames_per_block
    spec = KVCacheSpec.for_dit(cfg, tpf, nb * fpb)
    cache = spec.allocate(torch.bfloat16, "meta")
    assert cache.nbytes == spec.nbytes(torch.bfloat16) == 2 * cfg.num_layers * cfg.dim * tpf * nb * fpb * 2
    text = dit.encode_text(torch.empty(1, 512, cfg.text_dim, device="meta"))
    assert text.keys[0].shape == (1, cfg.num_heads, 512, cfg.head_dim)
    for b in range(nb):
        x = torch.empty(1, cfg.in_channels, fpb, *LATENT_HW, device="meta")  # [B, C, F, h, w]
        y = dit(x, torch.zeros(1, fpb, device="meta"), text, b * fpb, cache)
        cache.commit()
        assert y.shape == x.shape and y.dtype == torch.bfloat16
        k, _ = cache.visible(0)
        assert k.shape == (1, cfg.num_heads, (b + 1) * fpb * tpf, cfg.head_dim)


def test_real_size_streaming_vae_decode_on_meta():
    with torch.device("meta"):
        vae = StreamingVAEDecoder(build_vae(PRESET.vae))
    cache = vae.new_cache()
    fpb = PRESET.video.frames_per_block
    frames = []
    for b in range(3):
        out = vae.decode(torch.empty(1, 16, fpb, *LATENT_HW, device="meta"), cache)  # [B, 3, f, H, W]
        frames.append(out.shape[2])
        assert out.shape[-2:] == (PRESET.video.height, PRESET.video.width)
    assert frames == [1 + 4 * (fpb - 1), 4 * fpb, 4 * fpb]  # 9, then 12 per block
