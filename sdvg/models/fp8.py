"""FP8 DiT linears (the `quantization` run option): what is quantized, the one quantization rule, the
implementations and the plain reference they are compared against, and how a role's FP8 DiT is
made and kept.

What is quantized: every transformer block's linears (`QUANTIZED_LINEARS`: self- and cross-attention
q/k/v/out, the feed-forward's two linears), in FP8 e4m3 with a per-output-channel weight scale and a
row-wise activation scale computed at each call (torchao's `Float8DynamicActivationFloat8WeightConfig
(granularity=PerRow())`). Attention itself, the norms, the modulation (scale_shift_table, time
embedding, time_proj), the patch embedding, the text embedder and proj_out keep the model's dtype.

The rule (`quantize_rows`, written once; torchao's `Float8Tensor.from_hp` with a lower bound on amax,
bitwise: tests/test_fp8.py): per row, amax = max |x| (in x's dtype) clamped to >= `AMAX_EPS` (a zero
row gets a finite scale instead of 0 / 0), scale = amax / 448 (in x's dtype, then fp32), q =
clamp(x / scale, -448, 448) rounded to nearest e4m3. A linear then computes
`_scaled_mm(q_x, q_w.t(), scale_x, scale_w.t()) + bias` in the model's dtype (`USE_FAST_ACCUM`: torchao's
default).

Implementations (`IMPLS`), chosen once per device (`choose_impl`):
- `torchao`: the linear's weight becomes torchao's `Float8Tensor` (what `quantize_` builds after its
  hardware check, which refuses the CPU; the check is `fp8_conflict` here), so `F.linear` runs torchao's
  own activation quantization and `_scaled_mm` call;
- `scaled_mm`: `ScaledMMLinear`, the same arithmetic through `torch._scaled_mm` directly, where torchao
  is not installed or does not import or work on the running torch;
- `reference`: `ReferenceLinear`, the oracle's arithmetic (the same FP8 operands, dequantized, one fp32
  matmul), where neither runs: a CPU whose torch's `_scaled_mm` takes per-tensor scales only (torch 2.11's
  CPU kernel). It exists so that FP8 videos run on such a CPU for tests; a GPU never gets it.
`reference_linear` is the oracle: both operands quantized by the rule, dequantized to fp32, one fp32
matmul, the bias added. Both implementations lie within `IMPL_TOLERANCE` of it; FP8 against the model's
own linears within `FP8_TOLERANCE` (docs/engines.md, "FP8").

Keeping: a pipeline loaded with `quantization=` quantizes its DiTs in place (`quantize_in_place`: the
model-dtype linear weights are dropped); a call that asks FP8 of a DiT that still has them gets its
`role_dit`: a copy made once (`quantized_copy`: every tensor shared with the original but the
quantized linears' weights, so a DiT another call is running is never changed) and kept as long as
the original lives, on the device and in the dtype it was made for (`pipe.to()` drops it)."""
from __future__ import annotations

import copy
import itertools
import logging
import threading
import weakref
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_EPS = 1e-12  # a row's amax is clamped to at least this (an all-zero row: scale eps / 448, q = 0)
USE_FAST_ACCUM = True  # torchao's default Float8MMConfig
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and later
IMPLS = ("torchao", "scaled_mm", "reference")
# The linears of one transformer block that run in FP8 (names under `model.blocks.<i>`).
QUANTIZED_LINEARS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                     "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
# Every side of a quantized linear must be a multiple of this (`_scaled_mm`'s layout on CUDA).
DIM_MULTIPLE = 16

# ||impl - reference|| / ||reference|| of one linear, per output dtype: fp32 is the matmul's summation
# order; bf16 adds the output's rounding (2^-9 per element) and the GPU's fast FP8 accumulation.
IMPL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# ||FP8 - model dtype|| / ||model dtype||: one linear of random Gaussian operands (e4m3's 3 mantissa bits:
# ~2^-5 RMS per operand), and one DiT forward (the quality gate's bound, benchmarks/fp8_quality.py).
FP8_TOLERANCE = {"linear": 0.05, "forward": 0.05}


