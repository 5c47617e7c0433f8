import numpy as np
import pytest
import torch
from PIL import Image

from sdvg.config import get_preset
from sdvg.models.components import _randomize_reward_head
from sdvg.models.reward import (Aggregator, RewardScorer, build_image_reward, load_image_reward_weights,
                         reward_tokenizer)
from sdvg.generation.routers import Router
from sdvg.options import GenerationOptions

# Batched tensor path vs the package's per-image PIL path on the same uint8 frames. The only
# difference is the resize (torch antialiased bicubic vs PIL bicubic); measured max |diff| about
# 3e-5 on random-weight tiny models, so 5e-4 leaves room and still catches any real mismatch
# (a wrong crop, mean/std or normalisation moves scores by > 1e-2).
PIL_TOL = 5e-4


@pytest.fixture(scope="module")
def scorer():
    cfg = get_preset("tiny").reward
    torch.manual_seed(0)
    model = build_image_reward(cfg, reward_tokenizer(cfg, tiny=True))
    _randomize_reward_head(model, 1)
    return RewardScorer(model, cfg)


def _frames():
    g = torch.Generator().manual_seed(0)
    f = torch.rand(4, 3, 48, 80, generator=g)
    f[1] *= 0.1
    f[2] = f[2] ** 4
    return (f * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


@pytest.mark.parametrize("prompt", ["a cat on a mat", "fireworks over a city at night"])
def test_batched_scores_match_package_score(scorer, prompt):
    frames = _frames()
    ours = scorer.score(prompt, frames)
    ref = torch.tensor([scorer.model.score(prompt, Image.fromarray(f.numpy())) for f in frames])
    assert ours.shape == (4,)
    assert (ours - ref).abs().max() < PIL_TOL
    # float input in [0, 1] scores the same frames without a uint8 round trip
    unit = frames.permute(0, 3, 1, 2).float() / 255
    assert torch.allclose(scorer.score(prompt, unit), ours, atol=1e-6)


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
    with pytest.raises(ValueError, match="unknown aggregation"):
        Aggregator("median")(torch.zeros(2))  # the options refuse it first (sdvg.options.AGGREGATIONS)


def test_tokenizer_vocab_size_checked(tmp_path):
    from sdvg.models.tokenizers import check_vocab_size, load_bert_tokenizer

    cfg = get_preset("wan2.1").reward
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    with pytest.raises(ValueError, match="7 tokens, expected 30524"):
        reward_tokenizer(cfg, folder=tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_bert_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no vocab.txt"):
        (tmp_path / "empty").mkdir()
        load_bert_tokenizer(tmp_path / "empty")
    check_vocab_size(list(range(5)), 5, "x")


def test_reward_checkpoint_strict(tmp_path, scorer):
    from safetensors.torch import save_file

    from sdvg.models.checkpoints import CheckpointError

    state = {k: v.contiguous() for k, v in scorer.model.state_dict().items()}
    torch.save(state, tmp_path / "ImageReward.pt")
    cfg = get_preset("tiny").reward
    fresh = build_image_reward(cfg, reward_tokenizer(cfg, tiny=True))
    load_image_reward_weights(fresh, tmp_path / "ImageReward.pt")
    assert torch.equal(fresh.mlp.layers[0].weight, scorer.model.mlp.layers[0].weight)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="not an ImageReward"):
        load_image_reward_weights(fresh, tmp_path / "other.safetensors")
    state.pop("mlp.layers.0.bias")
    torch.save(state, tmp_path / "partial.pt")
    with pytest.raises(CheckpointError, match="missing key"):
        load_image_reward_weights(fresh, tmp_path / "partial.pt")
