"""The engine executors TensorRT drives (sdvg/engines/executor.py, trt_cuda.py, torch_trt.py): what this
machine can check without TensorRT — argument checks, install messages, the cudart error helper, the
cuda-python executor's stream-ordered memory and CUDA-graph protocol against fake TensorRT and cudart
modules, the torch-tensorrt route's export step and its engine-cache keys. The runs that need
TensorRT and a GPU are marked `tensorrt`."""
import builtins
import ctypes
import dataclasses
import enum
import hashlib
import json
import re
import sys
import types

import pytest
import torch

from sdvg.engines import tensorrt as trt_tensorrt
from sdvg.engines import torch_trt, trt_cuda
from sdvg.engines.cache import CorruptEngineError, EngineCache, EngineKey, StaleEngineError
from sdvg.engines.executor import EngineExecutor, ExecutorOptions, open_executor
from sdvg.engines.signatures import EngineSignature, TensorSig, dit_signature, engine_key, engine_spec, vae_signature

CMD = "python -m build_engines --preset tiny --format torch-tensorrt --out engines"


def _sigs(preset):
    return (dit_signature(preset, "drafter", 3, False), dit_signature(preset, "drafter", 3, True),
            vae_signature(preset))


# --------------------------------------------------------------------------- argument checks
def test_executor_options(tiny_preset):
    static, cached, vae = _sigs(tiny_preset)
    with pytest.raises(ValueError) as e:
        ExecutorOptions(runtime="cupy")
    assert all(s in str(e.value) for s in ("'cupy'", "runtime")), e.value
    with pytest.raises(ValueError, match="cuda_graph needs runtime='cuda-python'"):
        ExecutorOptions(cuda_graph=True)
    opts = ExecutorOptions(runtime="cuda-python", cuda_graph=True)
    assert [opts.graph_for(s) for s in (static, cached, vae)] == [True, False, False]
    assert not ExecutorOptions(runtime="cuda-python").graph_for(static)


def test_executors_refuse_cpu_devices_dynamic_graphs_and_other_engines(tiny_preset, tmp_path):
    """Refused before any optional library is imported: these hold on a machine without them."""
    static, cached, vae = _sigs(tiny_preset)
    plan = tmp_path / "engine.plan"
    with pytest.raises(ValueError) as e:
        trt_cuda.TRTCudaEngine(plan, static, "cpu")
    assert all(s in str(e.value) for s in ("cuda-python", "not cpu")), e.value
    with pytest.raises(ValueError) as e:
        trt_cuda.TRTCudaEngine(plan, cached, "cuda:0", cuda_graph=True)
    assert all(s in str(e.value) for s in ("visible_tokens", "cache_tokens", "cuda_graph")), e.value
    with pytest.raises(ValueError) as e:
        torch_trt.TorchTRTEngine(tmp_path / "program.ep", static, "cpu")
    assert all(s in str(e.value) for s in ("torch-tensorrt", "not cpu")), e.value
    with pytest.raises(ValueError) as e:
        torch_trt.TorchTRTEngine(tmp_path / "program.ep", vae, "cuda:0")
    assert "'vae_decode'" in str(e.value)
    with pytest.raises(ValueError) as e:
        open_executor("tflite", plan, static, "cpu")
    assert "'tflite'" in str(e.value)
    with pytest.raises(ValueError) as e:
        EngineKey("s", "c", "w", (), "fp32", "cpu", "none", "none", artifact="tflite")
    assert "'tflite'" in str(e.value)


def test_unknown_format_refused(capsys):
    from build_engines.__main__ import cli, parser
    from sdvg.generation.backends import BUILD_FORMATS, ENGINE_ARTIFACTS, build_format

    fmt = next(a for a in parser()._actions if "--format" in a.option_strings)
    assert tuple(fmt.choices) == BUILD_FORMATS == ("tensorrt", "onnx", "torch-tensorrt")
    assert {b: build_format(b) for b in ENGINE_ARTIFACTS} == {"tensorrt": "tensorrt", "onnxruntime": "onnx",
                                                              "torch-tensorrt": "torch-tensorrt"}
    with pytest.raises(SystemExit) as err:
        cli(["--preset", "tiny", "--format", "torch_tensorrt"])
    assert err.value.code == 2 and "invalid choice: 'torch_tensorrt'" in capsys.readouterr().err


