"""One websocket session, `WS /session/{id}`: a `Connection` per accepted socket, whose `run()` is its receive loop.

A message goes: `run()` -> `_receive_loop()` (timeouts, frame kind, size, decode, rate) -> `_handle()` -> the first
one to `on_params` (the generation's parameters), every later one to `on_update`, which hands each part of it to
its handler (`on_reset`, `on_pause`, `on_ping`, `on_seed`, `on_image`, the live prompt and router fields). A refused
message goes to `refuse` (one budget per socket); what the server sends goes through the socket's `Outbox` and
`_send_loop`. A send that waits `--send-stall-s` (the client stopped reading) cuts the socket (`_stalled`). The
worker's side is `sdvg.serve.sessions`; the wire format, docs/server.md."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import time
from typing import Callable

from sdvg.generation.types import strict_json
from sdvg.live.updates import ROUTER_FIELDS
from sdvg.serve.commands import LiveUpdate
from sdvg.serve.config import ServeConfig
from sdvg.serve.encode import FORMATS
from sdvg.serve.engine import Engine
from sdvg.serve.events import refusal_event, session_event
from sdvg.serve.metrics import ServeMetrics
from sdvg.serve.plain import params_error, plain_params, plain_update
from sdvg.serve.protocol import UPLOAD_ID, ProtocolError, Update, decode_message, parse_params, parse_update
from sdvg.serve.security import RateLimit, valid_session_id
from sdvg.serve.sessions import Outbox, Session, SessionManager
from sdvg.serve.uploads import UploadError, UploadStore, decode_frame, image_bytes


class Connection:
    """One socket's session, from its handshake to its close. `senders`: the server's running send loops (its
    shutdown waits for them)."""

    def __init__(self, websocket, session_id: str, *, manager: SessionManager, cfg: ServeConfig,
                 metrics: ServeMetrics, engine: Engine, uploads: UploadStore, senders: set[asyncio.Task],
                 cut: Callable[[tuple], bool] = lambda peer: False):
        self.websocket, self.session_id = websocket, session_id
        self.manager, self.cfg, self.metrics, self.engine, self.uploads = manager, cfg, metrics, engine, uploads
        self.senders = senders
        self.cut = cut  # (host, port) -> the connection aborted at once (False: the server cannot; see `_stalled`)
        self.receiver: asyncio.Task | None = None  # the task of `run()` (its receive loop), once open
        self.stalled = False
        self.closing = False  # `_close` has begun: the receive loop is over
        self.fmt = websocket.query_params.get("fmt", "jpeg")
        self.superset = websocket.query_params.get("sdvg", "0") in ("1", "true")  # sdvg's superset (?sdvg=1)
        self.session: Session | None = None
        self.sender: asyncio.Task | None = None
        self.opened = 0.0  # time.monotonic() when its receive loop began (the first message's timeout counts from it)
        self.rate = RateLimit(cfg.updates_per_s, cfg.update_burst)
        self.frame_rate = RateLimit(cfg.input_frames_per_s, max(1, round(cfg.input_frames_per_s)))  # webcam frames
        self.limits = dict(max_array_len=max(cfg.max_blocks, 64), max_bin_len=cfg.max_image_bytes,
                           max_str_len=max(4 * cfg.max_prompt_chars, (cfg.max_image_bytes + 2) // 3 * 4 + 256))

    @property
    def outbox(self) -> Outbox:
        return self.session.outbox

    # ------------------------------------------------------------------ the socket's life
    async def run(self) -> None:
        """The handshake, `ready`, then every message until the socket closes (or is closed)."""
        if not await self._open():
            return
        self.receiver = asyncio.current_task()
        try:
            await self._receive_loop()
        except asyncio.CancelledError:
            # `_stalled` ended the receive loop: the socket's life ends here, normally; any other cancellation (the
            # server's) goes on (Python 3.10 counts no cancellations: there is nothing to undo)
            uncancel = getattr(self.receiver, "uncancel", None)
            if not self.stalled or (uncancel is not None and uncancel() > 0):
                raise
        finally:
            await self._close()

    async def _open(self) -> bool:
        """Accept the socket, register its session and start its send loop; False when it was closed instead."""
        websocket, session_id, manager = self.websocket, self.session_id, self.manager
        if not valid_session_id(session_id) or self.fmt not in FORMATS:
            self.metrics.refused.labels("handshake").inc()
            await websocket.close(code=1008, reason="session id: [A-Za-z0-9_-]{1,64}; fmt: " + "|".join(FORMATS))
            return False
        await websocket.accept()
        outbox = Outbox(self.cfg.send_buffer_frames, self.metrics)
        session = self.session = Session(session_id, self.fmt, self.superset, asyncio.get_running_loop(), outbox)
        peer = websocket.client
        session.client = f"{peer.host}:{peer.port}" if peer else None
        if not manager.opened(session):
            await websocket.close(code=1001, reason="server shutting down")
            return False
        key = manager.claim_key(session_id)  # another open socket on the id: this one's videos are its own
        if key is None:
            manager.release(session)
            await websocket.close(code=1008, reason=f"too many sockets on session id {session_id}")
            return False
        session.video_key = session.adjusted.session_id = key  # log lines name the socket's own key
        self.sender = asyncio.create_task(self._send_loop())
        self.senders.add(self.sender)
        self.sender.add_done_callback(self.senders.discard)
        outbox.text(self._ready(key))
        return True

    def _ready(self, key: str) -> dict:
        ready = {"status": "ready", "worker": socket.gethostname()}
        if self.superset:
            h, w = self.engine.size
            ready.update(session_id=self.session_id, preset=self.engine.preset.name, width=w, height=h,
                         live=self.engine.live, fmt=self.fmt, replica=f"{socket.gethostname()}:{os.getpid()}",
                         download_url=f"/download_video/{key}", fps=self.cfg.fps,
                         random_weights=bool(getattr(self.engine.preset, "random_weights", False)))
        return ready

    async def _close(self) -> None:
        """The socket is gone (or closing): out of the worker's rotation, its upload released, its send loop given
        two seconds to send what is left."""
        session = self.session
        self.closing = True
        self.manager.release(session)
        if session.upload is not None:
            self.uploads.release(session.upload)
        if not self.sender.done():
            self.outbox.close(1000)
            try:
                await asyncio.wait_for(asyncio.shield(self.sender), 2.0)
            except (asyncio.TimeoutError, Exception):
                self.sender.cancel()
                if not self.stalled:  # its last sends waited 2 s: a client that stopped reading, cut as one
                    self._stalled(waited_s=2.0)

    async def _send_loop(self) -> None:
        """The outbox to the socket, in order, until a close item (or the client is gone). Each send may wait
        `--send-stall-s` for the client to read (the socket's buffers are full); longer, and the socket is cut."""
        websocket, outbox, stall_s = self.websocket, self.outbox, self.cfg.send_stall_s
        try:
            while True:
                item = await outbox.next()
                if item[0] == "text":
                    await asyncio.wait_for(websocket.send_text(strict_json(item[1])), stall_s)
                elif item[0] == "frame":
                    await asyncio.wait_for(websocket.send_bytes(item[1]), stall_s)
                else:
                    await asyncio.wait_for(websocket.close(code=item[1], reason=item[2]), stall_s)
                    return
        except asyncio.TimeoutError:
            if not self.stalled:
                self._stalled(waited_s=stall_s)
        except Exception:  # the client is gone
            return

    def _stalled(self, waited_s: float) -> None:
        """The client stopped reading: one send waited --send-stall-s (or, at close, its last sends 2 s). Its session
        leaves the worker's rotation now (the others' rounds go on without it; its MP4 is finished), it is counted,
        and the connection is cut: aborted, its unsent bytes dropped, where the server can (sdvg's server, a client
        address the app sees as the socket's peer); else the receive loop ends and the socket stays open until the
        client reads its bytes or goes away (a close frame would wait behind them)."""
        session, outbox = self.session, self.outbox
        self.stalled = True
        self.metrics.stalled.inc()
        session_event(session, "closed", why="send_stall", waited_s=waited_s, dropped=outbox.dropped,
                      unsent=len(outbox.items))
        self.manager.release(session)
        peer = self.websocket.client
        if peer is not None and self.cut((peer.host, peer.port)):
            return
        if self.receiver is not None and not self.closing:  # (once closing, the receive loop is over already)
            self.receiver.cancel()

    # ------------------------------------------------------------------ the receive loop
    def _wait_limit(self) -> tuple[float | None, str]:
        """How long this socket's next message may take, and what happens when it does not come: 'first' (no
        parameters yet: --first-message-timeout from the socket's opening; messages refused meanwhile do not extend
        it), 'pause' (paused: --max-pause-s from the pause; pings do not extend it), 'idle' (nothing running:
        --idle-timeout), or none while a run or the queue is in progress."""
        session, cfg = self.session, self.cfg
        now = time.monotonic()
        if session.spec is None:
            return max(0.0, self.opened + cfg.first_message_timeout_s - now), "first"
        if session.paused and session.state == "running" and session.paused_at is not None:
            return max(0.0, session.paused_at + cfg.max_pause_s - now), "pause"
        if session.state not in ("running", "queued"):
            return cfg.idle_timeout_s, "idle"
        return None, "none"

    async def _receive_loop(self) -> None:
        session, cfg = self.session, self.cfg
        self.opened = time.monotonic()
        while True:
            timeout, kind = self._wait_limit()
            try:
                message = await asyncio.wait_for(self.websocket.receive(), timeout)
            except asyncio.TimeoutError:
                if self._timed_out(kind):
                    return
                continue
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes")
            if data is None:
                if self.refuse(ProtocolError(None, "messages must be binary msgpack maps (text frames are not "
                                             "read)"), "text"):
                    return
                continue
            if len(data) > cfg.max_message_bytes:
                self.refuse(ProtocolError(None, f"message of {len(data)} bytes; at most {cfg.max_message_bytes}"),
                            "size")
                self.outbox.close(1009)
                return
            try:
                obj = decode_message(data, **self.limits)
            except ProtocolError as exc:
                obj = exc
            webcam = isinstance(obj, dict) and obj.get("image") is not None  # webcam frames have their own rate
            limit = self.frame_rate if webcam else self.rate
            if session.spec is not None and not limit.allow():
                what = (f"{cfg.input_frames_per_s:g} webcam frames" if webcam else f"{cfg.updates_per_s:g} updates")
                if self.refuse(ProtocolError(None, f"more than {what} per second; this one was dropped"), "rate"):
                    return
                continue
            if isinstance(obj, ProtocolError):
                if self.refuse(obj, "malformed"):
                    return
                continue
            try:
                await self._handle(obj)
            except ProtocolError as exc:
                if self.refuse(exc, "invalid"):
                    return
            if self.outbox.items and self.outbox.items[-1][0] == "close":
                return

    def _timed_out(self, kind: str) -> bool:
        """No message within the wait limit of `kind`: a pause's run ends (the socket stays: False); else the socket
        is closed (True)."""
        session, cfg = self.session, self.cfg
        if kind == "pause":  # the run ends; the socket stays (a reset starts it again)
            self.metrics.refused.labels("pause").inc()
            self.manager.end_run(session, f"paused for more than {cfg.max_pause_s:g} s (--max-pause-s): the run "
                                 "ends and its slot goes to the next session")
            return False
        why = (f"no parameters within {cfg.first_message_timeout_s:g} s (--first-message-timeout)"
               if kind == "first" else f"idle for {cfg.idle_timeout_s:g} s")
        self.metrics.refused.labels("timeout").inc()
        session_event(session, "closed", why="first_message_timeout" if kind == "first" else "idle_timeout")
        if session.superset:
            self.outbox.text({"status": "error", "error": f"{why}; closing", "field": None})
        self.outbox.close(1000)
        return True

    async def _handle(self, obj) -> None:
        """A decoded message: the parameters when the socket has none yet, else an update."""
        if self.session.spec is None:
            await self.on_params(obj)
        else:
            await self.on_update(obj)

    def refuse(self, error: ProtocolError, reason: str) -> bool:
        """A refused message, counted by reason (the error's own, where it has one): sdvg's `error` to an sdvg client;
        to a plain one Krea's reply to bad parameters before its run started, else nothing (Krea is silent), the
        operator told (sdvg.serve.plain). Every refusal, whatever its kind, counts against one budget per socket:
        True when it is spent (the socket is closed, 1008)."""
        session, cfg = self.session, self.cfg
        self.metrics.refused.labels(error.reason or reason).inc()
        refusal_event(session, error.reason or reason, str(error))
        session.refusals += 1
        if session.refusals >= cfg.flood_close_after:
            why = (f"{session.refusals} messages refused on this socket (at most {cfg.flood_close_after}, "
                   "--max-refused-messages); closing")
            session_event(session, "closed", why="max_refused_messages", refused=session.refusals)
            if session.superset:
                session.outbox.text({"status": "error", "error": why, "field": None})
            else:
                session.adjusted.tell("closed_refusals", why)
            session.outbox.close(1008, "too many refused messages")
            return True
        if session.superset:
            session.outbox.text(error.reply())
        elif session.spec is None:
            session.adjusted.tell("refused_params", f"parameters refused: {error}")
            session.outbox.text(params_error(error))
        else:
            session.adjusted.tell("dropped_update", f"{error}; dropped without a reply")
        return False

    # ------------------------------------------------------------------ the first message: the parameters
    async def on_params(self, obj) -> None:
        """The generation's parameters: checked, its start frame decoded, then admitted (running, queued or busy)."""
        session, cfg, uploads = self.session, self.cfg, self.uploads
        if not session.superset:  # read as Krea reads it, then what sdvg takes (sdvg.serve.plain)
            obj = plain_params(obj, self.engine, cfg, session.adjusted.tell, uploads.known)
        params = parse_params(obj, cfg.max_prompt_chars)
        try:
            image = await self._start_image(params.start_frame)
        except ProtocolError as exc:
            if session.superset:
                raise
            session.adjusted.tell("ignored_field", f"{exc}; ignored (Krea goes on without a start frame it cannot "
                                  "load)")
            params, image = params.model_copy(update={"start_frame": None}), None
        spec = self.engine.spec(params, cfg.max_blocks, uploads.known, uploads.claim, start_image=image)
        session.upload = params.input_video  # claimed: kept past its TTL until this socket closes
        self._admit(spec)

    async def _start_image(self, upload_id):
        """A start frame's upload, decoded off the event loop (JPEG/PNG/WebP under the pixel limit), or None when
        there is none or the id is not one of this server's uploads (the spec says why)."""
        if not isinstance(upload_id, str) or not UPLOAD_ID.match(upload_id):
            return None
        path = self.uploads.path(upload_id)
        if path is None:
            return None
        try:
            return await asyncio.to_thread(lambda: decode_frame(path.read_bytes(), self.cfg.max_image_pixels))
        except (UploadError, OSError) as exc:
            raise ProtocolError("start_frame", f"{upload_id}: {exc}; upload a JPEG, PNG or WebP image with POST "
                                "/upload_start_frame") from None

    def _admit(self, spec) -> None:
        """A run of `spec` admitted (a start or a reset): `params` to an sdvg client; busy: closed (1013)."""
        session, cfg = self.session, self.cfg
        state = self.manager.admit(session, spec)
        if state == "closed":  # cut meanwhile (it stopped reading): nothing more is sent
            return
        if state == "busy":
            busy = f"busy: {cfg.max_sessions} sessions are generating and {cfg.max_queue} are waiting; try again later"
            if session.superset:
                session.outbox.text({"status": "error", "error": busy, "field": None})
            else:
                session.adjusted.tell("busy", busy + "; closed (1013) without a message")
            session.outbox.close(1013)
            return
        if session.superset:
            image = spec.start_frame  # uint8 [H, W, 3] as decoded, or None
            start = None if image is None else {"height": int(image.shape[0]), "width": int(image.shape[1])}
            h, w = (spec.height, spec.width) if spec.height is not None else self.engine.size
            session.outbox.text({"status": "params", "state": state, "seed": spec.options.seed,
                                 "num_blocks": spec.options.num_blocks, "prompt": spec.prompt, "width": w, "height": h,
                                 "options": spec.options.as_dict(), "start_frame": start,
                                 "request_id": spec.request_id})

    def _ack(self, field: str, block, request_id, **extra) -> None:
        if self.session.superset:
            self.outbox.text({"status": "ack", "field": field, "block": block, "request_id": request_id, **extra})

    # ------------------------------------------------------------------ every later message: an update
    async def on_update(self, obj) -> None:
        """A mid-stream update. One message may carry several parts; each goes to its handler in this order: the
        action (reset / pause / resume / ping), the prompt (and its blend), the seed, a webcam image, the router
        fields; then the live parts go to the run (or, with no run in progress, the prompt to the next run)."""
        session = self.session
        if not session.superset:  # read as Krea's loop reads it; what is dropped is told to the operator
            obj = plain_update(obj, session.spec.prompt, session.adjusted.tell)
            if obj is None:
                return
        u = parse_update(obj, self.cfg.max_prompt_chars)
        if u.action in ("pause", "resume", "ping") and not session.superset:
            raise ProtocolError("action", f"{u.action!r} is sdvg's superset: connect with ?sdvg=1")
        for name in ROUTER_FIELDS:
            if getattr(u, name) is not None and not session.superset:
                raise ProtocolError(name, f"a live {name} is sdvg's superset: connect with ?sdvg=1")
        if u.action == "reset":
            self.on_reset(u)
        elif u.action in ("pause", "resume"):
            self.on_pause(u)
        elif u.action == "ping":
            self.on_ping(u)
        live = {}  # the parts for the run: name -> (the field its ack names, Engine.update's changes)
        prompt = self._prompt_change(u)
        if prompt is not None:
            live["prompt"] = prompt
        if u.seed is not None:
            self.on_seed(u)
        if u.image is not None:
            if not await self.on_image(u):
                return
        elif u.strength is not None:
            raise ProtocolError("strength", "applies to webcam `image` frames; send it with one")
        router = {name: getattr(u, name) for name in ROUTER_FIELDS if getattr(u, name) is not None}
        if router:  # one update (one ack, named by its first field): the options are checked together
            live["router"] = (next(iter(router)), router)
        if session.state != "running" and live:  # no run in progress: a prompt is the next run's (as Krea's)
            self._prompt_for_next_run(u, live)
            return
        self._to_run(u, live)

    def on_reset(self, u: Update) -> None:
        """Krea: a new generation with the same parameters (and a pending seed)."""
        session = self.session
        spec = session.spec
        if session.next_seed is not None:
            spec = dataclasses.replace(spec, options=spec.options.replace(seed=session.next_seed))
            session.next_seed = None
        self._admit(spec)
        self._ack("action", 0, u.request_id, action="reset")

    def on_pause(self, u: Update) -> None:
        """sdvg: the worker skips the session's turns (pause) / takes them again (resume)."""
        self.manager.pause(self.session, u.action == "pause")
        self._ack("action", None, u.request_id, action=u.action)

    def on_ping(self, u: Update) -> None:
        self.outbox.text({"status": "pong", "request_id": u.request_id, "timestamp": u.timestamp})

    def _prompt_change(self, u: Update) -> tuple[str, dict] | None:
        """A new prompt, blended over `interp_steps` blocks (Krea: the same prompt changes nothing)."""
        if u.prompt is not None and u.prompt != self.session.spec.prompt:
            steps = u.interp_steps or u.interpolation_steps or 4  # Krea's default blend
            return "prompt", {"prompt": u.prompt, "interp_blocks": steps}
        if u.interp_steps is not None or u.interpolation_steps is not None:
            name = "interp_steps" if u.interp_steps is not None else "interpolation_steps"
            if u.prompt is None:
                raise ProtocolError(name, "a blend needs a new `prompt` in the same message")
        return None

    def on_seed(self, u: Update) -> None:
        """Krea: stored; the next reset starts from it."""
        self.session.next_seed = u.seed
        self._ack("seed", None, u.request_id, effective="next reset")

    async def on_image(self, u: Update) -> bool:
        """A webcam frame: queued for the blocks to come (no ack; Krea sends none). False: dropped, and the rest of
        the message with it (the run has ended)."""
        session, cfg = self.session, self.cfg
        if not session.spec.webcam:
            raise ProtocolError("image", "this session takes no webcam frames: start it with webcam_mode: true")
        if session.state == "done":  # sent before the client heard `completed`: nothing more is read
            self.metrics.refused.labels("image_after_end").inc()
            return False
        if session.state != "running":
            raise ProtocolError("image", f"the session is {session.state}; send webcam frames once it runs")
        try:  # off the event loop (other sockets go on); this socket's next message waits: its order holds
            frame = await asyncio.to_thread(lambda: decode_frame(image_bytes(u.image, cfg.max_image_bytes),
                                                                 cfg.max_webcam_pixels))
        except UploadError as exc:
            raise ProtocolError("image", str(exc)) from None
        if session.state == "done":  # the run ended while it was decoded
            self.metrics.refused.labels("image_after_end").inc()
            return False
        if session.state != "running":  # reset (queued again) while it was decoded
            raise ProtocolError("image", f"the session is {session.state}; send webcam frames once it runs")
        # (a `strength` sent with it changes nothing, as in Krea's server, whose schedule is fixed at the start)
        self.manager.command(session, LiveUpdate({"input_frames": frame[None]}, "image", u.request_id))
        return True

    def _prompt_for_next_run(self, u, live: dict) -> None:
        """Live parts with no run in progress: a router field is refused; a prompt is the next run's."""
        session = self.session
        if "router" in live:
            raise ProtocolError(live["router"][0], f"the session is {session.state}: no run takes it; send it "
                                "while a run is in progress")
        session.spec = dataclasses.replace(session.spec, prompt=u.prompt)
        if session.superset:
            self._ack("prompt", None, u.request_id, effective="next run")
        else:
            session.adjusted.tell("prompt_for_next_run", f"a prompt update while the session is {session.state}: "
                                  "the next run (its reset, or its start) takes it")

    def _to_run(self, u, live: dict) -> None:
        """The live parts (prompt, router fields) to the running generation, one worker command each (acked at the
        block that takes it)."""
        session = self.session
        for field, changes in live.values():
            if not self.engine.live:
                raise ProtocolError(field, "this server's pipeline has no live sessions (pipe.session); "
                                    "a live update needs one")
            self.manager.command(session, LiveUpdate(changes, field, u.request_id))
        if u.prompt is not None and "prompt" in live:
            session.spec = dataclasses.replace(session.spec, prompt=u.prompt)
