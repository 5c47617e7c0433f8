"""Sessions and the one generation worker that runs them block by block.

The worker is one thread that owns every generation (the pipeline is not thread-safe across
videos): between two blocks it applies the commands the sockets queued (start, stop, live updates),
then runs the next blocks, writes each to its session's MP4 and hands its frames to the session's
socket. How it picks the next blocks is `ServeConfig.session_scheduler`:

- `batched` (the default): the next block of every runnable session as one round of a `StageBatcher`
  (sdvg/generation/batching.py): the sessions' denoising and scoring that can go together run as one
  batch (each session's video bitwise its own, as alone), the rest in turn;
- `round_robin`: the next block of the next runnable session in turn, alone (the earlier worker, kept
  for the side-by-side benchmark `benchmarks/serve_load.py`).

A socket never waits for the worker and the worker never waits for a socket:

- at most `max_sessions` generations are admitted (running or paused); the next `max_queue` wait
  in order and are told their position on every change; one more is refused with `busy`;
- each socket has a bounded send buffer of `send_buffer_frames` frames; when a new frame finds it
  full, the oldest unsent frame is dropped and counted (`sdvg_serve_dropped_frames_total`; text
  messages are never dropped), so a slow client loses frames, not other sessions' time; the MP4
  keeps every frame;
- a socket that closes is out of the rotation at once; its generation is closed (and its slot given
  to the queue) before the worker runs any other block.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
import traceback
from typing import Any, Protocol

import numpy as np

from sdvg.generation.batching import StageBatcher, why_alone
from sdvg.serve.capacity import CapacityModel
from sdvg.serve.commands import Command, EndRun, InputRead, LiveUpdate, Snapshot, Start
from sdvg.serve.config import ServeConfig
from sdvg.serve.encode import encode_block
from sdvg.serve.engine import Engine, SessionSpec
from sdvg.serve.events import session_event
from sdvg.serve.metrics import ServeMetrics
from sdvg.serve.plain import Adjusted, failure
from sdvg.serve.security import MAX_SHARED_ID
from sdvg.serve.videos import VideoStore

PRODUCER = {"forced": "target", "rejected": "target", "target": "target", "accepted": "drafter",
            "draft": "drafter"}


class Outbox:
    """One socket's send buffer: text messages (never dropped) and frames (at most `limit` unsent;
    the oldest goes when a new one finds it full). Used from the event loop only."""

    def __init__(self, limit: int, metrics: ServeMetrics):
        self.items: collections.deque = collections.deque()
        self.frames = 0
        self.limit, self.metrics = limit, metrics
        self.dropped = 0
        self.event = asyncio.Event()

    def text(self, message: dict) -> None:
        self.items.append(("text", message))
        self.event.set()

    def frame(self, data: bytes) -> None:
        if self.frames >= self.limit:
            for i, item in enumerate(self.items):
                if item[0] == "frame":
                    del self.items[i]
                    self.frames -= 1
                    self.dropped += 1
                    self.metrics.dropped.inc()
                    break
        self.items.append(("frame", data))
        self.frames += 1
        self.event.set()

    def close(self, code: int, reason: str = "") -> None:
        self.items.append(("close", code, reason))
        self.event.set()

    async def next(self):
        while not self.items:
            self.event.clear()
            await self.event.wait()
        item = self.items.popleft()
        if item[0] == "frame":
            self.frames -= 1
        return item


class Session:
    """One websocket's session. Fields marked (worker) are touched by the worker thread only."""

    def __init__(self, session_id: str, fmt: str, superset: bool, loop: asyncio.AbstractEventLoop,
                 outbox: Outbox):
        self.id, self.fmt, self.superset, self.loop, self.outbox = session_id, fmt, superset, loop, outbox
        self.adjusted = Adjusted(session_id, outbox.metrics.plain_adjusted)  # a plain client's: told to the operator
        self.spec: SessionSpec | None = None
        self.video_key = session_id  # the name of its runs' MP4s (GET /download_video/{video_key}: the latest)
        self.run_key: str | None = None  # (worker) the last finished run's own video (videos.RunVideo.run_key)
        self.upload: str | None = None  # the input_video upload this socket claimed (released when it closes)
        self.state = "new"  # new | queued | running | done | closed
        self.paused = False
        self.paused_at: float | None = None  # time.monotonic() of the pause (its --max-pause-s counts from it)
        self.refusals = 0  # messages refused on this socket, whatever the reason (--max-refused-messages closes it)
        self.client: str | None = None  # host:port of the socket's peer (log lines)
        self.commands: collections.deque = collections.deque()  # for the worker (under the manager's lock)
        self.run = 0  # bumped by every (re)start: blocks of an older run are not sent
        self.next_seed: int | None = None  # Krea: a `seed` update applies at the next reset
        self.generation: Any = None  # (worker)
        self.reading = False  # (worker) the run's input video is being read (off the worker)
        self.writer: Any = None  # (worker)
        self.blocks_done = 0  # (worker) blocks of the current run
        self.frames_done = 0  # (worker)
        self.accepted = self.later = 0  # (worker)
        self.t_start = 0.0
        self.first_frame_sent = False
        self.last_block_sent: float | None = None
        self.last_interval: float | None = None
        self.play_end: float | None = None  # (worker) when the frames made so far run out, played at the server's fps
        self.alone: dict[str, str] = {}  # (worker) batched worker: role -> why its calls run alone (its stats say)
        self.lock = asyncio.Lock()  # orders encoded blocks and text messages

    def deadline(self) -> float:
        """(worker) When this session's next block is due: when its playback runs dry (the frames made so far
        played at the server's fps from the first one), or, before its first block, its start (ttff counts)."""
        return self.play_end if self.play_end is not None else self.t_start

    def played(self, now: float, frames: int, fps: float) -> float:
        """(worker) A block of `frames` frames made at `now`: how late it came (seconds its playback had run dry
        for; 0 on time, and for a run's first block), and the playback extended by it."""
        late = 0.0 if self.play_end is None else max(0.0, now - self.play_end)
        self.play_end = max(now, self.play_end or now) + frames / fps
        return late

    def post_text(self, message: dict) -> None:
        """A text message after every block already handed over (from any thread)."""
        self.post(self._ordered, ("text", message))

    def completed(self) -> dict:
        """Krea's `completed`, whose session_id names the video to download (the socket's own: `id.N` when another
        socket held the id); sdvg clients also get its `download_url`."""
        out = {"session_id": self.video_key, "status": "completed"}
        if self.superset:  # this run's own video: no later run (a reset, the id reused) replaces it
            out["download_url"] = f"/download_video/{self.run_key or self.video_key}"
        return out

    def post_error(self, message: str, field: str | None = None, failed: bool = False) -> None:
        """An error, after every block already handed over (from any thread): sdvg's `error` to an sdvg client;
        to a plain one Krea's `{"error"}` when the run `failed` (could not start, broke off), else nothing (Krea
        is silent), the operator told either way."""
        if self.superset:
            self.post_text({"status": "error", "error": message, "field": field})
            return
        self.adjusted.tell("run_failed" if failed else "dropped_update", message)
        if failed:
            self.post_text(failure(message))

    def post_close(self, code: int, reason: str = "") -> None:
        self.post(self._ordered, ("close", code, reason))

    def _ordered(self, item) -> None:
        asyncio.ensure_future(self._ordered_async(item))

    async def _ordered_async(self, item) -> None:
        async with self.lock:  # FIFO: after the frames of the blocks handed over before it
            if item[0] == "text":
                self.outbox.text(item[1])
            else:
                self.outbox.close(item[1], item[2])

    def post(self, fn, *args) -> None:
        """Run fn(*args) on the event loop (from the worker)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is gone
            pass


class WorkerHook(Protocol):
    """A seam for tests: what the worker is asked, watched, and the worker held between blocks.
    `SessionManager(hook=...)` (or `create_app(hook=...)`, or `manager.hook = ...` while it runs) installs one; with
    none (the default) nothing is called and nothing is paid. tests/serve_harness.py's `BlockGate` is one."""

    def queued(self, session: Session, command: Command) -> None:
        """`command` was queued for `session` (on the thread that queued it, under the manager's lock: return at
        once)."""

    def before_block(self, session: Session) -> None:
        """The worker is about to run `session`'s next block (on the worker, outside the lock: it may wait here,
        which holds every session)."""


