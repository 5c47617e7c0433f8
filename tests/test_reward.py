import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image

from sdvg.config import get_preset
from sdvg.models.checkpoints import CheckpointError
from sdvg.models.components import _randomize_reward_model
from sdvg.models.reward import (CLIP_MEAN, CLIP_STD, Aggregator, RewardScorer, build_image_reward,
                                load_image_reward_weights, package_to_sdvg, reward_tokenizer,
                                save_image_reward_weights, sdvg_to_package)
from sdvg.generation.routers import Router
from sdvg.options import GenerationOptions

# Batched tensor path vs the package's per-image PIL path on the same uint8 frames: sdvg's tensor
# preprocessing follows PIL's (8-bit passes; PIL's fixed-point filter leaves about 1 pixel in 2,000 one
# level off); measured max |diff| about 1e-4 with strongly random weights (tests/test_reward_oracle.py),
# so 5e-4 leaves room and still catches any real mismatch (a wrong crop, mean/std or normalisation
# moves scores by > 1e-2).
PIL_TOL = 5e-4

# The keys of the image-reward package's ImageReward of one ViT block and one BERT layer (its
# state_dict, as ImageReward.pt holds them).
PACKAGE_KEYS = (
    ["blip.visual_encoder." + k for k in (
        "cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias", "norm.weight", "norm.bias")]
    + [f"blip.visual_encoder.blocks.0.{m}.{p}" for m in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")
       for p in ("weight", "bias")]
    + ["blip.text_encoder.embeddings." + k for k in (
        "position_ids", "word_embeddings.weight", "position_embeddings.weight", "LayerNorm.weight", "LayerNorm.bias")]
    + [f"blip.text_encoder.encoder.layer.0.{a}.{m}.{p}" for a in ("attention", "crossattention")
       for m in ("self.query", "self.key", "self.value", "output.dense", "output.LayerNorm") for p in ("weight", "bias")]
    + [f"blip.text_encoder.encoder.layer.0.{m}.{p}" for m in ("intermediate.dense", "output.dense", "output.LayerNorm")
       for p in ("weight", "bias")]
    + [f"blip.{m}.{p}" for m in ("vision_proj", "text_proj") for p in ("weight", "bias")]
    + [f"mlp.layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")]
)


@pytest.fixture(scope="module")
def scorer():
    cfg = get_preset("tiny").reward
    torch.manual_seed(0)
    model = build_image_reward(cfg, reward_tokenizer(cfg, tiny=True))
    _randomize_reward_model(model, 1)
    return RewardScorer(model, cfg)


