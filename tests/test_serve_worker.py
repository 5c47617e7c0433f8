"""The generation worker alone (a fake engine, no server): fair turns, one block at a time, under either session
scheduler (round-robin, or the batched worker's rounds)."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("fastapi")
pytest.importorskip("msgpack")
import torch  # noqa: E402

from sdvg.serve.config import ServeConfig  # noqa: E402
from sdvg.serve.engine import SessionSpec  # noqa: E402
from sdvg.serve.metrics import ServeMetrics  # noqa: E402
from sdvg.serve.sessions import Outbox, Session, SessionManager  # noqa: E402
from sdvg.serve.videos import VideoStore  # noqa: E402


class FakeEngine:
    """Generations of `blocks` one-frame blocks that record which session advanced and check that no
    two advance at once."""

    def __init__(self, blocks: int):
        self.blocks, self.order, self.running = blocks, [], threading.Lock()

    def start(self, spec, clip=None, batcher=None):  # Engine.start's signature (clip: an input video read off the
        # worker; batcher: the batched worker's, which a fake generation has no model work for)
        def gen():
            for b in range(self.blocks):
                assert self.running.acquire(blocking=False), "two generations ran at once"
                try:
                    time.sleep(0.01)
                    self.order.append(spec.prompt)
                finally:
                    self.running.release()
                yield SimpleNamespace(index=b, decision="forced" if b == 0 else "accepted",
                                      frames=torch.zeros(1, 2, 2, 3, dtype=torch.uint8), score=0.0, times={})
        return gen()

    @staticmethod
    def close(generation):
        generation.close()

    @staticmethod
    def input_ready(generation):  # no webcam input: every block can run
        return True


def wait_until(condition, deadline: float, poll_s: float = 0.02) -> None:
    """Poll `condition` until it holds or time.monotonic() passes `deadline` (the assertions after it say what did
    not happen)."""
    while not condition() and time.monotonic() < deadline:
        time.sleep(poll_s)


@pytest.mark.parametrize("scheduler", ["round_robin", "batched"])
def test_worker_takes_turns_round_robin(tmp_path, scheduler):
    engine = FakeEngine(blocks=3)
    metrics = ServeMetrics()
    manager = SessionManager(engine, ServeConfig(max_sessions=4, session_scheduler=scheduler), metrics,
                             VideoStore(tmp_path, 16, 8))
    loop = asyncio.new_event_loop()  # never run: what the worker posts for the sockets just waits there
    try:
        sessions = [Session(f"s{i}", "raw", False, loop, Outbox(8, metrics)) for i in range(4)]
        for s in sessions:
            assert manager.admit(s, SessionSpec(s.id, None, None)) == "running"
        manager.start()
        deadline = time.monotonic() + 60
        wait_until(lambda: len(engine.order) >= 12, deadline)
        manager.stop()
    finally:
        loop.close()
    assert engine.order == ["s0", "s1", "s2", "s3"] * 3
    assert manager.active == []  # every run ended and gave its slot back


def test_a_worker_hook_sees_typed_commands_and_holds_the_worker_between_blocks(tmp_path):
    """The test seam (`WorkerHook`): told of each command as it is queued, called before each block on the worker,
    where it may hold it; a command that is not one of `sdvg.serve.commands` is refused on the caller's thread."""
    from sdvg.serve.commands import LiveUpdate, Start
    from sdvg.serve.sessions import WorkerHook

    class Hold(WorkerHook):
        def __init__(self):
            self.commands, self.blocks, self.release = [], [], threading.Event()

        def queued(self, session, command):
            self.commands.append((session.id, command))

        def before_block(self, session):
            self.blocks.append((session.id, session.blocks_done))
            if session.blocks_done == 1:
                assert self.release.wait(60)

    engine = FakeEngine(blocks=3)
    metrics = ServeMetrics()
    hook = Hold()
    manager = SessionManager(engine, ServeConfig(max_sessions=1), metrics, VideoStore(tmp_path, 16, 8), hook=hook)
    loop = asyncio.new_event_loop()
    try:
        s = Session("s0", "raw", False, loop, Outbox(8, metrics))
        assert manager.admit(s, SessionSpec(s.id, None, None)) == "running"
        with pytest.raises(TypeError, match="not a worker command"):
            manager.command(s, ("update", {"tau": 0.5}, "tau", None))  # the old string-tagged tuple
        manager.start()
        deadline = time.monotonic() + 60
        wait_until(lambda: ("s0", 1) in hook.blocks, deadline)
        time.sleep(0.1)
        assert engine.order == ["s0"]  # held before block 1
        hook.release.set()
        wait_until(lambda: len(engine.order) >= 3, deadline)
        manager.stop()
    finally:
        loop.close()
    assert engine.order == ["s0"] * 3  # (the fourth call finds the generation's end)
    assert hook.blocks == [("s0", 0), ("s0", 1), ("s0", 2), ("s0", 3)]
    assert [(sid, type(c)) for sid, c in hook.commands] == [("s0", Start)] and hook.commands[0][1].run == 1
    assert not any(isinstance(c, LiveUpdate) for _, c in hook.commands) and not s.commands


