"""TensorRT 11 engine build (optional extra: `pip install 'sdvg[tensorrt]'`).

Networks are strongly typed (TensorRT 11 has no FP16/INT8 builder flags): the precision of an
engine is the precision of the exported graph. An engine with dynamic dimensions (a cached DiT
engine's visible and cache tokens) gets one optimisation profile per context mode
(`EngineSignature.profile_bounds`: the first tuned for the shape the preset runs, e.g. a recompute
target's 4,680 visible tokens at real size; the second for the full-history context). The runtime
lives in `sdvg.engines.tensorrt`.

Disk and host memory: the ONNX file and its `.data` are deleted as soon as the parser has read
them (`delete_onnx=True`: the parser owns a copy of the weights), so an engine's ONNX file and its
plan never lie on the disk together; the plan is written from TensorRT's host buffer through a
memoryview (no second host copy).
"""
from __future__ import annotations

from pathlib import Path

from sdvg.engines.tensorrt import import_tensorrt


def onnx_files(onnx_path: Path) -> list[Path]:
    """The ONNX file and its external weights (`<file>.data`, written past 2 GB), where they exist."""
    return [p for p in (Path(onnx_path), Path(str(onnx_path) + ".data")) if p.exists()]


def delete_onnx(onnx_path: Path) -> int:
    """Delete the ONNX file and its `.data`; the bytes freed on disk."""
    freed = 0
    for p in onnx_files(onnx_path):
        freed += p.stat().st_size
        p.unlink()
    return freed


def add_profiles(trt, builder, network, config, signature) -> int:
    """One optimisation profile per `signature.profile_bounds()` (min/opt/max of every input with a
    dynamic dimension, in the order the runtime selects them by index); the number added."""
    graph_inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    count = 0
    for index in range(len(signature.profile_bounds())):
        profile = builder.create_optimization_profile()
        bounds = [signature.profile_sizes(index, w) for w in ("min", "opt", "max")]
        for t in signature.inputs:
            if t.name in graph_inputs and any(isinstance(d, str) for d in t.shape):
                profile.set_shape(t.name, *(t.dims(b) for b in bounds))
        if config.add_optimization_profile(profile) < 0:
            raise RuntimeError(f"TensorRT refused optimisation profile {index} of engine {signature.name!r} "
                               f"({signature.profile_bounds()[index]})")
        count += 1
    return count


def write_plan(plan, plan_path: Path) -> int:
    """Write TensorRT's serialized engine (an `IHostMemory`, a buffer) to `plan_path` through a
    memoryview: no `bytes(...)` copy of a plan that holds a 14B model's weights. The bytes written."""
    view = memoryview(plan)
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    with plan_path.open("wb") as f:
        f.write(view.cast("B") if view.format != "B" else view)
    return view.nbytes


def build_engine(onnx_path: Path, plan_path: Path, signature=None, timing_cache: Path | None = None,
                 workspace_gib: float = 8.0, delete_onnx_after_parse: bool = False) -> Path:
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path}: {errors}")
    if delete_onnx_after_parse:  # the parser holds the weights now: free the disk before the plan lands there
        delete_onnx(onnx_path)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
    if signature is not None and signature.dynamic:
        add_profiles(trt, builder, network, config, signature)
    cache = None
    if timing_cache is not None:
        blob = timing_cache.read_bytes() if timing_cache.is_file() else b""
        cache = config.create_timing_cache(blob)
        config.set_timing_cache(cache, ignore_mismatch=False)
    plan = builder.build_serialized_network(network, config)  # the parser owns the weights: kept until here
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path} (see the log above)")
    del network, parser  # the parsed weights go before the plan is written
    write_plan(plan, plan_path)
    del plan
    if cache is not None:
        write_plan(config.get_timing_cache().serialize(), timing_cache)
    return plan_path