class FP8Error(ValueError):
    """FP8 cannot run here (device, dtype, layer sizes) or a call asks for weights that were dropped;
    the message names the value and the fix."""


# ---------------------------------------------------------------------------- the rule and the oracle
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] e4m3, scale [..., 1] fp32) with x ~ q * scale, row by row (the rule in
    the module docstring; torchao's `Float8Tensor.from_hp(x, PerRow(), hp_value_lb=AMAX_EPS)`)."""
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_EPS)  # [..., 1], x's dtype
    scale = (amax / FP8_MAX).to(torch.float32)
    q = (x.to(torch.float32) / scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [..., K] e4m3, scale [..., 1]) -> fp32 [..., K]."""
    return q.to(torch.float32) * scale


def reference_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """The plain FP8 linear: x [..., K] quantized by the rule, both operands dequantized to fp32, one fp32
    matmul with weight [N, K] (scale [N, 1]), the bias added -> [..., N] in x's dtype."""
    q, scale = quantize_rows(x)
    out = dequantize_rows(q, scale) @ dequantize_rows(weight_q, weight_scale).t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x_q [M, K] @ w_q.t() through `torch._scaled_mm` (row scales [M, 1] and [N, 1]) -> [M, N] in out_dtype,
    as torchao's `addmm_float8_unwrapped_inference` calls it (an fp32 output takes the bias after the matmul)."""
    if not x_q.is_contiguous():
        x_q = x_q.contiguous()
    fused = bias if out_dtype != torch.float32 else None
    out = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.t(), bias=fused, out_dtype=out_dtype,
                           use_fast_accum=USE_FAST_ACCUM)
    return out + bias if bias is not None and fused is None else out