def test_backend_artifacts_per_family():
    from sdvg.generation.backends import STAGE_BACKENDS, engine_artifact
    from sdvg.options import BACKENDS

    assert STAGE_BACKENDS is BACKENDS and "torch-tensorrt" in BACKENDS
    assert [engine_artifact("torch-tensorrt", f) for f in ("target_dit", "drafter_dit", "vae_decode", "reward")] == \
        ["torch-tensorrt", "torch-tensorrt", "tensorrt", "tensorrt"]
    assert {engine_artifact("onnxruntime", f) for f in ("target_dit", "reward")} == {"onnx"}


# --------------------------------------------------------------------------- install messages
def _block(monkeypatch, *names):
    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if any(name == n or name.startswith(n + ".") for n in names):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    for mod in list(sys.modules):
        if any(mod == n or mod.startswith(n + ".") for n in names):
            monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", fake)


def test_install_messages_name_the_extra(monkeypatch):
    _block(monkeypatch, "cuda", "torch_tensorrt")
    with pytest.raises(RuntimeError) as e:
        trt_cuda.import_cuda_python()
    assert all(s in str(e.value) for s in ("cuda-python", "pip install 'sdvg[tensorrt]'")), e.value
    with pytest.raises(RuntimeError) as e:
        torch_trt.import_torch_tensorrt()
    assert all(s in str(e.value) for s in ("torch-tensorrt", "'sdvg[torch-tensorrt]'",
                                           "replaces the installed torch")), e.value


def test_torch_tensorrt_backend_and_build_name_their_extra(monkeypatch, tiny_pipe, tmp_path, capsys):
    """With TensorRT present (a stand-in here) and torch-tensorrt missing, the backend and the build
    say which extra to install, before anything is loaded or built."""
    from build_engines.__main__ import cli
    from sdvg.generation.backends import StageRunners

    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))
    _block(monkeypatch, "torch_tensorrt")
    with pytest.raises(RuntimeError, match=r"'sdvg\[torch-tensorrt\]'"):
        StageRunners(tiny_pipe.components, "torch-tensorrt", tmp_path)
    with pytest.raises(ValueError) as e:
        StageRunners(tiny_pipe.components, "torch-tensorrt")
    assert all(s in str(e.value) for s in ("engines=", "--format torch-tensorrt")), e.value
    assert cli(["--preset", "tiny", "--format", "torch-tensorrt", "--out", str(tmp_path)]) == 2
    assert "'sdvg[torch-tensorrt]'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- cudart error helper
