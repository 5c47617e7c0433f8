"""The typed boundary of sdvg._C: SchedulerConfig (every field a required keyword), the name
tuples exported once from C++, and the Counters both schedulers count into."""
import math

import pytest
import torch

from sdvg._native import _C
from sdvg.options import GenerationOptions

FIELDS = dict(mode="sdvg", num_blocks=5, frames_per_block=3, prefix_frames=0, drafter_steps=4,
              drafter_recompute=False, target_recompute=False, own_context=False, skips_first_draft=True,
              lazy_target_commit=False,
              score_emitted=True, run_ahead=True, run_ahead_blocks=2, live=False, max_held_target_commits=0,
              record_blocks=0)


def _config(**changes):
    return _C.SchedulerConfig(**{**FIELDS, **changes})


def test_fields_are_the_keyword_set():
    assert isinstance(_C.SchedulerConfig.FIELDS, tuple)
    assert set(_C.SchedulerConfig.FIELDS) == set(FIELDS)
    assert len(_C.SchedulerConfig.FIELDS) == len(FIELDS)
    assert _C.SchedulerConfig.FIELDS[0] == "mode"


def test_every_field_round_trips():
    c = _config()
    for name, value in FIELDS.items():
        got = getattr(c, name)
        assert got == value and type(got) is type(value), name
    for mode in ("sdvg", "target", "draft"):
        assert _config(mode=mode).mode == mode


def test_fields_are_read_only():
    c = _config()
    for name in FIELDS:
        with pytest.raises(AttributeError):
            setattr(c, name, getattr(c, name))


def test_repr_names_every_field():
    r = repr(_config())
    assert r.startswith("SchedulerConfig(mode='sdvg', num_blocks=5,")
    for name in FIELDS:
        assert f"{name}=" in r
    assert "mode='sdvg'" in r and "skips_first_draft=True" in r


def test_a_start_frames_prefix_is_a_non_negative_frame_count():
    assert _config(prefix_frames=3).prefix_frames == 3
    with pytest.raises(ValueError, match="prefix_frames -1 must be >= 0"):
        _config(prefix_frames=-1)


def test_a_live_config_has_no_block_count_and_a_non_negative_cap():
    c = _config(live=True, num_blocks=0, max_held_target_commits=4)
    assert c.live and c.num_blocks == 0 and c.max_held_target_commits == 4
    with pytest.raises(ValueError, match="num_blocks 5 must be 0 for a live video"):
        _config(live=True)
    with pytest.raises(ValueError, match="max_held_target_commits -1 must be >= 0"):
        _config(max_held_target_commits=-1)
    with pytest.raises(ValueError, match="record_blocks -2 must be >= 0"):
        _config(record_blocks=-2)


def test_block_plan_fields_are_typed_keywords():
    # no router names, draws or patterns: the plan carries a decision (`accept`) or a threshold (`scored`, `tau`)
    assert _C.BlockPlan.FIELDS == ("stop", "last", "forced", "drafter_recache", "target_recache", "scored", "tau",
                                   "accept")
    empty = _C.BlockPlan()
    assert tuple(getattr(empty, f) for f in _C.BlockPlan.FIELDS) == (False,) * 6 + (0.0, False)
    p = _C.BlockPlan(last=True, scored=True, tau=1)
    assert p.last and p.scored and p.tau == 1.0
    assert _C.BlockPlan(tau=-math.inf).tau == -math.inf and _C.BlockPlan(accept=True).accept
    with pytest.raises(ValueError, match="unknown field 'block'; the fields are stop, last"):
        _C.BlockPlan(block=3)
    with pytest.raises(ValueError, match="unknown field 'router'"):
        _C.BlockPlan(router="random")
    with pytest.raises(TypeError, match="BlockPlan field 'stop' must be a bool, got int 1"):
        _C.BlockPlan(stop=1)
    with pytest.raises(ValueError, match="must not be NaN"):
        _C.BlockPlan(tau=math.nan)


