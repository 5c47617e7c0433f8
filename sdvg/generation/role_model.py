"""A role model: one DiT in its role (drafter or target) with its KV cache, its context rule (full or
recompute) on its device; every forward it runs is counted into the run's counters. The text K/V a
forward runs under is an argument of each call (the block's conditioning, `plan.Conditioning`):
the model holds no prompt. `prepare` (sdvg/generation/prepare.py) builds one per role of a video; both
schedulers drive them through the stage calls."""
from __future__ import annotations

import math
from collections import deque

import torch

from sdvg.config import RoleContext
from sdvg.generation.noise import gaussian
from sdvg.generation.schedule import FlowSchedule
from sdvg.models.device_constants import to_device_async
from sdvg.models.dit import block_causal_mask


class RoleModel:
    """One DiT in its role (drafter or target) with its KV cache and its context rule on its device; every
    forward is counted into the run's counters (`<role>_forwards`); `text_kv` is each call's conditioning.

    Under a `full` context (`RoleContext.mode`) a block is denoised at its absolute frame index and
    `commit` runs the clean t = 0 forward that writes its K/V; under `recompute` `commit` only records
    the block's latents and `denoise` first rebuilds the cache from the recorded context (Krea)."""

    def __init__(self, dit, role: str, cache, device, context: RoleContext, schedule: FlowSchedule,
                 counters, runners, frames_per_block: int, tokens_per_frame: int, vae=None, emitted_pixels=None,
                 exit_verifier=None, keep_clean: bool = False):
        self.dit, self.role, self.cache, self.device = dit, role, cache, device
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
        # re-cache on a switch (a plan that re-caches, full context): the clean latents of the committed frames a
        # window can still see are kept (`keep_clean`), and `recache_forwards` counts the re-cache forwards made
        self.keep_clean = keep_clean or exit_verifier is not None
        self.recache_forwards = 0
        self.prefix_frames = 0  # clean latent frames before block 0 (a start frame's; `start_from`)

    @property
    def committed_frames(self) -> int:
        """Latent frames committed so far: the native cache's write pointer (full; the native scheduler
        may move it back) or the frames recorded (recompute)."""
        return self.recorded_frames if self.context.recompute else self.cache.committed_frames

    @property
    def kept_clean_frames(self) -> list[int]:
        """The latent frames (ascending) whose clean latents this role keeps now (full context, `keep_clean`: the
        stability verifier's history, a re-cache's input); for observation: which frames a long run still holds."""
        return sorted(self._clean_frames)

    def frame_of(self, block: int) -> int:
        """Block `block`'s first latent frame: after the start frame's frames, if any."""
        return self.prefix_frames + block * self.frames_per_block

    def start_from(self, latents: torch.Tensor, text_kv) -> None:
        """A start frame's clean latents [1, C, n, h, w] become frames 0 .. n - 1 before block 0 (Krea's
        `resume_latents`): recorded as the context (recompute) or written by one t = 0 forward and committed
        (full; their clean latents kept for a re-cache on a switch). Call once, on a fresh cache."""
        if self.committed_frames or self.prefix_frames:
            raise RuntimeError(f"{self.role}: a start frame goes into a fresh cache, before block 0")
        keep = self.keep_clean
        self.keep_clean = True  # a live session's re-cache needs them
        self.commit_forward(latents, 0, text_kv)
        self.keep_clean = keep
        if not self.context.recompute:
            self.cache.commit()
        self.prefix_frames = latents.shape[2]

    def forward(self, x, t, frame0: int, text_kv, attn_mask=None, active=None, hidden=None):
        return self.runners.dit_forward(self.role, self.dit, x, t, text_kv, frame0, self.cache,
                                        attn_mask=attn_mask, active=active, hidden=hidden)

    def count_forward(self) -> None:
        """Counts one forward of this role into the run's counters (`<role>_forwards`); a batched denoising
        (sdvg/generation/batching.py) counts each of its rows here."""
        setattr(self.counters, self.attr, getattr(self.counters, self.attr) + 1)

    def denoise(self, noise: torch.Tensor, block: int, frame0: int, seed: int, text_kv) -> torch.Tensor:
        """Few-step denoising of `noise` (float32) for block `block` under `text_kv` -> x0 (float32, on this device).
        `frame0` is the block's absolute first latent frame; the RoPE position is the cache's write
        position (frame0 under full, the context length under recompute)."""
        if frame0 != self.committed_frames:
            raise ValueError(f"{self.role}: block {block} starts at frame {frame0} but {self.committed_frames} "
                             "frames are committed; commit every earlier block first")
        if self.context.recompute:
            position = self.rebuild_context(block, text_kv)
        else:
            position = frame0
        if self.exit_verifier is not None:
            return self._denoise_with_exit(noise, block, position, seed, text_kv)
        x = to_device_async(noise, self.device)  # the CPU-drawn block noise, from pinned memory on CUDA
        steps = self.schedule.num_steps
        for i in range(steps):
            x0 = self.x0_at(x, i, position, text_kv)
            self.count_forward()
            x = self.renoised(x0, i + 1, block, seed) if i + 1 < steps else x0
        return x

    def x0_at(self, x: torch.Tensor, i: int, position: int, text_kv, active=None, hidden=None) -> torch.Tensor:
        """One denoising call: the model's flow for `x` at step i's timestep -> the clean estimate x0
        (float32 [1, C, F, h, w]). The plain loop, the oracle's rollout and the early-exit loop all step here
        (`active`, `hidden`: the sparse forward of early exit)."""
        t = torch.full((1, x.shape[2]), self.schedule.timesteps[i], device=self.device)
        return self.schedule.to_x0(x, self.forward(x, t, position, text_kv, active=active, hidden=hidden), i)

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
    def _denoise_with_exit(self, noise: torch.Tensor, block: int, position: int, seed: int, text_kv) -> torch.Tensor:
        """The early-exit loop; its record is kept in `exit_records[block]` (a redraft replaces it). The
        counters count the schedule's calls, as the native scheduler does; the calls actually made are in
        the record."""
        from sdvg.generation.early_exit import denoise_with_exit

        frames = self.history_frames()
        x, record = denoise_with_exit(self, self.exit_verifier, noise, block, position, seed, text_kv,
                                      lambda: self.history_tokens(frames))
        for _ in range(self.schedule.num_steps):
            self.count_forward()
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
    def recache(self, text_kv) -> None:
        """Re-cache on a switch (LongLive's `_recache_after_switch`): one t = 0 forward over every committed frame
        the cache still shows (sinks and window), each at its own position, block-causal among them (a frame
        attends to the frames of its block and earlier ones), under the current text K/V; their K/V replace
        the old ones in their slots. Full context only; a recompute context is rebuilt every block anyway.
        `text_kv`: the new conditioning's K/V."""
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
        dit.forward_with(x, t_freq, text_kv.keys, text_kv.values, cos, sin, attend)
        self.count_forward()
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

    def rebuild_context(self, block: int, text_kv) -> int:
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
        self.forward(x, torch.zeros((1, n), device=self.device), 0, text_kv, attn_mask=mask)
        self.count_forward()
        self.cache.commit()
        return n

    # ----------------------------------------------------------------- commit
    def commit_forward(self, latents: torch.Tensor, frame0: int, text_kv) -> None:
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
            self.forward(x, t, frame0, text_kv)
            self.committed(latents, frame0)

    def committed(self, latents: torch.Tensor, frame0: int) -> None:
        """After a full context's t = 0 forward over a block at `frame0` (`commit_forward`'s, or a batched one's of
        several videos, sdvg/generation/batching.py): the forward counted, the block's clean latents kept."""
        self.count_forward()
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