class _Err(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorMemoryAllocation = 2
    cudaErrorStreamCaptureInvalidated = 901


def _fake_cudart_errors():
    return types.SimpleNamespace(cudaError_t=_Err, cudaGetErrorName=lambda e: (_Err.cudaSuccess, e.name.encode()),
                                 cudaGetErrorString=lambda e: (_Err.cudaSuccess, b"out of memory"))


def test_cuda_error_helper():
    rt = _fake_cudart_errors()
    ok = _Err.cudaSuccess
    assert trt_cuda.check(rt, (ok,), "cudaFreeAsync") is None
    assert trt_cuda.check(rt, (ok, 0xBEEF), "cudaMallocAsync") == 0xBEEF
    assert trt_cuda.check(rt, (ok, 1, 2), "cudaX") == (1, 2)
    with pytest.raises(trt_cuda.CudaError, match=r"^cudaMallocAsync failed: cudaErrorMemoryAllocation "
                                                 r"\(out of memory\)$"):
        trt_cuda.check(rt, (_Err.cudaErrorMemoryAllocation, None), "cudaMallocAsync")


def test_cuda_error_helper_with_cuda_python():
    cudart = pytest.importorskip("cuda.bindings.runtime")
    err = cudart.cudaError_t.cudaErrorMemoryAllocation
    with pytest.raises(trt_cuda.CudaError, match="cudaMallocAsync failed: cudaErrorMemoryAllocation"):
        trt_cuda.check(cudart, (err, 0), "cudaMallocAsync")


# --------------------------------------------------------------------------- the cuda-python executor, faked
SIG = EngineSignature("drafter_dit_1f", "drafter_dit", (TensorSig("x", (2, 3), "float32"),),
                     (TensorSig("y", (2, 3), "float32"),))
MEMORY = 4096


def _floats(ptr):
    return (ctypes.c_float * 6).from_address(ptr)


class FakeCudart:
    """The cuda.bindings.runtime calls the executor makes; records them, captures launches into graphs."""

    cudaError_t = _Err
    cudaStreamNonBlocking, cudaEventDisableTiming = 1, 2
    cudaStreamCaptureMode = types.SimpleNamespace(cudaStreamCaptureModeThreadLocal=1)

    def __init__(self):
        self.calls, self.capturing, self.recorded, self.fail = [], False, [], {}
        self.cudaGetErrorName = _fake_cudart_errors().cudaGetErrorName
        self.cudaGetErrorString = _fake_cudart_errors().cudaGetErrorString

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, args))
            if name in self.fail:
                return (self.fail[name], None)
            return getattr(self, "_" + name, lambda *a: (_Err.cudaSuccess,))(*args)
        return call

    def _cudaStreamCreateWithFlags(self, flags):
        return _Err.cudaSuccess, 11

    def _cudaEventCreateWithFlags(self, flags):
        return _Err.cudaSuccess, 20 + len(self.calls)

    def _cudaMallocAsync(self, size, stream):
        return _Err.cudaSuccess, 0xDEAD000

    def _cudaStreamBeginCapture(self, stream, mode):
        self.capturing = True
        return (_Err.cudaSuccess,)

    def _cudaStreamEndCapture(self, stream):
        self.capturing = False
        return _Err.cudaSuccess, "graph"

    def _cudaGraphInstantiate(self, graph, flags):
        return _Err.cudaSuccess, "exec"

    def _cudaGraphLaunch(self, exec_, stream):
        for op in self.recorded:
            op()
        return (_Err.cudaSuccess,)

    def names(self):
        return [n for n, _ in self.calls]


class FakeContext:
    """y = 2 x + 1 at the bound addresses; a launch made while the stream captures is recorded."""

    def __init__(self, cudart, strategy):
        self.cudart, self.strategy, self.addr, self.memory, self.runs = cudart, strategy, {}, None, 0
        self.fail_in_capture = False

    def set_input_shape(self, name, shape):
        return tuple(shape) == (2, 3)

    def get_tensor_shape(self, name):
        return (2, 3)

    def set_tensor_address(self, name, ptr):
        self.addr[name] = ptr

    def set_device_memory(self, ptr, size):
        self.memory = (ptr, size)

    def execute_async_v3(self, stream):
        assert stream == 11 and self.memory == (0xDEAD000, MEMORY)
        x, y = self.addr["x"], self.addr["y"]

        def op():
            src, dst = _floats(x), _floats(y)
            for i in range(6):
                dst[i] = 2 * src[i] + 1
        if self.cudart.capturing:
            self.cudart.recorded.append(op)
            return not self.fail_in_capture
        self.runs += 1
        op()
        return True


@pytest.fixture
def fake_trt(monkeypatch):
    """Fake tensorrt and cudart modules; the executor's device is the CPU (tensors at host addresses)."""
    cudart = FakeCudart()
    trt = types.SimpleNamespace(float32="f32", float16="f16", bfloat16="bf16", int32="i32", int64="i64",
                                bool="b", int8="i8", __version__="11.1.0",
                                TensorIOMode=types.SimpleNamespace(INPUT="in", OUTPUT="out"),
                                ExecutionContextAllocationStrategy=types.SimpleNamespace(USER_MANAGED="user"),
                                Logger=type("Logger", (), {"WARNING": 0, "__init__": lambda self, level: None}))
    contexts = []

    class Engine:
        num_io_tensors, device_memory_size_v2 = 2, MEMORY

        def get_tensor_name(self, i):
            return "xy"[i]

        def get_tensor_mode(self, n):
            return "in" if n == "x" else "out"

        def get_tensor_dtype(self, n):
            return "f32"

        def get_tensor_shape(self, n):
            return (2, 3)

        def create_execution_context(self, strategy=None):
            contexts.append(FakeContext(cudart, strategy))
            return contexts[-1]

    def deserialize(reader):  # as TensorRT 11 does with an IStreamReaderV2: reads until the plan is in
        assert isinstance(reader, trt.IStreamReaderV2), "the plan is streamed from its file"
        blob = b""
        while chunk := reader.read(1 << 20, 0):
            blob += chunk
        trt.plans.append(blob)
        return Engine()

    trt.IStreamReaderV2 = type("IStreamReaderV2", (), {"__init__": lambda self: None})
    trt.SeekPosition = types.SimpleNamespace(SET="set", CUR="cur", END="end")
    trt.plans = []
    trt.Runtime = lambda logger: types.SimpleNamespace(deserialize_cuda_engine=deserialize)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(trt_cuda, "import_cuda_python", lambda: cudart)
    monkeypatch.setattr(trt_cuda, "require_cuda", lambda device, what: torch.device("cpu"))
    monkeypatch.setattr(trt_tensorrt, "_TORCH_DTYPES", {})  # filled from this fake, dropped afterwards
    monkeypatch.setattr(torch.cuda, "device", _NullDevice)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    return cudart, contexts


