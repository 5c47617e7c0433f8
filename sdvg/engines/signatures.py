"""Engine signatures: every engine of a pipeline (name, input and output names, shapes and dtypes,
the bounds of its dynamic dimensions), derived from the configs alone on the meta device (nothing
is allocated: the real-size set takes a fraction of a second), and the engine-cache key.

The engines of a pipeline (`preset_signatures` / `component_signatures`):

* `<role>_dit_<F>f` — a DiT forward of F new frames with no cached frame visible: block 0, or a
  recompute context forward (F = its context length, block-causal among its frames).
* `<role>_dit_<F>f_cached` — a DiT forward of F new frames over the visible cached frames. Two
  dynamic dimensions: `visible_tokens` (the visible cached tokens, a multiple of the tokens per
  frame) and `cache_tokens` (the capacity of the cache buffers, whatever the number of blocks or
  the context mode). One engine serves every block of a full context and every denoising step of a
  recompute context.
* `vae_decode` — one steady-state latent frame through the VAE decoder.
* `reward_<N>f` — ImageReward over the N frames of a block (block 0 has fewer frames).

The engine families `drafter_dit`, `target_dit`, `vae_decode` and `reward` (`ENGINE_FAMILIES`) name
what `python -m build_engines --stages` selects (the flag keeps its name).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from sdvg._native import _C
from sdvg.config import Preset, RoleContext, config_hash, torch_dtype
from sdvg.engines.cache import EngineKey, weights_fingerprint
from sdvg.engines.modules import DiTStep, RewardStep, VAEDecodeStep
from sdvg.models.kv_cache import KVCacheSpec

ENGINE_FAMILIES: tuple[str, ...] = ("drafter_dit", "target_dit", "vae_decode", "reward")  # what --stages selects
VISIBLE_TOKENS, CACHE_TOKENS = "visible_tokens", "cache_tokens"  # the dynamic dimensions of a cached DiT engine
MAX_ELEMENTS = 2**31 - 1  # what one engine tensor may hold (TensorRT's int32 volume)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class TensorSig:
    name: str
    shape: tuple  # ints, or the name of a dynamic dimension
    dtype: str  # "float32", "bfloat16", "int64", ...

    def dims(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.shape)

    def numel(self, sizes: dict[str, int]) -> int:
        return math.prod(self.dims(sizes))

    def nbytes(self, sizes: dict[str, int]) -> int:
        return self.numel(sizes) * torch.empty((), dtype=getattr(torch, self.dtype), device="meta").element_size()


@dataclass(frozen=True)
class EngineSignature:
    name: str  # e.g. target_dit_3f_cached (the engine-cache key's `stage` field: on-disk, see cache.py)
    family: str  # drafter_dit | target_dit | vae_decode | reward
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    dynamic: tuple = ()  # ((dimension, min, opt, max), ...): every profile's range; opt = the first profile's
    frames: int = 0  # DiT: new latent frames; reward: frames scored
    cached: bool = False  # DiT: visible cached frames come in
    # TensorRT optimisation profiles: ((label, ((dimension, min, opt, max), ...)), ...), the first one
    # the shape the preset runs (`dit_profiles`); empty: one profile over `dynamic`
    profiles: tuple = ()

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def sizes(self, which: str = "opt") -> dict[str, int]:
        """A value for every dynamic dimension: its min, opt or max bound."""
        col = {"min": 1, "opt": 2, "max": 3}[which]
        return {d[0]: d[col] for d in self.dynamic}

    def profile_bounds(self) -> tuple:
        """((label, ((dimension, min, opt, max), ...)), ...): `profiles`, or one profile over `dynamic`."""
        if self.profiles:
            return self.profiles
        return (("all", self.dynamic),) if self.dynamic else ()

    def profile_sizes(self, index: int, which: str = "opt") -> dict[str, int]:
        """`sizes` of one optimisation profile."""
        col = {"min": 1, "opt": 2, "max": 3}[which]
        return {d[0]: d[col] for d in self.profile_bounds()[index][1]}

    def profile_for(self, sizes: dict[str, int]) -> int:
        """The first profile whose ranges hold `sizes` (the dynamic dimensions of a call), or ValueError."""
        for i, (_, dims) in enumerate(self.profile_bounds()):
            if all(lo <= sizes[d] <= hi for d, lo, _, hi in dims):
                return i
        ranges = "; ".join(f"{label}: " + ", ".join(f"{d} {lo}..{hi}" for d, lo, _, hi in dims)
                           for label, dims in self.profile_bounds())
        raise ValueError(f"engine {self.name!r}: {sizes} is outside every optimisation profile ({ranges}); rebuild "
                         "the engines with a larger --num-blocks or the --kv-cache-frames this video runs")

    def shapes(self) -> tuple:
        """((input name, dims, dtype), ...): what an engine key records (dynamic dimensions by name)."""
        return tuple((t.name, tuple(t.shape), t.dtype) for t in self.inputs)

    def max_elements(self) -> int:
        """The largest tensor (input or output) at the dynamic dimensions' upper bounds."""
        top = self.sizes("max")
        return max(t.numel(top) for t in self.inputs + self.outputs)

    def example_inputs(self, device="meta", seed: int = 0, which: str = "opt") -> tuple[torch.Tensor, ...]:
        """Inputs of this signature at the `which` bounds, made on `device`: random values from a
        generator on that device (a valid token index for `cache_index`), or empty tensors on the
        meta device."""
        sizes = self.sizes(which)
        device = torch.device(device)
        g = None if device.type == "meta" else torch.Generator(device).manual_seed(seed)
        out = []
        for t in self.inputs:  # made on `device` (a GPU's generator there): no host copy of a GB-sized input
            dims, dtype = t.dims(sizes), getattr(torch, t.dtype)
            if device.type == "meta":
                out.append(torch.empty(dims, dtype=dtype, device="meta"))
            elif t.name == "cache_index":
                out.append(torch.arange(dims[0], dtype=dtype, device=device))
            elif dtype.is_floating_point:
                out.append(torch.randn(dims, generator=g, device=device).to(dtype))
            else:
                out.append(torch.ones(dims, dtype=dtype, device=device))
        return tuple(out)

    def dynamic_shapes(self):
        """`dynamic_shapes` for torch.export / torch.onnx.export of the engine module's forward."""
        if not self.dynamic:
            return None
        dims = {name: torch.export.Dim(name, min=lo, max=hi) for name, lo, _, hi in self.dynamic}
        specs = [{i: dims[d] for i, d in enumerate(t.shape) if isinstance(d, str)} or None for t in self.inputs]
        if self.family.endswith("_dit"):  # forward(latents, t_freq, text_k, text_v, cos, sin, *cache)
            return tuple(specs[:6]) + (tuple(specs[6:]),)
        return tuple(specs)


