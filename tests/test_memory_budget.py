"""The memory check each video passes before its KV caches are allocated: what it counts is what
`prepare` allocates (the very KVCacheSpec; the plan of `sdvg memory` shares the arithmetic), and a
video that does not fit the device's free memory, or the given budget, is refused before anything
of it is allocated."""
import math
import re

import pytest
import torch

from sdvg import SpeculativeVideoPipeline
from sdvg.config import get_preset
from sdvg.generation.prepare import prepare
from sdvg.generation.types import Counters
from sdvg.generation.video_memory import video_memory
from sdvg.models.kv_cache import KVCacheSpec, MemoryBudgetError
from sdvg.models.memory import GIB, available_bytes, plan_memory
from sdvg.options import GenerationOptions

PROMPT = "a red fox running through fresh snow"
TINY_KV_PER_BLOCK = 3 * 16 * 4 * 2 * (2 * 32 + 3 * 64)  # frames x tokens x fp32 x (K, V) x (drafter + target widths)


@pytest.fixture()
def nothing_allocated(monkeypatch, tiny_pipe):
    """Fail the test if a KV cache is allocated or the prompt encoded."""
    monkeypatch.setattr(KVCacheSpec, "allocate", lambda *a, **k: pytest.fail("a KV cache was allocated"))
    monkeypatch.setattr(tiny_pipe.components.text_encoder, "encode", lambda *a: pytest.fail("the prompt was encoded"))