def _frames():
    g = torch.Generator().manual_seed(0)
    f = torch.rand(4, 3, 48, 80, generator=g)
    f[1] *= 0.1
    f[2] = f[2] ** 4
    return (f * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def _package_preprocess(frame: torch.Tensor) -> torch.Tensor:
    """The image-reward package's `_transform(224)` on a PIL image (torchvision, as the package has it)."""
    from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize, ToTensor

    tf = Compose([Resize(224, interpolation=InterpolationMode.BICUBIC), CenterCrop(224),
                  lambda im: im.convert("RGB"), ToTensor(), Normalize(CLIP_MEAN, CLIP_STD)])
    return tf(Image.fromarray(frame.numpy()))


@pytest.mark.parametrize("prompt", ["a cat on a mat", "fireworks over a city at night"])
def test_batched_scores_match_package_preprocessing(scorer, prompt):
    frames = _frames()
    ours = scorer.score(prompt, frames)
    tok = scorer.tokens(prompt)
    ref = torch.cat([scorer.score_images(_package_preprocess(f)[None], tok.ids, tok.mask) for f in frames])
    assert ours.shape == (4,)
    assert (ours - ref).abs().max() < PIL_TOL
    # float input in [0, 1] scores the same frames without a uint8 round trip
    unit = frames.permute(0, 3, 1, 2).float() / 255
    assert torch.allclose(scorer.score(prompt, unit), ours, atol=1e-6)


def test_preprocessing_is_the_package_one_pixel_for_pixel(scorer):
    """Upsampled, downsampled and video-sized frames: the same 8-bit levels as PIL but for rare
    one-level differences (PIL's fixed-point filter)."""
    g = torch.Generator().manual_seed(1)
    for h, w in ((48, 80), (270, 480), (480, 832), (224, 224), (300, 224)):
        frames = (torch.rand(2, h, w, 3, generator=g) * 255).round().to(torch.uint8)
        ours = scorer.preprocess(frames)
        ref = torch.stack([_package_preprocess(f) for f in frames])
        levels = ((ours - ref) * torch.tensor(CLIP_STD).view(1, 3, 1, 1) * 255).abs()
        assert levels.max() < 1.01 and (levels > 0.5).float().mean() < 2e-3, (h, w)


def test_prompt_tokenised_once(scorer):
    scorer.score("same prompt", _frames()[:1])
    t = scorer.tokens("same prompt")
    scorer.score("same prompt", _frames()[:2])
    assert scorer.tokens("same prompt") is t


def test_worst_frame_rule_rejects_where_mean_accepts(scorer):
    frames = _frames().clone()
    frames[3] = 0  # one black frame
    s = scorer.score("a cat on a mat", frames)
    assert Aggregator("min")(s) <= Aggregator("mean")(s)
    # controlled scores for the decision itself
    controlled = torch.tensor([0.5, 0.6, 0.55, -2.0])
    q_min, q_mean = Aggregator("min")(controlled), Aggregator("mean")(controlled)
    tau = -0.5
    router = Router.from_options(GenerationOptions(tau=tau))
    assert not router.accept(1, q_min, 0)
    assert router.accept(1, q_mean, 0)
    assert Aggregator("trimmed_mean", trim=0.25)(controlled) == pytest.approx(0.525)
    assert Aggregator("quantile", q=0.0)(controlled) == pytest.approx(-2.0)


def test_bad_frames_are_clear_errors(scorer):
    with pytest.raises(ValueError, match="empty"):
        scorer.score("x", torch.zeros(0, 3, 8, 8))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        scorer.score("x", torch.full((1, 3, 8, 8), 3.0))
    with pytest.raises(ValueError, match=r"\[N, 3, H, W\]"):
        scorer.score("x", torch.rand(1, 8, 8, 3))
    with pytest.raises(TypeError, match="uint8"):
        scorer.score("x", torch.zeros(1, 3, 8, 8, dtype=torch.int32))
    with pytest.raises(TypeError):
        scorer.score("x", np.zeros((1, 8, 8, 3), dtype=np.uint8))
    with pytest.raises(ValueError) as e:
        Aggregator("median")(torch.ones(3))  # the options refuse it first (tests/test_options.py)
    assert "'median'" in str(e.value)


def test_tokenizer_vocab_size_checked(tmp_path):
    from sdvg.models.tokenizers import check_vocab_size, load_bert_tokenizer

    cfg = get_preset("wan2.1").reward
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    with pytest.raises(ValueError) as e:
        reward_tokenizer(cfg, folder=tmp_path)
    assert all(s in str(e.value) for s in ("7 tokens", "30524")), e.value
    with pytest.raises(FileNotFoundError, match="not found"):
        load_bert_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError) as e:
        (tmp_path / "empty").mkdir()
        load_bert_tokenizer(tmp_path / "empty")
    assert "vocab.txt" in str(e.value)
    check_vocab_size(list(range(5)), 5, "x")


def test_key_map_names_the_package_keys():
    """KEY_MAP renames every key of the package's ImageReward (the retrieval projections and the
    position_ids buffer aside) to one of the model's, and back."""
    cfg = dataclasses.replace(get_preset("tiny").reward, vit_depth=1, bert_layers=1)
    model = build_image_reward(cfg, reward_tokenizer(cfg, tiny=True))
    own = list(model.state_dict())
    unused = {"blip.text_encoder.embeddings.position_ids", "blip.vision_proj.weight", "blip.vision_proj.bias",
              "blip.text_proj.weight", "blip.text_proj.bias"}
    assert sorted(sdvg_to_package(k) for k in own) == sorted(set(PACKAGE_KEYS) - unused)
    assert all(package_to_sdvg(sdvg_to_package(k)) == k for k in own)
    assert package_to_sdvg("blip.visual_encoder.blocks.11.attn.qkv.weight") == \
        "visual_encoder.encoder.layers.11.self_attn.qkv.weight"
    assert package_to_sdvg("blip.visual_encoder.norm.bias") == "visual_encoder.post_layernorm.bias"
    assert package_to_sdvg("blip.something_else.weight") is None