# ---------------------------------------------------------------------------------------- DiT
def dit_engine_name(role: str, frames: int, cached: bool) -> str:
    return f"{role}_dit_{frames}f" + ("_cached" if cached else "")


@dataclass(frozen=True)
class ModeBounds:
    """The cached forwards of one context mode, in frames: the most visible committed frames, the
    visible frames the profile is tuned for (opt) and the slots of the cache."""

    mode: str  # "full" | "recompute"
    max_visible_frames: int
    opt_visible_frames: int
    cache_frames: int


@dataclass(frozen=True)
class ContextBounds:
    """What a role's engines must cover for `num_blocks` blocks under both context modes."""

    frames: tuple[int, ...]  # new-frame counts of the uncached forwards (block 0, context forwards)
    max_visible_frames: int  # most committed frames a forward sees
    max_cache_frames: int  # most slots a cache holds
    modes: tuple = ()  # ModeBounds per mode with a cached forward, the role's own mode first


def context_bounds(preset: Preset, role: str, num_blocks: int | None = None,
                   kv_cache_frames: int | None = None, modes=("full", "recompute")) -> ContextBounds:
    """Replays the slot table of each context mode (no tensors): the visible committed frames before
    every block of a full context (with the preset's window), and the context lengths of a
    recompute context (`min(kv_cache_frames, committed frames)`)."""
    dit = getattr(preset, role)
    fpb = preset.video.frames_per_block
    n = num_blocks or preset.video.num_blocks
    kv = kv_cache_frames or preset.kv_cache_frames
    frames, visible, capacity, per_mode = {fpb}, 0, 0, []
    if "full" in modes:
        spec = KVCacheSpec.for_context(preset, dit, RoleContext("full", kv, window=preset.kv_window), n)
        table = _C.FrameSlotTable(spec.layout())
        capacity = max(capacity, table.num_slots)
        seen = []  # visible committed frames before each block
        for _ in range(n):
            table.write(fpb)
            seen.append(len(table.visible_frames()) - fpb)
            table.commit()
        visible = max(seen)
        if visible:  # tuned for the middle block of the video
            per_mode.append(ModeBounds("full", visible, sorted(seen)[len(seen) // 2], table.num_slots))
    if "recompute" in modes:
        spec = KVCacheSpec.for_context(preset, dit, RoleContext("recompute", kv), n)
        slots = _C.FrameSlotTable(spec.layout()).num_slots
        capacity = max(capacity, slots)
        lengths = {min(kv, b * fpb) for b in range(1, n)}
        frames |= lengths
        visible = max([visible, *lengths])
        if lengths:  # every block from the second on sees the whole context
            per_mode.append(ModeBounds("recompute", max(lengths), max(lengths), slots))
    own = preset.target_context if role == "target" else preset.drafter_cache
    per_mode.sort(key=lambda m: m.mode != own)
    return ContextBounds(tuple(sorted(frames)), visible, capacity, tuple(per_mode))


def dit_profiles(bounds: ContextBounds, tokens_per_frame: int) -> tuple:
    """The optimisation profiles of a cached DiT engine: one per context mode (the role's own first, its
    opt the shape the preset runs: a recompute target's whole context, a full context's middle
    block), each ((visible_tokens, min, opt, max), (cache_tokens, min, opt, max)); bounds without
    modes (a benchmark's one shape) give one profile at their upper bounds."""
    lo = max(2, tokens_per_frame)  # torch.export specialises sizes 0 and 1
    modes = bounds.modes or (ModeBounds("given", bounds.max_visible_frames, bounds.max_visible_frames,
                                        bounds.max_cache_frames),)
    out = []
    for m in modes:
        vis_max = max(lo, m.max_visible_frames * tokens_per_frame)
        vis_opt = min(vis_max, max(lo, m.opt_visible_frames * tokens_per_frame))
        cap = max(vis_max, m.cache_frames * tokens_per_frame)
        out.append((m.mode, ((VISIBLE_TOKENS, lo, vis_opt, vis_max), (CACHE_TOKENS, lo, cap, cap))))
    return tuple(out)


def dit_signature(preset: Preset, role: str, frames: int, cached: bool, dtype=None,
                  bounds: ContextBounds | None = None) -> EngineSignature:
    """One DiT engine of `role` (see the module docstring); `bounds` set the dynamic dimensions'
    ranges (default: the preset's blocks under both context modes)."""
    cfg = getattr(preset, role)
    dt = _dtype_name(dtype or torch_dtype(preset.precision))
    lh, lw = preset.video.latent_hw(preset.vae)
    tpf = preset.video.tokens_per_frame(preset.vae, cfg)
    L, H, D = cfg.num_layers, cfg.num_heads, cfg.head_dim
    S = frames * tpf
    inputs = [TensorSig("latents", (1, cfg.in_channels, frames, lh, lw), dt),
              TensorSig("t_freq", (1, frames, cfg.freq_dim), "float32"),
              TensorSig("text_k", (L, 1, H, cfg.text_len, D), dt),
              TensorSig("text_v", (L, 1, H, cfg.text_len, D), dt),
              TensorSig("cos", (S, D // 2), "float32"),
              TensorSig("sin", (S, D // 2), "float32")]
    dynamic = profiles = ()
    if cached:
        b = bounds or context_bounds(preset, role)
        if b.max_visible_frames < 1:
            raise ValueError(f"{role}: no forward sees a cached frame with these bounds ({b}); a one-block video "
                             "needs no cached engine")
        profiles = dit_profiles(b, tpf)
        first = dict((d, opt) for d, _, opt, _ in profiles[0][1])
        dynamic = tuple((d, min(p[1][i][1] for p in profiles), first[d], max(p[1][i][3] for p in profiles))
                        for i, d in enumerate((VISIBLE_TOKENS, CACHE_TOKENS)))
        inputs.append(TensorSig("cache_index", (VISIBLE_TOKENS,), "int64"))
        inputs += [TensorSig(f"kv_{i}", (2, 1, H, CACHE_TOKENS, D), dt) for i in range(L)]
    outputs = (TensorSig("flow", (1, cfg.out_channels, frames, lh, lw), dt),
               TensorSig("new_k", (L, 1, H, S, D), dt), TensorSig("new_v", (L, 1, H, S, D), dt))
    return EngineSignature(dit_engine_name(role, frames, cached), f"{role}_dit", tuple(inputs), outputs, dynamic,
                          frames, cached, profiles if len(profiles) > 1 else ())


def dit_signatures(preset: Preset, role: str, dtype=None, num_blocks: int | None = None,
                   kv_cache_frames: int | None = None) -> list[EngineSignature]:
    """Every DiT engine `role` needs for `num_blocks` blocks under a full or a recompute context."""
    b = context_bounds(preset, role, num_blocks, kv_cache_frames)
    out = [dit_signature(preset, role, f, False, dtype, b) for f in b.frames]
    if b.max_visible_frames:
        out.append(dit_signature(preset, role, preset.video.frames_per_block, True, dtype, b))
    return out


# ---------------------------------------------------------------------------------------- VAE
@functools.lru_cache(maxsize=8)
def vae_cache_structure(vae, latent_hw: tuple[int, int]) -> tuple[int, tuple, tuple]:
    """(cache entries, ((slot, shape), ...) of the tensors the steady state holds, pixel shape of
    one latent frame): two latent frames through the Wan decoder on the meta device."""
    from sdvg.models.vae import StreamingVAEDecoder, build_vae

    with torch.device("meta"):
        dec = StreamingVAEDecoder(build_vae(vae))
    cache = dec.new_cache()
    dec.decode(torch.empty(1, vae.z_dim, 2, *latent_hw, device="meta"), cache)
    slots = tuple((i, tuple(e.shape)) for i, e in enumerate(cache.entries) if isinstance(e, torch.Tensor))
    pixels = dec.decode(torch.empty(1, vae.z_dim, 1, *latent_hw, device="meta"), cache).shape
    return len(cache.entries), slots, tuple(pixels)


def vae_signature(preset: Preset, dtype=None) -> EngineSignature:
    dt = _dtype_name(dtype or torch_dtype(preset.precision))
    lh, lw = preset.video.latent_hw(preset.vae)
    _, slots, pixels = vae_cache_structure(preset.vae, (lh, lw))
    inputs = (TensorSig("latent_frame", (1, preset.vae.z_dim, 1, lh, lw), "float32"),
              *(TensorSig(f"cache_in_{i}", shape, dt) for i, shape in slots))
    outputs = (TensorSig("pixels", pixels, "float32"), *(TensorSig(f"cache_out_{i}", shape, dt) for i, shape in slots))
    return EngineSignature("vae_decode", "vae_decode", inputs, outputs)


def vae_tensor_slots(preset: Preset) -> tuple[int, list[int]]:
    n, slots, _ = vae_cache_structure(preset.vae, preset.video.latent_hw(preset.vae))
    return n, [i for i, _ in slots]


# ------------------------------------------------------------------------------------- reward
def reward_frame_counts(preset: Preset) -> tuple[int, ...]:
    """Pixel frames of block 0 and of every later block (9 and 12 for three latent frames a block)."""
    first = preset.video.pixel_frames(preset.vae, 1)
    later = preset.video.pixel_frames(preset.vae, 2) - first
    return tuple(sorted({first, later}))


def reward_signature(preset: Preset, frames: int, dtype=None) -> EngineSignature:
    r = preset.reward
    dt = _dtype_name(dtype or torch_dtype(preset.precision))
    inputs = (TensorSig("images", (frames, 3, r.image_size, r.image_size), dt),
              TensorSig("ids", (1, r.max_text_len), "int64"), TensorSig("mask", (1, r.max_text_len), "int64"))
    return EngineSignature(f"reward_{frames}f", "reward", inputs, (TensorSig("scores", (frames,), "float32"),),
                          frames=frames)


# ------------------------------------------------------------------------------------ the set
def preset_signatures(preset: Preset, num_blocks: int | None = None, kv_cache_frames: int | None = None,
                      dtypes: dict | None = None, families=ENGINE_FAMILIES) -> list[EngineSignature]:
    """Every engine of `preset` for `num_blocks` blocks (default: the preset's) under both context
    modes, on the meta device. `dtypes` maps an engine family to its dtype (default: the preset's precision)."""
    dtypes = dtypes or {}
    out = []
    for role in ("drafter", "target"):
        if f"{role}_dit" in families:
            out += dit_signatures(preset, role, dtypes.get(f"{role}_dit"), num_blocks, kv_cache_frames)
    if "vae_decode" in families:
        out.append(vae_signature(preset, dtypes.get("vae_decode")))
    if "reward" in families:
        out += [reward_signature(preset, n, dtypes.get("reward")) for n in reward_frame_counts(preset)]
    return out


def component_dtypes(comps) -> dict:
    out = {"vae_decode": comps.vae.dtype}
    for role in ("drafter", "target"):
        if getattr(comps, role) is not None:
            out[f"{role}_dit"] = getattr(comps, role).dtype
    if comps.scorer is not None:
        out["reward"] = comps.scorer.dtype
    return out


def component_families(comps) -> tuple[str, ...]:
    return tuple(f for f in ENGINE_FAMILIES if f in component_dtypes(comps))


def component_signatures(comps, num_blocks: int | None = None, kv_cache_frames: int | None = None,
                         families=ENGINE_FAMILIES) -> list[EngineSignature]:
    """The engines of a pipeline's components (their dtypes; the models not loaded left out)."""
    fams = tuple(f for f in families if f in component_families(comps))
    return preset_signatures(comps.preset, num_blocks, kv_cache_frames, component_dtypes(comps), fams)


# ------------------------------------------------------------------------- modules and keys
def family_parts(comps, family: str):
    """(device, config, weights module) of an engine family in `comps`."""
    p = comps.preset
    if family.endswith("_dit"):
        role = family[: -len("_dit")]
        dit = getattr(comps, role)
        return (comps.drafter_device if role == "drafter" else comps.target_device), dataclasses.replace(dit.config), \
            dit.model
    if family == "vae_decode":
        return comps.vae.device, p.vae, comps.vae.vae
    if family == "reward":
        return comps.scorer.device, p.reward, comps.scorer.model
    raise ValueError(f"unknown engine family {family!r}; the engine families are {', '.join(ENGINE_FAMILIES)}")


def engine_module(comps, sig: EngineSignature) -> torch.nn.Module:
    if sig.family.endswith("_dit"):
        dit = getattr(comps, sig.family[: -len("_dit")])
        return DiTStep(dit, comps.preset.video.frames_per_block).eval()
    if sig.family == "vae_decode":
        n, slots = vae_tensor_slots(comps.preset)
        return VAEDecodeStep(comps.vae, n, slots).eval()
    return RewardStep(comps.scorer).eval()


@dataclass
class EngineSpec:
    """An engine ready to export: its signature, module and example inputs on its device."""

    signature: EngineSignature
    module: torch.nn.Module
    inputs: tuple
    device: torch.device
    config: object  # what the config hash covers
    weights: torch.nn.Module

    @property
    def name(self) -> str:
        return self.signature.name

    @property
    def input_names(self) -> list[str]:
        return self.signature.input_names

    @property
    def output_names(self) -> list[str]:
        return self.signature.output_names

    def shapes(self) -> tuple:
        return self.signature.shapes()

    def config_hash(self) -> str:
        return config_hash(self.config) if dataclasses.is_dataclass(self.config) else str(self.config)


def engine_spec(comps, sig: EngineSignature, seed: int = 0, which: str = "opt") -> EngineSpec:
    """The engine of `sig` over `comps` with example inputs (random values on the engine's device; the
    reward engine gets a real prompt's token ids and mask)."""
    device, config, weights = family_parts(comps, sig.family)
    inputs = sig.example_inputs(device, seed, which)
    if sig.family == "reward":
        tok = comps.scorer.tokens("a calibration prompt")
        inputs = (inputs[0], tok.ids, tok.mask)
    return EngineSpec(sig, engine_module(comps, sig), inputs, device, config, weights)


def dit_engine_spec(comps, role: str, visible_frames: int = 0) -> EngineSpec:
    """The block engine of `role` with `visible_frames` committed frames visible (benchmarks)."""
    p = comps.preset
    fpb = p.video.frames_per_block
    sig = dit_signature(p, role, fpb, visible_frames > 0, getattr(comps, role).dtype,
                        ContextBounds((fpb,), visible_frames, visible_frames + fpb) if visible_frames else None)
    return engine_spec(comps, sig)


def vae_engine_spec(comps) -> EngineSpec:
    return engine_spec(comps, vae_signature(comps.preset, comps.vae.dtype))


def reward_engine_spec(comps, frames: int | None = None) -> EngineSpec:
    return engine_spec(comps, reward_signature(comps.preset, frames or reward_frame_counts(comps.preset)[-1],
                                               comps.scorer.dtype))


def device_identity(device: torch.device) -> tuple[str, str]:
    device = torch.device(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return torch.cuda.get_device_name(device), f"{cap[0]}.{cap[1]}"
    return "cpu", "none"


def engine_key(sig: EngineSignature, comps, artifact: str, weights_hash: str | None = None) -> EngineKey:
    """Everything the engine depends on (see `sdvg.engines.cache`); `weights_hash`: the
    weights fingerprint when the caller kept it (the weights may be released since)."""
    from sdvg.engines.tensorrt import trt_version
    from sdvg.engines.torch_trt import torch_trt_version

    device, config, weights = family_parts(comps, sig.family)
    gpu, cc = device_identity(device)
    chash = config_hash(config) if dataclasses.is_dataclass(config) else str(config)
    versions = {}
    if artifact == "torch-tensorrt":  # the program runs inside the torch it was built with
        versions = dict(torch_version=torch.__version__, torch_trt_version=torch_trt_version())
    whash = weights_hash or weights_fingerprint(weights)
    # `stage=`: the key's field name is written into every manifest and hashed into the digest (on-disk name, kept)
    return EngineKey(stage=sig.name, config_hash=chash, weights_hash=whash, shapes=sig.shapes(),
                     precision=comps.preset.precision, gpu_name=gpu, compute_capability=cc,
                     trt_version=trt_version() if artifact != "onnx" else "none", artifact=artifact, **versions)