def test_capacity_model_fits_round_costs_and_admits_by_the_rate_it_predicts():
    """sdvg/serve/capacity.py: one round size seen -> a line through the origin (rounds run one after another, the safe
    side); several sizes -> least squares; admission keeps every admitted session at the rate (the first always)."""
    from sdvg.serve.capacity import CapacityModel

    model = CapacityModel()
    assert model.session_fps(2) is None and model.admits(3, 10.0)  # nothing measured: admitted, and learned
    model.observe(1, 0.5, 12)
    assert model.round_seconds(3) == pytest.approx(1.5) and model.session_fps(2) == pytest.approx(12.0)
    model.observe(3, 0.7, 12)  # batching: three sessions cost 0.7 s, not 1.5
    assert model.round_seconds(2) == pytest.approx(0.6) and model.round_seconds(5) == pytest.approx(0.9)
    assert model.admits(4, 12 / 0.8) and not model.admits(5, 12 / 0.8) and model.admits(1, 1e9)
    assert model.admits(50, 0.0)  # no rate asked: --max-sessions only
    with pytest.raises(ValueError, match="window"):
        CapacityModel(window=0)
    with pytest.raises(ValueError, match="min_session_fps"):
        ServeConfig(min_session_fps=-1)


@pytest.mark.parametrize("scheduler", ["round_robin", "batched"])
def test_a_session_that_would_slow_the_others_below_the_rate_waits_and_runs_after(tmp_path, scheduler):
    """--min-session-fps: with one session's measured rounds giving it under twice the rate, a second session waits in
    the queue (its slot free, its reason capacity) and runs when the first ends: nothing starves."""
    class SlowEngine(FakeEngine):
        def start(self, spec, clip=None, batcher=None):
            inner = super().start(spec, clip, batcher)

            def gen():
                for block in inner:
                    time.sleep(0.2)  # 1 frame a block: about 4 frames/s, whatever the machine's load
                    yield block
            return gen()

    engine = SlowEngine(blocks=3)
    metrics = ServeMetrics()
    manager = SessionManager(engine, ServeConfig(max_sessions=4, session_scheduler=scheduler, min_session_fps=3.0),
                             metrics, VideoStore(tmp_path, 16, 8))
    loop = asyncio.new_event_loop()
    try:
        first, second = (Session(f"s{i}", "raw", False, loop, Outbox(8, metrics)) for i in range(2))
        assert manager.admit(first, SessionSpec(first.id, None, None)) == "running"  # the first always runs
        manager.start()
        deadline = time.monotonic() + 60
        wait_until(lambda: len(engine.order) >= 1, deadline, 0.01)
        wait_until(lambda: manager.capacity.rounds, deadline, 0.01)
        assert manager.admit(second, SessionSpec(second.id, None, None)) == "queued"  # two would get ~2 frames/s
        wait_until(lambda: len(engine.order) >= 6, deadline)
        manager.stop()
    finally:
        loop.close()
    assert engine.order == ["s0"] * 3 + ["s1"] * 3  # the second ran once the first had ended


def test_sessions_whose_parameters_arrive_together_start_in_the_same_round(tmp_path):
    """A session admitted while the worker sets up another's run (its parameters came a moment later) makes its
    block 0 in the same round: the two run in step, their blocks batched from block 0 on."""

    class Picks:
        def __init__(self):
            self.blocks = []

        def queued(self, session, command):
            pass

        def before_block(self, session):
            self.blocks.append((session.id, session.blocks_done))

    metrics = ServeMetrics()
    loop = asyncio.new_event_loop()
    hook = Picks()
    try:
        late = Session("s1", "raw", False, loop, Outbox(8, metrics))

        class Engine(FakeEngine):
            def start(self, spec, clip=None, batcher=None):
                if spec.prompt == "s0":  # s1's parameters arrive while s0's run is being set up
                    assert manager.admit(late, SessionSpec("s1", None, None)) == "running"
                return super().start(spec, clip, batcher)

        engine = Engine(blocks=2)
        manager = SessionManager(engine, ServeConfig(max_sessions=4), metrics, VideoStore(tmp_path, 16, 8),
                                 hook=hook)
        first = Session("s0", "raw", False, loop, Outbox(8, metrics))
        assert manager.admit(first, SessionSpec("s0", None, None)) == "running"
        manager.start()
        deadline = time.monotonic() + 60
        wait_until(lambda: len(engine.order) >= 4, deadline)
        manager.stop()
    finally:
        loop.close()
    assert hook.blocks[:2] == [("s0", 0), ("s1", 0)]  # one round: both block 0s
    assert sorted(engine.order) == ["s0", "s0", "s1", "s1"]


def test_a_socket_is_released_once_and_a_released_one_starts_nothing(tmp_path):
    """A stalled socket is released when it is cut and again when it closes: the second release must not free the
    video key a newer socket on the same id holds; a reset that comes after the cut is not admitted."""
    metrics = ServeMetrics()
    manager = SessionManager(FakeEngine(blocks=1), ServeConfig(), metrics, VideoStore(tmp_path, 16, 8))
    loop = asyncio.new_event_loop()
    try:
        def socket_on(session_id):
            s = Session(session_id, "raw", False, loop, Outbox(8, metrics))
            assert manager.opened(s)
            s.video_key = manager.claim_key(session_id)
            return s

        cut = socket_on("k")
        manager.release(cut)  # cut: it stopped reading
        newer = socket_on("k")
        assert newer.video_key == "k"
        manager.release(cut)  # its close, later
        assert socket_on("k").video_key == "k.1"  # the newer socket still holds "k"
        assert manager.admit(cut, SessionSpec("k", None, None)) == "closed" and cut not in manager.active
    finally:
        loop.close()
