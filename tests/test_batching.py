"""Sessions batched together (sdvg/generation/batching.py): each session's video is its own, as alone.

The oracle is `pipe.session` run by itself; the batched runs go through `StageBatcher.run_round`, one block of each
session per round, as the server's batched worker drives them. The claim checked (the module docstring): the
decisions equal, the latents bitwise; the pixels of a batched VAE decode within one uint8 level and the scores read
from them within 1e-3 (the CPU's convolutions are not batch-invariant; tiny's random reward model amplifies); with
`batch_decode=False` every session bitwise its own, frames and scores included."""
from __future__ import annotations

import threading

import pytest
import torch

from sdvg.generation.batching import StageBatcher
from sdvg.models.dit import CausalWanDiT, TextKV
from sdvg.models.kv_cache import KVCacheSpec

PROMPTS = ("a cat on a sofa", "a dog on a beach", "a city at night", "a red car in the rain")


def _record(block) -> tuple:
    return (block.index, block.decision, block.score, tuple(block.frame_scores), block.latents, block.frames)


SCORE_TOLERANCE = 1e-3  # a batched decode's last-bit pixel differences, as tiny's random ImageReward reads them


def _same(a: list, b: list) -> bool:
    """Index and decision equal, latents bitwise, frames within one uint8 level, scores within SCORE_TOLERANCE."""
    def close(u, v):
        return (u is None and v is None) or (u is not None and v is not None and abs(u - v) <= SCORE_TOLERANCE)

    return len(a) == len(b) and all(
        x[:2] == y[:2] and close(x[2], y[2]) and len(x[3]) == len(y[3]) and all(map(close, x[3], y[3]))
        and torch.equal(x[4], y[4]) and int((x[5].int() - y[5].int()).abs().max()) <= 1 for x, y in zip(a, b))


def _bitwise(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x[:4] == y[:4] and torch.equal(x[4], y[4]) and torch.equal(x[5], y[5]) for x, y in zip(a, b))


def _drive(batcher: StageBatcher, sessions: dict, updates=None) -> dict:
    """Rounds of every session's next block until all end; `updates`: (session, before block) -> update keywords."""
    out = {name: [] for name in sessions}
    live = list(sessions)
    while live:
        for name in live:
            change = (updates or {}).get((name, len(out[name])))
            if change:
                sessions[name].update(**change)
        results = batcher.run_round([sessions[name].__next__ for name in live])
        ended = []
        for name, (ok, outcome) in zip(live, results):
            if ok:
                out[name].append(_record(outcome))
            elif isinstance(outcome, StopIteration):
                ended.append(name)
            else:
                raise outcome
        live = [n for n in live if n not in ended]
    return out


def _alone(pipe, prompt, updates=(), **kw) -> list:
    session = pipe.session(prompt, **kw)
    out = []
    for block in iter(lambda: next(session, None), None):
        out.append(_record(block))
        for at, change in updates:
            if at == len(out):
                session.update(**change)
    return out


KW = dict(num_blocks=3, scheduler="reference")
TAUS = {"a": -1e9, "b": 1e9, "c": 0.0}  # every draft accepted / rejected / the scores decide


@pytest.fixture(scope="module")
def three_alone(tiny_pipe) -> dict:
    """The oracle of the three-session tests, made once: each session (PROMPTS[i], seed i, TAUS) run by itself."""
    return {n: _alone(tiny_pipe, PROMPTS[i], seed=i, tau=TAUS[n], **KW) for i, n in enumerate(TAUS)}


def test_sessions_batched_together_are_each_their_own(tiny_pipe, three_alone):
    """Three sessions of different prompts, seeds and thresholds: drafts, target blocks, commits, decodes and scores
    batched across them (calls of more than one row happened), every block equal to the session's alone (decision
    and latents exactly, frames and scores within the decode's tolerance)."""
    batcher = StageBatcher()
    sessions = {n: tiny_pipe.session(PROMPTS[i], seed=i, tau=TAUS[n], batcher=batcher, **KW)
                for i, n in enumerate(TAUS)}
    batched = _drive(batcher, sessions)
    for n in TAUS:
        assert _same(batched[n], three_alone[n]), n
    assert [r[1] for r in batched["a"]] == ["forced", "accepted", "accepted"]
    assert [r[1] for r in batched["b"]] == ["forced", "rejected", "rejected"]
    calls = batcher.stats.calls
    # block 0's targets, then each block's drafts, denoised together; their scores (and block 0's) scored together
    assert calls[("denoise", 3)] >= 3 and calls[("score", 3)] >= 3, calls
    assert calls[("commit", 3)] >= 2, calls  # every session's drafter commit of blocks 0 and 1, together
    assert calls[("decode", 3)] >= 3, calls  # each block's first decode (the draft's, or block 0's target's)
    assert batcher.stats.rounds == 4  # three blocks, then the round that finds every end


