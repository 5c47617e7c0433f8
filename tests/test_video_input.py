"""Video-to-video (docs/live.md, "Video-to-video"): the streaming VAE encoder against diffusers' whole-clip
encode, Krea's strength schedule, the input frames' fit and resampling, the first denoising input exactly
(1 - sigma) E(input) + sigma noise, strength 1.0 equal to text-to-video bitwise, both schedulers equal, and
live pushed frames equal to the same frames given as a clip."""
import threading

import numpy as np
import pytest
import torch

from sdvg.config import get_preset
from sdvg.generation.noise import block_noise
from sdvg.generation.role_model import RoleModel
from sdvg.generation.schedule import FlowSchedule, strength_steps
from sdvg.generation.video_input import ClipFrames, InputEnded, LiveFrames
from sdvg.io.video_input import VideoInputError, check_frames, fit_frames, read_video, resample_indices
from sdvg.live.updates import UpdateError
from sdvg.models.vae import build_vae
from sdvg.models.vae_encoder import StreamingVAEEncoder
from sdvg.options import GenerationOptions, OptionError

KW = dict(scheduler="reference", seed=5, tau=-0.7, num_blocks=3)


def _frames(n=40, h=50, w=70, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def enc():
    torch.manual_seed(0)
    return StreamingVAEEncoder(build_vae(get_preset("tiny").vae))


# ------------------------------------------------------------------ the encoder
def test_streaming_encoder_equals_the_whole_clip_encode(enc):
    clip = torch.rand(1, 3, 33, 64, 64) * 2 - 1
    cache = enc.new_cache()
    blocks = [enc.encode(clip[:, :, a:b], cache) for a, b in ((0, 9), (9, 21), (21, 33))]  # 9, then 12, 12
    assert [x.shape[2] for x in blocks] == [3, 3, 3]
    streamed, whole = torch.cat(blocks, dim=2), enc.encode_video(clip)
    assert streamed.shape == whole.shape == (1, 16, 9, 8, 8)
    torch.testing.assert_close(streamed, whole, rtol=0, atol=1e-5)  # fp32 rounding (the same chunks)


def test_streaming_encoder_refuses_chunks_that_are_not_the_clip_encodes(enc):
    cache = enc.new_cache()
    with pytest.raises(ValueError) as e:
        enc.encode(torch.zeros(1, 3, 8, 64, 64), cache)
    assert all(s in str(e.value) for s in ("1 + 4 k", "got 8")), e.value
    enc.encode(torch.zeros(1, 3, 9, 64, 64), cache)
    with pytest.raises(ValueError) as e:
        enc.encode(torch.zeros(1, 3, 9, 64, 64), cache)
    assert all(s in str(e.value) for s in ("multiple of 4", "got 9")), e.value
    with pytest.raises(ValueError, match=r"\[B, 3, T, H, W\]"):
        enc.encode(torch.zeros(3, 9, 64, 64), cache)


# ------------------------------------------------------------------ the schedule
@pytest.mark.parametrize("strength", [1.0, 0.9, 0.7, 0.6, 0.55, 0.3, 0.01])
def test_strength_steps_follow_kreas_get_denoising_schedule(strength):
    krea = torch.linspace(strength * 1000, 0, 5, dtype=torch.float32).to(torch.long).tolist()  # v2v.py, steps=5
    assert strength_steps((1000.0, 750.0, 500.0, 250.0, 0.0), strength) == tuple(map(float, krea))
    assert strength_steps((1000.0, 750.0, 500.0, 250.0), strength) == tuple(map(float, krea[:4]))  # Self-Forcing's
    drafter = FlowSchedule.from_steps(strength_steps((1000.0, 750.0, 500.0, 250.0), strength), 5.0)
    target = FlowSchedule.from_steps(strength_steps((1000.0, 750.0, 500.0, 250.0, 0.0), strength), 5.0)
    assert drafter.timesteps[0] == target.timesteps[0] and drafter.sigmas[0] == target.sigmas[0]  # one input


def test_strength_one_keeps_the_steps_and_a_non_uniform_list_is_refused():
    assert strength_steps((1000.0, 800.0, 300.0), 1.0) == (1000.0, 800.0, 300.0)
    with pytest.raises(ValueError, match="uniform grid from 1000 to 0"):
        strength_steps((1000.0, 800.0, 300.0), 0.6)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan"), float("inf"), "0.5", True])
def test_strength_outside_zero_one_is_refused(bad):
    with pytest.raises(OptionError, match="strength"):
        GenerationOptions(strength=bad)


# ------------------------------------------------------------------ the frames
def test_fit_frames_scales_to_cover_and_centre_crops():
    frame = np.zeros((1, 40, 80, 3), dtype=np.uint8)  # 1:2, fitted to 64x64: scaled to 64x128, crop x 32..96
    frame[0, :, 38:42] = 255  # a bar at the centre survives the crop, at the centre
    frame[0, :, :4] = 255  # the left edge is cropped away
    x = fit_frames(frame, 64, 64)
    assert x.shape == (1, 3, 64, 64) and x.dtype == torch.float32
    assert x[0, :, :, 30:34].mean() > 0.5 and x[0, :, :, :8].max() < -0.9
    same = fit_frames(np.full((2, 64, 64, 3), 255, dtype=np.uint8), 64, 64)
    assert torch.equal(same, torch.ones(2, 3, 64, 64))  # uint8 -> [-1, 1] as Krea's to_tensor().sub(.5).div(.5)


def test_resampling_takes_the_nearest_source_frame():
    assert resample_indices(5, 16, 16) == [0, 1, 2, 3, 4]
    assert resample_indices(4, 32, 16) == [0, 2, 4, 6]
    assert resample_indices(5, 8, 16) == [0, 1, 1, 2, 2]  # j / 2 rounded half up
    assert resample_indices(3, 30, 16) == [0, 2, 4]


def test_read_video_resamples_a_real_mp4(tmp_path):
    import imageio_ffmpeg

    path = tmp_path / "in.mp4"
    writer = imageio_ffmpeg.write_frames(str(path), (48, 32), fps=32, quality=None,
                                         output_params=["-crf", "0"], macro_block_size=1)
    writer.send(None)
    for i in range(40):  # frame i is flat grey 6 i: its value tells which frame came back
        writer.send(np.full((32, 48, 3), 6 * i, dtype=np.uint8).tobytes())
    writer.close()
    frames = read_video(path, 12, fps=16)
    assert frames.shape == (12, 32, 48, 3)
    with pytest.raises(VideoInputError) as e:
        read_video(path, 12, fps=16, max_bytes=12 * 32 * 48 * 3 - 1)  # refused before a frame is decoded
    assert all(s in str(e.value) for s in ("48x32", "12 of them", "smaller", "shorter")), e.value
    assert [round(float(f.mean()) / 6) for f in frames] == list(range(0, 24, 2))  # every other frame at 16 fps
    assert len(read_video(path, 100, fps=16)) == 20  # the clip ends first
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video at all")
    with pytest.raises(VideoInputError, match="cannot be read|failed to decode|no frame"):
        read_video(bad, 9, fps=16)
    with pytest.raises(VideoInputError, match="does not exist"):
        read_video(tmp_path / "missing.mp4", 9, fps=16)


@pytest.mark.parametrize("frames,match", [
    (np.zeros((2, 8, 8, 3), dtype=np.float32), "must be uint8"),
    (torch.zeros(2, 8, 8, 3), "float32 tensor"),
    (np.zeros((2, 3, 8, 8), dtype=np.uint8), r"\[N, H, W, 3\]"),
    (np.zeros((0, 8, 8, 3), dtype=np.uint8), "holds 0 frames"),
    (np.zeros((1, 1, 8, 3), dtype=np.uint8), "each side"),
    ([[1, 2, 3]], "got list"),
])
def test_bad_input_frames_are_named(frames, match):
    with pytest.raises(VideoInputError, match=match):
        check_frames(frames)


def test_live_frames_are_taken_in_order_and_a_wait_times_out():
    live = LiveFrames(16, 16)
    assert live.push(np.zeros((5, 16, 16, 3), dtype=np.uint8)) == 0
    assert live.push(np.full((4, 16, 16, 3), 255, dtype=np.uint8)) == 5
    x = live.take(9, timeout_s=1)
    assert x.shape == (9, 3, 16, 16) and x[:5].max() == -1 and x[5:].min() == 1
    with pytest.raises(InputEnded) as e:
        live.take(12, timeout_s=0.05)
    assert "0.05 s" in str(e.value)
    got = []
    t = threading.Thread(target=lambda: got.append(live.take(2, timeout_s=5)))
    t.start()
    live.push(np.zeros((2, 16, 16, 3), dtype=np.uint8))  # arrives while the block waits
    t.join(10)
    assert got and got[0].shape[0] == 2
    live.close()
    with pytest.raises(InputEnded, match="closed"):
        live.take(1, timeout_s=5)
    full = LiveFrames(16, 16, max_queued=12)
    full.push(np.zeros((12, 16, 16, 3), dtype=np.uint8))
    with pytest.raises(VideoInputError) as e:
        full.push(np.zeros((1, 16, 16, 3), dtype=np.uint8))
    assert "12 input frames" in str(e.value)
    dropping = LiveFrames(16, 16, max_queued=12, drop_oldest=True)
    dropping.push(np.zeros((10, 16, 16, 3), dtype=np.uint8))
    dropping.push(np.full((5, 16, 16, 3), 255, dtype=np.uint8))  # 3 oldest make room
    assert dropping.dropped == 3 and dropping.queued() == 12
    x = dropping.take(9)
    assert x[:7].max() == -1 and x[7:].min() == 1
    dropping.unread(9)  # given back, in order
    assert torch.equal(dropping.take(9), x)
    clip = ClipFrames(np.zeros((10, 16, 16, 3), dtype=np.uint8), 16, 16)
    clip.take(9)
    with pytest.raises(InputEnded) as e:
        clip.take(12)
    assert "10 frames" in str(e.value)


# ------------------------------------------------------------------ in the loop
def test_the_first_denoising_input_is_the_noised_encoded_input_exactly(tiny_pipe, monkeypatch):
    seen = []
    real = RoleModel.denoise

    def record(self, noise, block, frame0, seed, text_kv):
        seen.append((self.role, block, noise.clone(), self.schedule))
        return real(self, noise, block, frame0, seed, text_kv)

    monkeypatch.setattr(RoleModel, "denoise", record)
    frames = _frames()
    list(tiny_pipe.stream("a red fox", input_video=frames, strength=0.6, **{**KW, "num_blocks": 2,
                                                                            "tau": float("-inf")}))
    p = tiny_pipe.preset
    enc = StreamingVAEEncoder(tiny_pipe.components.vae.vae)
    cache = enc.new_cache()
    fitted = fit_frames(frames, p.video.height, p.video.width)
    inputs = {0: enc.encode(fitted[:9].permute(1, 0, 2, 3)[None], cache),
              1: enc.encode(fitted[9:21].permute(1, 0, 2, 3)[None], cache)}
    assert {"drafter", "target"} <= {role for role, *_ in seen} and {0, 1} <= {block for _, block, *_ in seen}
    for role, block, x, schedule in seen:
        sigma = schedule.sigmas[0]
        assert schedule.timesteps[0] == FlowSchedule.from_steps((600.0,), p.shift).timesteps[0]
        noise = block_noise(x.shape, 5, block)
        assert torch.equal(x, (1.0 - sigma) * inputs[block] + sigma * noise), (role, block)


@pytest.mark.slow
def test_strength_one_equals_text_to_video_bitwise_and_both_schedulers_agree(tiny_pipe):
    frames = _frames()
    t2v = tiny_pipe("a red fox", output_type="uint8", **KW)
    v1 = tiny_pipe("a red fox", input_video=frames, strength=1.0, output_type="uint8", **KW)
    assert torch.equal(t2v.latents, v1.latents) and torch.equal(t2v.frames, v1.frames)
    ref = tiny_pipe("a red fox", input_video=frames, strength=0.6, output_type="uint8", **KW)
    assert not torch.equal(ref.latents, t2v.latents)
    assert ref.stats[0].extra["input_video"] == {"source": "frames", "frames": 33, "height": 50, "width": 70}
    for run_ahead in (False, True):
        cpp = tiny_pipe("a red fox", input_video=frames, strength=0.6, output_type="uint8",
                        **{**KW, "scheduler": "cpp", "run_ahead": run_ahead})
        assert torch.equal(cpp.latents, ref.latents) and torch.equal(cpp.frames, ref.frames), run_ahead


def test_a_short_clip_and_strength_without_input_are_refused_before_any_work(tiny_pipe):
    with pytest.raises(VideoInputError) as e:
        tiny_pipe.stream("a red fox", input_video=_frames(20), **KW)
    assert all(s in str(e.value) for s in ("20 frames", "asks for 3", "num_blocks=1")), e.value
    with pytest.raises(OptionError, match="pass input_video="):
        tiny_pipe.stream("a red fox", strength=0.5, **KW)
    with pytest.raises(TypeError) as e:
        tiny_pipe.stream("a red fox", input_video=3, **KW)
    assert all(s in str(e.value) for s in ("input_video", "uint8")), e.value
    with pytest.raises(VideoInputError, match="holds no frame|holds 0 frames"):
        tiny_pipe.stream("a red fox", input_video=_frames(0), **KW)
    # the preset's default length shrinks to what the clip covers (Krea's min rule)
    stream = tiny_pipe.stream("a red fox", input_video=_frames(21), scheduler="reference")
    assert stream.stats.options.num_blocks == 2


@pytest.mark.slow
def test_live_pushed_frames_equal_the_same_clip_and_a_missing_block_ends_the_session(tiny_pipe):
    frames = _frames()
    clip = tiny_pipe("a red fox", input_video=frames[:33], strength=0.6, output_type="uint8", **KW)
    session = tiny_pipe.session("a red fox", input_frames=True, strength=0.6, input_timeout_s=20, **KW)
    assert session.update(input_frames=frames[:5]).block == 0
    ack = session.update(input_frames=frames[5:30])
    assert (ack.block, ack.index, ack.frames) == (0, -1, 25)  # its first frame is block 0's 6th
    with pytest.raises(UpdateError) as e:  # refused; nothing lost
        session.update(input_frames=frames[:3].astype(np.float32))
    assert "uint8" in str(e.value)
    blocks = []
    for b in session:
        blocks.append(b)
        if b.index == 0:
            assert session.update(input_frames=frames[30:33]).block == 2
    latents = torch.cat([b.latents for b in blocks], dim=2)
    assert torch.equal(latents, clip.latents)
    assert "input_ended" not in session.stats.extra
    late = tiny_pipe.session("a red fox", input_frames=True, strength=0.6, input_timeout_s=0.2, **KW)
    late.update(input_frames=frames[:9])
    got = list(late)
    assert [b.index for b in got] == [0]
    assert "did not arrive within 0.2 s" in late.stats.extra["input_ended"]
    with pytest.raises(RuntimeError, match="closed"):
        late.update(input_frames=frames[:9])
    text_only = tiny_pipe.session("a red fox", **KW)
    with pytest.raises(UpdateError, match="input_frames=True"):
        text_only.update(input_frames=frames[:9])
    text_only.close()


@pytest.mark.slow
def test_cli_generate_with_an_input_video(tmp_path):
    import json

    import imageio_ffmpeg

    from sdvg import cli

    src = tmp_path / "in.mp4"
    writer = imageio_ffmpeg.write_frames(str(src), (80, 48), fps=16, quality=None, output_params=["-crf", "0"],
                                         macro_block_size=1)
    writer.send(None)
    for frame in _frames(21, 48, 80):
        writer.send(frame.tobytes())
    writer.close()
    out = tmp_path / "v.mp4"
    argv = ["generate", "--preset", "tiny", "--prompt", "a red fox", "--quiet", "--scheduler", "reference",
            "--num-blocks", "2", "--out", str(out)]
    assert cli.main(argv + ["--input-video", str(src), "--strength", "0.6"]) == 0
    stats = json.loads(out.with_suffix(".json").read_text())
    assert stats["options"]["strength"] == 0.6
    assert stats["video"]["input_video"]["frames"] == 21 and out.stat().st_size > 0
    assert cli.main(argv + ["--strength", "0.6"]) == 2  # strength without an input: refused before loading
    assert cli.main(argv + ["--input-video", str(tmp_path / "missing.mp4")]) == 2


def test_a_refused_update_with_input_frames_queues_nothing(tiny_pipe):
    session = tiny_pipe.session("a red fox", input_frames=True, strength=0.6, **{**KW, "num_blocks": 2})
    frames = _frames(12)
    with pytest.raises(UpdateError, match="tau"):
        session.update(input_frames=frames, tau=float("nan"))
    assert session.queued_input_frames == 0 and session.updates == []
    ack = session.update(input_frames=frames[0])  # one frame [H, W, 3]
    assert ack.frames == 1 and session.queued_input_frames == 1
    session.close()
