"""Weights that are not floating or not finite are refused as they are read, in every format, by the
file's key name; NaN/inf in a stage output is an error naming the stage and the block, except for a
draft, which is rejected (with a warning) and replaced by the target's block, in both schedulers."""
import math
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdvg.config import get_preset
from sdvg.models.checkpoints import (CheckpointError, check_dit_checkpoint, check_weights, load_dit,
                                     nonfinite_counts, save_dit)
from sdvg.models.dit import CausalWanDiT

from conftest import randomize, write_real_checkpoints

FIX = "re-download / re-export the checkpoint"
DIT_FORMATS = [  # format, file name, the file's name of the diffusers key `blocks.0.attn1.to_q.weight`
    ("diffusers", "dit_folder", "blocks.0.attn1.to_q.weight"),
    ("original", "wan.safetensors", "blocks.0.self_attn.q.weight"),
    ("krea", "krea.safetensors", "model.blocks.0.self_attn.q.weight"),
    ("self-forcing", "sf.pt", "model.blocks.0.self_attn.q.weight"),
]


def _poison(path, key, how="nan", count=1):
    """Rewrite one tensor of a real checkpoint file in place (the file's own structure kept):
    `count` NaN (or inf) values, or the tensor cast to int8."""
    def bad(t):
        if how == "int8":
            return t.to(torch.int8)
        t = t.clone()
        t.view(-1)[:count] = math.nan if how == "nan" else math.inf
        return t

    path = str(path)
    if path.endswith(".safetensors"):
        state = load_file(path)
        state[key] = bad(state[key])
        save_file(state, path)
    else:
        obj = torch.load(path, weights_only=True)
        for d in (obj, *[v for v in obj.values() if isinstance(v, dict)]):
            if key in d:
                d[key] = bad(d[key])
        torch.save(obj, path)


@pytest.fixture(scope="module")
def source():
    return randomize(CausalWanDiT(get_preset("tiny").drafter).eval(), std=0.1, seed=3)


def _file_of(path, fmt):
    return path / "diffusion_pytorch_model.safetensors" if fmt == "diffusers" else path


@pytest.mark.parametrize("fmt,name,key", DIT_FORMATS)
def test_dit_nan_is_refused_by_the_files_key_before_any_model_exists(tmp_path, source, fmt, name, key, monkeypatch):
    path = tmp_path / name
    save_dit(source, path, fmt)
    _poison(_file_of(path, fmt), key, "nan", count=12)
    monkeypatch.setattr(CausalWanDiT, "__init__", lambda *a, **k: pytest.fail("a model was allocated"))
    with pytest.raises(CheckpointError) as err:
        check_dit_checkpoint(path, source.config)
    msg = str(err.value)
    assert str(_file_of(path, fmt)) in msg and repr(key) in msg and FIX in msg
    assert "1 unusable tensor(s)" in msg and "non-finite values (12 NaN, 0 inf)" in msg


@pytest.mark.parametrize("fmt,name,key", DIT_FORMATS)
def test_dit_integer_weights_are_refused(tmp_path, source, fmt, name, key):
    path = tmp_path / name
    save_dit(source, path, fmt)
    _poison(_file_of(path, fmt), key, "int8")
    with pytest.raises(CheckpointError, match=rf"{key!r}: dtype torch.int8, not a floating dtype.*{FIX}"):
        load_dit(CausalWanDiT(source.config), path)


