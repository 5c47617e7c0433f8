"""Wan's original umT5 checkpoint (`models_t5_umt5-xxl-enc-bf16.pth`) and the `Wan-AI/Wan2.1-T2V-1.3B`
folder as it ships, for the text encoder and the VAE.

The test writes a tiny random encoder in Wan's key layout, spelled out here from Wan's `wan/modules/t5.py`
module tree (`T5Encoder` with `shared_pos=False`), not from sdvg's table, and checks it three ways: the
loaded weights equal the source's, the embeddings equal the same weights loaded from the transformers
format, and a plain forward written from Wan's T5 code over the Wan-layout dict gives the same embeddings."""
import math

import pytest
import torch

from sdvg.config import get_preset
from sdvg.models.checkpoints import CheckpointError
from sdvg.models.text_encoder import TextEncoder
from sdvg.models.tokenizers import tiny_umt5_tokenizer

PROMPT = "a red fox jumps over the snow"


def wan_layout(hf_state: dict, num_layers: int) -> dict:
    """transformers' UMT5EncoderModel weights -> Wan's T5Encoder names (token_embedding, blocks.N.*, norm)."""
    out = {"token_embedding.weight": hf_state["shared.weight"], "norm.weight": hf_state["encoder.final_layer_norm.weight"]}
    for n in range(num_layers):
        a, f = f"encoder.block.{n}.layer.0.", f"encoder.block.{n}.layer.1."
        out.update({
            f"blocks.{n}.norm1.weight": hf_state[a + "layer_norm.weight"],
            **{f"blocks.{n}.attn.{p}.weight": hf_state[f"{a}SelfAttention.{p}.weight"] for p in "qkvo"},
            f"blocks.{n}.pos_embedding.embedding.weight": hf_state[a + "SelfAttention.relative_attention_bias.weight"],
            f"blocks.{n}.norm2.weight": hf_state[f + "layer_norm.weight"],
            f"blocks.{n}.ffn.gate.0.weight": hf_state[f + "DenseReluDense.wi_0.weight"],
            f"blocks.{n}.ffn.fc1.weight": hf_state[f + "DenseReluDense.wi_1.weight"],
            f"blocks.{n}.ffn.fc2.weight": hf_state[f + "DenseReluDense.wo.weight"],
        })
    return {k: v.detach().clone() for k, v in out.items()}


def _bucket(rel, num_buckets=32, max_dist=128):
    half = num_buckets // 2  # bidirectional
    buckets = (rel > 0).long() * half
    rel = rel.abs()
    exact = half // 2
    large = exact + (torch.log(rel.float() / exact) / math.log(max_dist / exact) * (half - exact)).long()
    return buckets + torch.where(rel < exact, rel, large.clamp(max=half - 1))


def wan_reference_forward(state: dict, ids, mask, num_heads: int, eps: float = 1e-6):
    """Wan's T5Encoder forward (umT5: a position bias per block; no attention scaling; tanh GELU)."""
    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def gelu(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))

    x = state["token_embedding.weight"][ids]  # [B, L, C]
    b, length, _ = x.shape
    pos = torch.arange(length)
    buckets = _bucket(pos[None, :] - pos[:, None])  # [Lq, Lk]: key - query
    layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    for n in range(layers):
        p = lambda name: state[f"blocks.{n}.{name}"]  # noqa: E731
        h = norm(x, p("norm1.weight"))
        q, k, v = (h @ p(f"attn.{w}.weight").T for w in "qkv")
        q, k, v = (t.view(b, length, num_heads, -1) for t in (q, k, v))
        bias = p("pos_embedding.embedding.weight")[buckets].permute(2, 0, 1)[None]  # [1, n, Lq, Lk]
        bias = bias.masked_fill(mask.view(b, 1, 1, length) == 0, torch.finfo(x.dtype).min)
        attn = torch.softmax(torch.einsum("binc,bjnc->bnij", q, k) + bias, dim=-1)
        x = x + torch.einsum("bnij,bjnc->binc", attn, v).reshape(b, length, -1) @ p("attn.o.weight").T
        h = norm(x, p("norm2.weight"))
        x = x + ((h @ p("ffn.fc1.weight").T) * gelu(h @ p("ffn.gate.0.weight").T)) @ p("ffn.fc2.weight").T
    return norm(x, state["norm.weight"])


@pytest.fixture(scope="module")
def source():
    cfg = get_preset("tiny").text_encoder
    return TextEncoder.random(cfg, tiny_umt5_tokenizer(), seed=3)


def _wan_folder(tmp_path, enc, dtype=torch.float32):
    folder = tmp_path / "Wan2.1-T2V-1.3B"
    (folder / "google").mkdir(parents=True)
    state = {k: v.to(dtype) for k, v in wan_layout(enc.model.state_dict(), enc.config.num_layers).items()}
    torch.save(state, folder / "models_t5_umt5-xxl-enc-bf16.pth")
    enc.tokenizer.save_pretrained(str(folder / "google" / "umt5-xxl"))
    (folder / "config.json").write_text('{"_class_name": "WanModel", "model_type": "t2v", "dim": 1536}')  # the DiT's
    return folder, state


