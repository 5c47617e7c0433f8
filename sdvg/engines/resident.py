"""What a pipeline on the tensorrt backend keeps resident, per device (`sdvg memory --backend tensorrt`).

Each DiT engine holds its own copy of the weights (TensorRT shares no weights between plans): a
role with a block engine and a cached engine holds its weights twice in engines. Once a role's
engines load, the torch DiT keeps only what the engines do not cover (the text
embedder, the cross-attention K/V projections, the time embedding, `proj_out`:
`sdvg.engines.release`). The VAE and ImageReward keep their torch weights (the first latent frames
of a video decode eagerly) beside their engines.

Engine weights: the plan files' sizes when `engines` (a built folder) is given, else the engine
count times the weight bytes (a plan holds the graph's weights in their dtype; kernels add MBs).
Scratch: TensorRT's own number (`engine.device_memory_size_v2`, the largest over the profiles)
when TensorRT is installed and the folder is given; one buffer per role (the largest of its
engines), else listed as unknown (0 counted).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from sdvg.config import Preset, torch_dtype
from sdvg.models.memory import MemoryItem, component_params

ROLE_OF = {"drafter_dit": "drafter", "target_dit": "target", "vae_decode": "vae", "reward": "reward"}


def kept_dit_params(cfg) -> int:
    """Parameters a DiT keeps once its engines load (the real class on the meta device)."""
    from diffusers import WanTransformer3DModel

    from sdvg.engines.release import kept_params

    with torch.device("meta"):
        model = WanTransformer3DModel(**cfg.diffusers_kwargs())
    return kept_params(model)


def _folder_plans(engines: Path) -> dict[str, list[tuple[str, int, Path]]]:
    """engine family -> [(engine name, plan bytes, plan path)] of the TensorRT plans in a built folder (manifests
    only; an engine's name is its key's `stage` field, the on-disk name kept)."""
    out: dict[str, list] = {}
    for m in sorted(Path(engines).glob("*/manifest.json")):
        try:
            d = json.loads(m.read_text())
            key = d["key"]
        except Exception:
            continue
        if key.get("artifact") != "tensorrt":
            continue
        name = key["stage"]  # on-disk field name, kept
        family = next((f for f in ROLE_OF if name == f or name.startswith(f + "_")
                       or (f == "reward" and name.startswith("reward_"))), None)
        if family is not None:
            out.setdefault(family, []).append((name, int(d["size"]), m.parent / d["file"]))
    return out


def _scratch_bytes(plans) -> int | None:
    """The largest `device_memory_size_v2` of the plans (TensorRT deserialises each), or None without TensorRT."""
    try:
        from sdvg.engines.tensorrt import deserialize_plan, import_tensorrt

        trt = import_tensorrt()
    except Exception:
        return None
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    need = 0
    for _, _, path in plans:
        engine = deserialize_plan(trt, runtime, path)
        if engine is not None:
            need = max(need, int(engine.device_memory_size_v2))
        del engine
    return need


def engine_items(preset: Preset, roles, signatures, drafter_device: str, target_device: str,
                 engines: str | Path | None = None) -> list[MemoryItem]:
    """The tensorrt backend's resident items (see the module docstring); `signatures`: the engines a
    build makes for this run (`preset_signatures`), used when no folder is given."""
    elem = torch.empty((), dtype=torch_dtype(preset.precision)).element_size()
    params = component_params(preset)
    folder = _folder_plans(Path(engines)) if engines is not None else {}
    families = [f"{r}_dit" for r in roles] + ["vae_decode", "reward"]
    weights = {"drafter_dit": preset.drafter.num_params() * elem, "target_dit": preset.target.num_params() * elem,
               "vae_decode": params["vae"] * elem, "reward": params["reward"] * elem}
    items = []
    for family in families:
        role = ROLE_OF[family]
        device = target_device if role == "target" else drafter_device
        if family.endswith("_dit"):
            kept = kept_dit_params(getattr(preset, role))
            items.append(MemoryItem(device, f"{role} torch weights kept", kept * elem,
                                    f"text embedder, cross-attention K/V, time embedding, proj_out: {kept / 1e6:.1f}M "
                                    f"params x {elem} B"))
        plans = folder.get(family)
        if plans:
            nbytes = sum(size for _, size, _ in plans)
            how = " + ".join(f"{name} {size / 2**30:.2f} GiB" for name, size, _ in plans) + " (plan files)"
        else:
            names = [s.name for s in signatures if s.family == family]
            nbytes = len(names) * weights[family]
            how = (f"{len(names)} engines ({', '.join(names)}) x {weights[family] / 2**30:.2f} GiB of weights "
                   "(estimate)")
        items.append(MemoryItem(device, f"{role} engine weights", nbytes, how))
        scratch = _scratch_bytes(plans) if plans else None
        items.append(MemoryItem(device, f"{role} engine scratch", scratch or 0,
                                "one buffer shared by the role's contexts: the largest device_memory_size_v2"
                                if scratch is not None else "unknown here: TensorRT reports it when it loads the "
                                "engines (device_memory_size_v2); pass --engines DIR on a machine with TensorRT"))
    return items
