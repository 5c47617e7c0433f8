"""The FastAPI app: GET /health, GET / (sdvg's page, or the operator's with --static-dir), WS /session/{id},
GET /download_video/{id}, POST /upload_video and /upload_start_frame, GET /metrics (docs/server.md has the
protocol); who gets in is `access.SiteGate`'s (Host, Origin), then `access.TokenGate`'s (and CORS's, with
--cors-origin); how many connections, and for how long, `connections.ConnectionGuard`'s (through the server).

Routes and the lifespan only: each websocket is a `connection.Connection` (its receive loop and handlers), uploads
are `uploads.UploadReceiver`'s, generations the worker's (`sessions.SessionManager`)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request, WebSocket
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.background import BackgroundTask

from sdvg.serve.access import SiteGate, TokenGate
from sdvg.serve.config import ServeConfig
from sdvg.serve.connection import Connection
from sdvg.serve.engine import Engine, build_labels, pipe_devices
from sdvg.serve.metrics import ServeMetrics, cuda_memory_reader
from sdvg.serve.security import valid_video_key
from sdvg.serve.sessions import SessionManager, WorkerHook
from sdvg.serve.static_site import check_static_dir, media_type, static_file
from sdvg.serve.uploads import UploadError, UploadReceiver, UploadStore
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
    senders: set[asyncio.Task] = set()  # every socket's send loop (shutdown waits for them)

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

    def cut(peer: tuple) -> bool:
        """Abort the connection from `peer` (a client that stopped reading): through the connection guard sdvg's
        server gives the app (`server.http_protocol`); False under another server (Ray Serve's), which has none."""
        guard = getattr(app.state, "connections", None)
        return guard is not None and guard.abort(peer)

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

    receiver = UploadReceiver(uploads, cfg, metrics)

    async def upload(request: Request, image: bool):
        try:
            return await receiver.receive(request, image)
        except UploadError as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status, headers=exc.headers)

    @app.post("/upload_video")
    async def upload_video(request: Request):
        return await upload(request, image=False)

    @app.post("/upload_start_frame")
    async def upload_start_frame(request: Request):
        return await upload(request, image=True)

    @app.websocket("/session/{session_id}")
    async def ws_session(websocket: WebSocket, session_id: str):
        await Connection(websocket, session_id, manager=manager, cfg=cfg, metrics=metrics, engine=engine,
                         uploads=uploads, senders=senders, cut=cut).run()

    if site is not None:  # the operator's page and its files, after every other route
        @app.get("/{path:path}")
        async def static_page(path: str):
            found = static_file(site, path)
            if found is None:
                return PlainTextResponse("not found", status_code=404)
            return FileResponse(found, media_type=media_type(found), headers={"Cache-Control": "no-cache"})

    return app
