"""The image-reward package's scores, for the comparison with sdvg's ported scorer.

Runs in the oracle environment (.oracle/, built by scripts/reward_oracle.sh: transformers 4.55.4,
image-reward 1.5) with the checkout on PYTHONPATH, and never imports torch-dependent sdvg code: only
`sdvg.models.tokenizers` (the in-memory character BERT tokenizer of the random-weight presets).

It builds an ImageReward model of a small size from the package's own classes (ViT, med.py BERT, MLP
head), randomises every weight (so that any wrongly mapped key moves the scores), writes it exactly
as `ImageReward.pt` is written (`torch.save` of the model's state dict) with the matching
`med_config.json`, writes frames as PNG files, scores every (prompt, frame) pair with the package's
own `ImageReward.score(prompt, PIL.Image)` (its tokenisation, its PIL preprocessing) and saves the
scores as JSON. `tests/test_reward_oracle.py` then scores the same files with sdvg in the runtime
environment.

    PYTHONPATH=. .oracle/bin/python scripts/reward_oracle.py --out .oracle/out [--size real]
"""
from __future__ import annotations

import argparse
import json
import math
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# `tiny`: several heads everywhere, real image and patch size (the preprocessing is the real one).
# `real`: ImageReward's own ViT-L/16 and BERT-base sizes (with the small tokenizer's vocabulary).
SIZES = {
    "tiny": dict(vit_dim=64, vit_depth=2, vit_heads=4, bert_hidden=48, bert_layers=2, bert_heads=4,
                 bert_intermediate=96, image_size=224, patch_size=16, max_text_len=35, embed_dim=16),
    "real": dict(vit_dim=1024, vit_depth=24, vit_heads=16, bert_hidden=768, bert_layers=12, bert_heads=12,
                 bert_intermediate=3072, image_size=224, patch_size=16, max_text_len=35, embed_dim=256),
}
PROMPTS = [
    "a cat",  # shorter than max_text_len: padded, the padding masked
    "A red fox running through fresh snow, at dawn!",
    "fireworks over a city at night, seen from a boat on the river, long exposure, 4k",  # truncated
]
# Groups of frames of one size each (sdvg scores a batch of one size): upsampled and non-square,
# downsampled with antialiasing, and the size of the real decoded frames (480x832).
FRAME_GROUPS = {"small": (4, 48, 80), "mid": (3, 270, 480), "video": (2, 480, 832)}


