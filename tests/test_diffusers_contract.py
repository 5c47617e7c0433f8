"""sdvg's outputs have the structure of diffusers' own `WanPipeline` on the same settings: a tiny WanPipeline
(random WanTransformer3DModel, the tiny preset's AutoencoderKLWan, a tiny UMT5EncoderModel with sdvg's
character tokenizer; built offline) and the `tiny` preset make one prompt x 2 videos of 21 frames at 64x64,
and every output type is compared: container types, ndim, dtype, axis order (the full shape), batch size."""
import numpy as np
import pytest
import torch

PROMPT = "a red fox running through fresh snow"
BATCH, FRAMES, LATENT_FRAMES = 2, 21, 6  # tiny: 2 blocks of 3 latent frames -> 9 + 12 frames


@pytest.fixture(scope="module")
def wan_pipe(tiny_preset):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from sdvg.models.tokenizers import tiny_umt5_tokenizer
    from sdvg.models.vae import build_vae

    torch.manual_seed(0)
    tok = tiny_umt5_tokenizer()
    text = UMT5EncoderModel(UMT5Config(vocab_size=tok.vocab_size + 8, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                       num_heads=4, is_encoder_decoder=False)).eval()
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
                                        num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                        rope_max_seq_len=32).eval()
    pipe = WanPipeline(tokenizer=tok, text_encoder=text, transformer=transformer, vae=build_vae(tiny_preset.vae),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _structure(frames):
    """What a user's code depends on: container types down to a frame, shape, dtype."""
    if isinstance(frames, list):
        return ("list", len(frames), type(frames[0]).__name__, len(frames[0]), type(frames[0][0]).__name__,
                frames[0][0].size, frames[0][0].mode)
    return (type(frames).__name__, frames.ndim, tuple(frames.shape), str(frames.dtype).replace("torch.", ""))


@pytest.mark.parametrize("output_type", ["np", *(pytest.param(t, marks=pytest.mark.slow) for t in ("pt", "pil", "latent"))])
def test_outputs_have_wan_pipelines_structure(wan_pipe, tiny_pipe, output_type):
    ours = tiny_pipe(PROMPT, num_videos_per_prompt=BATCH, num_blocks=2, output_type=output_type)
    theirs = wan_pipe(PROMPT, num_videos_per_prompt=BATCH, num_frames=FRAMES, height=64, width=64,
                      num_inference_steps=1, guidance_scale=1.0, max_sequence_length=16, output_type=output_type)
    assert type(ours.frames) is type(theirs.frames)
    assert _structure(ours.frames) == _structure(theirs.frames)
    expected = {"np": ("ndarray", 5, (BATCH, FRAMES, 64, 64, 3), "float32"),
                "pt": ("Tensor", 5, (BATCH, FRAMES, 3, 64, 64), "float32"),
                "latent": ("Tensor", 5, (BATCH, 16, LATENT_FRAMES, 8, 8), "float32")}
    if output_type in expected:
        assert _structure(ours.frames) == expected[output_type]
    else:
        assert _structure(ours.frames) == ("list", BATCH, "list", FRAMES, "Image", (64, 64), "RGB")
    (tuple_frames,) = tiny_pipe(PROMPT, num_blocks=1, output_type=output_type, return_dict=False)
    (their_tuple,) = wan_pipe(PROMPT, num_frames=9, height=64, width=64, num_inference_steps=1, guidance_scale=1.0,
                              max_sequence_length=16, output_type=output_type, return_dict=False)
    assert _structure(tuple_frames) == _structure(their_tuple)  # one prompt: a batch of one in both
    if output_type in ("np", "pt"):
        assert 0.0 <= float(ours.frames.min()) <= float(ours.frames.max()) <= 1.0


@pytest.mark.slow
def test_export_to_video_of_both_pipelines_reads_back_alike(wan_pipe, tiny_pipe, tmp_path):
    from diffusers.utils import export_to_video

    ours = export_to_video(tiny_pipe(PROMPT, num_blocks=2).frames[0], str(tmp_path / "ours.mp4"), fps=16)
    theirs = wan_pipe(PROMPT, num_frames=FRAMES, height=64, width=64, num_inference_steps=1, guidance_scale=1.0,
                      max_sequence_length=16).frames[0]
    theirs = export_to_video(theirs, str(tmp_path / "theirs.mp4"), fps=16)
    assert _read(ours).shape == _read(theirs).shape == (FRAMES, 64, 64, 3)
    assert np.issubdtype(_read(ours).dtype, np.uint8)


def _read(path) -> np.ndarray:
    """Every frame of an MP4 as uint8 [F, H, W, 3], read back through imageio's ffmpeg plugin (imageio-ffmpeg's
    own binary; no ffprobe needed)."""
    from sdvg.io.video_writer import read_mp4_frames

    return read_mp4_frames(path)


def test_diffusers_keywords_are_taken_or_refused_by_name(tiny_pipe):
    """height / width make that size with the same weights (pipe.resized); num_inference_steps is target_steps;
    guidance_scale / negative_prompt are refused unless they ask for nothing (the models are CFG-distilled)."""
    from sdvg.options import OptionError

    kw = dict(num_blocks=1, seed=2, output_type="uint8")
    sized = tiny_pipe("a fox", height=48, width=80, **kw).frames
    assert sized.shape == (1, 9, 48, 80, 3)
    assert torch.equal(sized, tiny_pipe.resized(48, 80)("a fox", **kw).frames)
    assert torch.equal(tiny_pipe("a fox", num_inference_steps=3, **kw).frames,
                       tiny_pipe("a fox", target_steps=3, **kw).frames)
    assert torch.equal(tiny_pipe("a fox", guidance_scale=1.0, negative_prompt="", **kw).frames,
                       tiny_pipe("a fox", **kw).frames)
    with pytest.raises(OptionError, match="classifier-free guidance"):
        tiny_pipe("a fox", guidance_scale=5.0, **kw)
    with pytest.raises(OptionError) as e:
        tiny_pipe("a fox", negative_prompt=["blurry"], **kw)
    assert "negative_prompt" in str(e.value)
    with pytest.raises(OptionError, match="give one"):
        tiny_pipe("a fox", num_inference_steps=3, target_steps=4, **kw)
    with pytest.raises(ValueError, match="multiple"):
        tiny_pipe("a fox", height=50, **kw)


def test_repr_and_a_stream_as_a_context_manager(tiny_pipe):
    text = repr(tiny_pipe)
    assert text.startswith("SpeculativeVideoPipeline(preset='tiny' (random weights), 64x64") and "backend='eager'" in text
    with tiny_pipe.stream("a fox", num_blocks=3, seed=1) as blocks:
        first = next(blocks)
    assert first.index == 0 and blocks.finished and blocks.stats.interrupted
