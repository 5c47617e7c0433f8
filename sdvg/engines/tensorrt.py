"""TensorRT 11 engine runtime (optional extra: `pip install 'sdvg[tensorrt]'`); engines are built by
`python -m build_engines`.

The runtime binds every I/O tensor with `set_tensor_address` (the KV cache's layer buffers by
address, no copy), selects the optimisation profile that holds a cached DiT engine's shapes and sets
them per call, runs with `execute_async_v3` on the caller's current CUDA stream (the scheduler's
role stream) — never on the legacy default stream: called there, it runs on a stream of its own,
ordered after and before it by events. The cuda-python executor (`trt_cuda`) adds stream-ordered
engine memory and CUDA graphs.

A plan is streamed from its file into TensorRT (`PlanReader`, an `IStreamReaderV2`: at most
READ_CHUNK_BYTES of it on the host at a time). Execution contexts are `USER_MANAGED`: their scratch
memory is one buffer per role (`sdvg.engines.scratch`), shared by the role's contexts (they run
one after another on the role's stream), sized by `update_device_memory_size_for_shapes()` for
the shapes set (0 there is TensorRT's error value: refused).
"""
from __future__ import annotations

from pathlib import Path

import torch

INSTALL_HINT = ("TensorRT is not installed: install the optional extra with `pip install 'sdvg[tensorrt]'` "
                "(TensorRT 11 for CUDA 13 and cuda-python) on a machine with an NVIDIA GPU")


def import_tensorrt():
    from sdvg.engines.dependencies import import_optional

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


READ_CHUNK_BYTES = 64 << 20  # what PlanReader hands TensorRT per read


def plan_reader(trt, file):
    """An `IStreamReaderV2` over an open plan file: TensorRT asks for the whole plan at once; each
    read answers with at most READ_CHUNK_BYTES (a short read is allowed), so the host never holds
    more than that of a 27 GiB plan."""

    class PlanReader(trt.IStreamReaderV2):
        def __init__(self):
            trt.IStreamReaderV2.__init__(self)

        def read(self, num_bytes: int, stream: int) -> bytes:
            return file.read(min(num_bytes, READ_CHUNK_BYTES))

        def seek(self, offset: int, where) -> bool:
            whence = {trt.SeekPosition.SET: 0, trt.SeekPosition.CUR: 1, trt.SeekPosition.END: 2}[where]
            file.seek(offset, whence)
            return True

    return PlanReader()


def deserialize_plan(trt, runtime, plan_path: Path):
    """The engine of a plan file, streamed from the file (`plan_reader`)."""
    with Path(plan_path).open("rb") as f:
        return runtime.deserialize_cuda_engine(plan_reader(trt, f))


