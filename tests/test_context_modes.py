"""The target's context modes and the drafter's policy (docs/method.md, "Context modes").

`krea_reference` below is Krea Realtime Video's per-block rule written out plainly, from its
description (release_server.py: get_clean_context_frames, recompute_kv_cache, generate_block_internal),
with no KV cache at all: each model call is one full-sequence forward over the clean context frames
(t = 0, block-causal among them, positions from 0) followed by the noisy block (attending to every
context frame and to itself). The `recompute` mode, which rebuilds a KV cache once per block and
then denoises against it, must equal it block by block."""
import dataclasses
import math
from collections import deque

import pytest
import torch

from sdvg.generation.native import generate_blocks_native
from sdvg.generation.noise import block_noise, gaussian
from sdvg.generation.reference import generate_blocks
from sdvg.generation.schedule import table_sigma
from sdvg.options import GenerationOptions

PROMPT = "a lighthouse on a cliff at dusk"
KREA_TIMESTEPS = (1000.0, 937.5, 833.3333129882812, 625.0, 0.0)  # the shift-5 table at steps 1000/750/500/250/0


@pytest.fixture(scope="module")
def long_pipe():
    """The tiny preset (real Wan/diffusers classes, random weights) with room for 12 blocks."""
    from sdvg import SpeculativeVideoPipeline
    from sdvg.config import get_preset

    tiny = get_preset("tiny")
    preset = dataclasses.replace(tiny, name="tiny-12", video=dataclasses.replace(tiny.video, num_blocks=12))
    return SpeculativeVideoPipeline.from_preset(preset, seed=0)


