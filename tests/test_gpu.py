"""GPU checks (skipped without CUDA): native cache on the device, the reference loop's invariants on
CUDA, and CUDA against CPU within the fp32 tolerance (TF32 off), CUDA graphs of the drafter against eager."""
import math

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPT = "a red fox running through fresh snow"
# Per-dtype tolerance for CUDA vs CPU kernels on the same weights (values are O(1)).
CUDA_VS_CPU_TOL = {torch.float32: 2e-3, torch.bfloat16: 1e-1}


@pytest.fixture(autouse=True)
def no_tf32():
    """Exactness tests compare fp32 results: TF32 off for each test, the flags restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def gpu_pipe():
    from sdvg import SpeculativeVideoPipeline

    return SpeculativeVideoPipeline.from_preset("tiny", seed=0, device="cuda:0")


def test_native_cache_on_cuda():
    from sdvg._native import _C
    from sdvg.models.kv_cache import KVCacheSpec

    cache = KVCacheSpec(2, 2, 8, 4, 9).allocate(torch.bfloat16, "cuda:0")
    cache.begin_write(3)
    k = torch.ones(1, 2, 12, 8, device="cuda", dtype=torch.bfloat16)
    cache.write(0, k, -k)
    kv, vv = cache.visible(0)
    assert kv.is_cuda and torch.equal(kv, k) and torch.equal(vv, -k)
    info = _C.build_info()
    # the CUDA build (a CPU build allocates on CUDA too, through torch), against torch's CUDA major version
    assert info["cuda"] is True, f"sdvg._C is a CPU build: {info}"
    assert info["cuda_runtime_version"] // 1000 == int(torch.version.cuda.split(".")[0]), (info, torch.version.cuda)


def test_tau_inf_equals_target_only_on_cuda(gpu_pipe):
    a = gpu_pipe(PROMPT, tau=math.inf, num_blocks=3, seed=1)
    b = gpu_pipe(PROMPT, mode="target", num_blocks=3, seed=1)
    assert torch.equal(a.latents, b.latents) and np.array_equal(a.frames, b.frames)


def test_cuda_matches_cpu_reference(gpu_pipe, tiny_pipe):
    kw = dict(router="pattern", pattern=(False, True, False), num_blocks=3, seed=4)
    g = gpu_pipe(PROMPT, **kw)
    c = tiny_pipe(PROMPT, **kw)
    assert [b["decision"] for b in g.stats["blocks"]] == [b["decision"] for b in c.stats["blocks"]]
    assert (g.latents - c.latents).abs().max() < CUDA_VS_CPU_TOL[torch.float32] * max(1.0, c.latents.abs().max())


def test_bf16_cache_path_matches_masked_full_forward_on_cuda():
    from sdvg.config import get_preset
    from sdvg.models.dit import CausalWanDiT, block_causal_mask
    from sdvg.models.kv_cache import KVCacheSpec

    torch.manual_seed(0)
    with torch.device("cuda"):
        dit = CausalWanDiT(get_preset("tiny").target)
    dit.set_precision("bf16").eval()
    text = dit.encode_text(torch.randn(1, 512, 32, device="cuda"))
    nb, fpb, tpf = 3, 3, 16
    x = torch.randn(1, 16, nb * fpb, 8, 8, device="cuda")
    cache = KVCacheSpec.for_dit(dit.config, tpf, nb * fpb).allocate(torch.bfloat16, "cuda")
    outs = []
    for b in range(nb):
        outs.append(dit(x[:, :, b * fpb:(b + 1) * fpb], torch.zeros(1, fpb, device="cuda"), text, b * fpb, cache))
        cache.commit()
    full = dit(x, torch.zeros(1, nb * fpb, device="cuda"), text, attn_mask=block_causal_mask(nb, fpb, tpf))
    err = (torch.cat(outs, 2).float() - full.float()).abs().max() / full.float().abs().max()
    assert err < CUDA_VS_CPU_TOL[torch.bfloat16]


def test_cpp_scheduler_matches_reference_on_cuda(gpu_pipe):
    kw = dict(router="pattern", pattern=(False, True, False, True), num_blocks=4, seed=2)
    ref = gpu_pipe(PROMPT, scheduler="reference", **kw)
    for run_ahead in (False, True):
        got = gpu_pipe(PROMPT, scheduler="cpp", run_ahead=run_ahead, **kw)
        assert torch.equal(ref.latents, got.latents) and np.array_equal(ref.frames, got.frames)


def test_role_streams_overlap_on_one_gpu():
    from sdvg.generation.fake_stages import FakeStages, fake_scheduler
    from sdvg.options import GenerationOptions

    stages = FakeStages(spin_cycles=20_000_000, device="cuda:0")  # ~10 ms per stage on a modern GPU
    opts = GenerationOptions(router="pattern", pattern="011011", num_blocks=6, run_ahead=True)
    sched = fake_scheduler(stages, opts, device="cuda:0")
    sched.run()
    assert len(set(stages.streams.values())) == 3, stages.streams  # one stream per role
    assert torch.cuda.current_stream().cuda_stream not in stages.streams.values()
    # drafter work ran on the drafter thread beside the main thread's target / VAE work
    trace = sched.trace()
    drafter = [x for x in trace if x["thread"] == "drafter"]
    main = [x for x in trace if x["thread"] == "main"]
    assert drafter and any(d["start_s"] < m["end_s"] and m["start_s"] < d["end_s"] for d in drafter for m in main)


def test_latent_transfer_prefetch_between_devices():
    from sdvg.generation.transfer import LatentTransfer

    n = torch.cuda.device_count()
    dest = torch.device(f"cuda:{1 if n > 1 else 0}")
    t = LatentTransfer([torch.device("cuda:0"), dest])
    x = torch.randn(1, 16, 3, 60, 104, device="cuda:0")
    t.prefetch(x, dest)
    y = t.get(x, dest)
    assert y.device == dest and torch.equal(y.cpu(), x.cpu())
    assert t.in_flight() == (1 if dest != x.device else 0)
    t.release(x)
    assert t.in_flight() == 0


def test_cuda_graphs_equal_eager_on_cuda(gpu_pipe):
    """Real CUDA-graph capture of the drafter's steps: bitwise the eager video, over two videos (the second
    replays the first one's graphs with another prompt and seed), sequential and run-ahead."""
    from sdvg.generation.graphs import CudaGraphCapture

    kw = dict(router="pattern", pattern=(False, True, True, False), num_blocks=4)
    for run_ahead in (False, True):
        for prompt, seed in ((PROMPT, 1), ("a lighthouse at night in a storm", 2)):
            eager = gpu_pipe(prompt, seed=seed, run_ahead=run_ahead, **kw)
            graphed = gpu_pipe(prompt, seed=seed, run_ahead=run_ahead, cuda_graphs=True, **kw)
            assert torch.equal(eager.latents, graphed.latents) and np.array_equal(eager.frames, graphed.frames)
    graphs = gpu_pipe.runners().graphs
    assert all(isinstance(c, CudaGraphCapture) for c in graphs.capture_backends.values()) and graphs.replays > 0
    assert graphs.stats()["graphs"] == 4 and graphs.stats()["caches"] == 1
    assert graphs.stats()["captured_late"] == 0  # every block position captured by prepare, none in a lane
    streams = {c.stream.cuda_stream for c in graphs.capture_backends.values()}
    assert torch.cuda.current_stream().cuda_stream not in streams  # the persistent capture stream


