"""The diffusers call surface: batched outputs (sdvg/io/video_batch.py), prompt lists, num_videos_per_prompt,
generators, output_type, return_dict, callback and interrupt, progress bar, torch_dtype, .to(), the component
attributes, CPU offload of the text encoder, and interchange with diffusers' export_to_video."""
import numpy as np
import pytest
import torch

PROMPT = "a red fox running through fresh snow"
KW = dict(num_blocks=2, tau=-0.1, seed=3)


@pytest.mark.slow
def test_prompt_list_gives_each_prompt_its_own_video(tiny_pipe):
    prompts = [PROMPT, "a blue whale"]
    out = tiny_pipe(prompts, output_type="uint8", **KW)
    assert out.frames.shape[0] == out.latents.shape[0] == len(out.stats) == len(out.blocks) == 2
    for i, (p, frames, latents, stats) in enumerate(zip(prompts, out.frames, out.latents, out.stats)):
        alone = tiny_pipe(p, output_type="uint8", **{**KW, "seed": KW["seed"] + i})  # video i has seed + i
        assert torch.equal(frames, alone.frames[0]) and torch.equal(latents, alone.latents[0])
        assert stats["video"]["prompt"] == p and stats["options"]["seed"] == KW["seed"] + i
        assert [b.index for b in out.blocks[i]] == [0, 1]
    assert not torch.equal(out.frames[0], out.frames[1])


@pytest.mark.slow
def test_videos_per_prompt_are_distinct_and_prompt_major(tiny_pipe):
    out = tiny_pipe(["a cat", "a dog"], num_videos_per_prompt=2, output_type="latent", num_blocks=1, seed=7)
    assert out.frames.shape[0] == 4 and out.frames is out.latents
    assert [s["video"]["prompt"] for s in out.stats] == ["a cat", "a cat", "a dog", "a dog"]  # as diffusers repeats
    assert [s["options"]["seed"] for s in out.stats] == [7, 8, 9, 10]
    assert not torch.equal(out.latents[0], out.latents[1])  # the same prompt, distinct seeds
    assert torch.equal(out.latents[3], tiny_pipe("a dog", num_blocks=1, seed=10, output_type="latent").latents[0])


@pytest.mark.slow
def test_output_types_agree(tiny_pipe):
    u8 = tiny_pipe(PROMPT, output_type="uint8", **KW)
    assert u8.frames.dtype == torch.uint8 and u8.frames.shape == (1, 21, 64, 64, 3)  # one prompt: a batch of one
    np_out = tiny_pipe(PROMPT, **KW)  # np is the default
    assert isinstance(np_out.frames, np.ndarray) and np_out.frames.dtype == np.float32
    assert np_out.frames.shape == tuple(u8.frames.shape) and 0.0 <= np_out.frames.min() <= np_out.frames.max() <= 1.0
    assert np.array_equal((np_out.frames * 255).astype(np.uint8), u8.frames.numpy())  # diffusers' conversion
    pt = tiny_pipe(PROMPT, output_type="pt", **KW).frames
    assert pt.shape == (1, 21, 3, 64, 64) and pt.dtype == torch.float32
    assert torch.equal(pt.permute(0, 1, 3, 4, 2), torch.from_numpy(np_out.frames))
    pil = tiny_pipe(PROMPT, output_type="pil", **KW).frames
    assert isinstance(pil, list) and len(pil) == 1 and isinstance(pil[0], list) and len(pil[0]) == 21
    assert np.array_equal(np.asarray(pil[0][5]), u8.frames[0, 5].numpy())
    lat = tiny_pipe(PROMPT, output_type="latent", **KW)
    assert torch.equal(lat.frames, u8.latents) and lat.frames.shape == (1, 16, 6, 8, 8)
    (frames,) = tiny_pipe(PROMPT, return_dict=False, **KW)
    assert np.array_equal(frames, np_out.frames)


