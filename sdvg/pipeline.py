"""Diffusers-like API of sdvg.

    from sdvg import SpeculativeVideoPipeline
    pipe = SpeculativeVideoPipeline.from_preset("tiny")
    out = pipe("a red fox in the snow", mode="sdvg", tau=-0.7, num_blocks=9, seed=42)
    out.frames[0]  # video 0: float32 numpy [F, H, W, 3] in [0, 1]; out.frames is [batch, F, H, W, 3] as in
                   # diffusers' WanPipelineOutput (one prompt is a batch of one; sdvg/io/video_batch.py)
    stream = pipe.stream("...", tau=-0.7)
    for block in stream: ...      # each block as soon as its frames are final
    stream.stats                  # RunStats, complete once the stream is exhausted

The generation keywords of `__call__` and `stream` are the options declared once in
`sdvg.options.GenerationOptions` (their defaults are read from there); `__call__` adds the
diffusers call surface: a list of prompts, `num_videos_per_prompt`, `generator` (or one per video),
`output_type`, `return_dict` and `callback_on_block_end`; the pipeline has diffusers' `to(device | dtype)`,
`device`, `dtype`, `interrupt`, `set_progress_bar_config` and its components as attributes
(`drafter`, `target`, `vae`, `text_encoder`, `reward`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
import time
import warnings
from typing import Callable, Iterator

import numpy as np
import torch

from sdvg._native import build_record, cpu_build_warning
from sdvg.config import Preset, config_hash, get_preset, torch_dtype
from sdvg.generation.run import RunContext, run_blocks
from sdvg.generation.types import BlockRecord, LoopReport, RunStats
from sdvg.io.video_batch import (OUTPUT_TYPES, PipelineOutput, VideoOutput,  # noqa: F401 (re-exported)
                                 batch_output, convert_frames)
from sdvg.models.components import Components, build_random, load_pretrained
from sdvg.models.fingerprint import file_fingerprint, random_fingerprint
from sdvg.models.hub import HubAccess, preset_for, resolve_components
from sdvg.options import DEFAULTS as D
from sdvg.options import OPTION_NAMES, SEED_MAX, GenerationOptions, OptionError
from sdvg.runtime import hold_spare_team


COMPONENT_ROLES = ("drafter", "target", "vae", "reward", "text_encoder")
SCHEDULE_KEYWORD = "prompt_schedule"  # __call__ and stream: replaces prompt (docs/live.md), not an option
API_KEYWORDS = ("num_videos_per_prompt", "generator", "output_type", "return_dict",
                "callback_on_block_end", "height", "width", "num_inference_steps", "guidance_scale",
                "negative_prompt")  # __call__ only, not options (the last five: diffusers' names, taken or refused)
PRECISION_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def device_name(device: torch.device) -> str:
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def precision_of(torch_dtype) -> str:
    if torch_dtype not in PRECISION_OF_DTYPE:
        raise ValueError(f"torch_dtype {torch_dtype} is not supported; use torch.float32, torch.bfloat16 or "
                         "torch.float16")
    return PRECISION_OF_DTYPE[torch_dtype]


def _options(keywords: dict) -> GenerationOptions:
    """The options given as `stream`/`__call__` keywords (their names are exactly OPTION_NAMES)."""
    return GenerationOptions(**{name: keywords[name] for name in OPTION_NAMES})


def _diffusers_steps(num_inference_steps, target_steps):
    """diffusers' num_inference_steps as sdvg's target_steps (both given: they must agree)."""
    if num_inference_steps is None:
        return target_steps
    if target_steps is not None and target_steps != num_inference_steps:
        raise OptionError(f"num_inference_steps {num_inference_steps} and target_steps {target_steps} name the same "
                          "thing (the target's denoising steps); give one")
    return num_inference_steps


def _no_guidance(guidance_scale, negative_prompt) -> None:
    """Classifier-free guidance: sdvg's models (Self-Forcing's drafter, Krea's target) are distilled to sample
    without it, so only a request for none is taken."""
    if guidance_scale is not None and guidance_scale != 1.0:
        raise OptionError(f"guidance_scale {guidance_scale}: sdvg's models are distilled to sample without "
                          "classifier-free guidance (Self-Forcing, Krea Realtime Video); leave it out or pass 1.0")
    if negative_prompt is not None and any(negative_prompt if isinstance(negative_prompt, list) else [negative_prompt]):
        raise OptionError("negative_prompt: sdvg's models are distilled to sample without classifier-free guidance, "
                          "so a negative prompt would change nothing; leave it out")


class BlockStream:
    """The blocks of one video as they are emitted (an iterator of `BlockRecord`).

    `stats` grows block by block and is complete (counters, trace, wall time) once the iterator is
    exhausted; `close()` stops an unfinished video (the native scheduler's thread included)."""

    def __init__(self, blocks: Iterator[BlockRecord], stats: RunStats, report: LoopReport):
        self._blocks, self.stats, self._report = blocks, stats, report
        self.finished = False  # the stats are final (the video ended, or the stream was closed early)

    def __iter__(self) -> "BlockStream":
        return self

    def __next__(self) -> BlockRecord:
        if self.finished:
            raise StopIteration
        try:
            block = next(self._blocks)
        except StopIteration:
            self.finished = True
            self.stats.finish(self._report)
            raise
        except BaseException:  # a stage failed or the consumer was interrupted: what was emitted stays
            self.close()
            raise
        self.stats.add(block)
        return block

    def __enter__(self) -> "BlockStream":
        return self

    def __exit__(self, *exc) -> None:
        """`with pipe.stream(...) as blocks:` closes the video when the block ends (a break, an error): its
        scheduler thread stops and its stats are final."""
        self.close()

    def close(self) -> None:
        """Stop an unfinished video (its scheduler thread included); its stats are then final and
        marked interrupted, with the blocks emitted so far."""
        self._blocks.close()
        if not self.finished:
            self.finished = True
            self.stats.finish(None, interrupted=True)


class SpeculativeVideoPipeline:
    """`memory_budget_gib`: before each video allocates its KV caches, they are checked per device
    against the device's free memory (None, the default) or against this many GiB per device for
    everything the pipeline holds there (weights included, as `sdvg memory --budget-gib` counts);
    a video that does not fit raises `MemoryBudgetError` before anything of it is allocated."""

    def __init__(self, components: Components, backend: str = "eager", engines=None,
                 sources: dict[str, str] | None = None, memory_budget_gib: float | None = None,
                 compile_settings=None):
        self.components = components
        self.compile_settings = compile_settings  # backend compile: a CompileSettings (None: its defaults)
        self.memory_budget_gib = memory_budget_gib
        self.preset = components.preset
        self._runners: dict = {}  # stage backend -> StageRunners (compiled modules / engines), built on first use
        self.default_backend = backend
        self.default_quantization = "none"  # the calls' default quantization (a loader's quantization=)
        self.engines = engines
        self.sources = dict(sources or {})  # component -> checkpoint fingerprint (or random:preset:seed)
        self.build_flags: list[str] = []  # the `python -m build_engines` flags that load these weights
        self.engine_executor = None  # ExecutorOptions of the TensorRT executors (None: the torch runtime)
        self._interrupt = False  # set (pipe.interrupt = True) by a callback: the call stops after this block
        self._progress_bar_config: dict = {}  # tqdm keywords of __call__'s block progress bar
        self._start_memo: tuple | None = None  # (key, latents): the last start frame encoded (`start_latents`)
        self.load_s: float | None = None  # seconds from_preset / from_pretrained took (None: built otherwise)
        self._warn_cpu_build()
        hold_spare_team()  # torch imported first with OpenMP's spinning default: waiters spin short (sdvg/runtime.py)

    def __repr__(self) -> str:
        c, v = self.components, self.preset.video
        random = " (random weights)" if self.preset.sources is None else ""
        return (f"SpeculativeVideoPipeline(preset={self.preset.name!r}{random}, {v.width}x{v.height}, "
                f"precision={self.preset.precision}, "
                f"drafter_device={str(c.drafter_device)!r}, target_device={str(c.target_device)!r}, "
                f"backend={self.default_backend!r}, quantization={self.default_quantization!r})")

    def _warn_cpu_build(self) -> None:
        """A CPU-only sdvg._C under CUDA devices is said at load and after `to()`."""
        c = self.components
        why = cpu_build_warning([c.drafter_device, c.target_device])
        if why is not None:
            warnings.warn(why, RuntimeWarning, stacklevel=3)

    @property
    def memory_budget_gib(self) -> float | None:
        return self._memory_budget_gib

    @memory_budget_gib.setter
    def memory_budget_gib(self, value: float | None) -> None:
        from sdvg.models.memory import check_budget_gib

        self._memory_budget_gib = check_budget_gib(value)

    def resized(self, height: int, width: int) -> "SpeculativeVideoPipeline":
        """These models making `height` x `width` videos: a view that shares every weight (nothing is copied or
        loaded) under the preset with that video size, or this pipeline at its own size. Each side must be a
        multiple of the VAE's stride times the patch size (ConfigError naming it); only the eager backend makes
        another size (compiled regions and engines are built for the preset's). The view's own stage runners,
        start-frame memo and memory checks follow its size."""
        from sdvg.config import ConfigError

        video = self.preset.video
        if (height, width) == (video.height, video.width):
            return self
        if self.default_backend != "eager":
            raise ConfigError(f"{width}x{height}: backend {self.default_backend!r} runs engines built for the preset's "
                              f"{video.width}x{video.height}; only backend eager makes other sizes")
        video = dataclasses.replace(video, height=height, width=width)
        video.validate(self.preset.vae, self.preset.target)
        view = SpeculativeVideoPipeline(dataclasses.replace(self.components, preset=self.preset.replace(video=video)),
                                        self.default_backend, self.engines, self.sources, self.memory_budget_gib,
                                        self.compile_settings)
        view.default_quantization, view.build_flags = self.default_quantization, list(self.build_flags)
        view.engine_executor, view.load_s = self.engine_executor, self.load_s
        return view

    def runners(self, backend: str | None = None):
        from sdvg.generation.backends import StageRunners

        backend = backend or self.default_backend
        if backend not in self._runners:
            self._runners[backend] = StageRunners(self.components, backend, self.engines,
                                                   compile_settings=self.compile_settings,
                                                   build_flags=self.build_flags, executor=self.engine_executor)
        return self._runners[backend]

    def set_engine_executor(self, runtime: str = "torch", cuda_graph: bool = False,
                            release_torch_weights: bool = True) -> "SpeculativeVideoPipeline":
        """How TensorRT plans run (docs/engines.md, "Executors"): `runtime` torch (on torch's current stream)
        or cuda-python (stream-ordered engine memory on the role's own stream); `cuda_graph` captures
        the static-shape DiT engines in CUDA graphs (cuda-python only); `release_torch_weights`: drop the torch
        DiT weights a role's engines replace once they load (the eager backend then refuses that
        DiT). Engines already loaded are dropped."""
        from sdvg.engines.executor import ExecutorOptions

        self.engine_executor = ExecutorOptions(runtime, cuda_graph, release_torch_weights)
        for backend in [b for b in self._runners if b in ("tensorrt", "torch-tensorrt")]:
            del self._runners[backend]
        return self

    @classmethod
    def from_preset(cls, name: str | Preset = "tiny", seed: int = 0, device: str = "cpu",
                    target_device: str | None = None, backend: str = "eager", engines=None, torch_dtype=None,
                    memory_budget_gib: float | None = None, quantization: str | None = None,
                    compile_mode: str = "default", compile_cache=None, random_init: str = "cpu",
                    **preset_changes) -> "SpeculativeVideoPipeline":
        """A pipeline with random weights of a named preset (`tiny`, `cpu-bench`, `real-size`).
        torch_dtype (torch.float32 / bfloat16 / float16) overrides the preset's precision;
        memory_budget_gib: see the class. quantization (fp8 | fp8-target | fp8-drafter | none): those DiTs'
        block linears quantized in place (their model-dtype weights dropped), the calls' default.
        compile_mode (default | max-autotune-no-cudagraphs) and compile_cache (inductor's persistent cache
        folder): how backend "compile" compiles (sdvg/generation/compile.py). random_init: "cpu" (default) draws
        the DiTs with the CPU generator, one model for a seed on every device (real-size: ~150 s of host drawing);
        "device" with the device's own generator (no host draw, another model per device type; recorded in the
        checkpoints' fingerprints)."""
        from sdvg.generation.compile import CompileSettings
        from sdvg.models.fp8 import check_load, load_in_place
        from sdvg.models.memory import check_budget_gib

        t0 = time.perf_counter()
        check_budget_gib(memory_budget_gib)  # before any weights are built
        compiling = CompileSettings(compile_mode, cache_dir=compile_cache)  # refused before any weights are built
        preset = get_preset(name) if isinstance(name, str) else name
        if torch_dtype is not None:
            preset_changes["precision"] = precision_of(torch_dtype)
        if preset_changes:
            preset = dataclasses.replace(preset, **preset_changes)
        preset.validate()
        fp8 = check_load(quantization, backend, preset, {"drafter": device, "target": target_device or device})
        sources = {role: random_fingerprint(preset.name, seed, random_init) for role in COMPONENT_ROLES}  # checked
        pipe = cls(build_random(preset, seed=seed, drafter_device=device, target_device=target_device,
                                random_init=random_init), backend, engines, sources, memory_budget_gib, compiling)
        pipe.build_flags = ["--weights-seed", str(seed)] if seed else []
        load_in_place(pipe.components, fp8)
        pipe.default_quantization = quantization or "none"
        pipe.load_s = time.perf_counter() - t0
        return pipe

    @classmethod
    def from_pretrained(cls, preset: str | Preset = "wan2.1", *, drafter=None, target=None, vae=None, reward=None,
                        text_encoder=None, reward_tokenizer=None, drafter_device="cuda:0", target_device=None,
                        backend: str = "eager", engines=None, torch_dtype=None,
                        memory_budget_gib: float | None = None, progress: bool = True,
                        quantization: str | None = None, compile_mode: str = "default",
                        compile_cache=None, cache_dir=None, token: str | bool | None = None,
                        local_files_only: bool | None = None) -> "SpeculativeVideoPipeline":
        """Real weights. Each component is a local path (see docs/checkpoints.md for the formats), a
        hub repo `org/name[@revision][/path/in/repo]`, or None: the file the preset publishes for it
        (`Preset.sources`; `from_pretrained("wan2.1")` finds everything in the HF cache). `preset` may also be
        the hub repo of a published model (`"Wan-AI/Wan2.1-T2V-1.3B"`, `"gdhe17/Self-Forcing"`,
        `"krea/krea-realtime-video"`, ...): the preset that loads it, that repo giving the components it
        holds; a repo no preset loads is refused with the list of those that are. Missing files
        are reported together, with the command that fetches them. torch_dtype overrides the preset's
        precision. `reward=None` on a random-weight preset builds no reward model. memory_budget_gib: see
        the class. `progress`: a bar over the components as they load (each is logged at INFO on the `sdvg`
        logger either way). quantization: as `from_preset`'s (the model-dtype weights load first; the
        quantized linears' are dropped once their FP8 weights are made). compile_mode, compile_cache: as
        `from_preset`'s. cache_dir, token, local_files_only: as huggingface_hub's (the cache folder, default
        HF_HUB_CACHE; the access token, default HF_TOKEN or the stored login; True reads the cache only,
        default HF_HUB_OFFLINE); `sdvg download PRESET --cache-dir DIR` fills the same cache."""
        from sdvg.generation.compile import CompileSettings
        from sdvg.models.fp8 import check_load, load_in_place
        from sdvg.models.memory import check_budget_gib

        t0 = time.perf_counter()
        check_budget_gib(memory_budget_gib)  # before any weights are read
        compiling = CompileSettings(compile_mode, cache_dir=compile_cache)  # refused before any weights are read
        hub = HubAccess(cache_dir=cache_dir, token=token, local_files_only=local_files_only)  # likewise
        repo_specs = {}
        if isinstance(preset, str):  # a preset name, or the hub repo of a published model a preset loads
            name, repo_specs = preset_for(preset)
            preset = get_preset(name)
        if torch_dtype is not None:
            preset = preset.replace(precision=precision_of(torch_dtype))
        specs = dict(drafter=drafter, target=target, vae=vae, text_encoder=text_encoder, reward=reward,
                     reward_tokenizer=reward_tokenizer)
        specs.update({role: spec for role, spec in repo_specs.items() if specs[role] is None})
        defaults = {} if preset.sources is None else {role: getattr(preset.sources, role) for role in specs}
        fp8 = check_load(quantization, backend, preset, {"drafter": drafter_device,
                                                         "target": target_device or drafter_device})
        paths = resolve_components(specs, defaults, hub, preset.name)
        needed = [role for role in ("drafter", "target", "vae", "text_encoder") if paths[role] is None]
        if needed:
            raise ValueError(f"preset {preset.name!r} publishes no weights; give {', '.join(needed)} (local paths "
                             "or hub repos), or use from_preset() for random weights")
        sources = {role: file_fingerprint(path) for role, path in paths.items()
                   if path is not None and role != "reward_tokenizer"}
        pipe = cls(load_pretrained(preset, paths["drafter"], paths["target"], paths["vae"], paths["reward"],
                                   paths["text_encoder"], paths["reward_tokenizer"], drafter_device, target_device,
                                   progress=progress),
                   backend, engines, sources, memory_budget_gib, compiling)
        pipe.build_flags = [a for role, path in paths.items() if path is not None
                            for a in (f"--{role.replace('_', '-')}", str(path))]
        load_in_place(pipe.components, fp8)
        pipe.default_quantization = quantization or "none"
        pipe.load_s = time.perf_counter() - t0
        return pipe

    # ------------------------------------------------------------------ components, placement, dtype
    @property
    def drafter(self):
        """The drafter DiT (`CausalWanDiT`, Self-Forcing 1.3B for `wan2.1`)."""
        return self.components.drafter

    @property
    def target(self):
        """The target DiT (`CausalWanDiT`, Krea Realtime 14B for `wan2.1`)."""
        return self.components.target

    @property
    def vae(self):
        """The streaming Wan VAE decoder (`StreamingVAEDecoder`; the diffusers module is `pipe.vae.vae`)."""
        return self.components.vae

    @property
    def text_encoder(self):
        """The umT5 text encoder (`TextEncoder`; the transformers model is `pipe.text_encoder.model`)."""
        return self.components.text_encoder

    @property
    def reward(self):
        """The ImageReward scorer of the router (`RewardScorer`), or None when none was built."""
        return self.components.scorer

    @property
    def device(self) -> torch.device:
        """The drafter's device: where prompts are encoded and frames decoded and scored (the target's
        is `pipe.target.device`; they differ only when built with `target_device=`)."""
        return torch.device(self.components.drafter_device)

    @property
    def dtype(self) -> torch.dtype:
        """The DiTs' and the VAE's dtype (the preset's precision)."""
        return torch_dtype(self.preset.precision)

    def to(self, *args, device=None, dtype=None) -> "SpeculativeVideoPipeline":
        """As diffusers' `pipe.to`: `to("cuda")`, `to(torch.bfloat16)`, `to("cuda", torch.float16)` or
        `to(device=..., dtype=...)`. A device moves every component there (dtypes kept; for two devices,
        build with `drafter_device=` / `target_device=`); a dtype casts the pipeline as `torch_dtype=` of
        `from_preset` / `from_pretrained` would have built it."""
        for a in args:
            if isinstance(a, torch.dtype):
                dtype = a if dtype is None else _twice("dtype", dtype, a)
            elif isinstance(a, (str, torch.device, int)):
                device = a if device is None else _twice("device", device, a)
            else:
                raise TypeError(f"pipe.to() takes a device (e.g. 'cuda:0') and/or a torch dtype (e.g. "
                                f"torch.bfloat16), got {a!r}")
        if dtype is not None:
            precision_of(dtype)  # refused before anything moves
        from sdvg.models.fp8 import before_to

        before_to(self.components, device, dtype)  # FP8 weights: refused before anything moves; copies dropped
        if device is not None:
            self._move(device)
            self._warn_cpu_build()
        if dtype is not None:
            self._cast(dtype)
        return self

    def _move(self, device) -> None:
        c = self.components
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {dev} requested but CUDA is not available")
        for dit in (c.drafter, c.target):
            if dit is not None:
                dit.to(dev)
        if c.text_encoder.offload_device is None:
            c.text_encoder.model.to(dev)
        else:
            c.text_encoder.execution_device = dev
        c.text_encoder.cache.clear()
        c.vae.vae.to(dev)
        if c.scorer is not None:
            c.scorer.to(dev, c.scorer.dtype)
        c.drafter_device = c.target_device = dev
        self._runners.clear()  # compiled modules and engines belong to the old placement
        self._start_memo = None  # an encoded start frame lives where the VAE was

    def _cast(self, dtype: torch.dtype) -> None:
        """The builders' rule per component (sdvg/models/components.py): the DiTs (their fp32 parts kept) and
        the VAE in `dtype`; the text encoder in `dtype` for loaded weights, fp32 for random ones; the reward
        model in `dtype`, except fp32 on the CPU for random weights."""
        precision = precision_of(dtype)
        c = self.components
        random = all(str(s).startswith("random:") for s in self.sources.values()) and bool(self.sources)
        for dit in (c.drafter, c.target):
            if dit is not None:
                dit.set_precision(precision)
        torch.nn.Module.to(c.vae.vae, dtype)
        enc = c.text_encoder
        enc.to(enc.device, "fp32" if random else precision)
        if c.scorer is not None:
            c.scorer.to(c.scorer.device, torch.float32 if random and c.scorer.device.type != "cuda" else dtype)
        c.preset = self.preset = self.preset.replace(precision=precision)
        self._runners.clear()

    def enable_model_cpu_offload(self, device=None) -> "SpeculativeVideoPipeline":
        """Keep the text encoder (umT5-XXL, ~11 GB) in CPU memory; it visits `device` (default: the
        drafter's) only to encode a new prompt, and leaves right after."""
        self.components.text_encoder.enable_offload(device or self.components.drafter_device, "cpu")
        return self

    def provenance(self, options: GenerationOptions | None = None) -> dict:
        """What produced a video: versions, devices, the preset's and checkpoints' fingerprints, the seconds
        the pipeline took to load (`load_s`); with resolved `options`, the FP8 implementation of each role they
        run in FP8 (`fp8_impl`). The statistics' `run` group holds them."""
        import sdvg

        c = self.components
        out = {"sdvg_version": sdvg.__version__, "torch_version": torch.__version__, "build": build_record(),
               "devices": {"drafter": device_name(c.drafter_device), "target": device_name(c.target_device),
                           "vae": device_name(c.vae.device)},
               "precision": self.preset.precision, "preset_fingerprint": config_hash(self.preset),
               "checkpoints": dict(self.sources), "load_s": self.load_s}
        if options is not None:
            from sdvg.models.fp8 import role_impls

            out["fp8_impl"] = role_impls(c, options)
        return out

    def run_context(self, options: GenerationOptions) -> RunContext:
        """What a run of resolved `options` needs of this pipeline (sdvg/generation/run.py): the components, the
        stage runners of the options' backend, the memory budget, the provenance of the statistics."""
        return RunContext(self.components, self.runners(options.backend), self.memory_budget_gib,
                          self.provenance(options))

    def _live_session(self, prompt: str, options: GenerationOptions, num_blocks: int | None, image=None,
                      record_blocks: int | str | None = "auto", batcher=None, **kwargs) -> "LiveSession":
        """A live session of `options` (the session's end from `session_options`; a start frame encoded here). The
        prompt and `record_blocks` are checked here, before any work."""
        from sdvg.live import LiveSession
        from sdvg.live.session import kept_blocks, session_options
        from sdvg.live.updates import check_prompt

        check_prompt(prompt)
        kept = kept_blocks(record_blocks, num_blocks)
        opts, limit = session_options(self.resolve, self.components, options, num_blocks, image is not None)
        if batcher is not None and opts.scheduler != "reference":
            raise ValueError(f"a session batched with others (batcher=) runs the reference loop; got "
                             f"scheduler={opts.scheduler!r}: pass scheduler='reference'")
        context = dataclasses.replace(self.run_context(opts), batcher=batcher)
        return LiveSession(context, prompt, opts, num_blocks, limit, record_blocks=kept,
                           start_latents=self.start_latents(image, opts), start_frame=image, **kwargs)

    def resolve(self, options: GenerationOptions) -> GenerationOptions:
        """The options with this pipeline's defaults filled in (num_blocks from the preset, backend,
        quantization); what they ask of the DiTs is checked here, before any work (`fp8.check_roles`)."""
        from sdvg.models.fp8 import check_roles

        out = options.resolved(self.preset, self.default_backend, self.default_quantization)
        check_roles(self.components, out)
        return out

    def session(self, prompt: str, num_blocks: int | None = None, input_video=None, input_frames: bool = False,
                input_timeout_s: float = 30.0, input_queue_frames: int = 1024, input_drop_oldest: bool = False,
                record_blocks: int | str | None = "auto", start_frame=None, batcher=None, **options) -> "LiveSession":
        """A live session (docs/live.md): iterate it for each `BlockRecord`; `session.update(prompt=...,
        interp_blocks=..., seed=..., reset=..., tau=..., router=..., accept_prob=..., pattern=...,
        input_frames=...)` from any thread takes effect at the block it acknowledges; `session.close()` ends
        it. `num_blocks=None`: unbounded (a full-context role needs a window or the recompute context).
        Video-to-video: `input_video` (a file or uint8 frames, as `stream`'s), or `input_frames=True` for
        frames pushed with `update(input_frames=...)`, each block waiting up to `input_timeout_s` for its
        frames (the session ends when they do not come), at most `input_queue_frames` waiting (one more is
        refused, or with `input_drop_oldest` the oldest queued frame makes room); `strength` sets how much of
        the input is kept. `record_blocks`: the block entries (and their trace) `session.stats` keeps, the
        oldest folded into the totals ('auto': all for a bounded session, the last 1000 for an unbounded one;
        None: all). `start_frame`: an image (a path, a PIL image or uint8 [H, W, 3]) every role sees as clean
        context before block 0 of every segment (Krea's `start_frame`; docs/live.md). `batcher`: a
        `sdvg.generation.batching.StageBatcher` that runs this session's denoising and scoring batched with other
        sessions' (the server's batched worker; each session's video is its own, as alone; docs/server.md); the
        session then runs the reference loop. The other keywords are those of `stream`."""
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"session() got unknown keywords {unknown}; use the options of stream()")
        opts = GenerationOptions(**options)
        if input_video is not None and input_frames:
            raise ValueError("give input_video (a file or frames) or input_frames=True (frames pushed live), not both")
        frames = None
        if input_video is not None:
            resolved, frames = self.input_clip(input_video, opts if num_blocks is None else
                                               opts.replace(num_blocks=num_blocks))
            num_blocks = resolved.num_blocks
        elif not input_frames:
            self.input_clip(None, opts)  # strength without an input is refused
        return self._live_session(prompt, opts, num_blocks, _start_image(start_frame), input_video=frames,
                                  input_frames=input_frames, input_timeout_s=input_timeout_s,
                                  input_queue_frames=input_queue_frames, input_drop_oldest=input_drop_oldest,
                                  record_blocks=record_blocks, batcher=batcher)

    def input_clip(self, input_video, options: GenerationOptions, fit_blocks: bool = False,
                   max_bytes: int | None = None, max_pixels: int | None = None) -> tuple[GenerationOptions, object]:
        """Video-to-video's input for a video of `options`: (resolved options, uint8 frames [N, H, W, 3] at the
        model's 16 frames/s, or None without an input). `input_video` is a video file's path (read up to the
        frames the video needs, resampled to 16 frames/s) or such frames already. A clip shorter than the
        video: an explicit num_blocks is refused naming both counts (with `fit_blocks` it shrinks too, as Krea's
        server does); the preset's default shrinks to the blocks the clip covers (Krea's rule). `strength` < 1
        without an input is refused. `max_bytes`: a file whose frames, as read and fitted (`input_video_bytes`: the
        uint8 frames kept and the fit's float32 working frame), would pass it is refused before a frame is decoded;
        `max_pixels`: so is a file whose frames have more pixels (width x height, read from its header)."""

        from sdvg.io import DEFAULT_FPS
        from sdvg.io.video_input import VideoInputError, check_fit, check_frames, read_video

        opts = self.resolve(options)
        if input_video is None:
            if opts.strength != 1.0:
                raise OptionError(f"strength {opts.strength} sets how much of an input video is kept; pass "
                                  "input_video=... (API) or --input-video FILE (CLI), or leave strength at 1.0")
            return opts, None
        video, vae = self.preset.video, self.preset.vae
        need = video.pixel_frames(vae, opts.num_blocks)
        if isinstance(input_video, (str, os.PathLike)):
            frames = read_video(input_video, need, DEFAULT_FPS, max_bytes=max_bytes,
                                fit_size=(video.height, video.width),
                                **({} if max_pixels is None else {"max_pixels": max_pixels}))
            what = f"input video {os.fspath(input_video)}"
        elif isinstance(input_video, (np.ndarray, torch.Tensor)):
            frames, what = check_frames(input_video[:need], "input_video", max_frames=need), "input_video"
            check_fit(frames.shape[1], frames.shape[2], video.height, video.width, where="input_video")
        else:
            raise TypeError(f"input_video must be a video file's path or uint8 frames [N, H, W, 3], got "
                            f"{type(input_video).__name__}")
        first, later = video.pixel_frames(vae, 1), vae.temporal_stride * video.frames_per_block
        covered = 0 if len(frames) < first else 1 + (len(frames) - first) // later
        if covered < opts.num_blocks:
            fix = f"{what} gives {len(frames)} frames at {DEFAULT_FPS} frames/s, {covered} block(s) " \
                  f"(block 0 takes {first}, each later one {later})"
            if covered == 0 or (options.num_blocks is not None and not fit_blocks):
                raise VideoInputError(f"{fix}, but the video asks for {opts.num_blocks}; give a longer input or "
                                      f"num_blocks={max(covered, 1)} or fewer")
            opts = opts.replace(num_blocks=covered)
        return opts, frames

    def video_input(self, frames, options: GenerationOptions):
        """A `VideoInput` over `frames` (from `input_clip`) for one video, or None."""
        if frames is None:
            return None
        from sdvg.generation.video_input import ClipFrames, VideoInput
        from sdvg.models.vae_encoder import StreamingVAEEncoder

        v = self.preset.video
        return VideoInput(ClipFrames(frames, v.height, v.width), StreamingVAEEncoder(self.components.vae.vae),
                          v.frames_per_block)

    def start_latents(self, image, options: GenerationOptions):
        """A start frame's clean latents for `options` ([1, z, kv_cache_frames, h, w]), or None without one; a
        start frame the options cannot take is refused here, before any work."""
        if image is None:
            return None
        from sdvg.generation.prepare import start_frame_conflict
        from sdvg.generation.start_frame import start_latents

        opts = self.resolve(options)
        why = start_frame_conflict(opts)
        if why:
            raise OptionError(why)
        vae = self.components.vae.vae
        weight = vae.quant_conv.weight  # where and in what dtype the encoder runs (StreamingVAEEncoder's)
        # the last image encoded is kept (by its bytes, for the VAE's device and dtype): `pipe(...)` checks it before
        # the first video and each video starts from it, so a batch encodes it once
        key = (hashlib.blake2b(np.ascontiguousarray(image).data, digest_size=16).digest(), image.shape,
               opts.kv_cache_frames, weight.device, weight.dtype)
        memo = self._start_memo
        if memo is None or memo[0] != key:
            memo = self._start_memo = (key, start_latents(image, vae, self.preset, opts.kv_cache_frames))
        return memo[1].clone()  # [1, z, kv_cache_frames, h, w]; the runs never share one tensor

    def run(self, prompt: str | None, options: GenerationOptions, threaded: bool = True,
            prompt_schedule=None, input_video=None, start_frame=None) -> BlockStream:
        """The blocks of one video for explicit options (what `stream` and `__call__` call). A
        `prompt_schedule` (sdvg.live.parse_schedule's formats) replaces `prompt`: the video is a live
        session fed those updates at those blocks (docs/live.md). `input_video` (a path or uint8 frames
        [N, H, W, 3] at 16 frames/s) makes it video-to-video, noised to `strength` (`input_clip`). `start_frame`
        (an image's path, a PIL image or uint8 [H, W, 3]): Krea's start frame, encoded as `kv_cache_frames` clean
        latent frames that every role sees before block 0 (sdvg/generation/start_frame.py)."""
        from sdvg.live.updates import ScheduledPrompt

        if prompt_schedule is None and isinstance(prompt, ScheduledPrompt):  # the CLI's --prompt-schedule
            prompt, prompt_schedule = None, prompt.schedule
        if prompt_schedule is not None:
            from sdvg.live import parse_schedule

            if prompt is not None:
                raise ValueError("prompt_schedule replaces prompt: give one of them (the schedule's block-0 entry is "
                                 "the first prompt)")
            schedule = parse_schedule(prompt_schedule)
            if not isinstance(options, GenerationOptions):
                raise TypeError(f"options must be a sdvg.GenerationOptions, got {type(options).__name__}")
            opts, frames = self.input_clip(input_video, options)
            return self._live_session(schedule[0][1], options, opts.num_blocks, _start_image(start_frame),
                                      schedule=schedule, input_video=frames)
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
        if not isinstance(options, GenerationOptions):
            raise TypeError(f"options must be a sdvg.GenerationOptions, got {type(options).__name__}; "
                            "e.g. GenerationOptions(tau=-0.7, num_blocks=9)")
        opts, frames = self.input_clip(input_video, options)
        image = _start_image(start_frame)
        latents = self.start_latents(image, opts)
        video_input = self.video_input(frames, opts)
        context = self.run_context(opts)
        report = LoopReport()
        blocks = run_blocks(context, prompt, opts, report, threaded=threaded, video_input=video_input,
                            start_latents=latents)
        stats = RunStats(prompt, self.preset.name, opts, context.provenance)
        if frames is not None:
            stats.extra["input_video"] = input_summary(input_video, frames)
        if image is not None:
            stats.extra["start_frame"] = start_summary(start_frame, image, latents)
        return BlockStream(blocks, stats, report)

    def stream(self, prompt: str | None = None, *, mode: str = D.mode, tau: float = D.tau, num_blocks: int | None = D.num_blocks,
               seed: int = D.seed, router: str = D.router, accept_prob: float = D.accept_prob,
               pattern=D.pattern, aggregation: str = D.aggregation, force_first_reject: bool = D.force_first_reject,
               drafter_context: str = D.drafter_context,
               target_context: str | None = D.target_context, drafter_cache: str | None = D.drafter_cache,
               kv_cache_frames: int | None = D.kv_cache_frames, keep_first_frame: bool = D.keep_first_frame,
               window_frames: int | None = D.window_frames, sink_frames: int | None = D.sink_frames,
               early_exit: str = D.early_exit, exit_verifier: str = D.exit_verifier,
               exit_eps: float = D.exit_eps, exit_thresholds=D.exit_thresholds, exit_head: str | None = D.exit_head,
               exit_pattern_steps: float = D.exit_pattern_steps, vae_decoder: str | None = D.vae_decoder,
               interp_blocks: int = D.interp_blocks, force_reject_after_switch: bool = D.force_reject_after_switch,
               recache: bool = D.recache, strength: float = D.strength,
               target_steps: int | None = D.target_steps,
               # the run options (RunOptions): how it runs, never what video it gives
               skip_first_draft: bool = D.skip_first_draft, lazy_target_commit: bool = D.lazy_target_commit,
               score_emitted: bool = D.score_emitted, scheduler: str = D.scheduler, run_ahead: bool = D.run_ahead,
               run_ahead_blocks: int = D.run_ahead_blocks, cuda_graphs: bool = D.cuda_graphs,
               fast_vae: bool = D.fast_vae, stage_timing: str = D.stage_timing,
               backend: str | None = D.backend, quantization: str | None = D.quantization, prompt_schedule=None,
               input_video=None, start_frame=None) -> BlockStream:
        """Yield each block as soon as its frames are final; the returned stream's `.stats` is
        complete once it is exhausted. The keywords are the generation options
        (`sdvg.options.GenerationOptions`, whose field docs say what each does):

        mode: sdvg | target | draft. tau: acceptance threshold on the draft's aggregated score.
        num_blocks: blocks to generate (None: the preset's). seed: every noise draw.
        router: reward | random | pattern (accept_prob for random; pattern, a 0/1 string or list of
        bools, for pattern). aggregation: min | mean | trimmed_mean | quantile.
        force_first_reject: block 0 from the target. drafter_context: own (the paper's) | committed.
        target_context / drafter_cache: full | recompute (None: the preset's); kv_cache_frames and
        keep_first_frame shape a recompute context, window_frames / sink_frames a full one.
        skip_first_draft, lazy_target_commit, score_emitted: see GenerationOptions.
        scheduler: cpp (native) | reference (the Python oracle; bitwise the same video).
        run_ahead: draft ahead while blocks are settled (cpp), at most run_ahead_blocks drafts ahead.
        early_exit: none | target | drafter | both (token-level early exit, docs/early-exit.md), judged by
        exit_verifier stability (exit_thresholds) | oracle (exit_eps) | head (exit_head, exit_eps) |
        pattern (exit_pattern_steps).
        cuda_graphs: replay the drafter's steps from graphs captured per block position (backend eager).
        fast_vae: channels-last, compiled steady-state VAE decode (cudnn.benchmark on CUDA; backend eager;
        within a tolerance of the plain decode). vae_decoder: wan | krea, the VAE's temporal-upsample cache
        (None: the preset's; docs/method.md). target_steps: the target's denoising steps by Krea's rule (None:
        the preset's lists; docs/method.md). stage_timing: sync | events (no per-stage waits).
        backend: eager | compile | tensorrt | onnxruntime | torch-tensorrt (None: the pipeline's).
        quantization: none | fp8 | fp8-target | fp8-drafter, the DiTs' block linears in FP8 (None: the
        pipeline's; within a tolerance of the model dtype, docs/engines.md "FP8")."""
        options = _options(locals())
        return self.run(prompt, options, prompt_schedule=prompt_schedule, input_video=input_video,
                        start_frame=start_frame)

    def __call__(self, prompt: str | list[str] | None = None, *, mode: str = D.mode, tau: float = D.tau,
                 num_blocks: int | None = D.num_blocks, seed: int = D.seed, router: str = D.router,
                 accept_prob: float = D.accept_prob, pattern=D.pattern, aggregation: str = D.aggregation,
                 force_first_reject: bool = D.force_first_reject, drafter_context: str = D.drafter_context,
                 target_context: str | None = D.target_context,
                 drafter_cache: str | None = D.drafter_cache, kv_cache_frames: int | None = D.kv_cache_frames,
                 keep_first_frame: bool = D.keep_first_frame, window_frames: int | None = D.window_frames,
                 sink_frames: int | None = D.sink_frames, early_exit: str = D.early_exit,
                 exit_verifier: str = D.exit_verifier, exit_eps: float = D.exit_eps, exit_thresholds=D.exit_thresholds,
                 exit_head: str | None = D.exit_head, exit_pattern_steps: float = D.exit_pattern_steps,
                 vae_decoder: str | None = D.vae_decoder, interp_blocks: int = D.interp_blocks,
                 force_reject_after_switch: bool = D.force_reject_after_switch, recache: bool = D.recache,
                 strength: float = D.strength, target_steps: int | None = D.target_steps,
                 skip_first_draft: bool = D.skip_first_draft, lazy_target_commit: bool = D.lazy_target_commit,
                 score_emitted: bool = D.score_emitted, scheduler: str = D.scheduler, run_ahead: bool = D.run_ahead,
                 run_ahead_blocks: int = D.run_ahead_blocks,
                 cuda_graphs: bool = D.cuda_graphs, fast_vae: bool = D.fast_vae, stage_timing: str = D.stage_timing,
                 backend: str | None = D.backend, quantization: str | None = D.quantization, prompt_schedule=None,
                 input_video=None, start_frame=None, num_videos_per_prompt: int | None = 1,
                 generator: torch.Generator | list[torch.Generator] | None = None, output_type: str = "np",
                 return_dict: bool = True,
                 callback_on_block_end: Callable[["SpeculativeVideoPipeline", BlockRecord], None] | None = None,
                 height: int | None = None, width: int | None = None, num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, negative_prompt: str | list[str] | None = None):
        """Whole videos at once, returned as diffusers' `WanPipeline` returns them (sdvg/io/video_batch.py).
        The generation keywords are those of `stream`; besides them:

        prompt: a string or a list of strings. num_videos_per_prompt: videos per prompt. The call makes
        `batch = len(prompts) * num_videos_per_prompt` videos, prompt by prompt (video i is copy
        `i % num_videos_per_prompt` of prompt `i // num_videos_per_prompt`); one prompt is a batch of one.
        Seeds: video i has seed `seed + i`, so `pipe(prompt_of_i, seed=seed + i)` reproduces it alone.
        generator: a torch.Generator (one 63-bit draw gives `seed`, then video i has `seed + i`; the
        generator's state moves on, as in diffusers) or a list of `batch` generators (video i's seed is
        one draw from generator i). The stats record each video's seed.
        output_type: np (float32 [batch, F, H, W, 3] in [0, 1], the default) | pt ([batch, F, 3, H, W]) |
        pil (a list per video of lists of images) | latent (the latents [batch, z, T, h, w]) | uint8 (torch
        [batch, F, H, W, 3]). return_dict: False returns `(frames,)`.
        callback_on_block_end(pipe, block): called with every BlockRecord as soon as it is final; setting
        `pipe.interrupt = True` there stops the call after that block (the output then holds the blocks
        every emitted video has; `blocks` and `stats`, marked interrupted, keep all).
        Everything is checked before any work: a bad callback, generator list or num_videos_per_prompt is
        refused naming the fix. A progress bar counts the blocks (`set_progress_bar_config`).

        diffusers' names: height / width make videos of that size with these weights (`resized`: each a multiple of
        the VAE's stride times the patch size; the eager backend only); num_inference_steps is the target's
        steps (`target_steps`, as Krea's server reads its num_denoising_steps; the drafter keeps its own);
        guidance_scale and negative_prompt are refused unless they ask for nothing (1.0, empty): the models
        are distilled to sample without classifier-free guidance."""
        if height is not None or width is not None:
            video = self.preset.video
            size = (video.height if height is None else height, video.width if width is None else width)
            if size != (video.height, video.width):
                keywords = {k: v for k, v in locals().items()
                            if k not in ("self", "height", "width", "video", "size", "__class__")}
                return self.resized(*size)(**keywords)
        target_steps = _diffusers_steps(num_inference_steps, target_steps)
        _no_guidance(guidance_scale, negative_prompt)
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"unknown output_type {output_type!r}; choose one of {', '.join(OUTPUT_TYPES)}")
        prompts = [None] if prompt_schedule is not None and prompt is None else _prompt_list(prompt)
        options, frames = self.input_clip(input_video, _options(locals()))  # all checked before the first video
        image = _start_image(start_frame)
        self.start_latents(image, options)  # refused before the first video
        per_prompt = _videos_per_prompt(num_videos_per_prompt)
        batch = [p for p in prompts for _ in range(per_prompt)]
        seeds = _video_seeds(generator, options.seed, len(batch), len(prompts), per_prompt)
        check_callback(callback_on_block_end)
        self._interrupt = False
        videos, stats = [], []
        with self._progress_bar(len(batch) * options.num_blocks) as bar:
            for p, s in zip(batch, seeds):
                blocks, run_stats = self._video(p, options.replace(seed=s), callback_on_block_end, bar,
                                                prompt_schedule, frames, image)
                if frames is not None:
                    run_stats.extra["input_video"] = input_summary(input_video, frames)
                if image is not None:
                    run_stats.extra["start_frame"]["source"] = start_summary(start_frame, image)["source"]
                videos.append(blocks)
                stats.append(run_stats)
                if self._interrupt:
                    break
        out = batch_output(videos, stats, output_type)
        return out if return_dict else (out.frames,)

    def generate(self, prompt: str | None, options: GenerationOptions, output_type: str = "uint8",
                 callback_on_block_end: Callable | None = None, prompt_schedule=None,
                 input_video=None, start_frame=None) -> VideoOutput:
        """One whole video for explicit options, unbatched: frames uint8 [F, H, W, 3] (or `output_type`'s
        frames of one video), latents [1, z, T, h, w], its RunStats and BlockRecords. The scheduler runs
        on this thread (nothing to stream)."""
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"unknown output_type {output_type!r}; choose one of {', '.join(OUTPUT_TYPES)}")
        check_callback(callback_on_block_end)
        self._interrupt = False
        blocks, stats = self._video(prompt, options, callback_on_block_end, None, prompt_schedule, input_video,
                                    start_frame)
        if not blocks:
            return VideoOutput(frames=None, latents=None, stats=stats, blocks=blocks)
        frames = torch.cat([b.frames for b in blocks])
        return VideoOutput(frames=convert_frames(frames, output_type),
                           latents=torch.cat([b.latents for b in blocks], dim=2), stats=stats, blocks=blocks)

    def _video(self, prompt: str | None, options: GenerationOptions, callback, bar,
               prompt_schedule=None, input_video=None, start_frame=None) -> tuple[list[BlockRecord], RunStats]:
        """The blocks of one video on this thread (`prompt_schedule`, `input_video`, `start_frame`: see `run`); stops after a
        block when `interrupt` was set."""
        stream = self.run(prompt, options, threaded=False, prompt_schedule=prompt_schedule, input_video=input_video,
                          start_frame=start_frame)
        blocks = []
        for block in stream:
            blocks.append(block)
            if bar is not None:
                bar.update(1)
            if callback is not None:
                callback(self, block)
            if self._interrupt:
                stream.close()  # the stats are final and marked interrupted
                break
        return blocks, stream.stats

    # ------------------------------------------------------------------ diffusers' call-control surface
    @property
    def interrupt(self) -> bool:
        """Set it (`pipe.interrupt = True`, or diffusers' `pipe._interrupt = True`) from
        `callback_on_block_end` to stop the call after the current block. Each call starts with it False."""
        return self._interrupt

    @interrupt.setter
    def interrupt(self, value: bool) -> None:
        self._interrupt = bool(value)

    def set_progress_bar_config(self, **kwargs) -> None:
        """tqdm keywords for the block progress bar of `__call__` (e.g. `disable=True`, `desc=`, `leave=`)."""
        import tqdm

        bad = sorted(set(kwargs) - set(inspect.signature(tqdm.tqdm.__init__).parameters))
        if bad:
            raise TypeError(f"set_progress_bar_config got {', '.join(bad)}, which tqdm does not take; give tqdm "
                            "keywords such as disable=True, desc='...', leave=False")
        self._progress_bar_config = dict(kwargs)

    def _progress_bar(self, total: int):
        """The call's block bar (tqdm.auto): drawn on a terminal or in a notebook, not into a file or pipe (no
        escape codes in logs); set_progress_bar_config(disable=True) hides it, disable=False forces it."""
        from sdvg.io.progress import progress_bar

        config = {"desc": "blocks", "unit": "block", **self._progress_bar_config}
        disable = config.pop("disable", None)
        return progress_bar(total, show=disable is not True, force=disable is False, auto=True, **config)


