"""The diffusers call surface: prompt lists, generator, output_type, return_dict, callback, torch_dtype,
.to(), CPU offload of the text encoder, and interchange with diffusers' export_to_video."""
import numpy as np
import pytest
import torch

PROMPT = "a red fox running through fresh snow"
KW = dict(num_blocks=2, tau=-0.1, seed=3)


def test_prompt_list_gives_each_prompt_its_own_video(tiny_pipe):
    prompts = [PROMPT, "a blue whale"]
    out = tiny_pipe(prompts, output_type="uint8", **KW)
    assert isinstance(out.frames, list) and len(out.frames) == len(out.stats) == len(out.latents) == 2
    for p, frames, latents, stats in zip(prompts, out.frames, out.latents, out.stats):
        alone = tiny_pipe(p, output_type="uint8", **KW)
        assert torch.equal(frames, alone.frames) and torch.equal(latents, alone.latents)
        assert stats["prompt"] == p
    assert not torch.equal(out.frames[0], out.frames[1])


@pytest.mark.slow
def test_output_types_agree(tiny_pipe):
    u8 = tiny_pipe(PROMPT, output_type="uint8", **KW)
    np_out = tiny_pipe(PROMPT, **KW)  # np is the default
    assert isinstance(np_out.frames, np.ndarray) and np_out.frames.dtype == np.float32
    assert np_out.frames.shape == tuple(u8.frames.shape) and 0.0 <= np_out.frames.min() <= np_out.frames.max() <= 1.0
    assert np.array_equal((np_out.frames * 255).astype(np.uint8), u8.frames.numpy())  # diffusers' conversion
    pt = tiny_pipe(PROMPT, output_type="pt", **KW).frames
    assert pt.shape == (u8.frames.shape[0], 3, *u8.frames.shape[1:3]) and pt.dtype == torch.float32
    assert torch.equal(pt.permute(0, 2, 3, 1), torch.from_numpy(np_out.frames))
    pil = tiny_pipe(PROMPT, output_type="pil", **KW).frames
    assert len(pil) == u8.frames.shape[0] and np.array_equal(np.asarray(pil[5]), u8.frames[5].numpy())
    lat = tiny_pipe(PROMPT, output_type="latent", **KW)
    assert lat.frames is None and torch.equal(lat.latents, u8.latents)
    (frames,) = tiny_pipe(PROMPT, return_dict=False, **KW)
    assert np.array_equal(frames, np_out.frames)


@pytest.mark.slow
def test_generator_draws_the_seed(tiny_pipe):
    a = tiny_pipe(PROMPT, generator=torch.Generator().manual_seed(42), num_blocks=2)
    b = tiny_pipe(PROMPT, generator=torch.Generator().manual_seed(42), num_blocks=2)
    seed = a.stats["seed"]
    assert np.array_equal(a.frames, b.frames) and b.stats["seed"] == seed
    c = tiny_pipe(PROMPT, seed=seed, num_blocks=2)
    assert np.array_equal(a.frames, c.frames)  # the recorded seed reproduces the video
    g = torch.Generator().manual_seed(42)
    first, second = tiny_pipe(PROMPT, generator=g, num_blocks=1), tiny_pipe(PROMPT, generator=g, num_blocks=1)
    assert first.stats["seed"] != second.stats["seed"]  # the generator's state moves on, as in diffusers


def test_callback_sees_every_block_in_order(tiny_pipe):
    seen = []
    out = tiny_pipe(PROMPT, callback_on_block_end=lambda pipe, block: seen.append((pipe, block.index)), **KW)
    assert [i for _, i in seen] == [0, 1] and all(p is tiny_pipe for p, _ in seen)
    assert len(out.blocks) == 2


@pytest.mark.slow
def test_export_to_video_equals_sdvg_mp4(tiny_pipe, tmp_path):
    from diffusers.utils import export_to_video

    from sdvg.io.video_writer import IncrementalMP4Writer, read_mp4_frames

    out = tiny_pipe(PROMPT, **KW)
    theirs = export_to_video(list(out.frames), str(tmp_path / "d.mp4"), fps=16, quality=8)  # = crf 10, sdvg's default
    u8 = torch.from_numpy((out.frames * 255).astype(np.uint8))
    with IncrementalMP4Writer(tmp_path / "s.mp4") as w:
        w.write(u8)
    a, b = read_mp4_frames(theirs).astype(np.float32), read_mp4_frames(tmp_path / "s.mp4").astype(np.float32)
    assert a.shape == b.shape == tuple(u8.shape)
    # both are lossy H.264 of the same frames: close to each other and to the source
    assert np.abs(a - b).mean() < 0.5 and np.abs(a - u8.numpy()).mean() < 12.0


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
])
def test_bad_calls_name_the_problem(tiny_pipe, call, error, match):
    with pytest.raises(error, match=match):
        tiny_pipe(num_blocks=1, **call)