def test_cuda_graphs_keep_what_they_read_alive(gpu_pipe):
    """torch's input-liveness check (where this torch has it) on every capture: a replay after a tensor
    the graph reads was freed raises; two videos with collections and an emptied allocator between
    replays give the eager video."""
    import gc

    from sdvg.generation.graphs import CudaGraphCapture, DiTGraphs, _has_liveness

    if not _has_liveness():
        pytest.skip("this torch has no torch.cuda.graph(check_input_liveness=...)")
    graphs = DiTGraphs(capture_factory=lambda d: CudaGraphCapture(d, check_input_liveness=True))
    gpu_pipe.runners().graphs = graphs
    kw = dict(mode="draft", num_blocks=3)
    eager = gpu_pipe(PROMPT, seed=5, **kw)
    for _ in range(2):
        graphed = gpu_pipe(PROMPT, seed=5, cuda_graphs=True, **kw)
        gc.collect()
        torch.cuda.empty_cache()
        assert torch.equal(eager.latents, graphed.latents) and np.array_equal(eager.frames, graphed.frames)
    assert graphs.captured == 3 and graphs.captured_late == 0


def test_copy_ahead_on_cuda():
    from sdvg.generation.noise import block_noise, copy_ahead, gaussian

    shape = (1, 16, 3, 60, 104)
    noise = block_noise(shape, 3, 1)
    on_device = copy_ahead(noise, 3, 1, 4, "drafter", "cuda:0")
    ahead = [gaussian(shape, 3, 1, s, "drafter", "cuda:0") for s in (1, 2, 3)]
    assert torch.equal(on_device.cpu(), noise)
    assert all(torch.equal(a.cpu(), gaussian(shape, 3, 1, s, "drafter")) for a, s in zip(ahead, (1, 2, 3)))