def test_without_batched_decodes_every_session_is_bitwise_its_own(tiny_pipe, three_alone):
    """`batch_decode=False`: the DiT and reward calls still batched, each decode alone: decisions, scores, latents and
    frames bitwise the session's alone."""
    batcher = StageBatcher(batch_decode=False)
    sessions = {n: tiny_pipe.session(PROMPTS[i], seed=i, tau=TAUS[n], batcher=batcher, **KW)
                for i, n in enumerate(TAUS)}
    batched = _drive(batcher, sessions)
    for n in TAUS:
        assert _bitwise(batched[n], three_alone[n]), n
    calls = batcher.stats.calls
    assert calls[("denoise", 3)] >= 3 and calls[("score", 3)] >= 3 and not any(k == "decode" for k, _ in calls)


# slow: rows at other cache positions under other conditionings in one call stay fast in
# test_forward_rows_equals_each_rows_forward_alone; batched sessions equal to their own alone in
# test_sessions_batched_together_are_each_their_own
@pytest.mark.slow
def test_sessions_at_different_blocks_and_a_live_update_stay_their_own(tiny_pipe):
    """A session that starts two rounds later (its blocks at other cache positions than the others' in the same
    call) and a prompt update mid-stream with a blend: each video still equals its own alone."""
    batcher = StageBatcher()
    first = {"a": tiny_pipe.session(PROMPTS[0], seed=3, tau=0.0, batcher=batcher, num_blocks=4, scheduler="reference")}
    early = [_record(outcome) for ok, outcome in (batcher.run_round([first["a"].__next__])[0],) if ok]
    early += [_record(outcome) for ok, outcome in (batcher.run_round([first["a"].__next__])[0],) if ok]
    later = tiny_pipe.session(PROMPTS[1], seed=4, tau=0.0, batcher=batcher, **KW)
    update = {("b", 1): dict(prompt=PROMPTS[2], interp_blocks=2)}
    batched = _drive(batcher, {"a": first["a"], "b": later}, update)
    assert _same(early + batched["a"], _alone(tiny_pipe, PROMPTS[0], seed=3, tau=0.0, num_blocks=4,
                                              scheduler="reference"))
    assert _same(batched["b"], _alone(tiny_pipe, PROMPTS[1], [(1, dict(prompt=PROMPTS[2], interp_blocks=2))],
                                      seed=4, tau=0.0, **KW))
    assert any(kind == "denoise" and rows == 2 for kind, rows in batcher.stats.calls), batcher.stats.calls


# slow: the rule that keeps a recompute drafter out of batched calls stays fast in
# test_why_a_role_runs_alone_is_one_rule; work run alone in its turn of the round in
# test_one_job_runs_at_a_time_in_the_order_given
@pytest.mark.slow
def test_a_session_that_cannot_batch_runs_alone_in_the_round(tiny_pipe):
    """A recompute-context drafter (its denoise rebuilds the context first) never joins a call of other rows: the
    round still runs it, in its turn, and both videos equal their own alone."""
    batcher = StageBatcher()
    sessions = {"full": tiny_pipe.session(PROMPTS[0], seed=5, tau=0.0, batcher=batcher, **KW),
                "recompute": tiny_pipe.session(PROMPTS[1], seed=6, tau=0.0, drafter_cache="recompute",
                                               batcher=batcher, **KW)}
    batched = _drive(batcher, sessions)
    assert _same(batched["full"], _alone(tiny_pipe, PROMPTS[0], seed=5, tau=0.0, **KW))
    assert _same(batched["recompute"], _alone(tiny_pipe, PROMPTS[1], seed=6, tau=0.0, drafter_cache="recompute",
                                              **KW))


def test_a_failing_session_fails_alone_and_a_batched_session_needs_the_reference_loop(tiny_pipe):
    """A job that raises ends only itself (its exception handed back in order); the others of the round finish.
    The native scheduler's lanes cannot take turns: a batched session is refused on it, naming the fix."""
    batcher = StageBatcher()
    session = tiny_pipe.session(PROMPTS[0], seed=7, batcher=batcher, **KW)

    def broken():
        raise RuntimeError("broken generation")

    results = batcher.run_round([broken, session.__next__])
    assert results[0][0] is False and str(results[0][1]) == "broken generation"
    assert results[1][0] is True and results[1][1].index == 0
    with pytest.raises(ValueError, match="scheduler='reference'"):
        tiny_pipe.session(PROMPTS[0], batcher=batcher, num_blocks=2, scheduler="cpp")