class ScaledMMLinear(nn.Module):
    """The `scaled_mm` implementation of one FP8 linear: e4m3 weight [N, K] and its fp32 row scales [N, 1]
    (buffers), the original bias (the same Parameter: shared with the model-dtype linear it replaces)."""

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight_q.shape[1], weight_q.shape[0]
        self.register_buffer("weight_q", weight_q)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "ScaledMMLinear":
        q, scale = quantize_rows(linear.weight.detach())
        return cls(q, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N] in x's dtype
        q, scale = quantize_rows(x.reshape(-1, self.in_features))  # [M, K], [M, 1]
        out = scaled_mm(q, scale, self.weight_q, self.weight_scale, self.bias, x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=e4m3 (scaled_mm)"


class ReferenceLinear(ScaledMMLinear):
    """The `reference` implementation: `reference_linear` over the same FP8 weight and scales."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N] in x's dtype
        return reference_linear(x, self.weight_q, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=e4m3 (fp32 reference matmul)"


# ---------------------------------------------------------------------------- torchao
@lru_cache(maxsize=1)
def torchao_error() -> str | None:
    """Why torchao cannot build FP8 weights in this process (not installed, or it does not import on
    this torch), or None."""
    try:
        import torchao  # noqa: F401
        from torchao.float8.inference import Float8MMConfig  # noqa: F401
        from torchao.quantization import Float8Tensor, PerRow  # noqa: F401
        from torchao.quantization.quantize_.workflows.float8.float8_tensor import (  # noqa: F401
            QuantizeTensorToFloat8Kwargs)
    except Exception as exc:  # ImportError, or an API this torch lacks
        return f"torchao does not import ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def torchao_weight(weight: torch.Tensor) -> nn.Parameter:
    """weight [N, K] as torchao's `Float8Tensor` (the rule's qdata and row scales, activations quantized
    row-wise at each call with the same lower bound on amax), as a frozen Parameter."""
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import Float8Tensor, PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import QuantizeTensorToFloat8Kwargs

    act = QuantizeTensorToFloat8Kwargs(FP8_DTYPE, PerRow(), hp_value_lb=AMAX_EPS)
    q = Float8Tensor.from_hp(weight.detach(), float8_dtype=FP8_DTYPE, granularity=PerRow(),
                             mm_config=Float8MMConfig(use_fast_accum=USE_FAST_ACCUM), hp_value_lb=AMAX_EPS,
                             act_quant_kwargs=act)
    return nn.Parameter(q, requires_grad=False)


_IMPL_BY_DEVICE: dict[str, tuple[str, str | None]] = {}
_LOCK = threading.RLock()


def choose_impl(device, dtype: torch.dtype) -> tuple[str, str | None]:
    """(implementation, why not torchao or None) for FP8 linears on `device` in `dtype`: torchao when it
    imports and one small linear through it matches the reference there; else scaled_mm when one small
    linear through it does; else (a CPU whose `_scaled_mm` has no row-wise scales) the reference. Decided
    once per device and dtype."""
    key = f"{torch.device(device)}:{dtype}"
    with _LOCK:
        if key not in _IMPL_BY_DEVICE:
            why = impl_error("torchao", device, dtype)
            impl = "torchao" if why is None else "scaled_mm"
            if why is not None:
                why_not_mm = impl_error("scaled_mm", device, dtype)
                if why_not_mm is not None:
                    impl, why = "reference", f"{why}; {why_not_mm}"
                log.info("FP8 linears on %s run through %s: %s", key, impl, why)
            _IMPL_BY_DEVICE[key] = (impl, why)
        return _IMPL_BY_DEVICE[key]


def impl_error(impl: str, device, dtype: torch.dtype) -> str | None:
    """Why implementation `impl` cannot run FP8 linears on `device` in `dtype` (one small linear against the
    reference), or None when it can."""
    if impl == "torchao":
        return torchao_error() or _smoke(lambda x, w, b: F.linear(x, torchao_weight(w), b), "torchao", device,
                                         dtype)
    if impl == "scaled_mm":
        return _smoke(lambda x, w, b: ScaledMMLinear(*quantize_rows(w), b)(x), "torch._scaled_mm", device, dtype)
    if impl == "reference":
        return None
    raise ValueError(f"unknown FP8 implementation {impl!r}; one of {', '.join(IMPLS)}")


def _smoke(linear, name: str, device, dtype: torch.dtype) -> str | None:
    """One [32, 32] x [32, 16] FP8 linear through `linear(x, w, b)` against `reference_linear`: None when
    it runs and agrees, else why not."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(32, 32, generator=g).to(device, dtype)
        x = torch.randn(16, 32, generator=g).to(device, dtype)
        b = torch.randn(32, generator=g).to(device, dtype)
        out = linear(x, w, b)
        ref = reference_linear(x, *quantize_rows(w), b)
        err = relative_error(out, ref)
        if not err <= IMPL_TOLERANCE[dtype]:
            return (f"{name}'s FP8 linear is {err:.3g} from the reference on {device} (tolerance "
                    f"{IMPL_TOLERANCE[dtype]})")
    except Exception as exc:
        return f"{name}'s FP8 linear fails on {device} ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius, fp32)."""
    ref = ref.detach().to(torch.float32)
    return float((out.detach().to(torch.float32) - ref).norm() / ref.norm().clamp(min=1e-30))


