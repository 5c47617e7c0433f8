"""What an engine executor needs from its surroundings: an optional library imported with its install message,
and a CUDA device checked by name. The executors (onnxruntime, tensorrt, trt_cuda, torch_trt) import these, and
`executor.open_executor` imports the executors, so neither depends on the other."""
from __future__ import annotations

import torch


def import_optional(module: str, install_hint: str):
    """The optional library `module` (a dotted name gives the submodule), or a RuntimeError with the
    install message: an ImportError, a placeholder wheel that fails on import, or bindings built for
    another CUDA all end there. Goes through `__import__`, so a test may block it."""
    try:
        return __import__(module, fromlist=["__name__"])
    except Exception as exc:
        raise RuntimeError(f"{install_hint} ({type(exc).__name__}: {exc})") from exc


def require_cuda(device, what: str) -> torch.device:
    """`device` as a torch.device, or a ValueError naming `what` when it is not a CUDA device."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{what} runs on CUDA devices, not {device}; run the pipeline on a GPU (--device cuda:0) "
                         "or use --backend onnxruntime on the CPU")
    return device
