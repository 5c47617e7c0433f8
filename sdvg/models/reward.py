"""ImageReward router: the `image-reward` package's model classes, scored in batches, offline.

One forward scores every frame of a block; the prompt is tokenised once per prompt and its
ids/mask reused across frames and blocks. Preprocessing (short side to 224 bicubic, centre crop,
CLIP mean/std) runs on tensors on the model's device.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from sdvg.models.checkpoints import CheckpointError, _read_file, _unwrap, load_strict
from sdvg.config import RewardConfig
from sdvg.models.tokenizers import (BERT_BASE_UNCASED_VOCAB, add_blip_tokens, check_vocab_size, load_bert_tokenizer,
                             tiny_bert_tokenizer)

REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MED_CONFIG = "med_config.json"


def med_config_path() -> Path:
    return Path(str(resources.files("sdvg") / "assets" / MED_CONFIG))


def _med_config(cfg: RewardConfig, vocab_size: int):
    from ImageReward.models.BLIP.med import BertConfig

    base = json.loads(med_config_path().read_text())
    base.update(hidden_size=cfg.bert_hidden, num_hidden_layers=cfg.bert_layers, num_attention_heads=cfg.bert_heads,
                intermediate_size=cfg.bert_intermediate, vocab_size=vocab_size)
    bert = BertConfig(**base)
    bert.encoder_width = cfg.vit_dim  # BLIP overrides it with the ViT width
    return bert


def build_image_reward(cfg: RewardConfig, tokenizer, device="cpu"):
    """An `ImageReward.ImageReward` of the given size, built without any download."""
    from ImageReward.ImageReward import MLP, ImageReward, _transform
    from ImageReward.models.BLIP.blip_pretrain import BLIP_Pretrain
    from ImageReward.models.BLIP.med import BertModel
    from ImageReward.models.BLIP.vit import VisionTransformer

    model = ImageReward.__new__(ImageReward)
    torch.nn.Module.__init__(model)
    model.device = device
    blip = BLIP_Pretrain.__new__(BLIP_Pretrain)
    torch.nn.Module.__init__(blip)
    blip.visual_encoder = VisionTransformer(img_size=cfg.image_size, patch_size=cfg.patch_size, embed_dim=cfg.vit_dim,
                                            depth=cfg.vit_depth, num_heads=cfg.vit_heads, drop_path_rate=0.0)
    blip.tokenizer = tokenizer
    blip.text_encoder = BertModel(config=_med_config(cfg, len(tokenizer)), add_pooling_layer=False)
    blip.vision_proj = torch.nn.Linear(cfg.vit_dim, cfg.embed_dim)
    blip.text_proj = torch.nn.Linear(cfg.bert_hidden, cfg.embed_dim)
    model.blip = blip
    model.preprocess = _transform(cfg.image_size)
    model.mlp = MLP(cfg.bert_hidden)
    model.mean, model.std = REWARD_MEAN, REWARD_STD
    return model.eval()


def reward_tokenizer(cfg: RewardConfig, folder=None, tiny: bool = False):
    tok = add_blip_tokens(tiny_bert_tokenizer() if tiny else load_bert_tokenizer(folder))
    check_vocab_size(tok, cfg.vocab_size or BERT_BASE_UNCASED_VOCAB + 2, "ImageReward BERT")
    return tok


def load_image_reward_weights(model, path: str | Path) -> None:
    """ImageReward.pt from a local path: weights_only, strict keys (position_ids may be absent)."""
    state = _unwrap(_read_file(Path(path)), str(path))
    if not any(k.startswith("blip.visual_encoder.") for k in state):
        raise CheckpointError(f"{path} is not an ImageReward checkpoint (no blip.visual_encoder.* keys)")
    own = model.state_dict()
    for k in own:  # a recomputable buffer that some exports drop
        if k.endswith("embeddings.position_ids") and k not in state:
            state[k] = own[k]
    load_strict(model, state, str(path), describe_size="not an ImageReward model of this size")


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

    def __init__(self, model, config: RewardConfig):
        self.model = model.eval()
        self.model.mlp.float()  # the score head runs in fp32 whatever the encoders' precision
        self.config = config
        self._tokens: dict[str, PromptTokens] = {}  # per-prompt tokenisation, explicit and bounded by use

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.blip.visual_encoder.parameters()).dtype

    def to(self, device, dtype=torch.float32) -> "RewardScorer":
        self.model.to(device=device, dtype=dtype)
        self.model.mlp.float()
        self.model.device = torch.device(device)
        self._tokens.clear()
        return self

    def tokens(self, prompt: str) -> PromptTokens:
        if prompt not in self._tokens:
            t = self.model.blip.tokenizer(prompt, padding="max_length", truncation=True,
                                          max_length=self.config.max_text_len, return_tensors="pt")
            self._tokens[prompt] = PromptTokens(t.input_ids.to(self.device), t.attention_mask.to(self.device))
        return self._tokens[prompt]

    def preprocess(self, frames: torch.Tensor) -> torch.Tensor:
        """frames float [N, 3, H, W] in [0, 1] (or uint8 [N, H, W, 3]) -> normalised [N, 3, S, S]."""
        frames = check_frames(frames)
        if frames.dtype == torch.uint8:
            frames = frames.permute(0, 3, 1, 2).float() / 255.0
        x = frames.to(self.device, torch.float32)
        S = self.config.image_size
        h, w = x.shape[-2:]
        scale = S / min(h, w)
        nh, nw = max(S, round(h * scale)), max(S, round(w * scale))
        if (nh, nw) != (h, w):
            x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
        top, left = int(round((nh - S) / 2.0)), int(round((nw - S) / 2.0))
        x = x[..., top:top + S, left:left + S].clamp(0, 1)
        mean = torch.tensor(CLIP_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(CLIP_STD, device=x.device).view(1, 3, 1, 1)
        return ((x - mean) / std).to(self.dtype)

    @torch.no_grad()
    def score(self, prompt: str, frames: torch.Tensor) -> torch.Tensor:
        """Normalised ImageReward of every frame, one forward: float32 [N]."""
        images = self.preprocess(frames)
        tok = self.tokens(prompt)
        return self.score_images(images, tok.ids, tok.mask)

    def score_images(self, images: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """images [N, 3, S, S] (preprocessed), ids/mask [1, L] -> normalised scores float32 [N]."""
        n = images.shape[0]
        blip = self.model.blip
        image_embeds = blip.visual_encoder(images)  # [N, P, vit_dim]
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=images.device)
        out = blip.text_encoder(ids.expand(n, -1), attention_mask=mask.expand(n, -1),
                                encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts,
                                return_dict=True)
        feats = out.last_hidden_state[:, 0, :].float()
        raw = self.model.mlp(feats)
        return ((raw - REWARD_MEAN) / REWARD_STD).squeeze(-1).float()


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

