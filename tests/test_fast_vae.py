"""The fast VAE decode (`fast_vae`): a channels-last copy of the decoder, the steady state compiled,
cudnn.benchmark for the decoder's calls only; against the plain streaming decode within
`FAST_VAE_TOLERANCE` (not bitwise: other summation orders)."""
import numpy as np
import pytest
import torch

from sdvg.generation.fast_vae import FAST_VAE_TOLERANCE, FastVAEDecode, cudnn_benchmark

PROMPT = "a red fox"


def _latents(preset, blocks=3, seed=0):
    lh, lw = preset.video.latent_hw(preset.vae)
    g = torch.Generator().manual_seed(seed)
    F = preset.video.frames_per_block
    x = torch.randn(1, preset.vae.z_dim, blocks * F, lh, lw, generator=g)
    return [x[:, :, b * F:(b + 1) * F] for b in range(blocks)]


def _compare(vae, preset, compile: bool):
    fast = FastVAEDecode(vae, compile=compile)
    plain_cache, fast_cache = vae.new_cache(), vae.new_cache()
    worst = 0.0
    for b, x in enumerate(_latents(preset)):
        snap = fast_cache.snapshot()
        a, f = vae.decode(x, plain_cache), fast.decode(x, fast_cache)
        assert a.shape == f.shape and f.is_contiguous() and f.dtype == torch.float32
        worst = max(worst, (a - f).abs().max().item())
        if b == 2:  # a snapshot restored and decoded again (a rejected draft) gives the same pixels
            fast_cache.restore(snap)
            assert torch.equal(fast.decode(x, fast_cache), f)
    assert worst <= FAST_VAE_TOLERANCE[vae.dtype], worst
    return fast


def test_channels_last_decode_within_tolerance_and_the_vae_untouched(tiny_pipe):
    vae = tiny_pipe.components.vae
    weights = {n: p.detach().clone() for n, p in vae.vae.named_parameters()}
    flag = torch.backends.cudnn.benchmark
    fast = _compare(vae, tiny_pipe.preset, compile=False)
    convs = [p for p in fast.fast.vae.parameters() if p.dim() == 5]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last_3d) for p in convs)
    # the pipeline's own VAE keeps its weights and layout; the global flag is as it was
    for n, p in vae.vae.named_parameters():
        assert p.is_contiguous() and torch.equal(p, weights[n]), n
    assert torch.backends.cudnn.benchmark == flag


@pytest.mark.slow
def test_compiled_steady_decode_within_tolerance(tiny_pipe):
    _compare(tiny_pipe.components.vae, tiny_pipe.preset, compile=True)


def test_cudnn_benchmark_is_restored_even_on_error():
    before = torch.backends.cudnn.benchmark
    with pytest.raises(RuntimeError):
        with cudnn_benchmark(not before):
            assert torch.backends.cudnn.benchmark == (not before)
            raise RuntimeError("stage failed")
    assert torch.backends.cudnn.benchmark == before


@pytest.mark.slow
def test_fast_vae_video_within_tolerance(tiny_pipe):
    """target-only under a full context: the latents do not depend on the pixels (bitwise the same);
    the frames within the tolerance (one uint8 step on fp32)."""
    kw = dict(mode="target", num_blocks=3, seed=2, target_context="full")
    plain = tiny_pipe(PROMPT, **kw)
    fast = tiny_pipe(PROMPT, fast_vae=True, **kw)
    assert fast.stats["options"]["fast_vae"] is True
    assert torch.equal(plain.latents, fast.latents)
    assert np.abs(plain.frames - fast.frames).max() <= 1 / 255 + 1e-7
    again = tiny_pipe(PROMPT, **kw)  # the plain decode afterwards is the plain decode
    assert np.array_equal(plain.frames, again.frames)


def test_fast_vae_needs_the_eager_backend(tiny_pipe):
    with pytest.raises(ValueError, match="fast_vae needs backend 'eager'"):
        tiny_pipe(PROMPT, num_blocks=1, mode="target", fast_vae=True, backend="compile")

