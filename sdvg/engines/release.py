"""Dropping the torch DiT weights that a role's TensorRT engines replace, so that a 14B target is
resident once (in its engines), not twice.

What the engines do not cover stays: the text embedder and every block's cross-attention
K/V projections (`CausalWanDiT.encode_text`, once per prompt), the time embedding (its dtype is
read by `timestep_freqs`), `proj_out` (the DiT's dtype and device are read from it). Everything
else (patch embedding, the blocks' self-attention, cross-attention queries and outputs, FFNs,
norms and modulation tables, the output norm) goes to the meta device; each released submodule
then refuses an eager call with the reason and the fix instead of failing inside a kernel.
"""
from __future__ import annotations

import re

import torch

_KEPT = re.compile(r"(condition_embedder\..*|proj_out\..*|blocks\.\d+\.attn2\.(to_k|to_v|norm_k)\..*)")


def kept_after_engines(name: str) -> bool:
    """Whether the parameter `name` of a DiT's `model` stays resident once its engines have loaded."""
    return bool(_KEPT.fullmatch(name))


def kept_params(model: torch.nn.Module) -> int:
    """Parameters (count) a DiT keeps after its engines load (works on the meta device)."""
    return sum(p.numel() for n, p in model.named_parameters() if kept_after_engines(n))


class ReleasedWeightsError(RuntimeError):
    """An eager DiT forward after the weights its engines replace were released."""


def release_replaced_weights(dit, why: str) -> int:
    """Move every parameter and buffer of `dit.model` that `kept_after_engines` does not keep to the
    meta device (freeing its memory); a forward of a released submodule raises ReleasedWeightsError
    naming `why`. Returns the bytes released (0 when already released)."""
    model = dit.model
    if getattr(model, "_sdvg_released", False):
        return 0
    freed = 0
    for mod_name, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False)]
        released = False
        for n, p in own:
            full = f"{mod_name}.{n}" if mod_name else n
            if p.device.type != "meta" and not kept_after_engines(full):
                freed += p.numel() * p.element_size()
                module._parameters[n] = torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                           requires_grad=p.requires_grad)
                released = True
        if released:
            module.register_forward_pre_hook(_refuse(mod_name, why))
    model._sdvg_released = True
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return freed


def _refuse(name: str, why: str):
    def hook(module, args):
        raise ReleasedWeightsError(f"the torch DiT's {name or 'model'} weights were released after {why}; run this "
                                   "pipeline with that backend, or keep them with "
                                   "pipe.set_engine_executor(..., release_torch_weights=False) before its first video")
    return hook
