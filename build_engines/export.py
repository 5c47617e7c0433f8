"""ONNX export of the engine modules (dynamo exporter) and onnxruntime verification against eager."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from sdvg.engines.signatures import EngineSpec

# Max |onnxruntime - eager| / max(1, max |eager|) accepted by --verify, per precision.
VERIFY_TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}

# Opset 23 has the `Attention` operator: each scaled_dot_product_attention exports as one node
# (TensorRT's ONNX parser imports it as one fused attention layer) instead of MatMul/Softmax/MatMul
# with the [S, S_k] scores between them. ONNX declares it from onnx 1.18; onnxruntime runs it on
# the CPU from 1.23 (checked here with onnx 1.23.2 / onnxruntime 1.32.0). Older libraries get
# FALLBACK_OPSET (the decomposed attention; what torch's exporter wrote before).
ATTENTION_OPSET, FALLBACK_OPSET = 23, 18
ORT_ATTENTION_VERSION = (1, 23)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("+")[0].split("."):
        digits = "".join(c for c in p if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def export_opset() -> tuple[int, str]:
    """(opset to export with, why): ATTENTION_OPSET when the installed onnx defines `Attention`-23
    and onnxruntime (when installed: --verify and the onnxruntime backend run the file) is at least
    ORT_ATTENTION_VERSION; FALLBACK_OPSET otherwise, the reason naming the versions."""
    import onnx

    try:
        onnx.defs.get_schema("Attention", ATTENTION_OPSET, "")
    except Exception:
        return FALLBACK_OPSET, (f"onnx {onnx.__version__} has no Attention-{ATTENTION_OPSET} (onnx >= 1.18 has): "
                                f"opset {FALLBACK_OPSET}, attention decomposed")
    try:
        import onnxruntime
    except Exception:
        return ATTENTION_OPSET, f"onnx {onnx.__version__}, no onnxruntime"
    if _version(onnxruntime.__version__) < ORT_ATTENTION_VERSION:
        return FALLBACK_OPSET, (f"onnxruntime {onnxruntime.__version__} cannot run Attention-{ATTENTION_OPSET} "
                                f"(onnxruntime >= {'.'.join(map(str, ORT_ATTENTION_VERSION))} can): opset "
                                f"{FALLBACK_OPSET}, attention decomposed")
    return ATTENTION_OPSET, f"onnx {onnx.__version__}, onnxruntime {onnxruntime.__version__}"


def export_onnx(engine: EngineSpec, path: Path, opset: int | None = None) -> Path:
    """torch.onnx.export with the dynamo exporter (the TorchScript exporter fails on rms_norm), the
    signature's dynamic dimensions kept dynamic, at `opset` (default `export_opset()`: 23, one
    `Attention` node per attention). Weights past 2 GB go to `<path>.data` beside it."""
    opset = export_opset()[0] if opset is None else opset
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in (path, Path(str(path) + ".data")):
        old.unlink(missing_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        # every layer buffer shares the cache_tokens dimension; the exporter says so once per buffer
        warnings.filterwarnings("ignore", message=".*shares the same shape constraints.*")
        program = torch.onnx.export(engine.module, engine.inputs, dynamo=True, input_names=engine.input_names,
                                    output_names=engine.output_names, dynamic_shapes=engine.signature.dynamic_shapes(),
                                    opset_version=opset, optimize=True, verbose=False)
    program.save(str(path))
    del program  # the exported program holds host copies of initializers
    return path


def eager_outputs(module, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        out = module(*inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def verify_onnx(engine: EngineSpec, path: Path) -> float:
    """Max |onnxruntime - eager| / max(1, max |eager|) over all outputs, at the example inputs and,
    for an engine with dynamic dimensions, at their lower bounds: on the engine's CUDA device where
    onnxruntime has the CUDA execution provider, else on the CPU one (which runs fp32 graphs only)."""
    from sdvg.engines.onnxruntime import ORTEngine, import_onnxruntime

    device = engine.device
    if device.type == "cuda" and "CUDAExecutionProvider" not in import_onnxruntime().get_available_providers():
        device = torch.device("cpu")
    run = ORTEngine(path, engine.signature, device)
    cases = [engine.inputs]
    if engine.signature.dynamic:
        cases.append(engine.signature.example_inputs(engine.device, seed=1, which="min"))
    err = 0.0
    for inputs in cases:
        got = run(*inputs)
        got = list(got) if isinstance(got, tuple) else [got]
        for g, w in zip(got, eager_outputs(engine.module, inputs)):
            w = w.detach().float().cpu()
            err = max(err, float((g.float() - w).abs().max()) / max(1.0, float(w.abs().max())))
    return err