def open_engine(plan_path: Path, signature, strategy=None):
    """(trt, runtime, engine, context, engine inputs in the signature's order, output names in the
    module's order) of a plan built for `signature`; `strategy`: the execution context's
    `trt.ExecutionContextAllocationStrategy` (default: TensorRT's own allocation)."""
    trt = import_tensorrt()
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = deserialize_plan(trt, runtime, plan_path)
    if engine is None:
        raise RuntimeError(f"TensorRT could not deserialise {plan_path} (built for another TensorRT or GPU?)")
    context = engine.create_execution_context() if strategy is None else engine.create_execution_context(strategy)
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = {n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
    outputs = {n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT}
    if outputs != set(signature.output_names):
        raise RuntimeError(f"engine {plan_path} has outputs {sorted(outputs)}, its signature {signature.name!r} "
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


def dynamic_sizes(signature, feeds: dict[str, torch.Tensor]) -> dict[str, int]:
    """The value of each dynamic dimension of the signature in this call's inputs."""
    sizes = {}
    for t in signature.inputs:
        a = feeds.get(t.name)
        if a is None:
            continue
        for d, n in zip(t.shape, a.shape):
            if isinstance(d, str):
                sizes.setdefault(d, int(n))
    return sizes


def select_profile(context, signature, feeds, current: int, stream: int) -> int:
    """Switch `context` to the first optimisation profile holding this call's dynamic sizes (when it is
    not the current one, stream-ordered on `stream`); the profile's index."""
    if not signature.dynamic or len(signature.profile_bounds()) < 2:
        return 0
    index = signature.profile_for(dynamic_sizes(signature, feeds))
    if index != current and not context.set_optimization_profile_async(index, stream):
        raise RuntimeError(f"TensorRT could not select optimisation profile {index} of engine {signature.name!r}")
    return index


def scratch_bytes(engine, context, signature) -> int:
    """Scratch memory the context needs for the shapes set now: `update_device_memory_size_for_shapes()`
    for a dynamic engine (0 is TensorRT's error value: the shapes are not all set or invalid), the
    engine's `device_memory_size_v2` for a static one."""
    if not signature.dynamic:
        return int(engine.device_memory_size_v2)
    need = int(context.update_device_memory_size_for_shapes())
    if need == 0:
        raise RuntimeError(f"engine {signature.name!r}: update_device_memory_size_for_shapes() returned 0 (TensorRT's "
                           "error value: an input shape is not set or lies outside the selected profile); the engine "
                           "cannot run with these shapes")
    return need


def set_input_shapes(engine, context, feeds: dict[str, torch.Tensor]) -> None:
    for n, t in feeds.items():
        if not context.set_input_shape(n, tuple(t.shape)):
            raise ValueError(f"engine input {n!r}: shape {list(t.shape)} is outside the engine's profile "
                             f"({list(engine.get_tensor_shape(n))}); rebuild the engines with a larger --num-blocks")


LEGACY_DEFAULT_STREAM = 0  # cudaStreamLegacy's handle: torch's default stream when none is set


class TRTEngine:
    """A deserialised engine called like the engine module it was built from (positional inputs in the
    signature's order), on torch's current stream with outputs from torch's allocator (a stream of
    its own when torch's current stream is the legacy default one). Dynamic dimensions (a cached DiT
    engine's visible and cache tokens) select their profile and are set per call; outputs are
    allocated per call; the scratch memory is the role's shared buffer (`scratch`, default: one of
    its own). Stream-ordered engine memory and CUDA graphs: `trt_cuda.TRTCudaEngine`."""

    def __init__(self, plan_path: Path, signature, device: torch.device, scratch=None):
        from sdvg.engines.scratch import TorchScratch

        self.signature = signature
        self.device = torch.device(device)
        trt = import_tensorrt()
        self.trt, self.runtime, self.engine, self.context, self.inputs, self.outputs = open_engine(
            plan_path, signature, trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        self.scratch = scratch if scratch is not None else TorchScratch(self.device, signature.name)
        self._profile = 0
        self._side = None  # the stream used when torch's current one is the legacy default stream

    def _stream(self):
        """(stream to enqueue on, torch's current stream)."""
        current = torch.cuda.current_stream(self.device)
        if current.cuda_stream != LEGACY_DEFAULT_STREAM:
            return current, current
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side, current

    def __call__(self, *args):
        feeds = engine_feeds(self.trt, self.engine, self.inputs, self.signature, args, self.device)
        stream, current = self._stream()
        if stream is not current:
            stream.wait_stream(current)  # the inputs were written on torch's stream
        self._profile = select_profile(self.context, self.signature, feeds, self._profile, stream.cuda_stream)
        set_input_shapes(self.engine, self.context, feeds)
        for n, t in feeds.items():
            self.context.set_tensor_address(n, t.data_ptr())
        outs = []
        for n in self.outputs:
            o = torch.empty(tuple(self.context.get_tensor_shape(n)),
                            dtype=_torch_dtype(self.trt, self.engine.get_tensor_dtype(n)), device=self.device)
            self.context.set_tensor_address(n, o.data_ptr())
            outs.append(o)
        self.scratch.bind(self.context, scratch_bytes(self.engine, self.context, self.signature), stream)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT execute_async_v3 failed for engine {self.signature.name!r}")
        if stream is not current:
            current.wait_stream(stream)
            for t in (*feeds.values(), *outs):  # used on the side stream: not reused before it is done
                t.record_stream(stream)
        return tuple(outs) if len(outs) > 1 else outs[0]