@pytest.mark.parametrize("scheduler", ["reference", "cpp"])
def test_a_million_blocks_are_refused_before_any_allocation(tiny_pipe, nothing_allocated, scheduler):
    free, source = available_bytes("cpu")
    assert free is not None and "MemAvailable" in source
    num_blocks = max(10**6, 2 * free // TINY_KV_PER_BLOCK)  # 10**6: 91.6 GiB of KV cache; more on a big host
    with pytest.raises(MemoryBudgetError) as err:
        tiny_pipe(PROMPT, num_blocks=num_blocks, scheduler=scheduler)
    msg = str(err.value)
    assert msg.startswith(f"device cpu: this video needs {num_blocks * TINY_KV_PER_BLOCK / GIB:.2f} GiB but ")
    assert "is available RAM (MemAvailable, /proc/meminfo); nothing was allocated" in msg
    frames = 3 * num_blocks
    assert f"(full: {frames} frames x 16 tokens x 3 layers x 2 (K, V) x 64 x 4 B)" in msg  # the target's
    assert f"(full: {frames} frames x 16 tokens x 2 layers x 2 (K, V) x 32 x 4 B)" in msg  # the drafter's
    assert f"fewer blocks (num_blocks is {num_blocks})" in msg and "target_context='recompute'" in msg
    assert "window_frames=" in msg and "a larger budget (memory_budget_gib=" in msg
    if num_blocks == 10**6:
        assert re.search(r"drafter KV cache +22.89 GiB", msg) and re.search(r"target KV cache +68.66 GiB", msg)


def test_the_recompute_context_makes_the_same_length_fit(tiny_pipe):
    """Under recompute both caches hold kv_cache_frames + one block whatever the length: 10**6 blocks fit
    (only prepare runs here: the caches are allocated, no block is generated)."""
    opts = tiny_pipe.resolve(GenerationOptions(num_blocks=10**6, target_context="recompute",
                                               drafter_cache="recompute"))
    items = {it.what: it for it in video_memory(tiny_pipe.components, opts)}
    assert items["target KV cache"].arithmetic == "recompute: 6 frames x 16 tokens x 3 layers x 2 (K, V) x 64 x 4 B"
    setup = prepare(tiny_pipe.components, PROMPT, opts, Counters())
    assert setup.target.cache.buffer.numel() * 4 == items["target KV cache"].nbytes


@pytest.mark.slow
def test_a_budget_that_fits_runs_and_one_that_does_not_is_refused(tiny_pipe, tiny_preset):
    pipe = SpeculativeVideoPipeline(tiny_pipe.components, memory_budget_gib=0.5)
    out = pipe(PROMPT, num_blocks=2, seed=1, tau=0.0)
    assert out.frames.shape[:2] == (1, 21) and torch.equal(out.latents, tiny_pipe(PROMPT, num_blocks=2, seed=1,
                                                                            tau=0.0).latents)
    pipe.memory_budget_gib = 0.004  # 4.1 MiB: the tiny weights (4.9 MiB in fp32) do not fit
    with pytest.raises(MemoryBudgetError) as err:
        pipe(PROMPT, num_blocks=2, seed=1)
    msg = str(err.value)
    assert msg.startswith("device cpu: it would hold ") and "over the budget of 0.004 GiB (memory_budget_gib)" in msg
    for what in ("drafter weights", "target weights", "VAE weights", "ImageReward weights", "umT5 text encoder weights",
                 "drafter KV cache", "target prompt K/V"):
        assert what in msg


@pytest.mark.parametrize("bad,error", [(math.nan, ValueError), (-1.0, ValueError), (0, ValueError),
                                       (math.inf, ValueError), (True, TypeError), ("8", TypeError)])
def test_bad_budgets_are_refused(tiny_pipe, bad, error):
    with pytest.raises(error, match="memory_budget_gib must be"):
        SpeculativeVideoPipeline(tiny_pipe.components, memory_budget_gib=bad)
    pipe = SpeculativeVideoPipeline(tiny_pipe.components)
    with pytest.raises(error, match="memory_budget_gib must be"):
        pipe.memory_budget_gib = bad
    with pytest.raises(error, match="memory_budget_gib must be"):
        SpeculativeVideoPipeline.from_preset("tiny", memory_budget_gib=bad)
    assert pipe.memory_budget_gib is None


@pytest.mark.parametrize("kw", [
    dict(),
    dict(target_context="recompute", drafter_cache="recompute", kv_cache_frames=4),
    dict(window_frames=6, sink_frames=3, run_ahead=True, drafter_context="committed"),
])
def test_the_check_counts_what_prepare_allocates(tiny_pipe, kw):
    """Each counted KV cache is the allocated buffer to the byte (windows with run-ahead slack included);
    the prompt K/V are the encoded ones; the plan of `sdvg memory` gives the same numbers."""
    from sdvg.generation.native import setup_slack

    comps = tiny_pipe.components
    opts = tiny_pipe.resolve(GenerationOptions(num_blocks=5, **kw))
    slack = setup_slack(comps, opts.run_ahead)
    items = {it.what: it for it in video_memory(comps, opts, slack)}
    setup = prepare(comps, PROMPT, opts, Counters(), slack_frames=slack)
    for role in ("drafter", "target"):
        rm = getattr(setup, role)
        assert rm.cache.buffer.numel() * rm.cache.buffer.element_size() == items[f"{role} KV cache"].nbytes
        kv = setup.text_kv[setup.conditioning.key, role]
        text = sum(t.numel() * t.element_size() for t in (*kv.keys, *kv.values))
        assert text == items[f"{role} prompt K/V"].nbytes
    plan = {it.what: it for it in plan_memory(comps.preset, {r: opts.role_context(r) for r in ("drafter", "target")},
                                              opts.num_blocks, "cpu", "cpu", "cpu")}
    for what in ("target KV cache", "drafter prompt K/V", "target prompt K/V") + (() if slack else ("drafter KV cache",)):
        assert (plan[what].nbytes, plan[what].arithmetic) == (items[what].nbytes, items[what].arithmetic), what
    if slack:  # run-ahead widens the drafter's window by two blocks of slack: the plan has none
        assert items["drafter KV cache"].nbytes == plan["drafter KV cache"].nbytes * (6 + 3 + 6) // (6 + 3)
        assert "window 6 + sink 3 + slack 6" in items["drafter KV cache"].arithmetic


@pytest.mark.parametrize("kw", [
    dict(),
    dict(target_context="recompute", drafter_cache="recompute", kv_cache_frames=4),
])
def test_a_start_frames_frames_are_counted_as_prepare_allocates(tiny_pipe, kw):
    """A start frame's kv_cache_frames latent frames sit in every full context before block 0: the check and
    the plan of `sdvg memory` count them as `prepare` allocates them (a recompute context is unchanged)."""
    import numpy as np

    comps = tiny_pipe.components
    opts = tiny_pipe.resolve(GenerationOptions(num_blocks=3, **kw))
    v = comps.preset.video
    latents = tiny_pipe.start_latents(np.full((v.height, v.width, 3), 128, np.uint8), opts)
    n = latents.shape[2]
    assert n == opts.kv_cache_frames
    items = {it.what: it for it in video_memory(comps, opts, prefix_frames=n)}
    bare = {it.what: it for it in video_memory(comps, opts)}
    setup = prepare(comps, PROMPT, opts, Counters(), start_latents=latents)
    contexts = {r: opts.role_context(r) for r in ("drafter", "target")}
    plan = {it.what: it for it in plan_memory(comps.preset, contexts, opts.num_blocks, "cpu", "cpu", "cpu", n)}
    for role in ("drafter", "target"):
        rm, what = getattr(setup, role), f"{role} KV cache"
        assert rm.cache.buffer.numel() * rm.cache.buffer.element_size() == items[what].nbytes
        assert (plan[what].nbytes, plan[what].arithmetic) == (items[what].nbytes, items[what].arithmetic)
        frames = opts.num_blocks * v.frames_per_block
        grown = 1 if contexts[role].recompute else (frames + n) / frames
        assert items[what].nbytes == bare[what].nbytes * grown, role


def test_sdvg_memory_counts_a_start_frame(capsys):
    """`sdvg memory --start-frame [IMAGE]`: the drafter's full 27-frame context holds the start frame's 3 latent
    frames too (the image is not read); the target's recompute context is unchanged; what a start frame cannot go
    with is refused in the command line's words."""
    import json

    from sdvg.cli.main import main

    def memory(*argv):
        capsys.readouterr()
        try:
            code = main(["memory", "--preset", "wan2.1", *argv])
        except SystemExit as exc:
            code = exc.code
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = memory("--json")
    plan = {it["what"]: it["gib"] for it in json.loads(out)["items"]}
    code, out, _ = memory("--json", "--start-frame", "not-read.png")
    framed = json.loads(out)
    assert code == 0 and framed["start_frame_latent_frames"] == 3
    got = {it["what"]: it["gib"] for it in framed["items"]}
    assert got["drafter KV cache"] == pytest.approx(plan["drafter KV cache"] * (27 + 3) / 27)
    assert got["target KV cache"] == plan["target KV cache"]
    code, out, _ = memory("--start-frame")
    assert code == 0 and "27 latent frames, after a start frame of 3" in out
    code, _, err = memory("--start-frame", "--backend", "tensorrt")
    assert code == 2 and "--start-frame with --backend 'tensorrt'" in err and "--backend eager" in err
    code, _, err = memory("--start-frame", "--window-frames", "2")
    assert code == 2 and "raise --window-frames to 3 or more, or lower --kv-cache-frames" in err, err


def test_the_wan_plan_numbers_are_unchanged():
    """`sdvg memory`'s numbers for the real sizes (KVCacheSpec.nbytes through the shared arithmetic)."""
    from sdvg.config import RoleContext

    p = get_preset("wan2.1")
    items = {it.what: it for it in plan_memory(p, {"drafter": RoleContext(), "target": RoleContext("recompute")},
                                               p.video.num_blocks, "cuda:0", "cuda:1", "cuda:0")}
    assert items["target KV cache"].nbytes == 40 * 2 * 40 * 128 * 6 * 1560 * 2  # 7.14 GiB
    assert items["target KV cache"].arithmetic == "recompute: 6 frames x 1560 tokens x 40 layers x 2 (K, V) x 5120 x 2 B"
    assert items["drafter KV cache"].nbytes == 30 * 2 * 1536 * 27 * 1560 * 2
    assert items["target prompt K/V"].nbytes == 40 * 2 * 512 * 5120 * 2


@pytest.mark.gpu
def test_cuda_budget_is_the_free_memory_and_the_count_is_what_is_allocated():
    pipe = SpeculativeVideoPipeline.from_preset("tiny", device="cuda:0")
    comps = pipe.components
    free, source = available_bytes("cuda:0")
    assert "mem_get_info" in source
    with pytest.raises(MemoryBudgetError, match=r"^device cuda:0: this video needs .* is free memory"):
        pipe(PROMPT, num_blocks=int(2 * free // TINY_KV_PER_BLOCK))
    opts = pipe.resolve(GenerationOptions(num_blocks=200))
    need = sum(it.nbytes for it in video_memory(comps, opts))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated("cuda:0")
    setup = prepare(comps, "a prompt never encoded before", opts, Counters())
    torch.cuda.synchronize()
    emb = comps.text_encoder.cache["a prompt never encoded before"]
    grown = torch.cuda.memory_allocated("cuda:0") - before - emb.numel() * emb.element_size()
    assert need <= grown <= need + 2**20, (need, grown)  # allocator rounding only
    del setup


def test_an_offloaded_text_encoders_visit_is_checked_on_its_device(tiny_pipe):
    """An offloaded umT5 comes to its execution device to encode a new prompt (before the caches are
    allocated): that visit is checked there, and not once the prompt is cached."""
    import dataclasses
    from types import SimpleNamespace

    from sdvg.generation.video_memory import check_memory

    te = tiny_pipe.components.text_encoder
    fake = SimpleNamespace(model=te.model, execution_device=torch.device("cuda:0"), offload_device=torch.device("cpu"),
                           cache={})
    comps = dataclasses.replace(tiny_pipe.components, text_encoder=fake)
    opts = tiny_pipe.resolve(GenerationOptions(num_blocks=2))
    with pytest.raises(MemoryBudgetError, match=r"(?s)^device cuda:0: it would hold 0.00 GiB .*umT5 text encoder "
                                                r"\(visits to encode the prompt\) .*offloaded: 24.86K x 4 B"):
        check_memory(comps, opts, memory_budget_gib=1e-5, prompt=PROMPT)
    fake.cache[PROMPT] = None  # encoded before: no visit; the video itself is on the cpu, over 1e-5 GiB
    with pytest.raises(MemoryBudgetError, match=r"^device cpu: "):
        check_memory(comps, opts, memory_budget_gib=1e-5, prompt=PROMPT)
    assert check_memory(comps, opts, memory_budget_gib=0.5, prompt=PROMPT)
