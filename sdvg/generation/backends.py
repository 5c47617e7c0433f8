"""How the stage calls' models execute: `eager` (the modules as they are), `compile` (the eager loop
with its hot parts through torch.compile: sdvg/generation/compile.py), `tensorrt` (engines from the
engine cache), `onnxruntime` (the ONNX files of `python -m build_engines --format onnx` from the same
cache) or `torch-tensorrt` (the DiT engines as torch-tensorrt programs of `--format torch-tensorrt`,
the other engines as TensorRT plans); engines are validated against this setup (config, weights,
shapes, precision, device, versions) before they run.

Each backend is one entry of `REGISTRY` behind one interface (`make`: an engine from its module or
its signature); what needs the eager backend is refused in one place, before loading
(`sdvg.options.backend_conflicts`). A `StageRunners` object is built once per pipeline and backend
and holds the compiled modules or engine executors (`sdvg.engines.executor`) explicitly, one per
engine (`sdvg.engines.signatures`), each made when first needed; the stage calls run `dit_forward`,
`decode` and `score` through it."""
from __future__ import annotations

import shlex
from pathlib import Path

import torch

from sdvg.engines.executor import ExecutorOptions, open_executor
from sdvg.engines.modules import (DiTStep, RewardStep, VAEDecodeStep, dit_forward_static, text_tensors,
                                 vae_cache_is_steady, vae_decode_static)
from sdvg.models.dit_block import EAGER_REGIONS
from sdvg.options import BACKENDS

STAGE_BACKENDS = BACKENDS  # declared once, in sdvg.options


class RegionalCompile:
    """`compile`: the eager loop, its hot parts through torch.compile (`sdvg.generation.compile`: each DiT
    block's regions, the VAE's steady-state decode, the reward model's forward)."""

    static = False

    def make(self, runners, make_step, signature, dynamic, extra):
        return runners.compile_settings.compile(make_step().eval(), "reward")


class EngineBackend:
    """An engine backend: each engine an executor of a validated engine-cache artifact. `dit_artifact`
    holds its DiT engines (and names the `build_engines --format` that builds the folder), `other_artifact`
    the VAE and reward engines; `libraries()` imports what it runs on, or raises the install message."""

    static = True

    def __init__(self, dit_artifact: str, other_artifact: str, libraries):
        self.dit_artifact, self.other_artifact, self.libraries = dit_artifact, other_artifact, libraries

    def make(self, runners: "StageRunners", make_step, signature, dynamic, extra):
        return runners._load_engine(signature(), extra)


class EagerBackend:
    """`eager`: the modules as they are (no engine is ever made)."""

    static = False

    def make(self, runners, make_step, signature, dynamic, extra):
        raise AssertionError("the eager backend runs no engine")


def _tensorrt():
    from sdvg.engines.tensorrt import import_tensorrt

    import_tensorrt()


def _onnxruntime():
    from sdvg.engines.onnxruntime import import_onnxruntime

    import_onnxruntime()


def _torch_tensorrt():
    from sdvg.engines.torch_trt import import_torch_tensorrt

    _tensorrt()
    import_torch_tensorrt()


# The registry: one entry per backend of sdvg.options.BACKENDS (tests/test_trt_executors.py checks they match).
REGISTRY = {"eager": EagerBackend(), "compile": RegionalCompile(),
            "tensorrt": EngineBackend("tensorrt", "tensorrt", _tensorrt),
            "onnxruntime": EngineBackend("onnx", "onnx", _onnxruntime),
            "torch-tensorrt": EngineBackend("torch-tensorrt", "tensorrt", _torch_tensorrt)}
# engine backend -> (artifact of its DiT engines, artifact of its other engines) in the engine cache
ENGINE_ARTIFACTS = {name: (b.dit_artifact, b.other_artifact) for name, b in REGISTRY.items()
                    if isinstance(b, EngineBackend)}
BUILD_FORMATS = tuple(dict.fromkeys(dit for dit, _ in ENGINE_ARTIFACTS.values()))  # build_engines --format choices


