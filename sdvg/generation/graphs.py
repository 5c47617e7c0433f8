"""CUDA graphs for cached DiT forwards (`cuda_graphs=True`; backend eager): one graph per role and
block position, captured by `prepare` before the scheduler starts (`capture_all`: never inside a
role's lane, where a capture would synchronize the device and empty the allocator's cache beside
the other role; a key it did not cover is captured by its first forward, `captured_late`), then
replayed for every denoising step, the block's t = 0 commit, and every later video.

What a replay refreshes and what stays baked in:

* refreshed per replay: the latents and the per-frame timesteps, copied into the graph's static
  input buffers (`x [1, C, F, H, W]`, `t [1, F]`), and the cache's host bookkeeping
  (`KVCache.begin_write`: the pending slots; no device work);
* refreshed per prompt: the prompt's cross-attention K/V, copied into one static `TextKV` per role
  (every graph of the role reads it);
* baked in: the RoPE tables of the block's frames (`cos`/`sin [S, D/2]`, the device tables the
  eager path reads too), the KV cache's buffer addresses and the visible slot range (part of the
  key), the weights. A graph holds addresses, not tensors: each `_Graph` holds every tensor it
  reads besides the weights and the cache (`reads`: RoPE tables, static prompt K/V) for its lifetime.

A graph therefore needs the same cache buffer for every video: `cache()` hands out one KV cache per
(DiT, spec, dtype, device), allocated once per pipeline and rolled back to frame 0 for each video
(a finished video's `LoopReport.drafter_cache` is that shared cache: read it before the next video).
Forwards whose visible slots are not one contiguous range (a wrapped local window gathers them
through an index tensor that `begin_write` rebuilds), forwards with an attention mask (a recompute
context forward over more than one group of frames; a one-group context takes none and is graphed)
and roles not listed run eagerly.

On a CUDA device a capture is `torch.cuda.CUDAGraph` (one warm-up run on the capture stream, then
the capture; one persistent capture stream per `DiTGraphs` and device, created outside torch's
stream pool, which the scheduler's role streams come from; all graphs of a device share one memory
pool: they replay one at a time, and each output is cloned before the next replay). Elsewhere
`ReplayCapture` stands in with a CUDA graph's semantics: the same static buffers, keys and
refreshes; the capture records the forward's operators, and a replay reruns that recording against
the storages it read, holding weak references only (never the tensors the forward closed over), and
raises if one was freed, where a CUDA graph would read garbage. So the bookkeeping and the lifetimes
are exact-tested on the CPU (tests/test_graphs.py) and a replay can be counted as one launch
(benchmarks/host_syncs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from sdvg.models.dit import TextKV, cache_frame_offset


class _Slot(int):
    """A tape reference to the tensor made by an earlier operator of the capture (graph-owned memory)."""


class _Input(int):
    """A tape reference to a tensor from outside the capture (weights, caches, tables, static inputs)."""


class _Outside:
    """A tensor from outside a capture, held as a graph holds it: a weak reference to its storage and
    the view's geometry (never the tensor)."""

    def __init__(self, t: torch.Tensor):
        self.storage = StorageWeakRef(t.untyped_storage())
        self.dtype, self.device = t.dtype, t.device
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()

    def resolve(self) -> torch.Tensor:
        if self.storage.expired():
            raise RuntimeError(
                f"graph replay reads a {self.dtype} tensor of shape {list(self.size)} on {self.device} that was freed "
                "since the capture (a CUDA graph would read whatever the allocator put there now): keep every "
                "tensor a captured graph reads alive for the graph's lifetime")
        storage = torch.UntypedStorage._new_with_weak_ptr(self.storage.cdata)
        return torch.empty(0, dtype=self.dtype, device=self.device).set_(storage, self.offset, self.size,
                                                                        self.stride)


