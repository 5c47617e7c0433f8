"""What one pipeline keeps resident, per device, computed before anything is allocated.

Parameter counts come from the real classes built on the meta device (no memory, no download); KV
caches from `KVCacheSpec` under each role's context mode. `sdvg memory` prints this plan."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from sdvg.config import Preset, RoleContext, torch_dtype
from sdvg.models.kv_cache import KVCacheSpec

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


def kv_bytes(preset: Preset, role: str, context: RoleContext, num_blocks: int) -> tuple[int, str]:
    dit = getattr(preset, role)
    spec = KVCacheSpec.for_context(preset, dit, context, num_blocks)
    elem = torch.empty((), dtype=torch_dtype(preset.precision)).element_size()
    frames = context.cache_frames(num_blocks, preset.video.frames_per_block)
    kept = f"window {context.window.window_frames} + sink {context.window.sink_frames}" \
        if context.window.window_frames else f"{frames} frames"
    how = (f"{context.mode}: {kept} x {spec.tokens_per_frame} tokens x {dit.num_layers} layers x 2 (K, V) x "
           f"{dit.dim} x {elem} B")
    return spec.nbytes(torch_dtype(preset.precision)), how


def plan_memory(preset: Preset, contexts: dict[str, RoleContext], num_blocks: int, drafter_device: str,
                target_device: str, text_encoder_device: str) -> list[MemoryItem]:
    """Every resident component of a pipeline running `contexts` (role -> context), by device. The VAE and
    ImageReward live with the drafter (as `SpeculativeVideoPipeline` places them)."""
    elem = torch.empty((), dtype=torch_dtype(preset.precision)).element_size()
    items = []
    for role, device in (("drafter", drafter_device), ("target", target_device)):
        if role not in contexts:
            continue
        dit = getattr(preset, role)
        n = dit.num_params()
        items.append(MemoryItem(device, f"{role} weights", n * elem, f"{n / 1e9:.2f}B params x {elem} B"))
        nbytes, how = kv_bytes(preset, role, contexts[role], num_blocks)
        items.append(MemoryItem(device, f"{role} KV cache", nbytes, how))
        text = dit.num_layers * 2 * preset.text_encoder.text_len * dit.dim * elem
        items.append(MemoryItem(device, f"{role} prompt K/V", text, f"{dit.num_layers} layers x 2 x "
                                f"{preset.text_encoder.text_len} tokens x {dit.dim} x {elem} B"))
    params = component_params(preset)
    for name, device in (("vae", drafter_device), ("reward", drafter_device), ("text_encoder", text_encoder_device)):
        n = params[name]
        items.append(MemoryItem(device, {"vae": "VAE", "reward": "ImageReward", "text_encoder": "umT5 text encoder"}
                                [name] + " weights", n * elem, f"{n / 1e6:.1f}M params x {elem} B"))
    return items


def device_totals(items: list[MemoryItem]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for it in items:
        totals[it.device] = totals.get(it.device, 0) + it.nbytes
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
