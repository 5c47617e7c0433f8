"""Frozen model configurations and the named presets (the generation options live in `sdvg.options`).

Every size the engine allocates comes from here, so a config is validated before any
heavy allocation (`Preset.validate`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Literal

Precision = Literal["fp32", "bf16", "fp16"]

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the value and the fix."""


class MemoryBudgetError(MemoryError):
    """What is about to be allocated does not fit the device's free memory or the given budget; raised
    before allocating (`KVCacheSpec.allocate`, and `sdvg.models.memory.check_budget`, which `prepare`
    runs for each video)."""


INT64_MAX = 2**63 - 1  # the largest size the native core (int64) and torch can hold
MAX_BUDGET_GIB = float(2**33)  # 2^63 bytes: the largest memory budget a size can be compared with


def checked_size(what: str, *factors: int) -> int:
    """The product of `factors` (exact: Python integers), refused (ConfigError) when a factor is negative or
    the product passes 2^63 - 1, the largest size the native core and torch hold; the message names the
    value and its factors."""
    out = 1
    for f in factors:
        if isinstance(f, bool) or not isinstance(f, int):
            raise ConfigError(f"{what}: factor {f!r} is not an integer")
        if f < 0:
            raise ConfigError(f"{what}: factor {f} is negative")
        out *= f
    if out > INT64_MAX:
        shown = " x ".join(str(f) for f in factors)
        raise ConfigError(f"{what} = {shown} = {out:.4g} passes 2^63 - 1 ({INT64_MAX}), the largest size a device "
                          "can be asked for; use fewer blocks, a local window or smaller shapes")
    return out


