"""ONNX export of the stages (dynamo exporter) and onnxruntime verification against eager."""
from __future__ import annotations

from pathlib import Path

import torch

from sdvg.engines.signatures import StageSpec

# Max |onnxruntime - eager| / max(1, max |eager|) accepted by --verify, per precision.
VERIFY_TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}


def export_onnx(stage: StageSpec, path: Path) -> Path:
    """torch.onnx.export with the dynamo exporter (the TorchScript exporter fails on rms_norm)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        program = torch.onnx.export(stage.module, stage.inputs, dynamo=True, input_names=stage.input_names,
                                    output_names=stage.output_names, optimize=True, verbose=False)
    program.save(str(path))
    return path


def eager_outputs(stage: StageSpec) -> list[torch.Tensor]:
    with torch.no_grad():
        out = stage.module(*stage.inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def verify_onnx(stage: StageSpec, path: Path) -> float:
    """Max |onnxruntime - eager| / max(1, max |eager|) over all outputs."""
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {}
    names = {i.name for i in sess.get_inputs()}
    for n, t in zip(stage.input_names, stage.inputs):
        if n in names:  # inputs the graph folded away (unused) are not fed
            feeds[n] = t.detach().cpu().float().numpy() if t.dtype == torch.bfloat16 else t.detach().cpu().numpy()
    got = sess.run(None, feeds)
    want = eager_outputs(stage)
    err = 0.0
    for g, w in zip(got, want):
        w = w.detach().float().cpu().numpy()
        err = max(err, float(np.abs(g.astype(np.float32) - w).max() / max(1.0, float(np.abs(w).max()))))
    return err

