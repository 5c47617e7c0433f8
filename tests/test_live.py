"""Live sessions, the fast parts: Krea's blend weights and the per-block conditioning table, update and
schedule validation, the refusals made before any work (docs/live.md)."""
import json

import pytest
import torch

from sdvg.live import ConditioningTable, PromptBank, Update, blend_weights, parse_schedule
from sdvg.live.updates import UpdateError
from sdvg.options import OptionError


class FakeEncoder:
    """prompt -> a fixed random [1, 5, 8] embedding; counts its calls."""

    def __init__(self):
        self.calls = []

    def encode(self, prompt):
        self.calls.append(prompt)
        g = torch.Generator().manual_seed(sum(map(ord, prompt)))
        return torch.randn(1, 5, 8, generator=g)


def test_blend_weights_follow_krea_linspace_first_at_zero():
    assert blend_weights(4) == torch.linspace(0, 1, 4).tolist()
    assert blend_weights(4)[0] == 0.0 and blend_weights(4)[-1] == 1.0
    assert blend_weights(2) == [0.0, 1.0]
    assert blend_weights(1) == [1.0]  # departure: Krea's linspace(0, 1, 1) = [0] never switches


def test_table_blends_as_krea_lerp_bitwise_and_encodes_each_prompt_once():
    enc = FakeEncoder()
    table = ConditioningTable(PromptBank(enc), "a fox")
    fox, owl = enc.encode("a fox"), enc.encode("an owl")
    enc.calls.clear()
    table.freeze(0), table.freeze(1)
    table.switch(2, "an owl", 4)
    conds = [table.freeze(b) for b in range(2, 8)]
    # Krea: torch.lerp(old, new, linspace(0, 1, n)) over a batch, one chunk per block
    krea = torch.lerp(fox, owl, torch.linspace(0, 1, steps=4).unsqueeze(1).unsqueeze(2)).chunk(4, dim=0)
    for c, want in zip(conds[:4], krea):
        assert torch.equal(c.emb, want)
    assert [c.weight for c in conds] == blend_weights(4) + [1.0, 1.0]
    assert [c.first_new for c in conds] == [False, True, False, False, False, False]
    assert torch.equal(conds[0].emb, fox) and torch.equal(conds[-1].emb, owl)
    assert all(c.prompt_index == 1 for c in conds)
    table.switch(8, "a fox", 2)  # back: encoded already
    assert torch.equal(table.freeze(8).emb, owl) and torch.equal(table.freeze(9).emb, fox)
    assert enc.calls == ["an owl"] and table.bank.encodes == 2


def test_a_switch_mid_blend_starts_from_the_current_blend_and_interp_1_switches_at_once():
    enc = FakeEncoder()
    table = ConditioningTable(PromptBank(enc), "a")
    table.freeze(0)
    table.switch(1, "b", 3)
    mid = [table.freeze(1), table.freeze(2)][-1]  # weight 0.5 of b
    table.switch(3, "c", 1)
    now = table.freeze(3)
    assert now.weight == 1.0 and now.first_new and torch.equal(now.emb, enc.encode("c"))
    table.switch(4, "a", 2)
    assert torch.equal(table.freeze(4).emb, now.emb)
    with pytest.raises(RuntimeError, match="frozen"):
        table.switch(4, "b", 2)
    assert mid.weight == 0.5


def test_text_kv_is_rebuilt_only_when_the_conditioning_changes():
    from sdvg.generation.calls import TextKVCache
    from sdvg.generation.plan import Conditioning

    enc = FakeEncoder()
    table = ConditioningTable(PromptBank(enc), "a")

    class Dit:
        calls = 0

        def encode_text(self, emb):
            Dit.calls += 1
            return emb * 2

    kv = TextKVCache({"drafter": Dit(), "target": Dit()})

    def text_kv(block, role):  # what the stage calls pass to a forward of the block: its frozen conditioning's K/V
        cond = table.frozen[block]
        return kv(Conditioning(cond.key, cond.prompt, cond.emb), role)

    table.freeze(0), table.freeze(1)
    assert text_kv(0, "drafter") is text_kv(1, "drafter")
    table.switch(2, "b", 2)
    table.freeze(2), table.freeze(3)
    assert text_kv(2, "drafter") is text_kv(1, "drafter")  # weight 0: the old one
    assert torch.equal(text_kv(3, "target"), enc.encode("b") * 2)
    assert Dit.calls == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt=""), "prompt is empty"), (dict(prompt=3), "prompt must be a string"),
    (dict(prompt="x", interp_blocks=0), "interp_blocks 0 must be an integer in"),
    (dict(prompt="x", interp_blocks=10**6), "interp_blocks 1000000 must be an integer in"),
    (dict(prompt="x", interp_blocks=True), "interp_blocks must be an integer"),
    (dict(interp_blocks=2), "without a prompt"), (dict(), "changes nothing"),
    (dict(seed=-1), "seed -1"), (dict(tau=float("nan")), "tau is NaN"), (dict(reset=1), "reset must be"),
    (dict(router="greedy"), "unknown router 'greedy'; choose one of reward, random, pattern"),
    (dict(accept_prob=2.0), "accept_prob 2.0 must lie in"), (dict(pattern="012"), "only 0 and 1"),
])
def test_bad_updates_are_refused_by_name(kwargs, match):
    with pytest.raises(UpdateError, match=match):
        Update(**kwargs)


