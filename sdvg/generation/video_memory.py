"""The memory budget of one video: what it allocates per device, checked before anything of it is
allocated (`check_memory`, called by `prepare`). It counts each role's KV cache (the very spec `prepare`
allocates) and prompt K/V, the FP8 copies the video makes and an offloaded text encoder's visit to
encode the prompt, against each device's free memory or a budget."""
from __future__ import annotations

import torch

from sdvg.config import RoleContext
from sdvg.models.components import Components
from sdvg.models.fp8 import fp8_state, fp8_tensors, kept_copy, tensor_bytes
from sdvg.models.kv_cache import KVCacheSpec
from sdvg.models.memory import (MemoryItem, check_budget, device_key, fp8_weights_item, kv_arithmetic,
                                prompt_kv_bytes, resident_items)
from sdvg.options import GenerationOptions


def cache_spec(comps: Components, dit, context: RoleContext, num_blocks: int, slack_frames: int = 0,
               runners=None, prefix_frames: int = 0) -> KVCacheSpec:
    """The KV cache one role gets for a video (what `allocate_cache` allocates and the budget check counts).
    Every backend uses the same cache: the engines take the visible cache length as a dynamic
    dimension (sdvg/engines/modules.py), so both context modes run on all of them."""
    return KVCacheSpec.for_context(comps.preset, dit.config, context, num_blocks, slack_frames, prefix_frames)


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
