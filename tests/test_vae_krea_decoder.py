"""`vae_decoder="krea"`: the streaming decode under Krea Realtime Video's temporal-upsample cache rule.

The reference below is written from Krea's rule alone (krea-ai/realtime-video, `wan/modules/vae.py`,
`Resample.forward`, mode 'upsample3d'): a first frame leaves a zero cache of 2 frames and no temporal
upsampling; afterwards the cache becomes [where(old_last == 0, 0, x), x] for a one-frame input x, and
`time_conv` runs over [old cache, x]. It swaps that forward into each 3-D upsampler of a tiny random
diffusers VAE and decodes frame by frame; sdvg's own path (the Wan rule in the decoder, then
`VAEDecodeCache.settle`) must equal it bitwise."""
import types

import pytest
import torch

from sdvg.config import get_preset
from sdvg.engines.modules import VAEDecodeStep, vae_decode_static
from sdvg.models.vae import StreamingVAEDecoder, build_vae


@pytest.fixture(scope="module")
def dec():
    torch.manual_seed(0)
    return StreamingVAEDecoder(build_vae(get_preset("tiny").vae))


def _krea_upsample3d(self, x, feat_cache=None, feat_idx=(0,), **_):
    b, c, t, h, w = x.shape
    idx = feat_idx[0]
    if feat_cache[idx] is None:
        feat_cache[idx] = torch.zeros(b, c, 2, h, w, dtype=x.dtype)
        feat_idx[0] += 1
    else:
        cache_x = x[:, :, -2:].clone()
        if cache_x.shape[2] < 2:
            cache_x = torch.cat([torch.where(feat_cache[idx][:, :, -1:] == 0, 0, cache_x), cache_x], dim=2)
        x = self.time_conv(x, feat_cache[idx])
        feat_cache[idx] = cache_x
        feat_idx[0] += 1
        x = x.reshape(b, 2, c, t, h, w)
        x = torch.stack((x[:, 0], x[:, 1]), 3).reshape(b, c, t * 2, h, w)
    t = x.shape[2]
    x = self.resample(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
    return x.view(b, t, x.shape[1], x.shape[2], x.shape[3]).permute(0, 2, 1, 3, 4)


@torch.no_grad()
def krea_reference_decode(vae, latents):
    """latents [1, z, F, h, w] (normalised) -> pixels [1, 3, 1 + 4(F-1), H, W], one latent frame at a time."""
    ups = [m for m in vae.decoder.modules() if getattr(m, "mode", None) == "upsample3d"]
    assert ups, "the tiny VAE has a temporal upsampler"
    for m in ups:
        m.forward = types.MethodType(_krea_upsample3d, m)
    try:
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        x = vae.post_quant_conv(latents * std + mean)
        n = sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")
        feat_cache = [None] * n
        frames = [vae.decoder(x[:, :, i:i + 1], feat_cache=feat_cache, feat_idx=[0], first_chunk=i == 0)
                  for i in range(x.shape[2])]
    finally:
        for m in ups:
            del m.forward
    return torch.cat(frames, 2).float().clamp(-1.0, 1.0)


def test_krea_decoder_equals_the_reference_and_differs_from_wan_from_latent_frame_3(dec):
    torch.manual_seed(1)
    lat = torch.randn(1, 16, 9, 8, 8)
    cache = dec.new_cache("krea")
    krea = torch.cat([dec.decode(lat[:, :, i:i + 3], cache) for i in (0, 3, 6)], 2)  # blocks of 3, cache carried
    assert torch.equal(krea, krea_reference_decode(dec.vae, lat))
    wan = dec.decode(lat, dec.new_cache("wan"))
    assert torch.equal(wan, dec.decode_video(lat))  # the wan rule stays diffusers' decode
    first_pixel_of_latent_3 = 1 + 4 * 2
    assert torch.equal(krea[:, :, :first_pixel_of_latent_3], wan[:, :, :first_pixel_of_latent_3])
    for f in range(3, 9):  # every later latent frame's 4 pixel frames differ
        lo = 1 + 4 * (f - 1)
        assert not torch.equal(krea[:, :, lo:lo + 4], wan[:, :, lo:lo + 4]), f
    assert dec.new_cache().time_rule == "wan"


def test_krea_rule_survives_snapshot_restore_and_the_static_step(dec):
    torch.manual_seed(2)
    lat = torch.randn(1, 16, 6, 8, 8)
    draft = torch.randn(1, 16, 3, 8, 8)
    cache = dec.new_cache("krea")
    first = dec.decode(lat[:, :, :3], cache)
    snap = cache.snapshot()
    dec.decode(draft, cache)  # a rejected draft
    cache.restore(snap)
    second = dec.decode(lat[:, :, 3:], cache)
    ref = krea_reference_decode(dec.vae, lat)
    assert torch.equal(torch.cat([first, second], 2), ref)

    # the static steady-state step (compile / engine backends) with the rule applied outside it
    cache = dec.new_cache("krea")
    steps = {}

    def step(frame, *entries):
        steps.setdefault("s", VAEDecodeStep.for_cache(dec, cache))
        return steps["s"](frame, *entries)

    static = vae_decode_static(step, dec, lat, cache)
    assert "s" in steps  # the steady frames went through the step
    torch.testing.assert_close(static, ref, rtol=0, atol=1e-6)


def test_unknown_vae_decoder_refused(dec):
    with pytest.raises(ValueError, match="unknown vae_decoder 'kera'; choose one of wan, krea"):
        dec.new_cache("kera")


def test_pipeline_option_reaches_the_decoder_and_the_stats(tiny_pipe):
    from sdvg.options import GenerationOptions

    runs = {rule: tiny_pipe.generate("a red fox", tiny_pipe.resolve(GenerationOptions(
        mode="target", num_blocks=2, seed=3, vae_decoder=rule))) for rule in ("wan", "krea")}
    wan, krea = runs["wan"], runs["krea"]
    assert tiny_pipe.resolve(GenerationOptions()).vae_decoder == "wan"  # the tiny preset's default
    assert torch.equal(wan.latents, krea.latents)  # the decoder changes pixels only
    assert wan.stats.as_dict()["options"]["vae_decoder"] == "wan"
    assert krea.stats.as_dict()["options"]["vae_decoder"] == "krea"
    first_pixel_of_latent_3 = 1 + 4 * 2
    a, b = torch.as_tensor(wan.frames), torch.as_tensor(krea.frames)  # uint8 [F, H, W, 3]
    assert a.shape == b.shape and a.shape[0] == 1 + 4 * 5
    assert torch.equal(a[:first_pixel_of_latent_3], b[:first_pixel_of_latent_3])
    assert not torch.equal(a[first_pixel_of_latent_3:], b[first_pixel_of_latent_3:])
