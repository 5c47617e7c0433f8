"""The engine executor interface: what `StageRunners` (sdvg/generation/backends.py) calls, whatever
runs the engine.

An executor is built from one validated engine-cache artifact and the engine's signature
(`sdvg.engines.signatures.EngineSignature`) and provides:

* `signature`, `device` — the engine it runs and where;
* `__call__(*inputs)` — the inputs positionally in the signature's order (tensors on any device and
  dtype: converted to the engine's when they differ); returns the outputs in the signature's order,
  one tensor or a tuple of several;
* optionally `capture()` — record the engine's launch in a CUDA graph now (static shapes only).

The executors, one per artifact kind (`open_executor`):

| artifact | executor | runs with |
|---|---|---|
| `onnx` | `onnxruntime.ORTEngine` | onnxruntime (CPU or CUDA execution provider) |
| `tensorrt` | `tensorrt.TRTEngine` (runtime `torch`) | TensorRT on torch's current stream |
| `tensorrt` | `trt_cuda.TRTCudaEngine` (runtime `cuda-python`) | TensorRT on its own stream, CUDA graphs |
| `torch-tensorrt` | `torch_trt.TorchTRTEngine` | a torch-tensorrt exported program (DiT engines) |

Every import of an optional library happens when an executor is built, never when sdvg is imported.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from sdvg.options import TRT_RUNTIMES as RUNTIMES  # how a TensorRT plan is driven


@runtime_checkable
class EngineExecutor(Protocol):
    signature: object  # EngineSignature
    device: torch.device

    def __call__(self, *inputs: torch.Tensor): ...


@dataclass(frozen=True)
class ExecutorOptions:
    """How the engine executors of a `StageRunners` run.

    `runtime`: `torch` (TRTEngine) or `cuda-python` (TRTCudaEngine) for TensorRT plans.
    `cuda_graph`: capture each static-shape DiT engine without cached frames in a CUDA graph
    (cuda-python runtime only); its outputs are views of the graph's static buffers, valid until
    that engine's next call (the sampler consumes the flow and `KVCache.write` copies the new K/V
    before then). The cached DiT engine (dynamic), the VAE engine (its cache tensors are kept across
    calls) and the reward engine run without a graph.
    `release_torch_weights`: once a role's first TensorRT or torch-tensorrt DiT engine has loaded,
    the torch DiT weights the engines replace are dropped (`sdvg.engines.release`), so the model is
    resident once; the eager backend then refuses that DiT."""

    runtime: str = "torch"
    cuda_graph: bool = False
    release_torch_weights: bool = True

    def __post_init__(self):
        if self.runtime not in RUNTIMES:
            raise ValueError(f"unknown TensorRT runtime {self.runtime!r}; choose one of {', '.join(RUNTIMES)}")
        if self.cuda_graph and self.runtime != "cuda-python":
            raise ValueError("cuda_graph needs runtime='cuda-python' (the graph is captured on the executor's own "
                             "stream through cuda-python)")

    def graph_for(self, signature) -> bool:
        """Whether the engine of `signature` runs from a CUDA graph under these options."""
        return self.cuda_graph and signature.family.endswith("_dit") and not signature.dynamic


def open_executor(artifact: str, path: Path, signature, device, options: ExecutorOptions | None = None,
                  scratch=None):
    """The executor of one engine-cache artifact (see the module docstring); `scratch`: the role's
    shared TensorRT scratch memory (`sdvg.engines.scratch`, of the options' runtime)."""
    options = options or ExecutorOptions()
    if artifact == "onnx":
        from sdvg.engines.onnxruntime import ORTEngine

        return ORTEngine(path, signature, device)
    if artifact == "tensorrt":
        if options.runtime == "cuda-python":
            from sdvg.engines.trt_cuda import TRTCudaEngine

            return TRTCudaEngine(path, signature, device, cuda_graph=options.graph_for(signature), scratch=scratch)
        from sdvg.engines.tensorrt import TRTEngine

        return TRTEngine(path, signature, device, scratch=scratch)
    if artifact == "torch-tensorrt":
        from sdvg.engines.torch_trt import TorchTRTEngine

        return TorchTRTEngine(path, signature, device)
    raise ValueError(f"unknown engine artifact {artifact!r}; the artifacts are onnx, tensorrt, torch-tensorrt")