def _context_mask(n_ctx: int, n_block: int, frames_per_block: int, tpf: int) -> torch.Tensor:
    """[S, S] bool: context frames block-causal among themselves in groups of frames_per_block from
    position 0; the block's frames see every context frame and each other."""
    pos = torch.arange(n_ctx + n_block)
    group = torch.where(pos < n_ctx, pos // frames_per_block, 10**6)
    allowed = group[None, :] <= group[:, None]
    return allowed.repeat_interleave(tpf, 0).repeat_interleave(tpf, 1)


def krea_reference(comps, prompt: str, num_blocks: int, kv_frames: int, keep_first_frame: bool, seed: int,
                   start: torch.Tensor | None = None):
    """Target-only video under Krea's rule -> the emitted latents of each block. `start`: a start frame's clean
    latents [1, C, kv, h, w], Krea's `resume_latents`: latent frames 0 .. kv - 1 before block 0."""
    dit, vae, p = comps.target, comps.vae, comps.preset
    F = p.video.frames_per_block
    lh, lw = p.video.latent_hw(p.vae)
    tpf = p.video.tokens_per_frame(p.vae, dit.config)
    text = dit.encode_text(comps.text_encoder.encode(prompt))
    sigmas = [table_sigma(t, p.shift) for t in KREA_TIMESTEPS]
    frames: list[torch.Tensor] = [] if start is None else list(start.split(1, dim=2))  # [1, C, 1, h, w] each
    pixels: deque = deque(maxlen=1 + (kv_frames - 1) * 4)  # Krea's frame_context_cache
    vae_cache = vae.new_cache()
    out = []
    for b in range(num_blocks):
        if not frames:  # block 0 without a start frame
            context = []
        else:  # Krea's all_latents[:, :current_start_frame]: frame 0, then the last kv - 1 after it
            earlier = frames[1:][-(kv_frames - 1):] if kv_frames > 1 else []
            if keep_first_frame or (b - 1) * F < kv_frames:
                context = [frames[0]] + earlier
            else:
                context = [vae.encode_frame(pixels[0])] + earlier
        n = len(context)
        mask = _context_mask(n, F, F, tpf)
        x = block_noise((1, p.vae.z_dim, F, lh, lw), seed, b)
        for i, t in enumerate(KREA_TIMESTEPS):
            seq = torch.cat(context + [x], dim=2) if context else x
            steps = torch.tensor([[0.0] * n + [t] * F])
            flow = dit(seq, steps, text, frame_offset=0, attn_mask=mask)[:, :, n:]
            x0 = x.float() - sigmas[i] * flow.float()
            if i + 1 < len(KREA_TIMESTEPS):
                eps = gaussian(x.shape, seed, b, i + 1, "target")
                x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * eps
            else:
                x = x0
        out.append(x)
        frames.extend(x.split(1, dim=2))
        pixels.extend(vae.decode(x, vae_cache).split(1, dim=2))
    return out


def _opts(**kw) -> GenerationOptions:
    return GenerationOptions(**{"seed": 5, **kw})


@pytest.mark.slow
@pytest.mark.parametrize("kv_frames", [3, 6])
@pytest.mark.parametrize("keep_first_frame", [False, True])
def test_recompute_equals_krea_reference(long_pipe, kv_frames, keep_first_frame):
    nb = 8  # the window slides from block 2 (kv 3) or 3 (kv 6): 5-6 blocks past it
    opts = long_pipe.resolve(_opts(mode="target", num_blocks=nb, target_context="recompute",
                                   kv_cache_frames=kv_frames, keep_first_frame=keep_first_frame))
    ref = krea_reference(long_pipe.components, PROMPT, nb, kv_frames, keep_first_frame, opts.seed)
    got = list(generate_blocks(long_pipe.components, PROMPT, opts))
    native = list(generate_blocks_native(long_pipe.components, PROMPT, opts))
    for b in range(nb):
        torch.testing.assert_close(got[b].latents, ref[b], rtol=1e-4, atol=1e-4, msg=f"block {b}")
        assert torch.equal(got[b].latents, native[b].latents), b
    # the re-encoded first frame matters: keeping latent frame 0 gives another block once the window slides
    if not keep_first_frame:
        slide = kv_frames // 3 + 1  # the first block b with (b - 1) * 3 >= kv_cache_frames
        kept = krea_reference(long_pipe.components, PROMPT, slide + 1, kv_frames, True, opts.seed)
        torch.testing.assert_close(kept[slide - 1], ref[slide - 1])
        assert not torch.allclose(kept[slide], ref[slide], atol=1e-4)


@pytest.mark.slow
def test_recompute_equals_full_history_before_the_window_slides(long_pipe):
    """Blocks with 3b <= kv_cache_frames see every earlier frame under recompute: the full mode run with
    the same (five-call) schedule gives them to float rounding."""
    from sdvg import SpeculativeVideoPipeline

    comps = long_pipe.components
    five = dataclasses.replace(comps.preset, timesteps=comps.preset.recompute_timesteps)
    pipe5 = SpeculativeVideoPipeline(dataclasses.replace(comps, preset=five))
    nb, kv = 4, 6
    rec = list(generate_blocks(pipe5.components, PROMPT, pipe5.resolve(
        _opts(mode="target", num_blocks=nb, target_context="recompute", kv_cache_frames=kv))))
    full = list(generate_blocks(pipe5.components, PROMPT, pipe5.resolve(
        _opts(mode="target", num_blocks=nb, target_context="full"))))
    for b in range(nb):
        if 3 * b <= kv:
            torch.testing.assert_close(rec[b].latents, full[b].latents, rtol=1e-4, atol=1e-4, msg=f"block {b}")
    assert not torch.allclose(rec[3].latents, full[3].latents, atol=1e-4)  # the window slid at block 3


def _latents(blocks):
    return [b.latents for b in blocks]


def _bitwise(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.decision == y.decision, i
        assert torch.equal(x.latents, y.latents), i
        assert torch.equal(x.frames, y.frames), i


@pytest.mark.parametrize("target_context,policy", [  # the fast tier keeps one context pair
    ("recompute", "committed"),
    pytest.param("recompute", "own", marks=pytest.mark.slow),
    pytest.param("full", "own", marks=pytest.mark.slow),
    pytest.param("full", "committed", marks=pytest.mark.slow)])
def test_native_equals_reference_in_every_context(tiny_pipe, policy, target_context):
    opts = tiny_pipe.resolve(_opts(num_blocks=4, router="pattern", pattern="0110", drafter_context=policy,
                                   target_context=target_context, kv_cache_frames=3))
    ref = list(generate_blocks(tiny_pipe.components, PROMPT, opts))
    for run_ahead in (False, True):
        got = list(generate_blocks_native(tiny_pipe.components, PROMPT, opts.replace(run_ahead=run_ahead)))
        _bitwise(ref, got)


@pytest.mark.slow
def test_recompute_extremes_equal_single_model_runs(tiny_pipe):
    kw = dict(num_blocks=4, target_context="recompute", kv_cache_frames=3)
    target_only = list(generate_blocks(tiny_pipe.components, PROMPT, tiny_pipe.resolve(_opts(mode="target", **kw))))
    never = list(generate_blocks(tiny_pipe.components, PROMPT, tiny_pipe.resolve(_opts(tau=math.inf, **kw))))
    assert [b.decision for b in never] == ["forced"] + ["rejected"] * 3
    for a, b in zip(target_only, never):
        assert torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames)
    always = list(generate_blocks(tiny_pipe.components, PROMPT, tiny_pipe.resolve(_opts(tau=-math.inf, **kw))))
    draft_only = list(generate_blocks(tiny_pipe.components, PROMPT, tiny_pipe.resolve(_opts(mode="draft", **kw))))
    assert [b.decision for b in always] == ["forced"] + ["accepted"] * 3
    assert torch.equal(always[0].latents, target_only[0].latents)
    for a, b in zip(always[1:], draft_only[1:]):  # under `own` the drafter never sees the target's block 0
        assert torch.equal(a.latents, b.latents)


@pytest.mark.slow
def test_own_drafts_do_not_depend_on_tau(tiny_pipe):
    drafts = []
    for tau in (-math.inf, -0.1, 0.0, math.inf):
        blocks = tiny_pipe(PROMPT, num_blocks=4, seed=5, tau=tau, output_type="latent").blocks[0]
        drafts.append([b.draft_latents for b in blocks])
        assert all(d is not None for d in drafts[-1])  # block 0 is drafted too
    for other in drafts[1:]:
        assert all(torch.equal(a, b) for a, b in zip(drafts[0], other))


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_multi_block_run_ahead_gives_the_sequential_video(tiny_pipe, ahead):
    opts = tiny_pipe.resolve(_opts(num_blocks=5, tau=-0.05))
    seq = list(generate_blocks_native(tiny_pipe.components, PROMPT, opts))
    got = list(generate_blocks_native(tiny_pipe.components, PROMPT,
                                      opts.replace(run_ahead=True, run_ahead_blocks=ahead)))
    _bitwise(seq, got)


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_run_ahead_queue_is_bounded(ahead):
    """Under `own` the drafter never waits for a decision, only for room in its queue: with a slow target
    it runs exactly `run_ahead_blocks` drafts beyond the block being decided."""
    from sdvg.generation.fake_stages import FakeStages, fake_scheduler

    stages = FakeStages(costs={"target": 0.03, "decode": 0.03})  # decode: the window after a draft is taken
    sched = fake_scheduler(stages, GenerationOptions(num_blocks=8, tau=0.0, run_ahead=True, run_ahead_blocks=ahead,
                                                     router="pattern", pattern="0"))
    sched.run()
    leads = []
    for i, (stage, block) in enumerate(stages.calls):
        if stage == "draft":
            scored = sum(1 for s, _ in stages.calls[:i] if s == "score")  # drafts the main thread has taken
            leads.append(block - scored)
    assert max(leads) == ahead


@pytest.mark.slow
def test_recompute_costs_and_counts(tiny_pipe):
    """Under recompute the target's commits cost nothing and each denoise past block 0 makes one context
    forward; both schedulers count the same."""
    opts = tiny_pipe.resolve(_opts(num_blocks=4, router="pattern", pattern="0110", target_context="recompute"))
    from sdvg.generation.types import LoopReport

    r_ref, r_cpp = LoopReport(), LoopReport()
    list(generate_blocks(tiny_pipe.components, PROMPT, opts, r_ref))
    list(generate_blocks_native(tiny_pipe.components, PROMPT, opts, r_cpp))
    # target runs blocks 0 (forced), 1 and 2 (rejected; pattern 0110 cycles from block 0): 5 + 6 + 6 calls
    decisions = ["forced", "accepted", "accepted", "rejected"]
    target_blocks = [b for b, d in enumerate(decisions) if d != "accepted"]
    assert r_ref.counters.target_forwards == sum(5 + (b > 0) for b in target_blocks)
    assert r_cpp.counters.target_forwards == r_ref.counters.target_forwards
    assert r_ref.target_cache.committed_frames <= 3 + 3  # never more than the context


def test_encode_frame_is_the_vae_posterior_mean(tiny_pipe):
    vae = tiny_pipe.components.vae
    pixels = torch.rand(1, 3, 1, 64, 64) * 2 - 1
    z = vae.encode_frame(pixels)
    assert z.shape == (1, tiny_pipe.preset.vae.z_dim, 1, 8, 8)
    dist = vae.vae.encode(pixels).latent_dist
    mean, std = vae.latent_stats()
    torch.testing.assert_close(z * std + mean, dist.mean, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one pixel frame"):
        vae.encode_frame(torch.zeros(1, 3, 2, 64, 64))


def test_one_group_context_forward_takes_no_mask(dit, text):
    """A recompute context of one group of frames is attended without a mask (no [N, N] host mask per
    context forward; SDPA's unmasked kernels): bitwise the all-true mask's result on the CPU."""
    from sdvg.generation.role_model import context_mask
    from sdvg.models.dit import block_causal_mask
    from sdvg.models.kv_cache import KVCacheSpec

    tpf, fpb = 16, 3
    spec = KVCacheSpec.for_dit(dit.config, tpf, 6)
    x = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    t = torch.zeros(1, 3)
    for n in (1, 3):
        assert context_mask(n, fpb, tpf, "cpu") is None
        masked, unmasked = spec.allocate(dit.dtype, "cpu"), spec.allocate(dit.dtype, "cpu")
        all_true = block_causal_mask(None, fpb, tpf, num_frames=n)
        assert bool(all_true.all())
        a = dit(x[:, :, :n], t[:, :n], text, 0, masked, attn_mask=all_true)
        b = dit(x[:, :, :n], t[:, :n], text, 0, unmasked)
        assert torch.equal(a, b) and torch.equal(masked.buffer, unmasked.buffer)
    many = context_mask(4, fpb, tpf, "cpu")
    assert torch.equal(many, block_causal_mask(None, fpb, tpf, num_frames=4)) and not bool(many.all())
    assert context_mask(4, fpb, tpf, "cpu") is many  # kept, not rebuilt per forward