class _NullDevice:
    def __init__(self, device):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_cuda_python_executor_stream_ordered_memory(fake_trt, tmp_path):
    cudart, contexts = fake_trt
    (tmp_path / "engine.plan").write_bytes(b"plan")
    engine = trt_cuda.TRTCudaEngine(tmp_path / "engine.plan", SIG, "cuda:0")
    assert isinstance(engine, EngineExecutor) and contexts[0].strategy == "user"
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(engine(x), 2 * x + 1)
    dest = torch.empty(2, 3)
    assert engine(x + 1, out={"y": dest}) is dest and torch.equal(dest, 2 * x + 3)
    with pytest.raises(ValueError) as e:
        engine(x, out={"y": torch.empty(3, 2)})
    assert all(s in str(e.value) for s in ("out['y']", "torch.float32", "[2, 3]")), e.value
    names = cudart.names()
    assert names.count("cudaMallocAsync") == 1 and ("cudaMallocAsync", (MEMORY, 11)) in cudart.calls
    # every launch waits for torch's stream and torch's stream waits for it
    assert names.count("cudaStreamWaitEvent") == 2 * contexts[0].runs == 4
    engine.close()
    assert ("cudaFreeAsync", (0xDEAD000, 11)) in cudart.calls and cudart.names()[-1] == "cudaStreamDestroy"


def test_cuda_python_executor_graph_replays_static_buffers(fake_trt, tmp_path):
    cudart, contexts = fake_trt
    (tmp_path / "engine.plan").write_bytes(b"plan")
    engine = trt_cuda.TRTCudaEngine(tmp_path / "engine.plan", SIG, "cuda:0", cuda_graph=True)
    x = torch.arange(6.0).reshape(2, 3)
    first = engine(x)
    assert torch.equal(first, 2 * x + 1)
    ptr = first.data_ptr()
    second = engine(x * 10)
    assert second.data_ptr() == ptr and torch.equal(second, 20 * x + 1)  # a view of the static output: no clone
    assert torch.equal(first, second)  # the lifetime rule: the previous result is overwritten by this call
    names = cudart.names()
    assert names.index("cudaStreamBeginCapture") < names.index("cudaStreamEndCapture") < \
        names.index("cudaGraphInstantiate")
    assert names.count("cudaGraphLaunch") == 2 and contexts[0].runs == 1 and len(cudart.recorded) == 1
    with pytest.raises(ValueError) as e:
        engine(torch.zeros(3, 2))
    assert all(s in str(e.value) for s in ("input 'x'", "[2, 3]")), e.value
    with pytest.raises(ValueError, match="copy from the returned views"):
        engine(x, out={"y": torch.empty(2, 3)})
    engine.close()
    assert {"cudaGraphExecDestroy", "cudaGraphDestroy", "cudaFreeAsync"} <= set(cudart.names())