class _Recorder(TorchDispatchMode):
    """Records every operator a capture runs: arguments made inside the capture by tape slot, the
    others as `_Outside` (by storage). Refuses a host read, which a CUDA capture cannot do."""

    def __init__(self):
        super().__init__()
        self.tape: list = []  # (operator, args, kwargs, outputs)
        self.slots: dict = {}  # id(tensor) -> _Slot, for tensors made during the capture
        self.inputs: dict = {}  # id(tensor) -> _Input
        self.outside: list[_Outside] = []
        self.seen: list = []  # every tensor touched, alive until the capture ends (ids stay unique)

    def _arg(self, a):
        if not isinstance(a, torch.Tensor):
            return a
        key = id(a)
        if key in self.slots:
            return self.slots[key]
        if key not in self.inputs:
            self.seen.append(a)
            self.inputs[key] = _Input(len(self.outside))
            self.outside.append(_Outside(a))
        return self.inputs[key]

    def _out(self, o):
        if not isinstance(o, torch.Tensor):
            return o
        self.seen.append(o)
        slot = self.slots[id(o)] = _Slot(len(self.slots))
        return slot

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            raise RuntimeError("a graph capture cannot read a tensor's value on the host (.item(), bool(t), int(t)): "
                               "a CUDA graph has no host step; keep the captured forward free of host reads")
        spec = (tree_map(self._arg, list(args)), tree_map(self._arg, kwargs))
        out = func(*args, **kwargs)
        self.tape.append((func, spec[0], spec[1], tree_map(self._out, out)))
        return out


class ReplayCapture:
    """The CPU stand-in of a graph capture, with a CUDA graph's semantics: `capture(fn)` runs `fn` once
    and records its operators; `replay()` reruns the recording (not `fn`) against the storages the
    capture read and writes its result into `out` (the static output, owned by the graph). Nothing
    `fn` closed over is referenced: a replay after such a tensor was freed raises (a CUDA graph would
    read garbage), so a graph that does not hold what it reads fails on the CPU too."""

    kind = "replay"

    def __init__(self, device):
        self.device = torch.device(device)

    def capture(self, fn):
        recorder = _Recorder()
        with recorder:
            result = fn()
        if not isinstance(result, torch.Tensor) or id(result) not in recorder.slots:
            raise RuntimeError("a captured function must return a tensor it computed")
        out_slot = recorder.slots[id(result)]
        out = result  # graph-owned memory, like the pool memory of a CUDA graph's output
        tape, outside, num_slots = recorder.tape, recorder.outside, len(recorder.slots)
        del recorder, result, fn  # the capture keeps addresses only

        def replay():
            inputs = [o.resolve() for o in outside]
            made: list = [None] * num_slots

            def arg(a):
                if isinstance(a, _Slot):
                    return made[a]
                return inputs[a] if isinstance(a, _Input) else a

            for func, args, kwargs, outs in tape:
                got = func(*tree_map(arg, args), **tree_map(arg, kwargs))
                for slot, value in zip(tree_leaves(outs), tree_leaves(got)):
                    if isinstance(slot, _Slot):
                        made[slot] = value
            out.copy_(made[out_slot])

        return replay, out


def capture_stream(device) -> "torch.cuda.Stream":
    """A CUDA stream of `device` created for graph capture alone (`cudaStreamCreateWithFlags`, non-blocking,
    through the CUDA runtime torch loaded), never handed out by torch's stream pool: the native scheduler's
    role streams come from that pool (`getStreamFromPool`), and in a long video a pool stream can be the one
    a role is running on. Lives as long as the process. Without that runtime entry point, a high-priority
    pool stream (the role streams come from the low-priority pool)."""
    import ctypes

    device = torch.device(device)
    try:
        major = (torch.version.cuda or "").split(".")[0]
        create = ctypes.CDLL(f"libcudart.so.{major}").cudaStreamCreateWithFlags
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            if create(ctypes.byref(handle), ctypes.c_uint(1)) != 0:  # 1 = cudaStreamNonBlocking
                raise OSError("cudaStreamCreateWithFlags failed")
        return torch.cuda.ExternalStream(handle.value, device=device)
    except (OSError, AttributeError):
        lo, hi = torch.cuda.Stream.priority_range()
        return torch.cuda.Stream(device, priority=hi)