def test_one_job_runs_at_a_time_in_the_order_given():
    """The round's jobs never overlap (a turn passes from thread to thread) and run in the order given; a request
    outside a round runs at once."""
    batcher = StageBatcher()
    running, order = threading.Lock(), []

    def job(name):
        def run():
            assert running.acquire(blocking=False), "two jobs ran at once"
            try:
                order.append(name)
            finally:
                running.release()
            return name
        return run

    assert batcher.run_round([job(n) for n in "abcd"]) == [(True, n) for n in "abcd"]
    assert order == list("abcd")
    with pytest.raises(ValueError, match="max_rows"):
        StageBatcher(max_rows=0)


def test_deadlines_order_the_turns_and_each_job_is_handed_over_as_it_ends():
    """`deadlines` with jobs that hand no model work over: earliest deadline first (ties in the order given), each
    job's `on_done` before the next job's turn; the results in the order given. (With sessions' model calls:
    test_earliest_deadline_first_and_each_block_handed_over_as_it_ends.)"""
    batcher = StageBatcher()
    events = []

    def job(name):
        def run():
            events.append(("run", name))
            return name
        return run

    results = batcher.run_round([job(n) for n in "abcd"], [3.0, 1.0, 2.0, 1.0],
                                on_done=lambda i, ok, outcome: events.append(("done", i, ok, outcome)))
    assert results == [(True, n) for n in "abcd"]
    assert events == [("run", "b"), ("done", 1, True, "b"), ("run", "d"), ("done", 3, True, "d"),
                      ("run", "c"), ("done", 2, True, "c"), ("run", "a"), ("done", 0, True, "a")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_rows_equals_each_rows_forward_alone(tiny_preset, dtype):
    """`CausalWanDiT.forward_rows`: four videos' blocks at different cache positions (0 to 3 blocks committed) under
    different conditionings, in one call, bitwise each one's `forward` with its own cache; their caches end equal."""
    from tests.conftest import randomize

    torch.manual_seed(0)
    dit = randomize(CausalWanDiT(tiny_preset.target).eval(), std=0.2).to(dtype)
    cfg, video = tiny_preset.target, tiny_preset.video
    h, w = video.latent_hw(tiny_preset.vae)
    frames = video.frames_per_block
    tpf = video.tokens_per_frame(tiny_preset.vae, cfg)
    rows = 4
    g = torch.Generator().manual_seed(1)
    texts = [dit.encode_text(torch.randn(1, 512, cfg.text_dim, generator=g).to(dtype)) for _ in range(rows)]
    alone = [KVCacheSpec.for_dit(cfg, tpf, 16).allocate(dtype, "cpu") for _ in range(rows)]
    together = [KVCacheSpec.for_dit(cfg, tpf, 16).allocate(dtype, "cpu") for _ in range(rows)]
    for j in range(rows):
        for _ in range(j):
            x = torch.randn(1, cfg.in_channels, frames, h, w, generator=g)
            for caches in (alone, together):
                dit(x, torch.zeros(1, frames), texts[j], cache=caches[j])
                caches[j].commit()
    x = torch.randn(rows, cfg.in_channels, frames, h, w, generator=g)
    t = torch.full((rows, frames), 625.0)
    expected = torch.cat([dit(x[j:j + 1], t[j:j + 1], texts[j], cache=alone[j]) for j in range(rows)])
    stacked = TextKV([torch.cat([tx.keys[i] for tx in texts]) for i in range(cfg.num_layers)],
                     [torch.cat([tx.values[i] for tx in texts]) for i in range(cfg.num_layers)])
    got = dit.forward_rows(x, t, stacked, together)
    assert torch.equal(got, expected)
    for a, b in zip(alone, together):
        for layer in range(cfg.num_layers):
            assert all(torch.equal(p, q) for p, q in zip(a.visible(layer), b.visible(layer)))
    with pytest.raises(ValueError, match="one KV cache per row"):
        dit.forward_rows(x, t, stacked, together[:2])


# slow: deadline order of the turns and on_done as each job ends stay fast in
# test_deadlines_order_the_turns_and_each_job_is_handed_over_as_it_ends; batched sessions equal to their own alone in
# test_sessions_batched_together_are_each_their_own
@pytest.mark.slow
def test_earliest_deadline_first_and_each_block_handed_over_as_it_ends(tiny_pipe):
    """`deadlines` order the turns and the calls: the earliest-deadline session's block is made first and handed
    over (`on_done`) before the round ends; the videos are the same whatever the order."""
    def run(deadlines):
        batcher = StageBatcher()
        sessions = [tiny_pipe.session(PROMPTS[i], seed=i, tau=1e9 if i == 0 else -1e9, batcher=batcher,
                                      num_blocks=2, scheduler="reference") for i in range(3)]
        batcher.run_round([s.__next__ for s in sessions])  # block 0: every session's target, together
        done = []
        results = batcher.run_round([s.__next__ for s in sessions], deadlines,
                                    on_done=lambda i, ok, outcome: done.append((i, ok, outcome.decision)))
        return done, [outcome for _, outcome in results]

    done, blocks = run([3.0, 1.0, 2.0])
    assert [i for i, _, _ in done] == [1, 2, 0]  # the accepted drafts end first, in deadline order; then the target's
    assert [d for _, _, d in done] == ["accepted", "accepted", "rejected"] and all(ok for _, ok, _ in done)
    done_again, blocks_again = run([1.0, 3.0, 2.0])
    assert [i for i, _, _ in done_again][:1] == [2]  # session 0's draft is rejected: its target runs after the others
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(blocks, blocks_again))