def test_cuda_python_executor_errors(fake_trt, tmp_path):
    cudart, contexts = fake_trt
    (tmp_path / "engine.plan").write_bytes(b"plan")
    engine = trt_cuda.TRTCudaEngine(tmp_path / "engine.plan", SIG, "cuda:0", cuda_graph=True)
    contexts[0].fail_in_capture = True  # the launch inside the capture fails: the capture still ends
    with pytest.raises(RuntimeError) as e:
        engine(torch.zeros(2, 3))
    assert "execute_async_v3" in str(e.value)
    assert cudart.names().count("cudaStreamEndCapture") == 1 and not cudart.capturing
    contexts[0].fail_in_capture = False
    cudart.fail["cudaGraphInstantiate"] = _Err.cudaErrorStreamCaptureInvalidated
    with pytest.raises(trt_cuda.CudaError) as e:
        engine(torch.zeros(2, 3))
    assert all(s in str(e.value) for s in ("cudaGraphInstantiate", "cudaErrorStreamCaptureInvalidated")), e.value
    plain = trt_cuda.TRTCudaEngine(tmp_path / "engine.plan", SIG, "cuda:0")
    cudart.fail["cudaMallocAsync"] = _Err.cudaErrorMemoryAllocation
    with pytest.raises(trt_cuda.CudaError) as e:
        plain(torch.zeros(2, 3))
    assert all(s in str(e.value) for s in ("cudaMallocAsync", "cudaErrorMemoryAllocation")), e.value


# --------------------------------------------------------------------------- torch-tensorrt route
@pytest.mark.slow
def test_torch_tensorrt_export_step(tiny_pipe):
    """The DiT engine through torch.export with the dynamic dimensions torch-tensorrt gets: the program's
    inputs are the signature's, its ranges the signature's bounds, its outputs eager's at two lengths."""
    comps = tiny_pipe.components
    sig = dit_signature(comps.preset, "target", 3, True, comps.target.dtype)
    spec = engine_spec(comps, sig)
    program = torch_trt.export_engine(spec.module, sig, spec.inputs)
    user_inputs = [s for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    assert len(user_inputs) == len(sig.inputs)
    shapes = [n.meta["val"].shape for n in program.graph.nodes if n.op == "placeholder"][-len(sig.inputs):]
    for t, shape in zip(sig.inputs, shapes):
        assert len(shape) == len(t.shape)
        for d, s in zip(t.shape, shape):
            if isinstance(d, int):
                assert s == d
            else:  # symbolic, with the signature's bounds
                r = program.range_constraints[s.node.expr]
                bound = next(b for b in sig.dynamic if b[0] == d)
                assert (int(r.lower), int(r.upper)) == (bound[1], bound[3])
    run = program.module()
    for inputs in (spec.inputs, sig.example_inputs("cpu", seed=1, which="min")):
        with torch.no_grad():
            got, want = run(*inputs), spec.module(*inputs)
        assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want))
    with pytest.raises(ValueError) as e:
        torch_trt.export_engine(spec.module, vae_signature(comps.preset), spec.inputs)
    assert "'vae_decode'" in str(e.value)


def test_torch_tensorrt_inputs_follow_the_signature(tiny_preset):
    class Input:
        def __init__(self, **kw):
            self.kw = kw

    sig = dit_signature(tiny_preset, "target", 3, True)
    specs = torch_trt.trt_inputs(types.SimpleNamespace(Input=Input), sig)
    by = {s.kw["name"]: s.kw for s in specs}
    assert list(by) == sig.input_names
    assert by["latents"]["shape"] == sig.inputs[0].shape and "min_shape" not in by["latents"]
    lo, opt, hi = (sig.sizes(w) for w in ("min", "opt", "max"))
    assert by["kv_0"]["min_shape"][3] == lo["cache_tokens"] and by["kv_0"]["max_shape"][3] == hi["cache_tokens"]
    assert by["kv_0"]["opt_shape"][3] == opt["cache_tokens"] and by["kv_0"]["shared_dims"] == {3: "cache_tokens"}
    assert by["cache_index"]["max_shape"] == (hi["visible_tokens"],) and by["cache_index"]["dtype"] is torch.int64