class CudaGraphCapture:
    """`torch.cuda.CUDAGraph` capture on one persistent capture stream of `device` (`capture_stream`, outside
    the stream pool), one warm-up run first; the graphs of one device share a memory pool (replayed one at
    a time; their outputs stay referenced). `check_input_liveness` (tests): torch's tracker of the tensors a
    capture reads from outside, which makes a replay after one was freed raise (where torch has it)."""

    kind = "cuda"

    def __init__(self, device, check_input_liveness: bool = False):
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = capture_stream(self.device)
        self.liveness = {"check_input_liveness": True} if check_input_liveness and _has_liveness() else {}

    def capture(self, fn):
        current = torch.cuda.current_stream(self.device)
        side = self.stream
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()  # warm-up: lazy initialisation outside the capture (writes the same K/V the replay will)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a capture that still runs late (a key not captured up front) does not stop the other
        # role's work on the main thread
        with torch.cuda.graph(graph, pool=self.pool, stream=side, capture_error_mode="thread_local", **self.liveness):
            out = fn()
        current.wait_stream(side)
        return graph.replay, out


def _has_liveness() -> bool:
    import inspect

    return "check_input_liveness" in inspect.signature(torch.cuda.graph.__init__).parameters


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
    reads: tuple = ()  # every other tensor the graph reads (RoPE cos/sin, the static prompt K/V): a graph holds
    # addresses only, so these live exactly as long as the graph


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
        self.captured_late = 0  # of which by a forward (a key `capture_all` did not cover), not up front
        self.replays = 0  # forwards served by a replay
        self.eager = 0  # forwards of a graphed role that ran eagerly (mask, gathered slots)

    @property
    def capture_backends(self) -> dict:
        """device -> the capture backend that captured its graphs (made by `capture_factory` at the first capture
        there); a copy, for observation: which backend captured, and on what stream."""
        return dict(self._captures)

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
            self.captured_late += 1
        g.x.copy_(latents)
        g.t.copy_(timesteps)
        self._replay(g)
        return g.out.clone()

    def capture_all(self, role: str, dit, text: TextKV, cache, block_shape, plan) -> int:
        """Capture, before the scheduler starts, the graph of every forward in `plan` that has none yet, so
        that no capture runs inside a role's lane (a capture synchronizes the device and empties the
        allocator's cache). `plan`: (position, frames) per forward, in the order a video meets them
        (`position`: the cache's committed frames before it; the cache is walked there by bookkeeping
        alone: commits of the frames in between, or a rollback). `block_shape` [1, C, F, h, w]: the
        latents' shape but for the frame count. The capture's warm-up writes K/V into pending slots only,
        which every forward rewrites before it reads them; the cache ends rolled back to frame 0.
        Returns the number of graphs captured."""
        if role not in self.roles:
            return 0
        device = cache.buffer.device
        static_text = self._static_text(role, text)
        before = self.captured
        for position, frames in plan:
            at = cache.committed_frames
            if position < at:
                cache.rollback(position)
            elif position > at:
                cache.begin_write(position - at)
                cache.commit()
            latents = torch.zeros((*block_shape[:2], frames, *block_shape[3:]), device=device)
            timesteps = torch.zeros((1, frames), device=device)
            cache.begin_write(frames)
            if _contiguous(cache.visible_slots()):
                key = self.key(role, latents, timesteps, cache, position)
                if key not in self._graphs:
                    self._graphs[key] = self._capture(dit, latents, timesteps, static_text, position, cache)
            cache.rollback(position)  # the pending slots released
        cache.rollback(0)
        return self.captured - before

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
        return _Graph(replay, x, t, out, cache, (cos, sin, *text.keys, *text.values))

    def stats(self) -> dict:
        return {"graphs": len(self._graphs), "captured": self.captured, "captured_late": self.captured_late,
                "replays": self.replays,
                "eager": self.eager, "caches": len(self._caches)}
