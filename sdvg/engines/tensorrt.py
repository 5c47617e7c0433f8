"""TensorRT 11 engine runtime (optional extra: `pip install 'sdvg[tensorrt]'`); engines are built by
`python -m build_engines`.

The runtime binds every I/O tensor with `set_tensor_address` (the KV cache's layer buffers by
address, no copy), sets the dynamic input shapes of a cached DiT stage per call, runs with
`execute_async_v3` on the caller's current CUDA stream (the scheduler's role stream) and can
capture a static-shape launch in a CUDA graph.
"""
from __future__ import annotations

from pathlib import Path

import torch

INSTALL_HINT = ("TensorRT is not installed: install the optional extra with `pip install 'sdvg[tensorrt]'` "
                "(TensorRT 11 for CUDA 13 and torch-tensorrt) on a machine with an NVIDIA GPU")


def import_tensorrt():
    try:
        import tensorrt as trt  # noqa: F401
    except Exception as exc:  # ImportError, or a placeholder wheel that fails on import
        raise RuntimeError(f"{INSTALL_HINT} ({type(exc).__name__}: {exc})") from exc
    return trt


def trt_version() -> str:
    try:
        import tensorrt as trt

        return trt.__version__
    except Exception:
        return "none"


_TORCH_DTYPES = {}


def _torch_dtype(trt, dt):
    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update({trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                              trt.int32: torch.int32, trt.int64: torch.int64, trt.bool: torch.bool,
                              trt.int8: torch.int8})
    return _TORCH_DTYPES[dt]


class TRTStage:
    """A deserialised engine called like the stage module it was built from (positional inputs in the
    signature's order). Dynamic dimensions (a cached DiT stage's visible and cache tokens) are set
    per call; outputs are allocated per call. `cuda_graph` captures the launch (static-shape
    engines only)."""

    def __init__(self, plan_path: Path, signature, device: torch.device, cuda_graph: bool = False):
        trt = import_tensorrt()
        self.trt = trt
        self.signature = signature
        self.device = torch.device(device)
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(Path(plan_path).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialise {plan_path} (built for another TensorRT or GPU?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = {n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
        self.inputs = [t for t in signature.inputs if t.name in inputs]  # exporters may drop unused inputs
        outputs = {n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT}
        if outputs != set(signature.output_names):
            raise RuntimeError(f"engine {plan_path} has outputs {sorted(outputs)}, stage {signature.name!r} "
                               f"{signature.output_names}; rebuild the engine folder")
        self.outputs = list(signature.output_names)  # in the module's order
        if cuda_graph and signature.dynamic:
            raise ValueError(f"stage {signature.name!r} has dynamic dimensions; CUDA graphs need static shapes")
        self.cuda_graph = cuda_graph
        self._graph = None
        self._static_in: dict[str, torch.Tensor] = {}
        self._static_out: dict[str, torch.Tensor] = {}

    def _bind(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for n, t in feeds.items():
            if not self.context.set_input_shape(n, tuple(t.shape)):
                raise ValueError(f"engine input {n!r}: shape {list(t.shape)} is outside the engine's profile "
                                 f"({list(self.engine.get_tensor_shape(n))}); rebuild the engines with a larger "
                                 "--num-blocks")
            self.context.set_tensor_address(n, t.data_ptr())
        outs = {}
        for n in self.outputs:
            outs[n] = torch.empty(tuple(self.context.get_tensor_shape(n)),
                                  dtype=_torch_dtype(self.trt, self.engine.get_tensor_dtype(n)), device=self.device)
            self.context.set_tensor_address(n, outs[n].data_ptr())
        return outs

    def __call__(self, *args):
        by_name = dict(zip(self.signature.input_names, args))
        feeds = {}
        for t in self.inputs:
            a = by_name[t.name]
            want = _torch_dtype(self.trt, self.engine.get_tensor_dtype(t.name))
            if a.device != self.device or a.dtype != want:
                a = a.to(self.device, want)
            feeds[t.name] = a if a.is_contiguous() else a.contiguous()
        stream = torch.cuda.current_stream(self.device)
        if not self.cuda_graph:
            outs = self._bind(feeds)
            if not self.context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed")
            result = tuple(outs[n] for n in self.outputs)
        else:
            if self._graph is None:
                self._static_in = {n: t.clone() for n, t in feeds.items()}
                self._static_out = self._bind(self._static_in)
                self.context.execute_async_v3(stream.cuda_stream)  # warm-up outside the capture
                self._graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self._graph, stream=stream):
                    self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream)
            for n, t in feeds.items():
                self._static_in[n].copy_(t, non_blocking=True)
            self._graph.replay()
            result = tuple(self._static_out[n].clone() for n in self.outputs)
        return result if len(result) > 1 else result[0]
