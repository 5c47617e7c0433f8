"""A block's text conditioning as a value, and each role's cross-attention K/V of it.

A plan (sdvg/generation/plan.py) gives every block its `Conditioning`: a whole video's is its one
prompt's; a live session's (sdvg/live/conditioning.py) changes between blocks, blended over a few
blocks after a switch. The stage calls read the block's conditioning and pass its K/V to each
forward (`RoleModel.denoise`, `commit_forward`, `recache`): no model holds a prompt of its own.
`TextKV` turns a conditioning into a role's K/V once per (conditioning, role) while it is in use."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Conditioning:
    """The text a block is made under: `key` (equal keys <=> equal embeddings; the K/V is reused),
    `prompt` (what a score is judged against), `emb` (the umT5 embedding [1, L, d])."""

    key: tuple
    prompt: str
    emb: torch.Tensor


class TextKV:
    """(conditioning key, role) -> the role's cross-attention K/V of that conditioning, made by the role's
    DiT (`dits`: role -> the DiT the role runs this video, FP8 copy included), the last `size` kept.
    `seed`: K/V already made for a conditioning (the prompt's, by `prepare`), reused as they are."""

    def __init__(self, dits: dict, seed: dict | None = None, size: int = 8):
        self.dits, self.size = dits, size
        self._kv: dict[tuple, object] = dict(seed or {})
        self.made = 0  # K/V made here (not seeded)

    def __call__(self, conditioning: Conditioning, role: str):
        k = (conditioning.key, role)
        if k not in self._kv:
            while len(self._kv) >= self.size:
                self._kv.pop(next(iter(self._kv)))
            self._kv[k] = self.dits[role].encode_text(conditioning.emb)
            self.made += 1
        return self._kv[k]
