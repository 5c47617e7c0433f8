"""The build plan of `python -m build_engines`: what each engine's build needs on the disk, on the GPU
and in host memory, computed on the meta device from the configs alone (no weights, no TensorRT),
and the check that refuses a build before any work when a limit is too small.

One engine is built at a time, in the signatures' order:

1. export: the engine module (its weights where the pipeline put them) to ONNX, example inputs at the
   first profile's opt shape on the engine's device; the ONNX file and its `.data` hold the
   weights once (W);
2. before `build_engine`: the example inputs are freed and a DiT engine's torch DiT goes to the host
   (`torch.cuda.empty_cache()` after), so the builder's copy of the weights is the only one on
   the GPU;
3. TensorRT parses the ONNX file (the parser keeps the weights in host memory: W), the file is
   deleted, the builder times tactics with every I/O tensor at the largest profile shapes and its
   workspace, and returns the serialized plan in host memory (W again), written to disk through a
   memoryview;
4. the DiT goes back to the GPU for the next engine.

Estimates (stated with each number): an ONNX file's and a plan's size are the engine's weight
bytes (strongly typed: the plan keeps the graph's dtypes; kernels and the graph add megabytes),
the builder's device memory is its weights + the I/O tensors at the profiles' upper bounds + the
workspace limit. Activations inside the builder come out of the workspace.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from sdvg.config import Preset, torch_dtype

GIB = 2**30
# One H200 machine as this project is lent it: GPU memory, disk, host memory (GiB).
H200_LIMITS = {"gpu": 139.0, "disk": 64.0, "host": 128.0}
FIXES = {
    "disk": "free disk space under --out, point --out at a larger disk, or build fewer engine families at a time "
            "(--stages) and move each folder's plans away",
    "gpu": "build on a larger GPU, lower --workspace-gib, or build a smaller --num-blocks (the cached engines' "
           "largest I/O tensors)",
    "host": "build on a machine with more host memory, or build the DiT engines one family at a time (--stages)",
}


@dataclass(frozen=True)
class EnginePlan:
    name: str
    family: str
    device: str
    weights: int  # bytes of the engine's weights: its ONNX file, its plan, the builder's device copy
    io_max: int  # bytes of every input and output at the profiles' upper bounds
    inputs_opt: int  # bytes of the example inputs the export makes (first profile's opt shape)
    disk_peak: int  # plans built before + this engine's ONNX file or plan (never both: deleted after parse)
    gpu_peak: int  # on `device`: max(export, build)
    host_peak: int
    gpu_how: str
    host_how: str
    disk_how: str


def _elem(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def family_weights(preset: Preset) -> dict[str, int]:
    """Bytes of the weights each engine family's module holds (meta device): a DiT, the VAE's decoder
    (post_quant_conv + decoder: what `VAEDecodeStep` exports), ImageReward."""
    from sdvg.models.memory import component_params
    from sdvg.models.vae import build_vae

    elem = _elem(torch_dtype(preset.precision))
    with torch.device("meta"):
        vae = build_vae(preset.vae)
    decoder = _params(vae.decoder) + _params(vae.post_quant_conv)
    return {"drafter_dit": preset.drafter.num_params() * elem, "target_dit": preset.target.num_params() * elem,
            "vae_decode": decoder * elem, "reward": component_params(preset)["reward"] * elem}


def resident_weights(preset: Preset, drafter_device: str, target_device: str) -> dict[str, dict[str, int]]:
    """device -> {what: bytes} of the pipeline's weights as `build_engines` loads it (the drafter, VAE,
    ImageReward and text encoder on --device, the target on --target-device)."""
    from sdvg.models.memory import component_params

    elem = _elem(torch_dtype(preset.precision))
    params = component_params(preset)
    out: dict[str, dict[str, int]] = {}
    for what, device, n in (("drafter_dit", drafter_device, preset.drafter.num_params()),
                            ("target_dit", target_device, preset.target.num_params()),
                            ("vae", drafter_device, params["vae"]), ("reward", drafter_device, params["reward"]),
                            ("text_encoder", drafter_device, params["text_encoder"])):
        out.setdefault(str(device), {})[what] = n * elem
    return out


def build_plan(preset: Preset, signatures, fmt: str = "tensorrt", drafter_device: str = "cuda:0",
               target_device: str | None = None, workspace_gib: float = 8.0) -> list[EnginePlan]:
    """The per-engine plan of building `signatures` (in order) in format `fmt` (see the module docstring)."""
    target_device = str(target_device or drafter_device)
    weights = family_weights(preset)
    resident = resident_weights(preset, drafter_device, target_device)
    workspace = int(workspace_gib * GIB)
    stored, out = 0, []
    for sig in signatures:
        device = target_device if sig.family == "target_dit" else str(drafter_device)
        w = weights[sig.family]
        top = sig.sizes("max")
        io_max = sum(t.nbytes(top) for t in sig.inputs + sig.outputs)
        inputs_opt = sum(t.nbytes(sig.sizes("opt")) for t in sig.inputs)
        here = sum(resident.get(device, {}).values())
        dit = sig.family.endswith("_dit")
        export_gpu = here + inputs_opt
        if fmt == "onnx":
            gpu = export_gpu
            gpu_how = f"export: resident weights {here / GIB:.1f} + example inputs {inputs_opt / GIB:.2f}"
            host = w
            host_how = f"the ONNX writer's copy of the weights {w / GIB:.1f}"
            disk = stored + w
            disk_how = f"ONNX files before {stored / GIB:.1f} + this one {w / GIB:.1f}"
            stored += w
        else:
            builder_gpu = (here - (w if dit else 0)) + w + io_max + workspace
            gpu = max(export_gpu, builder_gpu)
            gpu_how = (f"max(export: resident {here / GIB:.1f} + example inputs {inputs_opt / GIB:.2f}; build: resident"
                       f"{' without this DiT' if dit else ''} {(here - (w if dit else 0)) / GIB:.1f} + builder weights "
                       f"{w / GIB:.1f} + I/O at the bounds {io_max / GIB:.1f} + workspace {workspace_gib:g})")
            moved = w if dit else 0
            host = moved + 2 * w
            host_how = (f"{'DiT moved off the GPU ' + format(moved / GIB, '.1f') + ' + ' if dit else ''}parsed weights "
                        f"{w / GIB:.1f} + serialized plan {w / GIB:.1f}")
            disk = stored + w
            disk_how = f"plans before {stored / GIB:.1f} + this engine's ONNX file, then its plan {w / GIB:.1f}"
            stored += w
        out.append(EnginePlan(sig.name, sig.family, device, w, io_max, inputs_opt, disk, gpu, host, gpu_how, host_how,
                              disk_how))
    return out


@dataclass(frozen=True)
class Limit:
    kind: str  # gpu | disk | host
    nbytes: int
    source: str


def flag_limits(gpu_gib: float, disk_gib: float, host_gib: float) -> dict[str, Limit]:
    return {k: Limit(k, int(v * GIB), f"--{k}-gib {v:g}") for k, v in
            (("gpu", gpu_gib), ("disk", disk_gib), ("host", host_gib))}


def measured_limits(limits: dict[str, Limit], out: Path, devices=()) -> dict[str, Limit]:
    """`limits` lowered to what this machine has now: the free disk under `out` (its nearest existing
    folder) and the free memory of each CUDA device in `devices` (the smallest)."""
    limits = dict(limits)
    folder = Path(out).resolve()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free < limits["disk"].nbytes:
        limits["disk"] = Limit("disk", free, f"free disk at {folder}")
    for d in devices:
        d = torch.device(d)
        if d.type == "cuda" and torch.cuda.is_available() and (d.index or 0) < torch.cuda.device_count():
            free, _ = torch.cuda.mem_get_info(d)
            if free < limits["gpu"].nbytes:
                limits["gpu"] = Limit("gpu", free, f"free memory of {d}")
    return limits


def check_plan(plan: list[EnginePlan], limits: dict[str, Limit]) -> list[str]:
    """One line per limit an engine exceeds: the engine, the number that does not fit, the limit and the fix."""
    problems = []
    for kind, attr in (("disk", "disk_peak"), ("gpu", "gpu_peak"), ("host", "host_peak")):
        worst = max(plan, key=lambda s: getattr(s, attr), default=None)
        if worst is None:
            continue
        need, lim = getattr(worst, attr), limits[kind]
        if need > lim.nbytes:
            problems.append(f"{kind}: engine {worst.name} needs {need / GIB:.1f} GiB at its peak, over {lim.source} "
                            f"({lim.nbytes / GIB:.1f} GiB) by {(need - lim.nbytes) / GIB:.1f} GiB; fix: {FIXES[kind]}")
    return problems


def format_plan(plan: list[EnginePlan], limits: dict[str, Limit], fmt: str) -> list[str]:
    lines = [f"build plan ({fmt}, one engine at a time; GiB; estimates from the configs on the meta device):",
             f"  {'engine':<24} {'device':<8} {'weights':>8} {'I/O max':>8} {'disk':>7} {'GPU':>7} {'host':>7}"]
    for s in plan:
        lines.append(f"  {s.name:<24} {s.device:<8} {s.weights / GIB:8.2f} {s.io_max / GIB:8.2f} "
                     f"{s.disk_peak / GIB:7.1f} {s.gpu_peak / GIB:7.1f} {s.host_peak / GIB:7.1f}")
    for s in plan:
        lines.append(f"  {s.name}: disk = {s.disk_how}; GPU = {s.gpu_how}; host = {s.host_how}")
    for kind, attr in (("disk", "disk_peak"), ("gpu", "gpu_peak"), ("host", "host_peak")):
        peak = max((getattr(s, attr) for s in plan), default=0)
        lim = limits[kind]
        verdict = "fits" if peak <= lim.nbytes else f"DOES NOT FIT (over by {(peak - lim.nbytes) / GIB:.1f} GiB)"
        lines.append(f"  peak {kind:<4} {peak / GIB:7.1f} GiB of {lim.nbytes / GIB:.1f} GiB ({lim.source}): {verdict}")
    return lines
