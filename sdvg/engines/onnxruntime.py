"""onnxruntime engine runtime: the ONNX files `python -m build_engines --format onnx` exports, run
through the same validated engine cache as TensorRT engines (`--backend onnxruntime`).

The CPU execution provider runs a CPU pipeline (the engine path's executable oracle on machines
without TensorRT); a CUDA pipeline needs the CUDA execution provider (`onnxruntime-gpu`). Inputs and
outputs are bound by address (`IOBinding`): the KV cache's layer buffers go in without a copy and
the outputs land in tensors allocated here.
"""
from __future__ import annotations

from pathlib import Path

import torch

INSTALL_HINT = "onnxruntime is not installed: `pip install onnxruntime` (or onnxruntime-gpu for CUDA)"

# torch dtype -> ONNX TensorProto element type (IOBinding takes the integer for every type)
_ONNX_TYPES = {torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.int32: 6, torch.int64: 7, torch.bool: 9,
               torch.float16: 10, torch.float64: 11, torch.bfloat16: 16}


def import_onnxruntime():
    from sdvg.engines.dependencies import import_optional

    return import_optional("onnxruntime", INSTALL_HINT)


def providers_for(device: torch.device) -> list[str]:
    """The execution providers of an engine on `device`: CUDA's on a CUDA device, else the CPU's."""
    ort = import_onnxruntime()
    device = torch.device(device)
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise RuntimeError(f"the engine runs on {device} but this onnxruntime has no CUDA execution provider "
                               f"(providers: {', '.join(ort.get_available_providers())}); install onnxruntime-gpu, "
                               "or run the pipeline on the CPU (--device cpu) with engines built for it")
        return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    if device.type != "cpu":
        raise RuntimeError(f"backend 'onnxruntime' runs engines on cpu or cuda devices, not {device}")
    return ["CPUExecutionProvider"]


class ORTEngine:
    """An ONNX engine called like the module it was exported from (positional inputs in the
    signature's order; inputs the exporter dropped as unused are skipped). Returns the outputs (a
    tuple when there are several) as torch tensors on the engine's device."""

    def __init__(self, path: Path, signature, device: torch.device, threads: int | None = None):
        ort = import_onnxruntime()
        self.signature = signature
        self.device = torch.device(device)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        providers = providers_for(self.device)
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=providers)
        except Exception as exc:  # onnxruntime's own exception types (InvalidGraph, Fail, ...)
            names = [p if isinstance(p, str) else p[0] for p in providers]
            dtypes = sorted({t.dtype for t in signature.inputs})
            hint = ("; onnxruntime's CPU execution provider runs fp32 graphs (this one takes "
                    f"{', '.join(dtypes)}): build with --precision fp32, or run on a GPU with onnxruntime-gpu"
                    if "CUDAExecutionProvider" not in names and set(dtypes) - {"float32", "int64"} else "")
            raise RuntimeError(f"onnxruntime cannot load engine {signature.name!r} from {path} with "
                               f"{', '.join(names)} ({type(exc).__name__}: {exc}){hint}") from exc
        graph_inputs = {i.name for i in self.session.get_inputs()}
        self.inputs = [t for t in signature.inputs if t.name in graph_inputs]
        missing = graph_inputs - {t.name for t in signature.inputs}
        if missing:
            raise RuntimeError(f"{path} takes inputs {sorted(missing)} that engine {signature.name!r} does not have; "
                               "rebuild the engine folder")
        self._all = signature.input_names
        self._where = ("cuda", self.device.index or 0) if self.device.type == "cuda" else ("cpu", 0)

    def __call__(self, *args):
        binding = self.session.io_binding()
        by_name = dict(zip(self._all, args))
        keep, sizes = [], {}
        for t in self.inputs:
            a = by_name[t.name]
            want = getattr(torch, t.dtype)
            if a.device != self.device or a.dtype != want:
                a = a.to(self.device, want)
            if not a.is_contiguous():
                a = a.contiguous()
            for d, n in zip(t.shape, a.shape):
                if isinstance(d, str):
                    sizes[d] = n
            if tuple(a.shape) != t.dims({**sizes}):
                raise ValueError(f"engine {self.signature.name!r}: input {t.name!r} must be {list(t.shape)}, got "
                                 f"{list(a.shape)}")
            keep.append(a)
            binding.bind_input(t.name, *self._where, _ONNX_TYPES[a.dtype], tuple(a.shape), a.data_ptr())
        outs = []
        for t in self.signature.outputs:
            o = torch.empty(t.dims(sizes), dtype=getattr(torch, t.dtype), device=self.device)
            outs.append(o)
            binding.bind_output(t.name, *self._where, _ONNX_TYPES[o.dtype], tuple(o.shape), o.data_ptr())
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the inputs are written on torch's stream
        self.session.run_with_iobinding(binding)
        if self.device.type == "cuda":
            binding.synchronize_outputs()  # the outputs are final before torch reads them
        return tuple(outs) if len(outs) > 1 else outs[0]
