"""Engine modules (static shapes) against the eager path, in-place K/V writes, ONNX export parity, the
compiled backend."""
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sdvg.config import KVWindow
from sdvg.models.dit import block_causal_mask
from sdvg.models.kv_cache import KVCacheSpec
from sdvg.engines.modules import (DiTStep, RewardStep, VAEDecodeStep, dit_engine_mask, dit_forward_static,
                                  text_tensors, vae_cache_is_steady, vae_decode_static)

TPF, FPB = 16, 3  # the tiny preset's tokens per latent frame and frames per block


@pytest.mark.parametrize("window,blocks", [(KVWindow(), 3), (KVWindow(4, 1, 2), 5)], ids=["full", "ring-window"])
def test_dit_step_equals_cached_forward(tiny_pipe, window, blocks):
    """The DiT engine gathers the visible cached tokens in frame order (a ring window's too) and attends over
    them and the block only: the same keys in the same order as the eager forward, so bitwise equal."""
    c = tiny_pipe.components
    dit = c.target
    text = dit.encode_text(c.text_encoder.encode("a fox"))
    spec = KVCacheSpec.for_dit(dit.config, TPF, blocks * FPB, window)
    eager_cache, static_cache = spec.allocate(torch.float32, "cpu"), spec.allocate(torch.float32, "cpu")
    step = DiTStep(dit, FPB).eval()
    g = torch.Generator().manual_seed(0)
    for b in range(blocks):
        x = torch.randn(1, 16, FPB, 8, 8, generator=g)
        t = torch.full((1, FPB), 625.0 if b == 2 else 0.0)
        a = dit(x, t, text, FPB * b, cache=eager_cache)
        s = dit_forward_static(step, dit, x, t, text, FPB * b, static_cache, TPF)
        assert torch.equal(a, s)
        assert torch.equal(eager_cache.buffer, static_cache.buffer)
        eager_cache.commit()
        static_cache.commit()
    if window.window_frames:
        assert static_cache.visible_slots() != sorted(static_cache.visible_slots())  # the ring wrapped


@pytest.mark.parametrize("before,frames", [(0, 3), (0, 6), (0, 5), (3, 3)])
def test_context_forward_through_the_dit_engine(tiny_pipe, before, frames):
    """A recompute context forward (several clean frames at once, block-causal in groups of 3) through
    the DiT engine equals the eager masked forward; a mask other than the engine's own is refused."""
    c = tiny_pipe.components
    dit = c.target
    text = dit.encode_text(c.text_encoder.encode("a fox"))
    spec = KVCacheSpec.for_dit(dit.config, TPF, 12)
    eager_cache, static_cache = spec.allocate(torch.float32, "cpu"), spec.allocate(torch.float32, "cpu")
    step = DiTStep(dit, FPB).eval()
    g = torch.Generator().manual_seed(1)
    if before:
        x = torch.randn(1, 16, before, 8, 8, generator=g)
        for cache in (eager_cache, static_cache):
            dit(x, torch.zeros(1, before), text, cache=cache)
            cache.commit()
    x = torch.randn(1, 16, frames, 8, 8, generator=g)
    t = torch.zeros(1, frames)
    mask = block_causal_mask(None, FPB, TPF, num_frames=before + frames)[before * TPF:]
    want = dit_engine_mask(frames, before, TPF, FPB)
    assert (mask.all() if want is None else torch.equal(mask, want))
    a = dit(x, t, text, cache=eager_cache, attn_mask=mask)
    s = dit_forward_static(step, dit, x, t, text, None, static_cache, TPF, attn_mask=mask, frames_per_block=FPB)
    assert (a - s).abs().max() <= 1e-5 * max(1.0, a.abs().max())
    assert (eager_cache.buffer - static_cache.buffer).abs().max() <= 1e-5
    static_cache.rollback(before)
    with pytest.raises(ValueError, match="take no free attention mask"):
        dit_forward_static(step, dit, x, t, text, None, static_cache, TPF, attn_mask=~mask, frames_per_block=FPB)


class NewStorages(TorchDispatchMode):
    """Every tensor an op allocates (outputs on a storage none of its inputs has): (op, bytes)."""

    def __init__(self):
        super().__init__()
        self.allocations = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.allocations.append((str(func), t.untyped_storage().nbytes()))
        return out


def assert_in_place_step(run_step, cache):
    """`run_step()` writes a block into `cache` without moving its buffer, copying it or allocating
    anything near its size (the largest allocation stays below a fifth of the cache)."""
    ptr, total = cache.buffer.data_ptr(), cache.nbytes
    with NewStorages() as mode:
        run_step()
    assert cache.buffer.data_ptr() == ptr
    biggest = max(mode.allocations, key=lambda a: a[1])
    assert biggest[1] < total / 5, (biggest, total)
    return mode.allocations


