"""TensorRT executor on cuda-python (`cuda.bindings.runtime`, the `tensorrt` extra): what torch's
stream and allocator do not give.

* Stream-ordered engine memory: the execution context is created `USER_MANAGED`; its scratch memory
  (`engine.device_memory_size_v2`, or `context.update_device_memory_size_for_shapes()` for the
  shapes of a dynamic engine; 0 there is refused) is the role's `scratch.CudaScratch`: one buffer
  from `cudaMallocAsync` on the role's stream, shared by the role's executors, grown when a larger
  shape needs more, freed with `cudaFreeAsync` when its owner closes it (an executor opened without
  one owns a private one).
* The role's non-blocking stream (the scratch's), ordered after torch's current stream (the
  scheduler's role stream) by an event before every launch, and torch's stream after it by an
  event after.
* A CUDA graph of the engine call (`cuda_graph=True`, static-shape engines only; a dynamic engine is
  refused): captured on that stream with `cudaStreamBeginCapture` / `cudaStreamEndCapture` /
  `cudaGraphInstantiate`, bound to static input and output buffers allocated once, replayed with
  `cudaGraphLaunch`. Each call copies its inputs into the static input buffers (skipped when an
  input already is that buffer) and returns **views of the static output buffers: valid until the
  executor's next call**; a caller that keeps an output past that copies it. Nothing is cloned.

Without a graph, `out={name: tensor}` binds outputs straight to caller-provided destinations (by
address, no copy); the other outputs are allocated by torch on its current stream.

Every cudart call's status is checked (`check`): a failure raises `CudaError` naming the call and
CUDA's error. Not runnable on any machine available to this project (no TensorRT); the tests that
need it are marked `tensorrt`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from sdvg.engines.dependencies import require_cuda
from sdvg.engines.scratch import CudaScratch
from sdvg.engines.tensorrt import (_torch_dtype, engine_feeds, import_tensorrt, open_engine, scratch_bytes,
                                   select_profile, set_input_shapes)

INSTALL_HINT = ("cuda-python is not installed: install the optional extra with `pip install 'sdvg[tensorrt]'` "
                "(cuda-python 13, with TensorRT 11 for CUDA 13) on a machine with an NVIDIA GPU")


class CudaError(RuntimeError):
    """A CUDA runtime call made through cuda-python failed."""


def import_cuda_python():
    """cuda-python's runtime API module (`cuda.bindings.runtime`), or the install message."""
    from sdvg.engines.dependencies import import_optional

    return import_optional("cuda.bindings.runtime", INSTALL_HINT)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def check(cudart, result, call: str):
    """The values a cuda-python call returns after its status (`(err, *values)`): None, one value or a
    tuple; raises `CudaError` naming `call` and CUDA's error name and text when `err` is not success."""
    err, *values = result
    if err != cudart.cudaError_t.cudaSuccess:
        _, name = cudart.cudaGetErrorName(err)
        _, text = cudart.cudaGetErrorString(err)
        raise CudaError(f"{call} failed: {_text(name)} ({_text(text)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class TRTCudaEngine:
    """A TensorRT plan run through cuda-python (see the module docstring); called like the engine
    module it was built from, positional inputs in the signature's order."""

    def __init__(self, plan_path: Path, signature, device, cuda_graph: bool = False,
                 scratch: CudaScratch | None = None):
        self.signature = signature
        self.device = require_cuda(device, "the cuda-python TensorRT executor")
        if cuda_graph and signature.dynamic:
            dims = ", ".join(d[0] for d in signature.dynamic)
            raise ValueError(f"engine {signature.name!r} has dynamic dimensions ({dims}): a CUDA graph is captured "
                             "for one static shape; run it without cuda_graph")
        self.cuda_graph = cuda_graph
        self.cudart = cudart = import_cuda_python()
        trt = import_tensorrt()
        self.trt, self.runtime, self.engine, self.context, self.inputs, self.outputs = open_engine(
            plan_path, signature, trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        with torch.cuda.device(self.device):
            self._owns_scratch = scratch is None
            self.scratch = scratch if scratch is not None else CudaScratch(cudart, check, signature.name)
            self.stream = self.scratch.stream
            self._ready = self._cuda(cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming),
                                     "cudaEventCreateWithFlags")
            self._done = self._cuda(cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming),
                                    "cudaEventCreateWithFlags")
        self._profile = 0
        self._graph = self._graph_exec = None
        self._static_in: dict[str, torch.Tensor] = {}
        self._static_out: dict[str, torch.Tensor] = {}

    def _cuda(self, result, call: str):
        return check(self.cudart, result, call)

    # ------------------------------------------------------------------ streams and memory
    def _after_torch(self) -> None:
        """This stream waits for the work torch queued so far (the inputs are written there)."""
        cudart = self.cudart
        self._cuda(cudart.cudaEventRecord(self._ready, torch.cuda.current_stream(self.device).cuda_stream),
                   "cudaEventRecord")
        self._cuda(cudart.cudaStreamWaitEvent(self.stream, self._ready, 0), "cudaStreamWaitEvent")

    def _before_torch(self) -> None:
        """Torch's stream waits for the engine (its reads of the outputs, its frees of the inputs)."""
        cudart = self.cudart
        self._cuda(cudart.cudaEventRecord(self._done, self.stream), "cudaEventRecord")
        self._cuda(cudart.cudaStreamWaitEvent(torch.cuda.current_stream(self.device).cuda_stream, self._done, 0),
                   "cudaStreamWaitEvent")

    def _ensure_memory(self) -> None:
        """The role's scratch memory for the shapes set now, bound to this context (grown, never shrunk)."""
        self.scratch.bind(self.context, scratch_bytes(self.engine, self.context, self.signature))

    def _launch(self) -> None:
        if not self.context.execute_async_v3(int(self.stream)):
            raise RuntimeError(f"TensorRT execute_async_v3 failed for engine {self.signature.name!r}")

    # ------------------------------------------------------------------ calls
    def __call__(self, *args, out: dict[str, torch.Tensor] | None = None):
        feeds = engine_feeds(self.trt, self.engine, self.inputs, self.signature, args, self.device)
        with torch.cuda.device(self.device):
            if self.cuda_graph:
                if out:
                    raise ValueError("a CUDA-graph engine writes its static output buffers; copy from the returned "
                                     "views instead of passing out=")
                return self._replay(feeds)
            return self._run(feeds, out or {})

    def _run(self, feeds, out):
        self._profile = select_profile(self.context, self.signature, feeds, self._profile, int(self.stream))
        set_input_shapes(self.engine, self.context, feeds)
        for n, t in feeds.items():
            self.context.set_tensor_address(n, t.data_ptr())
        outs = []
        for n in self.outputs:
            shape = tuple(self.context.get_tensor_shape(n))
            dtype = _torch_dtype(self.trt, self.engine.get_tensor_dtype(n))
            o = out.get(n)
            if o is None:
                o = torch.empty(shape, dtype=dtype, device=self.device)
            elif tuple(o.shape) != shape or o.dtype != dtype or o.device != self.device or not o.is_contiguous():
                raise ValueError(f"out[{n!r}] must be a contiguous {dtype} tensor {list(shape)} on {self.device}, "
                                 f"got {o.dtype} {list(o.shape)} on {o.device}")
            self.context.set_tensor_address(n, o.data_ptr())
            outs.append(o)
        self._ensure_memory()
        self._after_torch()
        self._launch()
        self._before_torch()
        return tuple(outs) if len(outs) > 1 else outs[0]

    def capture(self) -> None:
        """Allocate the static buffers (the signature's shapes), bind them, run the engine once (TensorRT
        finishes its deferred set-up outside a capture) and capture one launch in a CUDA graph."""
        if not self.cuda_graph:
            raise ValueError(f"engine {self.signature.name!r} was opened without cuda_graph")
        if self._graph_exec is not None:
            return
        cudart = self.cudart
        with torch.cuda.device(self.device):
            for t in self.inputs:  # [static shape of the signature]
                buf = torch.zeros(t.dims({}), dtype=_torch_dtype(self.trt, self.engine.get_tensor_dtype(t.name)),
                                  device=self.device)
                self._static_in[t.name] = buf
            set_input_shapes(self.engine, self.context, self._static_in)
            for n, buf in self._static_in.items():
                self.context.set_tensor_address(n, buf.data_ptr())
            for n in self.outputs:
                buf = torch.empty(tuple(self.context.get_tensor_shape(n)),
                                  dtype=_torch_dtype(self.trt, self.engine.get_tensor_dtype(n)), device=self.device)
                self._static_out[n] = buf
                self.context.set_tensor_address(n, buf.data_ptr())
            self._ensure_memory()
            self._after_torch()
            self._launch()  # warm-up, outside the capture
            self._cuda(cudart.cudaStreamBeginCapture(self.stream,
                                                     cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
                       "cudaStreamBeginCapture")
            try:
                self._launch()
            finally:  # end the capture whatever happened, so the stream stays usable
                graph = self._cuda(cudart.cudaStreamEndCapture(self.stream), "cudaStreamEndCapture")
            self._graph = graph
            self._graph_exec = self._cuda(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
            self._before_torch()

    def _replay(self, feeds):
        self.capture()
        for n, t in feeds.items():  # on torch's stream, before the launch waits for it
            buf = self._static_in[n]
            if tuple(t.shape) != tuple(buf.shape):
                raise ValueError(f"engine {self.signature.name!r}: input {n!r} must be {list(buf.shape)} (the "
                                 f"captured shape), got {list(t.shape)}")
            if t.data_ptr() != buf.data_ptr():
                buf.copy_(t, non_blocking=True)
        self._after_torch()
        self._cuda(self.cudart.cudaGraphLaunch(self._graph_exec, self.stream), "cudaGraphLaunch")
        self._before_torch()
        outs = tuple(self._static_out[n] for n in self.outputs)  # views: valid until the next call
        return outs if len(outs) > 1 else outs[0]

    def close(self) -> None:
        """Destroy the graph, wait for the stream, free the scratch memory and the stream when this
        executor owns them."""
        cudart = getattr(self, "cudart", None)
        if cudart is None or getattr(self, "stream", None) is None:
            return
        with torch.cuda.device(self.device):
            if self._graph_exec is not None:
                self._cuda(cudart.cudaGraphExecDestroy(self._graph_exec), "cudaGraphExecDestroy")
                self._cuda(cudart.cudaGraphDestroy(self._graph), "cudaGraphDestroy")
                self._graph = self._graph_exec = None
            self._cuda(cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
            for ev in (self._ready, self._done):
                self._cuda(cudart.cudaEventDestroy(ev), "cudaEventDestroy")
            if self._owns_scratch:  # a shared one is closed by its owner (StageRunners)
                self.scratch.close()
            self.stream = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
