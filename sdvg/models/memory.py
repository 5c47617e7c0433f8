"""What one pipeline keeps resident, per device, computed before anything is allocated, and the
budget check each video passes before its KV caches are allocated.

Parameter counts come from the real classes built on the meta device (no memory, no download); KV
caches from `KVCacheSpec` under each role's context mode (`KVCacheSpec.nbytes`, the one place their
bytes are computed, for the plan and for the check alike). `sdvg memory` prints the plan;
`check_budget` is what `prepare()` runs before allocating a video's caches."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from sdvg.config import MAX_BUDGET_GIB, Preset, RoleContext, checked_size, torch_dtype
from sdvg.models.kv_cache import KVCacheSpec, MemoryBudgetError

GIB = 2**30


@dataclass(frozen=True)
class MemoryItem:
    device: str
    what: str
    nbytes: int
    arithmetic: str  # how the number was obtained, for the printed plan

    @property
    def gib(self) -> float:
        return self.nbytes / GIB


class _VocabStub:
    """What the ImageReward builder reads from its tokenizer: the vocabulary size and two token ids."""

    bos_token_id, sep_token_id = 30522, 102

    def __init__(self, size: int):
        self._size = size

    def __len__(self) -> int:
        return self._size


@lru_cache(maxsize=16)
def component_params(preset: Preset) -> dict[str, int]:
    """Parameters of the VAE, the umT5 encoder and ImageReward of `preset` (real classes, meta device)."""
    from transformers import UMT5Config, UMT5EncoderModel

    from sdvg.models.reward import build_image_reward
    from sdvg.models.vae import build_vae

    te = preset.text_encoder
    with torch.device("meta"):
        vae = build_vae(preset.vae)
        umt5 = UMT5EncoderModel(UMT5Config(vocab_size=te.vocab_size, d_model=te.d_model, d_kv=te.d_kv, d_ff=te.d_ff,
                                           num_layers=te.num_layers, num_heads=te.num_heads,
                                           feed_forward_proj="gated-gelu", is_encoder_decoder=False))
        reward = build_image_reward(preset.reward, _VocabStub(preset.reward.vocab_size or 30524))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return {"vae": count(vae), "text_encoder": count(umt5), "reward": count(reward)}


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_arithmetic(spec: KVCacheSpec, context: RoleContext, dtype: torch.dtype) -> tuple[int, str]:
    """(bytes, how they add up) of the cache `spec` describes: `spec.nbytes` and its factors."""
    nbytes, elem = spec.nbytes(dtype), _elem(dtype)
    per_frame = spec.num_layers * 2 * spec.batch * spec.heads * spec.head_dim * spec.tokens_per_frame * elem
    slots = nbytes // per_frame
    w = spec.window
    kept = f"{slots} frames"
    if w.window_frames:
        kept = f"window {w.window_frames} + sink {w.sink_frames}" + (f" + slack {w.slack_frames}" if w.slack_frames
                                                                      else "")
    batch = f" x batch {spec.batch}" if spec.batch != 1 else ""
    how = (f"{context.mode}: {kept} x {spec.tokens_per_frame} tokens x {spec.num_layers} layers x 2 (K, V) x "
           f"{spec.heads * spec.head_dim}{batch} x {elem} B")
    return nbytes, how


def kv_bytes(preset: Preset, role: str, context: RoleContext, num_blocks: int,
             slack_frames: int = 0, prefix_frames: int = 0) -> tuple[int, str]:
    """(bytes, arithmetic) of `role`'s KV cache for `num_blocks` blocks under `context`, after `prefix_frames`
    clean frames (a start frame's latents: `KVCacheSpec.for_context`)."""
    spec = KVCacheSpec.for_context(preset, getattr(preset, role), context, num_blocks, slack_frames, prefix_frames)
    return kv_arithmetic(spec, context, torch_dtype(preset.precision))


def prompt_kv_bytes(dit, text_len: int, dtype: torch.dtype) -> tuple[int, str]:
    """(bytes, arithmetic) of one DiT's cross-attention K/V of one prompt (`CausalWanDiT.encode_text`)."""
    elem = _elem(dtype)
    return (dit.num_layers * 2 * text_len * dit.dim * elem,
            f"{dit.num_layers} layers x 2 x {text_len} tokens x {dit.dim} x {elem} B")


def plan_memory(preset: Preset, contexts: dict[str, RoleContext], num_blocks: int, drafter_device: str,
                target_device: str, text_encoder_device: str, prefix_frames: int = 0,
                fp8_roles: tuple[str, ...] = ()) -> list[MemoryItem]:
    """Every resident component of a pipeline running `contexts` (role -> context), by device. The VAE and
    ImageReward live with the drafter (as `SpeculativeVideoPipeline` places them). `prefix_frames`: a start
    frame's latent frames (kv_cache_frames), which a full context holds before block 0. `fp8_roles`: DiTs
    quantized in place (`quantization=` at load, as the CLI loads them): their block linears as e4m3
    weights and fp32 row scales (`fp8_weights_item`), the rest in the preset's precision."""
    elem = torch.empty((), dtype=torch_dtype(preset.precision)).element_size()
    items = []
    for role, device in (("drafter", drafter_device), ("target", target_device)):
        if role not in contexts:
            continue
        dit = getattr(preset, role)
        n = dit.num_params()
        if role in fp8_roles:
            fp8 = fp8_weights_item(dit, device, f"{role} FP8 weights")
            n -= fp8.params
            items.append(MemoryItem(device, f"{role} weights", n * elem, f"{n / 1e9:.2f}B params x {elem} B (the "
                                                                       "rest: not quantized)"))
            items.append(fp8.item)
        else:
            items.append(MemoryItem(device, f"{role} weights", n * elem, f"{n / 1e9:.2f}B params x {elem} B"))
        nbytes, how = kv_bytes(preset, role, contexts[role], num_blocks, prefix_frames=prefix_frames)
        items.append(MemoryItem(device, f"{role} KV cache", nbytes, how))
        text, how = prompt_kv_bytes(dit, preset.text_encoder.text_len, torch_dtype(preset.precision))
        items.append(MemoryItem(device, f"{role} prompt K/V", text, how))
    params = component_params(preset)
    for name, device in (("vae", drafter_device), ("reward", drafter_device), ("text_encoder", text_encoder_device)):
        n = params[name]
        items.append(MemoryItem(device, {"vae": "VAE", "reward": "ImageReward", "text_encoder": "umT5 text encoder"}
                                [name] + " weights", n * elem, f"{n / 1e6:.1f}M params x {elem} B"))
    return items


@dataclass(frozen=True)
class FP8Weights:
    item: MemoryItem
    params: int  # the quantized linears' weights (parameters no longer in the model's dtype)


def fp8_weights_item(config, device: str, what: str) -> FP8Weights:
    """The bytes of a DiT's FP8 block linears (sdvg/models/fp8.py): 1 B per weight, a 4 B scale per output row."""
    from sdvg.models.fp8 import quantized_counts

    weights, rows = quantized_counts(config)
    return FP8Weights(MemoryItem(device, what, weights + 4 * rows,
                                 f"{weights / 1e9:.2f}B params x 1 B (e4m3) + {rows} rows x 4 B"), weights)


def device_totals(items: list[MemoryItem]) -> dict[str, int]:
    """Bytes per device (exact; refused by `checked_size` past 2^63 - 1, so no total can wrap or go negative)."""
    totals: dict[str, int] = {}
    for it in items:
        totals[it.device] = checked_size(f"memory of device {it.device}", totals.get(it.device, 0) + it.nbytes)
    return totals


def format_plan(items: list[MemoryItem], budget_gib: float | None) -> list[str]:
    lines = []
    totals = device_totals(items)
    for device, total in totals.items():
        lines.append(f"device {device}:")
        for it in (i for i in items if i.device == device):
            lines.append(f"  {it.what:<28} {it.gib:8.2f} GiB   ({it.arithmetic})")
        verdict = ""
        if budget_gib is not None:
            verdict = (f"   fits the budget of {budget_gib:.1f} GiB" if total / GIB <= budget_gib else
                       f"   EXCEEDS the budget of {budget_gib:.1f} GiB by {total / GIB - budget_gib:.2f} GiB")
        lines.append(f"  {'total':<28} {total / GIB:8.2f} GiB" + verdict)
    return lines


# ------------------------------------------------------------------ the budget check of one video
def device_key(device) -> str:
    """'cpu', 'cuda:0', ...: a CUDA device without an index is the current one."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def check_budget_gib(budget_gib) -> float | None:
    """A memory budget in GiB: None (each device's free memory) or a positive finite number."""
    if budget_gib is None:
        return None
    if isinstance(budget_gib, bool) or not isinstance(budget_gib, (int, float)):
        raise TypeError(f"memory_budget_gib must be a number of GiB or None, got {type(budget_gib).__name__}")
    if not math.isfinite(budget_gib) or not 0 < budget_gib <= MAX_BUDGET_GIB:
        raise ValueError(f"memory_budget_gib must be a positive finite number of GiB up to 2^33 (2^63 bytes; or "
                         f"None: each device's free memory), got {budget_gib:.6g}")
    return float(budget_gib)


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def storage_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `t`'s memory: itself, or a tensor subclass's inner tensors (torchao's
    FP8 weights: e4m3 data and fp32 scales, whose wrapper reports the original dtype)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in storage_tensors(getattr(t, n))]
    return [t]


def resident_items(modules: dict[str, torch.nn.Module | None]) -> list[MemoryItem]:
    """The bytes of each named module's parameters and buffers, per device they sit on (measured)."""
    items = []
    for name, module in modules.items():
        if module is None:
            continue
        per_device: dict[str, dict[int, int]] = {}  # device -> element size -> values
        seen = set()
        for t in (x for p in (*module.parameters(), *module.buffers()) for x in storage_tensors(p)):
            if id(t) in seen:  # tied weights count once
                continue
            seen.add(id(t))
            sizes = per_device.setdefault(device_key(t.device), {})
            sizes[t.element_size()] = sizes.get(t.element_size(), 0) + t.numel()
        for device, sizes in per_device.items():
            nbytes = sum(elem * n for elem, n in sizes.items())
            how = " + ".join(f"{_count(n)} x {elem} B" for elem, n in sorted(sizes.items(), key=lambda x: -x[1]))
            items.append(MemoryItem(device, f"{name} weights", nbytes, f"resident: {how}"))
    return items


_MEMINFO = Path("/proc/meminfo")
_NOTED: set = set()


def available_bytes(device) -> tuple[int | None, str]:
    """(bytes a new allocation on `device` can take now, where the number comes from). CUDA: the
    driver's free memory plus what PyTorch's caching allocator holds unused (an earlier video's
    caches). CPU: MemAvailable of /proc/meminfo, else psutil's available memory, else None."""
    d = torch.device(device)
    if d.type == "cuda":
        free, _ = torch.cuda.mem_get_info(d)
        cached = torch.cuda.memory_reserved(d) - torch.cuda.memory_allocated(d)
        return free + cached, "free memory (torch.cuda.mem_get_info, plus PyTorch's cached blocks)"
    if d.type == "cpu":
        try:
            for line in _MEMINFO.read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available RAM (MemAvailable, /proc/meminfo)"
        except OSError:
            pass
        try:
            import psutil

            return int(psutil.virtual_memory().available), "available RAM (psutil)"
        except ImportError:
            pass
    return None, f"unknown on {d} (no /proc/meminfo, no psutil)"


def check_budget(needs: list[MemoryItem], budget_gib: float | None = None,
                 resident: list[MemoryItem] | None = None, fixes: str = "") -> None:
    """Refuse, before anything is allocated, what does not fit, per device.

    budget_gib None: `needs` (what is about to be allocated) against what the device has free now
    (`available_bytes`; a device whose free memory is unknown is skipped, with a warning, once).
    budget_gib set: the memory the pipeline may hold on each device, as `sdvg memory --budget-gib`
    reads it: `resident` (what is already there) plus `needs`. Activations and the CUDA context come
    on top of either. Raises MemoryBudgetError naming the device, each item with its arithmetic, the
    budget and `fixes`."""
    budget_gib = check_budget_gib(budget_gib)
    resident = resident or []
    for device in dict.fromkeys(it.device for it in needs):
        items = [it for it in needs if it.device == device]
        need = sum(it.nbytes for it in items)
        if budget_gib is None:
            limit, source = available_bytes(device)
            if limit is None:
                if device not in _NOTED:
                    _NOTED.add(device)
                    warnings.warn(f"memory check skipped on {device}: its free memory is {source}; pass "
                                  "memory_budget_gib to check against a budget", RuntimeWarning, stacklevel=3)
                continue
            held = []
            what = f"this video needs {need / GIB:.2f} GiB but {limit / GIB:.2f} GiB is {source}"
        else:
            held = [it for it in resident if it.device == device]
            limit, source = int(budget_gib * GIB), f"the budget of {budget_gib:g} GiB (memory_budget_gib)"
            total = need + sum(it.nbytes for it in held)
            what = (f"it would hold {total / GIB:.2f} GiB ({sum(it.nbytes for it in held) / GIB:.2f} GiB resident + "
                    f"{need / GIB:.2f} GiB for this video), over {source}")
            need = total
        if need <= limit:
            continue
        width = max(len(it.what) for it in (*held, *items))
        lines = [f"  {it.what:<{width}} {it.gib:9.2f} GiB  ({it.arithmetic})" for it in (*held, *items)]
        raise MemoryBudgetError(f"device {device}: {what}; nothing was allocated:\n" + "\n".join(lines)
                                + f"\nFix: {fixes or 'a larger budget'}")