def test_torch_tensorrt_cache_key_holds_versions(tiny_pipe, tmp_path, monkeypatch):
    comps = tiny_pipe.components
    sig = dit_signature(comps.preset, "drafter", 3, False, comps.drafter.dtype)
    monkeypatch.setattr(torch_trt, "torch_trt_version", lambda: "2.13.0")
    built = engine_key(sig, comps, "torch-tensorrt")
    assert (built.torch_version, built.torch_trt_version, built.artifact) == (torch.__version__, "2.13.0",
                                                                              "torch-tensorrt")
    onnx = engine_key(sig, comps, "onnx")
    assert "torch_version" not in onnx.as_json() and "torch_trt_version" not in onnx.as_json()
    old = {k: v for k, v in dataclasses.asdict(onnx).items() if k not in ("torch_version", "torch_trt_version")}
    old["shapes"] = [[n, list(s), t] for n, s, t in onnx.shapes]
    assert onnx.digest() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()  # digests unchanged

    cache = EngineCache(tmp_path / "engines")
    art = tmp_path / "program.ep"
    art.write_bytes(b"exported program")
    dest = cache.store(built, art, CMD)
    assert dest.name == "program.ep" and cache.load(built, CMD) == dest
    monkeypatch.setattr(torch_trt, "torch_trt_version", lambda: "2.14.0")
    with pytest.raises(StaleEngineError) as err:
        cache.load(engine_key(sig, comps, "torch-tensorrt"), CMD)
    assert "torch_trt_version: built for '2.13.0', needed '2.14.0'" in str(err.value)
    assert str(err.value).endswith("rebuild with: " + CMD)
    with pytest.raises(StaleEngineError, match=re.escape(f"torch_version: built for '{torch.__version__}', needed "
                                                         "'2.13.1'")):
        cache.load(dataclasses.replace(built, torch_version="2.13.1"), CMD)  # a pipeline on another torch
    manifest = dest.parent / "manifest.json"
    m = json.loads(manifest.read_text())
    m["file"] = "engine.plan"
    manifest.write_text(json.dumps(m))
    with pytest.raises(CorruptEngineError) as e:
        cache.load(built, CMD)
    assert all(s in str(e.value) for s in ("torch-tensorrt", "program.ep")), e.value


# --------------------------------------------------------------------------- on a GPU with TensorRT
@pytest.mark.tensorrt
def test_cuda_python_executor_on_gpu(tmp_path):
    """A tiny drafter block engine built into a plan, run through cuda-python with and without a CUDA
    graph: both equal eager, the graph's outputs keep their address across replays."""
    from build_engines.__main__ import main as build
    from sdvg import SpeculativeVideoPipeline

    assert build(["--preset", "tiny", "--format", "tensorrt", "--device", "cuda:0", "--stages", "drafter_dit",
                  "--out", str(tmp_path)]) == 0
    comps = SpeculativeVideoPipeline.from_preset("tiny", device="cuda:0").components
    sig = dit_signature(comps.preset, "drafter", 3, False, comps.drafter.dtype)
    path = EngineCache(tmp_path).load(engine_key(sig, comps, "tensorrt"), CMD)
    spec = engine_spec(comps, sig)
    want = spec.module(*spec.inputs)
    for graph in (False, True):
        engine = trt_cuda.TRTCudaEngine(path, sig, "cuda:0", cuda_graph=graph)
        a = engine(*spec.inputs)
        ptrs = [t.data_ptr() for t in a]
        b = engine(*spec.inputs)
        assert all(torch.allclose(g, w, atol=1e-3) for g, w in zip(b, want))
        assert ([t.data_ptr() for t in b] == ptrs) == graph
        engine.close()


@pytest.mark.tensorrt
def test_torch_tensorrt_route_video_equals_eager(tmp_path):
    pytest.importorskip("torch_tensorrt")
    from build_engines.__main__ import main as build
    from sdvg import SpeculativeVideoPipeline

    assert build(["--preset", "tiny", "--format", "torch-tensorrt", "--device", "cuda:0", "--out", str(tmp_path)]) == 0
    pipe = SpeculativeVideoPipeline.from_preset("tiny", device="cuda:0", engines=tmp_path)
    kw = dict(num_blocks=3, seed=1, router="pattern", pattern=(False, True, False))
    eager, ttrt = pipe("a red fox", **kw), pipe("a red fox", backend="torch-tensorrt", **kw)
    assert (eager.latents - ttrt.latents).abs().max() < 1e-3


def test_pipeline_and_cli_choose_the_executor(tiny_pipe):
    from sdvg import SpeculativeVideoPipeline, cli
    from sdvg.engines.executor import ExecutorOptions

    pipe = SpeculativeVideoPipeline(tiny_pipe.components)  # the shared weights; no runners made yet
    pipe.set_engine_executor("cuda-python", cuda_graph=True)
    assert pipe.engine_executor == ExecutorOptions("cuda-python", True)
    assert pipe.runners("eager").executor == ExecutorOptions("cuda-python", True)  # runners carry the options
    with pytest.raises(ValueError, match="cuda_graph needs runtime='cuda-python'"):
        pipe.set_engine_executor("torch", cuda_graph=True)
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--trt-runtime", "cuda-python",
                                          "--trt-cuda-graphs"])
    assert args.trt_runtime == "cuda-python" and args.trt_cuda_graphs
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--prompt", "x", "--trt-runtime", "cuda"])