def torch_dtype(precision: Precision):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def config_hash(obj) -> str:
    """Stable short hash of a (nested) frozen dataclass."""
    blob = json.dumps(dataclasses.asdict(obj), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class DiTConfig:
    """Wan2.1 text-to-video DiT (diffusers `WanTransformer3DModel` dimensions)."""

    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    patch_size: tuple[int, int, int] = (1, 2, 2)
    freq_dim: int = 256
    text_dim: int = 4096
    in_channels: int = 16
    out_channels: int = 16
    eps: float = 1e-6
    qk_norm: bool = True
    cross_attn_norm: bool = True
    rope_max_seq_len: int = 1024
    text_len: int = 512  # text tokens the cross-attention sees: embeddings are zero-padded to it (Wan: 512)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def validate(self, role: str) -> None:
        if self.dim % self.num_heads:
            raise ConfigError(f"{role}: dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.head_dim < 6 or self.head_dim % 2:
            raise ConfigError(f"{role}: head_dim {self.head_dim} must be even and >= 6 (3-axis RoPE)")
        if self.text_len < 1:
            raise ConfigError(f"{role}: text_len {self.text_len} must be >= 1 (Wan uses 512)")

    @property
    def wan_sized(self) -> bool:
        """The width of Wan2.1's 1.3B or 14B DiT: its weights expect Wan's conditioning exactly."""
        return self.dim in (1536, 5120)

    def diffusers_kwargs(self) -> dict:
        return dict(
            patch_size=self.patch_size,
            num_attention_heads=self.num_heads,
            attention_head_dim=self.head_dim,
            in_channels=self.in_channels,
            out_channels=self.out_channels,
            text_dim=self.text_dim,
            freq_dim=self.freq_dim,
            ffn_dim=self.ffn_dim,
            num_layers=self.num_layers,
            cross_attn_norm=self.cross_attn_norm,
            qk_norm="rms_norm_across_heads" if self.qk_norm else None,
            eps=self.eps,
            rope_max_seq_len=self.rope_max_seq_len,
        )

    def num_params(self) -> int:
        d, f, L, p = self.dim, self.ffn_dim, self.num_layers, math.prod(self.patch_size)
        per_block = 8 * (d * d + d) + 2 * d * 2 + (d * f + f) + (f * d + d) + 2 * d + 6 * d
        embed = self.in_channels * p * d + d + self.text_dim * d + d + d * d + d + self.freq_dim * d + d
        embed += d * d + d + d * 6 * d + 6 * d
        head = d * self.out_channels * p + self.out_channels * p + 2 * d
        return L * per_block + embed + head


@dataclass(frozen=True)
class KVWindow:
    """Local attention: keep `window_frames` recent frames plus `sink_frames` first frames.
    `window_frames = 0` keeps the whole video. `slack_frames` makes rollbacks that deep exact."""

    window_frames: int = 0
    sink_frames: int = 0
    slack_frames: int = 0


CONTEXT_MODES: tuple[str, ...] = ("full", "recompute")
# How a random-weight preset's DiTs are drawn (sdvg.models.components.build_random): "cpu" with the CPU generator
# (one model for a seed on every device), "device" with the generator of the device they are built for (fast:
# no host draw, but another model per device type).
RANDOM_INITS: tuple[str, ...] = ("cpu", "device")


def check_random_init(random_init) -> str:
    if random_init not in RANDOM_INITS:
        raise ConfigError(f"random_init {random_init!r} is not one of {RANDOM_INITS}: 'cpu' draws the random weights "
                          "with the CPU generator (one model for a seed on every device), 'device' with the device's own "
                          "(no host draw, another model per device type)")
    return random_init
# The streaming VAE decoder's temporal-upsample cache rule (sdvg.models.vae): Wan2.1's or Krea's.
VAE_DECODERS: tuple[str, ...] = ("wan", "krea")


@dataclass(frozen=True)
class RoleContext:
    """How one DiT's KV cache holds the video's history (one per role, resolved from the preset and
    the generation options).

    full: every committed block stays in the cache (or `window` frames plus sink frames); the block
      is denoised at its absolute frame index with the preset's `timesteps`, then a clean t = 0
      forward commits it (Self-Forcing's inference).
    recompute: before each block the cache is rebuilt by one t = 0 forward over at most
      `kv_cache_frames` clean context frames positioned from 0 (block-causal among them), and the
      block is denoised right after them with the preset's `recompute_timesteps`; committing a block
      only records its latents (Krea Realtime Video's inference). The first context frame is latent
      frame 0 while the context still reaches it (always, with `keep_first_frame`); after that it is
      the oldest emitted pixel frame of a `1 + (kv_cache_frames - 1) * 4` frame window, re-encoded
      alone by the VAE encoder."""

    mode: str = "full"
    kv_cache_frames: int = 3
    keep_first_frame: bool = False
    window: KVWindow = KVWindow()  # full only

    def __post_init__(self):
        if self.mode not in CONTEXT_MODES:
            raise ConfigError(f"unknown context mode {self.mode!r}; choose one of {', '.join(CONTEXT_MODES)}")
        if isinstance(self.kv_cache_frames, bool) or not isinstance(self.kv_cache_frames, int) \
                or self.kv_cache_frames < 1:
            raise ConfigError(f"kv_cache_frames {self.kv_cache_frames!r} must be an integer >= 1 (Krea's default: 3)")
        if self.mode == "recompute" and self.window.window_frames:
            raise ConfigError(f"a recompute context already keeps only kv_cache_frames = {self.kv_cache_frames} "
                              f"frames; drop the window (window_frames = {self.window.window_frames}) or use the "
                              "full context")

    @property
    def recompute(self) -> bool:
        return self.mode == "recompute"

    def cache_frames(self, num_blocks: int, frames_per_block: int) -> int:
        """Latent frames the cache must hold: the whole video (full) or the context plus one block."""
        if self.recompute:
            return self.kv_cache_frames + frames_per_block
        return num_blocks * frames_per_block

    def pixel_window(self, temporal_stride: int = 4) -> int:
        """Emitted pixel frames kept for re-encoding the moving first context frame (Krea's
        `frame_context_cache`): 1 + (kv_cache_frames - 1) * temporal_stride."""
        return 1 + (self.kv_cache_frames - 1) * temporal_stride


@dataclass(frozen=True)
class TextEncoderConfig:
    """umT5 encoder (transformers `UMT5EncoderModel`)."""

    d_model: int = 4096
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    d_kv: int = 64
    vocab_size: int = 256384
    text_len: int = 512  # prompt tokens: truncated to it, and the embeddings zero-padded to it

    def validate(self) -> None:
        if self.text_len < 1:
            raise ConfigError(f"text encoder text_len {self.text_len} must be >= 1 (Wan uses 512)")


@dataclass(frozen=True)
class VAEConfig:
    """Wan2.1 VAE (diffusers `AutoencoderKLWan`)."""

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temporal_downsample: tuple[bool, ...] = (False, True, True)

    @property
    def spatial_stride(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def temporal_stride(self) -> int:
        return 2 ** sum(self.temporal_downsample)


@dataclass(frozen=True)
class RewardConfig:
    """ImageReward: BLIP ViT image encoder + BERT with cross-attention + MLP head."""

    vit_dim: int = 1024
    vit_depth: int = 24
    vit_heads: int = 16
    bert_hidden: int = 768
    bert_layers: int = 12
    bert_heads: int = 12
    bert_intermediate: int = 3072
    vocab_size: int = 30524
    image_size: int = 224
    patch_size: int = 16
    max_text_len: int = 35
    embed_dim: int = 256


@dataclass(frozen=True)
class VideoConfig:
    height: int = 480
    width: int = 832
    frames_per_block: int = 3  # latent frames
    num_blocks: int = 9

    @staticmethod
    def size_multiple(vae: VAEConfig, dit: DiTConfig) -> int:
        """What each side of a video must be a multiple of: the VAE's spatial stride times the DiT's patch."""
        return vae.spatial_stride * dit.patch_size[1]

    def validate(self, vae: VAEConfig, dit: DiTConfig) -> None:
        mult = self.size_multiple(vae, dit)
        for name, v in (("height", self.height), ("width", self.width)):
            if v < mult or v % mult:
                raise ConfigError(f"{name} {v} must be a positive multiple of {mult} (VAE stride x patch size)")
        if self.frames_per_block < 1:
            raise ConfigError(f"frames_per_block {self.frames_per_block} must be >= 1")
        if self.num_blocks < 1:
            raise ConfigError(f"num_blocks {self.num_blocks} must be >= 1")

    def latent_hw(self, vae: VAEConfig) -> tuple[int, int]:
        return self.height // vae.spatial_stride, self.width // vae.spatial_stride

    def tokens_per_frame(self, vae: VAEConfig, dit: DiTConfig) -> int:
        h, w = self.latent_hw(vae)
        return (h // dit.patch_size[1]) * (w // dit.patch_size[2])

    def pixel_frames(self, vae: VAEConfig, num_blocks: int | None = None) -> int:
        """Pixel frames of `num_blocks` blocks: the first latent frame gives 1, each later one `temporal_stride`."""
        latent = self.frames_per_block * (self.num_blocks if num_blocks is None else num_blocks)
        return 1 + vae.temporal_stride * (latent - 1)


@dataclass(frozen=True)
class HubSource:
    """Where a component's published weights live on the Hugging Face Hub: one file, or a folder
    (the files matching `patterns`) of a repo at a revision."""

    repo_id: str
    filename: str | None = None  # None: a folder
    patterns: tuple[str, ...] = ()
    revision: str = "main"


@dataclass(frozen=True)
class PresetSources:
    """The published checkpoints of a real-weight preset, per component."""

    drafter: HubSource
    target: HubSource
    vae: HubSource
    text_encoder: HubSource
    reward: HubSource
    reward_tokenizer: HubSource


@dataclass(frozen=True)
class Preset:
    name: str
    drafter: DiTConfig
    target: DiTConfig
    text_encoder: TextEncoderConfig
    vae: VAEConfig
    reward: RewardConfig
    video: VideoConfig
    precision: Precision = "bf16"
    kv_window: KVWindow = field(default_factory=KVWindow)
    # Denoising steps in the unshifted 0..1000 scale (sdvg.generation.schedule): a full-context role
    # runs `timesteps` then the t = 0 commit (Self-Forcing); a recompute role runs `recompute_timesteps`
    # (Krea's five calls, the last at t = 0).
    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    recompute_timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0, 0.0)
    shift: float = 5.0
    # How each role's KV cache holds history by default (sdvg.config.RoleContext; options override).
    drafter_cache: str = "full"
    target_context: str = "full"
    kv_cache_frames: int = 3
    # The VAE decoder's temporal-upsample cache rule (VAE_DECODERS; the vae_decoder option overrides it):
    # "wan" keeps [previous, current] upsampler inputs (Wan2.1, Self-Forcing, diffusers), "krea" [current,
    # current] (Krea's server); docs/method.md says why "wan" is every preset's default.
    vae_decoder: str = "wan"
    sources: PresetSources | None = None  # None: a random-weight preset

    @property
    def random_weights(self) -> bool:
        return self.sources is None

    def validate(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not one of {PRECISIONS}")
        self.drafter.validate("drafter")
        self.target.validate("target")
        self.text_encoder.validate()
        for role, dit in (("drafter", self.drafter), ("target", self.target)):
            if dit.text_len != 512 and (self.sources is not None or dit.wan_sized):
                why = "loads Wan2.1 weights" if self.sources is not None else f"has Wan2.1's width (dim {dit.dim})"
                raise ConfigError(
                    f"{role} text_len {dit.text_len}: this DiT {why}, and Wan2.1 weights expect the umT5 embeddings "
                    "zero-padded to 512 tokens; set text_len=512 on the DiT and the text encoder"
                )
            if dit.text_len != self.text_encoder.text_len:
                raise ConfigError(
                    f"{role} text_len {dit.text_len} != text encoder text_len {self.text_encoder.text_len}: the DiT "
                    f"attends to the encoder's padded embeddings; set both to the same length (e.g. {dit.text_len})"
                )
            if dit.text_dim != self.text_encoder.d_model:
                raise ConfigError(
                    f"{role} text_dim {dit.text_dim} != text encoder width {self.text_encoder.d_model}"
                )
            if dit.in_channels != self.vae.z_dim or dit.out_channels != self.vae.z_dim:
                raise ConfigError(f"{role} latent channels {dit.in_channels} != VAE z_dim {self.vae.z_dim}")
            if dit.patch_size != self.drafter.patch_size:
                raise ConfigError("drafter and target must use the same patch size")
        self.video.validate(self.vae, self.target)
        if not self.timesteps or any(not 0 < t <= 1000 for t in self.timesteps):
            raise ConfigError(f"timesteps {self.timesteps} must lie in (0, 1000]")
        rt = self.recompute_timesteps
        if not rt or any(not 0 <= t <= 1000 for t in rt) or any(t == 0 for t in rt[:-1]):
            raise ConfigError(f"recompute_timesteps {rt} must lie in [0, 1000], only the last may be 0")
        if self.vae_decoder not in VAE_DECODERS:
            raise ConfigError(f"vae_decoder {self.vae_decoder!r} is not one of {VAE_DECODERS}")
        for name in ("drafter_cache", "target_context"):
            RoleContext(getattr(self, name), self.kv_cache_frames, window=self.kv_window
                        if getattr(self, name) == "full" else KVWindow())

    def replace(self, **changes) -> "Preset":
        return dataclasses.replace(self, **changes)


DRAFTER_1_3B = DiTConfig(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30)
TARGET_14B = DiTConfig(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)
UMT5_XXL = TextEncoderConfig()
WAN_VAE = VAEConfig()
IMAGE_REWARD = RewardConfig()

# The in-memory character BERT tokenizer of the random-weight presets (89 tokens) + [DEC] + [ENC].
TINY_BERT_VOCAB = 89 + 2
_TINY_TEXT = TextEncoderConfig(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=128)

PRESETS: dict[str, Preset] = {
    # Random weights, tiny everything: tests and the demo.
    "tiny": Preset(
        name="tiny",
        drafter=DiTConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=2, text_dim=32),
        target=DiTConfig(dim=64, ffn_dim=128, num_heads=4, num_layers=3, text_dim=32),
        text_encoder=_TINY_TEXT,
        vae=VAEConfig(base_dim=8, num_res_blocks=1),
        reward=RewardConfig(
            vit_dim=32, vit_depth=2, vit_heads=2, bert_hidden=32, bert_layers=2, bert_heads=2,
            bert_intermediate=64, vocab_size=TINY_BERT_VOCAB, embed_dim=16,
        ),
        video=VideoConfig(height=64, width=64, frames_per_block=3, num_blocks=3),
        precision="fp32",
    ),
    # The real models (Self-Forcing 1.3B drafter, Wan2.1 14B target) at 832x480: load real weights.
    "wan2.1": Preset(
        name="wan2.1",
        drafter=DRAFTER_1_3B,
        target=TARGET_14B,
        text_encoder=UMT5_XXL,
        vae=WAN_VAE,
        reward=IMAGE_REWARD,
        video=VideoConfig(),
        precision="bf16",
        target_context="recompute",  # Krea's inference; --target-context full for a full-history target
        sources=PresetSources(
            drafter=HubSource("gdhe17/Self-Forcing", "checkpoints/self_forcing_dmd.pt"),
            target=HubSource("krea/krea-realtime-video", "krea-realtime-video-14b.safetensors"),
            vae=HubSource("Wan-AI/Wan2.1-T2V-1.3B", "Wan2.1_VAE.pth"),
            # Wan's original umT5 file and its tokenizer: the same repo as the VAE (one download)
            text_encoder=HubSource("Wan-AI/Wan2.1-T2V-1.3B",
                                   patterns=("models_t5_umt5-xxl-enc-bf16.pth", "google/umt5-xxl/*")),
            reward=HubSource("THUDM/ImageReward", "ImageReward.pt"),
            reward_tokenizer=HubSource("google-bert/bert-base-uncased",
                                       patterns=("vocab.txt", "tokenizer_config.json", "tokenizer.json",
                                                 "special_tokens_map.json", "config.json")),
        ),
    ),
    # Exact 1.3B / 14B / VAE / ImageReward sizes, random weights, for GPU benchmarks. The text
    # encoder is a 1-layer stand-in of the right width (it runs once per prompt, outside the loop).
    "real-size": Preset(
        name="real-size",
        drafter=DRAFTER_1_3B,
        target=TARGET_14B,
        text_encoder=TextEncoderConfig(d_model=4096, d_ff=256, num_layers=1, num_heads=8, d_kv=64, vocab_size=128),
        vae=WAN_VAE,
        reward=dataclasses.replace(IMAGE_REWARD, vocab_size=TINY_BERT_VOCAB),
        video=VideoConfig(),
        precision="bf16",
        target_context="recompute",
    ),
    # CPU benchmark: drafter:target parameter ratio ~1:9 (1.3B:14B is ~1:10), head_dim 128 like the real
    # models, and a VAE small enough that the target's forwards dominate as they do on a GPU.
    "cpu-bench": Preset(
        name="cpu-bench",
        drafter=DiTConfig(dim=640, ffn_dim=1920, num_heads=5, num_layers=5, text_dim=32),
        target=DiTConfig(dim=1536, ffn_dim=4608, num_heads=12, num_layers=8, text_dim=32),
        text_encoder=_TINY_TEXT,
        vae=VAEConfig(base_dim=4, num_res_blocks=1),
        reward=RewardConfig(
            vit_dim=64, vit_depth=2, vit_heads=2, bert_hidden=64, bert_layers=2, bert_heads=2,
            bert_intermediate=128, vocab_size=TINY_BERT_VOCAB, embed_dim=16,
        ),
        video=VideoConfig(height=64, width=96, frames_per_block=3, num_blocks=9),
        precision="fp32",
    ),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(unknown_preset(name))
    return PRESETS[name]


def unknown_preset(name: str) -> str:
    """The refusal of a name that is no preset: the closest ones, then all of them."""
    from sdvg.names import did_you_mean

    return f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; choose one of {sorted(PRESETS)}"