def test_one_prompt_extras_read_as_before_and_batches_name_the_index(tiny_pipe):
    one = tiny_pipe(PROMPT, output_type="latent", **KW)
    assert one.stats["options"]["seed"] == one.stats[0]["options"]["seed"] == KW["seed"]
    assert one.stats.to_json() == one.stats[0].to_json()
    two = tiny_pipe(PROMPT, num_videos_per_prompt=2, output_type="latent", num_blocks=1)
    with pytest.raises(TypeError) as e:
        two.stats["options"]["seed"]
    assert all(s in str(e.value) for s in ("a batch of 2", "out.stats[i]['options']")), e.value


@pytest.mark.slow
def test_generator_draws_the_seed(tiny_pipe):
    a = tiny_pipe(PROMPT, generator=torch.Generator().manual_seed(42), num_blocks=2)
    b = tiny_pipe(PROMPT, generator=torch.Generator().manual_seed(42), num_blocks=2)
    seed = a.stats[0]["options"]["seed"]
    assert np.array_equal(a.frames, b.frames) and b.stats[0]["options"]["seed"] == seed
    c = tiny_pipe(PROMPT, seed=seed, num_blocks=2)
    assert np.array_equal(a.frames, c.frames)  # the recorded seed reproduces the video
    g = torch.Generator().manual_seed(42)
    first, second = tiny_pipe(PROMPT, generator=g, num_blocks=1), tiny_pipe(PROMPT, generator=g, num_blocks=1)
    # the generator's state moves on, as in diffusers
    assert first.stats[0]["options"]["seed"] != second.stats[0]["options"]["seed"]


def test_a_list_of_generators_gives_each_video_its_own(tiny_pipe):
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    out = tiny_pipe(PROMPT, num_videos_per_prompt=2, generator=gens, num_blocks=1, output_type="latent")
    expected = [int(torch.randint(0, 2**63 - 1, (), generator=torch.Generator().manual_seed(s))) for s in (1, 2)]
    assert [s["options"]["seed"] for s in out.stats] == expected


def test_callback_sees_every_block_in_order(tiny_pipe):
    seen = []
    out = tiny_pipe(PROMPT, callback_on_block_end=lambda pipe, block: seen.append((pipe, block.index)), **KW)
    assert [i for _, i in seen] == [0, 1] and all(p is tiny_pipe for p, _ in seen)
    assert len(out.blocks) == 1 and len(out.blocks[0]) == 2


@pytest.mark.slow
def test_interrupt_from_a_callback_stops_after_that_block(tiny_pipe):
    def stop_after_block_1(pipe, block):
        if block.index == 1:
            pipe.interrupt = True

    out = tiny_pipe([PROMPT, "a blue whale"], num_blocks=3, callback_on_block_end=stop_after_block_1,
                    output_type="uint8", seed=3)
    assert len(out.stats) == 1 and out.stats[0].interrupted and len(out.blocks[0]) == 2  # the whale never starts
    assert out.frames.shape == (1, 21, 64, 64, 3)
    assert tiny_pipe.interrupt  # still set after the call, as in diffusers ...
    full = tiny_pipe(PROMPT, num_blocks=3, seed=3, output_type="uint8")  # ... and reset by the next call
    assert not tiny_pipe.interrupt and not full.stats.interrupted and len(full.blocks[0]) == 3
    assert torch.equal(out.frames[0], full.frames[0, :21])

    def diffusers_style(pipe, block):
        pipe._interrupt = True  # what diffusers' docs tell callbacks to set

    assert len(tiny_pipe(PROMPT, num_blocks=3, callback_on_block_end=diffusers_style).blocks[0]) == 1