# --------------------------------------------------------------------------- the torch runtime, faked
DYN = EngineSignature("target_dit_3f_cached", "target_dit", (TensorSig("x", (2, "n"), "float32"),),
                     (TensorSig("y", (2, "n"), "float32"),), dynamic=(("n", 2, 3, 8),),
                     profiles=(("recompute", (("n", 2, 3, 3),)), ("full", (("n", 2, 6, 8),))))


class _Stream:
    def __init__(self, handle):
        self.cuda_stream, self.waits = handle, []

    def wait_stream(self, other):
        self.waits.append(other.cuda_stream)


def _torch_runtime(fake_trt, monkeypatch, current):
    """TRTEngine over the fake engine (y = 2 x + 1 at the bound addresses) with torch's current stream `current`."""
    cudart, contexts = fake_trt
    side = _Stream(7)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: side)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    launched = []
    import ctypes as _ct

    class Ctx(FakeContext):
        def __init__(self, strategy):
            super().__init__(cudart, strategy)
            self.profiles, self.need = [], MEMORY

        def set_optimization_profile_async(self, index, stream):
            self.profiles.append(index)
            return True

        def update_device_memory_size_for_shapes(self):
            return self.need

        def set_input_shape(self, name, shape):
            self.shape = tuple(shape)
            return True

        def get_tensor_shape(self, name):
            return getattr(self, "shape", (2, 3))

        def execute_async_v3(self, stream):
            launched.append(stream)
            n = self.shape[1] if hasattr(self, "shape") else 3
            src, dst = ((_ct.c_float * (2 * n)).from_address(self.addr[k]) for k in "xy")
            for i in range(2 * n):
                dst[i] = 2 * src[i] + 1
            return True

    return side, launched, Ctx


def test_torch_runtime_never_enqueues_on_the_legacy_default_stream(fake_trt, monkeypatch, tmp_path):
    from sdvg.engines.scratch import TorchScratch

    (tmp_path / "engine.plan").write_bytes(b"plan")
    legacy = _Stream(0)
    side, launched, Ctx = _torch_runtime(fake_trt, monkeypatch, legacy)
    trt = sys.modules["tensorrt"]
    engine = trt_tensorrt.TRTEngine(tmp_path / "engine.plan", SIG, "cpu", scratch=TorchScratch("cpu", "drafter"))
    engine.context = Ctx("user")
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(engine(x), 2 * x + 1)
    assert launched == [7] and side.waits == [0] and legacy.waits == [7]  # ordered both ways by the side stream
    assert trt.plans == [b"plan"]  # streamed from the file
    role = _Stream(5)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: role)
    engine(x)
    assert launched == [7, 5] and role.waits == []  # a role stream: enqueued there, nothing added


def test_torch_runtime_profiles_and_shared_scratch(fake_trt, monkeypatch, tmp_path):
    from sdvg.engines.scratch import TorchScratch

    (tmp_path / "engine.plan").write_bytes(b"plan")
    side, launched, Ctx = _torch_runtime(fake_trt, monkeypatch, _Stream(5))
    scratch = TorchScratch("cpu", "target")
    a = trt_tensorrt.TRTEngine(tmp_path / "engine.plan", DYN, "cpu", scratch=scratch)
    b = trt_tensorrt.TRTEngine(tmp_path / "engine.plan", DYN, "cpu", scratch=scratch)
    a.context, b.context = Ctx("user"), Ctx("user")
    assert a.context.strategy == "user"
    x3, x6 = torch.ones(2, 3), torch.ones(2, 6)
    assert torch.equal(a(x3), 3 * x3) and a.context.profiles == []  # profile 0 is selected already
    assert torch.equal(a(x6), 3 * x6) and a.context.profiles == [1]  # 6 is past the recompute profile
    a(x3)
    assert a.context.profiles == [1, 0]
    b.context.need = 2 * MEMORY  # the second context needs more: the one buffer grows, both rebind it
    b(x3)
    assert scratch.nbytes == scratch.peak == 2 * MEMORY and b.context.memory == (scratch.buffer.data_ptr(), 2 * MEMORY)
    a(x3)
    assert a.context.memory == (scratch.buffer.data_ptr(), MEMORY)  # rebound to the grown buffer
    with pytest.raises(ValueError, match="outside every optimisation profile"):
        a(torch.ones(2, 9))
    a.context.need = 0
    with pytest.raises(RuntimeError) as e:
        a(x3)
    assert "update_device_memory_size_for_shapes" in str(e.value)


