"""KV-cache sizing and allocation. The buffers and the write pointer live in `sdvg._C.KVCache`."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sdvg._native import _C
from sdvg.models.device_constants import device_constant
from sdvg.config import DiTConfig, KVWindow, MemoryBudgetError, RoleContext, checked_size  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    heads: int
    head_dim: int
    tokens_per_frame: int
    max_frames: int
    window: KVWindow = KVWindow()
    batch: int = 1

    @classmethod
    def for_dit(cls, dit: DiTConfig, tokens_per_frame: int, max_frames: int, window: KVWindow = KVWindow(),
                batch: int = 1) -> "KVCacheSpec":
        return cls(dit.num_layers, dit.num_heads, dit.head_dim, tokens_per_frame, max_frames, window, batch)

    @classmethod
    def for_context(cls, preset, dit: DiTConfig, context: RoleContext, num_blocks: int,
                    slack_frames: int = 0, prefix_frames: int = 0) -> "KVCacheSpec":
        """The cache one DiT of `preset` needs for `num_blocks` blocks under `context`: the one place KV
        sizes are derived. A full context holds the video (or its window) after `prefix_frames` (a start
        frame's); a recompute context holds kv_cache_frames context frames plus one block (a start frame's
        frames are the first context). `slack_frames` widens a windowed cache so that a rollback that deep
        stays exact (run-ahead)."""
        tpf = preset.video.tokens_per_frame(preset.vae, dit)
        window = context.window
        if window.window_frames and slack_frames > window.slack_frames:
            window = replace(window, slack_frames=slack_frames)
        frames = context.cache_frames(num_blocks, preset.video.frames_per_block)
        return cls.for_dit(dit, tpf, frames + (0 if context.recompute else prefix_frames), window)

    @classmethod
    def for_preset(cls, preset, dit: DiTConfig, num_blocks: int, slack_frames: int = 0) -> "KVCacheSpec":
        """The cache of a full-history context with the preset's window (the engines' static shape)."""
        return cls.for_context(preset, dit, RoleContext("full", window=preset.kv_window), num_blocks, slack_frames)

    def layout(self):
        w = self.window
        return _C.SlotLayout(self.max_frames, w.sink_frames, w.window_frames, w.slack_frames)

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of the K and V buffers, known before allocating them."""
        elem = torch.empty((), dtype=dtype).element_size()
        w = self.window
        slots = self.max_frames if not w.window_frames else min(self.max_frames, w.sink_frames + w.window_frames
                                                                 + w.slack_frames)
        checked_size("KV cache bytes (layers x K,V x batch x heads x frames x tokens x head_dim x element)",
                     self.num_layers, 2, self.batch, self.heads, slots, self.tokens_per_frame, self.head_dim, elem)
        return _C.kv_cache_nbytes(self.num_layers, self.batch, self.heads, self.head_dim, self.tokens_per_frame,
                                  self.layout(), elem)

    def allocate(self, dtype: torch.dtype, device: torch.device | str, budget_bytes: int | None = None):
        need = self.nbytes(dtype)
        if budget_bytes is not None and need > budget_bytes:
            raise MemoryBudgetError(
                f"KV cache needs {need / 2**30:.2f} GiB ({self.num_layers} layers x {self.max_frames} frames x "
                f"{self.tokens_per_frame} tokens, {dtype}) but the budget is {budget_bytes / 2**30:.2f} GiB; use a "
                "local window (KVWindow(window_frames=..., sink_frames=...)), fewer blocks or a larger budget"
            )
        return _C.KVCache(self.num_layers, self.batch, self.heads, self.head_dim, self.tokens_per_frame,
                          self.layout(), dtype, torch.device(device))


def pending_token_positions(cache, tokens: torch.Tensor) -> torch.Tensor:
    """Buffer positions [A] (int64, on the cache's device) of pending tokens `tokens` ([A] int64 indices into
    the pending frames' tokens, frame-major, checked by the caller: `check_active`): what `KVCache.write_tokens`
    computes per layer, with a host copy and two scalar reads each time, built here once per forward on the
    device (the pending slots are the last visible ones, copied there once per slot list)."""
    pending = cache.pending_frames
    if pending == 0:
        raise RuntimeError("KV cache write_tokens() before begin_write()")
    tpf = cache.buffer.shape[-2] // cache.num_slots
    slots = tuple(cache.visible_slots()[-pending:])
    device = cache.buffer.device
    table = device_constant(("pending_slots", slots), device, lambda: torch.tensor(slots, dtype=torch.int64))
    tokens = tokens.to(device, non_blocking=True)
    return table.index_select(0, torch.div(tokens, tpf, rounding_mode="floor")) * tpf + torch.remainder(tokens, tpf)


def write_positions(cache, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
    """`KVCache.write_tokens(layer, k, v, tokens)` given the tokens' buffer positions (`pending_token_positions`):
    k, v [B, H, A, D] into layer `layer`'s buffer, no host round trip."""
    buf = cache.layer_buffer(layer)  # [2, B, H, slots * tpf, D]
    if k.shape != v.shape or k.shape[2] != positions.shape[0]:
        raise ValueError(f"KV cache write_tokens expects K/V of shape [B, H, {positions.shape[0]}, D] ({positions.shape[0]} "
                         f"token positions), got {list(k.shape)} and {list(v.shape)}")
    buf.select(0, 0).index_copy_(2, positions, k.to(buf.dtype))
    buf.select(0, 1).index_copy_(2, positions, v.to(buf.dtype))
