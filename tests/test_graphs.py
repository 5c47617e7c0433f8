"""The drafter's graph path (`cuda_graphs`) against the plain eager path: on the CPU through the
replay stand-in (same static buffers, keys and refreshes as a CUDA graph); the real capture is in
tests/test_gpu.py."""
import numpy as np
import pytest
import torch

from sdvg.generation.graphs import DiTGraphs, ReplayCapture

PROMPT = "a red fox running through fresh snow"
OTHER = "a lighthouse at night in a storm"


def _same(a, b):
    return torch.equal(a.latents, b.latents) and np.array_equal(a.frames, b.frames)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler,run_ahead", [("reference", False), ("cpp", False), ("cpp", True)])
def test_graphs_equal_eager_over_two_videos(tiny_pipe, scheduler, run_ahead):
    kw = dict(router="pattern", pattern=(False, True, True), num_blocks=3, scheduler=scheduler, run_ahead=run_ahead)
    eager = [tiny_pipe(PROMPT, seed=1, **kw), tiny_pipe(OTHER, seed=2, **kw)]
    graphed = [tiny_pipe(PROMPT, seed=1, cuda_graphs=True, **kw), tiny_pipe(OTHER, seed=2, cuda_graphs=True, **kw)]
    assert all(_same(e, g) for e, g in zip(eager, graphed))
    graphs = tiny_pipe.runners().graphs
    assert graphs.stats()["caches"] == 1  # one drafter cache for the pipeline, reused by both videos
    assert graphs.stats()["graphs"] == 3  # one per block position (0, 3, 6)


@pytest.mark.slow
def test_graphs_capture_once_per_block_position_and_replay_across_videos(tiny_pipe):
    graphs = DiTGraphs(capture_factory=ReplayCapture)
    runners = tiny_pipe.runners()
    runners.graphs = graphs
    kw = dict(mode="draft", num_blocks=3, cuda_graphs=True, scheduler="reference")
    first = tiny_pipe(PROMPT, seed=3, **kw)
    # 3 positions; 4 steps each, plus the t = 0 commit of blocks 0 and 1 (the last block commits nothing)
    # captured up front by `prepare` (capture_all), none by a forward inside the lane
    assert graphs.stats() == {"graphs": 3, "captured": 3, "captured_late": 0, "replays": 14, "eager": 0, "caches": 1}
    second = tiny_pipe(PROMPT, seed=3, **kw)
    assert graphs.captured == 3 and graphs.replays == 28  # nothing captured again
    assert _same(first, second)
    assert _same(first, tiny_pipe(PROMPT, seed=3, mode="draft", num_blocks=3, scheduler="reference"))


def test_graph_replay_refreshes_inputs_and_prompt(dit):
    """Each replay reads the latents, timesteps and prompt K/V given now, not those of its capture."""
    from sdvg.models.kv_cache import KVCacheSpec

    graphs = DiTGraphs(roles=("target",), capture_factory=ReplayCapture)
    g = torch.Generator().manual_seed(0)
    texts = [dit.encode_text(torch.randn(1, 7, 32, generator=g)) for _ in range(2)]
    spec = KVCacheSpec.for_dit(dit.config, 16, 6)
    eager_cache = spec.allocate(dit.dtype, "cpu")
    cache = graphs.cache(dit, spec, dit.dtype, "cpu")
    for text in texts:
        for step in range(3):
            x = torch.randn(1, 16, 3, 8, 8, generator=g)
            t = torch.full((1, 3), 900.0 - 300 * step)
            want = dit(x, t, text, 0, eager_cache)
            got = graphs.forward("target", dit, x, t, text, 0, cache)
            assert torch.equal(got, want)
            assert torch.equal(cache.buffer, eager_cache.buffer)  # the same K/V written in place
    assert graphs.captured == 1 and graphs.replays == 6


def test_graphs_key_on_cache_state_and_skip_masks(dit):
    from sdvg.models.kv_cache import KVCacheSpec

    graphs = DiTGraphs(roles=("target",), capture_factory=ReplayCapture)
    text = dit.encode_text(torch.randn(1, 7, 32))
    spec = KVCacheSpec.for_dit(dit.config, 16, 9)
    cache = graphs.cache(dit, spec, dit.dtype, "cpu")
    eager_cache = spec.allocate(dit.dtype, "cpu")
    x = torch.randn(1, 16, 3, 8, 8)
    t = torch.zeros(1, 3)
    for f0 in (0, 3, 6):
        assert torch.equal(graphs.forward("target", dit, x, t, text, f0, cache), dit(x, t, text, f0, eager_cache))
        cache.commit()
        eager_cache.commit()
    assert graphs.captured == 3  # one per block position
    assert graphs.forward("drafter", dit, x, t, text, 9, cache) is None  # a role not graphed
    mask = torch.ones(48, 48, dtype=torch.bool)
    cache.rollback(6)
    assert graphs.forward("target", dit, x, t, text, 6, cache, attn_mask=mask) is None and graphs.eager == 1
    assert graphs.cache(dit, spec, dit.dtype, "cpu") is cache and cache.committed_frames == 0  # reused, rewound


