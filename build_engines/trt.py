"""TensorRT 11 engine build (optional extra: `pip install 'sdvg[tensorrt]'`).

Networks are strongly typed (TensorRT 11 has no FP16/INT8 builder flags): the precision of an
engine is the precision of the exported graph. A stage with dynamic dimensions (a cached DiT
stage's visible and cache tokens) gets one optimisation profile over their bounds. The runtime
lives in `sdvg.engines.tensorrt`.
"""
from __future__ import annotations

from pathlib import Path

from sdvg.engines.tensorrt import import_tensorrt


def build_engine(onnx_path: Path, plan_path: Path, signature=None, timing_cache: Path | None = None,
                 workspace_gib: float = 8.0) -> Path:
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
    if signature is not None and signature.dynamic:
        profile = builder.create_optimization_profile()
        graph_inputs = {network.get_input(i).name for i in range(network.num_inputs)}
        bounds = [signature.sizes(w) for w in ("min", "opt", "max")]
        for t in signature.inputs:
            if t.name in graph_inputs and any(isinstance(d, str) for d in t.shape):
                profile.set_shape(t.name, *(t.dims(b) for b in bounds))
        config.add_optimization_profile(profile)
    cache = None
    if timing_cache is not None:
        blob = timing_cache.read_bytes() if timing_cache.is_file() else b""
        cache = config.create_timing_cache(blob)
        config.set_timing_cache(cache, ignore_mismatch=False)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path} (see the log above)")
    plan_path.write_bytes(bytes(plan))
    if cache is not None:
        timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    return plan_path