def make_frames(out: Path) -> dict[str, list[str]]:
    rng = np.random.default_rng(0)
    groups = {}
    for name, (n, h, w) in FRAME_GROUPS.items():
        files = []
        yy, xx = np.mgrid[0:h, 0:w]
        for i in range(n):
            kind = i % 4
            if kind == 0:  # noise
                img = rng.random((h, w, 3))
            elif kind == 1:  # smooth colour gradients with a little noise
                img = np.stack([xx / w, yy / h, 0.5 + 0.5 * np.sin(xx / 7.0 + yy / 11.0)], -1)
                img = img + 0.05 * rng.standard_normal((h, w, 3))
            elif kind == 2:  # dark
                img = 0.15 * rng.random((h, w, 3)) ** 3
            else:  # saturated blocks
                img = ((xx // 8 + yy // 8) % 2)[..., None] * np.array([1.0, 0.2, 0.0])
            f = out / "frames" / f"{name}_{i}.png"
            f.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray((np.clip(img, 0, 1) * 255).round().astype(np.uint8)).save(f)
            files.append(f"frames/{f.name}")
        groups[name] = files
    return groups


def med_config(size: dict, vocab_size: int) -> dict:
    """The package's med_config.json (BERT-base with cross-attention), at `size`."""
    return {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
            "hidden_dropout_prob": 0.1, "hidden_size": size["bert_hidden"], "initializer_range": 0.02,
            "intermediate_size": size["bert_intermediate"], "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
            "model_type": "bert", "num_attention_heads": size["bert_heads"],
            "num_hidden_layers": size["bert_layers"], "pad_token_id": 0, "type_vocab_size": 2,
            "vocab_size": vocab_size, "encoder_width": size["vit_dim"], "add_cross_attention": True}


def build_package_model(size: dict, tokenizer, med_config_file: Path):
    """ImageReward of `size` from the package's classes, as `ImageReward(med_config)` builds it at full
    size (without its hub download of bert-base-uncased)."""
    from ImageReward.ImageReward import MLP, ImageReward, _transform
    from ImageReward.models.BLIP.blip_pretrain import BLIP_Pretrain
    from ImageReward.models.BLIP.med import BertConfig, BertModel
    from ImageReward.models.BLIP.vit import VisionTransformer

    model = ImageReward.__new__(ImageReward)
    torch.nn.Module.__init__(model)
    model.device = "cpu"
    blip = BLIP_Pretrain.__new__(BLIP_Pretrain)
    torch.nn.Module.__init__(blip)
    blip.visual_encoder = VisionTransformer(img_size=size["image_size"], patch_size=size["patch_size"],
                                            embed_dim=size["vit_dim"], depth=size["vit_depth"],
                                            num_heads=size["vit_heads"], drop_path_rate=0.0)
    blip.tokenizer = tokenizer
    bert = BertConfig.from_json_file(str(med_config_file))
    bert.encoder_width = size["vit_dim"]  # as BLIP_Pretrain does
    blip.text_encoder = BertModel(config=bert, add_pooling_layer=False)
    blip.vision_proj = torch.nn.Linear(size["vit_dim"], size["embed_dim"])
    blip.text_proj = torch.nn.Linear(size["bert_hidden"], size["embed_dim"])
    model.blip = blip
    model.preprocess = _transform(size["image_size"])
    model.mlp = MLP(size["bert_hidden"])
    model.mean, model.std = 0.16717362830052426, 1.0333394966054072
    return model.eval()


@torch.no_grad()
def randomize(model, seed: int) -> None:
    """Every weight random and O(1) in effect: a wrongly mapped or transposed key changes the scores."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g)
        if name.endswith("cls_token") or name.endswith("pos_embed"):
            p.copy_(0.5 * r)
        elif p.ndim >= 2:  # Linear [out, in], Conv2d [out, in, k, k], Embedding [n, dim]
            fan_in = p[0].numel() if "embeddings" not in name else 1
            p.copy_(r * fan_in ** -0.5)
        elif "norm" in name.lower() and name.endswith("weight"):
            p.copy_(1.0 + 0.2 * r)
        else:  # biases
            p.copy_(0.1 * r)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".oracle/out")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from sdvg.models.tokenizers import add_blip_tokens, tiny_bert_tokenizer

    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = SIZES[args.size]
    tokenizer = add_blip_tokens(tiny_bert_tokenizer())
    (out / "med_config.json").write_text(json.dumps(med_config(size, len(tokenizer)), indent=2))
    torch.manual_seed(args.seed)
    model = build_package_model(size, tokenizer, out / "med_config.json")
    randomize(model, args.seed)
    torch.save(model.state_dict(), out / "ImageReward.pt")  # what ImageReward.pt holds
    groups = make_frames(out)
    scores = {}
    for prompt in PROMPTS:
        scores[prompt] = {}
        for files in groups.values():
            for f in files:
                s = model.score(prompt, Image.open(out / f))
                assert isinstance(s, float) and math.isfinite(s), s
                scores[prompt][f] = s
    result = {
        "format": 1,
        "size": args.size,
        "config": dict(size, vocab_size=len(tokenizer)),
        "weights": "ImageReward.pt",
        "med_config": "med_config.json",
        "groups": groups,
        "prompts": PROMPTS,
        "scores": scores,
        "versions": {p: metadata.version(p) for p in ("image-reward", "transformers", "torch", "torchvision", "timm",
                                                      "pillow")},
        "seconds": round(time.perf_counter() - t0, 2),
    }
    (out / "scores.json").write_text(json.dumps(result, indent=2))
    flat = [s for per in scores.values() for s in per.values()]
    print(f"reward oracle: {len(flat)} scores from image-reward {result['versions']['image-reward']} "
          f"(transformers {result['versions']['transformers']}), size {args.size}, range "
          f"[{min(flat):.3f}, {max(flat):.3f}], std {float(np.std(flat)):.3f}, {result['seconds']} s -> {out}")
    return result


if __name__ == "__main__":
    main()