def test_cuda_graphs_need_the_eager_backend(tiny_pipe):
    from sdvg.options import GenerationOptions

    with pytest.raises(ValueError, match="cuda_graphs needs backend 'eager'"):  # at construction, before loading
        GenerationOptions(cuda_graphs=True, backend="compile")
    with pytest.raises(ValueError, match="cuda_graphs needs backend 'eager'"):  # a pipeline's default backend
        GenerationOptions(cuda_graphs=True).resolved(tiny_pipe.preset, "compile")


def test_copy_ahead_hands_out_the_same_draws():
    from sdvg.generation.noise import block_noise, copy_ahead, gaussian

    shape = (1, 4, 3, 2, 2)
    noise = block_noise(shape, 5, 2)
    got = copy_ahead(noise, 5, 2, 4, "drafter", "cpu")
    assert torch.equal(got, noise)
    for step in (1, 2, 3):
        ahead = gaussian(shape, 5, 2, step, "drafter", "cpu")  # handed out once, then drawn again
        assert torch.equal(ahead, gaussian(shape, 5, 2, step, "drafter", "cpu"))


# ---------------------------------------------------------------- CUDA-graph semantics of the stand-in
def test_replay_capture_keeps_nothing_the_function_closed_over():
    """Like a CUDA graph, the stand-in holds addresses, not the tensors the captured function read: a
    replay reads the inputs' current values, and a replay after one of them was freed fails loudly
    (a CUDA graph would read whatever the allocator put there since)."""
    import gc
    import weakref

    capture = ReplayCapture("cpu")
    table = torch.arange(4.0)
    x = torch.ones(4)

    def fn():
        return x * table + 1

    replay, out = capture.capture(fn)
    x.fill_(2.0)
    replay()
    assert torch.equal(out, 2 * torch.arange(4.0) + 1)  # the static input's value now
    del fn
    gone = weakref.ref(table)
    del table
    gc.collect()
    assert gone() is None  # nothing but the closure held the table: the stand-in does not keep it
    with pytest.raises(RuntimeError, match="freed since the capture"):
        replay()


def test_graphs_hold_every_tensor_they_read(dit):
    """The RoPE tables a graph reads are held by the graph (a capture holds no reference to them), so
    replays after a garbage collection still give the eager result."""
    import gc

    from sdvg.models.kv_cache import KVCacheSpec

    graphs = DiTGraphs(roles=("target",), capture_factory=ReplayCapture)
    text = dit.encode_text(torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(4)))
    spec = KVCacheSpec.for_dit(dit.config, 16, 6)
    eager_cache = spec.allocate(dit.dtype, "cpu")
    cache = graphs.cache(dit, spec, dit.dtype, "cpu")
    x = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    for step in range(2):
        t = torch.full((1, 3), 900.0 - 300 * step)
        got = graphs.forward("target", dit, x, t, text, 0, cache)
        gc.collect()
        assert torch.equal(got, dit(x, t, text, 0, eager_cache))
    assert graphs.captured == 1 and graphs.replays == 2


@pytest.mark.parametrize("scheduler", [pytest.param("reference", marks=pytest.mark.slow), "cpp"])
def test_recompute_drafter_graphs_captured_up_front(tiny_pipe, scheduler):
    """A recompute drafter's graphs (its one-group context forwards, which now take no mask, and its
    steps after the context) are all captured before the scheduler starts, and replay the eager video."""
    graphs = DiTGraphs(capture_factory=ReplayCapture)
    tiny_pipe.runners().graphs = graphs
    kw = dict(mode="draft", num_blocks=3, drafter_cache="recompute", scheduler=scheduler)
    eager = tiny_pipe(PROMPT, seed=4, **kw)
    graphed = tiny_pipe(PROMPT, seed=4, cuda_graphs=True, **kw)
    assert _same(eager, graphed)
    stats = graphs.stats()
    assert stats["captured"] > 0 and stats["captured_late"] == 0 and stats["replays"] > 0