def test_stage_timing_events_equal_sync_on_cuda(gpu_pipe):
    """No per-stage wait (the scheduler's events order the roles' streams; the guard's and the router's
    reads are the only host waits): bitwise the synchronised video, native (with and without run-ahead)
    and reference; device times from the event pairs."""
    kw = dict(router="pattern", pattern=(False, True, True, False), num_blocks=4, seed=5)
    synced = gpu_pipe(PROMPT, **kw)
    for scheduler, run_ahead in (("cpp", False), ("cpp", True), ("reference", False)):
        out = gpu_pipe(PROMPT, scheduler=scheduler, run_ahead=run_ahead, stage_timing="events", **kw)
        assert torch.equal(synced.latents, out.latents) and np.array_equal(synced.frames, out.frames), scheduler
        device_s = out.stats["result"]["stage_device_s"]
        assert {"draft", "decode", "target"} <= set(device_s) and all(v > 0 for v in device_s.values())
    assert synced.stats["result"]["stage_device_s"] is None


def test_stage_events_on_cuda_measure_device_time():
    from sdvg.generation.stage_timing import StageEvents

    ev = StageEvents(["cuda:0"], "events")
    x = torch.randn(2048, 2048, device="cuda:0")
    start = ev.start("cuda:0")
    for _ in range(10):
        x = x @ x.T / 2048
    ev.end("target", start, "cuda:0")
    times = ev.resolve()
    assert set(times) == {"target"} and times["target"] > 0


def test_fast_vae_on_cuda_within_tolerance(gpu_pipe, monkeypatch):
    """cudnn.benchmark and channels-last on the GPU, the steady state compiled, against the plain CUDA
    decode within FAST_VAE_TOLERANCE; cudnn.benchmark is then on for the rest of the process (set once,
    never toggled back: `enable_cudnn_benchmark`), and restored for the tests after this one."""
    from test_fast_vae import _compare

    from sdvg.generation import fast_vae

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    monkeypatch.setattr(fast_vae, "_BENCHMARK_SET", fast_vae._BENCHMARK_SET)
    _compare(gpu_pipe.components.vae, gpu_pipe.preset, compile=True)
    assert torch.backends.cudnn.benchmark
    kw = dict(mode="target", num_blocks=3, seed=2, target_context="full")
    plain, fast = gpu_pipe(PROMPT, **kw), gpu_pipe(PROMPT, fast_vae=True, **kw)
    assert torch.equal(plain.latents, fast.latents)
    assert np.abs(plain.frames - fast.frames).max() <= 1 / 255 + 1e-7


def test_compile_backend_on_cuda_within_tolerance():
    """backend compile with inductor's Triton kernels: each block's regions compiled once for every layer, a bf16
    SDVG video within COMPILE_TOLERANCE of eager (relative to the latents' scale), the same decisions."""
    from sdvg import SpeculativeVideoPipeline
    from sdvg.generation.compile import COMPILE_TOLERANCE

    pipe = SpeculativeVideoPipeline.from_preset("tiny", seed=0, device="cuda:0", torch_dtype=torch.bfloat16)
    kw = dict(router="pattern", pattern=(False, True, False), num_blocks=3, seed=4)
    eager = pipe(PROMPT, **kw)
    compiled = pipe(PROMPT, backend="compile", **kw)
    scale = eager.latents.float().abs().max()
    assert (compiled.latents.float() - eager.latents.float()).abs().max() <= COMPILE_TOLERANCE[torch.bfloat16] * scale
    assert compiled.stats["result"]["compile"]["graphs"] > 0
    assert compiled.stats["result"]["compile"]["compiler"] == "inductor"
    again = pipe(PROMPT, backend="compile", **kw)
    assert again.stats["result"]["compile"]["graphs"] == 0 and torch.equal(again.latents, compiled.latents)
