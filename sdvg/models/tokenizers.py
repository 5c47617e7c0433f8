"""Tokenizers: the real ones from local folders, and small in-memory character tokenizers
for the random-weight presets (built offline, deterministic)."""
from __future__ import annotations

import dataclasses
import os
import string
from pathlib import Path

_CHARS = string.ascii_lowercase + string.digits + ".,!?'-"


def _char_wordpiece(specials: list[str], unk: str):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab: dict[str, int] = {}
    for tok in specials + list(_CHARS) + ["##" + c for c in _CHARS]:
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True, clean_text=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tok


def tiny_umt5_tokenizer():
    """A T5-style tokenizer (pad=0, eos=1, unk=2) over characters; appends </s>."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = _char_wordpiece(["<pad>", "</s>", "<unk>"], "<unk>")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_bert_tokenizer():
    """A BERT-style tokenizer ([CLS] ... [SEP]) over characters, without [DEC]/[ENC]."""
    from tokenizers import processors
    from transformers import BertTokenizerFast

    tok = _char_wordpiece(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "[UNK]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return BertTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]",
        mask_token="[MASK]",
    )


BERT_BASE_UNCASED_VOCAB = 30522


def bert_from_hf_cache() -> Path:
    """bert-base-uncased's tokenizer files from the Hugging Face cache, at `refs/main`: the current repo
    id (google-bert/bert-base-uncased) first, then the legacy one (bert-base-uncased)."""
    from sdvg.config import get_preset
    from sdvg.models.hub import MissingWeightsError, resolve_components

    source = get_preset("wan2.1").sources.reward_tokenizer
    try:
        return resolve_components({"reward_tokenizer": None}, {"reward_tokenizer": source})["reward_tokenizer"]
    except MissingWeightsError as first:
        legacy = dataclasses.replace(source, repo_id="bert-base-uncased")
        try:
            return resolve_components({"reward_tokenizer": None}, {"reward_tokenizer": legacy})["reward_tokenizer"]
        except MissingWeightsError:
            raise first from None


def load_bert_tokenizer(path: str | os.PathLike | None):
    """bert-base-uncased from a local folder (or the HF cache when `path` is None)."""
    from transformers import BertTokenizer

    folder = Path(path) if path is not None else bert_from_hf_cache()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"BERT tokenizer folder {str(path) if path else '(HF cache: bert-base-uncased)'} not found; pass "
            "reward_tokenizer=<folder with vocab.txt> (a copy of bert-base-uncased)"
        )
    if not (folder / "vocab.txt").is_file() and not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder} holds no vocab.txt or tokenizer.json; it is not a BERT tokenizer folder")
    return BertTokenizer.from_pretrained(str(folder), local_files_only=True)


def add_blip_tokens(tokenizer):
    """ImageReward/BLIP's tokenizer additions: [DEC] as bos and [ENC] as an extra special token."""
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    tokenizer.enc_token_id = tokenizer.convert_tokens_to_ids("[ENC]")  # transformers 4 and 5 alike
    return tokenizer


def check_vocab_size(tokenizer, expected: int, what: str) -> None:
    """Guard against tokenizers that silently map every word to [UNK] (e.g. a 5-token stub)."""
    n = len(tokenizer)
    if n != expected:
        raise ValueError(
            f"{what} tokenizer has {n} tokens, expected {expected}; it is the wrong tokenizer or an offline "
            "placeholder. Point it at a full local copy (for ImageReward: bert-base-uncased, 30522 + [DEC] + [ENC])."
        )
