"""CUDA graphs for cached DiT forwards (`cuda_graphs=True`; backend eager): one graph per role and
block position, captured the first time a forward of that shape, position and cache state runs,
then replayed for every later denoising step, the block's t = 0 commit, and every later video.

What a replay refreshes and what stays baked in:

* refreshed per replay: the latents and the per-frame timesteps, copied into the graph's static
  input buffers (`x [1, C, F, H, W]`, `t [1, F]`), and the cache's host bookkeeping
  (`KVCache.begin_write`: the pending slots; no device work);
* refreshed per prompt: the prompt's cross-attention K/V, copied into one static `TextKV` per role
  (every graph of the role reads it);
* baked in: the RoPE tables of the block's frames (`cos`/`sin [S, D/2]`, device buffers computed
  once per graph from the same CPU table the eager path copies per forward), the KV cache's buffer
  addresses and the visible slot range (part of the key), the weights.

A graph therefore needs the same cache buffer for every video: `cache()` hands out one KV cache per
(DiT, spec, dtype, device), allocated once per pipeline and rolled back to frame 0 for each video
(a finished video's `LoopReport.drafter_cache` is that shared cache: read it before the next video).
Forwards whose visible slots are not one contiguous range (a wrapped local window gathers them
through an index tensor that `begin_write` rebuilds), forwards with an attention mask (a recompute
context forward) and roles not listed run eagerly.

On a CUDA device a capture is `torch.cuda.CUDAGraph` (one warm-up run on the capture stream, then
the capture; all graphs of a device share one memory pool: they replay one at a time, and each
output is cloned before the next replay). Elsewhere `ReplayCapture` stands in: the same static
buffers, keys and refreshes, with a "replay" that reruns the forward on the static buffers, so the
bookkeeping is exact-tested on the CPU (tests/test_graphs.py) and a replay can be counted as one
launch (benchmarks/host_syncs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sdvg.models.dit import TextKV, cache_frame_offset


class ReplayCapture:
    """The CPU stand-in of a graph capture: `capture(fn)` runs `fn` once and returns (replay, out);
    `replay()` reruns `fn` and writes its result into `out` (the static output), as a graph would."""

    kind = "replay"

    def __init__(self, device):
        self.device = torch.device(device)

    def capture(self, fn):
        out = fn()  # the "capture": allocates the static output

        def replay():
            out.copy_(fn())

        return replay, out


class CudaGraphCapture:
    """`torch.cuda.CUDAGraph` capture on a side stream of `device`, one warm-up run first; the graphs
    of one device share a memory pool (replayed one at a time; their outputs stay referenced)."""

    kind = "cuda"

    def __init__(self, device):
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn):
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()  # warm-up: lazy initialisation outside the capture (writes the same K/V the replay will)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the main thread's stage work (syncs included) goes on while the run-ahead drafter captures
        with torch.cuda.graph(graph, pool=self.pool, stream=side, capture_error_mode="thread_local"):
            out = fn()
        return graph.replay, out


def capture_for(device):
    device = torch.device(device)
    return CudaGraphCapture(device) if device.type == "cuda" else ReplayCapture(device)


@dataclass
class _Graph:
    replay: object  # () -> None
    x: torch.Tensor  # static latents [1, C, F, H, W]
    t: torch.Tensor  # static timesteps [1, F]
    out: torch.Tensor  # static flow [1, C, F, H, W] (model dtype)
    cache: object  # the KVCache whose buffer the graph writes and reads (kept alive with it)


def _contiguous(slots) -> bool:
    return all(b == a + 1 for a, b in zip(slots, slots[1:]))


class DiTGraphs:
    """The graphs of one pipeline's cached DiT forwards (see the module docstring). `roles`: the roles
    whose forwards are graphed; `capture_factory(device)`: a capture backend (default: `capture_for`)."""

    def __init__(self, roles=("drafter",), capture_factory=capture_for):
        self.roles = tuple(roles)
        self._capture_factory = capture_factory
        self._captures: dict = {}  # device -> capture backend
        self._graphs: dict = {}  # key (see `key`) -> _Graph
        self._text: dict = {}  # role -> (source TextKV, static TextKV)
        self._caches: dict = {}  # (id(dit), spec, dtype, device) -> (dit, KVCache)
        self.captured = 0  # graphs captured so far
        self.replays = 0  # forwards served by a replay
        self.eager = 0  # forwards of a graphed role that ran eagerly (mask, gathered slots)

    # ---------------------------------------------------------------- caches
    def cache(self, dit, spec, dtype: torch.dtype, device):
        """The KV cache of `spec` for `dit`: allocated once, then rolled back to frame 0 for each video
        (a cache that cannot roll back that far is replaced, and its graphs dropped)."""
        device = torch.device(device)
        key = (id(dit), spec, dtype, device)
        held = self._caches.get(key)
        if held is not None and held[0] is dit and held[1].can_rollback(0):
            held[1].rollback(0)
            return held[1]
        if held is not None:
            self._drop_cache(held[1])
        cache = spec.allocate(dtype, device)
        self._caches[key] = (dit, cache)
        return cache

    def _drop_cache(self, cache) -> None:
        self._graphs = {k: g for k, g in self._graphs.items() if g.cache is not cache}

    # ---------------------------------------------------------------- forward
    def key(self, role: str, latents, timesteps, cache, position: int) -> tuple:
        """A graph's key: role, cache identity, input shapes/dtypes, the block's position and the
        visible slots after `begin_write` (which fix every address the forward reads or writes)."""
        return (role, id(cache), tuple(latents.shape), latents.dtype, tuple(timesteps.shape), timesteps.dtype,
                position, tuple(cache.visible_slots()))

    def forward(self, role: str, dit, latents, timesteps, text: TextKV, frame_offset, cache, attn_mask=None):
        """`dit(latents, timesteps, text, frame_offset, cache=cache)` through a graph -> the flow (a fresh
        tensor); None when this forward is not graphed (the caller runs it eagerly)."""
        if role not in self.roles or cache is None:
            return None
        if attn_mask is not None:
            self.eager += 1
            return None
        position = cache_frame_offset(frame_offset, cache)
        cache.begin_write(latents.shape[2])  # host bookkeeping; the eager forward would do the same
        slots = cache.visible_slots()
        if not _contiguous(slots):
            self.eager += 1
            return None
        key = self.key(role, latents, timesteps, cache, position)
        static_text = self._static_text(role, text)
        g = self._graphs.get(key)
        if g is None:  # a capture runs nothing (CUDA): the first result comes from a replay too
            g = self._graphs[key] = self._capture(dit, latents, timesteps, static_text, position, cache)
        g.x.copy_(latents)
        g.t.copy_(timesteps)
        self._replay(g)
        return g.out.clone()

    def _replay(self, g: _Graph) -> None:
        g.replay()
        self.replays += 1

    def _static_text(self, role: str, text: TextKV) -> TextKV:
        held = self._text.get(role)
        if held is not None and held[0] is text:
            return held[1]
        if held is not None and [k.shape for k in held[1].keys] == [k.shape for k in text.keys]:
            static = held[1]
            for dst, src in zip(static.keys + static.values, text.keys + text.values):
                dst.copy_(src)
        else:  # first prompt (or another text length): new buffers, so this role's graphs are stale
            self._graphs = {k: g for k, g in self._graphs.items() if k[0] != role}
            static = TextKV([k.clone() for k in text.keys], [v.clone() for v in text.values])
        self._text[role] = (text, static)
        return static

    def _capture(self, dit, latents, timesteps, text: TextKV, position: int, cache) -> _Graph:
        device = latents.device
        if device not in self._captures:
            self._captures[device] = self._capture_factory(device)
        x, t = latents.clone(), timesteps.clone()
        _, _, nF, H, W = latents.shape
        cos, sin = dit.rope(position, nF, H, W, device)  # static for this block position

        def attend(layer, k, v):
            cache.write(layer, k, v)
            k_all, v_all = cache.visible(layer)
            return k_all, v_all, None

        def body():
            with torch.no_grad():
                return dit.forward_with(x, dit.timestep_freqs(t), text.keys, text.values, cos, sin, attend)

        replay, out = self._captures[device].capture(body)
        self.captured += 1
        return _Graph(replay, x, t, out, cache)

    def stats(self) -> dict:
        return {"graphs": len(self._graphs), "captured": self.captured, "replays": self.replays,
                "eager": self.eager, "caches": len(self._caches)}
