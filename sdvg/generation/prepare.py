"""What one video needs before either scheduler runs: the schedule, each role's DiT with a fresh KV
cache and its prompt K/V (a `RoleModel`, sdvg/generation/role_model.py), the VAE cache and the stage
runners. The video's memory is checked first (`check_memory`, sdvg/generation/video_memory.py). Shared
by the reference loop and the native driver (neither imports the other)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from sdvg.config import RoleContext
from sdvg.generation.guard import StageGuard
from sdvg.generation.plan import Conditioning
from sdvg.generation.role_model import RoleModel
from sdvg.generation.schedule import FlowSchedule, counted_steps, strength_steps
from sdvg.generation.video_memory import cache_spec, check_memory
from sdvg.models.components import Components
from sdvg.models.fp8 import check_roles, role_dit
from sdvg.models.reward import Aggregator
from sdvg.options import GenerationOptions, backend_conflicts


def allocate_cache(comps: Components, dit, device, context: RoleContext, num_blocks: int, slack_frames: int = 0,
                   runners=None, prefix_frames: int = 0):
    return cache_spec(comps, dit, context, num_blocks, slack_frames, runners, prefix_frames).allocate(dit.dtype, device)


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
    conditioning: Conditioning  # the prompt's (a whole video's plan gives it to every block)
    text_kv: dict  # (conditioning key, role) -> the role's K/V of the prompt (`calls.TextKVCache`'s first entries)

    def observe(self, pixels: torch.Tensor) -> None:
        """Record a block's emitted pixels [1, 3, T, H, W] (call once per block, in order, before the next
        block is denoised)."""
        self.emitted_pixels.extend(pixels)


def prepare(comps: Components, prompt: str, opts: GenerationOptions, counters, slack_frames: int = 0,
            runners=None, memory_budget_gib: float | None = None, exit_verifiers: dict | None = None,
            start_latents: torch.Tensor | None = None, keep_clean: bool = False) -> Setup:
    """`opts` are resolved options (num_blocks set); `counters` a `Counters` that the models count into.
    Before anything is allocated, the video's KV caches and prompt K/V are checked against each
    device's free memory, or against `memory_budget_gib` (`check_memory`; `MemoryBudgetError`).
    `exit_verifiers` (role -> verifier) replaces the verifier the options make for a role that exits
    early (the recording verifier of sdvg/evaluation/exit_calibration.py); other roles are refused.
    `start_latents` ([1, z, n, h, w], `sdvg.generation.start_frame`): a start frame's clean latents, frames
    0 .. n - 1 of every role before block 0 (`RoleModel.start_from`). `keep_clean`: the video's plan may ask a
    full-context role to re-cache (`Plan.recaches`), so each keeps the clean latents of the frames it can see.
    The prompt's conditioning and each role's K/V of it are made here (`Setup.conditioning`, `Setup.text_kv`)."""
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
    conditioning = Conditioning(("prompt", prompt), prompt, comps.text_encoder.encode(prompt))
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
        return RoleModel(dit, role, cache, device, context, schedule, counters, runners,
                         zf, p.video.tokens_per_frame(p.vae, dit.config), comps.vae, emitted_pixels,
                         verifiers.get(role), keep_clean=keep_clean)

    drafter = (role_model("drafter", dits["drafter"], comps.drafter_device, slack_frames) if "drafter" in contexts
               else None)
    target = role_model("target", dits["target"], comps.target_device, 0) if "target" in contexts else None
    models = [m for m in (drafter, target) if m is not None]
    text_kv = {(conditioning.key, m.role): m.dit.encode_text(conditioning.emb) for m in models}
    for model in models:
        if start_latents is not None:
            model.start_from(start_latents.to(model.device), text_kv[conditioning.key, model.role])
    lh, lw = p.video.latent_hw(p.vae)
    for model in models:  # every graph captured here, before either scheduler starts
        if graphs is not None and model.exit_verifier is None:
            graphs.capture_all(model.role, model.dit, text_kv[conditioning.key, model.role], model.cache,
                               (1, p.vae.z_dim, zf, lh, lw), model.graph_plan(opts.num_blocks))
    return Setup(Aggregator(opts.aggregation), drafter, target, comps.vae.new_cache(opts.vae_decoder), zf,
                 (1, p.vae.z_dim, zf, lh, lw), runners, emitted_pixels, StageGuard(opts), conditioning, text_kv)


def role_dits(comps: Components, opts: GenerationOptions) -> dict:
    """role -> the DiT each role of `opts` runs for this video: the pipeline's, or in FP8 (`opts.fp8_roles()`)
    its FP8 copy (made once, then kept) or itself when it was quantized in place (`fp8.role_dit`). The eager
    loop (backends eager and compile) runs the DiT given here; the engine backends, which build their
    engines from the pipeline's own, are refused with FP8 (`backend_conflicts`)."""
    fp8 = opts.fp8_roles()
    return {role: role_dit(getattr(comps, role), role, role in fp8) for role in opts.roles}


def start_frame_conflict(opts: GenerationOptions) -> str | None:
    """Why a start frame cannot go with `opts` (resolved), or None: what is not built with it yet, or a start frame
    whose frames (`kv_cache_frames`, written by one forward) do not fit a full role's attention window."""
    if opts.backend not in (None, "eager", "compile"):  # the engines' static shapes
        return (f"start_frame with backend {opts.backend!r}: its engines are shaped for caches without a start "
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
