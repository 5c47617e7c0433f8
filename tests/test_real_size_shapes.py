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


@pytest.mark.slow
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


# ------------------------------------------------------------------ engine signatures
REAL_ENGINES = {  # name: (largest tensor at the profiles' upper bounds, its name)
    "drafter_dit_3f": (215_654_400, "new_k"),  # [30, 1, 12, 4680, 128]
    "drafter_dit_3f_cached": (215_654_400, "new_k"),  # kv_l [2, 1, 12, <=42120, 128]: 129 M
    "target_dit_3f": (958_464_000, "new_k"),  # [40, 1, 40, 4680, 128]
    "target_dit_3f_cached": (958_464_000, "new_k"),  # kv_l [2, 1, 40, <=42120, 128]: 431 M
    "vae_decode": (76_677_120, "cache_in_25"),  # [1, 96, 2, 480, 832] (and its cache_out)
    "reward_9f": (1_354_752, "images"),
    "reward_12f": (1_806_336, "images"),
}


def test_real_size_engine_signatures_on_meta():
    """Every engine of the real-size preset (both context modes, the preset's 9 blocks), from the
    configs on the meta device (no weights, no real tensor: how long it takes is measured nowhere here, as
    no test times anything): no tensor reaches 2^31 elements, the cache goes in one layer at a time and is
    read over the visible tokens only."""
    from sdvg.engines.signatures import (CACHE_TOKENS, MAX_ELEMENTS, VISIBLE_TOKENS, preset_signatures,
                                         vae_cache_structure)

    vae_cache_structure.cache_clear()
    sigs = preset_signatures(PRESET)
    by_name = {s.name: s for s in sigs}
    assert list(by_name) == list(REAL_ENGINES)
    table = []
    for s in sigs:
        top = s.sizes("max")
        biggest = max(s.inputs + s.outputs, key=lambda t: t.numel(top))
        assert (biggest.numel(top), biggest.name) == REAL_ENGINES[s.name], (s.name, biggest)
        assert s.max_elements() <= MAX_ELEMENTS
        for t in s.inputs:
            table.append((s.name, t.name, t.shape, t.dtype, t.nbytes(top)))
    tgt = by_name["target_dit_3f_cached"]
    assert dict((d, (lo, hi)) for d, lo, _, hi in tgt.dynamic) == {
        VISIBLE_TOKENS: (1560, 24 * 1560),  # 1 to 24 visible frames: the 9th block of a full context
        CACHE_TOKENS: (1560, 27 * 1560),  # up to the 27-frame full cache (a recompute cache holds 6)
    }
    kv = [t for t in tgt.inputs if t.name.startswith("kv_")]
    assert len(kv) == 40 and kv[0].shape == (2, 1, 40, CACHE_TOKENS, 128) and kv[0].dtype == "bfloat16"
    assert kv[0].nbytes(tgt.sizes("max")) == 2 * 40 * 42120 * 128 * 2  # one layer's K and V: 0.86 GB
    whole_cache = 40 * 2 * 40 * 42120 * 128  # what the old engine took as one input: 8.6e9 elements
    assert whole_cache > MAX_ELEMENTS and all(t.numel(tgt.sizes("max")) < whole_cache / 20 for t in tgt.inputs)
    assert [t.name for t in by_name["target_dit_3f"].inputs] == ["latents", "t_freq", "text_k", "text_v", "cos",
                                                                 "sin"]
    assert by_name["reward_9f"].inputs[0].shape == (9, 3, 224, 224)
    inputs = {name: sum(1 for row in table if row[0] == name) for name in by_name}
    assert inputs == {"drafter_dit_3f": 6, "drafter_dit_3f_cached": 6 + 1 + 30, "target_dit_3f": 6,
                      "target_dit_3f_cached": 6 + 1 + 40, "vae_decode": 1 + 32, "reward_9f": 3, "reward_12f": 3}
