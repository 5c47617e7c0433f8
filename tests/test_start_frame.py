"""A start frame (Krea's `start_frame`, sdvg/generation/start_frame.py): an image every role sees as clean
context before block 0.

Oracles: Krea's clip (the image repeated 1 + (kv - 1) * 4 times) encoded through diffusers' whole-clip encode;
Krea's recompute rule with the start latents as `resume_latents` (`krea_reference`, no KV cache); and for a
full context, a plain reference with no KV cache either: each model call one full-sequence forward over every
clean frame (start frames and committed blocks, block-causal at t = 0) followed by the noisy block."""
import dataclasses
import json

import numpy as np
import pytest
import torch

from sdvg.generation.native import generate_blocks_native
from sdvg.generation.noise import block_noise, gaussian
from sdvg.generation.reference import generate_blocks
from sdvg.generation.schedule import FlowSchedule, table_sigma
from sdvg.generation.start_frame import start_frame_image, start_frame_pixels, start_latents
from sdvg.options import GenerationOptions, OptionError
from test_context_modes import _context_mask, krea_reference

PROMPT = "a lighthouse on a cliff at dusk"


def _image(h=64, w=64, seed=3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def _krea_start_latents(comps, image: np.ndarray, kv: int) -> torch.Tensor:
    """Krea's `setup_start_frame`, plainly: to_tensor, * 2 - 1, stacked 1 + (kv - 1) * 4 times, encoded whole."""
    from sdvg.models.vae_encoder import StreamingVAEEncoder

    x = torch.from_numpy(image).permute(2, 0, 1).float() / 255.0 * 2.0 - 1.0  # [3, H, W]
    clip = torch.stack([x] * (1 + (kv - 1) * 4), dim=1)[None]  # [1, 3, T, H, W]
    return StreamingVAEEncoder(comps.vae.vae).encode_video(clip)


def full_reference(comps, prompt: str, num_blocks: int, seed: int, start: torch.Tensor) -> list[torch.Tensor]:
    """Target-only video under a full context after a start frame, with no KV cache: the start frames (one
    group, as their single commit forward), then every committed block (groups of 3), all clean at t = 0 and
    block-causal, then the noisy block at the preset's timesteps."""
    dit, p = comps.target, comps.preset
    F = p.video.frames_per_block
    lh, lw = p.video.latent_hw(p.vae)
    tpf = p.video.tokens_per_frame(p.vae, dit.config)
    text = dit.encode_text(comps.text_encoder.encode(prompt))
    steps = FlowSchedule.from_steps(p.timesteps, p.shift).timesteps  # the shifted table's (Self-Forcing's) calls
    sigmas = [table_sigma(t, p.shift) for t in steps]
    frames = list(start.split(1, dim=2))
    out = []
    for b in range(num_blocks):
        n = len(frames)
        mask = _context_mask(n, F, F, tpf)  # start.shape[2] == 3: the start frames are group 0
        x = block_noise((1, p.vae.z_dim, F, lh, lw), seed, b)
        for i, t in enumerate(steps):
            seq = torch.cat(frames + [x], dim=2)
            flow = dit(seq, torch.tensor([[0.0] * n + [t] * F]), text, frame_offset=0, attn_mask=mask)[:, :, n:]
            x0 = x.float() - sigmas[i] * flow.float()
            x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * gaussian(x.shape, seed, b, i + 1, "target") \
                if i + 1 < len(steps) else x0
        out.append(x)
        frames.extend(x.split(1, dim=2))
    return out


def test_start_latents_are_kreas_clip_encoded_whole(tiny_pipe):
    comps = tiny_pipe.components
    image = _image()
    got = start_latents(image, comps.vae.vae, comps.preset, 3)
    assert got.shape == (1, comps.preset.vae.z_dim, 3, 8, 8)
    torch.testing.assert_close(got, _krea_start_latents(comps, image, 3), rtol=1e-5, atol=1e-5)
    # another size is fitted as video input is (cover, centre-crop): a 2x larger image of the same pixels
    big = np.repeat(np.repeat(image, 2, axis=0), 2, axis=1)
    assert start_frame_pixels(big, 3, 64, 64).shape == (1, 3, 9, 64, 64)


@pytest.mark.slow
@pytest.mark.parametrize("keep_first_frame", [False, True])
def test_recompute_after_a_start_frame_equals_krea_reference(tiny_pipe, keep_first_frame):
    """Krea's `resume_latents` path: block 0 denoised after the kv start frames (position kv), the first context
    frame the start frame's until the window slides, then the re-encoded oldest emitted frame."""
    comps = tiny_pipe.components
    nb, kv = 5, 3
    opts = tiny_pipe.resolve(GenerationOptions(mode="target", num_blocks=nb, seed=5, target_context="recompute",
                                               kv_cache_frames=kv, keep_first_frame=keep_first_frame))
    start = start_latents(_image(), comps.vae.vae, comps.preset, kv)
    ref = krea_reference(comps, PROMPT, nb, kv, keep_first_frame, opts.seed, start=start)
    got = list(generate_blocks(comps, PROMPT, opts, start_latents=start))
    native = list(generate_blocks_native(comps, PROMPT, opts, start_latents=start))
    plain = list(generate_blocks(comps, PROMPT, opts))
    for b in range(nb):
        torch.testing.assert_close(got[b].latents, ref[b], rtol=1e-4, atol=1e-4, msg=f"block {b}")
        assert torch.equal(got[b].latents, native[b].latents), b
    assert not torch.allclose(got[0].latents, plain[0].latents, atol=1e-3)  # the start frame is seen


@pytest.mark.slow
def test_full_context_after_a_start_frame_equals_the_plain_reference(tiny_pipe):
    comps = tiny_pipe.components
    nb = 3
    opts = tiny_pipe.resolve(GenerationOptions(mode="target", num_blocks=nb, seed=5, target_context="full"))
    start = start_latents(_image(), comps.vae.vae, comps.preset, opts.kv_cache_frames)
    ref = full_reference(comps, PROMPT, nb, opts.seed, start)
    got = list(generate_blocks(comps, PROMPT, opts, start_latents=start))
    for b in range(nb):
        torch.testing.assert_close(got[b].latents, ref[b], rtol=1e-4, atol=1e-4, msg=f"block {b}")


@pytest.mark.slow
@pytest.mark.parametrize("contexts", [("full", "full"), ("full", "recompute")], ids=["full", "recompute-target"])
def test_sdvg_with_a_start_frame_native_run_ahead_equals_the_reference_loop(tiny_pipe, contexts):
    """Both roles start from the start frame; rejections under run-ahead roll the drafter back to prefix + 3 b
    (the C++ scheduler's `prefix_frames`): bitwise the reference loop's video."""
    drafter_cache, target_context = contexts
    image = _image()
    kw = dict(num_blocks=5, seed=5, router="pattern", pattern="0101", drafter_cache=drafter_cache,
              target_context=target_context, drafter_context="committed", start_frame=image)
    ref = list(tiny_pipe.stream(PROMPT, scheduler="reference", **kw))
    native = list(tiny_pipe.stream(PROMPT, scheduler="cpp", run_ahead=True, **kw))
    assert [b.decision for b in ref] == ["forced", "accepted", "rejected", "accepted", "rejected"]
    for a, b in zip(ref, native):
        assert torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames), a.index