def test_engine_cache_hashes_a_plan_once(tmp_path):
    """SHA-256 at store; a load checks the size, the modification time and the ends; a file whose time
    changed is hashed in full once (a copied folder passes, an altered one is refused)."""
    import os

    cache = EngineCache(tmp_path / "engines")
    key = EngineKey("target_dit_3f", "c", "w", (), "bf16", "NVIDIA H200", "9.0", "11.1.0")
    art = tmp_path / "engine.plan"
    art.write_bytes(bytes(range(256)) * 20000)  # 5 MB: the ends are a part of it
    path = cache.store(key, art, CMD)
    m = json.loads((path.parent / "manifest.json").read_text())
    assert {"sha256", "ends_sha256", "mtime_ns", "size"} <= set(m)
    assert cache.load(key, CMD) == path and cache.full_checks == 0
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # copied: another time, same bytes
    assert cache.load(key, CMD) == path and cache.full_checks == 1
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # the middle, which the ends do not cover
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptEngineError) as e:
        cache.load(key, CMD)
    assert "SHA-256" in str(e.value)
    with pytest.raises(StaleEngineError, match="trt_version: built for '11.1.0', needed '10.9.0'"):
        cache.load(dataclasses.replace(key, trt_version="10.9.0"), CMD)  # refused before the plan is read


def test_released_dit_keeps_what_the_engines_do_not_cover(tiny_preset):
    from sdvg.engines.release import ReleasedWeightsError, kept_after_engines, release_replaced_weights
    from sdvg.models.components import build_random

    dit = build_random(tiny_preset).target
    emb = torch.randn(1, 5, tiny_preset.target.text_dim)
    before = dit.encode_text(emb)
    total = sum(p.numel() * p.element_size() for p in dit.model.parameters())
    freed = release_replaced_weights(dit, "its tensorrt engines loaded")
    kept = [n for n, p in dit.model.named_parameters() if p.device.type != "meta"]
    assert kept and all(kept_after_engines(n) for n in kept) and 0 < freed < total
    assert {n.split(".")[0] for n in kept} == {"condition_embedder", "blocks", "proj_out"}
    after = dit.encode_text(emb)  # the prompt's K/V still come from the torch DiT
    assert all(torch.equal(a, b) for a, b in zip(before.keys + before.values, after.keys + after.values))
    assert dit.dtype == torch.float32 and dit.device.type == "cpu"
    assert release_replaced_weights(dit, "again") == 0
    with pytest.raises(ReleasedWeightsError) as e:
        dit(torch.randn(1, 16, 3, 8, 8), torch.full((1, 3), 500.0), after)
    assert all(s in str(e.value) for s in ("its tensorrt engines loaded", "release_torch_weights=False")), e.value


def test_a_folder_of_another_tensorrt_is_refused_before_any_work(tiny_pipe, tmp_path, monkeypatch):
    from sdvg.generation.backends import StageRunners

    comps = tiny_pipe.components
    cache = EngineCache(tmp_path)
    sig = dit_signature(comps.preset, "drafter", 3, False, comps.drafter.dtype)
    art = tmp_path / "engine.plan"
    art.write_bytes(b"plan")
    cache.store(dataclasses.replace(engine_key(sig, comps, "tensorrt"), trt_version="10.13.0"), art, CMD)
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="11.1.0"))
    with pytest.raises(StaleEngineError) as e:
        StageRunners(comps, "tensorrt", tmp_path)
    assert all(s in str(e.value) for s in ("TensorRT 10.13.0", "drafter_dit_3f", "TensorRT 11.1.0",
                                           "rebuild with: python -m build_engines")), e.value