def test_the_scheduler_asks_the_stage_calls_for_plans():
    """StageCalls.plan is a virtual with a clear error when not overridden (the scheduler asks it for every block)."""
    class NoPlan(_C.StageCalls):
        pass

    with pytest.raises(RuntimeError, match=r"StageCalls.plan\(0\) for every block, but this StageCalls does not "
                                           "override plan"):
        NoPlan().plan(0)


def test_unknown_key_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown field 'temperature'; the fields are mode, num_blocks, .*run_ahead"):
        _config(temperature=1.0)
    with pytest.raises(ValueError, match=r"unknown fields 'a', 'b'"):
        _config(a=1, b=2)


def test_missing_key_is_refused_by_name():
    kw = dict(FIELDS)
    del kw["run_ahead"]
    with pytest.raises(ValueError, match=r"missing field 'run_ahead'; every field is required"):
        _C.SchedulerConfig(**kw)
    with pytest.raises(ValueError, match=r"missing fields 'mode', 'num_blocks'"):
        _C.SchedulerConfig()
    with pytest.raises(TypeError):
        _C.SchedulerConfig("sdvg")  # keywords only


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match=r"unknown mode 'fast'; choose sdvg, target or draft"):
        _config(mode="fast")


@pytest.mark.parametrize("field,value,want", [
    ("mode", 0, "a str"),
    ("num_blocks", 2.0, "an int"),
    ("num_blocks", True, "an int"),
    ("frames_per_block", "3", "an int"),
    ("skips_first_draft", 1, "a bool"),
    ("run_ahead", None, "a bool"),
])
def test_wrong_types_are_refused_by_field(field, value, want):
    with pytest.raises(TypeError, match=f"field '{field}' must be {want}"):
        _config(**{field: value})


def test_out_of_range_values_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"num_blocks 0 must be >= 1"):
        _config(num_blocks=0)
    with pytest.raises(ValueError, match=r"drafter_steps -1 must be >= 1"):
        _config(drafter_steps=-1)
    with pytest.raises(ValueError, match=r"run_ahead_blocks 0 must be >= 1"):
        _config(run_ahead_blocks=0)
    with pytest.raises(ValueError, match=r"recompute drafter cannot roll back"):
        _config(drafter_recompute=True, own_context=False, run_ahead=True)
    with pytest.raises(ValueError, match=r"field 'num_blocks' = \d+ is out of range"):
        _config(num_blocks=2**40)


def test_names_tuples():
    assert _C.STAGE_NAMES == ("draft", "decode", "score", "target", "drafter_commit", "target_commit", "recache")
    assert _C.DECISION_NAMES == ("forced", "accepted", "rejected", "target", "draft")
    assert _C.COUNTER_NAMES == ("target_forwards", "drafter_forwards", "skipped_drafter_forwards",
                                "skipped_target_commits", "skipped_drafter_commits", "redrafts",
                                "speculative_drafts", "scheduler_wall_s", "stage_call_s", "main_stage_s")


def test_counters_attributes_equal_counter_names():
    c = _C.Counters()
    public = tuple(n for n in dir(c) if not n.startswith("_") and not callable(getattr(c, n)))
    assert set(public) == set(_C.COUNTER_NAMES)
    assert tuple(c.as_dict()) == _C.COUNTER_NAMES  # in struct order
    assert all(v == 0 for v in c.as_dict().values())
    c.redrafts += 2
    c.stage_call_s = 1.5
    assert c.as_dict()["redrafts"] == 2 and c.stage_call_s == 1.5
    assert repr(c).startswith("Counters(target_forwards=0,") and "redrafts=2" in repr(c)
    with pytest.raises(TypeError):
        c.redrafts = "two"


def test_both_loops_use_the_native_names():
    from sdvg.generation import types

    assert types.STAGE_NAMES == _C.STAGE_NAMES and types.COUNTER_NAMES == _C.COUNTER_NAMES
    assert types.BLOCK_TIME_KEYS == (*_C.STAGE_NAMES, "commit") and types.Counters is _C.Counters


