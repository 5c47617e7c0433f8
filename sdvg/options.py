"""The generation options: declared once, here.

Each option is declared once, with its default and help, in one of two halves: `MethodOptions`
(what video you get: mode, tau, router, aggregation, contexts, forced block, early exit) or
`RunOptions` (how it runs: scheduler, backend, run-ahead, graphs, stage timing, fast VAE, FP8).
`GenerationOptions` is both as one flat keyword set, and everything else derives from it. The halves
group the declaration by meaning; every layer takes the whole `GenerationOptions` (no layer reads one
half only; docs/api.md, "Generation options"):

- the API keywords of `SpeculativeVideoPipeline.__call__` / `.stream` (written out by hand for
  readable signatures, defaults read from `DEFAULTS`; `tests/test_options.py` checks they match);
- the CLI flags, their choices, defaults and help (`add_option_flags`, `options_from_args`);
- the option fields of the statistics (`GenerationOptions.as_dict`);
- the native scheduler's config (`sdvg.generation.native`, every field passed by name; the C++
  side declares no defaults and refuses unknown or missing fields).

Every rule on an option's value lives here: a method rule in `MethodOptions`, a run rule in
`RunOptions`, the roles of a mode in `MODE_ROLES`, the roles a quantization runs in FP8 in
`QUANTIZATION_ROLES`, what needs the eager backend (or FP8's backends) in `backend_conflicts`.
This module imports no torch, so `sdvg --help` stays fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
from dataclasses import dataclass, field

from sdvg.config import CONTEXT_MODES, VAE_DECODERS, KVWindow, RoleContext

MODES: tuple[str, ...] = ("sdvg", "target", "draft")
ROUTERS: tuple[str, ...] = ("reward", "random", "pattern")
AGGREGATIONS: tuple[str, ...] = ("min", "mean", "trimmed_mean", "quantile")
DRAFTER_CONTEXTS: tuple[str, ...] = ("own", "committed")
SCHEDULERS: tuple[str, ...] = ("cpp", "reference")
BACKENDS: tuple[str, ...] = ("eager", "compile", "tensorrt", "onnxruntime", "torch-tensorrt")
TRT_RUNTIMES: tuple[str, ...] = ("torch", "cuda-python")  # how a TensorRT plan is driven (sdvg/engines/executor.py)
# backend compile (sdvg/generation/compile.py): the torch.compile modes it takes (the CUDA-graph modes,
# "reduce-overhead" and "max-autotune", would capture each region with static copies of its inputs, which
# the KV cache's views and the per-layer weights do not suit: cuda_graphs=True captures whole forwards), and
# the torch.compile backends (inductor generates the kernels; aot_eager and eager only trace: debugging, tests)
COMPILE_MODES: tuple[str, ...] = ("default", "max-autotune-no-cudagraphs")
COMPILERS: tuple[str, ...] = ("inductor", "aot_eager", "eager")
EARLY_EXIT_ROLES: tuple[str, ...] = ("none", "target", "drafter", "both")
EXIT_VERIFIERS: tuple[str, ...] = ("stability", "oracle", "head", "pattern")
STAGE_TIMINGS: tuple[str, ...] = ("sync", "events")
EXIT_BACKENDS: tuple[str, ...] = ("eager",)  # the stage backends that run a sparse (early-exit) forward
QUANTIZATIONS: tuple[str, ...] = ("none", "fp8", "fp8-target", "fp8-drafter")
# The roles whose DiT block linears each quantization runs in FP8 (sdvg/models/fp8.py).
QUANTIZATION_ROLES: dict[str, tuple[str, ...]] = {"none": (), "fp8": ("drafter", "target"), "fp8-target": ("target",),
                                                  "fp8-drafter": ("drafter",)}
FP8_BACKENDS: tuple[str, ...] = ("eager", "compile")  # the stage backends that run an FP8 DiT (the eager loop's)
# Speculative Forcing's published training-free thresholds (one 5-second setting): tau_red, tau_stab.
PAPER_EXIT_THRESHOLDS: tuple[float, float] = (0.497, 0.327)

SEED_MAX = 2**63 - 1
# Upper bounds of the size options, so no size derived from them can pass 2^63 (checked before loading).
MAX_BLOCKS = 10**9  # far past any video; keeps every size derived from it well inside int64 (checked anyway)
MAX_FRAMES = 1_000_000  # latent frames of a context, window or sink
MAX_STEPS = 1000  # denoising steps: past the table's 1000 entries, Krea's integer steps repeat
MAX_INTERP_BLOCKS = 1024  # a prompt blend longer than this is a mistake (Krea's demo uses 4)
# Krea's kv_cache_num_frames: the clean context frames a recompute role rebuilds before every block (Krea: 3),
# which a start frame also writes as its latent frames. Every DiT places a frame at one of its RoPE table's
# positions (DiTConfig.rope_max_seq_len, 1024 on every preset), so no context can hold more; the video's own
# length (num_blocks * frames_per_block) bounds it further once the preset is known (`resolved`), and the memory
# budget check counts the cache it makes before anything is allocated (sdvg/generation/video_memory.py).
MAX_KV_CACHE_FRAMES = 1024
# The pattern router cycles its decisions over the blocks (pattern[block % len]): a period longer than this is no
# acceptance pattern anyone runs, and it is what a client could make the server store and copy per update.
MAX_PATTERN = 1024
# exit_eps is a relative gap (the gap to the full schedule's output over the median token norm): the paper uses
# 0.24 to 0.28, the random-weight tests 1.5, and on the tiny preset every token exits at its first step from about
# 3; a gap of 100 median token norms is far past any a model shows, so a larger eps says nothing more.
MAX_EXIT_EPS = 100.0


class OptionError(ValueError):
    """A generation option has a value it cannot take; the message names the option and the fix."""


def _opt(default, help: str, choices: tuple[str, ...] | None = None, metavar: str | None = None, **extra):
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar, **extra})


# The roles each mode runs (the one place that says it).
MODE_ROLES: dict[str, tuple[str, ...]] = {"sdvg": ("drafter", "target"), "target": ("target",), "draft": ("drafter",)}
# The run options that only the eager backend runs, and why (checked in one place: `backend_conflicts`).
EAGER_ONLY: dict[str, str] = {
    "cuda_graphs": "compile: its compiled regions are not captured in graphs; engines run their own",
    "fast_vae": "compile decodes through its own compiled fast VAE; the engine backends run their own VAE engine",
}


def _check_fields(obj, cls) -> None:
    """The rules every option of `cls` shares: None only where None is the declared default (it means "the
    preset's" or "not set"), a declared choice, a bool that is a bool."""
    for f in dataclasses.fields(cls):
        choices, value = f.metadata["choices"], getattr(obj, f.name)
        if value is None and f.default is not None:
            raise OptionError(f"{f.name} must be {_what(f)}, got None; give one, or leave {f.name} out for its default "
                              f"({_shown_default(f)})")
        if choices is not None and not (value is None and f.default is None) and value not in choices:
            raise OptionError(f"unknown {f.name} {_quote(value)}; choose one of {', '.join(choices)}")
        if isinstance(f.default, bool) and not isinstance(value, bool):
            raise OptionError(f"{f.name} must be True or False, got {_quote(value)}")


def _what(f) -> str:
    """What option field `f` takes, in words (for the messages that refuse a value of the wrong kind)."""
    if f.metadata["choices"] is not None:
        return "one of " + ", ".join(f.metadata["choices"])
    if isinstance(f.default, bool):
        return "True or False"
    return {"pattern": "a string of 0/1 decisions (e.g. '0110')"}.get(f.name) or _FROM_TEXT.get(f.name, (0, "a value"))[1]


def _shown_default(f) -> str:
    if f.name == "pattern":
        return "no pattern"
    if f.name == "exit_thresholds":
        return ",".join(f"{x:g}" for x in f.default)
    return repr(f.default)


@dataclass(frozen=True)
class MethodOptions:
    """What video you get: the method's options (frozen; validated on construction). Two runs with the
    same method options give the same video whatever their `RunOptions`."""

    mode: str = _opt("sdvg", "sdvg: speculative (drafter proposes, target regenerates rejected blocks); "
                             "target: target-only; draft: drafter-only", MODES)
    tau: float = _opt(-0.7, "acceptance threshold on the aggregated ImageReward score of a draft "
                            "(inf: never accept, -inf: always accept)", metavar="TAU")
    num_blocks: int | None = _opt(None, "blocks to generate (default: the preset's)", metavar="N")
    seed: int = _opt(0, "seed of every noise draw (the same seed gives the same video)", metavar="SEED")
    router: str = _opt("reward", "who decides: reward (score >= tau), random (accept with --accept-prob), "
                                 "pattern (a fixed decision list, --pattern)", ROUTERS)
    accept_prob: float = _opt(0.731, "acceptance probability of the random router (0.731: the paper's "
                                     "acceptance at tau = -0.7)", metavar="P")
    pattern: tuple[bool, ...] = _opt((), "decisions of the pattern router: a string of 0/1 per block, cycled "
                                         "(e.g. 0110)", metavar="BITS")
    aggregation: str = _opt("min", "per-frame scores to one block score: min is the worst frame (the paper)",
                            AGGREGATIONS)
    force_first_reject: bool = _opt(True, "block 0 always comes from the target (the paper's rule)")
    drafter_context: str = _opt("own", "what the drafter conditions on: own (its own drafts, block 0 included, "
                                       "whatever the decision: the paper's rule; the drafter never waits for a "
                                       "decision) or committed (the emitted blocks: drafts follow the target's "
                                       "corrections, but the drafter waits for each decision)", DRAFTER_CONTEXTS)
    target_context: str | None = _opt(None, "how the target's KV cache holds history: full (every committed block, "
                                            "Self-Forcing's 4 steps + t = 0 commit) or recompute (Krea: rebuilt "
                                            "from --kv-cache-frames clean frames before each block, 5 calls); "
                                            "default: the preset's", CONTEXT_MODES)
    drafter_cache: str | None = _opt(None, "how the drafter's KV cache holds history: full or recompute (as "
                                           "--target-context); default: the preset's", CONTEXT_MODES)
    kv_cache_frames: int | None = _opt(None, "recompute: clean context frames rebuilt before each block "
                                             "(Krea's kv_cache_num_frames; default: the preset's, 3)", metavar="N")
    keep_first_frame: bool = _opt(False, "recompute: keep latent frame 0 as a fixed first context frame (Krea's "
                                         "default: off, the first frame moves with the window and is re-encoded)")
    window_frames: int | None = _opt(None, "full context: attend to the last N frames only (0: the whole "
                                           "history; default: the preset's)", metavar="N")
    sink_frames: int | None = _opt(None, "full context with a window: first frames always kept (default: the "
                                         "preset's)", metavar="N")
    early_exit: str = _opt("none", "token-level early exit of the denoising loop (Speculative Forcing): which "
                                   "role's tokens may leave the loop once converged (docs/early-exit.md)",
                           EARLY_EXIT_ROLES)
    exit_verifier: str = _opt("stability", "who judges a token converged: stability (training-free: redundancy "
                                           "against the visible history at step 1, step-to-step change later, "
                                           "smoothed, against --exit-thresholds), oracle (runs the full schedule "
                                           "first; gap to the final output below --exit-eps), head (a learned "
                                           "verifier, --exit-head), pattern (a fixed seeded share per step, "
                                           "--exit-pattern-steps; benchmarks and tests)", EXIT_VERIFIERS)
    exit_eps: float = _opt(0.26, "oracle and head verifiers: a token exits when its relative gap to the full "
                                 "schedule's output is below eps (strict: 0 never exits early; the paper uses "
                                 "0.24 to 0.28)", metavar="EPS")
    exit_thresholds: tuple[float, float] = _opt(PAPER_EXIT_THRESHOLDS, "stability verifier: the redundancy and "
                                                "stability thresholds RED,STAB (the paper's 5-second setting: "
                                                "0.497,0.327)", metavar="RED,STAB")
    exit_head: str | None = _opt(None, "head verifier: the learned head's safetensors file (sdvg "
                                       "train-exit-head)", metavar="FILE")
    exit_pattern_steps: float = _opt(1.65, "pattern verifier: the mean denoising steps per token it aims at "
                                           "(1.65: the paper's mean)", metavar="K")
    vae_decoder: str | None = _opt(None, "the streaming VAE decoder's temporal-upsample cache: wan (Wan2.1, "
                                         "Self-Forcing, diffusers: the previous and current frames) or krea (Krea "
                                         "Realtime Video's server: the current frame twice; other pixels from latent "
                                         "frame 3 on); default: the preset's (wan; docs/method.md)", VAE_DECODERS)

    interp_blocks: int = _opt(4, "a prompt change (live update or --prompt-schedule) is blended over this many blocks, "
                                 "Krea's rule: one lerp weight per block from linspace(0, 1, N), the first at 0 "
                                 "(1: the new prompt at once; docs/live.md)", metavar="N")
    force_reject_after_switch: bool = _opt(True, "the first block under a new prompt (its first blend weight > 0) "
                                                 "comes from the target, as block 0 does (docs/live.md)")
    recache: bool = _opt(True, "live sessions: when a block's text conditioning differs from the one before (a prompt "
                               "switch, each blended block), a full-context role first recomputes the K/V of the "
                               "frames it still sees under the new one, one t = 0 forward (LongLive's re-cache; "
                               "docs/live.md, docs/cost-model.md)")
    strength: float = _opt(1.0, "video-to-video: how far the input video is noised before both roles denoise it, "
                                "in (0, 1]; each role's steps start at strength * 1000 (Krea's rule; 1.0: pure "
                                "noise, the input is ignored; docs/live.md)", metavar="S")
    target_steps: int | None = _opt(None, "the target's denoising steps (Krea's num_denoising_steps): N model calls "
                                          "by Krea's rule, linspace(1000, 0, N) truncated to integers for a recompute "
                                          "target (5: its default list), the first N of linspace(1000, 0, N + 1) then "
                                          "the t = 0 commit for a full-context one (4: Self-Forcing's); the drafter "
                                          "keeps its distilled schedule; default: the preset's lists "
                                          "(docs/method.md)", metavar="N")

    def __post_init__(self) -> None:
        _check_fields(self, MethodOptions)
        self._check_method(lambda name, value: object.__setattr__(self, name, value))

    def _check_method(self, set_) -> None:
        set_("tau", _number("tau", self.tau, allow_inf=True))
        if self.num_blocks is not None:
            set_("num_blocks", _integer("num_blocks", self.num_blocks, low=1, cap=MAX_BLOCKS))
        set_("seed", _integer("seed", self.seed, low=0, high=SEED_MAX))
        set_("interp_blocks", _integer("interp_blocks", self.interp_blocks, low=1, high=MAX_INTERP_BLOCKS))
        strength = _number("strength", self.strength)
        if not 0.0 < strength <= 1.0:
            raise OptionError(f"strength {strength} must lie in (0, 1]: 1.0 starts from pure noise, smaller values keep "
                              "more of the input video (Krea's demo uses 0.6 to 0.9)")
        set_("strength", strength)
        if self.target_steps is not None:
            set_("target_steps", _integer("target_steps", self.target_steps, low=1, high=MAX_STEPS))
        if self.kv_cache_frames is not None:
            kv = _integer("kv_cache_frames", self.kv_cache_frames, low=1)
            if kv > MAX_KV_CACHE_FRAMES:
                _integer("kv_cache_frames", kv, low=1, high=MAX_KV_CACHE_FRAMES,
                         fix="it is Krea's kv_cache_num_frames, the clean context frames rebuilt before every block "
                             f"(Krea's default: 3); no model places a frame past its RoPE table's {MAX_KV_CACHE_FRAMES} "
                             "positions, and the video's num_blocks * frames_per_block bounds it further")
            set_("kv_cache_frames", kv)
        for name in ("window_frames", "sink_frames"):
            if getattr(self, name) is not None:
                set_(name, _integer(name, getattr(self, name), low=0, cap=MAX_FRAMES))
        prob = _number("accept_prob", self.accept_prob)
        if not 0.0 <= prob <= 1.0:
            raise OptionError(f"accept_prob {prob} must lie in [0, 1]")
        set_("accept_prob", prob)
        set_("pattern", parse_pattern(self.pattern))
        if self.router == "pattern" and not self.pattern:
            raise OptionError("router 'pattern' needs a decision pattern: pass pattern='0110' (API) or "
                              "--pattern 0110 (CLI)")
        self._check_early_exit(set_)

    def _check_early_exit(self, set_) -> None:
        eps = _number("exit_eps", self.exit_eps)
        if eps < 0:
            raise OptionError(f"exit_eps {eps} must be >= 0 (0: no token exits early)")
        if eps > MAX_EXIT_EPS:
            raise OptionError(f"exit_eps {eps:g} must lie in [0, {MAX_EXIT_EPS:g}]: it is a relative gap to the full "
                              "schedule's output (the paper uses 0.24 to 0.28; the random-weight presets exit every token "
                              f"at its first step from about 3); give at most {MAX_EXIT_EPS:g}")
        set_("exit_eps", eps)
        set_("exit_thresholds", parse_thresholds(self.exit_thresholds))
        steps = _number("exit_pattern_steps", self.exit_pattern_steps)
        if steps < 1:
            raise OptionError(f"exit_pattern_steps {steps} must be >= 1 (every token takes at least one step)")
        if steps > MAX_STEPS:
            raise OptionError(f"exit_pattern_steps {steps:g} must lie in [1, {MAX_STEPS}]: it is a mean of denoising "
                              "steps per token, at most the role's own steps (checked against them once the preset is "
                              "known; the paper's mean: 1.65)")
        set_("exit_pattern_steps", steps)
        if self.exit_head is not None and not isinstance(self.exit_head, str):
            import os

            if not isinstance(self.exit_head, os.PathLike):  # a list or a number is never a path
                from sdvg.bounded import quote

                raise OptionError(f"exit_head must be a file path, got {type(self.exit_head).__name__} "
                                  f"{quote(self.exit_head)}")
            set_("exit_head", os.fspath(self.exit_head))
        check_exit_head(self, resolved=False)
        if self.early_exit != "none" and self.mode != "sdvg":
            role = {"target": "target", "draft": "drafter"}[self.mode]
            if self.early_exit not in (role, "both"):
                raise OptionError(f"early_exit {self.early_exit!r} names a role that mode {self.mode!r} does not run; "
                                  f"use --early-exit {role}")

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles the mode runs ("drafter", "target")."""
        return MODE_ROLES[self.mode]

@dataclass(frozen=True)
class RunOptions:
    """How a video runs: the scheduler, the stage backend, run-ahead, graphs, timing (frozen; validated
    on construction). They change the cost and the statistics, never the video (the fast VAE and FP8:
    within their documented tolerances)."""

    skip_first_draft: bool = _opt(True, "under committed context and a forced block 0, do not draft block 0 "
                                        "(its draft is never used)")
    lazy_target_commit: bool = _opt(True, "commit accepted blocks into the target's cache only when the target "
                                          "next runs (a trailing run of accepted blocks costs the target nothing)")
    score_emitted: bool = _opt(False, "also score the target's frames of rejected blocks (a quality proxy)")
    scheduler: str = _opt("cpp", "cpp: the native scheduler; reference: the plain Python loop (the oracle; "
                                 "bitwise the same video)", SCHEDULERS)
    run_ahead: bool = _opt(False, "draft ahead on a drafter thread while the current block is decoded, scored "
                                  "and committed (scheduler cpp; same output)")
    run_ahead_blocks: int = _opt(2, "run-ahead: drafts the drafter may hold ahead of the block being decided "
                                    "(a bounded queue; the committed context allows one)", metavar="N")
    cuda_graphs: bool = _opt(False, "replay the drafter's denoising steps from graphs captured once per block "
                                    "position (CUDA graphs; a CPU stand-in elsewhere), its KV cache allocated once "
                                    "per pipeline and reused across videos, and every role's noise draws of a block "
                                    "copied ahead from pinned memory (backend eager; same output)")
    fast_vae: bool = _opt(False, "decode through a channels-last copy of the VAE decoder, its steady-state frames "
                                 "through torch.compile (static shapes) and, on CUDA, with cudnn.benchmark on for the "
                                 "decoder's calls only (backend eager; pixels within a per-dtype tolerance of the plain "
                                 "decode, not bitwise: docs/engines.md)")
    stage_timing: str = _opt("sync", "sync: every stage's stream is synchronised after the call (the stage times "
                                     "measure execution); events: no per-stage wait besides the host reads a stage "
                                     "makes itself (finite checks, scores), device time per stage from CUDA event "
                                     "pairs read at the end (stats stage_device_s; the stage times then measure the "
                                     "host's time in each call); same output", STAGE_TIMINGS)
    backend: str | None = _opt(None, "how stages run: eager, compile (the eager loop with each DiT block's "
                                     "regions, the VAE decode and the reward model through torch.compile; "
                                     "--compile-mode, --compile-cache), tensorrt "
                                     "(engines; needs --engines) or onnxruntime (the ONNX files of build_engines "
                                     "--format onnx; needs --engines) or torch-tensorrt (DiT engines from build_engines "
                                     "--format torch-tensorrt, the others TensorRT; needs --engines); default: the "
                                     "pipeline's", BACKENDS)
    quantization: str | None = _opt(None, "run the DiTs' transformer-block linears (attention q/k/v/out, the FFN) "
                                          "in FP8 e4m3, row-wise dynamic activation scales and per-output-channel weight "
                                          "scales (torchao, else torch._scaled_mm): fp8 (both DiTs), fp8-target, "
                                          "fp8-drafter or none; attention, norms, modulation, embeddings and proj_out "
                                          "stay in the model's dtype. Changes the numerics within a tolerance, as "
                                          "--fast-vae does (not bitwise: docs/engines.md, 'FP8'); needs CUDA compute "
                                          "capability >= 8.9 and bf16 (or the CPU), backend eager or compile; default: "
                                          "the pipeline's (none unless loaded with quantization=, which quantizes in "
                                          "place)", QUANTIZATIONS)

    def __post_init__(self) -> None:
        _check_fields(self, RunOptions)
        self._check_run(lambda name, value: object.__setattr__(self, name, value))

    def _check_run(self, set_) -> None:
        set_("run_ahead_blocks", _integer("run_ahead_blocks", self.run_ahead_blocks, low=1, cap=MAX_BLOCKS))
        if self.run_ahead and self.scheduler != "cpp":
            raise OptionError("run_ahead needs scheduler 'cpp' (the reference loop is sequential)")


@dataclass(frozen=True)
class GenerationOptions(RunOptions, MethodOptions):
    """One generation run's options: the method's and the run's, one flat keyword set (the API keywords,
    CLI flags and statistics fields); `.method` and `.run` give the two halves. Frozen; validated on
    construction (each half's rules, then the rules that join them)."""

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (normalised values)
        _check_fields(self, GenerationOptions)
        self._check_method(set_)
        self._check_run(set_)
        conflicts = backend_conflicts(self, self.backend)
        if conflicts:
            raise OptionError(conflicts[0])

    @property
    def method(self) -> MethodOptions:
        return MethodOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(MethodOptions)})

    @property
    def run(self) -> RunOptions:
        return RunOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RunOptions)})

    def fp8_roles(self) -> tuple[str, ...]:
        """The roles whose DiT block linears run in FP8 (resolved options: `quantization` set)."""
        if self.quantization is None:
            raise OptionError("options are not resolved: call opts.resolved(preset) first")
        return QUANTIZATION_ROLES[self.quantization]

    def exit_roles(self) -> tuple[str, ...]:
        """The roles whose denoising loop may let tokens exit early."""
        return {"none": (), "target": ("target",), "drafter": ("drafter",),
                "both": ("drafter", "target")}[self.early_exit]

    # ------------------------------------------------------------------ derived
    def replace(self, **changes) -> "GenerationOptions":
        return dataclasses.replace(self, **changes)

    def resolved(self, preset, backend: str | None = None, quantization: str | None = None) -> "GenerationOptions":
        """The options with a pipeline's defaults filled in where unset: the preset's `num_blocks`,
        context modes, `kv_cache_frames` and window and, when given, the pipeline's stage `backend`; its
        `quantization` (given: the pipeline's default; else none).
        The rules that need the preset (the video's length, a window under recompute) are checked here."""
        changes = {}
        defaults = {"num_blocks": preset.video.num_blocks, "target_context": preset.target_context,
                    "drafter_cache": preset.drafter_cache, "kv_cache_frames": preset.kv_cache_frames,
                    "window_frames": preset.kv_window.window_frames, "sink_frames": preset.kv_window.sink_frames,
                    "vae_decoder": preset.vae_decoder}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                changes[name] = value
        if self.backend is None and backend is not None:
            changes["backend"] = backend
        if self.quantization is None:
            changes["quantization"] = quantization or "none"
        out = self.replace(**changes) if changes else self
        out._check_contexts(preset, window_given=self.window_frames is not None)
        return out

    def _check_contexts(self, preset, window_given: bool) -> None:
        frames = self.num_blocks * preset.video.frames_per_block
        modes = {role: self.context_mode(role) for role in self.roles}
        if "recompute" in modes.values() and self.kv_cache_frames > frames:
            raise OptionError(f"kv_cache_frames {self.kv_cache_frames} is larger than the video ({frames} latent "
                              f"frames in {self.num_blocks} blocks); use at most {frames} (Krea's default: 3)")
        if window_given and self.window_frames and "full" not in modes.values():
            raise OptionError(f"window_frames {self.window_frames}: a recompute context already keeps only "
                              f"kv_cache_frames = {self.kv_cache_frames} frames; drop --window-frames or use "
                              "--target-context full")
        conflicts = backend_conflicts(self, self.backend)
        if conflicts:
            raise OptionError(conflicts[0])
        check_exit_head(self, resolved=True)
        for role in (r for r in self.exit_roles() if r in self.roles):
            steps = len(preset.recompute_timesteps if modes[role] == "recompute" else preset.timesteps)
            if role == "target" and self.target_steps is not None:
                steps = self.target_steps
            if self.exit_verifier == "pattern" and self.exit_pattern_steps > steps:
                raise OptionError(f"exit_pattern_steps {self.exit_pattern_steps:g} exceeds the {role}'s {steps} denoising "
                                  f"steps ({modes[role]} context): give a mean in [1, {steps}]")
        if self.window_frames and self.sink_frames > self.window_frames:
            raise OptionError(f"sink_frames {self.sink_frames} exceeds window_frames {self.window_frames}")
        if self.sink_frames and not self.window_frames:
            raise OptionError(f"sink_frames {self.sink_frames} needs a window (--window-frames N)")
        if (modes.get("drafter") == "recompute" and not self.keep_first_frame and self.run_ahead):
            raise OptionError("drafter_cache 'recompute' without keep_first_frame re-encodes its first context frame "
                              "from the emitted pixels, which a run-ahead drafter does not wait for; pass "
                              "--keep-first-frame, --no-run-ahead or --drafter-cache full")

    def context_mode(self, role: str) -> str:
        mode = self.target_context if role == "target" else self.drafter_cache
        if mode is None:
            raise OptionError("options are not resolved: call opts.resolved(preset) first")
        return mode

    def role_context(self, role: str) -> RoleContext:
        """The resolved KV-cache context of `role` ("drafter" or "target")."""
        mode = self.context_mode(role)
        window = KVWindow(self.window_frames or 0, self.sink_frames or 0) if mode == "full" else KVWindow()
        return RoleContext(mode, self.kv_cache_frames, self.keep_first_frame, window)

    @property
    def skips_first_draft(self) -> bool:
        return (self.mode == "sdvg" and self.skip_first_draft and self.force_first_reject
                and self.drafter_context == "committed")

    def as_dict(self) -> dict:
        """JSON-ready: the option fields of the statistics (the pattern as a 0/1 string)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["pattern"] = "".join("1" if x else "0" for x in self.pattern)
        d["exit_thresholds"] = list(self.exit_thresholds)
        return d




def check_exit_head(opts, resolved: bool) -> None:
    """The head verifier and its file (the one place that says it): exit_verifier 'head' reads `exit_head`.
    On the options alone (`resolved` False) a missing file is refused only when early exit asks for the head:
    the file may still come from where the options meet a pipeline (`sdvg serve --exit-head`, a command line's
    --exit-head under a --config file's verifier). Where they meet it (`resolved`, `GenerationOptions.resolved`:
    the API's call, the CLI before loading, the server's session) the head verifier needs its file whether or
    not early exit is on, and a file is refused under another verifier. Whether the file is one a pipeline can
    read is `sdvg.models.exit_head`'s to say (`check_head_file`)."""
    if opts.exit_verifier == "head" and not opts.exit_head and (resolved or opts.early_exit != "none"):
        raise OptionError("exit_verifier 'head' needs the learned head's file and none is given: exit_head=<path> "
                          "(API) or --exit-head FILE (sdvg generate, sdvg serve); train one with `sdvg train-exit-head`, "
                          "or choose another verifier (stability, oracle, pattern)")
    if resolved and opts.exit_head and opts.exit_verifier != "head":
        raise OptionError(f"exit_head {_quote(opts.exit_head)} is read by the head verifier only, but exit_verifier is "
                          f"{opts.exit_verifier!r}: pass --exit-verifier head, or drop --exit-head")


