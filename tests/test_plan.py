"""The block plan (sdvg/generation/plan.py): one forcing rule, a whole video's fixed plan, and what the
native scheduler is told (a decision or a threshold, never a routing rule of its own)."""
import math

import pytest

from sdvg._native import _C
import torch

from sdvg.generation.calls import TextKVCache
from sdvg.generation.plan import STOP, BlockStep, Conditioning, FixedPlan, forced_block, native_plan, recaching_roles
from sdvg.generation.routers import Router
from sdvg.options import GenerationOptions


@pytest.mark.parametrize("opts,block,after_switch,want", [
    (GenerationOptions(), 0, False, True),  # block 0 goes to the target (force_first_reject, the default)
    (GenerationOptions(), 1, False, False),
    (GenerationOptions(force_first_reject=False), 0, False, False),
    (GenerationOptions(), 3, True, True),  # a live prompt switch (force_reject_after_switch, the default)
    (GenerationOptions(force_reject_after_switch=False), 3, True, False),
    (GenerationOptions(force_first_reject=False), 0, True, False),  # a switch never forces block 0
    (GenerationOptions(mode="target"), 0, False, False),  # no draft to route outside sdvg mode
    (GenerationOptions(mode="draft"), 2, True, False),
])
def test_one_forcing_rule(opts, block, after_switch, want):
    assert forced_block(opts, block, after_switch) is want


PROMPT = Conditioning(("prompt", "a fox"), "a fox", torch.ones(1, 2, 3))


def test_a_fixed_plan_steps_through_the_video_then_stops():
    opts = GenerationOptions(num_blocks=3, router="pattern", pattern="011")
    plan = FixedPlan(opts, PROMPT)
    steps = [plan.begin(b) for b in range(4)]
    assert [(s.stop, s.last, s.forced) for s in steps[:3]] == [(False, False, True), (False, False, False),
                                                               (False, True, False)]
    assert steps[3] == STOP and all(s.router == Router.from_options(opts) for s in steps[:3])
    # one conditioning for every block, never a re-cache
    assert all(s.conditioning is PROMPT and s.recache == frozenset() for s in steps[:3])
    assert not plan.recaches and plan.max_held_commits is None and plan.record_blocks is None
    with pytest.raises(ValueError, match="num_blocks set"):
        FixedPlan(GenerationOptions(), PROMPT)


FULL = dict(drafter_cache="full", target_context="full")


@pytest.mark.parametrize("opts,block,keys,want", [
    (GenerationOptions(**FULL), 2, ("a", "b"), {"drafter", "target"}),  # a new conditioning: both full contexts
    (GenerationOptions(**FULL), 2, ("a", "a"), set()),  # the same one: nothing to redo
    (GenerationOptions(**FULL), 0, ("a", "b"), set()),  # block 0 has nothing before it
    (GenerationOptions(**FULL, recache=False), 2, ("a", "b"), set()),  # re-cache off: the old K/V stay
    (GenerationOptions(drafter_cache="full", target_context="recompute"), 2, ("a", "b"), {"drafter"}),  # rebuilt anyway
    (GenerationOptions(**FULL, mode="target"), 2, ("a", "b"), {"target"}),  # only the roles the mode runs
])
def test_one_recaching_rule(opts, block, keys, want):
    assert recaching_roles(opts, block, keys[1], keys[0]) == frozenset(want)


def test_text_kv_is_made_once_per_conditioning_and_role():
    class Dit:
        def __init__(self, scale):
            self.scale, self.calls = scale, 0

        def encode_text(self, emb):
            self.calls += 1
            return emb * self.scale

    drafter, target = Dit(2), Dit(3)
    seeded = torch.zeros(1)
    kv = TextKVCache({"drafter": drafter, "target": target}, {(PROMPT.key, "target"): seeded}, size=3)
    assert kv(PROMPT, "target") is seeded and target.calls == 0  # what prepare made is reused
    first = kv(PROMPT, "drafter")
    assert torch.equal(first, PROMPT.emb * 2) and kv(PROMPT, "drafter") is first and drafter.calls == 1
    other = Conditioning(("prompt", "b"), "b", torch.full((1, 2, 3), 5.0))  # another conditioning: its own K/V
    assert torch.equal(kv(other, "target"), other.emb * 3) and kv.encodes == 2
    kv(Conditioning(("x",), "x", torch.ones(1)), "target")  # past `size`: the oldest entry goes
    assert kv(PROMPT, "target") is not seeded and torch.equal(kv(PROMPT, "target"), PROMPT.emb * 3)


def test_the_native_plan_carries_a_decision_or_a_threshold():
    opts = GenerationOptions(num_blocks=4, router="pattern", pattern="0110")
    fixed = FixedPlan(opts, PROMPT)
    plans = [native_plan(fixed.begin(b), b, opts.seed) for b in range(5)]
    assert [p.accept for p in plans[:4]] == [False, True, True, False] and not any(p.scored for p in plans)
    assert plans[4].stop and plans[3].last and plans[0].forced
    # the random router's decision is its seeded draw under the probability, made in Python once
    rnd = GenerationOptions(num_blocks=6, router="random", accept_prob=0.5, seed=7)
    router = Router.from_options(rnd)
    got = [native_plan(FixedPlan(rnd, PROMPT).begin(b), b, rnd.seed).accept for b in range(6)]
    assert got == [router.uniform(b, 7) < 0.5 for b in range(6)]
    # the reward router hands over its threshold; an infinite one stays infinite
    reward = GenerationOptions(num_blocks=2, tau=-math.inf)
    p = native_plan(FixedPlan(reward, PROMPT).begin(1), 1, 0)
    assert p.scored and p.tau == -math.inf and not p.accept and not (p.drafter_recache or p.target_recache)
    assert isinstance(p, _C.BlockPlan)
    # the roles a step re-caches, one flag each
    step = BlockStep(False, router=Router.from_options(reward), conditioning=PROMPT, recache=frozenset({"target"}))
    p = native_plan(step, 1, 0)
    assert p.target_recache and not p.drafter_recache


def test_the_native_scheduler_asks_the_plan_once_per_block_in_order():
    from sdvg.generation.fake_stages import FakeStages, fake_scheduler

    for run_ahead in (False, True):
        stages = FakeStages()
        opts = GenerationOptions(num_blocks=5, router="pattern", pattern="01101", run_ahead=run_ahead,
                                 drafter_context="committed")
        fake_scheduler(stages, opts).run()
        assert stages.planned == [0, 1, 2, 3, 4]  # none past the last block
        assert [b.decision for b in stages.emitted] == ["forced", "accepted", "accepted", "rejected", "accepted"]


def test_fake_stages_without_a_video_say_so():
    from sdvg.generation.fake_stages import FakeStages

    with pytest.raises(RuntimeError, match="no video to plan"):
        FakeStages().plan(0)