def _stages(drafter_cache, target_cache, score=None, **options):
    """The shared fake, writing into the given caches as a DiT forward does, planning the 5-block video of
    `options` (default: the random router, which decides without a score); every draft scored `score`."""
    from sdvg.generation.fake_stages import FakeStages
    from sdvg.options import GenerationOptions

    stages = FakeStages(score=score, options=GenerationOptions(**{"num_blocks": 5, "router": "random", **options}))
    stages.caches = {"drafter": drafter_cache, "target": target_cache}
    return stages


def _cache(frames=15):
    return _C.KVCache(1, 1, 1, 1, 1, _C.SlotLayout(frames), torch.float32, torch.device("cpu"))


def test_scheduler_takes_the_struct_and_returns_counters():
    cpu = torch.device("cpu")
    d, t = _cache(), _cache()
    s = _C.Scheduler(_config(run_ahead=False), _stages(d, t), d, t, cpu, cpu)
    s.run()
    c = s.counters()
    assert isinstance(c, _C.Counters)
    assert tuple(c.as_dict()) == _C.COUNTER_NAMES
    assert c.scheduler_wall_s > 0 and c.skipped_drafter_forwards == 4
    assert [tuple(b) for b in s.block_times()] == [_C.STAGE_NAMES] * 5
    assert {x["stage"] for x in s.trace()} <= set(_C.STAGE_NAMES)
    assert d.committed_frames == 12  # every block but the last
    with pytest.raises(TypeError):
        _C.Scheduler(dict(FIELDS), _stages(d, t), d, t, cpu, cpu)  # a dict is no config


def test_missing_cache_is_refused_by_role():
    cpu = torch.device("cpu")
    d, t = _cache(), _cache()
    with pytest.raises(RuntimeError, match=r"mode 'sdvg' runs the drafter, but drafter_cache is None"):
        _C.Scheduler(_config(), _stages(d, t), None, t, cpu, cpu)
    with pytest.raises(RuntimeError, match=r"mode 'target' runs the target, but target_cache is None"):
        _C.Scheduler(_config(mode="target"), _stages(d, t), d, None, cpu, cpu)
    with pytest.raises(TypeError, match=r"drafter_cache must be an sdvg._C.KVCache or None, got dict"):
        _C.Scheduler(_config(), _stages(d, t), {}, t, cpu, cpu)
    for mode, caches in (("target", (None, _cache())), ("draft", (_cache(), None))):
        stages = _stages(*caches, mode=mode)
        _C.Scheduler(_config(mode=mode), stages, *caches, cpu, cpu).run()  # the unused role needs no cache
        assert [r.decision for r in stages.emitted] == [mode] * 5


def test_kv_cache_has_no_discard_or_reset():
    assert not hasattr(_C.KVCache, "discard") and not hasattr(_C.KVCache, "reset")


# ------------------------------------------------------------------ the typed stage boundary
def test_stages_must_be_a_stage_calls_subclass():
    cpu = torch.device("cpu")
    d, t = _cache(), _cache()

    class Duck:  # every method by name, but not the typed boundary
        def draft(self, block):
            return torch.zeros(1)

    with pytest.raises(TypeError, match=r"stages must be an sdvg._C.StageCalls subclass instance"):
        _C.Scheduler(_config(run_ahead=False), Duck(), d, t, cpu, cpu)


def test_a_stage_method_left_out_is_named():
    from sdvg.generation.fake_stages import FakeStages

    class NoScore(FakeStages):
        score = _C.StageCalls.score  # the pure virtual, as if never overridden

    cpu = torch.device("cpu")
    d, t = _cache(), _cache()
    stages = NoScore(score=None, options=GenerationOptions(num_blocks=5, router="pattern", pattern="011"))
    stages.caches = {"drafter": d, "target": t}
    with pytest.raises(RuntimeError, match=r"StageCalls::score"):
        _C.Scheduler(_config(run_ahead=False), stages, d, t, cpu, cpu).run()