def test_static_step_writes_the_block_in_place(tiny_pipe):
    """The cache goes into the DiT engine as its layer buffers (views, no copy) and the block's K/V are
    copied into the pending slots: the buffer keeps its address and nothing cache-sized is allocated."""
    c = tiny_pipe.components
    dit = c.target
    text = dit.encode_text(c.text_encoder.encode("a fox"))
    cache = KVCacheSpec.for_dit(dit.config, TPF, 8 * FPB).allocate(torch.float32, "cpu")  # 8 blocks of capacity
    step = DiTStep(dit, FPB).eval()
    stacked = text_tensors(text)  # stacked once per prompt, as the runners do (512 text tokens > this cache)
    g = torch.Generator().manual_seed(2)
    for b in range(3):
        x = torch.randn(1, 16, FPB, 8, 8, generator=g)
        assert_in_place_step(lambda: dit_forward_static(step, dit, x, torch.zeros(1, FPB), text, None, cache, TPF,
                                                        text_kv=stacked), cache)
        block = slice(b * FPB * TPF, (b + 1) * FPB * TPF)
        assert cache.buffer[..., block, :].abs().sum() > 0  # the block landed in its slots
        cache.commit()
    assert cache.buffer[..., 3 * FPB * TPF:, :].abs().sum() == 0  # and nowhere else
    with pytest.raises(AssertionError):  # the check sees a copy of the cache's keys (what a .contiguous() made)
        assert_in_place_step(lambda: cache.buffer[:, 0].contiguous(), cache)


def test_vae_step_equals_streaming_decode(tiny_pipe):
    dec = tiny_pipe.components.vae
    lat = torch.randn(1, 16, 6, 8, 8, generator=torch.Generator().manual_seed(1))
    warm = dec.new_cache()
    dec.decode(lat[:, :, :2], warm)
    assert vae_cache_is_steady(warm)
    step = VAEDecodeStep.for_cache(dec, warm)
    calls = []

    def counted(*args):
        calls.append(1)
        return step(*args)

    a, b = dec.new_cache(), dec.new_cache()
    assert torch.equal(dec.decode(lat, a), vae_decode_static(counted, dec, lat, b))
    assert len(calls) == 4  # frames 3..6 went through the static step
    with pytest.raises(ValueError, match="steady state"):
        VAEDecodeStep.for_cache(dec, dec.new_cache())


def test_reward_step_equals_scorer(tiny_pipe):
    sc = tiny_pipe.components.scorer
    frames = torch.rand(3, 3, 48, 64, generator=torch.Generator().manual_seed(2))
    tok = sc.tokens("a fox")
    assert torch.equal(sc.score("a fox", frames), RewardStep(sc)(sc.preprocess(frames), tok.ids, tok.mask))


@pytest.mark.slow
def test_onnx_export_of_every_engine_matches_eager(tiny_pipe, tiny_onnx_build):
    """Every engine's ONNX file as export_onnx wrote it (the session's one `build_engines --format onnx`
    run, conftest's `tiny_onnx_build`, exports each engine with it) run in onnxruntime against eager here."""
    from build_engines.export import verify_onnx
    from sdvg.engines.cache import EngineCache
    from sdvg.engines.signatures import component_signatures, engine_key, engine_spec

    assert tiny_onnx_build.proc.returncode == 0, tiny_onnx_build.proc.stderr
    cache = EngineCache(tiny_onnx_build.out)
    errors = {}
    for sig in component_signatures(tiny_pipe.components):
        st = engine_spec(tiny_pipe.components, sig)
        # the file exported for these very weights, shapes and precision (the cache validates the key and file)
        onnx_file = cache.load(engine_key(sig, tiny_pipe.components, "onnx"), "python -m build_engines --preset tiny")
        errors[st.name] = verify_onnx(st, onnx_file)
    assert set(errors) == {"drafter_dit_3f", "drafter_dit_3f_cached", "target_dit_3f", "target_dit_3f_cached",
                           "vae_decode", "reward_9f", "reward_12f"}
    # measured: DiT engines 2.6e-7 to 4.1e-7, VAE 2.1e-6, reward 7.8e-7
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.slow
def test_compile_backend_matches_eager(tiny_pipe):
    """backend compile with inductor (its C++ kernels on the CPU): within COMPILE_TOLERANCE of eager."""
    kw = dict(num_blocks=3, seed=1, router="pattern", pattern=(False, True, False))
    eager = tiny_pipe("a red fox", **kw)
    compiled = tiny_pipe("a red fox", backend="compile", **kw)
    assert compiled.stats["options"]["backend"] == "compile"
    assert [b["decision"] for b in eager.stats["blocks"]] == [b["decision"] for b in compiled.stats["blocks"]]
    assert (eager.latents - compiled.latents).abs().max() < 1e-4
    assert np.abs(eager.frames - compiled.frames).max() <= 1 / 255 + 1e-7  # uint8 rounding
    for a, b in zip(eager.stats["blocks"][1:], compiled.stats["blocks"][1:]):
        assert a["score"] == pytest.approx(b["score"], abs=1e-4)
