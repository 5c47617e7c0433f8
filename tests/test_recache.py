"""Re-cache on a switch (docs/live.md): the re-cache forward's K/V equal a fresh context forward under the new
prompt (a cached context forward over the whole history; for a window with sinks, a full-sequence forward at
the frames' own positions with the evicted frames masked out), and a live session that re-caches replays
bitwise from its schedule, its re-cache forwards counted per block."""
import pytest
import torch

from sdvg.generation.prepare import allocate_cache, prepare
from sdvg.generation.types import Counters
from sdvg.models.dit import block_causal_mask
from sdvg.options import GenerationOptions


def _target(pipe, window_frames=0, sink_frames=0, num_blocks=6, keep_clean=True):
    opts = pipe.resolve(GenerationOptions(mode="target", target_context="full", num_blocks=num_blocks,
                                          scheduler="reference", window_frames=window_frames,
                                          sink_frames=sink_frames))
    setup = prepare(pipe.components, "a red fox", opts, Counters(), keep_clean=keep_clean)
    model = setup.target
    model.prompt_kv = setup.text_kv[setup.conditioning.key, "target"]  # the K/V its blocks are committed under
    return model, opts


def _commit_blocks(model, blocks: int, seed=0):
    g = torch.Generator().manual_seed(seed)
    F = model.frames_per_block
    lh, lw = model.dit.config.patch_size[1] * 4, model.dit.config.patch_size[2] * 4
    shape = (1, model.dit.config.in_channels, F, lh, lw)
    latents = [torch.randn(shape, generator=g) for _ in range(blocks)]
    for b, x in enumerate(latents):
        model.commit_forward(x, b * F, model.prompt_kv)
        model.cache.commit()
    return torch.cat(latents, dim=2)


def _new_text(pipe, model, prompt="an owl at night"):
    return model.dit.encode_text(pipe.components.text_encoder.encode(prompt))


def _slot_kv(cache, layer, frame, tpf):
    buf = cache.layer_buffer(layer)  # [2, B, H, slots * tpf, D]
    slot = cache.visible_slots()[cache.visible_frames().index(frame)]
    return buf[:, :, :, slot * tpf:(slot + 1) * tpf]


def test_recache_equals_a_fresh_context_forward_under_the_new_prompt(tiny_pipe):
    model, opts = _target(tiny_pipe)
    x = _commit_blocks(model, 3)  # [1, C, 9, h, w]
    text = _new_text(tiny_pipe, model)
    before = model.cache.buffer.clone()
    model.recache(text)
    assert model.recache_forwards == 1 and not torch.equal(before, model.cache.buffer)
    assert not model.cache.buffer.requires_grad and model.cache.buffer.grad_fn is None  # no graph holds the cache
    fresh = allocate_cache(tiny_pipe.components, model.dit, model.device, opts.role_context("target"), opts.num_blocks)
    tpf, n = model.tokens_per_frame, x.shape[2]
    mask = block_causal_mask(None, model.frames_per_block, tpf, num_frames=n)
    model.dit(x, torch.zeros((1, n)), text, 0, cache=fresh, attn_mask=mask)  # the context forward of a fresh cache
    fresh.commit()
    for layer in range(model.dit.config.num_layers):
        for f in range(n):
            torch.testing.assert_close(_slot_kv(model.cache, layer, f, tpf), _slot_kv(fresh, layer, f, tpf),
                                       rtol=0, atol=0)


def test_recache_of_a_window_with_sinks_equals_the_full_sequence_at_the_frames_positions(tiny_pipe):
    model, opts = _target(tiny_pipe, window_frames=6, sink_frames=3, num_blocks=8)
    x = _commit_blocks(model, 5)  # frames 0..14: visible are the sinks 0..2 and the window 9..14
    visible = [f for f in model.cache.visible_frames()]
    assert visible == [0, 1, 2, 9, 10, 11, 12, 13, 14]
    text = _new_text(tiny_pipe, model)
    model.recache(text)
    # the oracle: one forward over all 15 frames at positions 0..14, block-causal, the evicted frames 3..8 masked
    # out as keys, K/V captured per layer (no cache, no slots, no RoPE runs)
    dit, tpf, n, F = model.dit, model.tokens_per_frame, x.shape[2], model.frames_per_block
    keep = torch.tensor([f in visible for f in range(n)]).repeat_interleave(tpf)
    mask = block_causal_mask(None, F, tpf, num_frames=n) & keep[None, :]
    mask |= torch.eye(n * tpf, dtype=torch.bool)  # the evicted rows attend to themselves (their output is unused)
    captured = {}

    def attend(layer, k, v):
        captured[layer] = (k, v)
        return k, v, mask

    cos, sin = dit.rope(0, n, x.shape[-2], x.shape[-1], x.device)
    dit.forward_with(x, dit.timestep_freqs(torch.zeros((1, n))), text.keys, text.values, cos, sin, attend)
    for layer, (k, v) in captured.items():
        for f in visible:
            want = torch.stack([k[:, :, f * tpf:(f + 1) * tpf], v[:, :, f * tpf:(f + 1) * tpf]])
            torch.testing.assert_close(_slot_kv(model.cache, layer, f, tpf), want.to(model.cache.buffer.dtype),
                                       rtol=1e-5, atol=1e-5)


def test_recache_needs_the_clean_frames_and_runs_between_blocks(tiny_pipe):
    model, _ = _target(tiny_pipe, keep_clean=False)
    _commit_blocks(model, 1)
    with pytest.raises(RuntimeError, match="clean latents of frames \\[0, 1, 2\\]"):
        model.recache(model.prompt_kv)


@pytest.mark.slow
def test_a_recaching_session_replays_bitwise_and_counts_its_forwards(tiny_pipe):
    kw = dict(scheduler="reference", seed=5, tau=-0.7, target_context="full", drafter_cache="full", window_frames=6,
              sink_frames=3)
    videos = {}
    for recache in (True, False):
        session = tiny_pipe.session("a red fox", num_blocks=7, recache=recache, **kw)
        blocks = []
        for b in session:
            blocks.append(b)
            if b.index == 1:
                session.update(prompt="an owl", interp_blocks=2)  # block 2 at weight 0, block 3 at 1: re-cache at 3
            if b.index == 4:
                session.update(prompt="a cat", interp_blocks=1)  # at once: re-cache at 5
        latents = torch.cat([b.latents for b in blocks], dim=2)
        counts = [b.live["recache_forwards"] for b in blocks]
        assert counts == ([0, 0, 0, 2, 0, 2, 0] if recache else [0] * 7)  # both roles, once per change
        assert session.stats.extra["recache_forwards"] == sum(counts)
        replay = tiny_pipe(prompt_schedule=[(0, "a red fox")] + session.stats.extra["updates"], num_blocks=7,
                           recache=recache, output_type="latent", **kw)
        assert torch.equal(torch.cat([b.latents for b in replay.blocks[0]], dim=2), latents)
        videos[recache] = latents
    assert torch.equal(videos[True][:, :, :9], videos[False][:, :, :9])  # the same until the first re-cache
    assert not torch.equal(videos[True], videos[False])
