"""torch-tensorrt: the second build route for the DiT engines (`python -m build_engines --format
torch-tensorrt`, optional extra `pip install 'sdvg[torch-tensorrt]'`) and its executor.

Build: the DiT engine module (`DiTStep`) goes through `torch.export` with the signature's dynamic
dimensions (`export_engine`: runs anywhere, tested here), then `torch_tensorrt.dynamo.compile` with
one `torch_tensorrt.Input` per input over the signature's min/opt/max bounds (`trt_inputs`; the
cached engine's `cache_tokens` shared by every layer buffer), and `torch_tensorrt.save` writes the
exported program (`program.ep`). The engine cache keys it by TensorRT, torch and torch-tensorrt
versions as well (`engine_key`): a program is tied to the torch it was built with.

torch-tensorrt pins the torch it is built for (2.14.0 needs torch >= 2.14, < 2.15): installing it
next to another torch replaces that torch. requirements-torch-tensorrt.txt pins the pair.
"""
from __future__ import annotations

from pathlib import Path

import torch

from sdvg.engines.dependencies import import_optional, require_cuda

INSTALL_HINT = ("torch-tensorrt is not installed: install the optional extra with `pip install "
                "'sdvg[torch-tensorrt]'` (or -r requirements-torch-tensorrt.txt: torch-tensorrt 2.14.0 for torch "
                "2.14; another torch-tensorrt replaces the installed torch) on a machine with an NVIDIA GPU")
ARTIFACT = "torch-tensorrt"


def import_torch_tensorrt():
    return import_optional("torch_tensorrt", INSTALL_HINT)


def torch_trt_version() -> str:
    """The installed torch-tensorrt's version (from its metadata: importing it needs TensorRT)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch-tensorrt")
    except PackageNotFoundError:
        return "none"


def check_dit_engine(signature) -> None:
    if not signature.family.endswith("_dit"):
        raise ValueError(f"the torch-tensorrt route builds DiT engines only, not {signature.name!r} (the VAE and "
                         "reward engines go through ONNX and TensorRT)")


def export_engine(module: torch.nn.Module, signature, inputs) -> torch.export.ExportedProgram:
    """`torch.export` of a DiT engine module at `inputs` with the signature's dynamic dimensions: what
    torch-tensorrt compiles."""
    check_dit_engine(signature)
    with torch.no_grad():
        return torch.export.export(module, tuple(inputs), dynamic_shapes=signature.dynamic_shapes())


def trt_inputs(torch_tensorrt, signature) -> list:
    """One `torch_tensorrt.Input` per input in the signature's order: static shapes as they are,
    dynamic ones over the min/opt/max bounds with their dimension names shared across inputs."""
    bounds = [signature.sizes(w) for w in ("min", "opt", "max")]
    out = []
    for t in signature.inputs:
        dtype = getattr(torch, t.dtype)
        named = {i: d for i, d in enumerate(t.shape) if isinstance(d, str)}
        if not named:
            out.append(torch_tensorrt.Input(shape=t.dims({}), dtype=dtype, name=t.name))
        else:
            lo, opt, hi = (t.dims(b) for b in bounds)
            out.append(torch_tensorrt.Input(min_shape=lo, opt_shape=opt, max_shape=hi, dtype=dtype, name=t.name,
                                            shared_dims=named))
    return out


def build_program(module: torch.nn.Module, signature, inputs, path: Path) -> Path:
    """Export, compile and save one DiT engine as a torch-tensorrt exported program at `path`."""
    tt = import_torch_tensorrt()
    require_cuda(inputs[0].device, "torch-tensorrt")
    program = export_engine(module, signature, inputs)
    specs = trt_inputs(tt, signature)
    # no use_explicit_typing: torch-tensorrt 2.14 removed it (its networks are strongly typed: the
    # exported program's dtypes are the engine's)
    compiled = tt.dynamo.compile(program, arg_inputs=specs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    tt.save(compiled, str(path), output_format="exported_program", arg_inputs=specs)
    return path


class TorchTRTEngine:
    """A torch-tensorrt exported program called like the DiT engine module it was built from
    (positional inputs in the signature's order; runs on torch's current stream)."""

    def __init__(self, path: Path, signature, device):
        check_dit_engine(signature)
        self.signature = signature
        self.device = require_cuda(device, "a torch-tensorrt program")
        tt = import_torch_tensorrt()
        self.module = tt.load(str(path)).module()

    def __call__(self, *args):
        inputs = []
        for t, a in zip(self.signature.inputs, args):
            want = getattr(torch, t.dtype)
            inputs.append(a if a.device == self.device and a.dtype == want else a.to(self.device, want))
        with torch.no_grad():
            out = self.module(*inputs)
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return out if len(out) > 1 else out[0]
