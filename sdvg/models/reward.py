"""ImageReward router: transformers' BLIP vision and text models plus sdvg's score head, batched, offline.

ImageReward is BLIP's ViT-L/16 (transformers `BlipVisionModel`), BLIP's BERT whose layers cross-attend
to the image embeddings (`BlipTextModel`, the port of BLIP's med.py), and an MLP head on the [CLS]
feature. `ImageReward.pt` (the `image-reward` package's state dict) is read through a documented key
map (`KEY_MAP`, also in docs/checkpoints.md) with strict key checking; the package itself is only a
test oracle in an environment of its own (scripts/reward_oracle.sh).

One forward scores every frame of a block; the prompt is tokenised once per prompt and its
ids/mask reused across frames and blocks. Preprocessing (the package's PIL path: 8-bit levels, short
side to 224 bicubic in two rounded passes, centre crop, CLIP mean/std) runs on tensors on the model's
device.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from sdvg.config import RewardConfig
from sdvg.models.checkpoints import CheckpointError, _mismatches, _read_file, _unwrap, check_weights, load_strict
from sdvg.models.tokenizers import (BERT_BASE_UNCASED_VOCAB, add_blip_tokens, check_vocab_size, load_bert_tokenizer,
                                    tiny_bert_tokenizer)

REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MED_CONFIG = "med_config.json"

# ------------------------------------------------------------------ key map
# ImageReward.pt key (the image-reward package's names) -> key of `ImageRewardModel`. `{n}` is a layer
# index; a row ending in "." renames a prefix (the rest, e.g. `weight` / `bias`, is kept). The ViT is
# timm-style in the package and transformers' `BlipVisionModel` here (both fuse q, k and v into one
# `qkv` Linear with the same [3 * dim, dim] row order); the text encoder is BLIP's med.py BERT in the
# package and transformers' `BlipTextModel` here, which keeps med.py's module names; the head keeps the
# package's `mlp.layers.{0,2,4,6,7}` (its dropouts sit at 1, 3 and 5).
KEY_MAP: tuple[tuple[str, str], ...] = (
    ("blip.visual_encoder.cls_token", "visual_encoder.embeddings.class_embedding"),
    ("blip.visual_encoder.pos_embed", "visual_encoder.embeddings.position_embedding"),
    ("blip.visual_encoder.patch_embed.proj.", "visual_encoder.embeddings.patch_embedding."),
    ("blip.visual_encoder.blocks.{n}.norm1.", "visual_encoder.encoder.layers.{n}.layer_norm1."),
    ("blip.visual_encoder.blocks.{n}.attn.qkv.", "visual_encoder.encoder.layers.{n}.self_attn.qkv."),
    ("blip.visual_encoder.blocks.{n}.attn.proj.", "visual_encoder.encoder.layers.{n}.self_attn.projection."),
    ("blip.visual_encoder.blocks.{n}.norm2.", "visual_encoder.encoder.layers.{n}.layer_norm2."),
    ("blip.visual_encoder.blocks.{n}.mlp.fc1.", "visual_encoder.encoder.layers.{n}.mlp.fc1."),
    ("blip.visual_encoder.blocks.{n}.mlp.fc2.", "visual_encoder.encoder.layers.{n}.mlp.fc2."),
    ("blip.visual_encoder.norm.", "visual_encoder.post_layernorm."),
    # embeddings.{word,position}_embeddings, embeddings.LayerNorm, encoder.layer.{n}.attention.self.
    # {query,key,value}, .attention.output.{dense,LayerNorm}, .crossattention.* (the same two),
    # .intermediate.dense, .output.{dense,LayerNorm}: the same names on both sides
    ("blip.text_encoder.", "text_encoder."),
    ("mlp.layers.", "mlp.layers."),
)
# In the file but not loaded: BLIP's image-text retrieval projections (the score does not use them)
# and the text encoder's position_ids buffer (checked to be 0, 1, 2, ...; transformers recomputes it).
UNUSED_PREFIXES = ("blip.vision_proj.", "blip.text_proj.")
POSITION_IDS = "blip.text_encoder.embeddings.position_ids"


def _pattern(template: str) -> re.Pattern:
    body = re.escape(template).replace(re.escape("{n}"), r"(?P<n>\d+)")
    return re.compile("^" + body + ("" if template.endswith(".") else "$"))


_FORWARD = [(_pattern(src), dst) for src, dst in KEY_MAP]
_BACKWARD = [(_pattern(dst), src) for src, dst in KEY_MAP]


def _rename(key: str, table) -> str | None:
    for pat, template in table:
        m = pat.match(key)
        if m:
            new = template.replace("{n}", m.group("n")) if "n" in pat.groupindex else template
            return new + key[m.end():]
    return None


def package_to_sdvg(key: str) -> str | None:
    """The `ImageRewardModel` key of an ImageReward.pt key (None: no row of `KEY_MAP` names it)."""
    return _rename(key, _FORWARD)


def sdvg_to_package(key: str) -> str:
    """The ImageReward.pt key of an `ImageRewardModel` key."""
    name = _rename(key, _BACKWARD)
    if name is None:
        raise KeyError(f"{key!r} has no ImageReward.pt name in KEY_MAP")
    return name


# ------------------------------------------------------------------- model
def med_config_path() -> Path:
    return Path(str(resources.files("sdvg") / "assets" / MED_CONFIG))


_MED_SIZES = {"hidden_size": "bert_hidden", "num_hidden_layers": "bert_layers", "num_attention_heads": "bert_heads",
              "intermediate_size": "bert_intermediate"}


def _read_med_config(med_config) -> tuple[dict, bool]:
    """(the med_config.json dict, whether it is the user's) from a path, a dict or None (the shipped copy)."""
    if med_config is None:
        return json.loads(med_config_path().read_text()), False
    if isinstance(med_config, dict):
        return dict(med_config), True
    path = Path(med_config)
    if not path.is_file():
        raise FileNotFoundError(f"med_config {path} does not exist")
    return json.loads(path.read_text()), True


def text_config(cfg: RewardConfig, tokenizer, med_config=None):
    """transformers' `BlipTextConfig` of ImageReward's BERT: the sizes of `cfg`, everything else from
    med_config.json (the shipped copy by default; a given one must agree with `cfg` on the sizes)."""
    from transformers import BlipTextConfig

    med, given = _read_med_config(med_config)
    want = {k: getattr(cfg, v) for k, v in _MED_SIZES.items()} | {"vocab_size": len(tokenizer)}
    if given:
        for k, v in want.items():
            if k in med and med[k] != v:
                raise CheckpointError(f"med_config {k}={med[k]} but the model expects {v} (RewardConfig / tokenizer)")
    if med.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(f"med_config position_embedding_type {med['position_embedding_type']!r}: "
                              "ImageReward's BERT uses absolute positions")
    if not med.get("add_cross_attention", False):
        raise CheckpointError("med_config add_cross_attention is false: ImageReward's BERT cross-attends to the image")
    return BlipTextConfig(
        **want, encoder_hidden_size=cfg.vit_dim,  # BLIP sets encoder_width to the ViT width
        max_position_embeddings=med.get("max_position_embeddings", 512), hidden_act=med.get("hidden_act", "gelu"),
        layer_norm_eps=med.get("layer_norm_eps", 1e-12), hidden_dropout_prob=med.get("hidden_dropout_prob", 0.0),
        attention_probs_dropout_prob=med.get("attention_probs_dropout_prob", 0.0),
        pad_token_id=med.get("pad_token_id", 0), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.sep_token_id, sep_token_id=tokenizer.sep_token_id,
        is_decoder=True,  # BlipTextModel builds the cross-attention layers of decoder configs; the forward
        initializer_range=0.02,  # stays bidirectional (is_decoder=False there), as med.py's `multimodal` mode
    )


def vision_config(cfg: RewardConfig):
    """transformers' `BlipVisionConfig` of ImageReward's ViT (BLIP `vit='large'`: timm ViT, LayerNorm eps
    1e-6, exact GELU, MLP ratio 4, qkv with bias)."""
    from transformers import BlipVisionConfig

    return BlipVisionConfig(hidden_size=cfg.vit_dim, intermediate_size=4 * cfg.vit_dim, num_hidden_layers=cfg.vit_depth,
                            num_attention_heads=cfg.vit_heads, image_size=cfg.image_size, patch_size=cfg.patch_size,
                            hidden_act="gelu", layer_norm_eps=1e-6, attention_dropout=0.0,
                            initializer_range=0.02)  # the package's trunc_normal(std=.02) (transformers: 1e-10)


class RewardHead(nn.Module):
    """ImageReward's score head: five Linear layers, no activations (its dropouts are identities here
    and kept only so that the layer indices are the package's)."""

    def __init__(self, width: int):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(width, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                                    nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))
        for name, p in self.layers.named_parameters():  # the package's initialisation
            if name.endswith("weight"):
                nn.init.normal_(p, mean=0.0, std=1.0 / (width + 1))
            else:
                nn.init.zeros_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ImageRewardModel(nn.Module):
    """ImageReward: `visual_encoder` (BlipVisionModel), `text_encoder` (BlipTextModel cross-attending to
    the image), `mlp` (RewardHead); `tokenizer` is BLIP's BERT tokenizer."""

    def __init__(self, cfg: RewardConfig, tokenizer, med_config=None):
        from transformers import BlipTextModel, BlipVisionModel

        super().__init__()
        self.config = cfg
        self.tokenizer = tokenizer
        self.visual_encoder = BlipVisionModel(vision_config(cfg))
        self.text_encoder = BlipTextModel(text_config(cfg, tokenizer, med_config), add_pooling_layer=False)
        self.mlp = RewardHead(cfg.bert_hidden)

    def forward(self, images: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                rows: list[int] | None = None) -> torch.Tensor:
        """images [N, 3, S, S] (preprocessed), ids/mask [1, L] (or [N, L]: each image's own prompt) -> normalised
        scores float32 [N]. `rows`: several videos' frames in one call (sdvg/generation/batching.py), each video's
        count in order; the head (linears over a few rows, whose kernel the row count may change) then runs per
        video, as alone."""
        n = images.shape[0]
        image_embeds = self.visual_encoder(pixel_values=images).last_hidden_state  # [N, P, vit_dim]
        # every image token is attended to (the package's all-ones encoder mask adds zeros)
        out = self.text_encoder(input_ids=ids.expand(n, -1), attention_mask=mask.expand(n, -1),
                                encoder_hidden_states=image_embeds)
        feats = out.last_hidden_state[:, 0, :].float()  # [CLS]
        raw = self.mlp(feats) if rows is None else torch.cat([self.mlp(f) for f in feats.split(rows)])
        return ((raw - REWARD_MEAN) / REWARD_STD).squeeze(-1).float()