def test_reward_checkpoint_strict(tmp_path, scorer):
    from safetensors.torch import save_file

    save_image_reward_weights(scorer.model, tmp_path / "ImageReward.pt")
    state = torch.load(tmp_path / "ImageReward.pt", weights_only=True)
    assert "blip.visual_encoder.blocks.0.attn.qkv.weight" in state and "mlp.layers.7.bias" in state
    cfg = get_preset("tiny").reward
    fresh = build_image_reward(cfg, reward_tokenizer(cfg, tiny=True))
    load_image_reward_weights(fresh, tmp_path / "ImageReward.pt")
    for k, v in scorer.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    frames = _frames()
    assert torch.equal(RewardScorer(fresh, cfg).score("a cat", frames), scorer.score("a cat", frames))
    # the retrieval projections may be there (the package writes them) or not; position_ids too
    extra = dict(state, **{"blip.vision_proj.weight": torch.zeros(16, 32), "blip.text_proj.bias": torch.zeros(16)})
    del extra["blip.text_encoder.embeddings.position_ids"]
    torch.save(extra, tmp_path / "extra.pt")
    load_image_reward_weights(fresh, tmp_path / "extra.pt")

    def refused(changed, match):
        torch.save(changed, tmp_path / "bad.pt")
        with pytest.raises(CheckpointError, match=match):
            load_image_reward_weights(fresh, tmp_path / "bad.pt")

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="not an ImageReward"):
        load_image_reward_weights(fresh, tmp_path / "other.safetensors")
    refused({k: v for k, v in state.items() if k != "mlp.layers.0.bias"}, r"missing key.*mlp\.layers\.0\.bias")
    refused(dict(state, **{"blip.text_encoder.embeddings.token_type_embeddings.weight": torch.zeros(2, 32)}),
            r"unexpected key.*token_type_embeddings")
    refused(dict(state, **{"blip.visual_encoder.blocks.0.attn.qkv.weight": torch.zeros(32, 32)}),
            r"'blip\.visual_encoder\.blocks\.0\.attn\.qkv\.weight': expected \[96, 32\], found \[32, 32\].*ViT width 32")
    refused(dict(state, **{"blip.text_encoder.embeddings.position_ids": torch.arange(512).flip(0)[None]}),
            "position_ids is not 0, 1, 2")


def test_med_config_is_read_and_checked(tmp_path):
    cfg = get_preset("tiny").reward
    tok = reward_tokenizer(cfg, tiny=True)
    med = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
           "vocab_size": len(tok), "layer_norm_eps": 1e-5, "hidden_act": "gelu", "max_position_embeddings": 64,
           "encoder_width": 768, "add_cross_attention": True}
    (tmp_path / "med_config.json").write_text(json.dumps(med))
    model = build_image_reward(cfg, tok, med_config=tmp_path / "med_config.json")
    text = model.text_encoder.config
    assert (text.layer_norm_eps, text.max_position_embeddings, text.encoder_hidden_size) == (1e-5, 64, cfg.vit_dim)
    with pytest.raises(CheckpointError) as e:
        build_image_reward(cfg, tok, med_config=dict(med, num_attention_heads=4))
    assert all(s in str(e.value) for s in ("num_attention_heads=4", "2")), e.value
    with pytest.raises(CheckpointError, match="cross-attends"):
        build_image_reward(cfg, tok, med_config=dict(med, add_cross_attention=False))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_image_reward(cfg, tok, med_config=tmp_path / "missing.json")
