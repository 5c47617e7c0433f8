"""Wan's original umT5 checkpoint (`models_t5_umt5-xxl-enc-bf16.pth` of `Wan-AI/Wan2.1-T2V-1.3B`),
read into transformers' `UMT5EncoderModel`.

Wan's `wan/modules/t5.py` (`T5Encoder` with `shared_pos=False`: umT5 has a relative position bias per
block) names the encoder's weights as below; transformers' names are on the right. Every Linear is
bias-free in both; Wan's feed-forward is `fc2(fc1(x) * gelu_tanh(gate(x)))`, transformers' gated-gelu
`wo(gelu_new(wi_0(x)) * wi_1(x))`, so `gate.0` is `wi_0` and `fc1` is `wi_1`.

| Wan (`T5Encoder`) | transformers (`UMT5EncoderModel`) |
|---|---|
| `token_embedding.weight` | `shared.weight` (= `encoder.embed_tokens.weight`, tied) |
| `blocks.N.norm1.weight` | `encoder.block.N.layer.0.layer_norm.weight` |
| `blocks.N.attn.{q,k,v,o}.weight` | `encoder.block.N.layer.0.SelfAttention.{q,k,v,o}.weight` |
| `blocks.N.pos_embedding.embedding.weight` | `encoder.block.N.layer.0.SelfAttention.relative_attention_bias.weight` |
| `blocks.N.norm2.weight` | `encoder.block.N.layer.1.layer_norm.weight` |
| `blocks.N.ffn.gate.0.weight` | `encoder.block.N.layer.1.DenseReluDense.wi_0.weight` |
| `blocks.N.ffn.fc1.weight` | `encoder.block.N.layer.1.DenseReluDense.wi_1.weight` |
| `blocks.N.ffn.fc2.weight` | `encoder.block.N.layer.1.DenseReluDense.wo.weight` |
| `norm.weight` | `encoder.final_layer_norm.weight` |

The file is read with `torch.load(weights_only=True)` and must be a flat dict of tensors.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from sdvg.config import TextEncoderConfig
from sdvg.models.checkpoints import CheckpointError, _read_file, check_weights, load_strict

WAN_UMT5_FILE = "models_t5_umt5-xxl-enc-bf16.pth"  # its name in Wan-AI/Wan2.1-T2V-1.3B (and -14B)
WAN_UMT5_TOKENIZER = "google/umt5-xxl"  # the tokenizer folder beside it

_BLOCK = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}
_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.(.+)$")


def is_original_umt5(state: dict) -> bool:
    """Wan's key layout: a `token_embedding` and per-block `attn` weights."""
    return "token_embedding.weight" in state and any(k.endswith(".attn.q.weight") for k in state)


def original_to_transformers(state: dict[str, torch.Tensor], source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Wan's umT5 encoder keys -> `UMT5EncoderModel` keys (the table in the module docstring)."""
    out = {}
    for key, value in state.items():
        m = _BLOCK_RE.match(key)
        if key == "token_embedding.weight":
            out["shared.weight"] = out["encoder.embed_tokens.weight"] = value
        elif key == "norm.weight":
            out["encoder.final_layer_norm.weight"] = value
        elif m and m.group(2) in _BLOCK:
            out[f"encoder.block.{m.group(1)}.{_BLOCK[m.group(2)]}"] = value
        else:
            raise CheckpointError(f"{source}: unexpected key {key!r} in a Wan umT5 checkpoint (expected "
                                  "token_embedding, blocks.N.{norm1,attn.*,pos_embedding,norm2,ffn.*}, norm)")
    return out


def read_original_umt5(path: str | Path) -> dict[str, torch.Tensor]:
    """The flat dict of tensors of a Wan umT5 `.pth` (weights_only), every tensor floating and finite."""
    path = Path(path)
    state = _read_file(path)
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: entries {bad[:5]} are not tensors; Wan's umT5 file is a flat dict of "
                              f"tensors ({WAN_UMT5_FILE})")
    if not is_original_umt5(state):
        raise CheckpointError(f"{path} is not Wan's umT5 encoder (no token_embedding.weight / blocks.N.attn.q.weight "
                              f"keys); give {WAN_UMT5_FILE} or a transformers UMT5 folder")
    check_weights(state, path)
    return state


def config_of(state: dict[str, torch.Tensor]) -> TextEncoderConfig:
    """The encoder's sizes, read from the weights' shapes."""
    vocab, d_model = state["token_embedding.weight"].shape
    layers = 1 + max(int(m.group(1)) for k in state if (m := _BLOCK_RE.match(k)))
    buckets_heads = state["blocks.0.pos_embedding.embedding.weight"].shape
    heads = buckets_heads[1]
    return TextEncoderConfig(d_model=d_model, d_ff=state["blocks.0.ffn.fc1.weight"].shape[0], num_layers=layers,
                             num_heads=heads, d_kv=state["blocks.0.attn.q.weight"].shape[0] // heads,
                             vocab_size=vocab)


def build_umt5(config: TextEncoderConfig, num_buckets: int = 32, dtype: torch.dtype = torch.float32):
    """An `UMT5EncoderModel` of umT5-XXL's kind (gated tanh-GELU, 32 buckets up to distance 128, eps 1e-6)
    with `config`'s sizes, in `dtype`, its weights allocated on the CPU but not initialised (every one is
    loaded next: no 20 GB fp32 random init of umT5-XXL)."""
    from transformers import UMT5Config, UMT5EncoderModel

    hf = UMT5Config(vocab_size=config.vocab_size, d_model=config.d_model, d_kv=config.d_kv, d_ff=config.d_ff,
                    num_layers=config.num_layers, num_heads=config.num_heads, feed_forward_proj="gated-gelu",
                    dense_act_fn="gelu_new", relative_attention_num_buckets=num_buckets,
                    relative_attention_max_distance=128, layer_norm_epsilon=1e-6, is_encoder_decoder=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = UMT5EncoderModel(hf)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied input embeddings (shared, encoder.embed_tokens) a tensor each
    if model.encoder.embed_tokens.weight is not model.shared.weight:
        model.encoder.embed_tokens.weight = model.shared.weight
    return model


def load_original_umt5(path: str | Path, config: TextEncoderConfig | None = None):
    """A `UMT5EncoderModel` holding Wan's umT5 `.pth` exactly (created in the file's dtype, strict keys and
    shapes). `config`: the preset's sizes (None: read from the file)."""
    state = read_original_umt5(path)
    own = config_of(state)
    cfg = config or own
    dtype = state["token_embedding.weight"].dtype
    model = build_umt5(cfg, state["blocks.0.pos_embedding.embedding.weight"].shape[0], dtype)
    load_strict(model, original_to_transformers(state, str(path)), str(path),
                describe_size=f"the file is a umT5 of d_model {own.d_model}, {own.num_layers} layers, d_ff {own.d_ff}; "
                              f"the preset's has d_model {cfg.d_model}, {cfg.num_layers} layers, d_ff {cfg.d_ff}")
    return model.eval()
