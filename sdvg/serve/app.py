"""The FastAPI app: GET /health, GET / (sdvg's page, or the operator's with --static-dir), WS /session/{id},
GET /download_video/{id}, POST /upload_video and /upload_start_frame, GET /metrics (docs/server.md has the
protocol); who gets in is `access.SiteGate`'s (Host, Origin), then `access.TokenGate`'s (and CORS's, with
--cors-origin); how many connections, and for how long, `connections.ConnectionGuard`'s (through the server)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import secrets
import socket
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request, WebSocket
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.background import BackgroundTask

from sdvg.generation.types import strict_json
from sdvg.live.updates import ROUTER_FIELDS
from sdvg.serve.access import SiteGate, TokenGate
from sdvg.serve.commands import LiveUpdate
from sdvg.serve.config import ServeConfig
from sdvg.serve.encode import FORMATS
from sdvg.serve.engine import Engine, build_labels, pipe_devices
from sdvg.serve.events import refusal_event, session_event
from sdvg.serve.metrics import ServeMetrics, cuda_memory_reader
from sdvg.serve.plain import params_error, plain_params, plain_update
from sdvg.serve.protocol import UPLOAD_ID, ProtocolError, decode_message, parse_params, parse_update
from sdvg.serve.security import RateLimit, valid_session_id, valid_video_key
from sdvg.serve.sessions import Outbox, Session, SessionManager, WorkerHook
from sdvg.serve.static_site import check_static_dir, media_type, static_file
from sdvg.serve.uploads import (IMAGE_KINDS, VIDEO_KINDS, UploadError, UploadStore, check_image, check_video_upload,
                                decode_frame, image_bytes, sniff)
from sdvg.serve.videos import VideoStore, join_segments

STATIC = Path(__file__).parent / "static"


def create_app(pipe, cfg: ServeConfig = ServeConfig(), defaults=None, hook: WorkerHook | None = None) -> FastAPI:
    """The server of one pipeline (models loaded once). `defaults`: the server's GenerationOptions; `hook`: a
    test's seam on the generation worker (`sessions.WorkerHook`; also `app.state.manager.hook`)."""
    engine = Engine(pipe, defaults, max_input_video_bytes=cfg.max_input_video_bytes, max_steps=cfg.max_steps,
                    max_input_video_pixels=cfg.max_input_video_pixels,
                    max_pixels=cfg.max_pixels)
    metrics = ServeMetrics(build_labels(pipe), cuda_memory_reader(pipe_devices(pipe)))
    folder = Path(cfg.video_dir) if cfg.video_dir else Path(tempfile.mkdtemp(prefix="sdvg-serve-"))
    videos = VideoStore(folder / "videos", cfg.fps, cfg.keep_videos)
    uploads = UploadStore(folder / "uploads", cfg.upload_ttl_s, cfg.max_upload_store_bytes)
    metrics.uploads_held_bytes.set_function(lambda: uploads.nbytes)  # read at each scrape
    manager = SessionManager(engine, cfg, metrics, videos, uploads, hook)
    senders: set[asyncio.Task] = set()

    @asynccontextmanager
    async def lifespan(app):
        from sdvg.serve.connections import ThrottledLoopErrors

        asyncio.get_running_loop().set_exception_handler(ThrottledLoopErrors())  # one line per kind and interval
        manager.start()
        lag = asyncio.create_task(watch_loop_lag())
        yield
        lag.cancel()
        await drain()
        uploads.clear()

    async def watch_loop_lag(period_s: float = 0.1) -> None:
        """sdvg_serve_event_loop_lag_seconds: every `period_s`, how much later than asked the loop woke (the time one
        callback held every socket; goal: under 0.1 s whatever a client sends)."""
        worst = 0.0
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(period_s)
            late = max(0.0, time.monotonic() - t0 - period_s)
            metrics.loop_lag.observe(late)
            if late > worst:
                worst = late
                metrics.loop_lag_max.set(worst)

    async def drain() -> None:
        """Shutdown: finish every generation and MP4, send `completed`, close each socket (1001)."""
        if not manager.stopping:
            await asyncio.to_thread(manager.stop)
        if senders:
            await asyncio.wait(list(senders), timeout=cfg.drain_timeout_s)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.manager, app.state.metrics, app.state.engine, app.state.drain = manager, metrics, engine, drain
    app.state.videos, app.state.uploads, app.state.config = videos, uploads, cfg
    app.add_middleware(TokenGate, token=cfg.token, origins=cfg.cors_origins)
    if cfg.cors_origins:  # outermost: a preflight is answered before the token is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.cors_origins), allow_credentials=True,
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(SiteGate, bind=cfg.host, allowed_hosts=cfg.allowed_hosts, origins=cfg.cors_origins,
                       refused=metrics.count_refused)  # outermost: Host, then Origin
    site = check_static_dir(cfg.static_dir) if cfg.static_dir is not None else None

    @app.get("/health")
    async def health():
        return "OK"

    if site is None:  # sdvg's page
        @app.get("/")
        async def page():
            return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

        @app.get("/static/app.js")
        async def page_script():
            return Response((STATIC / "app.js").read_text(encoding="utf-8"), media_type="text/javascript")

    @app.get("/metrics")
    async def metrics_text():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    snapshots_running = 0  # downloads of runs still being written, joining their segments now

    @app.get("/download_video/{session_id}")
    async def download_video(session_id: str):
        nonlocal snapshots_running
        if not valid_video_key(session_id):
            return JSONResponse({"error": "session id: letters, digits, _ and - only (1 to 64), then .N for a "
                                          "socket that shared its id"}, status_code=400)
        state, path = videos.state(session_id)
        if state == "finished":
            return FileResponse(path, media_type="video/mp4", filename=f"video_{session_id}.mp4")
        if state == "none":
            return JSONResponse({"error": "No video data found for this session"}, status_code=404)
        # still being written: the frames so far, as Krea's server gives them (its page offers Download at once)
        retry = JSONResponse({"error": "the video is being finished; retry in a moment"}, status_code=409,
                             headers={"Retry-After": "1"})
        if snapshots_running >= cfg.max_concurrent_snapshots:
            return JSONResponse({"error": f"busy: {snapshots_running} videos in progress are being prepared for "
                                 "download; retry in a moment"}, status_code=503, headers={"Retry-After": "1"})
        snapshots_running += 1
        try:
            future = manager.snapshot(session_id)
            if future is None:
                return retry
            try:
                links = await asyncio.wait_for(asyncio.wrap_future(future), cfg.drain_timeout_s)
            except (asyncio.TimeoutError, asyncio.CancelledError, concurrent.futures.CancelledError):
                return retry
            if not links:
                return JSONResponse({"error": "No frames available"}, status_code=404)
            out = videos.folder / f".download-{secrets.token_hex(8)}.mp4"
            try:
                await asyncio.to_thread(join_segments, links, out)
            finally:
                for link in links:
                    link.unlink(missing_ok=True)
        finally:
            snapshots_running -= 1
        return FileResponse(out, media_type="video/mp4", filename=f"video_{session_id}.mp4",
                            background=BackgroundTask(out.unlink, missing_ok=True))

    async def read_upload(request: Request, kinds: dict, limit: int):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit + 65536):
            raise UploadError(413, f"upload larger than {limit} bytes")
        body = bytearray()
        stream, t0 = request.stream().__aiter__(), time.monotonic()
        while True:
            # the next chunk must come before the body's average rate falls under the floor (after a 10 s grace)
            # and before the deadline
            due = t0 + min(cfg.upload_deadline_s, max(cfg.upload_grace_s, (len(body) + 1) / cfg.upload_min_bytes_per_s))
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), max(0.0, due - time.monotonic()))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise UploadError(408, f"upload too slow: {len(body)} bytes in {time.monotonic() - t0:.0f} s (at least "
                                  f"{cfg.upload_min_bytes_per_s} bytes/s after {cfg.upload_grace_s:g} s, "
                                  f"--upload-min-rate; all within {cfg.upload_deadline_s:g} s, --upload-deadline)"
                                  ) from None
            body += chunk
            if len(body) > limit + 65536:
                raise UploadError(413, f"upload larger than {limit} bytes")
        request._body = bytes(body)  # the form parser reads the capped body
        try:
            form = await request.form(max_files=1, max_fields=4)
        except Exception as exc:
            raise UploadError(400, f"a multipart form with one `file` field is expected ({exc})") from None
        file = form.get("file")
        if file is None or isinstance(file, str):
            raise UploadError(400, "the form has no `file` field")
        data = await file.read(limit + 1)
        if len(data) > limit:
            raise UploadError(413, f"file larger than {limit} bytes")
        kind = sniff(data[:16], kinds)
        if kind is None:
            raise UploadError(415, f"not one of {', '.join(kinds)} (judged by the file's bytes, not its name)")
        return data, kind, file.filename

    receiving = 0  # uploads being received on this event loop (their bodies are held in memory while read)
    metrics.uploads_receiving.set_function(lambda: receiving)  # read at each scrape

    async def upload(request: Request, kinds: dict, limit: int, image: bool):
        nonlocal receiving
        if receiving >= cfg.max_concurrent_uploads:
            metrics.refused.labels("upload").inc()
            return JSONResponse({"error": f"busy: {receiving} uploads are being received (at most "
                                 f"{cfg.max_concurrent_uploads} at once); retry in a moment"}, status_code=503,
                                headers={"Retry-After": "1"})
        receiving += 1
        try:
            data, kind, filename = await read_upload(request, kinds, limit)
            if image:
                await asyncio.to_thread(check_image, data, cfg.max_image_pixels)
            upload_id = await asyncio.to_thread(uploads.add, data, kind)  # 507 past max_upload_store_bytes
            if not image:  # its frame size from the container's header (ffmpeg -i, nothing decoded)
                await asyncio.to_thread(check_video_upload, uploads, upload_id, cfg.max_input_video_pixels)
        except UploadError as exc:
            metrics.refused.labels("upload").inc()
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        finally:
            receiving -= 1
        # `path`: Krea's name for what its page sends back as start_frame / input_video; here the same opaque id
        return {"path": upload_id, "id": upload_id, "filename": Path(filename or "").name[:128], "bytes": len(data),
                "type": kind}

    @app.post("/upload_video")
    async def upload_video(request: Request):
        return await upload(request, VIDEO_KINDS, cfg.max_upload_bytes, image=False)

    @app.post("/upload_start_frame")
    async def upload_start_frame(request: Request):
        return await upload(request, IMAGE_KINDS, cfg.max_image_bytes, image=True)

    @app.websocket("/session/{session_id}")
    async def ws_session(websocket: WebSocket, session_id: str):
        fmt = websocket.query_params.get("fmt", "jpeg")
        superset = websocket.query_params.get("sdvg", "0") in ("1", "true")
        if not valid_session_id(session_id) or fmt not in FORMATS:
            metrics.refused.labels("handshake").inc()
            await websocket.close(code=1008, reason="session id: [A-Za-z0-9_-]{1,64}; fmt: " + "|".join(FORMATS))
            return
        await websocket.accept()
        outbox = Outbox(cfg.send_buffer_frames, metrics)
        session = Session(session_id, fmt, superset, asyncio.get_running_loop(), outbox)
        peer = websocket.client
        session.client = f"{peer.host}:{peer.port}" if peer else None
        if not manager.opened(session):
            await websocket.close(code=1001, reason="server shutting down")
            return
        key = manager.claim_key(session_id)  # another open socket on the id: this one's videos are its own
        if key is None:
            manager.release(session)
            await websocket.close(code=1008, reason=f"too many sockets on session id {session_id}")
            return
        session.video_key = session.adjusted.session_id = key  # log lines name the socket's own key
        sender = asyncio.create_task(send_loop(websocket, outbox))
        senders.add(sender)
        sender.add_done_callback(senders.discard)
        ready = {"status": "ready", "worker": socket.gethostname()}
        if superset:
            h, w = engine.size
            ready.update(session_id=session_id, preset=engine.preset.name, width=w, height=h, live=engine.live,
                         fmt=fmt, replica=f"{socket.gethostname()}:{os.getpid()}", download_url=f"/download_video/{key}",
                         fps=cfg.fps, random_weights=bool(getattr(engine.preset, "random_weights", False)))
        outbox.text(ready)
        try:
            await receive_loop(websocket, session)
        finally:
            manager.release(session)
            if session.upload is not None:
                uploads.release(session.upload)
            if not sender.done():
                outbox.close(1000)
                try:
                    await asyncio.wait_for(asyncio.shield(sender), 2.0)
                except (asyncio.TimeoutError, Exception):
                    sender.cancel()

    async def send_loop(websocket: WebSocket, outbox: Outbox) -> None:
        try:
            while True:
                item = await outbox.next()
                if item[0] == "text":
                    await websocket.send_text(strict_json(item[1]))
                elif item[0] == "frame":
                    await websocket.send_bytes(item[1])
                else:
                    await websocket.close(code=item[1], reason=item[2])
                    return
        except Exception:  # the client is gone
            return

    def refuse(session: Session, error: ProtocolError, reason: str) -> bool:
        """A refused message, counted by reason (the error's own, where it has one): sdvg's `error` to an sdvg client;
        to a plain one Krea's reply to bad parameters before its run started, else nothing (Krea is silent), the
        operator told (sdvg.serve.plain). Every refusal, whatever its kind, counts against one budget per socket:
        True when it is spent (the socket is closed, 1008)."""
        metrics.refused.labels(error.reason or reason).inc()
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

    def wait_limit(session: Session, opened: float) -> tuple[float | None, str]:
        """How long this socket's next message may take, and what happens when it does not come: 'first' (no
        parameters yet: --first-message-timeout from the socket's opening; messages refused meanwhile do not extend
        it), 'pause' (paused: --max-pause-s from the pause; pings do not extend it), 'idle' (nothing running:
        --idle-timeout), or none while a run or the queue is in progress."""
        now = time.monotonic()
        if session.spec is None:
            return max(0.0, opened + cfg.first_message_timeout_s - now), "first"
        if session.paused and session.state == "running" and session.paused_at is not None:
            return max(0.0, session.paused_at + cfg.max_pause_s - now), "pause"
        if session.state not in ("running", "queued"):
            return cfg.idle_timeout_s, "idle"
        return None, "none"

    async def receive_loop(websocket: WebSocket, session: Session) -> None:
        rate = RateLimit(cfg.updates_per_s, cfg.update_burst)
        frame_rate = RateLimit(cfg.input_frames_per_s, max(1, round(cfg.input_frames_per_s)))
        opened = time.monotonic()
        limits = dict(max_array_len=max(cfg.max_blocks, 64), max_bin_len=cfg.max_image_bytes,
                      max_str_len=max(4 * cfg.max_prompt_chars, (cfg.max_image_bytes + 2) // 3 * 4 + 256))
        while True:
            timeout, kind = wait_limit(session, opened)
            try:
                message = await asyncio.wait_for(websocket.receive(), timeout)
            except asyncio.TimeoutError:
                if kind == "pause":  # the run ends; the socket stays (a reset starts it again)
                    metrics.refused.labels("pause").inc()
                    manager.end_run(session, f"paused for more than {cfg.max_pause_s:g} s (--max-pause-s): the run "
                                    "ends and its slot goes to the next session")
                    continue
                why = (f"no parameters within {cfg.first_message_timeout_s:g} s (--first-message-timeout)"
                       if kind == "first" else f"idle for {cfg.idle_timeout_s:g} s")
                metrics.refused.labels("timeout").inc()
                session_event(session, "closed", why="first_message_timeout" if kind == "first" else "idle_timeout")
                if session.superset:
                    session.outbox.text({"status": "error", "error": f"{why}; closing", "field": None})
                session.outbox.close(1000)
                return
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes")
            if data is None:
                if refuse(session, ProtocolError(None, "messages must be binary msgpack maps (text frames are not "
                                                 "read)"), "text"):
                    return
                continue
            if len(data) > cfg.max_message_bytes:
                refuse(session, ProtocolError(None, f"message of {len(data)} bytes; at most {cfg.max_message_bytes}"),
                       "size")
                session.outbox.close(1009)
                return
            try:
                obj = decode_message(data, **limits)
            except ProtocolError as exc:
                obj = exc
            webcam = isinstance(obj, dict) and obj.get("image") is not None  # webcam frames have their own rate
            limit = frame_rate if webcam else rate
            if session.spec is not None and not limit.allow():
                what = (f"{cfg.input_frames_per_s:g} webcam frames" if webcam else f"{cfg.updates_per_s:g} updates")
                if refuse(session, ProtocolError(None, f"more than {what} per second; this one was dropped"), "rate"):
                    return
                continue
            if isinstance(obj, ProtocolError):
                if refuse(session, obj, "malformed"):
                    return
                continue
            try:
                if session.spec is None:
                    await start(session, obj)
                else:
                    await handle_update(session, obj)
            except ProtocolError as exc:
                if refuse(session, exc, "invalid"):
                    return
            if session.outbox.items and session.outbox.items[-1][0] == "close":
                return

    async def start(session: Session, obj) -> None:
        if not session.superset:  # read as Krea reads it, then what sdvg takes (sdvg.serve.plain)
            obj = plain_params(obj, engine, cfg, session.adjusted.tell, uploads.known)
        params = parse_params(obj, cfg.max_prompt_chars)
        try:
            image = await start_image(params.start_frame)
        except ProtocolError as exc:
            if session.superset:
                raise
            session.adjusted.tell("ignored_field", f"{exc}; ignored (Krea goes on without a start frame it cannot "
                                  "load)")
            params, image = params.model_copy(update={"start_frame": None}), None
        spec = engine.spec(params, cfg.max_blocks, uploads.known, uploads.claim, start_image=image)
        session.upload = params.input_video  # claimed: kept past its TTL until this socket closes
        admitted(session, spec)

    async def start_image(upload_id):
        """A start frame's upload, decoded off the event loop (JPEG/PNG/WebP under the pixel limit), or None when
        there is none or the id is not one of this server's uploads (the spec says why)."""
        if not isinstance(upload_id, str) or not UPLOAD_ID.match(upload_id):
            return None
        path = uploads.path(upload_id)
        if path is None:
            return None
        try:
            return await asyncio.to_thread(lambda: decode_frame(path.read_bytes(), cfg.max_image_pixels))
        except (UploadError, OSError) as exc:
            raise ProtocolError("start_frame", f"{upload_id}: {exc}; upload a JPEG, PNG or WebP image with POST "
                                "/upload_start_frame") from None

    def admitted(session: Session, spec) -> None:
        state = manager.admit(session, spec)
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
            h, w = (spec.height, spec.width) if spec.height is not None else engine.size
            session.outbox.text({"status": "params", "state": state, "seed": spec.options.seed,
                                 "num_blocks": spec.options.num_blocks, "prompt": spec.prompt, "width": w, "height": h,
                                 "options": spec.options.as_dict(), "start_frame": start,
                                 "request_id": spec.request_id})

    def ack(session: Session, field: str, block, request_id, **extra) -> None:
        if session.superset:
            session.outbox.text({"status": "ack", "field": field, "block": block, "request_id": request_id, **extra})

    async def handle_update(session: Session, obj) -> None:
        if not session.superset:  # read as Krea's loop reads it; what is dropped is told to the operator
            obj = plain_update(obj, session.spec.prompt, session.adjusted.tell)
            if obj is None:
                return
        u = parse_update(obj, cfg.max_prompt_chars)
        if u.action in ("pause", "resume", "ping") and not session.superset:
            raise ProtocolError("action", f"{u.action!r} is sdvg's superset: connect with ?sdvg=1")
        for name in ROUTER_FIELDS:
            if getattr(u, name) is not None and not session.superset:
                raise ProtocolError(name, f"a live {name} is sdvg's superset: connect with ?sdvg=1")
        if u.action == "reset":  # Krea: a new generation with the same parameters (and a pending seed)
            spec = session.spec
            if session.next_seed is not None:
                spec = dataclasses.replace(spec, options=spec.options.replace(seed=session.next_seed))
                session.next_seed = None
            admitted(session, spec)
            ack(session, "action", 0, u.request_id, action="reset")
        elif u.action in ("pause", "resume"):
            manager.pause(session, u.action == "pause")
            ack(session, "action", None, u.request_id, action=u.action)
        elif u.action == "ping":
            session.outbox.text({"status": "pong", "request_id": u.request_id, "timestamp": u.timestamp})
        live = {}
        if u.prompt is not None and u.prompt != session.spec.prompt:  # Krea: the same prompt changes nothing
            steps = u.interp_steps or u.interpolation_steps or 4  # Krea's default blend
            live["prompt"] = ("prompt", {"prompt": u.prompt, "interp_blocks": steps})
        elif u.interp_steps is not None or u.interpolation_steps is not None:
            name = "interp_steps" if u.interp_steps is not None else "interpolation_steps"
            if u.prompt is None:
                raise ProtocolError(name, "a blend needs a new `prompt` in the same message")
        if u.seed is not None:  # Krea: stored; the next reset starts from it
            session.next_seed = u.seed
            ack(session, "seed", None, u.request_id, effective="next reset")
        if u.image is not None:  # a webcam frame: queued for the blocks to come (no ack; Krea sends none)
            if not session.spec.webcam:
                raise ProtocolError("image", "this session takes no webcam frames: start it with webcam_mode: true")
            if session.state == "done":  # sent before the client heard `completed`: nothing more is read
                metrics.refused.labels("image_after_end").inc()
                return
            if session.state != "running":
                raise ProtocolError("image", f"the session is {session.state}; send webcam frames once it runs")
            try:  # off the event loop (other sockets go on); this socket's next message waits: its order holds
                frame = await asyncio.to_thread(lambda: decode_frame(image_bytes(u.image, cfg.max_image_bytes),
                                                                     cfg.max_webcam_pixels))
            except UploadError as exc:
                raise ProtocolError("image", str(exc)) from None
            if session.state == "done":  # the run ended while it was decoded
                metrics.refused.labels("image_after_end").inc()
                return
            if session.state != "running":  # reset (queued again) while it was decoded
                raise ProtocolError("image", f"the session is {session.state}; send webcam frames once it runs")
            # (a `strength` sent with it changes nothing, as in Krea's server, whose schedule is fixed at the start)
            frames = {"input_frames": frame[None]}
            manager.command(session, LiveUpdate(frames, "image", u.request_id))
        elif u.strength is not None:
            raise ProtocolError("strength", "applies to webcam `image` frames; send it with one")
        router = {name: getattr(u, name) for name in ROUTER_FIELDS if getattr(u, name) is not None}
        if router:  # one update (one ack, named by its first field): the options are checked together
            live["router"] = (next(iter(router)), router)
        if session.state != "running" and live:  # no run in progress: a prompt is the next run's (as Krea's)
            if "router" in live:
                raise ProtocolError(live["router"][0], f"the session is {session.state}: no run takes it; send it "
                                    "while a run is in progress")
            session.spec = dataclasses.replace(session.spec, prompt=u.prompt)
            if session.superset:
                ack(session, "prompt", None, u.request_id, effective="next run")
            else:
                session.adjusted.tell("prompt_for_next_run", f"a prompt update while the session is {session.state}: "
                                      "the next run (its reset, or its start) takes it")
            return
        for field, changes in live.values():
            if not engine.live:
                raise ProtocolError(field, "this server's pipeline has no live sessions (pipe.session); "
                                    "a live update needs one")
            manager.command(session, LiveUpdate(changes, field, u.request_id))
        if u.prompt is not None and "prompt" in live:
            session.spec = dataclasses.replace(session.spec, prompt=u.prompt)

    if site is not None:  # the operator's page and its files, after every other route
        @app.get("/{path:path}")
        async def static_page(path: str):
            found = static_file(site, path)
            if found is None:
                return PlainTextResponse("not found", status_code=404)
            return FileResponse(found, media_type=media_type(found), headers={"Cache-Control": "no-cache"})

    return app