@pytest.mark.slow
def test_export_to_video_writes_the_first_video(tiny_pipe, tmp_path):
    """The diffusers idiom `export_to_video(pipe(p).frames[0], path)`: the right frame count and size, and the
    pixels of sdvg's own MP4 of the same frames within codec tolerance."""
    from diffusers.utils import export_to_video

    from sdvg.io.video_writer import IncrementalMP4Writer

    out = tiny_pipe(PROMPT, output_type="np", **KW)
    theirs = export_to_video(out.frames[0], str(tmp_path / "d.mp4"), fps=16, quality=8)  # = crf 10, sdvg's default
    u8 = tiny_pipe(PROMPT, output_type="uint8", **KW).frames[0]
    with IncrementalMP4Writer(tmp_path / "s.mp4") as w:
        w.write(u8)
    a, b = _read(theirs), _read(tmp_path / "s.mp4")
    assert a.shape == b.shape == (21, 64, 64, 3) == tuple(u8.shape)  # frames, height, width, RGB
    a, b, src = a.astype(np.float32), b.astype(np.float32), u8.numpy().astype(np.float32)
    # both are lossy H.264 of the same frames, sdvg's converted with BT.709 and tagged so, diffusers' (imageio's)
    # with BT.601 untagged: each decoded by its own matrix is as close to the source (random-weight noise, hard
    # to code) as the other, and they agree within a few levels
    err_theirs, err_ours = np.abs(a - src).mean(), np.abs(b - src).mean()
    assert err_theirs < 12.0 and err_ours < 12.0 and err_ours <= err_theirs + 1.0, (err_theirs, err_ours)
    assert np.abs(a - b).mean() < 5.0


def _read(path) -> np.ndarray:
    """Every frame of an MP4 as uint8 [F, H, W, 3], read back through imageio's ffmpeg plugin (imageio-ffmpeg's
    own binary; no ffprobe needed)."""
    from sdvg.io.video_writer import read_mp4_frames

    return read_mp4_frames(path)


def test_torch_dtype_and_to():
    from sdvg import SpeculativeVideoPipeline

    pipe = SpeculativeVideoPipeline.from_preset("tiny", torch_dtype=torch.bfloat16)
    assert pipe.preset.precision == "bf16" and pipe.components.target.dtype == torch.bfloat16
    assert pipe.to("cpu") is pipe and pipe.components.target_device == torch.device("cpu")
    with pytest.raises(ValueError, match="torch_dtype"):
        SpeculativeVideoPipeline.from_preset("tiny", torch_dtype=torch.int8)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            pipe.to("cuda")


def _dtypes(pipe) -> dict:
    return {"drafter": pipe.drafter.dtype, "target": pipe.target.dtype, "vae": pipe.vae.dtype,
            "text_encoder": next(pipe.text_encoder.model.parameters()).dtype, "reward": pipe.reward.dtype,
            "fp32 parts": pipe.target.model.blocks[0].scale_shift_table.dtype}


@pytest.mark.slow
def test_to_dtype_casts_as_torch_dtype_builds_and_components_are_attributes():
    from sdvg import SpeculativeVideoPipeline

    pipe = SpeculativeVideoPipeline.from_preset("tiny")
    c = pipe.components
    assert (pipe.drafter, pipe.target, pipe.vae, pipe.text_encoder, pipe.reward) == (
        c.drafter, c.target, c.vae, c.text_encoder, c.scorer)
    assert pipe.device == torch.device("cpu") and pipe.dtype == torch.float32
    assert pipe.to(torch.bfloat16) is pipe and pipe.dtype == torch.bfloat16 and pipe.preset.precision == "bf16"
    built = SpeculativeVideoPipeline.from_preset("tiny", torch_dtype=torch.bfloat16)
    assert _dtypes(pipe) == _dtypes(built)
    out = pipe(PROMPT, num_blocks=1, output_type="latent")
    assert out.stats["run"]["precision"] == "bf16" and torch.isfinite(out.latents).all()
    pipe.to("cpu", torch.float32)
    assert _dtypes(pipe) == _dtypes(SpeculativeVideoPipeline.from_preset("tiny"))
    with pytest.raises(ValueError, match="torch_dtype"):
        pipe.to(torch.int8)
    with pytest.raises(TypeError) as e:
        pipe.to(3.5)
    assert all(s in str(e.value) for s in ("a device", "torch dtype")), e.value
    with pytest.raises(TypeError, match="two dtypes"):
        pipe.to(torch.float16, torch.bfloat16)