def build_image_reward(cfg: RewardConfig, tokenizer, med_config=None) -> ImageRewardModel:
    """An ImageReward model of the given size (random weights until loaded), built without any download.
    `med_config`: ImageReward's med_config.json (path or dict); default, the copy in sdvg/assets."""
    return ImageRewardModel(cfg, tokenizer, med_config).eval()


def reward_tokenizer(cfg: RewardConfig, folder=None, tiny: bool = False):
    tok = add_blip_tokens(tiny_bert_tokenizer() if tiny else load_bert_tokenizer(folder))
    check_vocab_size(tok, cfg.vocab_size or BERT_BASE_UNCASED_VOCAB + 2, "ImageReward BERT")
    return tok


def _size_hint(cfg: RewardConfig) -> str:
    return (f"not an ImageReward model of this size: ViT width {cfg.vit_dim}, {cfg.vit_depth} blocks; BERT width "
            f"{cfg.bert_hidden}, {cfg.bert_layers} layers")


def load_image_reward_weights(model: ImageRewardModel, path: str | Path) -> None:
    """ImageReward.pt from a local path (weights_only), renamed by `KEY_MAP`, strictly: every model key
    present, no key the map does not name, every shape equal, every loaded tensor floating and finite.
    Errors name the file's keys."""
    state = dict(_unwrap(_read_file(Path(path)), str(path)))
    if not any(k.startswith("blip.visual_encoder.") for k in state):
        raise CheckpointError(f"{path} is not an ImageReward checkpoint (no blip.visual_encoder.* keys)")
    pos = state.pop(POSITION_IDS, None)  # some exports drop this buffer
    if pos is not None and not torch.equal(pos.reshape(-1).long(), torch.arange(pos.numel())):
        raise CheckpointError(f"{path}: {POSITION_IDS} is not 0, 1, 2, ...; sdvg uses absolute positions")
    for k in [k for k in state if k.startswith(UNUSED_PREFIXES)]:
        del state[k]
    check_weights(state, path)
    own = model.state_dict()
    _mismatches({sdvg_to_package(k): tuple(v.shape) for k, v in own.items()}, state, str(path), _size_hint(model.config))
    load_strict(model, {package_to_sdvg(k): v for k, v in state.items()}, str(path), _size_hint(model.config))