def test_schedule_formats_round_trip(tmp_path):
    entries = [{"block": 0, "prompt": "a fox"}, {"block": 3, "prompt": "an owl", "interp_blocks": 2},
               {"block": 5, "seed": 4, "reset": True}, {"block": 6, "tau": -1.0},
               {"block": 7, "router": "pattern", "pattern": "0110"}, {"block": 8, "router": "random", "accept_prob": 0.5}]
    out = parse_schedule(entries)
    assert out[0] == (0, "a fox") and out[1] == (3, Update("an owl", 2))
    assert [u.as_entry(b) for b, u in out[1:]] == entries[1:]
    assert parse_schedule([(0, "a"), (2, "b")]) == [(0, "a"), (2, Update("b"))]
    assert parse_schedule(out) == out  # parsed already
    (tmp_path / "s.json").write_text(json.dumps(entries))
    (tmp_path / "s.yaml").write_text("- {block: 0, prompt: a fox}\n- {block: 3, prompt: an owl, interp_blocks: 2}\n")
    assert parse_schedule(tmp_path / "s.json") == out
    assert parse_schedule(str(tmp_path / "s.yaml")) == out[:2]
    assert out[4][1].router_changes == {"router": "pattern", "pattern": (False, True, True, False)}


def test_router_updates_are_checked_against_the_sessions_router_and_take_effect_at_their_block(tiny_pipe):
    s = tiny_pipe.session("a fox", num_blocks=2, scheduler="reference")  # the reward router
    Update(router="pattern")  # fine alone; the session has no pattern to go with it:
    with pytest.raises(UpdateError, match="'pattern' with router 'pattern' needs a decision pattern"):
        s.update(router="pattern")
    assert s.updates == [] and s.stats.extra["updates"] == []  # a refused update changes nothing
    s.close()
    s = tiny_pipe.session("a fox", num_blocks=3, scheduler="reference", router="pattern", pattern="011")
    ack = s.update(pattern="000")  # from block 0 (nothing started yet): every block goes to the target
    assert ack.block == 0 and s.stats.extra["updates"] == [{"block": 0, "pattern": "000"}]
    assert [b.decision for b in s] == ["forced", "rejected", "rejected"]


@pytest.mark.parametrize("schedule, match", [
    ([], "non-empty list"), ([(1, "a")], "start with a prompt at block 0"), ([(0, "")], r"\[0\] prompt is empty"),
    ([(0, "a"), {"block": 2, "promt": "b"}], "unknown keys"), ([(0, "a"), (2, "b", 3)], r"prompt_schedule\[1\]"),
    ([(0, "a"), {"block": 2, "prompt": "b", "interp_blocks": 0}], r"prompt_schedule\[1\]: interp_blocks 0"),
    ([(-1, "a")], "block -1"), ("/nonexistent/s.json", "not found"),
])
def test_bad_schedules_are_refused_by_name(schedule, match):
    with pytest.raises(UpdateError, match=match):
        parse_schedule(schedule)


def test_unbounded_full_history_is_refused_naming_the_fix(tiny_pipe):
    with pytest.raises(OptionError, match="window_frames=N, sink_frames=M.*drafter_cache='recompute'"):
        tiny_pipe.session("a fox", scheduler="reference")  # the tiny drafter keeps its full history
    s = tiny_pipe.session("a fox", scheduler="reference", window_frames=6, sink_frames=3)
    assert s.limit is not None and s.opts.num_blocks == s.limit  # the RoPE table's end
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.update(prompt="an owl")


def test_session_refusals_before_any_work(tiny_pipe):
    with pytest.raises(UpdateError, match="prompt is empty"):
        tiny_pipe.session("  ", num_blocks=2, scheduler="reference")
    with pytest.raises(OptionError, match="num_blocks 0"):
        tiny_pipe.session("a", num_blocks=0, scheduler="reference")
    with pytest.raises(OptionError, match="interp_blocks 0"):
        tiny_pipe.session("a", num_blocks=2, scheduler="reference", interp_blocks=0)
    with pytest.raises(TypeError, match="unknown keywords"):
        tiny_pipe.session("a", num_blocks=2, scheduler="reference", temperature=1)
    with pytest.raises(ValueError, match="replaces prompt"):
        tiny_pipe("a", prompt_schedule=[(0, "b")], scheduler="reference")
    with pytest.raises(UpdateError, match="ends after block 1"):  # an update past the end, as a schedule gives it
        tiny_pipe.stream(prompt_schedule=[(0, "a"), (2, "b")], num_blocks=2, scheduler="reference")


