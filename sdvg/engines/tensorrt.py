"""TensorRT 11 engine runtime (optional extra: `pip install 'sdvg[tensorrt]'`); engines are built by
`python -m build_engines`.

The runtime binds every I/O tensor with
`set_tensor_address`, runs with `execute_async_v3` on the caller's current CUDA stream (the
scheduler's role stream) and can capture the static-shape launch in a CUDA graph.
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
    """A deserialised engine called like the stage module it was built from (positional inputs in
    the exported order). Outputs are preallocated and returned as fresh tensors per call."""

    def __init__(self, plan_path: Path, device: torch.device, input_names: list[str], cuda_graph: bool = False):
        trt = import_tensorrt()
        self.trt = trt
        self.device = torch.device(device)
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(Path(plan_path).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialise {plan_path} (built for another TensorRT or GPU?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.input_names = [n for n in input_names if n in self.inputs]  # exporters may drop unused inputs
        self.all_input_names = list(input_names)
        self.cuda_graph = cuda_graph
        self._graph = None
        self._static_in: dict[str, torch.Tensor] = {}
        self._out = {n: torch.empty(tuple(self.engine.get_tensor_shape(n)),
                                    dtype=_torch_dtype(trt, self.engine.get_tensor_dtype(n)), device=self.device)
                     for n in self.outputs}

    def _bind(self, feeds: dict[str, torch.Tensor]) -> None:
        for n, t in feeds.items():
            want = tuple(self.engine.get_tensor_shape(n))
            if tuple(t.shape) != want:
                raise ValueError(f"engine input {n!r} expects shape {list(want)}, got {list(t.shape)}")
            self.context.set_tensor_address(n, t.data_ptr())
        for n, t in self._out.items():
            self.context.set_tensor_address(n, t.data_ptr())

    def __call__(self, *args):
        dtypes = {n: _torch_dtype(self.trt, self.engine.get_tensor_dtype(n)) for n in self.inputs}
        feeds = {n: a.to(self.device, dtypes[n]).contiguous() for n, a in zip(self.all_input_names, args)
                 if n in self.inputs}
        stream = torch.cuda.current_stream(self.device)
        if not self.cuda_graph:
            self._bind(feeds)
            if not self.context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed")
        else:
            if self._graph is None:
                self._static_in = {n: t.clone() for n, t in feeds.items()}
                self._bind(self._static_in)
                self.context.execute_async_v3(stream.cuda_stream)  # warm-up outside the capture
                self._graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self._graph, stream=stream):
                    self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream)
            for n, t in feeds.items():
                self._static_in[n].copy_(t, non_blocking=True)
            self._graph.replay()
        outs = tuple(self._out[n].clone() for n in self.outputs)
        return outs if len(outs) > 1 else outs[0]