def backend_conflicts(opts, backend: str | None) -> list[str]:
    """Why `opts` cannot run on stage `backend` (None: not chosen yet, nothing to say): the one place
    that says which options need the eager backend. Each entry names the option and the fix."""
    if backend is None or backend in EXIT_BACKENDS:
        return []
    out = []
    if opts.quantization not in (None, "none") and backend not in FP8_BACKENDS:
        out.append(f"quantization {opts.quantization!r} runs the DiTs' linears in FP8, which only the "
                   f"{' and '.join(FP8_BACKENDS)} backends run (the {backend} engines hold the weights they were built "
                   "from); use backend eager (--backend eager) or drop --quantization")
    if opts.early_exit != "none":
        out.append(f"early_exit {opts.early_exit!r} runs a sparse forward over the active tokens, which only the "
                   f"{', '.join(EXIT_BACKENDS)} backend runs (the {backend} backend's token counts are static); use "
                   "backend eager (--backend eager) for early exit")
    for name, why in EAGER_ONLY.items():
        if getattr(opts, name):
            out.append(f"{name} needs backend 'eager', not {backend!r} ({why}); use --backend eager or drop "
                       f"{flag_of(name)}")
    return out


def _number(name: str, value, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        from sdvg.bounded import quote

        raise OptionError(f"{name} must be a number, got {quote(value)}")
    if isinstance(value, int) and abs(value) > 2**1023:
        raise OptionError(f"{name} is too large to be a number here; give a value of a sensible size")
    try:
        value = float(value)
    except (OverflowError, ValueError, TypeError):  # e.g. a Fraction past float's range
        raise OptionError(f"{name} is too large to be a number here; give a value of a sensible size") from None
    if math.isnan(value):
        raise OptionError(f"{name} is NaN; give a number" + (" (or inf / -inf)" if allow_inf else ""))
    if math.isinf(value) and not allow_inf:
        raise OptionError(f"{name} must be finite, got {value}")
    return value


def _integer(name: str, value, low: int, high: int | None = None, cap: int | None = None, fix: str = "") -> int:
    from sdvg.bounded import quote

    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise OptionError(f"{name} must be an integer, got {quote(value)}")
    value = int(value.__index__())
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise OptionError(f"{name} {quote(value)} must be an integer {bound}" + (f"; {fix}" if fix else ""))
    if cap is not None and value > cap:
        raise OptionError(f"{name} {quote(value)} must be an integer <= {cap} (a size bound)")
    return value


def parse_thresholds(value) -> tuple[float, float]:
    """The stability verifier's (tau_red, tau_stab) from 'RED,STAB' or a pair of numbers; each >= 0 (inf
    allowed: that test never passes)."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        if len(parts) != 2:
            raise OptionError(f"exit_thresholds {_quote(value)} must be two numbers RED,STAB (e.g. 0.497,0.327)")
        try:
            value = tuple(float(p) for p in parts)
        except ValueError:
            raise OptionError(f"exit_thresholds {_quote(value)} must be two numbers RED,STAB (e.g. "
                              "0.497,0.327)") from None
    try:
        pair = tuple(value)
    except TypeError:
        raise OptionError(f"exit_thresholds must be two numbers (tau_red, tau_stab), got {_quote(value)}") from None
    if len(pair) != 2:
        raise OptionError(f"exit_thresholds must be two numbers (tau_red, tau_stab), got {len(pair)}")
    out = tuple(_number(name, v, allow_inf=True) for name, v in zip(("exit_thresholds RED", "exit_thresholds STAB"),
                                                                    pair))
    for name, v in zip(("RED", "STAB"), out):
        if v < 0:
            raise OptionError(f"exit_thresholds {name} {v} must be >= 0 (scores are distances)")
    return out


def _long_pattern(length: str) -> OptionError:
    return OptionError(f"pattern has {length} decisions; at most {MAX_PATTERN}: the pattern router cycles them over the "
                       "blocks (block b takes pattern[b % len]), so a video reads at most num_blocks of them; give one "
                       "period (e.g. '0110')")


def parse_pattern(value) -> tuple[bool, ...]:
    """A decision pattern from a string of 0/1 ('0110') or a sequence of bools (or 0/1 ints), at most
    `MAX_PATTERN` long (read no further than that; messages quote a bounded prefix of the value)."""
    import itertools

    if isinstance(value, str):
        if len(value) > MAX_PATTERN:
            raise _long_pattern(str(len(value)))
        bad = sorted(set(value) - {"0", "1"})
        if bad:
            raise OptionError(f"pattern {_quote(value)} may hold only 0 and 1 (found {_quote(''.join(bad))}); "
                              "e.g. '0110'")
        return tuple(c == "1" for c in value)
    if isinstance(value, (dict, set, frozenset)):  # no order, or keys: never a decision list
        raise OptionError(f"pattern must be a string of 0/1 or a list of bools, got {type(value).__name__} "
                          f"{_quote(value)}")
    try:
        items = tuple(itertools.islice(iter(value), MAX_PATTERN + 1))  # an endless iterable is not read to its end
    except TypeError:
        raise OptionError(f"pattern must be a string of 0/1 or a list of bools, got {_quote(value)}") from None
    if len(items) > MAX_PATTERN:
        raise _long_pattern(str(len(value)) if hasattr(value, "__len__") else f"more than {MAX_PATTERN}")
    out = []
    for x in items:
        if isinstance(x, bool):
            out.append(x)
        elif isinstance(x, int) and x in (0, 1):
            out.append(bool(x))
        else:
            raise OptionError(f"pattern entries must be bools (or 0/1), got {_quote(x)}")
    return tuple(out)


# Named protocols: option sets that reproduce a published setting in one switch (explicit options win).
PROTOCOLS: dict[str, dict] = {
    # The SDVG paper's loop: the drafter conditions on its own drafts, block 0 from the target, the worst
    # frame decides, 9 blocks (81 frames at 832x480 on the real presets), seed 42.
    "paper": {"mode": "sdvg", "router": "reward", "aggregation": "min", "drafter_context": "own",
              "force_first_reject": True, "num_blocks": 9, "seed": 42},
}
PAPER_RESOLUTION = (480, 832)  # height, width


def protocol_options(name: str, **overrides) -> "GenerationOptions":
    """The options of a named protocol (`PROTOCOLS`), with `overrides` on top."""
    if name not in PROTOCOLS:
        raise OptionError(f"unknown protocol {_quote(name)}; choose one of {', '.join(PROTOCOLS)}")
    return GenerationOptions(**{**PROTOCOLS[name], **overrides})


def describe_protocol(name: str, opts: "GenerationOptions", height: int, width: int, random_weights: bool) -> list[str]:
    """What a protocol set, line by line (printed by the CLI), including the resolution it keeps."""
    kept = [f"{k}={getattr(opts, k)}" for k, v in PROTOCOLS[name].items() if getattr(opts, k) == v]
    overridden = [f"{k}={getattr(opts, k)} (the protocol's: {v})" for k, v in PROTOCOLS[name].items()
                  if getattr(opts, k) != v]
    lines = [f"protocol {name}: " + ", ".join(kept)]
    if overridden:
        lines.append(f"protocol {name}: overridden by the config or flags: " + ", ".join(overridden))
    if (height, width) == PAPER_RESOLUTION:
        lines.append(f"protocol {name}: resolution {width}x{height} (the paper's)")
    elif random_weights:
        lines.append(f"protocol {name}: resolution kept at the preset's {width}x{height} (a random-weight preset; the "
                     f"paper's is {PAPER_RESOLUTION[1]}x{PAPER_RESOLUTION[0]})")
    else:
        lines.append(f"protocol {name}: resolution {width}x{height} differs from the paper's "
                     f"{PAPER_RESOLUTION[1]}x{PAPER_RESOLUTION[0]} (set by the preset)")
    return lines


FIELDS = {f.name: f for f in dataclasses.fields(GenerationOptions)}
METHOD_OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(MethodOptions))
RUN_OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunOptions))
OPTION_NAMES: tuple[str, ...] = tuple(FIELDS)
DEFAULTS = GenerationOptions()


def _quote(value) -> str:
    from sdvg.bounded import quote

    return quote(value)


# ---------------------------------------------------------------------------- command line
def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


_FROM_TEXT = {"tau": (float, "a number (e.g. -0.7, inf, -inf)"), "accept_prob": (float, "a number"),
              "num_blocks": (int, "an integer"), "seed": (int, "an integer"), "pattern": (str, "a string"),
              "kv_cache_frames": (int, "an integer"), "window_frames": (int, "an integer"),
              "sink_frames": (int, "an integer"), "run_ahead_blocks": (int, "an integer"),
              "interp_blocks": (int, "an integer"),
              "strength": (float, "a number"), "target_steps": (int, "an integer"),
              "exit_eps": (float, "a number"), "exit_pattern_steps": (float, "a number"),
              "exit_thresholds": (str, "two numbers RED,STAB"), "exit_head": (str, "a path")}


def option_type(name: str):
    """The argparse `type` that reads option `name` from text; the value is then checked by
    `GenerationOptions` itself (one place per rule)."""
    convert, what = _FROM_TEXT.get(name, (str, "a string"))

    def parse(text: str):
        from sdvg.bounded import quote

        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} {quote(text)} is not {what}") from None
        try:
            return getattr(GenerationOptions(**{name: value}), name)
        except OptionError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = name
    return parse


def add_option_flags(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (),
                     only: tuple[str, ...] | None = None) -> None:
    """One flag per option (all, or `only` those), derived from the declaration: --name-with-dashes;
    booleans get --flag / --no-flag; choices and defaults as declared."""
    group = parser.add_argument_group("generation options")
    for f in dataclasses.fields(GenerationOptions):
        if f.name in exclude or (only is not None and f.name not in only):
            continue
        meta = f.metadata
        shown = "" if f.default in (None, ()) else f" (default: {f.default})"  # None / (): the help says it
        help_ = f"{meta['help']}{shown}".replace("%", "%%")
        if isinstance(f.default, bool):
            group.add_argument(flag_of(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_)
        elif meta["choices"] is not None:
            group.add_argument(flag_of(f.name), dest=f.name, choices=meta["choices"], default=f.default, help=help_)
        else:
            group.add_argument(flag_of(f.name), dest=f.name, type=option_type(f.name), default=f.default,
                               metavar=meta["metavar"], help=help_)


def options_from_args(args: argparse.Namespace, **overrides) -> GenerationOptions:
    """The options a parsed command line gives (flags added by `add_option_flags`)."""
    values = {name: getattr(args, name) for name in OPTION_NAMES if hasattr(args, name)}
    values.update(overrides)
    return GenerationOptions(**values)


# ---------------------------------------------------------------------------- config files
def _check_type(name: str, value, source: str) -> None:
    """The type a config value may have, per option (a list is never a path or a name; a mapping is never
    anything): the message quotes a bounded prefix of the value."""
    from sdvg.bounded import quote

    default = FIELDS[name].default
    ok = True
    if isinstance(value, (dict, set)):
        ok = False
    elif isinstance(value, (list, tuple)):
        ok = name in ("pattern", "exit_thresholds")
    elif isinstance(default, bool):
        ok = isinstance(value, bool)
    elif FIELDS[name].metadata["choices"] is not None or name == "exit_head":
        ok = value is None and default is None or isinstance(value, str)
    if not ok:
        what = {"exit_head": "a path (text)"}.get(name, "a value of its own type")
        if isinstance(default, bool):
            what = "true or false"
        elif FIELDS[name].metadata["choices"] is not None:
            what = "one of " + ", ".join(FIELDS[name].metadata["choices"])
        raise OptionError(f"{source}: {name} must be {what}, got {type(value).__name__} {quote(value)}")



def load_options_file(path, extra: dict | None = None) -> dict:
    """The generation options of a YAML or JSON file (`--config`): a mapping whose every key is an
    option name, or a key of `extra` ({key: check}, the command line's model and placement keys: each
    value goes through its check, which raises ValueError / ArgumentTypeError naming the problem).
    Option values are checked by `GenerationOptions` (strings go through the CLI parsers, so
    `tau: -inf` and `pattern: "0110"` work). Returns {name: value} for the keys present."""
    from pathlib import Path

    from sdvg.bounded import BoundedInputError, decode_utf8, load_json_text, load_yaml_text, read_bounded

    path = Path(path)
    try:  # bounded: size, depth, no YAML aliases or anchors, no duplicate keys, UTF-8 with the line named
        text = decode_utf8(read_bounded(path, "config file"), str(path), "config file")
        source = f"config file {path}"
        data = load_json_text(text, source) if path.suffix.lower() == ".json" else load_yaml_text(text, source)
    except BoundedInputError as exc:
        raise OptionError(str(exc)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise OptionError(f"config file {path} must hold a mapping of option names to values, got "
                          f"{type(data).__name__}")
    from sdvg.bounded import quote

    extra = extra or {}
    unknown = sorted(k[:40] if isinstance(k, str) else quote(k, 40) for k in data
                     if k not in OPTION_NAMES and k not in extra)
    if unknown:
        raise OptionError(f"config file {path}: unknown key(s) {', '.join(unknown[:10])}; the keys are the options "
                          f"{', '.join(OPTION_NAMES)}" + (f" and {', '.join(extra)}" if extra else ""))
    values = {}
    for name, check in extra.items():
        if name in data:
            try:
                values[name] = check(data.pop(name))
            except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
                raise OptionError(f"config file {path}: {name}: {exc}") from None
    options = {}
    for name, value in data.items():
        _check_type(name, value, f"config file {path}")
        if isinstance(value, str) and FIELDS[name].metadata["choices"] is None:
            try:
                value = option_type(name)(value)
            except argparse.ArgumentTypeError as exc:
                raise OptionError(f"config file {path}: {exc}") from None
        options[name] = value
    try:
        GenerationOptions(**options)  # every rule, with the file named in the error
    except OptionError as exc:
        raise OptionError(f"config file {path}: {exc}") from None
    return {**values, **options}
