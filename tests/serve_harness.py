"""Shared by the tests/test_serve*.py files: a real uvicorn server on 127.0.0.1 (a free port) in a
thread, and a websockets client that runs one session to its end."""
from __future__ import annotations

import asyncio
import io
import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240.0  # seconds any one session may take on a loaded 2-core machine


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def running_server(pipe, tmp_path, **config):
    """Yields (base_url, app); the server drains and stops on exit."""
    from sdvg.serve.app import create_app
    from sdvg.serve.config import ServeConfig
    from sdvg.serve.server import DrainingServer, uvicorn_config

    host = config.pop("host", "127.0.0.1")
    log_level = config.pop("log_level", "warning")
    cfg = ServeConfig(host=host, port=free_port(host), video_dir=str(tmp_path), **config)
    app = create_app(pipe, cfg)
    server = DrainingServer(uvicorn_config(app, cfg, log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"{host}:{cfg.port}", app
    finally:
        server.should_exit = True
        thread.join(60)


class BlockGate:
    """A `sdvg.serve.sessions.WorkerHook` that holds a session's blocks after its first one on the server's worker
    until its client's mid-stream messages (updates, resets) have reached the worker's queue, so that a test's update
    cannot lose a race with the end of a short generation on a fast machine. `session_id` None: the first session
    that reaches block 1; `messages`: how many of its messages open the gate (each live update or webcam frame, and
    each reset: a `Start` after the session's first). Once open it stays open. `timed_out` says the messages never
    came (the worker went on after TIMEOUT)."""

    def __init__(self, session_id: str | None = None, messages: int = 1):
        from sdvg.serve.commands import LiveUpdate, Start

        self.session_id, self.messages = session_id, messages
        self.seen = 0
        self.timed_out = False
        self.open = threading.Event()
        self._counted = lambda c: isinstance(c, LiveUpdate) or isinstance(c, Start) and c.run > 1

    def _mine(self, s) -> bool:
        if self.session_id is None:
            self.session_id = s.id
        return s.id == self.session_id

    def queued(self, session, command) -> None:  # under the manager's lock: never waits
        if self._counted(command) and self._mine(session):
            self.seen += 1
            if self.seen >= self.messages:
                self.open.set()

    def before_block(self, session) -> None:  # on the worker: holds it
        if session.blocks_done >= 1 and not self.open.is_set() and self._mine(session):
            self.timed_out = not self.open.wait(TIMEOUT)


@contextmanager
def block_gate(app, session_id: str | None = None, messages: int = 1):
    """A `BlockGate` on the in-process server's worker (`app.state.manager.hook`) for the `with` block; on exit it
    opens and the hook before it is put back."""
    manager = app.state.manager
    gate, before = BlockGate(session_id, messages), manager.hook
    manager.hook = gate
    try:
        yield gate
    finally:
        gate.open.set()
        manager.hook = before


def decode_jpeg(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


async def recv_json(ws, timeout: float = TIMEOUT) -> dict:
    """The next text message (binary ones before it are an error)."""
    m = await asyncio.wait_for(ws.recv(), timeout)
    assert isinstance(m, str), f"expected a text message, got {len(m)} binary bytes"
    return json.loads(m)


async def run_session(url: str, params: dict, fmt: str = "jpeg", superset: bool = False, session_id: str = "s1",
                      token: str | None = None, on_frame=None, stop_on_field_error: bool = True,
                      after_ready=None) -> dict:
    """One session to `completed`: {'ready', 'frames' (decoded uint8 [H, W, 3] in order), 'texts', 'blocks'
    (msgpack/raw block indices per frame)}. An error naming a field ends it (refused parameters) unless
    `stop_on_field_error` is False (a refused mid-stream update: the session goes on). `after_ready`: awaited
    between `ready` and the parameters (e.g. until other sockets are connected too)."""
    import websockets

    q = f"?fmt={fmt}" + ("&sdvg=1" if superset else "") + (f"&token={token}" if token else "")
    out = {"frames": [], "texts": [], "blocks": [], "frame_ids": []}
    async with websockets.connect(f"ws://{url}/session/{session_id}{q}", max_size=2**26) as ws:
        out["ready"] = await recv_json(ws, 30)
        if after_ready is not None:
            await after_ready()
        await ws.send(msgpack.packb(params))
        while True:
            m = await asyncio.wait_for(ws.recv(), TIMEOUT)
            if isinstance(m, str):
                msg = json.loads(m)
                out["texts"].append(msg)
                if msg.get("status") == "completed":
                    break
                if stop_on_field_error and msg.get("status") == "error" and msg.get("field") is not None:
                    break
                continue
            if fmt == "jpeg":
                out["frames"].append(decode_jpeg(m))
            else:
                d = msgpack.unpackb(m)
                out["blocks"].append(d["block"])
                out["frame_ids"].append(d["frame"])
                out["frames"].append(np.frombuffer(d["image"], np.uint8).reshape(d["shape"]) if fmt == "raw"
                                     else decode_jpeg(d["image"]))
                out.setdefault("request_ids", []).append(d["request_id"])
            if on_frame is not None:
                await on_frame(ws, len(out["frames"]))
    return out


def tiny_mp4(frames: int = 2, side: int = 16) -> bytes:
    """A real MP4 (H.264, black side x side frames): an upload ffmpeg can read."""
    import tempfile

    import imageio_ffmpeg

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tiny.mp4"
        writer = imageio_ffmpeg.write_frames(str(path), (side, side), fps=16, macro_block_size=1,
                                             output_params=["-preset", "ultrafast"])
        writer.send(None)
        for _ in range(frames):
            writer.send(bytes(side * side * 3))
        writer.close()
        return path.read_bytes()


def upload(url: str, path: str, data: bytes, filename: str = "f.bin"):
    """POST a multipart file upload: (status, JSON body), or ("reset", None) when refused mid-body."""
    boundary = "sdvgboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    req = urllib.request.Request(f"http://{url}{path}", data=body, method="POST",
                                 headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except urllib.error.URLError:  # refused from its Content-Length while the body was still being sent
        return "reset", None


def start_server(tmp_path, *flags: str, preexec_fn=None) -> tuple[subprocess.Popen, int]:
    """`sdvg serve --preset tiny --port 0` in its own process, up and answering /health: (process, port printed)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "sdvg.cli", "serve", "--preset", "tiny", "--port", "0",
                             "--video-dir", str(tmp_path), *flags], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=preexec_fn)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in iter(proc.stdout.readline, b"")], daemon=True).start()
    proc.lines = lines
    try:
        deadline = time.monotonic() + 300
        port = None
        while port is None:  # --port 0: the port bound is the one printed
            assert time.monotonic() < deadline, "sdvg serve did not print its URL"
            try:
                line = lines.get(timeout=1).decode(errors="replace")
            except queue.Empty:
                assert proc.poll() is None, "sdvg serve exited before printing its URL"
                continue
            printed = re.match(r"sdvg serve: http://127\.0\.0\.1:(\d+)/", line)
            port = int(printed.group(1)) if printed else None
        assert port > 0
        while True:
            assert proc.poll() is None, "sdvg serve exited"
            assert time.monotonic() < deadline, "sdvg serve did not come up"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.5)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, port
