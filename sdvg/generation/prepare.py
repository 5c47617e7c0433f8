"""What one video needs before either scheduler runs: the schedule, each role's DiT with a fresh KV
cache and its prompt K/V, the VAE cache and the stage runners. Shared by the reference loop and the
native driver (neither imports the other)."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from sdvg.config import RoleContext
from sdvg.generation.guard import StageGuard
from sdvg.generation.noise import gaussian
from sdvg.generation.schedule import FlowSchedule, counted_steps, strength_steps
from sdvg.models.components import Components
from sdvg.models.device_constants import to_device_async
from sdvg.models.dit import block_causal_mask
from sdvg.models.fp8 import check_roles, fp8_state, fp8_tensors, kept_copy, role_dit, tensor_bytes
from sdvg.models.kv_cache import KVCacheSpec
from sdvg.models.memory import (MemoryItem, check_budget, device_key, fp8_weights_item, kv_arithmetic,
                                prompt_kv_bytes, resident_items)
from sdvg.models.reward import Aggregator
from sdvg.options import GenerationOptions, backend_conflicts


class RoleModel:
    """One DiT in its role (drafter or target) with its KV cache, its context rule and its prompt K/V
    on its device; every forward is counted into the run's counters (`<role>_forwards`).

    Under a `full` context (`RoleContext.mode`) a block is denoised at its absolute frame index and
    `commit` runs the clean t = 0 forward that writes its K/V; under `recompute` `commit` only records
    the block's latents and `denoise` first rebuilds the cache from the recorded context (Krea)."""

    def __init__(self, dit, role: str, cache, text_kv, device, context: RoleContext, schedule: FlowSchedule,
                 counters, runners, frames_per_block: int, tokens_per_frame: int, vae=None, emitted_pixels=None,
                 exit_verifier=None):
        self.dit, self.role, self.cache, self.text_kv, self.device = dit, role, cache, text_kv, device
        self.context, self.schedule, self.counters, self.runners = context, schedule, counters, runners
        self.frames_per_block, self.tokens_per_frame = frames_per_block, tokens_per_frame
        self.attr = f"{role}_forwards"
        # recompute: latent frame 0 and the last kv_cache_frames - 1 committed frames ([1, C, 1, h, w] each)
        self.first_frame: torch.Tensor | None = None
        self.recent: deque = deque(maxlen=max(context.kv_cache_frames - 1, 0))
        self.recorded_frames = 0  # recompute: latent frames committed so far
        self.vae, self.emitted_pixels = vae, emitted_pixels
        # early exit (sdvg/generation/early_exit): the verifier, each denoise's record by block, and the clean
        # latent frames the history of the stability verifier is read from (full: committed frames by index;
        # recompute: the context of the last rebuild)
        self.exit_verifier = exit_verifier
        self.exit_records: dict = {}
        self.patch = tuple(dit.config.patch_size)
        self._clean_frames: dict[int, torch.Tensor] = {}
        self._context: list[torch.Tensor] = []
        # re-cache on a switch (live sessions, full context): the clean latents of the committed frames a window
        # can still see are kept (`keep_clean`), and `recache_forwards` counts the re-cache forwards made
        self.keep_clean = exit_verifier is not None
        self.recache_forwards = 0
        self.text_key = None  # live sessions: the key of the conditioning `text_kv` holds (StageCalls._condition)
        self.prefix_frames = 0  # clean latent frames before block 0 (a start frame's; `start_from`)

    @property
    def committed_frames(self) -> int:
        """Latent frames committed so far: the native cache's write pointer (full; the native scheduler
        may move it back) or the frames recorded (recompute)."""
        return self.recorded_frames if self.context.recompute else self.cache.committed_frames

    def frame_of(self, block: int) -> int:
        """Block `block`'s first latent frame: after the start frame's frames, if any."""
        return self.prefix_frames + block * self.frames_per_block

    def start_from(self, latents: torch.Tensor) -> None:
        """A start frame's clean latents [1, C, n, h, w] become frames 0 .. n - 1 before block 0 (Krea's
        `resume_latents`): recorded as the context (recompute) or written by one t = 0 forward and committed
        (full; their clean latents kept for a re-cache on a switch). Call once, on a fresh cache."""
        if self.committed_frames or self.prefix_frames:
            raise RuntimeError(f"{self.role}: a start frame goes into a fresh cache, before block 0")
        keep = self.keep_clean
        self.keep_clean = True  # a live session's re-cache needs them; set on the model only after prepare
        self.commit_forward(latents, 0)
        self.keep_clean = keep
        if not self.context.recompute:
            self.cache.commit()
        self.prefix_frames = latents.shape[2]

    def forward(self, x, t, frame0: int, attn_mask=None, active=None, hidden=None):
        return self.runners.dit_forward(self.role, self.dit, x, t, self.text_kv, frame0, self.cache,
                                        attn_mask=attn_mask, active=active, hidden=hidden)

    def _count(self):
        setattr(self.counters, self.attr, getattr(self.counters, self.attr) + 1)

    def denoise(self, noise: torch.Tensor, block: int, frame0: int, seed: int) -> torch.Tensor:
        """Few-step denoising of `noise` (float32) for block `block` -> x0 (float32, on this device).
        `frame0` is the block's absolute first latent frame; the RoPE position is the cache's write
        position (frame0 under full, the context length under recompute)."""
        if frame0 != self.committed_frames:
            raise ValueError(f"{self.role}: block {block} starts at frame {frame0} but {self.committed_frames} "
                             "frames are committed; commit every earlier block first")
        if self.context.recompute:
            position = self.rebuild_context(block)
        else:
            position = frame0
        if self.exit_verifier is not None:
            return self._denoise_with_exit(noise, block, position, seed)
        x = to_device_async(noise, self.device)  # the CPU-drawn block noise, from pinned memory on CUDA
        steps = self.schedule.num_steps
        for i in range(steps):
            x0 = self.x0_at(x, i, position)
            self._count()
            x = self.renoised(x0, i + 1, block, seed) if i + 1 < steps else x0
        return x

    def x0_at(self, x: torch.Tensor, i: int, position: int, active=None, hidden=None) -> torch.Tensor:
        """One denoising call: the model's flow for `x` at step i's timestep -> the clean estimate x0
        (float32 [1, C, F, h, w]). The plain loop, the oracle's rollout and the early-exit loop all step here
        (`active`, `hidden`: the sparse forward of early exit)."""
        t = torch.full((1, x.shape[2]), self.schedule.timesteps[i], device=self.device)
        return self.schedule.to_x0(x, self.forward(x, t, position, active=active, hidden=hidden), i)

    def renoised(self, x0: torch.Tensor, i: int, block: int, seed: int) -> torch.Tensor:
        """`x0` re-noised to step i's level with this role's draw of (seed, block, i)."""
        return self.schedule.renoise(x0, gaussian(x0.shape, seed, block, i, self.role, self.device), i)

    def graph_plan(self, num_blocks: int) -> list[tuple[int, int]]:
        """(cache position, frames) of every graphable forward a video of `num_blocks` blocks runs, in order
        (`DiTGraphs.capture_all`): full: each block's steps and commit at its frame; recompute: each block's
        context forward (when it takes no mask: one group of frames) and its steps after the context."""
        F = self.frames_per_block
        if not self.context.recompute:
            return [(b * F, F) for b in range(num_blocks)]
        plan = [(0, F)]
        for b in range(1, num_blocks):
            n = 1 + (min(b * F - 1, self.context.kv_cache_frames - 1) if b * F > 1 else 0)
            if context_mask(n, F, self.tokens_per_frame, self.device) is None:
                plan.append((0, n))
            plan.append((n, F))
        return plan

    # ------------------------------------------------------------ early exit
    def _denoise_with_exit(self, noise: torch.Tensor, block: int, position: int, seed: int) -> torch.Tensor:
        """The early-exit loop; its record is kept in `exit_records[block]` (a redraft replaces it). The
        counters count the schedule's calls, as the native scheduler does; the calls actually made are in
        the record."""
        from sdvg.generation.early_exit import denoise_with_exit

        frames = self.history_frames()
        x, record = denoise_with_exit(self, self.exit_verifier, noise, block, position, seed,
                                      lambda: self.history_tokens(frames))
        for _ in range(self.schedule.num_steps):
            self._count()
        self.exit_records[block] = record
        return x

    def history_frames(self) -> list[torch.Tensor]:
        """The clean latent frames ([1, C, 1, h, w] each) the attention window sees now: the committed
        visible frames (full) or the rebuilt context (recompute)."""
        if self.context.recompute:
            return list(self._context)
        committed = self.cache.committed_frames
        self._forget_clean_frames()
        return [self._clean_frames[f] for f in self.cache.visible_frames() if f < committed and f in self._clean_frames]

    def _forget_clean_frames(self) -> None:
        """Drop the kept clean frames no window (nor a run-ahead rollback, 2 blocks) can see again."""
        window = self.context.window
        if window.window_frames:
            reach = self.cache.committed_frames - window.window_frames - 2 * self.frames_per_block
            for f in [f for f in self._clean_frames if f < reach and f >= window.sink_frames]:
                del self._clean_frames[f]

    # -------------------------------------------------------------- re-cache
    @torch.no_grad()  # the K/V go into the cache in place: no autograd graph may hold the cache
    def recache(self) -> None:
        """Re-cache on a switch (LongLive's `_recache_after_switch`): one t = 0 forward over every committed frame
        the cache still shows (sinks and window), each at its own position, block-causal among them (a frame
        attends to the frames of its block and earlier ones), under the current text K/V; their K/V replace
        the old ones in their slots. Full context only; a recompute context is rebuilt every block anyway."""
        cache = self.cache
        if self.context.recompute or cache.pending_frames:
            raise RuntimeError(f"{self.role}: re-cache runs between blocks on a full context")
        committed = cache.committed_frames
        frames = [f for f in cache.visible_frames() if f < committed]
        if not frames:
            return
        missing = [f for f in frames if f not in self._clean_frames]
        if missing:
            raise RuntimeError(f"{self.role}: re-cache needs the clean latents of frames {missing}, which were not kept")
        dit, device, F = self.dit, self.device, self.frames_per_block
        x = torch.cat([self._clean_frames[f].to(device) for f in frames], dim=2)  # [1, C, n, h, w]
        n, (h, w) = len(frames), x.shape[-2:]
        tpf = self.tokens_per_frame
        runs = _runs(frames)  # contiguous frame ranges: each takes its own RoPE positions
        tables = [dit.rope(start, length, h, w, device) for start, length in runs]
        cos, sin = torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])
        p = self.prefix_frames  # a start frame's frames are one group, written by one forward before block 0
        blocks = torch.tensor([-1 if f < p else (f - p) // F for f in frames])
        mask = None
        if len(set(blocks.tolist())) > 1:
            mask = (blocks[None, :] <= blocks[:, None]).repeat_interleave(tpf, 0).repeat_interleave(tpf, 1).to(device)
        slots = torch.tensor(cache.visible_slots()[:n], dtype=torch.int64)
        positions = (slots[:, None] * tpf + torch.arange(tpf)[None, :]).flatten().to(device)

        def attend(layer, k, v):  # the frames' new K/V into their slots; attention among them only
            from sdvg.models.kv_cache import write_positions

            write_positions(cache, layer, k, v, positions)
            return k, v, mask

        t_freq = dit.timestep_freqs(torch.zeros((1, n), device=device))
        dit.forward_with(x, t_freq, self.text_kv.keys, self.text_kv.values, cos, sin, attend)
        self._count()
        self.recache_forwards += 1

    def history_tokens(self, frames: list[torch.Tensor]) -> torch.Tensor:
        from sdvg.generation.early_exit.tokens import to_tokens

        if not frames:
            return torch.zeros((0, self.dit.config.in_channels * math.prod(self.patch)),
                               device=self.device)
        return to_tokens(torch.cat([f.to(self.device) for f in frames], dim=2), self.patch)

    # ------------------------------------------------------------- recompute
    def context_frames(self, block: int) -> list[torch.Tensor]:
        """Krea's `get_clean_context_frames` for block `block` (> 0): latent frame 0 while the context still
        reaches it (or always, with keep_first_frame), else the oldest emitted pixel frame of the window
        re-encoded alone; then the last kv_cache_frames - 1 committed frames."""
        ctx, F = self.context, self.frames_per_block
        if ctx.keep_first_frame or (block - 1) * F < ctx.kv_cache_frames:
            first = self.first_frame
        else:
            if self.vae is None or not self.emitted_pixels:
                raise RuntimeError(f"{self.role}: re-encoding the first context frame needs the VAE and the emitted "
                                   "pixel window")
            first = self.vae.encode_frame(self.emitted_pixels.oldest()).to(self.device)
        rest = list(self.recent) if self.committed_frames > 1 else []
        return [first] + rest

    def rebuild_context(self, block: int) -> int:
        """Reset the cache and fill it with one t = 0 forward over the clean context frames, positioned from
        0, block-causal among them. Returns the new block's position (the context length)."""
        self.cache.rollback(0)
        if self.committed_frames == 0:  # block 0 of a video without a start frame: no context
            return 0
        frames = self.context_frames(block)
        if self.exit_verifier is not None:
            self._context = list(frames)
        x = torch.cat([f.to(self.device) for f in frames], dim=2)  # [1, C, n, h, w]
        n = x.shape[2]
        mask = context_mask(n, self.frames_per_block, self.tokens_per_frame, self.device)
        self.forward(x, torch.zeros((1, n), device=self.device), 0, attn_mask=mask)
        self._count()
        self.cache.commit()
        return n

    # ----------------------------------------------------------------- commit
    def commit_forward(self, latents: torch.Tensor, frame0: int) -> None:
        """full: the clean forward at t = 0 writes the block's K/V into the pending slots (pointer
        unchanged: the loop that runs, Python or C++, moves it with `cache.commit()`). recompute: the
        block's latents join the context (no forward, no pointer move)."""
        if frame0 != self.committed_frames:
            raise ValueError(f"{self.role}: committing a block at frame {frame0}, expected {self.committed_frames}")
        if self.context.recompute:
            frames = latents.detach().float().split(1, dim=2)
            if self.first_frame is None:
                self.first_frame = frames[0]
                frames = frames[1:]
            self.recent.extend(frames)
            self.recorded_frames += latents.shape[2]
        else:
            x = latents.to(self.device)
            t = torch.zeros((1, x.shape[2]), device=self.device)
            self.forward(x, t, frame0)
            self._count()
            if self.keep_clean:  # the stability verifier's history; re-cache's input
                for j, f in enumerate(latents.detach().float().split(1, dim=2)):
                    self._clean_frames[frame0 + j] = f
                if self.exit_verifier is None:
                    self._forget_clean_frames()


def _runs(frames: list[int]) -> list[tuple[int, int]]:
    """Ascending frame indices -> their contiguous runs as (start, length)."""
    runs: list[list[int]] = []
    for f in frames:
        if runs and f == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([f, 1])
    return [(a, b) for a, b in runs]


def context_mask(num_frames: int, frames_per_block: int, tokens_per_frame: int, device) -> torch.Tensor | None:
    """The attention mask of a recompute context forward over `num_frames` clean frames: None when they are one
    group (every token attends to every frame: SDPA then runs its unmasked kernels, bitwise the all-true
    mask on the CPU; tests/test_context_modes.py), else the block-causal [N, N] mask, kept on the device."""
    if num_frames <= frames_per_block:
        return None
    from sdvg.models.device_constants import device_constant

    return device_constant(("context_mask", num_frames, frames_per_block, tokens_per_frame), device,
                           lambda: block_causal_mask(None, frames_per_block, tokens_per_frame, num_frames=num_frames))


def cache_spec(comps: Components, dit, context: RoleContext, num_blocks: int, slack_frames: int = 0,
               runners=None, prefix_frames: int = 0) -> KVCacheSpec:
    """The KV cache one role gets for a video (what `allocate_cache` allocates and the budget check counts).
    Every backend uses the same cache: the static stages take the visible cache length as a dynamic
    dimension (sdvg/engines/stages.py), so both context modes run on all of them."""
    return KVCacheSpec.for_context(comps.preset, dit.config, context, num_blocks, slack_frames, prefix_frames)


def allocate_cache(comps: Components, dit, device, context: RoleContext, num_blocks: int, slack_frames: int = 0,
                   runners=None, prefix_frames: int = 0):
    return cache_spec(comps, dit, context, num_blocks, slack_frames, runners, prefix_frames).allocate(dit.dtype, device)


def _roles(comps: Components, opts: GenerationOptions) -> list[tuple[str, object, torch.device]]:
    """(role, DiT, device) of each role the mode runs."""
    return [(role, getattr(comps, role), getattr(comps, f"{role}_device")) for role in opts.roles]


def video_memory(comps: Components, opts: GenerationOptions, slack_frames: int = 0, runners=None,
                 prefix_frames: int = 0) -> list[MemoryItem]:
    """What `prepare` allocates for one video, per device: each role's KV cache (the very spec it
    allocates; `KVCacheSpec.nbytes`) and its prompt K/V. `opts` are resolved options."""
    items = []
    text_len = comps.preset.text_encoder.text_len
    for role, dit, device in _roles(comps, opts):
        context = opts.role_context(role)
        slack = slack_frames if role == "drafter" else 0
        nbytes, how = kv_arithmetic(cache_spec(comps, dit, context, opts.num_blocks, slack, runners, prefix_frames),
                                    context, dit.dtype)
        dev = device_key(device)
        items.append(MemoryItem(dev, f"{role} KV cache", nbytes, how))
        items.append(MemoryItem(dev, f"{role} prompt K/V", *prompt_kv_bytes(dit.config, text_len, dit.dtype)))
    return items


def resident_components(comps: Components) -> list[MemoryItem]:
    """The weights a pipeline already holds, per device (measured), the FP8 copies kept for its DiTs
    included (their own tensors: the rest is the DiT's)."""
    items = resident_items({"drafter": comps.drafter, "target": comps.target, "umT5 text encoder":
                            comps.text_encoder.model, "VAE": comps.vae.vae,
                            "ImageReward": comps.scorer.model if comps.scorer is not None else None})
    for role in ("drafter", "target"):
        dit = getattr(comps, role)
        held = kept_copy(dit) if dit is not None else None
        if held is not None:
            tensors = fp8_tensors(held)
            items.append(MemoryItem(device_key(dit.device), f"{role} FP8 weights (kept copy)", tensor_bytes(tensors),
                                    f"resident: {len(tensors) // 2} FP8 linears' e4m3 weights + fp32 row scales"))
    return items


def fp8_copy_items(comps: Components, opts: GenerationOptions) -> list[MemoryItem]:
    """The FP8 copies this video makes (a role asked in FP8 whose DiT has none yet): e4m3 weights and
    fp32 row scales of its block linears (`fp8_weights_item`)."""
    items = []
    for role in (r for r in opts.fp8_roles() if r in opts.roles):
        dit = getattr(comps, role)
        if dit is None or fp8_state(dit) is not None or kept_copy(dit) is not None:
            continue
        items.append(fp8_weights_item(dit.config, device_key(dit.device), f"{role} FP8 weights (a copy made now)").item)
    return items


def _fixes(opts: GenerationOptions) -> str:
    fixes = [f"fewer blocks (num_blocks is {opts.num_blocks})"]
    full = [r for r in opts.roles if not opts.role_context(r).recompute]
    if full:
        flags = " / ".join({"drafter": "drafter_cache='recompute'", "target": "target_context='recompute'"}[r]
                           for r in full)
        fixes.append(f"the recompute context ({flags}: kv_cache_frames context frames + one block, whatever the "
                     "video's length)")
        fixes.append("a local window for a full context (window_frames=..., sink_frames=...)")
    fixes.append("or a larger budget (memory_budget_gib=... / --memory-budget-gib; None: the device's free memory)")
    return ", ".join(fixes)


def text_encoder_visit(comps: Components, prompt: str | None) -> list[MemoryItem]:
    """An offloaded umT5 visits its execution device to encode a prompt it has not cached (its weights
    come over, then leave before the caches are allocated): that visit, or nothing."""
    te = comps.text_encoder
    if prompt is None or te.execution_device is None or te.execution_device == te.offload_device \
            or prompt in te.cache:
        return []
    (item,) = resident_items({"umT5 text encoder": te.model})
    return [MemoryItem(device_key(te.execution_device), "umT5 text encoder (visits to encode the prompt)",
                       item.nbytes, item.arithmetic.replace("resident", "offloaded"))]


def check_memory(comps: Components, opts: GenerationOptions, slack_frames: int = 0, runners=None,
                 memory_budget_gib: float | None = None, prompt: str | None = None,
                 prefix_frames: int = 0) -> list[MemoryItem]:
    """The budget check of one video, before anything of it is allocated (the weights are already
    resident): with `memory_budget_gib` None, what this video allocates against each device's free
    memory now; with a budget, the resident weights plus this video against it. An offloaded text
    encoder's visit to encode `prompt` comes first in `prepare` and is checked on its own. Returns the
    video's items; raises `MemoryBudgetError`."""
    resident = resident_components(comps) if memory_budget_gib is not None else None
    visit = text_encoder_visit(comps, prompt)
    if visit:
        check_budget(visit, memory_budget_gib, resident, "keep the text encoder off this device "
                     "(TextEncoder.enable_offload with an execution device that has room), free memory on it, or a "
                     "larger budget (memory_budget_gib=... / --memory-budget-gib)")
    needs = fp8_copy_items(comps, opts) + video_memory(comps, opts, slack_frames, runners, prefix_frames)
    check_budget(needs, memory_budget_gib, resident, _fixes(opts))
    return needs


class PixelWindow:
    """The last `maxlen` emitted pixel frames ([1, 3, 1, H, W] each) a recompute role re-encodes its first
    context frame from. They are written where blocks are emitted (the VAE lane under the native scheduler)
    and read on the role's lane: a read waits for an event recorded after the write, and marks the frame
    as used on the reading stream (a no-op off CUDA)."""

    def __init__(self, maxlen: int):
        self.frames: deque = deque(maxlen=maxlen)
        self._written = None  # torch.cuda.Event recorded on the writing stream after the last write

    def __len__(self) -> int:
        return len(self.frames)

    def extend(self, pixels: torch.Tensor) -> None:
        """Append a block's pixels [1, 3, T, H, W] (call once per block, in order)."""
        if not self.frames.maxlen:
            return
        self.frames.extend(pixels.split(1, dim=2))
        if pixels.is_cuda:
            self._written = torch.cuda.Event()
            self._written.record(torch.cuda.current_stream(pixels.device))

    def oldest(self) -> torch.Tensor:
        """The oldest frame, ordered after its write on the calling thread's current stream."""
        frame = self.frames[0]
        if frame.is_cuda:
            stream = torch.cuda.current_stream(frame.device)
            if self._written is not None:
                stream.wait_event(self._written)
            frame.record_stream(stream)
        return frame


@dataclass
class Setup:
    """What one video needs besides the loop: schedule, models with fresh caches, VAE cache."""

    aggregator: Aggregator
    drafter: RoleModel | None
    target: RoleModel | None
    vae_cache: object
    frames_per_block: int
    block_shape: tuple
    runners: object
    emitted_pixels: "PixelWindow"  # the last emitted pixel frames a recompute role re-encodes
    guard: StageGuard  # the NaN/inf checks of every stage output (both schedulers)

    def observe(self, pixels: torch.Tensor) -> None:
        """Record a block's emitted pixels [1, 3, T, H, W] (call once per block, in order, before the next
        block is denoised)."""
        self.emitted_pixels.extend(pixels)


def prepare(comps: Components, prompt: str, opts: GenerationOptions, counters, slack_frames: int = 0,
            runners=None, memory_budget_gib: float | None = None, exit_verifiers: dict | None = None,
            start_latents: torch.Tensor | None = None) -> Setup:
    """`opts` are resolved options (num_blocks set); `counters` a `Counters` that the models count into.
    Before anything is allocated, the video's KV caches and prompt K/V are checked against each
    device's free memory, or against `memory_budget_gib` (`check_memory`; `MemoryBudgetError`).
    `exit_verifiers` (role -> verifier) replaces the verifier the options make for a role that exits
    early (the recording verifier of sdvg/evaluation/exit_calibration.py); other roles are refused.
    `start_latents` ([1, z, n, h, w], `sdvg.generation.start_frame`): a start frame's clean latents, frames
    0 .. n - 1 of every role before block 0 (`RoleModel.start_from`)."""
    if opts.num_blocks is None:
        raise ValueError("prepare() needs resolved options: call opts.resolved(preset) first")
    if runners is None:
        from sdvg.generation.backends import StageRunners

        runners = StageRunners(comps, "eager")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("prompt is empty; give a non-empty text prompt")
    p = comps.preset
    for role in opts.roles:
        if getattr(comps, role) is None:
            raise ValueError(f"mode {opts.mode!r} needs a {role}, but none is loaded")
    conflicts = backend_conflicts(opts, runners.backend)
    if conflicts:
        raise ValueError(conflicts[0])
    check_roles(comps, opts)
    if opts.mode == "sdvg" and opts.router == "reward" and comps.scorer is None:
        raise ValueError("router 'reward' needs the ImageReward model; load one or use router 'random'/'pattern'")
    verifiers = exit_verifiers_for(comps, opts)  # bad exit settings refused before allocating
    if exit_verifiers:
        unknown = sorted(set(exit_verifiers) - set(verifiers))
        if unknown:
            raise ValueError(f"exit verifiers given for {unknown}, which do not exit early under early_exit "
                             f"{opts.early_exit!r} and mode {opts.mode!r}")
        verifiers.update(exit_verifiers)
    prefix = 0
    if start_latents is not None:
        why = start_frame_conflict(opts)
        if why:
            raise ValueError(why)
        prefix = start_latents.shape[2]
    check_memory(comps, opts, slack_frames, runners, memory_budget_gib, prompt, prefix)
    dits = role_dits(comps, opts)
    emb = comps.text_encoder.encode(prompt)
    zf = p.video.frames_per_block
    contexts = {role: opts.role_context(role) for role in opts.roles}
    window = max([c.pixel_window(p.vae.temporal_stride) for c in contexts.values()
                  if c.recompute and not c.keep_first_frame] + [0])
    emitted_pixels = PixelWindow(window)
    graphs = runners.use_graphs(opts.cuda_graphs) if opts.cuda_graphs or hasattr(runners, "use_graphs") else None
    if opts.fast_vae or hasattr(runners, "use_fast_vae"):
        runners.use_fast_vae(opts.fast_vae)

    def role_model(role: str, dit, device, slack: int) -> RoleModel:
        context = contexts[role]
        if graphs is not None and role in graphs.roles:  # one cache per pipeline: the graphs hold its addresses
            spec = cache_spec(comps, dit, context, opts.num_blocks, slack, runners)
            cache = graphs.cache(dit, spec, dit.dtype, device)
        else:
            cache = allocate_cache(comps, dit, device, context, opts.num_blocks, slack, runners, prefix)
        schedule = role_schedule(p, context, opts.strength, opts.target_steps if role == "target" else None)
        return RoleModel(dit, role, cache, dit.encode_text(emb), device, context, schedule, counters, runners,
                         zf, p.video.tokens_per_frame(p.vae, dit.config), comps.vae, emitted_pixels,
                         verifiers.get(role))

    drafter = (role_model("drafter", dits["drafter"], comps.drafter_device, slack_frames) if "drafter" in contexts
               else None)
    target = role_model("target", dits["target"], comps.target_device, 0) if "target" in contexts else None
    for model in (drafter, target):
        if model is not None and start_latents is not None:
            model.start_from(start_latents.to(model.device))
    lh, lw = p.video.latent_hw(p.vae)
    for model in (drafter, target):  # every graph captured here, before either scheduler starts
        if graphs is not None and model is not None and model.exit_verifier is None:
            graphs.capture_all(model.role, model.dit, model.text_kv, model.cache, (1, p.vae.z_dim, zf, lh, lw),
                               model.graph_plan(opts.num_blocks))
    return Setup(Aggregator(opts.aggregation), drafter, target, comps.vae.new_cache(opts.vae_decoder), zf,
                 (1, p.vae.z_dim, zf, lh, lw), runners, emitted_pixels, StageGuard(opts))


def role_dits(comps: Components, opts: GenerationOptions) -> dict:
    """role -> the DiT each role of `opts` runs for this video: the pipeline's, or in FP8 (`opts.fp8_roles()`)
    its FP8 copy (made once, then kept) or itself when it was quantized in place (`fp8.role_dit`). The eager
    loop (backends eager and compile) runs the DiT given here; the engine backends, which build their
    stages from the pipeline's own, are refused with FP8 (`backend_conflicts`)."""
    fp8 = opts.fp8_roles()
    return {role: role_dit(getattr(comps, role), role, role in fp8) for role in opts.roles}


def start_frame_conflict(opts: GenerationOptions) -> str | None:
    """Why a start frame cannot go with `opts` (resolved), or None: what is not built with it yet, or a start frame
    whose frames (`kv_cache_frames`, written by one forward) do not fit a full role's attention window."""
    if opts.backend not in (None, "eager", "compile"):  # the engines' static stages
        return (f"start_frame with backend {opts.backend!r}: the static stages are shaped for caches without a start "
                "frame's frames; run it with backend='eager'")
    for role in opts.roles:
        window = opts.role_context(role).window.window_frames
        if window and opts.kv_cache_frames > window:
            return (f"start_frame: its {opts.kv_cache_frames} latent frames (kv_cache_frames) are written by one "
                    f"forward and must fit the {role}'s attention window of {window} frames; raise window_frames to "
                    f"{opts.kv_cache_frames} or more, or lower kv_cache_frames")
    if opts.cuda_graphs:
        return ("start_frame with cuda_graphs: the graphs are captured per block position from frame 0, not yet "
                "after a start frame's frames; run it with cuda_graphs=False")
    if opts.early_exit != "none":
        return ("start_frame with early_exit: the exit verifiers' history does not hold a start frame yet; run it "
                "with early_exit='none'")
    return None


def exit_verifiers_for(comps: Components, opts: GenerationOptions) -> dict:
    """A fresh early-exit verifier per role that exits early (`opts.early_exit`), or {}. Refuses a
    backend without the sparse forward and a head file that does not fit the role's model."""
    from sdvg.generation.early_exit import ExitPlan, make_verifier

    roles = [r for r in opts.exit_roles() if r in opts.roles]
    if not roles:
        return {}
    out = {}
    for role in roles:
        head = None
        if opts.exit_verifier == "head":
            from sdvg.models.exit_head import ExitHead

            dit = getattr(comps, role)
            trained_for = ExitHead.read_extra(opts.exit_head).get("generator", {})  # {} for a missing file
            if trained_for.get("role") not in (None, role):
                raise ValueError(f"exit head {opts.exit_head} was trained on the {trained_for['role']}'s hidden states, "
                                 f"but early exit asks it to judge the {role}'s; train a head for the {role} (sdvg "
                                 f"train-exit-head --role {role}) or exit early in the {trained_for['role']}")
            head = ExitHead.load(opts.exit_head, dim=dit.config.dim, device=getattr(comps, f"{role}_device"))
        out[role] = make_verifier(ExitPlan.from_options(opts, head))
    return out


def role_schedule(preset, context: RoleContext, strength: float = 1.0, count: int | None = None) -> FlowSchedule:
    """A full context runs the preset's `timesteps` (then the t = 0 commit); a recompute context runs
    `recompute_timesteps` (Krea's five calls, the last at t = 0). `strength` < 1 (video-to-video) starts
    either list at step strength * 1000 (`strength_steps`, Krea's rule). `count` (the target's `target_steps`;
    None: the preset's lists) runs that many steps by Krea's rule instead (`counted_steps`)."""
    if count is not None:
        return FlowSchedule.from_steps(counted_steps(count, context.recompute, strength), preset.shift)
    steps = preset.recompute_timesteps if context.recompute else preset.timesteps
    return FlowSchedule.from_steps(strength_steps(tuple(steps), strength), preset.shift)