def build_format(backend: str) -> str:
    """The `python -m build_engines --format` whose folder `backend` runs."""
    return ENGINE_ARTIFACTS[backend][0]


def engine_artifact(backend: str, family: str) -> str:
    """What the engine cache holds for an engine family under an engine backend."""
    dit, other = ENGINE_ARTIFACTS[backend]
    return dit if family.endswith("_dit") else other


class StageRunners:
    """`build_flags`: the `python -m build_engines` flags that load these components' weights (the
    checkpoint flags, or --weights-seed), for the rebuild command an engine error names."""

    def __init__(self, comps, backend: str = "eager", engines: str | Path | None = None,
                 compile_settings=None, build_flags=(), executor: ExecutorOptions | None = None):
        if backend not in STAGE_BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {STAGE_BACKENDS}")
        self.comps, self.backend, self.backend_impl = comps, backend, REGISTRY[backend]  # its REGISTRY entry
        self.build_flags = list(build_flags)
        p = comps.preset
        self._fpb = p.video.frames_per_block
        self._tpf = {role: p.video.tokens_per_frame(p.vae, dit.config)
                     for role, dit in (("drafter", comps.drafter), ("target", comps.target)) if dit is not None}
        self.compile_settings = None  # backend compile: its CompileSettings
        self.regions = EAGER_REGIONS  # how the DiT blocks' regions run (sdvg.models.dit_block)
        if backend == "compile":
            from sdvg.generation.compile import CompileSettings, compiled_regions

            self.compile_settings = compile_settings or CompileSettings()
            self.compile_settings.activate()
            self.regions = compiled_regions(self.compile_settings)
        self._engines_made: dict = {}  # engine name -> callable (compiled module or engine executor)
        self._text: dict = {}  # role -> (TextKV, stacked K, stacked V) of its last prompt (one thread per role)
        self._cache = None
        self._weights_hash: dict[str, str] = {}  # family -> weights fingerprint, kept before any release
        self._scratch: dict[str, object] = {}  # role -> its TensorRT scratch memory, shared by its contexts
        self.released: dict[str, int] = {}  # role -> torch DiT bytes released after its engines loaded
        self.executor = executor or ExecutorOptions()
        self.graphs = None  # DiTGraphs, made by the first video that asks for cuda_graphs
        self._graphs_on = False  # whether the current video uses them
        self.fast_vae = None  # FastVAEDecode, made by the first video that asks for fast_vae
        self._fast_vae_on = False  # whether the current video uses it
        if isinstance(self.backend_impl, EngineBackend):
            if engines is None:
                raise ValueError(f"backend {backend!r} needs engines=<folder built by python -m build_engines "
                                 f"--format {build_format(backend)}> (CLI: --engines DIR)")
            if Path(engines).exists() and not Path(engines).is_dir():
                raise ValueError(f"engines={str(engines)!r} is a file, not an engine folder; give the folder that "
                                 f"`python -m build_engines --format {build_format(backend)} --out DIR` wrote")
            self.backend_impl.libraries()
            from sdvg.engines.cache import EngineCache

            self.engines = Path(engines)
            self._cache = EngineCache(self.engines)
            if backend != "onnxruntime":  # a plan of another TensorRT: refused now, not mid-video
                from sdvg.engines.tensorrt import trt_version

                self._cache.check_trt_version(trt_version(), self.rebuild_command())

    @property
    def static(self) -> bool:
        return self.backend_impl.static

    def _engine(self, name: str, make_step, signature, dynamic=False, extra=()):
        """The engine `name`, made once by the backend: `make_step()` the module (compile),
        `signature()` its signature (engine backends)."""
        if name not in self._engines_made:
            self._engines_made[name] = self.backend_impl.make(self, make_step, signature, dynamic, extra)
        return self._engines_made[name]

    # ----------------------------------------------------------- CUDA graphs
    def use_graphs(self, on: bool):
        """Called once per video (`prepare`, after `options.backend_conflicts`): the pipeline's `DiTGraphs`
        when `on`, else None."""
        if on and self.graphs is None:
            from sdvg.generation.graphs import DiTGraphs

            self.graphs = DiTGraphs()
        self._graphs_on = on
        return self.graphs if on else None

    # ------------------------------------------------------------- fast VAE
    def use_fast_vae(self, on: bool) -> None:
        """Called once per video (`prepare`, after `options.backend_conflicts`): decode through the
        pipeline's `FastVAEDecode` when `on`."""
        if on and self.fast_vae is None:
            from sdvg.generation.fast_vae import FastVAEDecode

            self.fast_vae = FastVAEDecode(self.comps.vae)  # sets cudnn.benchmark once, here on the main thread
        if on and self.fast_vae.fast.device.type == "cuda":
            from sdvg.generation.fast_vae import enable_cudnn_benchmark

            enable_cudnn_benchmark()  # once per process (a pipeline moved to a GPU after its first video)
        self._fast_vae_on = on

    # ------------------------------------------------------------------ DiT
    def dit_forward(self, role: str, dit, latents, timesteps, text, frame_offset: int, cache, attn_mask=None,
                    active=None, hidden=None):
        """`active` / `hidden`: the sparse forward of early exit (`CausalWanDiT.forward`), eager only."""
        if not self.static:
            if self._graphs_on and active is None and hidden is None:
                out = self.graphs.forward(role, dit, latents, timesteps, text, frame_offset, cache, attn_mask)
                if out is not None:
                    return out
            return dit(latents, timesteps, text, frame_offset=frame_offset, cache=cache, attn_mask=attn_mask,
                       active=active, hidden=hidden,
                       regions=self.regions if active is None and hidden is None else EAGER_REGIONS)
        if active is not None or hidden is not None:
            raise ValueError(f"the {self.backend} backend runs engines with static shapes: no sparse (early-exit) forward; use "
                             "backend='eager' for early exit")
        memo = self._text.get(role)
        if memo is None or memo[0] is not text:
            memo = self._text[role] = (text, *text_tensors(text))

        def step(*args):
            return self._dit_engine(role, args[0].shape[2], len(args) > 6)(*args)

        return dit_forward_static(step, dit, latents, timesteps, text, frame_offset, cache, self._tpf[role],
                                  attn_mask=attn_mask, frames_per_block=self._fpb, text_kv=memo[1:])

    def _dit_engine(self, role: str, frames: int, cached: bool):
        from sdvg.engines.signatures import dit_engine_name, dit_signature

        dit = getattr(self.comps, role)
        # compile: the cached engine's visible and cache lengths vary (automatic dynamic shapes after the first)
        return self._engine(dit_engine_name(role, frames, cached), lambda: DiTStep(dit, self._fpb),
                           lambda: dit_signature(self.comps.preset, role, frames, cached, dit.dtype),
                           dynamic=None if cached else False,
                           extra=() if frames == self._fpb else ("--kv-cache-frames", str(frames)))

    # ------------------------------------------------------------------ VAE
    def decode(self, latents, cache):
        dec = self.comps.vae
        if self.compile_settings is not None:
            return self._compiled_vae().decode(latents, cache)
        if not self.static:
            return (self.fast_vae if self._fast_vae_on else dec).decode(latents, cache)
        return vae_decode_static(lambda *args: self._vae_engine(cache)(*args), dec, latents, cache)

    def _compiled_vae(self):
        """The compile backend's decode: `FastVAEDecode` with its steady state compiled by these settings."""
        if "vae_decode" not in self._engines_made:
            from sdvg.generation.fast_vae import FastVAEDecode

            self._engines_made["vae_decode"] = FastVAEDecode(
                self.comps.vae, compile_fn=lambda step: self.compile_settings.compile(step, "vae"))
        return self._engines_made["vae_decode"]

    def _vae_engine(self, cache):
        dec = self.comps.vae

        def signature():
            from sdvg.engines.signatures import vae_signature, vae_tensor_slots

            step = VAEDecodeStep.for_cache(dec, cache)
            if vae_tensor_slots(self.comps.preset) != (step.num_entries, step.tensor_slots):
                raise RuntimeError("the VAE decoder's cache differs from the one its engine signature was derived "
                                   "from; rebuild the engines")
            return vae_signature(self.comps.preset, dec.dtype)

        return self._engine("vae_decode", lambda: VAEDecodeStep.for_cache(dec, cache), signature)

    # --------------------------------------------------------------- reward
    def score(self, prompt: str, unit_frames):
        sc = self.comps.scorer
        if not self.static and self.compile_settings is None:
            return sc.score(prompt, unit_frames)
        tok = sc.tokens(prompt)
        images = sc.preprocess(unit_frames)
        with torch.no_grad():
            return self._reward_engine(images.shape[0])(images, tok.ids, tok.mask)

    def _reward_engine(self, frames: int):
        from sdvg.engines.signatures import reward_signature

        sc = self.comps.scorer
        return self._engine(f"reward_{frames}f", lambda: RewardStep(sc),
                           lambda: reward_signature(self.comps.preset, frames, sc.dtype))

    def compile_clock(self):
        """A `CompileClock` started now (backend compile), else None: what compiling a video cost."""
        if self.compile_settings is None:
            return None
        from sdvg.generation.compile import CompileClock

        return CompileClock(self.compile_settings)

    # -------------------------------------------------------------- engines
    def rebuild_command(self, extra=()) -> str:
        """The `python -m build_engines` command that builds this setup's engines into the folder."""
        c, p = self.comps, self.comps.preset
        argv = ["--preset", p.name, *self.build_flags, "--device", str(c.drafter_device),
                "--target-device", str(c.target_device), "--precision", p.precision]
        argv += ["--format", build_format(self.backend), *extra, "--out", str(self.engines)]
        return "python -m build_engines " + " ".join(shlex.quote(a) for a in argv)

    def _load_engine(self, sig, extra=()):
        """The validated engine of `sig` (refused, with the rebuild command, when stale, foreign,
        damaged or missing), as an executor (`sdvg.engines.executor`) ready to call. A TensorRT
        executor gets its role's shared scratch memory; once a role's first DiT engine has loaded, the
        torch DiT weights it replaces are released (`ExecutorOptions.release_torch_weights`)."""
        from sdvg.engines.cache import weights_fingerprint
        from sdvg.engines.signatures import family_parts, engine_key

        artifact = engine_artifact(self.backend, sig.family)
        device, _, weights = family_parts(self.comps, sig.family)
        if sig.family not in self._weights_hash:
            self._weights_hash[sig.family] = weights_fingerprint(weights)
        key = engine_key(sig, self.comps, artifact, self._weights_hash[sig.family])
        path = self._cache.load(key, self.rebuild_command(extra))
        scratch = self._role_scratch(sig.family, device) if artifact == "tensorrt" else None
        runner = open_executor(artifact, path, sig, device, self.executor, scratch)
        if sig.family.endswith("_dit") and artifact in ("tensorrt", "torch-tensorrt") \
                and self.executor.release_torch_weights:
            from sdvg.engines.release import release_replaced_weights

            role = sig.family[: -len("_dit")]
            freed = release_replaced_weights(getattr(self.comps, role), f"its {artifact} engines loaded")
            self.released[role] = self.released.get(role, 0) + freed
        return runner

    def _role_scratch(self, family: str, device):
        """The scratch memory shared by the TensorRT contexts of engine family `family`'s role (drafter, target, vae,
        reward), for the executors' runtime."""
        role = family[: -len("_dit")] if family.endswith("_dit") else {"vae_decode": "vae"}.get(family, family)
        if role not in self._scratch:
            if self.executor.runtime == "cuda-python":
                from sdvg.engines.scratch import CudaScratch
                from sdvg.engines.trt_cuda import check, import_cuda_python

                self._scratch[role] = CudaScratch(import_cuda_python(), check, role)
            else:
                from sdvg.engines.scratch import TorchScratch

                self._scratch[role] = TorchScratch(device, role)
        return self._scratch[role]