class SessionManager:
    def __init__(self, engine: Engine, cfg: ServeConfig, metrics: ServeMetrics, videos: VideoStore,
                 uploads=None, hook: WorkerHook | None = None):
        self.engine, self.cfg, self.metrics, self.videos, self.uploads = engine, cfg, metrics, videos, uploads
        self.hook = hook
        self.cond = threading.Condition()
        self.active: list[Session] = []  # admitted (running or paused), in round-robin order
        self.queue: collections.deque[Session] = collections.deque()
        self.closing: list[Session] = []  # sockets gone or runs ended early, for the worker to close
        self.keys: set[str] = set()  # video keys of open sockets
        self.sockets: set[Session] = set()  # every open socket's session (shutdown closes the idle ones at once)
        self.turn = 0
        # the batched worker's batcher: one round at a time, at most max_sessions rows in a call
        self.batcher = (StageBatcher(max_rows=cfg.max_sessions, batch_decode=cfg.batch_decode)
                        if cfg.session_scheduler == "batched" else None)
        self.capacity = CapacityModel()  # measured round costs: `--min-session-fps` admission (sdvg/serve/capacity.py)
        self.stopping = False
        self.busy_block = False
        self.thread = threading.Thread(target=self._work, name="sdvg-serve-worker", daemon=True)

    def start(self) -> None:
        self.thread.start()

    # ------------------------------------------------------------------ called on the event loop
    def opened(self, session: Session) -> bool:
        """A socket is open (False once the server is stopping: it is closed at once, 1001)."""
        with self.cond:
            if self.stopping:
                return False
            self.sockets.add(session)
            return True

    def claim_key(self, session_id: str) -> str | None:
        """The video key of a new socket: its session id, or `id.N` (the smallest N free) while another open socket
        holds the id, so its runs never replace that one's video (None past MAX_SHARED_ID sockets on one id)."""
        with self.cond:
            key = session_id
            n = 0
            while key in self.keys:
                n += 1
                if n > MAX_SHARED_ID:
                    return None
                key = f"{session_id}.{n}"
            self.keys.add(key)
            return key

    def admit(self, session: Session, spec: SessionSpec) -> str:
        """Start (or queue) a generation: 'running', 'queued', 'busy', or 'closed' (the socket was released: a reset
        that came after it was cut starts nothing)."""
        with self.cond:
            if session.state == "closed":
                return "closed"
            if self.stopping:
                return "busy"
            session.spec = spec
            described = _described(spec)
            if session.state == "running":  # a reset: the slot is kept
                self._restart(session)
                session_event(session, "reset", run=session.run, **described)
                return "running"
            if self._has_room():
                self.active.append(session)
                session.state = "running"
                self._restart(session)
                self._counts()
                session_event(session, "started", run=session.run, **described)
                return "running"
            if len(self.queue) >= self.cfg.max_queue:
                self.metrics.busy_total.inc()
                session_event(session, "busy", active=len(self.active), queued=len(self.queue))
                return "busy"
            self.queue.append(session)
            session.state = "queued"
            session_event(session, "queued", position=len(self.queue), **described)
            self._counts()
            self._tell_positions()
            if not session.superset:
                session.adjusted.tell("queued", f"every slot is busy: waits at position {len(self.queue)}, told "
                                      "nothing (Krea has no queue; sdvg_serve_plain_sessions_queued)")
            return "queued"

    def command(self, session: Session, command: Command) -> None:
        """Queue `command` for the worker: applied between two blocks, in order (from any thread)."""
        with self.cond:
            self._queue(session, command)

    def snapshot(self, video_key: str) -> concurrent.futures.Future | None:
        """The frames so far of the run writing video `video_key` (a video key or that run's run key): a Future of
        hard-linked finished segments that the worker makes between two blocks (`VideoStore.snapshot_links`), or
        None when no admitted session is writing it (its run is being finished)."""
        key = video_key.split("~", 1)[0]  # a run key: its socket's video key, while that run is the one written
        if "~" in video_key and self.videos.writing(key) != video_key:
            return None
        with self.cond:
            session = next((s for s in self.active if s.video_key == key), None)
            if session is None:
                return None
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._queue(session, Snapshot(future))
        return future

    def pause(self, session: Session, paused: bool) -> None:
        with self.cond:
            if paused and not session.paused:
                session.paused_at = time.monotonic()
            session.paused = paused
            if not paused:
                session.paused_at = None
            self.cond.notify()

    def end_run(self, session: Session, why: str) -> None:
        """End the session's run now (a pause past --max-pause-s): its MP4 finished, its slot freed, `completed`
        sent; the socket stays open."""
        with self.cond:
            if session.state != "running":
                return
            session.paused = False
            session.paused_at = None
            self._queue(session, EndRun(why))

    def release(self, session: Session) -> None:
        """The socket is gone: out of the rotation now; the worker closes its generation next. Once per socket (a
        stalled socket is released when it is cut and again when it closes: the second finds nothing)."""
        with self.cond:
            if session not in self.sockets:
                return
            self.keys.discard(session.video_key)
            self.sockets.discard(session)
            if session in self.queue:
                self.queue.remove(session)
                self._tell_positions()
            if session in self.active:
                self.active.remove(session)
                self._promote()
            session.state = "closed"
            _drop_snapshots(session)
            self.closing.append(session)
            self._counts()
            self.cond.notify()

    def stop(self) -> None:
        """Shutdown: sockets with nothing running or queued are closed at once (1001), queued ones told the server
        is going away and closed; the block in progress ends, then every generation is finished (MP4 included),
        `completed` sent and its socket closed (1001)."""
        with self.cond:
            self.stopping = True
            idle = [s for s in self.sockets if s.state in ("new", "done")]
            queued = list(self.queue)
            self.queue.clear()
            self._counts()
            self.cond.notify()
        for s in idle:
            s.post_close(1001, "server shutting down")
        for s in queued:
            session_event(s, "shutdown", state="queued", ran=False)
            if s.superset:
                s.post_text({"status": "error", "error": "the server is shutting down; this session did not run",
                             "field": None})
            s.post_close(1001, "server shutting down before this session ran")
        self.thread.join(self.cfg.drain_timeout_s)

    # ------------------------------------------------------------------ under the lock
    def _queue(self, session: Session, command: Command) -> None:
        if not isinstance(command, Command):  # refused on the caller's thread: the worker never sees it
            raise TypeError(f"not a worker command (sdvg.serve.commands): {command!r}")
        session.commands.append(command)
        if self.hook is not None:
            self.hook.queued(session, command)
        self.cond.notify()

    def _restart(self, session: Session) -> None:
        session.run += 1
        session.t_start = time.perf_counter()
        session.first_frame_sent = False
        session.last_block_sent = session.last_interval = None
        self.metrics.sessions_total.inc()
        self._queue(session, Start(session.run, session.spec))

    def _has_room(self) -> bool:
        """(under the lock) Whether one more session may run: a slot is free and, with `--min-session-fps`, the
        measured round costs say every admitted session keeps that rate with it (the first always runs)."""
        return len(self.active) < self.cfg.max_sessions and self.capacity.admits(len(self.active) + 1,
                                                                                  self.cfg.min_session_fps)

    def _promote(self) -> None:
        while self.queue and self._has_room():
            nxt = self.queue.popleft()
            self.active.append(nxt)
            nxt.state = "running"
            self._restart(nxt)
            session_event(nxt, "started", run=nxt.run, from_queue=True)
            if nxt.superset:  # sdvg: the slot is held now (a webcam page starts sending frames)
                nxt.post_text({"status": "running", "session_id": nxt.id})
        self._tell_positions()

    def _tell_positions(self) -> None:
        """sdvg clients hear their place in the queue; plain ones wait silently (Krea has no queue)."""
        why = "slots" if len(self.active) >= self.cfg.max_sessions else "capacity"
        for pos, s in enumerate(self.queue, 1):
            if s.superset:
                s.post_text({"status": "queued", "position": pos, "session_id": s.id, "reason": why})

    def _counts(self) -> None:
        self.metrics.sessions_active.set(len(self.active))
        self.metrics.sessions_queued.set(len(self.queue))
        self.metrics.plain_queued.set(sum(not s.superset for s in self.queue))

    def _runnable(self) -> list[Session]:
        """Sessions whose next block can run now: not paused, no command waiting, and (webcam) its frames queued."""
        return [s for s in self.active if not s.paused and s.generation is not None and not s.commands
                and self.engine.input_ready(s.generation)]

    def _next(self) -> Session | None:
        """The next session in round-robin order over the admitted ones (advances the turn)."""
        runnable = self._runnable()
        if not runnable:
            return None
        order = self.active[self.turn % len(self.active):] + self.active[:self.turn % len(self.active)]
        pick = next(s for s in order if s in runnable)
        self.turn = self.active.index(pick) + 1
        return pick

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.stopping and not self.closing and not any(s.commands for s in self.active) \
                        and not self._runnable():
                    self.cond.wait()
                if self.stopping:
                    break
                closing, self.closing = self.closing, []
                commands = self._waiting_commands()
            for s in closing:
                self._end(s, reason="closed")
            self._apply_all(commands)
            with self.cond:
                picks = self._runnable() if self.batcher is not None else [p for p in [self._next()] if p]
            if self.hook is not None:
                for pick in picks:
                    self.hook.before_block(pick)
            if picks:
                self._step(picks)
        # shutdown: finish every generation and MP4, tell each socket completed, close it
        with self.cond:
            every = self.active + list(self.queue) + self.closing
            for s in every:
                _drop_snapshots(s)
            self.active, self.closing = [], []
            self.queue.clear()
            self._counts()
        for s in every:
            if s.generation is not None:
                session_event(s, "shutdown", state=s.state, blocks=s.blocks_done, frames=s.frames_done)
            self._end(s, reason="shutdown")
            if s.state != "closed":
                s.post_text(s.completed())
                s.post_close(1001)

    def _waiting_commands(self) -> list[tuple[Session, Command]]:
        """Every waiting command at once (webcam frames arrive many a second: none may wait behind a block); under
        the lock."""
        return [(s, s.commands.popleft()) for s in self.active for _ in range(len(s.commands))]

    def _apply_all(self, commands: list[tuple[Session, Command]]) -> None:
        """`commands`, in order; while they start runs, the commands that came meanwhile too (at most max_sessions
        more passes), so that sessions whose parameters arrive together start in the same round: in step, their blocks
        batch together from block 0 on (otherwise the first one's block 0 runs alone and it stays a block ahead)."""
        passes = 0
        while commands:
            for s, cmd in commands:
                self._apply(s, cmd)
            passes += 1
            # only a socket's first run asks for another pass (a stream of resets must not hold every round back)
            if passes > self.cfg.max_sessions or not any(isinstance(c, Start) and c.run == 1 for _, c in commands):
                return
            with self.cond:
                commands = self._waiting_commands()

    def _apply(self, s: Session, cmd: Command) -> None:
        """One command, on the worker between two blocks."""
        match cmd:
            case Start():
                self._start(s, cmd)
            case InputRead():
                self._input_read(s, cmd)
            case EndRun():
                self._end_run(s, cmd)
            case Snapshot():
                self._snapshot(s, cmd)
            case LiveUpdate():
                self._update(s, cmd)
            case _:
                raise TypeError(f"not a worker command: {cmd!r}")

    def _start(self, s: Session, cmd: Start) -> None:
        self._end(s, reason="restart")
        s.gen_run = cmd.run
        s.reading = cmd.spec.input_video is not None and self.engine.live
        if s.reading:  # read off the worker: the other sessions' blocks go on meanwhile
            threading.Thread(target=self._read_input, args=(s, cmd.run, cmd.spec), name=f"sdvg-serve-read-{s.id}",
                             daemon=True).start()
            return
        self._begin(s, cmd.spec, None)

    def _input_read(self, s: Session, cmd: InputRead) -> None:
        """An uploaded video read for run `cmd.run` (or why it could not be)."""
        if cmd.run != s.gen_run:  # a reset came while it was read: that run's own read follows
            return
        s.reading = False
        if isinstance(cmd.clip, Exception):
            session_event(s, "failed", at="input_video", error=type(cmd.clip).__name__, why=str(cmd.clip)[:80])
            s.post_error(f"could not start: {cmd.clip}", failed=True)
            self._finished(s)
            return
        self._begin(s, cmd.spec, cmd.clip)

    def _end_run(self, s: Session, cmd: EndRun) -> None:
        """The run ends early (a pause past --max-pause-s): completed, the slot freed."""
        session_event(s, "ended", why="max_pause", blocks=s.blocks_done, frames=s.frames_done)
        if s.superset:
            s.post_text({"status": "error", "error": cmd.why, "field": None})
        else:
            s.adjusted.tell("run_ended", cmd.why)
        self._end(s, reason="ended")
        self._finished(s)
        s.post_text(s.completed())

    def _snapshot(self, s: Session, cmd: Snapshot) -> None:
        """A download while the run is written: its frames so far."""
        try:
            cmd.future.set_result(self.videos.snapshot_links(s.writer) if s.writer is not None else [])
        except Exception as exc:  # the segment could not be finished: the download says so
            cmd.future.set_exception(exc)

    def _update(self, s: Session, cmd: LiveUpdate) -> None:
        """A live update (live sessions only: engine.live)."""
        if s.reading:  # its input video is still being read
            s.post_error(f"{cmd.field}: the session's input video is still being read; send it once the first "
                         "frames came", cmd.field)
            return
        try:
            block = s.generation.update(**cmd.changes).block  # LiveSession.update: the block it takes effect at
        except Exception as exc:
            s.post_error(f"{cmd.field}: {exc}", cmd.field)
            return
        if s.superset and cmd.field != "image":  # webcam frames are not acknowledged (Krea sends nothing)
            s.post_text({"status": "ack", "field": cmd.field, "block": block, "request_id": cmd.request_id})

    def _begin(self, s: Session, spec: SessionSpec, clip) -> None:
        """The run's generation and MP4 (worker); `clip`: its input video, already read."""
        try:
            s.generation = self.engine.start(spec, clip, batcher=self.batcher)
            s.writer = self.videos.writer(s.video_key)
        except Exception as exc:  # e.g. a memory budget refusal, an unreadable video
            session_event(s, "failed", at="start", error=type(exc).__name__, why=str(exc)[:80])
            s.post_error(f"could not start: {exc}", failed=True)
            self._finished(s)
            return
        s.blocks_done = s.frames_done = s.accepted = s.later = 0
        s.play_end = None  # a new run's playback starts with its first block
        opts = getattr(s.generation, "opts", None)  # a live session's resolved options
        s.alone = {} if self.batcher is None or opts is None else {
            role: why for role in (*opts.roles, "reward") if (why := why_alone(opts, role)) is not None}

    def _read_input(self, s: Session, run: int, spec: SessionSpec) -> None:
        """(its own thread) Read the run's input video, then hand it to the worker (`InputRead`)."""
        try:
            clip = self.engine.read_input(spec)
        except Exception as exc:
            clip = exc
        self.command(s, InputRead(run, spec, clip))

    def _step(self, sessions: list[Session]) -> None:
        """The next block of each of `sessions`: one round of the batcher (batched), or the one session's alone; a
        whole round (none ended or failed) is measured for admission."""
        t0 = time.perf_counter()
        if self.batcher is None:
            frames = [self._took(s, *_next_block(s.generation), t0) for s in sessions]
        else:
            frames = self._round(sessions, t0)
        if all(frames) and len(frames) == len(sessions):
            self._measured(len(sessions), time.perf_counter() - t0, sum(frames) / len(frames))

    def _round(self, sessions: list[Session], t0: float) -> list[int]:
        """One round of the batcher over `sessions`, earliest deadline first (a session's playback running dry; a new
        one's first frame: its start), each block handed over as soon as it is made while the round goes on -> each
        session's block's frames (0: its run ended or failed), in the order the blocks were made."""
        stats = self.batcher.stats
        calls, busy = collections.Counter(stats.calls), collections.Counter(stats.lane_seconds)
        made = []
        self.batcher.run_round([s.generation.__next__ for s in sessions], [s.deadline() for s in sessions],
                               on_done=lambda i, ok, outcome: made.append(self._took(sessions[i], ok, outcome, t0)))
        self.metrics.round(len(sessions), stats.calls - calls, stats.lane_seconds - busy)
        return made

    def _measured(self, sessions: int, seconds: float, frames_per_block: float) -> None:
        """A whole round's cost, for admission by rate: it may let a waiting session in."""
        with self.cond:
            self.capacity.observe(sessions, seconds, frames_per_block)
            if self.cfg.min_session_fps > 0:
                self._promote()
                self._counts()

    def _took(self, s: Session, ok: bool, outcome, t0: float) -> int:
        """A session's next block (`ok`), or how its generation ended (StopIteration) or failed -> the block's frames
        (0: none)."""
        if not ok and isinstance(outcome, StopIteration):  # the slot is free before the client hears of the end
            session_event(s, "completed", run=s.run, blocks=s.blocks_done, frames=s.frames_done,
                          acceptance=s.accepted / s.later if s.later else None,
                          seconds=time.perf_counter() - s.t_start, dropped_frames=s.outbox.dropped)
            self._end(s, reason="completed")
            self._finished(s)
            s.post_text(s.completed())
            return 0
        if not ok:
            exc = outcome
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not the session's failure
                raise exc
            traceback.print_exception(exc)
            session_event(s, "failed", at=f"block {s.blocks_done}", error=type(exc).__name__, why=str(exc)[:80])
            self._end(s, reason="error")
            self._finished(s)
            s.post_error(f"generation failed at block {s.blocks_done}: {type(exc).__name__}: {exc}", failed=True)
            return 0
        block = outcome
        now = time.perf_counter()
        self.metrics.block_latency.observe(now - t0)
        self.metrics.block(block.index, block.decision)
        frames = block.frames.cpu().numpy()  # uint8 [T, H, W, 3]
        try:
            s.writer.write(block.frames)
        except Exception as exc:  # the MP4 failed; the stream goes on
            s.post_error(f"video file: {exc}")
        if block.index > 0 and block.decision in ("accepted", "rejected"):
            s.later += 1
            s.accepted += block.decision == "accepted"
        first = s.frames_done
        late_s = s.played(now, frames.shape[0], self.cfg.fps)
        if late_s > 0:
            self.metrics.deadline_misses.inc()
        s.blocks_done += 1
        s.frames_done += frames.shape[0]
        stats = None
        if s.superset:
            stats = {"status": "stats", "block": block.index, "decision": block.decision, "score": block.score,
                     "producer": PRODUCER.get(block.decision, block.decision), "frames": int(frames.shape[0]),
                     "first_frame": first, "times": {k: round(v, 6) for k, v in block.times.items()},
                     "acceptance": s.accepted / s.later if s.later else None, "latency_s": now - t0,
                     "late_s": round(late_s, 6),
                     "session_fps": round(s.frames_done / (now - s.t_start), 3) if now > s.t_start else None}
            if s.alone:  # never refused for it: its calls run in batches of its own
                stats["alone"] = s.alone
            live = getattr(block, "live", None)  # a live session's block: the prompt it was made under
            if live:
                stats.update(prompt_index=live["prompt_index"], blend_weight=live["blend_weight"],
                             forced_by_update=live["forced_by_update"])
        s.post(self._deliver, s, s.gen_run, block.index, first, frames, stats)
        return int(frames.shape[0])

    def _end(self, s: Session, reason: str) -> None:
        """Close the generation and finish its MP4 (worker)."""
        if s.generation is not None and reason == "closed":  # the socket went away mid-run
            session_event(s, "closed", during="run", blocks=s.blocks_done, frames=s.frames_done)
        if s.generation is not None:
            try:
                self.engine.close(s.generation)
            except Exception:
                traceback.print_exc()
            s.generation = None
        if s.writer is not None:
            s.run_key = s.writer.run_key
            try:
                self.videos.finish(s.video_key, s.writer)
            except Exception as exc:
                s.post_error(f"video file: {exc}")
            s.writer = None
        if reason in ("closed", "shutdown") and self.uploads is not None:
            self.uploads.expire()

    def _finished(self, s: Session) -> None:
        """The run ended (completed or failed): the slot goes to the queue; the socket stays open."""
        with self.cond:
            if s in self.active:
                self.active.remove(s)
                self._promote()
            if s.state == "running":
                s.state = "done"
            self._counts()

    # ------------------------------------------------------------------ back on the event loop
    def _deliver(self, s: Session, run: int, block: int, first: int, frames: np.ndarray, stats) -> None:
        if run != s.run or s.state == "closed":
            return  # a block of a run that was reset, or of a socket that is gone
        asyncio.ensure_future(self._send_block(s, run, block, first, frames, stats))

    async def _send_block(self, s: Session, run, block, first, frames, stats) -> None:
        async with s.lock:
            await self._send_block_locked(s, run, block, first, frames, stats)

    async def _send_block_locked(self, s: Session, run, block, first, frames, stats) -> None:
        loop = asyncio.get_running_loop()
        request_id = s.spec.request_id if s.spec else None
        messages = await loop.run_in_executor(None, encode_block, frames, s.fmt, block, first, request_id,
                                              self.cfg.jpeg_quality)
        if run != s.run:
            return
        now = time.perf_counter()
        if not s.first_frame_sent:
            s.first_frame_sent = True
            self.metrics.first_frame.observe(now - s.t_start)
        if s.last_block_sent is not None:
            interval = now - s.last_block_sent
            self.metrics.inter_block.observe(interval)
            if s.last_interval is not None:
                self.metrics.jitter.observe(abs(interval - s.last_interval))
            s.last_interval = interval
        s.last_block_sent = now
        for m in messages:
            s.outbox.frame(m)
        if stats is not None:
            stats["queue_depth"] = s.outbox.frames
            stats["dropped_frames"] = s.outbox.dropped
            s.outbox.text(stats)


def _next_block(generation) -> tuple[bool, object]:
    """(True, the generation's next block), or (False, the exception that ended it: StopIteration at its end)."""
    try:
        return True, next(generation)
    except Exception as exc:  # StopIteration included
        return False, exc


def _described(spec) -> dict:
    """What a session's log lines say of its parameters (never the prompt's text)."""
    o = getattr(spec, "options", None)
    if o is None:
        return {}
    return dict(blocks=o.num_blocks, seed=o.seed, mode=o.mode, tau=o.tau, prompt_chars=len(spec.prompt or ""),
                size=f"{spec.width}x{spec.height}" if spec.width else None,
                input_video=spec.input_video is not None or None, webcam=spec.webcam or None,
                start_frame=spec.start_frame is not None or None)


def _drop_snapshots(s: Session) -> None:
    """(under the manager's lock) Snapshots asked of a session whose run the worker will not step again: cancelled,
    so the download waiting for one answers at once."""
    for cmd in s.commands:
        if isinstance(cmd, Snapshot):
            cmd.future.cancel()
