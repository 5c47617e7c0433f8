"""SIGTERM on `sdvg serve` (a real process): every running socket gets `completed` and a 1001 close after
the frames already made, and every session's MP4 is finished with exactly those frames; idle, finished and
queued sockets are closed at once. It listens on `--port 0` and is reached on the port it printed."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

pytest.importorskip("fastapi")
msgpack = pytest.importorskip("msgpack")
websockets = pytest.importorskip("websockets")

from serve_harness import recv_json, start_server  # noqa: E402


@pytest.mark.slow
def test_sigterm_completes_every_socket_and_finishes_every_mp4(tmp_path):
    from sdvg.io.video_writer import read_mp4_frames

    proc, port = start_server(tmp_path, "--send-buffer-frames", "4096")
    try:
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
        videos = list((tmp_path / "videos").glob(f"{sid}~*.mp4"))  # the run's own file (its run key)
        assert len(videos) == 1 and not list(tmp_path.glob("videos/.*partial*"))
        video = videos[0]
        assert len(read_mp4_frames(video)) == frames


@pytest.mark.slow
def test_sigterm_closes_idle_finished_and_queued_sockets_at_once(tmp_path):
    """docs/server.md: on SIGTERM a socket with nothing running (no parameters yet, or its run completed) is closed
    at once with 1001; queued clients are told the server is going away (an sdvg client: an error; a plain one: the
    1001 close's reason) and get no `completed`; the running session gets completed + 1001; the server exits."""
    proc, port = start_server(tmp_path, "--max-sessions", "1", "--max-queue", "4", "--send-buffer-frames", "4096")
    url = f"ws://127.0.0.1:{port}/session"

    async def until_closed(ws, texts):
        try:
            while True:
                m = await asyncio.wait_for(ws.recv(), 120)
                if isinstance(m, str):
                    texts.append(json.loads(m))
        except websockets.exceptions.ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd else None, exc.rcvd.reason if exc.rcvd else None

    async def go():
        finished = await websockets.connect(f"{url}/done1")  # a plain client whose run completed
        await recv_json(finished, 30)
        await finished.send(msgpack.packb({"prompt": "a fox", "num_blocks": 1, "seed": 1}))
        done_texts = []
        while not done_texts or done_texts[-1].get("status") != "completed":
            m = await asyncio.wait_for(finished.recv(), 240)
            if isinstance(m, str):
                done_texts.append(json.loads(m))
        running = await websockets.connect(f"{url}/run1")
        await recv_json(running, 30)
        await running.send(msgpack.packb({"prompt": "a fox", "num_blocks": 60, "seed": 1}))
        while not isinstance(await asyncio.wait_for(running.recv(), 240), bytes):  # its first frame: it runs
            pass
        idle = await websockets.connect(f"{url}/idle1")  # no parameters
        await recv_json(idle, 30)
        queued_sdvg = await websockets.connect(f"{url}/q1?sdvg=1")
        await recv_json(queued_sdvg, 30)
        await queued_sdvg.send(msgpack.packb({"prompt": "a cat", "num_blocks": 1, "seed": 2}))
        q_texts = [await recv_json(queued_sdvg, 30)]
        while q_texts[-1].get("status") != "queued":
            q_texts.append(await recv_json(queued_sdvg, 30))
        queued_plain = await websockets.connect(f"{url}/q2")
        await recv_json(queued_plain, 30)
        await queued_plain.send(msgpack.packb({"prompt": "a cat", "num_blocks": 1, "seed": 2}))
        await asyncio.sleep(0.5)  # admitted to the queue (a plain client hears nothing)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        texts = {k: [] for k in ("idle", "done", "qs", "qp", "run")}
        codes = await asyncio.gather(until_closed(idle, texts["idle"]), until_closed(finished, texts["done"]),
                                     until_closed(queued_sdvg, texts["qs"]), until_closed(queued_plain, texts["qp"]),
                                     until_closed(running, texts["run"]))
        return dict(zip(texts, codes)), texts, time.monotonic() - t0

    try:
        codes, texts, closed_in = asyncio.run(go())
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc in (0, 128 + signal.SIGTERM)
    for name in ("idle", "done", "qs", "qp", "run"):
        assert codes[name][0] == 1001, (name, codes[name])
    assert texts["idle"] == [] and texts["done"] == []
    assert "shutting down" in codes["qp"][1] and texts["qp"] == []  # plain: the close says it, no message
    # an sdvg client: its place in the queue as it changed, then why it never ran; no `completed`
    assert {t["status"] for t in texts["qs"][:-1]} <= {"queued"} and texts["qs"][-1]["status"] == "error"
    assert "shutting down" in texts["qs"][-1]["error"]
    assert texts["run"][-1] == {"session_id": "run1", "status": "completed"}
    # the old drain left idle sockets to uvicorn's 30 s graceful timeout (then 1012); generous bound
    assert closed_in < 25, closed_in