def _start_image(start_frame):
    """`start_frame` as uint8 [H, W, 3] (an image file's path, a PIL image, pixels), or None."""
    if start_frame is None:
        return None
    from sdvg.generation.start_frame import start_frame_image

    return start_frame_image(start_frame)


def start_summary(start_frame, image, latents=None) -> dict:
    """What the stats record of a start frame: its file (or that pixels were given), its size, its latent frames."""
    source = os.fspath(start_frame) if isinstance(start_frame, (str, os.PathLike)) else "pixels"
    out = {"source": source, "height": int(image.shape[0]), "width": int(image.shape[1])}
    if latents is not None:
        out["latent_frames"] = int(latents.shape[2])
    return out


def input_summary(input_video, frames) -> dict:
    """What the stats record of a video-to-video input: its file (or that frames were given) and the frames read."""
    source = os.fspath(input_video) if isinstance(input_video, (str, os.PathLike)) else "frames"
    return {"source": source, "frames": int(len(frames)), "height": int(frames.shape[1]),
            "width": int(frames.shape[2])}


def check_callback(callback) -> None:
    """`callback_on_block_end` must be callable as `callback(pipe, block)`; refused before any work."""
    if callback is None:
        return
    if not callable(callback):
        raise TypeError(f"callback_on_block_end must be callable as callback(pipe, block), got "
                        f"{type(callback).__name__}; e.g. def on_block_end(pipe, block): ...")
    try:
        signature = inspect.signature(callback)
    except (TypeError, ValueError):  # a builtin without a signature: trusted
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(f"callback_on_block_end{signature} cannot be called as callback(pipe, block); sdvg calls "
                        "it once per emitted block with the pipeline and the BlockRecord: write "
                        "def on_block_end(pipe, block): ... (diffusers' callback_on_step_end(pipe, step, "
                        "timestep, callback_kwargs) has no per-step counterpart here)") from None


