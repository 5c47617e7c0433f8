"""umT5 text encoder (transformers `UMT5EncoderModel`) with an explicit per-prompt cache."""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from sdvg.config import TextEncoderConfig, Precision, torch_dtype


class TextEncoder:
    """Encodes prompts to [1, text_len, d_model]; embeddings past the prompt length are zero.

    The padded length (512) is kept: the zero rows still pass through the DiT's text MLP and take
    part in cross-attention, as the checkpoints expect."""

    def __init__(self, model, tokenizer, config: TextEncoderConfig, cache_size: int = 64):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()  # prompt -> embeddings (LRU)
        self.cache_size = cache_size
        # CPU offload: the encoder lives on `offload_device` and visits `execution_device` only to
        # encode a new prompt (the 11 GB umT5 leaves the GPU right after encoding).
        self.execution_device: torch.device | None = None
        self.offload_device: torch.device | None = None

    def enable_offload(self, execution_device, offload_device="cpu") -> None:
        self.execution_device, self.offload_device = torch.device(execution_device), torch.device(offload_device)
        self.model.to(self.offload_device)

    @classmethod
    def random(cls, config: TextEncoderConfig, tokenizer, seed: int = 0) -> "TextEncoder":
        from transformers import UMT5Config, UMT5EncoderModel

        torch.manual_seed(seed)
        hf = UMT5Config(vocab_size=config.vocab_size, d_model=config.d_model, d_kv=config.d_kv, d_ff=config.d_ff,
                        num_layers=config.num_layers, num_heads=config.num_heads, feed_forward_proj="gated-gelu",
                        dense_act_fn="gelu_new", is_encoder_decoder=False)
        return cls(UMT5EncoderModel(hf), tokenizer, config)

    @classmethod
    def from_pretrained(cls, folder: str | Path, tokenizer_folder: str | Path | None = None,
                        config: TextEncoderConfig | None = None) -> "TextEncoder":
        """A transformers folder of UMT5EncoderModel (or a diffusers Wan folder's text_encoder/), or Wan's
        original umT5 file as it ships (`models_t5_umt5-xxl-enc-bf16.pth`, or a folder holding it, such as
        `Wan-AI/Wan2.1-T2V-1.3B`; the tokenizer from its `google/umt5-xxl/` folder unless `tokenizer_folder`
        is given; sdvg/models/umt5_original.py). Refused (CheckpointError): a non-floating tensor in its
        weight files, a NaN/inf in the loaded weights, a file that is not a flat dict of tensors."""
        from transformers import AutoTokenizer, UMT5EncoderModel

        from sdvg.models.checkpoints import check_file_dtypes, check_module_weights
        from sdvg.models.umt5_original import WAN_UMT5_FILE, WAN_UMT5_TOKENIZER

        folder = Path(folder)
        original = folder if folder.suffix == ".pth" else folder / WAN_UMT5_FILE
        if original.is_file():  # the Wan release folder also holds the DiT's config.json: the file decides
            return cls._from_original(original, tokenizer_folder or original.parent / WAN_UMT5_TOKENIZER, config)
        if (folder / "text_encoder").is_dir():
            tokenizer_folder = tokenizer_folder or folder / "tokenizer"
            folder = folder / "text_encoder"
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder} is not a UMT5 encoder folder (no config.json) nor holds Wan's "
                                    f"{WAN_UMT5_FILE}")
        # transformers casts to float32 as it reads: the files' dtypes are checked first (headers only),
        # the values once loaded (by the model's parameter names)
        check_file_dtypes(sorted(f for f in folder.iterdir() if f.suffix in (".safetensors", ".bin")))
        model = UMT5EncoderModel.from_pretrained(str(folder), local_files_only=True, torch_dtype=torch.float32)
        check_module_weights(model, folder)
        tok = AutoTokenizer.from_pretrained(str(tokenizer_folder or folder), local_files_only=True)
        cfg = config or TextEncoderConfig(d_model=model.config.d_model, d_ff=model.config.d_ff,
                                          num_layers=model.config.num_layers, num_heads=model.config.num_heads,
                                          d_kv=model.config.d_kv, vocab_size=model.config.vocab_size)
        return cls(model, tok, cfg)

    @classmethod
    def _from_original(cls, path: Path, tokenizer_folder: Path, config: TextEncoderConfig | None) -> "TextEncoder":
        from transformers import AutoTokenizer

        from sdvg.models.umt5_original import load_original_umt5

        if not Path(tokenizer_folder).is_dir():
            raise FileNotFoundError(f"{path}: the umT5 tokenizer folder {tokenizer_folder} does not exist (Wan ships it "
                                    "beside the weights as google/umt5-xxl/); pass its folder")
        model = load_original_umt5(path, config)
        c = model.config
        cfg = config or TextEncoderConfig(d_model=c.d_model, d_ff=c.d_ff, num_layers=c.num_layers, num_heads=c.num_heads,
                                          d_kv=c.d_kv, vocab_size=c.vocab_size)
        tok = AutoTokenizer.from_pretrained(str(tokenizer_folder), local_files_only=True)
        return cls(model, tok, cfg)

    def to(self, device, precision: Precision = "fp32") -> "TextEncoder":
        self.model.to(device=device, dtype=torch_dtype(precision))
        self.cache.clear()
        return self

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def encode(self, prompt: str) -> torch.Tensor:
        """prompt -> [1, text_len, d_model] float32 (cached)."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("prompt is empty; give a non-empty text prompt")
        if prompt in self.cache:
            self.cache.move_to_end(prompt)
            return self.cache[prompt]
        if self.execution_device is not None and self.execution_device != self.offload_device:
            self.model.to(self.execution_device)
            try:
                emb = self._encode(prompt)
            finally:
                self.model.to(self.offload_device)
        else:
            emb = self._encode(prompt)
        self.cache[prompt] = emb
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return emb

    def _encode(self, prompt: str) -> torch.Tensor:
        L = self.config.text_len
        tok = self.tokenizer([prompt], padding="max_length", max_length=L, truncation=True, add_special_tokens=True,
                             return_attention_mask=True, return_tensors="pt")
        ids = tok.input_ids.to(self.device)
        mask = tok.attention_mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()  # [1, L, d]
        return hidden * mask[..., None].float()  # zero past the prompt length