def test_many_bad_tensors_name_the_first_and_count_the_rest(tmp_path, source):
    from sdvg.models.checkpoints import diffusers_to_original

    state = {k: v.contiguous() for k, v in diffusers_to_original(source.model.state_dict()).items()}
    bad = sorted(k for k in state if k.endswith(".weight"))[:5]
    for i, k in enumerate(bad):
        state[k] = state[k].clone()
        state[k].view(-1)[0] = math.inf if i % 2 else math.nan
    state[bad[0]].view(-1)[1] = -math.inf
    save_file(state, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_dit(CausalWanDiT(source.config), tmp_path / "w.safetensors")
    msg = str(err.value)
    assert "5 unusable tensor(s)" in msg and "and 2 more" in msg
    assert f"{bad[0]!r}: non-finite values (1 NaN, 1 inf)" in msg and f"{bad[1]!r}: non-finite values (0 NaN, 1 inf)" in msg


def test_vae_nan_refused_in_both_formats(tmp_path, tiny_preset):
    from sdvg.models.vae import build_vae, load_vae_weights

    vae = randomize(build_vae(tiny_preset.vae), std=0.05, seed=1)
    vae.save_pretrained(tmp_path / "vae")
    f = tmp_path / "vae" / "diffusion_pytorch_model.safetensors"
    key = sorted(load_file(str(f)))[0]
    _poison(f, key, "inf", count=3)
    with pytest.raises(CheckpointError, match=rf"{key!r}: non-finite values \(0 NaN, 3 inf\).*{FIX}"):
        load_vae_weights(build_vae(tiny_preset.vae), tmp_path / "vae")
    torch.save({k: v.to(torch.int8) if k == key else v for k, v in vae.state_dict().items()}, tmp_path / "vae.pth")
    with pytest.raises(CheckpointError, match=rf"vae.pth: 1 unusable.*{key!r}: dtype torch.int8"):
        load_vae_weights(build_vae(tiny_preset.vae), tmp_path / "vae.pth")


def test_image_reward_nan_refused_by_the_packages_key(tmp_path, tiny_preset):
    from sdvg.models.reward import (build_image_reward, load_image_reward_weights, reward_tokenizer,
                                    save_image_reward_weights)

    cfg = tiny_preset.reward
    tok = reward_tokenizer(cfg, tiny=True)
    save_image_reward_weights(build_image_reward(cfg, tok), tmp_path / "ImageReward.pt")
    key = "blip.visual_encoder.blocks.1.attn.qkv.weight"
    _poison(tmp_path / "ImageReward.pt", key, "nan", count=2)
    with pytest.raises(CheckpointError, match=rf"ImageReward.pt: 1 unusable.*{key!r}: non-finite values \(2 NaN"):
        load_image_reward_weights(build_image_reward(cfg, tok), tmp_path / "ImageReward.pt")


def test_text_encoder_nan_and_int8_refused(tmp_path, tiny_preset):
    from sdvg.models.text_encoder import TextEncoder
    from sdvg.models.tokenizers import tiny_umt5_tokenizer

    enc = TextEncoder.random(tiny_preset.text_encoder, tiny_umt5_tokenizer(), seed=1)
    enc.model.save_pretrained(tmp_path / "te")
    enc.tokenizer.save_pretrained(tmp_path / "te")
    f = tmp_path / "te" / "model.safetensors"
    key = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    clean = load_file(str(f))
    _poison(f, key, "nan", count=4)
    with pytest.raises(CheckpointError, match=rf"te: 1 unusable.*{key!r}: non-finite values \(4 NaN, 0 inf\).*{FIX}"):
        TextEncoder.from_pretrained(tmp_path / "te", config=tiny_preset.text_encoder)
    save_file(clean, str(f))
    _poison(f, key, "int8")
    with pytest.raises(CheckpointError, match=rf"model.safetensors: 1 unusable.*{key!r}: dtype I8, not a floating"):
        TextEncoder.from_pretrained(tmp_path / "te", config=tiny_preset.text_encoder)


def test_real_pipeline_files_one_poisoned(tmp_path, tiny_pipe, tiny_preset):
    """The files of a whole pipeline in their real formats: the poisoned one is named, the clean ones load."""
    from sdvg import SpeculativeVideoPipeline

    paths = write_real_checkpoints(tiny_pipe.components, tmp_path)
    loaded = SpeculativeVideoPipeline.from_pretrained(tiny_preset, **paths, drafter_device="cpu")
    assert torch.equal(loaded.components.target.model.proj_out.bias, tiny_pipe.components.target.model.proj_out.bias)
    _poison(paths["target"], "model.head.head.bias", "nan")
    with pytest.raises(CheckpointError, match=r"krea.safetensors: 1 unusable.*'model.head.head.bias'"):
        SpeculativeVideoPipeline.from_pretrained(tiny_preset, **paths, drafter_device="cpu")


def test_the_finite_check_is_one_sum_when_clean():
    assert nonfinite_counts(torch.randn(1000)) == (0, 0)
    big = torch.full((4,), 60000.0, dtype=torch.float16)  # the sum overflows fp16: counted, not refused
    assert nonfinite_counts(big) == (0, 0)
    t = torch.randn(3 * (1 << 24) // 2)  # more than one counting chunk
    t[5], t[-1], t[1 << 24] = math.nan, math.inf, -math.inf
    assert nonfinite_counts(t) == (1, 2)
    assert nonfinite_counts(torch.empty(0)) == (0, 0)
    if hasattr(torch, "float8_e4m3fn"):
        f8 = torch.tensor([1.0, math.nan, 2.0]).to(torch.float8_e4m3fn)
        assert nonfinite_counts(f8) == (1, 0)
    check_weights({"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}, "x")
    with pytest.raises(CheckpointError, match=r"x: 1 unusable tensor\(s\): 'b': dtype torch.bool"):
        check_weights({"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.bool)}, "x")
