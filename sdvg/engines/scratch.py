"""The scratch memory of TensorRT execution contexts: one buffer per role, shared by its contexts.

Every execution context is created `USER_MANAGED`: TensorRT allocates no activation memory of its
own. A role's engines (a drafter's block engine and its cached engine, say) run one after another on
the role's stream, so one buffer serves them all: sized for the largest need seen so far (grown,
never shrunk), rebound (`context.set_device_memory`) before every launch since a growth moves it.
`StageRunners` keeps one per role and device (`drafter`, `target`, `vae`, `reward`).

* `TorchScratch` (the `torch` runtime, `TRTEngine`): the buffer comes from torch's caching allocator
  on the stream the launch goes to, so its reuse is ordered by that stream.
* `CudaScratch` (the `cuda-python` runtime, `TRTCudaEngine`): `cudaMallocAsync` / `cudaFreeAsync` on
  the role's own non-blocking stream, which every executor of the role launches on.
"""
from __future__ import annotations

import torch


class TorchScratch:
    def __init__(self, device, role: str):
        self.device = torch.device(device)
        self.role = role
        self.buffer: torch.Tensor | None = None  # uint8 [nbytes]
        self.peak = 0  # the largest size bound: what `sdvg memory` calls the role's scratch

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def bind(self, context, need: int, stream=None) -> None:
        """Grow the buffer to `need` bytes when smaller (allocated on `stream`) and bind it to `context`."""
        if need > self.nbytes:
            self.buffer = None  # freed on the stream it was used on: reused only after that work
            if self.device.type == "cuda" and stream is not None:
                with torch.cuda.stream(stream):
                    self.buffer = torch.empty(need, dtype=torch.uint8, device=self.device)
            else:
                self.buffer = torch.empty(need, dtype=torch.uint8, device=self.device)
        self.peak = max(self.peak, need)
        if need:
            context.set_device_memory(self.buffer.data_ptr(), need)


class CudaScratch:
    """A role's stream and its stream-ordered scratch memory, through cuda-python (`check`ed calls)."""

    def __init__(self, cudart, check, role: str):
        self.cudart, self._check, self.role = cudart, check, role
        self.stream = check(cudart, cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking),
                            "cudaStreamCreateWithFlags")
        self.memory, self.nbytes, self.peak = None, 0, 0

    def bind(self, context, need: int) -> None:
        cudart = self.cudart
        if need > self.nbytes:
            if self.memory is not None:
                self._check(cudart, cudart.cudaFreeAsync(self.memory, self.stream), "cudaFreeAsync")
            self.memory = self._check(cudart, cudart.cudaMallocAsync(need, self.stream), "cudaMallocAsync")
            self.nbytes = need
        self.peak = max(self.peak, need)
        if need:
            context.set_device_memory(int(self.memory), need)

    def close(self) -> None:
        """Free the memory on the stream, wait for it, destroy the stream."""
        cudart = self.cudart
        if self.stream is None:
            return
        if self.memory is not None:
            self._check(cudart, cudart.cudaFreeAsync(self.memory, self.stream), "cudaFreeAsync")
            self.memory, self.nbytes = None, 0
        self._check(cudart, cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        self._check(cudart, cudart.cudaStreamDestroy(self.stream), "cudaStreamDestroy")
        self.stream = None