def test_a_sessions_lateness_is_its_playback_running_dry():
    """The worker's deadline rule (sdvg/serve/sessions.py `Session.played`): a run's first block is never late;
    a block made after the frames before it would have finished playing at the server's fps is late by the gap."""
    import asyncio

    pytest.importorskip("prometheus_client")  # the serve extra
    pytest.importorskip("fastapi")
    from sdvg.serve.metrics import ServeMetrics
    from sdvg.serve.sessions import Outbox, Session

    loop = asyncio.new_event_loop()
    try:
        s = Session("s", "raw", True, loop, Outbox(4, ServeMetrics()))
        s.t_start = 5.0
        assert s.deadline() == 5.0  # before its first block: its start
        assert s.played(10.0, 16, 16.0) == 0.0 and s.deadline() == 11.0  # one second of frames from t=10
        assert s.played(10.5, 8, 16.0) == 0.0 and s.deadline() == 11.5  # early: appended after the first
        assert s.played(12.0, 16, 16.0) == 0.5 and s.deadline() == 13.0  # 0.5 s dry; playback restarts now
    finally:
        loop.close()


def test_why_a_role_runs_alone_is_one_rule(tiny_pipe):
    """`why_alone`: what keeps a role's calls out of other sessions' batches (the stage calls ask it; the server puts
    it in the session's stats): the backend, CUDA graphs, early exit, a recompute context."""
    from sdvg.generation.batching import why_alone
    from sdvg.options import GenerationOptions

    def resolved(**kw):
        return tiny_pipe.resolve(GenerationOptions(**kw))

    plain = resolved()
    assert [why_alone(plain, r) for r in ("drafter", "target", "reward")] == [None, None, None]
    assert "recompute" in why_alone(resolved(drafter_cache="recompute"), "drafter")
    assert why_alone(resolved(drafter_cache="recompute"), "target") is None
    assert "early_exit" in why_alone(resolved(early_exit="drafter"), "drafter")
    compiled = resolved(backend="compile")
    assert "compile" in why_alone(compiled, "drafter") and "compile" in why_alone(compiled, "reward")


class _Meet:
    """A request on a named device whose batched call waits, at a barrier, for a call on another device: it returns
    only if the two calls run at the same time."""

    lane = "meet"

    def __init__(self, device: str, barrier: threading.Barrier):
        self.device, self.barrier = device, barrier

    @property
    def key(self) -> tuple:
        return ("meet", self.device)

    def alone(self) -> str:
        return self.device

    @staticmethod
    def run_together(requests: list) -> list:
        requests[0].barrier.wait()  # BrokenBarrierError after its timeout: the calls ran one after another
        return [r.device for r in requests]


def test_calls_on_different_devices_run_at_the_same_time():
    """Two GPUs: the drafter's and the target's calls of a round run at once (each device its own call; the two
    requests on cuda:0 go together), and each video gets its own result; outside a round a request runs alone."""
    barrier = threading.Barrier(2, timeout=30)
    batcher = StageBatcher()
    jobs = [lambda d=d: batcher.request(_Meet(d, barrier)) for d in ("cuda:0", "cuda:1", "cuda:0")]
    assert batcher.run_round(jobs) == [(True, "cuda:0"), (True, "cuda:1"), (True, "cuda:0")]
    assert batcher.stats.calls == {("meet", 2): 1, ("meet", 1): 1}
    assert batcher.request(_Meet("cuda:0", barrier)) == "cuda:0"