@pytest.mark.slow
def test_a_live_reset_starts_again_from_the_start_frame(tiny_pipe):
    """Krea's reset makes a new generation with the same parameters, its start frame included: the blocks
    after a reset equal a fresh video with that start frame and the new seed."""
    image = _image()
    kw = dict(target_context="recompute", drafter_cache="full", window_frames=6, sink_frames=3, scheduler="reference")
    session = tiny_pipe.session(PROMPT, num_blocks=None, start_frame=image, seed=5, **kw)
    first = next(session)
    assert session.update(seed=9).block == 1
    after = [next(session) for _ in range(2)]
    stats = session.close()
    fresh = list(tiny_pipe.stream(PROMPT, num_blocks=2, start_frame=image, seed=9, **kw))
    for a, b in zip(after, fresh):
        assert torch.equal(a.frames, b.frames)
    again = list(tiny_pipe.stream(PROMPT, num_blocks=1, start_frame=image, seed=5, **kw))
    assert torch.equal(first.frames, again[0].frames)
    assert stats.extra["start_frame"] == {"height": 64, "width": 64, "latent_frames": 3}


def test_start_frame_is_checked_before_any_work(tiny_pipe, tmp_path):
    from PIL import Image

    from sdvg.io.video_input import VideoInputError

    with pytest.raises(OptionError, match="start_frame with cuda_graphs"):
        tiny_pipe.stream(PROMPT, num_blocks=1, start_frame=_image(), cuda_graphs=True)
    with pytest.raises(OptionError, match="start_frame with early_exit"):
        tiny_pipe.session(PROMPT, num_blocks=1, start_frame=_image(), early_exit="target")
    with pytest.raises(OptionError, match="must fit the drafter's attention window of 3 frames"):
        tiny_pipe.stream(PROMPT, num_blocks=2, start_frame=_image(), window_frames=3, sink_frames=0,
                         kv_cache_frames=4)
    with pytest.raises(VideoInputError, match=r"permute\(1, 2, 0\)"):
        start_frame_image(torch.zeros((3, 8, 8), dtype=torch.uint8))
    with pytest.raises(TypeError, match="start_frame must be an image file's path, a PIL image or uint8"):
        tiny_pipe.stream(PROMPT, num_blocks=1, start_frame=[1, 2, 3])
    with pytest.raises(VideoInputError, match="must be uint8"):
        start_frame_image(np.zeros((8, 8, 3), np.float32))
    with pytest.raises(VideoInputError, match=r"one RGB image, uint8 \[H, W, 3\]"):
        start_frame_image(np.zeros((2, 8, 8, 3), np.uint8))
    with pytest.raises(VideoInputError, match="does not exist or is not a file"):
        start_frame_image(tmp_path / "missing.png")
    (tmp_path / "bad.png").write_bytes(b"GIF89a" + b"\x00" * 32)
    with pytest.raises(VideoInputError, match="not a readable JPEG, PNG or WebP"):
        start_frame_image(tmp_path / "bad.png")
    image = _image()
    Image.fromarray(image).save(tmp_path / "start.png")
    assert np.array_equal(start_frame_image(tmp_path / "start.png"), image)
    assert np.array_equal(start_frame_image(Image.fromarray(image)), image)
    stream = tiny_pipe.stream(PROMPT, num_blocks=1, start_frame=tmp_path / "start.png")
    blocks = list(stream)
    from test_stats_schema import _check

    _check(json.loads(stream.stats.to_json()))  # docs/stats.md's fields, `start_frame` among them
    assert stream.stats.extra["start_frame"] == {"source": str(tmp_path / "start.png"), "height": 64, "width": 64,
                                                 "latent_frames": 3}
    same = list(tiny_pipe.stream(PROMPT, num_blocks=1, start_frame=torch.from_numpy(image)))
    assert torch.equal(blocks[0].frames, same[0].frames)
    out = tiny_pipe(PROMPT, num_blocks=1, start_frame=tmp_path / "start.png", output_type="uint8")  # diffusers' call
    assert torch.equal(out.frames[0], blocks[0].frames)
    assert out.stats[0].extra["start_frame"]["source"] == str(tmp_path / "start.png")


