"""ONNX export of the stages (dynamo exporter) and onnxruntime verification against eager."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from sdvg.engines.signatures import StageSpec

# Max |onnxruntime - eager| / max(1, max |eager|) accepted by --verify, per precision.
VERIFY_TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}


def export_onnx(stage: StageSpec, path: Path) -> Path:
    """torch.onnx.export with the dynamo exporter (the TorchScript exporter fails on rms_norm), the
    signature's dynamic dimensions kept dynamic. Weights past 2 GB go to `<path>.data` beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in (path, Path(str(path) + ".data")):
        old.unlink(missing_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        # every layer buffer shares the cache_tokens dimension; the exporter says so once per buffer
        warnings.filterwarnings("ignore", message=".*shares the same shape constraints.*")
        program = torch.onnx.export(stage.module, stage.inputs, dynamo=True, input_names=stage.input_names,
                                    output_names=stage.output_names, dynamic_shapes=stage.signature.dynamic_shapes(),
                                    optimize=True, verbose=False)
    program.save(str(path))
    return path


def eager_outputs(module, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        out = module(*inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def verify_onnx(stage: StageSpec, path: Path) -> float:
    """Max |onnxruntime - eager| / max(1, max |eager|) over all outputs, at the example inputs and,
    for a stage with dynamic dimensions, at their lower bounds: on the stage's CUDA device where
    onnxruntime has the CUDA execution provider, else on the CPU one (which runs fp32 graphs only)."""
    from sdvg.engines.onnxruntime import ORTStage, import_onnxruntime

    device = stage.device
    if device.type == "cuda" and "CUDAExecutionProvider" not in import_onnxruntime().get_available_providers():
        device = torch.device("cpu")
    run = ORTStage(path, stage.signature, device)
    cases = [stage.inputs]
    if stage.signature.dynamic:
        cases.append(stage.signature.example_inputs(stage.device, seed=1, which="min"))
    err = 0.0
    for inputs in cases:
        got = run(*inputs)
        got = list(got) if isinstance(got, tuple) else [got]
        for g, w in zip(got, eager_outputs(stage.module, inputs)):
            w = w.detach().float().cpu()
            err = max(err, float((g.float() - w).abs().max()) / max(1.0, float(w.abs().max())))
    return err
