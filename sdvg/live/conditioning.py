"""Each block's text conditioning in a live session: the prompts encoded once (`PromptBank`, an LRU),
Krea's blend of an old and a new prompt embedding over a few blocks (`blend_weights`), and the
per-block table the session's plan reads (`ConditioningTable`): once a block's conditioning is frozen it
goes into the block's step as a value (`sdvg.generation.plan.Conditioning`), so every stage of that
block (draft, target, commits, a recompute role's rebuild, a re-cache) runs under the same.

Krea's rule (krea-ai/realtime-video `release_server.py`, `GenerationSession.interpolate_prompt_embeds`):
`torch.lerp(old, new, torch.linspace(0, 1, steps=n))`, one embedding popped per block, the first at
weight 0; `old` is the embedding of the block before the switch (mid-blend: the blended one). Departure:
n = 1 gives weight 1 (Krea's linspace(0, 1, 1) is [0], which would never switch)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


def blend_weights(interp_blocks: int) -> list[float]:
    """The new prompt's weight in each of the `interp_blocks` blocks of a switch (Krea's linspace; 1 -> [1.0])."""
    if interp_blocks == 1:
        return [1.0]
    return torch.linspace(0, 1, steps=interp_blocks).tolist()


class PromptBank:
    """prompt -> umT5 embedding [1, L, d], each prompt encoded once while it stays among the `size` most
    recently used (`encodes` counts the encoder calls this bank made)."""

    def __init__(self, text_encoder, size: int = 64):
        self.text_encoder, self.size = text_encoder, size
        self._embs: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encodes = 0

    def __call__(self, prompt: str) -> torch.Tensor:
        if prompt in self._embs:
            self._embs.move_to_end(prompt)
            return self._embs[prompt]
        emb = self.text_encoder.encode(prompt)
        self.encodes += 1
        self._embs[prompt] = emb
        while len(self._embs) > self.size:
            self._embs.popitem(last=False)
        return emb


@dataclass(frozen=True)
class BlockConditioning:
    """The frozen conditioning of one session block."""

    block: int
    prompt_index: int  # the prompt held or blended towards (index into the session's prompt list)
    prompt: str
    weight: float  # that prompt's blend weight (1.0: held)
    first_new: bool  # the first block of a switch whose weight is > 0 (the one forced after a switch)
    key: tuple  # equal keys <=> equal embeddings (the text K/V is reused)
    emb: torch.Tensor  # [1, L, d]


class ConditioningTable:
    """The session's conditioning, block by block (session block indices). `switch` schedules a new prompt
    from a block on; `freeze(b)` fixes block b's conditioning (in order, once)."""

    KEEP = 16  # frozen blocks kept (a block is read only while it is being produced)

    def __init__(self, bank: PromptBank, prompt: str):
        self.bank = bank
        self.prompts: list[str] = [prompt]
        emb = bank(prompt)
        self._current = BlockConditioning(-1, 0, prompt, 1.0, False, ("prompt", 0), emb)
        self._blend: tuple | None = None  # (start block, old conditioning, new prompt index, weights)
        self.frozen: dict[int, BlockConditioning] = {}

    def prompt_index(self, prompt: str) -> int:
        if prompt not in self.prompts:
            self.prompts.append(prompt)
        return self.prompts.index(prompt)

    def switch(self, block: int, prompt: str, interp_blocks: int) -> None:
        """From `block` on, blend towards `prompt` over `interp_blocks` blocks (1: at once)."""
        if block <= self._current.block:
            raise RuntimeError(f"block {block}'s conditioning is already frozen")
        self.bank(prompt)
        self._blend = (block, self._current, self.prompt_index(prompt), blend_weights(interp_blocks))

    def freeze(self, block: int) -> BlockConditioning:
        if block != self._current.block + 1:
            raise RuntimeError(f"conditioning frozen out of order: block {block} after {self._current.block}")
        cond = self._current
        if self._blend is not None:
            start, old, index, weights = self._blend
            prompt = self.prompts[index]
            w = weights[block - start]
            new = self.bank(prompt)
            first_new = w > 0 and (block == start or weights[block - start - 1] == 0)
            if w == 1.0:
                cond = BlockConditioning(block, index, prompt, 1.0, first_new, ("prompt", index), new)
            elif w == 0.0:
                cond = BlockConditioning(block, index, prompt, 0.0, first_new, old.key, old.emb)
            else:
                emb = torch.lerp(old.emb, new.to(old.emb), torch.tensor(w, dtype=old.emb.dtype))
                cond = BlockConditioning(block, index, prompt, w, first_new, (old.key, index, w), emb)
            if block - start == len(weights) - 1:
                self._blend = None
        else:
            cond = BlockConditioning(block, cond.prompt_index, cond.prompt, 1.0, False, cond.key, cond.emb)
        self._current = cond
        self.frozen[block] = cond
        self.frozen.pop(block - self.KEEP, None)
        return cond