def _videos_per_prompt(n) -> int:
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_videos_per_prompt must be a positive integer, got {n!r}; e.g. num_videos_per_prompt=2")
    return n


def _video_seeds(generator, seed: int, batch: int, prompts: int, per_prompt: int) -> list[int]:
    """The seed of each video of the batch (the rule in `__call__`'s docstring)."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch:
            raise ValueError(f"got a list of {len(generator)} generators for {batch} videos ({prompts} prompt(s) x "
                             f"num_videos_per_prompt={per_prompt}); pass one generator per video, or a single one")
        for i, g in enumerate(generator):
            if not isinstance(g, torch.Generator):
                raise TypeError(f"generator[{i}] must be a torch.Generator, got {type(g).__name__}")
        return [_draw_seed(g) for g in generator]
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or a list of them, got {type(generator).__name__}")
        seed = _draw_seed(generator)
    return [(seed + i) % (SEED_MAX + 1) for i in range(batch)]


def _draw_seed(generator: torch.Generator) -> int:
    return int(torch.randint(0, SEED_MAX, (), generator=generator, device=generator.device))


def _twice(what: str, first, second):
    raise TypeError(f"pipe.to() got two {what}s ({first!r} and {second!r}); give one")


def _prompt_list(prompt) -> list[str]:
    """A prompt or a list of prompts, each a non-empty string (named by its position when not)."""
    if isinstance(prompt, str):
        items = [prompt]
    elif isinstance(prompt, (list, tuple)) and prompt:
        items = list(prompt)
    else:
        raise TypeError(f"prompt must be a string or a non-empty list of strings, got {prompt!r:.80}")
    for i, p in enumerate(items):
        where = "prompt" if isinstance(prompt, str) else f"prompt[{i}]"
        if not isinstance(p, str):
            raise TypeError(f"{where} must be a string, got {type(p).__name__}")
        if not p.strip():
            raise ValueError(f"{where} is empty; give a non-empty text prompt")
    return items