def save_image_reward_weights(model: ImageRewardModel, path: str | Path) -> None:
    """Write `model` as ImageReward.pt is written (`torch.save` of a state dict with the package's key
    names, position_ids included); the unused retrieval projections are not written."""
    state = {sdvg_to_package(k): v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    n = model.text_encoder.config.max_position_embeddings
    state[POSITION_IDS] = torch.arange(n).unsqueeze(0)
    torch.save(state, Path(path))


# ---------------------------------------------------------------- aggregation
@dataclass(frozen=True)
class Aggregator:
    """Per-frame scores -> block score. `min` is the method's worst-frame rule."""

    kind: str  # one of sdvg.options.AGGREGATIONS (checked there, with the other options)
    trim: float = 0.2  # trimmed_mean: fraction cut from each end
    q: float = 0.1  # quantile: the low quantile

    def __call__(self, scores: torch.Tensor) -> float:
        s = scores.float().flatten()
        if s.numel() == 0:
            raise ValueError("cannot aggregate an empty list of frame scores")
        if self.kind == "min":
            return float(s.min())
        if self.kind == "mean":
            return float(s.mean())
        if self.kind == "quantile":
            return float(torch.quantile(s, self.q))
        if self.kind == "trimmed_mean":
            s, _ = torch.sort(s)
            cut = int(self.trim * s.numel())
            return float(s[cut:s.numel() - cut].mean() if s.numel() - 2 * cut > 0 else s.mean())
        raise ValueError(f"unknown aggregation {self.kind!r}; see sdvg.options.AGGREGATIONS")


# --------------------------------------------------------------------- router
@dataclass
class PromptTokens:
    ids: torch.Tensor  # [1, max_text_len]
    mask: torch.Tensor  # [1, max_text_len]


class RewardScorer:
    """Batched ImageReward scoring of decoded frames."""

    def __init__(self, model: ImageRewardModel, config: RewardConfig):
        self.model = model.eval()
        self.model.mlp.float()  # the score head runs in fp32 whatever the encoders' precision
        self.config = config
        self._tokens: dict[str, PromptTokens] = {}  # per-prompt tokenisation, explicit and bounded by use

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.visual_encoder.parameters()).dtype

    def to(self, device, dtype=torch.float32) -> "RewardScorer":
        self.model.to(device=device, dtype=dtype)
        self.model.mlp.float()
        self._tokens.clear()
        return self

    def tokens(self, prompt: str) -> PromptTokens:
        if prompt not in self._tokens:
            t = self.model.tokenizer(prompt, padding="max_length", truncation=True,
                                     max_length=self.config.max_text_len, return_tensors="pt")
            self._tokens[prompt] = PromptTokens(t.input_ids.to(self.device), t.attention_mask.to(self.device))
        return self._tokens[prompt]

    def preprocess(self, frames: torch.Tensor) -> torch.Tensor:
        """frames float [N, 3, H, W] in [0, 1] (or uint8 [N, H, W, 3]) -> normalised [N, 3, S, S].

        The package's preprocessing (torchvision on a PIL image) on tensors, on the model's device: the
        frames as 8-bit levels (float frames are rounded to the levels the MP4 holds), torchvision's
        `Resize(S)` size (short side S, long side floor(S * long / short)), PIL's bicubic resampling of
        an 8-bit image (an antialiased horizontal pass, then a vertical one, each rounded and clipped
        to 8 bits), the centre crop and CLIP's mean/std."""
        frames = check_frames(frames)
        if frames.dtype == torch.uint8:  # float64: PIL computes its filter in double (float32 flips more levels)
            x = frames.to(self.device).permute(0, 3, 1, 2).double()
        else:
            x = (frames.to(self.device, torch.float64) * 255.0).round_().clamp_(0, 255)
        S = self.config.image_size
        h, w = x.shape[-2:]
        nh, nw = (int(S * h / w), S) if w <= h else (S, int(S * w / h))
        if nw != w:
            x = _resample_8bit(x, (h, nw))
        if nh != h:
            x = _resample_8bit(x, (nh, nw))
        top, left = int(round((nh - S) / 2.0)), int(round((nw - S) / 2.0))
        x = x[..., top:top + S, left:left + S].float() / 255.0
        mean = torch.tensor(CLIP_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(CLIP_STD, device=x.device).view(1, 3, 1, 1)
        return ((x - mean) / std).to(self.dtype)

    @torch.no_grad()
    def score(self, prompt: str, frames: torch.Tensor) -> torch.Tensor:
        """Normalised ImageReward of every frame, one forward: float32 [N]."""
        images = self.preprocess(frames)
        tok = self.tokens(prompt)
        return self.score_images(images, tok.ids, tok.mask)

    def score_images(self, images: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                     rows: list[int] | None = None) -> torch.Tensor:
        """images [N, 3, S, S] (preprocessed), ids/mask [1, L] or [N, L] -> normalised scores float32 [N] (`rows`:
        see `ImageRewardModel.forward`)."""
        return self.model(images, ids, mask) if rows is None else self.model(images, ids, mask, rows)


def _resample_8bit(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """One pass of PIL's bicubic resampling of 8-bit levels (float, 0..255): torch's antialiased bicubic
    is PIL's kernel (a = -0.5, support scaled when downsampling); PIL rounds and clips each pass."""
    return F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True).clamp_(0, 255).round_()


def check_frames(frames) -> torch.Tensor:
    if not isinstance(frames, torch.Tensor):
        raise TypeError(f"frames must be a torch.Tensor, got {type(frames).__name__}")
    if frames.numel() == 0 or frames.shape[0] == 0:
        raise ValueError("no frames to score: the frame batch is empty")
    if frames.dtype == torch.uint8:
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"uint8 frames must be [N, H, W, 3], got {list(frames.shape)}")
        return frames
    if not frames.is_floating_point():
        raise TypeError(f"frames must be uint8 [N, H, W, 3] or float [N, 3, H, W] in [0, 1], got {frames.dtype}")
    if frames.ndim != 4 or frames.shape[1] != 3:
        raise ValueError(f"float frames must be [N, 3, H, W], got {list(frames.shape)}")
    lo, hi = float(frames.min()), float(frames.max())
    if lo < -1e-3 or hi > 1 + 1e-3:
        raise ValueError(f"float frames must lie in [0, 1], got values in [{lo:.3g}, {hi:.3g}]")
    return frames