def test_a_batch_encodes_its_start_frame_once(tiny_pipe, monkeypatch):
    """`pipe(...)` checks the start frame before its first video and every video starts from it: the image is
    encoded once (kept by its bytes, kv_cache_frames and the VAE's device and dtype); another image, or another
    kv_cache_frames, is encoded afresh; each run gets its own copy of the latents."""
    import sdvg.generation.start_frame as start_frame

    calls = []
    encode = start_frame.start_latents
    monkeypatch.setattr(start_frame, "start_latents", lambda *a: calls.append(a[3]) or encode(*a))
    image = _image(seed=1206)  # an image no other test encodes: the memo of the shared pipeline cannot hold it yet
    out = tiny_pipe([PROMPT, PROMPT], num_blocks=1, start_frame=image, output_type="uint8", seed=3)
    assert calls == [3]
    alone = tiny_pipe(PROMPT, num_blocks=1, start_frame=image.copy(), output_type="uint8", seed=4)
    assert calls == [3] and torch.equal(out.frames[1], alone.frames[0])  # video 1 has seed 3 + 1
    opts = GenerationOptions(num_blocks=1)
    a, b = tiny_pipe.start_latents(image, opts), tiny_pipe.start_latents(image, opts)
    assert a is not b and torch.equal(a, b) and calls == [3]
    other = image.copy()
    other[0, 0, 0] ^= 1
    tiny_pipe.start_latents(other, opts)
    tiny_pipe.start_latents(other, GenerationOptions(num_blocks=1, kv_cache_frames=2))
    assert calls == [3, 3, 2]


