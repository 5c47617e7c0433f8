"""The API's output contract: diffusers' `WanPipelineOutput` with its video processor's shapes, plus sdvg's
per-video extras (`latents`, `stats`, `blocks`).

A call of `SpeculativeVideoPipeline` makes `batch = len(prompts) * num_videos_per_prompt` videos, prompt
by prompt (the videos of prompt 0 first, as diffusers repeats its prompt embeddings); one prompt is a
batch of one. `frames` by `output_type`, as diffusers' `VideoProcessor.postprocess_video` gives them:

| output_type | frames |
|---|---|
| `np` (default) | numpy float32 `[batch, F, H, W, 3]` in [0, 1] |
| `pt` | torch float32 `[batch, F, 3, H, W]` in [0, 1] |
| `pil` | a list (per video) of lists of F RGB `PIL.Image.Image` |
| `latent` | the emitted latents, float32 `[batch, z, T, h, w]` (the same tensor as `latents`) |
| `uint8` (sdvg's own) | torch uint8 `[batch, F, H, W, 3]`, the exact decoded pixels |

`latents` is a batched float32 tensor `[batch, z, T, h, w]` (what diffusers' `output_type="latent"`
gives); `stats` a per-video list of `RunStats` (for a batch of one it also reads as that RunStats:
`out.stats["options"]["seed"]`); `blocks` a per-video list of lists of `BlockRecord` (`out.blocks[0][b]`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

OUTPUT_TYPES = ("np", "pt", "pil", "uint8", "latent")


class PerVideo(list):
    """A list with one entry per video of the batch. For a batch of one it also reads as its only entry
    (`out.stats["options"]`, `out.stats.to_json()` are `out.stats[0]`'s), so one-prompt code written before
    outputs were batched keeps working; for a larger batch a string key or an unknown attribute is refused
    naming the fix (`out.stats[i]`)."""

    def __init__(self, items=(), name: str = "entry"):
        super().__init__(items)
        self.name = name

    def __getitem__(self, index):
        if isinstance(index, str):
            return self._only(repr(index))[index]
        return super().__getitem__(index)

    def __contains__(self, key) -> bool:
        if isinstance(key, str):  # `"live" in out.stats`: a key of the only entry, as `out.stats["live"]` reads
            return key in self._only(repr(key))
        return super().__contains__(key)

    def __getattr__(self, attr: str):
        if attr.startswith("_") or attr == "name":
            raise AttributeError(attr)
        return getattr(self._only(f".{attr}"), attr)

    def _only(self, what: str):
        if len(self) != 1:
            raise TypeError(f"out.{self.name} holds one entry per video (a batch of {len(self)}); index it by "
                            f"video first: out.{self.name}[i]" + (f"[{what}]" if not what.startswith(".") else what))
        return super().__getitem__(0)


@dataclass
class VideoOutput:
    """One video, as `SpeculativeVideoPipeline.generate` returns it: frames uint8 torch `[F, H, W, 3]` (or
    the `output_type` asked for, unbatched), latents float32 `[1, z, T, h, w]`, its RunStats and blocks."""

    frames: Any
    latents: torch.Tensor
    stats: Any  # RunStats
    blocks: list  # list[BlockRecord]


@dataclass
class PipelineOutput:
    """What `SpeculativeVideoPipeline.__call__` returns (the table in this module's docstring):
    `frames` batched as diffusers' `WanPipelineOutput.frames`, so `export_to_video(out.frames[0], path)`
    writes the first video; `latents` [batch, z, T, h, w]; `stats` and `blocks` one entry per video."""

    frames: Any
    latents: torch.Tensor | None
    stats: PerVideo
    blocks: PerVideo


def convert_frames(frames: torch.Tensor, output_type: str):
    """One video's uint8 [F, H, W, 3] -> its frames in `output_type`, unbatched (np [F, H, W, 3],
    pt [F, 3, H, W], pil a list of F images, uint8 as given; latent: None). The uint8 value k becomes
    k / 255 exactly, so `(x * 255).astype(uint8)`, as diffusers' export_to_video does, gives k back."""
    if output_type == "uint8":
        return frames
    if output_type == "latent":
        return None
    if output_type == "np":
        return frames.numpy().astype(np.float32) / np.float32(255)
    if output_type == "pt":
        return frames.permute(0, 3, 1, 2).float() / 255
    if output_type == "pil":
        from PIL import Image

        return [Image.fromarray(f) for f in frames.numpy()]
    raise ValueError(f"unknown output_type {output_type!r}; choose one of {', '.join(OUTPUT_TYPES)}")


def batch_output(videos: list[list], stats: list, output_type: str) -> PipelineOutput:
    """The batched output of several videos, each given as its list of BlockRecords (in emission order).

    The videos of one call have the same length unless the call was interrupted: then `frames` and
    `latents` hold the blocks every emitted video has (the common prefix); `blocks` and `stats` keep
    everything each video emitted."""
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"unknown output_type {output_type!r}; choose one of {', '.join(OUTPUT_TYPES)}")
    started = [(blocks, s) for blocks, s in zip(videos, stats) if blocks]
    common = min((len(blocks) for blocks, _ in started), default=0)
    if common == 0:
        frames = latents = None  # interrupted before any block was emitted
    else:
        latents = torch.cat([torch.cat([b.latents for b in blocks[:common]], dim=2) for blocks, _ in started])
        pixels = [torch.cat([b.frames for b in blocks[:common]]) for blocks, _ in started]  # uint8 [F, H, W, 3]
        frames = _stack([convert_frames(p, output_type) for p in pixels], output_type, latents)
    return PipelineOutput(frames=frames, latents=latents, stats=PerVideo([s for _, s in started], "stats"),
                          blocks=PerVideo([blocks for blocks, _ in started], "blocks"))


def _stack(per_video: list, output_type: str, latents: torch.Tensor):
    if output_type == "latent":
        return latents
    if output_type == "np":
        return np.stack(per_video)  # float32 [batch, F, H, W, 3]
    if output_type == "pil":
        return per_video  # [batch][F] images
    return torch.stack(per_video)  # pt float32 [batch, F, 3, H, W] | uint8 [batch, F, H, W, 3]