def test_wan_umt5_file_loads_and_equals_the_transformers_format(tmp_path, source):
    folder, state = _wan_folder(tmp_path, source)
    cfg = source.config
    loaded = TextEncoder.from_pretrained(folder / "models_t5_umt5-xxl-enc-bf16.pth", config=cfg)
    whole = TextEncoder.from_pretrained(folder, config=cfg)  # the folder as it ships, config read from shapes too
    inferred = TextEncoder.from_pretrained(folder)
    assert inferred.config == cfg
    src = source.model.state_dict()
    for enc in (loaded, whole, inferred):
        assert set(enc.model.state_dict()) == set(src)
        for k, v in enc.model.state_dict().items():
            assert torch.equal(v, src[k]), k

    source.model.save_pretrained(tmp_path / "hf")  # the other format: a transformers folder
    hf = TextEncoder.from_pretrained(tmp_path / "hf", tokenizer_folder=folder / "google" / "umt5-xxl", config=cfg)
    emb = loaded.encode(PROMPT)
    assert torch.equal(emb, hf.encode(PROMPT)) and torch.equal(emb, source.encode(PROMPT))

    tok = loaded.tokenizer([PROMPT], padding="max_length", max_length=cfg.text_len, truncation=True,
                           return_attention_mask=True, return_tensors="pt")
    with torch.no_grad():
        ref = wan_reference_forward(state, tok.input_ids, tok.attention_mask, cfg.num_heads)
    torch.testing.assert_close(emb, ref * tok.attention_mask[..., None], rtol=1e-5, atol=1e-5)


def test_bf16_file_loads_exactly_in_bf16(tmp_path, source):
    folder, state = _wan_folder(tmp_path, source, torch.bfloat16)
    enc = TextEncoder.from_pretrained(folder, config=source.config)
    assert enc.model.shared.weight.dtype == torch.bfloat16
    assert torch.equal(enc.model.shared.weight, state["token_embedding.weight"])
    assert enc.model.encoder.embed_tokens.weight is enc.model.shared.weight  # still tied


def test_wan_release_folder_gives_the_vae_too(tmp_path):
    from test_vae_original_format import REAL_LAYOUT_SMALL, _converter_tables, _to_original

    from sdvg.models.vae import StreamingVAEDecoder, build_vae, load_vae_weights

    torch.manual_seed(0)
    src = build_vae(REAL_LAYOUT_SMALL)
    folder = tmp_path / "Wan2.1-T2V-1.3B"
    folder.mkdir()
    fixed = _converter_tables()
    torch.save({_to_original(k, fixed): v.clone() for k, v in src.state_dict().items()}, folder / "Wan2.1_VAE.pth")
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(b"not the VAE")  # the DiT ships beside it
    dst = build_vae(REAL_LAYOUT_SMALL)
    load_vae_weights(dst, folder)
    lat = torch.randn(1, 16, 2, 4, 4)
    a, b = StreamingVAEDecoder(src), StreamingVAEDecoder(dst)
    assert torch.equal(a.decode(lat, a.new_cache()), b.decode(lat, b.new_cache()))


def test_bad_umt5_files_refused(tmp_path, source):
    folder, state = _wan_folder(tmp_path, source)
    cfg = source.config
    nested = tmp_path / "nested.pth"
    torch.save({"model": state}, nested)
    with pytest.raises(CheckpointError) as e:
        TextEncoder.from_pretrained(nested, tokenizer_folder=folder / "google" / "umt5-xxl", config=cfg)
    assert all(s in str(e.value) for s in ("nested.pth", "not tensors")), e.value
    extra = tmp_path / "extra.pth"
    torch.save({**state, "blocks.0.attn.bias": torch.zeros(1)}, extra)
    with pytest.raises(CheckpointError, match="unexpected key 'blocks.0.attn.bias'"):
        TextEncoder.from_pretrained(extra, tokenizer_folder=folder / "google" / "umt5-xxl", config=cfg)
    bigger = get_preset("tiny").text_encoder.__class__(d_model=cfg.d_model, d_ff=cfg.d_ff, num_layers=cfg.num_layers + 1,
                                                       num_heads=cfg.num_heads, d_kv=cfg.d_kv, vocab_size=cfg.vocab_size)
    with pytest.raises(CheckpointError, match="missing key"):
        TextEncoder.from_pretrained(folder, config=bigger)
    with pytest.raises(FileNotFoundError) as e:
        TextEncoder.from_pretrained(folder / "models_t5_umt5-xxl-enc-bf16.pth", tokenizer_folder=tmp_path / "none",
                                    config=cfg)
    assert all(s in str(e.value) for s in (str(tmp_path / "none"), "tokenizer folder")), e.value

    class Evil:
        def __reduce__(self):
            return (print, ("executed",))

    torch.save({"token_embedding.weight": Evil()}, tmp_path / "evil.pth")
    with pytest.raises(CheckpointError) as e:
        TextEncoder.from_pretrained(tmp_path / "evil.pth", tokenizer_folder=folder / "google" / "umt5-xxl", config=cfg)
    assert "evil.pth" in str(e.value)