@pytest.mark.slow
def test_cli_generate_with_a_start_frame(tmp_path, capsys):
    from PIL import Image

    from sdvg import cli

    Image.fromarray(_image()).save(tmp_path / "start.png")
    out = tmp_path / "v.mp4"
    argv = ["generate", "--preset", "tiny", "--prompt", PROMPT, "--num-blocks", "1", "--out", str(out), "--quiet"]
    assert cli.main(argv + ["--start-frame", str(tmp_path / "start.png")]) == 0
    stats = json.loads(out.with_suffix(".json").read_text())
    assert stats["video"]["start_frame"]["latent_frames"] == 3
    assert stats["video"]["start_frame"]["source"].endswith("start.png")
    capsys.readouterr()
    assert cli.main(argv + ["--start-frame", str(tmp_path / "nope.png")]) == 2  # refused before loading
    assert "--start-frame" in capsys.readouterr().err
    assert cli.main(argv + ["--start-frame", str(tmp_path / "start.png"), "--cuda-graphs"]) == 2
    assert "--start-frame with --cuda-graphs" in capsys.readouterr().err  # in the command line's words


@pytest.mark.parametrize("kv", [2, 3])
def test_a_recache_after_a_start_frame_rewrites_the_same_keys_and_values(tiny_pipe, kv):
    """A live switch's re-cache recomputes every visible frame in one forward, block-causal: the start frame's kv
    frames are one group (its one commit forward), then each block's 3 (at kv + 3 b). Under unchanged conditioning
    it rewrites the K/V the incremental forwards wrote (before, frames were grouped by f // 3 from 0: with kv = 2 a
    start frame attended to block 0's first frame and the K/V moved by 0.3)."""
    from sdvg.generation.noise import block_noise
    from sdvg.generation.prepare import prepare
    from sdvg.generation.types import Counters

    comps = tiny_pipe.components
    opts = tiny_pipe.resolve(GenerationOptions(mode="target", num_blocks=3, seed=5, target_context="full",
                                               kv_cache_frames=kv))
    start = start_latents(_image(), comps.vae.vae, comps.preset, kv)
    setup = prepare(comps, PROMPT, opts, Counters(), start_latents=start, keep_clean=True)
    target = setup.target
    text_kv = setup.text_kv[setup.conditioning.key, "target"]
    for b in range(2):
        x = target.denoise(block_noise(setup.block_shape, 5, b), b, target.frame_of(b), 5, text_kv)
        target.commit_forward(x, target.frame_of(b), text_kv)
        target.cache.commit()
    assert target.committed_frames == kv + 6
    before = target.cache.buffer.clone()
    target.recache(text_kv)
    torch.testing.assert_close(target.cache.buffer, before, rtol=1e-4, atol=1e-4)


def test_a_full_cache_holds_the_start_frames_too(tiny_pipe):
    from sdvg.config import RoleContext
    from sdvg.models.kv_cache import KVCacheSpec

    comps = tiny_pipe.components
    full = KVCacheSpec.for_context(comps.preset, comps.target.config, RoleContext("full"), 4, prefix_frames=3)
    assert full.max_frames == 4 * 3 + 3
    rec = KVCacheSpec.for_context(comps.preset, comps.target.config, RoleContext("recompute", 3), 4, prefix_frames=3)
    assert rec.max_frames == 3 + 3  # the start frames are the first context: no more room
    dataclasses.asdict(full)  # a plain spec