def test_a_seed_sent_before_the_first_block_seeds_the_first_segment(tiny_pipe, monkeypatch):
    import sdvg.generation.run as run  # where the loop is chosen (the reference loop, by the options)

    seeds = []
    def one_block_started(comps, prompt, opts, *args, plan, **kw):
        seeds.append(opts.seed)
        plan.begin(0)
        return iter(())

    monkeypatch.setattr(run, "generate_blocks", one_block_started)
    s = tiny_pipe.session("a", num_blocks=2, scheduler="reference", seed=1)
    assert s.update(seed=9).block == 0
    assert list(s) == [] and seeds == [9]


class _Exits:
    """A block's early-exit view, as `BlockExits.stats()` writes it."""

    def __init__(self, k):
        self.k = k

    def stats(self):
        role = {"forwards": self.k, "oracle_forwards": 1, "token_evals": 10 * self.k, "tokens": 10}
        return {"mean_steps": self.k / 2, "max_steps": self.k, "exit": {"producer": "drafter", "drafter": role}}


@pytest.mark.parametrize("early_exit", ["none", "drafter"])
def test_stats_keeping_the_last_blocks_fold_the_rest_into_exact_totals(early_exit):
    from sdvg.generation.types import BlockRecord, RunStats
    from sdvg.options import GenerationOptions

    opts = GenerationOptions(num_blocks=12, mode="sdvg", early_exit=early_exit)
    every, last3 = RunStats("p", "tiny", opts), RunStats("p", "tiny", opts, keep_blocks=3)
    for b in range(12):
        decision = "forced" if b == 0 else ("accepted" if b % 3 else "rejected")
        times = {k: 0.25 * (b + 1) for k in ("draft", "decode", "score", "target", "drafter_commit",
                                               "target_commit", "commit")}
        block = BlockRecord(b, decision, torch.zeros(1), torch.zeros((9 if b == 0 else 12, 2, 2, 3)), 0.5, [0.5],
                            times, exits=_Exits(b % 4 + 1) if early_exit != "none" else None)
        every.add(block), last3.add(block)
    a, k = every.as_dict(), last3.as_dict()
    assert [b["index"] for b in k["blocks"]] == [9, 10, 11]
    assert k["video"]["blocks_dropped"] == 9 and a["video"]["blocks_dropped"] == 0
    for group, key in (("video", "frames"), ("result", "acceptance_rate"), ("result", "accepted_blocks"),
                       ("video", "blocks_done"), ("result", "mean_steps"), ("result", "max_steps"),
                       ("result", "exit_roles"), ("result", "stage_totals")):
        assert k[group][key] == a[group][key], key  # quarters: every sum exact in any order
    from sdvg.live.session import kept_blocks

    assert kept_blocks("auto", 5) is None and kept_blocks("auto", None) == 1000 and kept_blocks(7, None) == 7
    with pytest.raises(OptionError, match="record_blocks 0 must be a positive integer"):
        kept_blocks(0, 2)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["reference", "cpp"])
def test_a_restart_lets_the_finished_segments_caches_go(tiny_pipe, monkeypatch, scheduler):
    """Each restart (a new seed: a reset on the server) starts a segment with new KV caches; the finished
    segment's report is folded into the session's totals at once and nothing holds its caches (before, every
    segment's report kept its caches until the session ended: a long session with resets grew by two KV caches
    per reset). The counters and the trace still cover every segment."""
    import gc
    import weakref

    from sdvg.generation import native, reference

    buffers = []

    def recording(prepare):  # each segment's setup, as the loop makes it
        def prepare_and_record(*args, **kwargs):
            setup = prepare(*args, **kwargs)
            buffers.append(weakref.ref(setup.target.cache.buffer))
            return setup
        return prepare_and_record

    for loop in (native, reference):
        monkeypatch.setattr(loop, "prepare", recording(loop.prepare))
    # by reference counting alone (no garbage collection): on a GPU, caches that wait for the collector are
    # memory held for an unknown time (a cycle through the native scheduler's error did that)
    gc.collect()
    gc.disable()
    try:
        s = tiny_pipe.session("a red fox", num_blocks=None, scheduler=scheduler, target_context="full",
                              drafter_cache="full", window_frames=6, sink_frames=3, router="pattern", pattern="01")
        for n, _ in enumerate(s, start=1):
            s.update(seed=n)  # a restart at the first block not started (the native pace may make it later)
            if n == 5:
                break
        # the reference loop restarts at every next block; the native thread may have started a block ahead
        assert len(buffers) >= (3 if scheduler == "reference" else 2)
        assert [ref() is None for ref in buffers] == [True] * (len(buffers) - 1) + [False]  # the running segment's
        stats = s.close()
        assert [ref() is None for ref in buffers] == [True] * len(buffers)  # a closed session holds no cache
    finally:
        gc.enable()
    assert stats.extra["segments"] == len(buffers) and len(stats.blocks) == 5
    assert stats.counters["target_forwards"] > 0
    assert {span["block"] for span in stats.trace} == {b["index"] for b in stats.blocks}
    # one target span per block the target made, in every segment (none of a block left in flight at close)
    made_by_target = [b for b in stats.blocks if b["decision"] in ("forced", "rejected")]
    assert sum(span["stage"] == "target" for span in stats.trace) == len(made_by_target) >= 3