def test_decode_and_score_are_told_the_producer_and_block():
    cpu = torch.device("cpu")
    d, t = _cache(), _cache()
    stages = _stages(d, t, score=(1.0, [1.0, 2.0]), router="pattern", pattern="010", num_blocks=3)
    _C.Scheduler(_config(run_ahead=False, num_blocks=3), stages, d, t, cpu, cpu).run()
    assert stages.producers == [("decode", "target", 0), ("score", "target", 0),  # block 0: forced, no draft
                                ("decode", "drafter", 1), ("score", "drafter", 1),  # accepted
                                ("decode", "drafter", 2), ("score", "drafter", 2), ("decode", "target", 2),
                                ("score", "target", 2)]  # rejected; score_emitted scores the target's frames
    assert _C.ROLE_NAMES == ("drafter", "target")


def test_every_emitted_field_reaches_python():
    """The scheduler's EmittedBlock: every field read (redrafts included: per block in the stats)."""
    cpu = torch.device("cpu")
    d, t = _cache(), _cache()
    stages = _stages(d, t, score=(1.0, [1.0, 2.0]), router="pattern", pattern="01001", drafter_context="committed")
    s = _C.Scheduler(_config(run_ahead=True, own_context=False), stages, d, t, cpu, cpu)
    s.run()
    fields = {n for n in dir(_C.EmittedBlock) if not n.startswith("_")}
    assert fields == {"index", "decision", "latents", "frames", "draft_latents", "score", "frame_scores",
                      "emitted_scores", "times", "redrafts"}
    assert sum(b.redrafts for b in stages.emitted) == s.counters().redrafts > 0
    assert [b.index for b in stages.emitted] == list(range(5))
    assert set(stages.emitted[1].times) == set(_C.STAGE_NAMES)


@pytest.mark.slow
def test_redrafts_per_block_in_the_stats(tiny_pipe):
    out = tiny_pipe("a red fox", num_blocks=4, router="pattern", pattern="0100", drafter_context="committed",
                    run_ahead=True)
    blocks = out.stats["blocks"]
    assert sum(b["redrafts"] for b in blocks) == out.stats["result"]["redrafts"] > 0


# ------------------------------------------------------------------ stream order (recorded, any device)
def _stream_log(options):
    from sdvg.generation.fake_stages import FakeStages, fake_scheduler

    stages = FakeStages()
    s = fake_scheduler(stages, options, log_streams=True)
    s.run()
    return s.stream_log()


def _waits(log):
    """Every cross-lane hand-over: (consumer, producer) of each wait, checked against its record."""
    recorded, out = {}, []
    for i, line in enumerate(log):
        words = line.split()
        if words[0] == "record":
            recorded[words[2]] = (words[1], i)
        elif words[0] == "wait":
            consumer, producer, handle = words[1], words[3], words[4]
            assert handle in recorded and recorded[handle] == (producer, recorded[handle][1]), line
            assert recorded[handle][1] < i, f"{line}: waits for an event not yet recorded"
            out.append((consumer, producer))
    return out


@pytest.mark.parametrize("run_ahead", [False, True])
def test_every_lane_waits_for_the_setup_and_each_hand_over(run_ahead):
    from sdvg.options import GenerationOptions

    log = _stream_log(GenerationOptions(router="pattern", pattern="0110", num_blocks=5, run_ahead=run_ahead,
                                        drafter_context="committed", lazy_target_commit=False))
    assert log[:3] == ["setup -> drafter", "setup -> target", "setup -> vae"]  # before any stage call
    waits = set(_waits(log))
    # drafts decoded (vae on drafter), target blocks decoded (vae on target), accepted drafts into the target,
    # target blocks into the committed drafter context; emit reads every block's tensors on the vae lane
    assert {("vae", "drafter"), ("vae", "target"), ("target", "drafter"), ("drafter", "target")} <= waits
    assert {("vae", "vae")} <= waits  # emit: the frames decoded on the vae lane
