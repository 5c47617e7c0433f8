import pytest
import torch

from sdvg.models.checkpoints import CheckpointError, load_dit, read_dit_checkpoint, save_dit
from sdvg.config import get_preset
from sdvg.models.dit import CausalWanDiT

from conftest import randomize

FORMATS = [("diffusers", "dit_folder"), ("original", "wan.safetensors"), ("krea", "krea.safetensors"),
           ("self-forcing", "sf.pt")]


@pytest.fixture(scope="module")
def source():
    return randomize(CausalWanDiT(get_preset("tiny").drafter).eval(), std=0.1, seed=3)


@pytest.mark.parametrize("fmt,name", FORMATS)
def test_round_trip_gives_identical_outputs(tmp_path, source, fmt, name):
    path = tmp_path / name
    save_dit(source, path, fmt)
    loaded = CausalWanDiT(source.config).eval()
    load_dit(loaded, path)
    for k, v in source.model.state_dict().items():
        assert torch.equal(v, loaded.model.state_dict()[k]), k
    x = torch.randn(1, 16, 3, 8, 8)
    emb = torch.randn(1, 512, 32)
    t = torch.full((1, 3), 625.0)
    assert torch.equal(source(x, t, source.encode_text(emb)), loaded(x, t, loaded.encode_text(emb)))


def test_self_forcing_prefers_ema(tmp_path, source):
    from sdvg.models.checkpoints import diffusers_to_original

    orig = {"model." + k: v for k, v in diffusers_to_original(source.model.state_dict()).items()}
    zeros = {k: torch.zeros_like(v) for k, v in orig.items()}
    torch.save({"generator": zeros, "generator_ema": orig}, tmp_path / "sf.pt")
    state, _ = read_dit_checkpoint(tmp_path / "sf.pt")
    assert torch.equal(state["proj_out.weight"], source.model.proj_out.weight)


def test_wrong_model_size_names_key_and_shapes(tmp_path, source):
    save_dit(source, tmp_path / "d.safetensors", "original")
    bigger = CausalWanDiT(get_preset("tiny").target)
    with pytest.raises(CheckpointError) as e:
        load_dit(bigger, tmp_path / "d.safetensors")
    assert all(s in str(e.value) for s in ("expected [", "found [", "different model size")), e.value
    save_dit(source, tmp_path / "folder", "diffusers")
    with pytest.raises(CheckpointError, match="num_attention_heads"):
        load_dit(bigger, tmp_path / "folder")


def test_missing_and_unexpected_keys(tmp_path, source):
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in source.model.state_dict().items()}
    state.pop("proj_out.bias")
    save_file(state, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_dit(CausalWanDiT(source.config), tmp_path / "m.safetensors")
    assert all(s in str(e.value) for s in ("missing key", "proj_out.bias")), e.value
    state = {k: v.contiguous() for k, v in source.model.state_dict().items()}
    state["blocks.0.extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "u.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_dit(CausalWanDiT(source.config), tmp_path / "u.safetensors")
    assert all(s in str(e.value) for s in ("unexpected key", "blocks.0.extra.weight")), e.value


def test_corrupt_and_pickled_objects_refused(tmp_path, source):
    save_dit(source, tmp_path / "ok.safetensors", "original")
    data = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt|truncated"):
        load_dit(CausalWanDiT(source.config), tmp_path / "cut.safetensors")

    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    torch.save({"generator": {"x": Evil()}}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError) as e:
        read_dit_checkpoint(tmp_path / "evil.pt")
    assert "evil.pt" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        read_dit_checkpoint(tmp_path / "nope.pt")
    assert all(s in str(e.value) for s in ("nope.pt", "does not exist")), e.value


def test_original_mapping_agrees_with_diffusers_converter(source):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from sdvg.models.checkpoints import diffusers_to_original, original_to_diffusers

    orig = diffusers_to_original(source.model.state_dict())
    theirs = convert_wan_transformer_to_diffusers(dict(orig))
    assert set(theirs) == set(original_to_diffusers(orig)) == set(source.model.state_dict())


def test_text_encoder_round_trip_from_a_folder(tmp_path):
    """A transformers UMT5 folder (and a diffusers-style text_encoder/ + tokenizer/ layout) loads offline."""
    from sdvg.config import get_preset
    from sdvg.models.text_encoder import TextEncoder
    from sdvg.models.tokenizers import tiny_umt5_tokenizer

    cfg = get_preset("tiny").text_encoder
    enc = TextEncoder.random(cfg, tiny_umt5_tokenizer(), seed=1)
    enc.model.save_pretrained(tmp_path / "wan" / "text_encoder")
    enc.tokenizer.save_pretrained(tmp_path / "wan" / "tokenizer")
    loaded = TextEncoder.from_pretrained(tmp_path / "wan", config=cfg)
    a, b = enc.encode("a red fox"), loaded.encode("a red fox")
    assert a.shape == (1, 512, cfg.d_model) and torch.equal(a, b)
    n = len(enc.tokenizer("a red fox").input_ids)
    assert torch.all(a[0, n:] == 0) and torch.any(a[0, :n] != 0)  # zero past the prompt length
    with pytest.raises(FileNotFoundError, match="not a UMT5 encoder folder"):
        TextEncoder.from_pretrained(tmp_path / "nothing")


def test_wrong_size_is_refused_before_any_model_is_allocated(tmp_path, source, monkeypatch):
    from sdvg.models import checkpoints
    from sdvg.models.dit import CausalWanDiT as Dit

    save_dit(source, tmp_path / "d.safetensors", "krea")
    monkeypatch.setattr(Dit, "__init__", lambda *a, **k: pytest.fail("a model was allocated"))
    with pytest.raises(CheckpointError) as e:
        checkpoints.check_dit_checkpoint(tmp_path / "d.safetensors", get_preset("tiny").target)
    assert "model has dim 64" in str(e.value)
    state, _ = checkpoints.check_dit_checkpoint(tmp_path / "d.safetensors", source.config)
    assert "proj_out.weight" in state