@torch.no_grad()
def cached_forward_error(dit, fp8_dit, text_embeds: torch.Tensor, frames: int, height: int, width: int,
                         seed: int = 0, timestep: float = 750.0) -> float:
    """||FP8 - model dtype|| / ||model dtype|| of one cached block forward (`FP8_TOLERANCE["forward"]`): each DiT
    commits a clean block at t = 0 into its own cache, then predicts the flow of the next block (noise) at
    `timestep`; the same inputs (seeded, latents [1, C, frames, height, width]) and prompt embeddings for both."""
    from sdvg.models.kv_cache import KVCacheSpec

    cfg = dit.config
    g = torch.Generator().manual_seed(seed)
    clean = torch.randn(1, cfg.in_channels, frames, height, width, generator=g)
    noisy = torch.randn(1, cfg.in_channels, frames, height, width, generator=g)
    tokens_per_frame = (height // cfg.patch_size[1]) * (width // cfg.patch_size[2])
    outs = []
    for model in (dit, fp8_dit):
        dev = model.device
        cache = KVCacheSpec.for_dit(cfg, tokens_per_frame, 2 * frames).allocate(model.dtype, dev)
        text = model.encode_text(text_embeds)
        model(clean.to(dev), torch.zeros(1, frames, device=dev), text, 0, cache=cache)
        cache.commit()
        outs.append(model(noisy.to(dev), torch.full((1, frames), timestep, device=dev), text, frames, cache=cache))
    return relative_error(outs[1], outs[0])


# ---------------------------------------------------------------------------- where FP8 may run
def fp8_conflict(device, dtype: torch.dtype) -> str | None:
    """Why FP8 linears cannot run on `device` in `dtype`, or None: the one place of this rule. CUDA needs
    compute capability >= 8.9 and bf16 (row-wise `_scaled_mm` writes bf16 there); the CPU runs bf16 or
    fp32 (tests); other devices and fp16 are refused."""
    dev = torch.device(device)
    if dev.type not in ("cuda", "cpu"):
        return (f"FP8 runs on CUDA (compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}) or on the CPU, "
                f"not on {dev}; use quantization='none' there")
    if dev.type == "cuda":
        cap = tuple(torch.cuda.get_device_capability(dev))
        if cap < MIN_CAPABILITY:
            return (f"{dev} has compute capability {cap[0]}.{cap[1]}, and FP8 matmuls need "
                    f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later (Ada, Hopper); use quantization='none' on it")
        if dtype != torch.bfloat16:
            return (f"FP8 on CUDA runs a bf16 model (row-wise _scaled_mm writes bf16), this one is {dtype}; load it "
                    "with torch_dtype=torch.bfloat16 (--dtype bfloat16)")
    elif dtype not in (torch.bfloat16, torch.float32):
        return f"FP8 runs a bf16 (or, on the CPU, fp32) model, this one is {dtype}; use torch_dtype=torch.bfloat16"
    return None


def config_conflict(config) -> str | None:
    """Why a DiT of `config` cannot run its block linears in FP8 (a width not a multiple of 16), or None."""
    bad = {name: v for name, v in (("dim", config.dim), ("ffn_dim", config.ffn_dim)) if v % DIM_MULTIPLE}
    if bad:
        return (f"FP8 linears need widths that are multiples of {DIM_MULTIPLE}, this DiT has "
                + ", ".join(f"{k} {v}" for k, v in bad.items()) + "; use quantization='none' for it")
    return None


# ---------------------------------------------------------------------------- the DiT
@dataclass(frozen=True)
class FP8State:
    """What a DiT holds in FP8: the implementation, and whether its model-dtype linear weights are gone
    (quantized in place) or kept in the DiT it was copied from."""

    impl: str
    in_place: bool
    device: str
    dtype: torch.dtype


def fp8_state(dit) -> FP8State | None:
    """The FP8 state of a DiT (None: its block linears are in the model's dtype)."""
    return getattr(dit, "_sdvg_fp8", None)


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name, parent module, attribute) of every linear that runs in FP8 in a Wan DiT's `model`."""
    out = []
    for i, block in enumerate(model.blocks):
        for path in QUANTIZED_LINEARS:
            *parents, attr = path.split(".")
            parent = block
            for p in parents:
                parent = parent[int(p)] if p.isdigit() else getattr(parent, p)
            out.append((f"blocks.{i}.{path}", parent, attr))
    return out


def _get(parent: nn.Module, attr: str) -> nn.Module:
    return parent[int(attr)] if attr.isdigit() else getattr(parent, attr)


def _set(parent: nn.Module, attr: str, module: nn.Module) -> None:
    if attr.isdigit():
        parent[int(attr)] = module
    else:
        setattr(parent, attr, module)


def _quantize_linears(dit, impl: str) -> None:
    """Each linear of `quantized_linears` of `dit.model` quantized: its weight replaced (torchao) or the
    module replaced (scaled_mm); biases kept as they are."""
    for _, parent, attr in quantized_linears(dit.model):
        linear = _get(parent, attr)
        if impl == "torchao":
            linear.weight = torchao_weight(linear.weight)
        else:
            _set(parent, attr, (ReferenceLinear if impl == "reference" else ScaledMMLinear).from_linear(linear))


def check_dit(dit) -> tuple[str, str | None]:
    """Refuse a DiT whose linears cannot run in FP8 where it is (FP8Error); else (implementation, why
    not torchao or None) for it."""
    why = config_conflict(dit.config) or fp8_conflict(dit.device, dit.dtype)
    if why:
        raise FP8Error(why)
    return choose_impl(dit.device, dit.dtype)


@torch.no_grad()
def quantize_in_place(dit, impl: str | None = None) -> str:
    """Quantize `dit`'s block linears in place (their model-dtype weights dropped); returns the
    implementation. A DiT already in FP8 is left as it is."""
    state = fp8_state(dit)
    if state is not None:
        return state.impl
    impl = impl or check_dit(dit)[0]
    device, dtype = dit.device, dit.dtype
    _quantize_linears(dit, impl)
    dit._sdvg_fp8 = FP8State(impl, True, str(device), dtype)
    return impl


@torch.no_grad()
def quantized_copy(dit, impl: str | None = None):
    """A copy of `dit` whose block linears run in FP8; every other tensor (and each linear's bias) is the
    original's own, shared, and the original is left untouched."""
    if fp8_state(dit) is not None:
        raise FP8Error("this DiT is already in FP8")
    impl = impl or check_dit(dit)[0]
    memo = {}  # deepcopy shares every tensor found here instead of copying it
    for module in dit.modules():
        for t in itertools.chain(module._parameters.values(), module._buffers.values(), vars(module).values()):
            if isinstance(t, torch.Tensor):
                memo[id(t)] = t
    out = copy.deepcopy(dit, memo)
    _quantize_linears(out, impl)
    out._sdvg_fp8 = FP8State(impl, False, str(dit.device), dit.dtype)
    return out


# the FP8 copy each model-dtype DiT has, kept as long as that DiT lives
_COPIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def kept_copy(dit):
    """The FP8 copy kept for `dit` (still on its device and in its dtype), or None."""
    with _LOCK:
        held = _COPIES.get(dit)
        if held is not None and (held._sdvg_fp8.device, held._sdvg_fp8.dtype) != (str(dit.device), dit.dtype):
            del _COPIES[dit]  # made before a move or a cast: stale
            held = None
        return held


def forget_copies(*dits) -> None:
    """Drop the FP8 copies kept for `dits` (their weights moved or changed dtype)."""
    with _LOCK:
        for dit in dits:
            if dit is not None:
                _COPIES.pop(dit, None)


def role_dit(dit, role: str, fp8: bool):
    """The DiT a role runs for one video: `dit` itself, or in FP8 its copy (made here once, then kept) or
    `dit` when quantized in place. Asking the model dtype of a DiT quantized in place is refused."""
    state = fp8_state(dit)
    if not fp8:
        if state is not None and state.in_place:
            raise FP8Error(dropped_message(role, state))
        return dit
    if state is not None:
        return dit
    with _LOCK:  # two sessions asking at once make one copy
        held = kept_copy(dit)
        if held is None:
            held = _COPIES[dit] = quantized_copy(dit)
        return held


def dropped_message(role: str, state: FP8State) -> str:
    flag = {"drafter": "'fp8-drafter'", "target": "'fp8-target'"}[role]
    return (f"the {role}'s model-dtype linear weights were dropped when the pipeline was loaded with FP8 (quantized "
            f"in place, {state.impl}), so it runs in FP8 only: ask quantization='fp8' or {flag} (or leave it unset: "
            "the pipeline's default), or load the pipeline without quantization= (then each call that asks FP8 "
            "quantizes a copy, both kept)")


def check_roles(comps, opts) -> None:
    """Refuse, before a video is prepared, what resolved `opts` ask of `comps`' DiTs: FP8 where it cannot
    run, the model dtype of a DiT quantized in place (FP8Error)."""
    fp8 = opts.fp8_roles()
    for role in opts.roles:
        dit = getattr(comps, role)
        if dit is None:
            continue
        state = fp8_state(dit)
        if role in fp8:
            if state is None:
                why = config_conflict(dit.config) or fp8_conflict(dit.device, dit.dtype)
                if why:
                    raise FP8Error(f"quantization {opts.quantization!r}: the {role}: {why}")
        elif state is not None and state.in_place:
            raise FP8Error(f"quantization {opts.quantization!r}: " + dropped_message(role, state))


def role_impls(comps, opts) -> dict[str, str]:
    """role -> FP8 implementation of each role that resolved `opts` run in FP8 (what `role_dit` gives it)."""
    out = {}
    for role in opts.fp8_roles():
        dit = getattr(comps, role) if role in opts.roles else None
        if dit is None:
            continue
        held = kept_copy(dit)
        state = fp8_state(dit) or (fp8_state(held) if held is not None else None)
        out[role] = state.impl if state is not None else choose_impl(dit.device, dit.dtype)[0]
    return out


# ---------------------------------------------------------------------------- the pipeline
def check_load(quantization, backend: str | None, preset, devices: dict) -> tuple[str, ...]:
    """Before a pipeline loads with `quantization=` (None or a name of `QUANTIZATIONS`): refuse an unknown
    value, a backend FP8 cannot run on, and a role's device, dtype or widths FP8 cannot run with
    (`devices`: role -> device). Returns the roles to quantize in place."""
    from sdvg.config import torch_dtype
    from sdvg.options import GenerationOptions

    opts = GenerationOptions(quantization="none" if quantization is None else quantization,
                             backend=backend)  # the value and backend rules
    dtype = torch_dtype(preset.precision)
    for role in opts.fp8_roles():
        why = config_conflict(getattr(preset, role)) or fp8_conflict(devices[role], dtype)
        if why:
            raise FP8Error(f"quantization {quantization!r}: the {role}: {why}")
    return opts.fp8_roles()


def load_in_place(comps, roles: tuple[str, ...]) -> None:
    """Quantize `roles`' DiTs of a pipeline being loaded in place (`check_load` first)."""
    for role in roles:
        dit = getattr(comps, role)
        if dit is not None:
            quantize_in_place(dit)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def before_to(comps, device=None, dtype: torch.dtype | None = None) -> None:
    """`pipe.to()`, before anything moves: refuse a cast of a DiT quantized in place (its FP8 weights would
    be cast too) and its move where FP8 cannot run; the FP8 copies kept for the DiTs are dropped (made
    for the old device or dtype)."""
    for role in ("drafter", "target"):
        dit = getattr(comps, role)
        state = fp8_state(dit) if dit is not None else None
        if state is None or not state.in_place:
            continue
        if dtype is not None:
            raise FP8Error(f"pipe.to({dtype}): the {role} was quantized in place at load and its FP8 weights cannot "
                           "be cast; load the pipeline with the torch_dtype you want (and quantization=)")
        why = fp8_conflict(device, dit.dtype) if device is not None else None
        if why:
            raise FP8Error(f"pipe.to({device}): the {role} runs in FP8 only (quantized in place at load): {why}")
    forget_copies(comps.drafter, comps.target)


# ---------------------------------------------------------------------------- memory
def fp8_tensors(dit) -> list[torch.Tensor]:
    """The tensors a DiT holds for its FP8 linears (e4m3 weights and their fp32 scales; empty when none)."""
    out = []
    for _, parent, attr in quantized_linears(dit.model):
        m = _get(parent, attr)
        if isinstance(m, ScaledMMLinear):
            out += [m.weight_q, m.weight_scale]
        elif hasattr(m.weight, "qdata"):  # torchao's Float8Tensor
            out += [m.weight.qdata, m.weight.scale]
    return out


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@lru_cache(maxsize=16)
def quantized_counts(config) -> tuple[int, int]:
    """(weights, output rows) of the linears a DiT of `config` runs in FP8 (the real class on the meta device)."""
    from sdvg.models.dit import CausalWanDiT

    with torch.device("meta"):
        model = CausalWanDiT(config).model
    linears = [_get(parent, attr) for _, parent, attr in quantized_linears(model)]
    return sum(m.weight.numel() for m in linears), sum(m.weight.shape[0] for m in linears)
