"""SIGTERM on `sdvg serve` (a real process): every socket gets `completed` and a 1001 close after
the frames already made, and every session's MP4 is finished with exactly those frames. It listens on
`--port 0` and is reached on the port it printed."""
from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
msgpack = pytest.importorskip("msgpack")
websockets = pytest.importorskip("websockets")

from serve_harness import recv_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_sigterm_completes_every_socket_and_finishes_every_mp4(tmp_path):
    from sdvg.io.video_writer import read_mp4_frames

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "sdvg.cli", "serve", "--preset", "tiny", "--port", "0",
                             "--video-dir", str(tmp_path),
                             "--send-buffer-frames", "4096"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in iter(proc.stdout.readline, b"")], daemon=True).start()
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

        async def session(sid, started):
            frames, texts = 0, []
            async with websockets.connect(f"ws://127.0.0.1:{port}/session/{sid}?fmt=raw") as ws:
                await recv_json(ws, 30)
                await ws.send(msgpack.packb({"prompt": "a fox", "num_blocks": 40, "seed": 1}))
                try:
                    while True:
                        m = await asyncio.wait_for(ws.recv(), 240)
                        if isinstance(m, bytes):
                            frames += 1
                            started.set()
                        else:
                            texts.append(json.loads(m))
                except websockets.exceptions.ConnectionClosed as exc:
                    return frames, texts, exc.rcvd.code if exc.rcvd else None

        async def go():
            a, b = asyncio.Event(), asyncio.Event()
            tasks = [asyncio.create_task(session("term1", a)), asyncio.create_task(session("term2", b))]
            await asyncio.wait_for(asyncio.gather(a.wait(), b.wait()), 240)
            proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

        results = asyncio.run(go())
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc in (0, 128 + signal.SIGTERM)
    for sid, (frames, texts, code) in zip(("term1", "term2"), results):
        assert texts[-1] == {"session_id": sid, "status": "completed"}
        assert code == 1001
        assert 0 < frames < 9 + 39 * 12  # stopped early, not run to its end
        video = tmp_path / "videos" / f"{sid}.mp4"
        assert video.is_file() and not list(tmp_path.glob("videos/.*partial*"))
        assert len(read_mp4_frames(video)) == frames