@pytest.mark.slow
def test_progress_bar_counts_blocks_and_can_be_disabled(tiny_pipe, capsys):
    tiny_pipe.set_progress_bar_config(disable=False, desc="fox", ascii=True)
    tiny_pipe(PROMPT, num_videos_per_prompt=2, num_blocks=2, output_type="latent")
    assert "fox" in capsys.readouterr().err  # tqdm writes to stderr
    tiny_pipe.set_progress_bar_config(disable=True)
    tiny_pipe(PROMPT, num_blocks=1, output_type="latent")
    assert capsys.readouterr().err == ""
    with pytest.raises(TypeError) as e:
        tiny_pipe.set_progress_bar_config(dissable=True)
    assert "dissable" in str(e.value)
    tiny_pipe.set_progress_bar_config()


def test_cpu_offload_moves_the_text_encoder_for_encoding_only(monkeypatch):
    from sdvg import SpeculativeVideoPipeline

    pipe = SpeculativeVideoPipeline.from_preset("tiny")
    enc = pipe.components.text_encoder
    visits = []

    def spy_to(device):  # records the moves (a CPU-only machine has no second real device to move to)
        visits.append(torch.device(device))
        return enc.model

    monkeypatch.setattr(enc.model, "to", spy_to)
    pipe.enable_model_cpu_offload(device="cuda:0")
    monkeypatch.setattr(type(enc), "_encode", lambda self, prompt: torch.zeros(1, enc.config.text_len,
                                                                                enc.config.d_model))
    enc.encode("a cat")
    assert visits == [torch.device("cpu"), torch.device("cuda:0"), torch.device("cpu")]
    assert enc.device == torch.device("cpu")


@pytest.mark.parametrize("call,error,match", [
    (dict(prompt=[PROMPT, " "]), ValueError, r"prompt\[1\] is empty"),
    (dict(prompt=[]), TypeError, "non-empty list of strings"),
    (dict(prompt=[PROMPT, 3]), TypeError, r"prompt\[1\] must be a string"),
    (dict(prompt=PROMPT, output_type="gif"), ValueError, "unknown output_type 'gif'; choose one of np, pt"),
    (dict(prompt=PROMPT, generator=42), TypeError, "generator must be a torch.Generator"),
    (dict(prompt=[PROMPT, "a cat"], generator=[torch.Generator()] * 3), ValueError,
     r"a list of 3 generators for 2 videos \(2 prompt\(s\) x num_videos_per_prompt=1\); pass one generator per video"),
    (dict(prompt=PROMPT, generator=[torch.Generator(), 1], num_videos_per_prompt=2), TypeError,
     r"generator\[1\] must be a torch.Generator"),
    (dict(prompt=PROMPT, num_videos_per_prompt=0), ValueError, "num_videos_per_prompt must be a positive integer"),
    (dict(prompt=PROMPT, num_videos_per_prompt=1.5), ValueError, "num_videos_per_prompt must be a positive integer"),
    (dict(prompt=PROMPT, callback_on_block_end=lambda pipe, step, timestep, kwargs: {}), TypeError,
     r"cannot be called as callback\(pipe, block\).*def on_block_end\(pipe, block\)"),
    (dict(prompt=PROMPT, callback_on_block_end=lambda block: None), TypeError, r"callback\(pipe, block\)"),
    (dict(prompt=PROMPT, callback_on_block_end="print"), TypeError, "must be callable"),
])
def test_bad_calls_name_the_problem_before_any_work(tiny_pipe, monkeypatch, call, error, match):
    def no_work(*args, **kwargs):
        raise AssertionError("a video started before the call was checked")

    monkeypatch.setattr(tiny_pipe, "run", no_work)
    with pytest.raises(error, match=match):
        tiny_pipe(num_blocks=1, **call)
