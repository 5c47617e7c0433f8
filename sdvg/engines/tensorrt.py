"""TensorRT 11 engine runtime (optional extra: `pip install 'sdvg[tensorrt]'`); engines are built by
`python -m build_engines`.

The runtime binds every I/O tensor with `set_tensor_address` (the KV cache's layer buffers by
address, no copy), sets the dynamic input shapes of a cached DiT stage per call, runs with
`execute_async_v3` on the caller's current CUDA stream (the scheduler's role stream). The
cuda-python executor (`trt_cuda`) adds stream-ordered engine memory and CUDA graphs.
"""
from __future__ import annotations

from pathlib import Path

import torch

INSTALL_HINT = ("TensorRT is not installed: install the optional extra with `pip install 'sdvg[tensorrt]'` "
                "(TensorRT 11 for CUDA 13 and cuda-python) on a machine with an NVIDIA GPU")


def import_tensorrt():
    from sdvg.engines.executor import import_optional

    return import_optional("tensorrt", INSTALL_HINT)


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


def open_engine(plan_path: Path, signature, strategy=None):
    """(trt, runtime, engine, context, engine inputs in the signature's order, output names in the
    module's order) of a plan built for `signature`; `strategy`: the execution context's
    `trt.ExecutionContextAllocationStrategy` (default: TensorRT's own allocation)."""
    trt = import_tensorrt()
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(Path(plan_path).read_bytes())
    if engine is None:
        raise RuntimeError(f"TensorRT could not deserialise {plan_path} (built for another TensorRT or GPU?)")
    context = engine.create_execution_context() if strategy is None else engine.create_execution_context(strategy)
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = {n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
    outputs = {n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT}
    if outputs != set(signature.output_names):
        raise RuntimeError(f"engine {plan_path} has outputs {sorted(outputs)}, stage {signature.name!r} "
                           f"{signature.output_names}; rebuild the engine folder")
    used = [t for t in signature.inputs if t.name in inputs]  # exporters may drop unused inputs
    return trt, runtime, engine, context, used, list(signature.output_names)


def engine_feeds(trt, engine, inputs, signature, args, device) -> dict[str, torch.Tensor]:
    """The engine's inputs by name from positional `args` (the signature's order), on `device` in the
    engine's dtype and contiguous (converted only when they are not)."""
    by_name = dict(zip(signature.input_names, args))
    feeds = {}
    for t in inputs:
        a = by_name[t.name]
        want = _torch_dtype(trt, engine.get_tensor_dtype(t.name))
        if a.device != device or a.dtype != want:
            a = a.to(device, want)
        feeds[t.name] = a if a.is_contiguous() else a.contiguous()
    return feeds


def set_input_shapes(engine, context, feeds: dict[str, torch.Tensor]) -> None:
    for n, t in feeds.items():
        if not context.set_input_shape(n, tuple(t.shape)):
            raise ValueError(f"engine input {n!r}: shape {list(t.shape)} is outside the engine's profile "
                             f"({list(engine.get_tensor_shape(n))}); rebuild the engines with a larger --num-blocks")


class TRTStage:
    """A deserialised engine called like the stage module it was built from (positional inputs in the
    signature's order), on torch's current stream with outputs from torch's allocator. Dynamic
    dimensions (a cached DiT stage's visible and cache tokens) are set per call; outputs are
    allocated per call. Stream-ordered engine memory and CUDA graphs: `trt_cuda.TRTCudaStage`."""

    def __init__(self, plan_path: Path, signature, device: torch.device):
        self.signature = signature
        self.device = torch.device(device)
        self.trt, self.runtime, self.engine, self.context, self.inputs, self.outputs = open_engine(plan_path, signature)

    def __call__(self, *args):
        feeds = engine_feeds(self.trt, self.engine, self.inputs, self.signature, args, self.device)
        set_input_shapes(self.engine, self.context, feeds)
        for n, t in feeds.items():
            self.context.set_tensor_address(n, t.data_ptr())
        outs = []
        for n in self.outputs:
            o = torch.empty(tuple(self.context.get_tensor_shape(n)),
                            dtype=_torch_dtype(self.trt, self.engine.get_tensor_dtype(n)), device=self.device)
            self.context.set_tensor_address(n, o.data_ptr())
            outs.append(o)
        if not self.context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise RuntimeError(f"TensorRT execute_async_v3 failed for stage {self.signature.name!r}")
        return tuple(outs) if len(outs) > 1 else outs[0]
