"""sdvg serve end to end: a real uvicorn server on 127.0.0.1, the `websockets` library as the client,
the tiny preset (docs/server.md)."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("fastapi")
msgpack = pytest.importorskip("msgpack")
websockets = pytest.importorskip("websockets")

from serve_harness import (TIMEOUT, block_gate, recv_json, run_session, running_server, tiny_mp4,  # noqa: E402
                           upload)

PROMPT = "a red fox running through fresh snow"
SEEDS = (5, 7)


@pytest.fixture(scope="module")
def refs(tiny_pipe):
    """The frames `pipe.stream` makes with the parameters the sessions send (before any server runs)."""
    out = {}
    for seed in SEEDS:
        blocks = list(tiny_pipe.stream(PROMPT, num_blocks=2, seed=seed, kv_cache_frames=3, keep_first_frame=False))
        out[seed] = {"frames": np.concatenate([b.frames.numpy() for b in blocks]),
                     "per_block": [b.frames.shape[0] for b in blocks],
                     "decisions": [b.decision for b in blocks], "scores": [b.score for b in blocks]}
    return out


@pytest.fixture(scope="module")
def server(tiny_pipe, refs, tmp_path_factory):
    with running_server(tiny_pipe, tmp_path_factory.mktemp("serve"), max_sessions=8,
                        send_buffer_frames=4096) as (url, app):
        yield url, app


def jpeg_roundtrip(frames: np.ndarray) -> np.ndarray:
    from serve_harness import decode_jpeg

    from sdvg.serve.encode import jpeg

    return np.stack([decode_jpeg(jpeg(f, 90)) for f in frames])


def params(seed=5, **extra):
    return {"prompt": PROMPT, "num_blocks": 2, "seed": seed, **extra}


def http(url: str, path: str, token: str | None = None, header: bool = True):
    req = urllib.request.Request(f"http://{url}{path}")
    if token and header:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_jpeg_session_is_krea_shaped_and_matches_stream(server, refs):
    url, _ = server
    out = asyncio.run(run_session(url, params(), session_id="jpeg1"))
    assert out["ready"]["status"] == "ready" and set(out["ready"]) == {"status", "worker"}  # Krea's, exactly
    assert out["texts"] == [{"session_id": "jpeg1", "status": "completed"}]  # no sdvg message without ?sdvg=1
    ref = refs[5]["frames"]
    got = np.stack(out["frames"])
    assert got.shape == ref.shape  # every frame: 9 in block 0, then 12 per block (tiny)
    # within codec tolerance: the pipeline's frames through the same JPEG codec (quality 90), decoded
    assert np.array_equal(got, jpeg_roundtrip(ref))


def test_raw_frames_are_bitwise_and_stats_follow_each_block(server, refs):
    url, _ = server
    out = asyncio.run(run_session(url, params(request_id="r-1"), fmt="raw", superset=True, session_id="raw1"))
    ref = refs[5]
    assert np.array_equal(np.stack(out["frames"]), ref["frames"])
    assert out["frame_ids"] == list(range(len(ref["frames"])))
    assert out["blocks"] == [i for i, n in enumerate(ref["per_block"]) for _ in range(n)]
    assert set(out["request_ids"]) == {"r-1"}
    stats = [m for m in out["texts"] if m["status"] == "stats"]
    assert [s["block"] for s in stats] == [0, 1]
    assert [s["decision"] for s in stats] == ref["decisions"]
    assert [s["score"] for s in stats] == pytest.approx(ref["scores"])
    assert stats[0]["producer"] == "target"
    assert {"times", "acceptance", "queue_depth", "dropped_frames"} <= set(stats[0])
    kinds = [m["status"] for m in out["texts"]]
    assert kinds[0] == "params" and kinds[-1] == "completed" and out["ready"]["preset"] == "tiny"


def test_msgpack_format_carries_block_frame_and_request_id(server, refs):
    url, _ = server
    out = asyncio.run(run_session(url, params(request_id="abc"), fmt="msgpack", session_id="mp1"))
    assert out["frame_ids"] == list(range(len(refs[5]["frames"])))
    assert set(out["request_ids"]) == {"abc"}
    assert np.array_equal(np.stack(out["frames"]), jpeg_roundtrip(refs[5]["frames"]))


def test_download_has_every_frame(server, refs, tmp_path):
    from sdvg.io.video_writer import read_mp4_frames

    url, _ = server
    asyncio.run(run_session(url, params(), session_id="dl1"))
    status, body = http(url, "/download_video/dl1")
    assert status == 200
    (tmp_path / "v.mp4").write_bytes(body)
    frames = read_mp4_frames(tmp_path / "v.mp4")
    assert frames.shape == refs[5]["frames"].shape  # every frame
    err = np.abs(frames.astype(np.int16) - refs[5]["frames"].astype(np.int16)).mean()
    other = np.abs(frames.astype(np.int16) - refs[7]["frames"].astype(np.int16)).mean()
    assert err < other / 2, (err, other)  # H.264 of noise-like tiny frames: the right video, lossy
    assert http(url, "/download_video/nosuch")[0] == 404
    assert http(url, "/download_video/..%2F..%2Fetc%2Fpasswd")[0] in (400, 404)


@pytest.mark.slow
def test_reset_restarts_at_block_0(server, refs):
    url, app = server

    async def go():
        async with websockets.connect(f"ws://{url}/session/reset1?fmt=raw&sdvg=1") as ws:
            await recv_json(ws, 30)
            await ws.send(msgpack.packb(params()))
            frames, texts, reset_at = [], [], None
            while True:
                m = await asyncio.wait_for(ws.recv(), TIMEOUT)
                if isinstance(m, str):
                    texts.append(json.loads(m))
                    if texts[-1]["status"] == "completed" and reset_at is not None:
                        return frames, texts, reset_at
                    continue
                d = msgpack.unpackb(m)
                frames.append(d)
                if reset_at is None and d["frame"] == 0:
                    reset_at = len(frames)
                    await ws.send(msgpack.packb({"action": "reset", "request_id": "x"}))

    with block_gate(app, "reset1") as gate:  # block 1 waits for the reset: the run cannot end before it arrives
        frames, texts, reset_at = asyncio.run(go())
    assert not gate.timed_out and gate.seen == 1
    assert {"status": "ack", "field": "action", "block": 0, "request_id": "x", "action": "reset"} in texts
    # after the reset: a new run from block 0 and frame 0, equal to a fresh stream
    restart = max(i for i, d in enumerate(frames) if d["frame"] == 0)
    after = frames[restart:]
    assert restart >= 1 and after[0]["block"] == 0
    got = np.stack([np.frombuffer(d["image"], np.uint8).reshape(d["shape"]) for d in after])
    assert np.array_equal(got, refs[5]["frames"])


def test_hostile_messages_get_errors_and_the_server_carries_on(server):
    """An sdvg client (sdvg=1) hears each refusal by name; plain clients: tests/test_serve_krea.py."""
    url, _ = server

    async def go():
        errors = []
        async with websockets.connect(f"ws://{url}/session/hostile1?sdvg=1", max_size=2**26) as ws:
            await recv_json(ws, 30)
            for bad in (b"\xc1\xff\x00", msgpack.packb([1, 2]), msgpack.packb({"prompt": "x", "bogus": 1}),
                        msgpack.packb({"prompt": 3}), msgpack.packb({"prompt": "x", "num_blocks": "9"}),
                        msgpack.packb({"prompt": "x", "input_video": "/etc/passwd"}),
                        msgpack.packb({"prompt": "x", "input_video": "http://example.com/a.mp4"}),
                        msgpack.packb({"prompt": "x", "start_frame": "../../secret.png"}),
                        msgpack.packb({"prompt": "x", "input_video": "up_" + "0" * 32}),
                        msgpack.packb({"prompt": "x", "width": 840}),
                        msgpack.packb({"prompt": "x", "num_denoising_steps": 9}),
                        msgpack.packb({"prompt": "x", "scheduler": "cpp"}),
                        msgpack.packb({"prompt": "x", "exit_head": "/etc/shadow"}),
                        msgpack.packb({"prompt": "x", "tau": "high"}),
                        msgpack.packb({"prompt": "x", "mode": "turbo"}),
                        msgpack.packb({"prompt": "x", "strength": 0.5})):
                await ws.send(bad)
                errors.append(await recv_json(ws, 30))
            await ws.send("a text frame")
            errors.append(await recv_json(ws, 30))
            # the same socket still starts a valid session afterwards
            await ws.send(msgpack.packb(params(num_blocks=1)))
            got = 0
            while True:
                m = await asyncio.wait_for(ws.recv(), TIMEOUT)
                if isinstance(m, bytes):
                    got += 1
                elif json.loads(m).get("status") == "completed":
                    break
                elif json.loads(m).get("status") not in ("params", "stats"):
                    errors.append(json.loads(m))
            return errors, got

    errors, got = asyncio.run(go())
    fields = [e.get("field") for e in errors]
    assert all(e["status"] == "error" for e in errors)
    assert fields == [None, None, "bogus", "prompt", "num_blocks", "input_video", "input_video", "start_frame",
                      "input_video", "width", "num_denoising_steps", "scheduler", "exit_head", "tau", "mode",
                      "strength", None]
    assert "never opens a path or URL" in errors[5]["error"]
    assert got == 9


def test_parameters_that_hold_only_together_are_taken_together(server):
    """Options checked alone name the field they refuse, but a rule across fields is checked on them together: the
    pattern router arrives with its pattern in the same parameters and decides the blocks; alone, it is refused."""
    url, _ = server
    out = asyncio.run(run_session(url, params(router="pattern", pattern="01"), fmt="raw", superset=True,
                                  session_id="together1"))
    assert [m["decision"] for m in out["texts"] if m["status"] == "stats"] == ["forced", "accepted"]
    refused = asyncio.run(run_session(url, params(router="pattern"), superset=True, session_id="together2"))
    error = next(m for m in refused["texts"] if m["status"] == "error")
    assert error["field"] == "router" and "needs a decision pattern" in error["error"]


def test_updates_sdvg_cannot_take_are_refused_by_field_and_krea_rules_hold(server):
    url, app = server
    assert app.state.engine.live

    async def go():
        async with websockets.connect(f"ws://{url}/session/upd1?sdvg=1") as ws:
            await recv_json(ws, 30)
            await ws.send(msgpack.packb(params(num_blocks=1)))
            replies = []
            for update in ({"image": b"\xff\xd8\xff" + b"0" * 10}, {"seed": 11},
                           {"action": "ping", "request_id": "p"}, {"prompt": PROMPT}, {"interp_steps": 3},
                           {"action": "jump"}):
                await ws.send(msgpack.packb(update))
            while len(replies) < 5:  # the unchanged prompt gets no reply (Krea: nothing changes)
                m = await asyncio.wait_for(ws.recv(), TIMEOUT)
                if isinstance(m, str) and json.loads(m)["status"] in ("error", "ack", "pong"):
                    replies.append(json.loads(m))
            return replies

    r = asyncio.run(go())
    assert r[0]["status"] == "error" and r[0]["field"] == "image" and "webcam_mode: true" in r[0]["error"]
    assert r[1] == {"status": "ack", "field": "seed", "block": None, "request_id": None, "effective": "next reset"}
    assert r[2]["status"] == "pong" and r[2]["request_id"] == "p"
    assert r[3]["status"] == "error" and r[3]["field"] == "interp_steps"  # a blend without a new prompt
    assert r[4]["status"] == "error" and r[4]["field"] == "action"


@pytest.mark.slow
def test_live_prompt_and_tau_updates_are_acked_blended_and_replay_bitwise(server, tiny_pipe):
    """A prompt change (blended over 2 blocks) and a tau change sent mid-stream are acked at a block;
    the stream equals, bitwise, `pipe.session` fed the same updates at the acked blocks."""
    url, app = server
    n_blocks = 5

    async def on_frame(ws, count):
        if count == 1:  # block 0's first frame: both updates go in while the session runs
            await ws.send(msgpack.packb({"prompt": "a cat on a piano", "interp_steps": 2, "request_id": "u1"}))
            await ws.send(msgpack.packb({"tau": 0.25, "request_id": "u2"}))
            await ws.send(msgpack.packb({"router": "pattern"}))  # no pattern to go with it: refused, nothing changes

    with block_gate(app, "live1", messages=3) as gate:  # block 1 waits for the three updates: none can miss the run
        out = asyncio.run(run_session(url, params(num_blocks=n_blocks), fmt="raw", superset=True,
                                      session_id="live1", on_frame=on_frame, stop_on_field_error=False))
    assert not gate.timed_out and gate.seen == 3
    acks = {m["field"]: m for m in out["texts"] if m["status"] == "ack"}
    assert set(acks) == {"prompt", "tau"} and acks["prompt"]["request_id"] == "u1"
    assert 1 <= acks["prompt"]["block"] <= acks["tau"]["block"] < n_blocks
    errors = [m for m in out["texts"] if m["status"] == "error"]
    assert [e["field"] for e in errors] == ["router"] and "needs a decision pattern" in errors[0]["error"]
    stats = [m for m in out["texts"] if m["status"] == "stats"]
    assert [m["block"] for m in stats] == list(range(n_blocks))

    session = tiny_pipe.session(PROMPT, num_blocks=n_blocks, seed=5, kv_cache_frames=3, keep_first_frame=False,
                                scheduler="reference")
    due = {acks["prompt"]["block"]: [{"prompt": "a cat on a piano", "interp_blocks": 2}]}
    due.setdefault(acks["tau"]["block"], []).append({"tau": 0.25})
    blocks = []
    while len(blocks) < n_blocks:
        for changes in due.pop(len(blocks), []):
            assert session.update(**changes).block == len(blocks)
        blocks.append(next(session))
    session.close()
    assert np.array_equal(np.stack(out["frames"]), np.concatenate([b.frames.numpy() for b in blocks]))
    assert [m["decision"] for m in stats] == [b.decision for b in blocks]
    got = [(m["prompt_index"], m["blend_weight"], m["forced_by_update"]) for m in stats]
    assert got == [(b.live["prompt_index"], b.live["blend_weight"], b.live["forced_by_update"]) for b in blocks]
    switch = acks["prompt"]["block"]
    assert [w for _, w, _ in got[switch:switch + 2]] == [0.0, 1.0][:n_blocks - switch]  # Krea's blend, 2 blocks
    assert all(i == 0 for i, _, _ in got[:switch]) and all(i == 1 for i, _, _ in got[switch:])


def test_handshake_refusals_oversize_message_and_update_flood(server):
    url, _ = server

    async def refused(path):
        try:
            async with websockets.connect(f"ws://{url}{path}") as ws:
                await asyncio.wait_for(ws.recv(), 30)
        except websockets.exceptions.InvalidStatus as exc:
            return exc.response.status_code
        except websockets.exceptions.ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd else None
        return "open"

    assert asyncio.run(refused("/session/..%2F..%2Fetc")) in (403, 404, 1008)
    assert asyncio.run(refused("/session/a.b")) in (403, 1008)
    assert asyncio.run(refused("/session/ok?fmt=png")) in (403, 1008)

    async def oversize():
        async with websockets.connect(f"ws://{url}/session/big1", max_size=2**26) as ws:
            await recv_json(ws, 30)
            await ws.send(b"\x00" * (9 * 2**20))  # beyond the 8 MiB limit
            try:
                while True:
                    await asyncio.wait_for(ws.recv(), 30)
            except websockets.exceptions.ConnectionClosed as exc:
                return exc.rcvd.code if exc.rcvd else None

    assert asyncio.run(oversize()) == 1009

    async def flood():
        async with websockets.connect(f"ws://{url}/session/flood1") as ws:
            await recv_json(ws, 30)
            await ws.send(msgpack.packb(params(num_blocks=1)))
            try:
                for _ in range(400):
                    await ws.send(msgpack.packb({"seed": 1}))
                while True:
                    await asyncio.wait_for(ws.recv(), 60)
            except websockets.exceptions.ConnectionClosed as exc:
                return exc.rcvd.code if exc.rcvd else None

    assert asyncio.run(flood()) == 1008
    assert http(url, "/health") == (200, b'"OK"')
    metrics = http(url, "/metrics")[1].decode()
    assert 'sdvg_serve_refused_messages_total{reason="rate"}' in metrics


def test_uploads_return_ids_and_check_type_and_size(server):
    import io

    from PIL import Image

    url, app = server

    def post(path, data: bytes, filename="f.bin"):
        return upload(url, path, data, filename)

    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    status, body = post("/upload_start_frame", png.getvalue(), "../../evil.png")
    assert status == 200 and body["id"].startswith("up_") and body["filename"] == "evil.png"
    assert body["path"] == body["id"]  # Krea's page reads `path`: the opaque id, never a server path
    assert app.state.uploads.known(body["id"])
    assert post("/upload_start_frame", b"#!/bin/sh\nrm -rf /\n", "x.png")[0] == 415
    assert post("/upload_video", tiny_mp4())[0] == 200
    assert post("/upload_video", b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64)[0] == 415  # the signature, no video
    assert post("/upload_video", b"GIF89a" + b"\x00" * 64)[0] == 415
    assert post("/upload_start_frame", b"\xff\xd8\xff" + b"\x00" * (5 * 2**20))[0] in (413, "reset")
    assert post("/upload_start_frame", b"\xff\xd8\xff" + b"\x00" * 64)[0] == 400  # JPEG magic, not an image


@pytest.mark.slow
def test_a_start_frame_upload_starts_the_video_from_the_image(server, tiny_pipe, refs):
    """Krea's `start_frame`, as an upload id: the image is every model's clean context before block 0, and the
    stream equals, bitwise, `pipe.stream(start_frame=...)` with the same decoded pixels (a lossless PNG). An id
    that is not an image upload, or no upload at all, is refused naming `start_frame`."""
    import io

    from PIL import Image

    url, _ = server
    image = np.random.default_rng(4).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    status, body = upload(url, "/upload_start_frame", png.getvalue(), "start.png")
    assert status == 200
    _, video = upload(url, "/upload_video", tiny_mp4())
    out = asyncio.run(run_session(url, params(start_frame=body["id"]), fmt="raw", superset=True, session_id="sf1"))
    bad = asyncio.run(run_session(url, params(start_frame=video["id"]), fmt="raw", superset=True, session_id="sf2"))
    unknown = asyncio.run(run_session(url, params(start_frame="up_" + "1" * 32), fmt="raw", superset=True,
                                      session_id="sf3"))
    ref = list(tiny_pipe.stream(PROMPT, num_blocks=2, seed=5, kv_cache_frames=3, keep_first_frame=False,
                                start_frame=image, scheduler="reference"))
    assert out["texts"][-1]["status"] == "completed"
    echo = next(t for t in out["texts"] if t["status"] == "params")
    assert echo["start_frame"] == {"height": 64, "width": 64}
    assert np.array_equal(np.stack(out["frames"]), np.concatenate([b.frames.numpy() for b in ref]))
    assert not np.array_equal(np.stack(out["frames"]), refs[5]["frames"])  # the same session without it differs
    refused = bad["texts"][-1]
    assert refused["field"] == "start_frame" and "JPEG, PNG or WebP" in refused["error"] and not bad["frames"]
    assert unknown["texts"][-1]["field"] == "start_frame" and "no such upload" in unknown["texts"][-1]["error"]


def test_metrics_are_prometheus_text(server):
    url, _ = server
    async def two():  # two sessions at once: the batched worker's rounds make calls of two rows
        return await asyncio.gather(*[run_session(url, params(num_blocks=3), session_id=f"metrics{i}")
                                      for i in range(2)])

    asyncio.run(two())
    text = http(url, "/metrics")[1].decode()
    for name in ("sdvg_serve_sessions_active", "sdvg_serve_sessions_queued", "sdvg_serve_blocks_total",
                 "sdvg_serve_acceptance_ratio", "sdvg_serve_time_to_first_frame_seconds_bucket",
                 "sdvg_serve_block_latency_seconds_bucket", "sdvg_serve_inter_frame_jitter_seconds_bucket",
                 "sdvg_serve_dropped_frames_total", "sdvg_serve_inter_block_seconds_bucket",
                 "sdvg_serve_deadline_misses_total", "sdvg_serve_round_sessions_bucket"):
        assert name in text, name
    # the batched worker (the default): its model calls by kind and rows, their seconds by lane
    assert "sdvg_serve_batched_calls_total{kind=" in text  # a round of both sessions went through the batcher
    assert 'sdvg_serve_lane_seconds_total{lane="drafter"}' in text and 'lane="target"' in text
    assert 'sdvg_serve_blocks_total{decision="forced"}' in text
    assert "sdvg_serve_build_info{" in text and 'preset="tiny"' in text  # the build and the model served


def test_page_is_served(server):
    url, _ = server
    status, body = http(url, "/")
    assert status == 200 and b"/static/app.js" in body
    status, js = http(url, "/static/app.js")
    assert status == 200 and b"interp_steps" in js and b"http" not in js.replace(b"https:", b"")


def _eight_sessions(url) -> list:
    async def go():
        return await asyncio.gather(*[run_session(url, params(seed=SEEDS[i % 2]), fmt="raw", superset=True,
                                                  session_id=f"many{i}") for i in range(8)])

    outs = asyncio.run(go())
    assert all(out["texts"][-1]["status"] == "completed" for out in outs)
    return outs


@pytest.mark.slow
def test_eight_concurrent_sessions_each_make_their_own_video(server, refs):
    """The batched worker (its default: decodes batched too): every session's blocks decided as alone, their frames
    within one uint8 level of the session alone (the VAE's convolutions are not batch-invariant)."""
    url, app = server
    for i, out in enumerate(_eight_sessions(url)):
        want = refs[SEEDS[i % 2]]
        got = np.stack(out["frames"])
        assert got.shape == want["frames"].shape and int(np.abs(got.astype(int) - want["frames"]).max()) <= 1, i
        decisions = [t["decision"] for t in out["texts"] if t.get("status") == "stats"]
        assert decisions == want["decisions"], i
    assert any(kind == "decode" and rows > 1 for kind, rows in app.state.manager.batcher.stats.calls)


@pytest.mark.slow
def test_eight_concurrent_sessions_without_batched_decodes_are_bitwise(tiny_pipe, refs, tmp_path):
    """`--no-batch-decode`: eight concurrent sessions, their DiT and reward calls batched, each bitwise its own video."""
    with running_server(tiny_pipe, tmp_path, max_sessions=8, send_buffer_frames=4096, batch_decode=False) as (url, _):
        for i, out in enumerate(_eight_sessions(url)):
            assert np.array_equal(np.stack(out["frames"]), refs[SEEDS[i % 2]]["frames"]), i


@pytest.mark.slow
def test_killed_client_frees_its_session_and_others_finish(server, refs):
    url, app = server

    async def go():
        killed = asyncio.Event()

        async def victim():
            ws = await websockets.connect(f"ws://{url}/session/victim1")
            await recv_json(ws, 30)
            await ws.send(msgpack.packb(params(num_blocks=9)))
            await asyncio.wait_for(ws.recv(), TIMEOUT)  # a frame: it is generating
            ws.transport.abort()  # killed: no close handshake
            killed.set()

        async def other():
            await killed.wait()
            return await run_session(url, params(seed=7), fmt="raw", session_id="survivor1")

        _, out = await asyncio.gather(victim(), other())
        return out

    out = asyncio.run(go())
    assert np.array_equal(np.stack(out["frames"]), refs[7]["frames"])
    # the victim's 9 blocks would outlast the survivor's 2 by far: freed at once, nothing is left running
    manager = app.state.manager
    assert manager.active == [] and "victim1" not in manager.keys


@pytest.mark.slow
def test_max_sessions_2_queues_the_third_and_refuses_beyond_the_queue(tiny_pipe, refs, tmp_path):
    """Two paused sessions hold both slots (a paused generation stays admitted), so the order is not a race with
    how fast a block runs: the third is queued, the fourth refused `busy`; resuming the two frees a slot and the
    queued third runs to the end."""
    with running_server(tiny_pipe, tmp_path, max_sessions=2, max_queue=1) as (url, _):
        async def until(ws, status):
            while True:
                m = await asyncio.wait_for(ws.recv(), TIMEOUT)
                if isinstance(m, str) and json.loads(m)["status"] == status:
                    return json.loads(m)

        async def go():
            socks = []
            for i in range(2):  # the slot holders: started, then paused before their block (or after it)
                ws = await websockets.connect(f"ws://{url}/session/q{i}?fmt=raw&sdvg=1")
                await recv_json(ws, 30)
                await ws.send(msgpack.packb(params(num_blocks=2)))
                await ws.send(msgpack.packb({"action": "pause"}))
                await until(ws, "ack")
                socks.append(ws)
            for i in (2, 3):  # sdvg's superset: the third is told when it gets its slot (plain: test_serve_krea.py)
                ws = await websockets.connect(f"ws://{url}/session/q{i}?fmt=raw&sdvg=1")
                await recv_json(ws, 30)
                await ws.send(msgpack.packb(params(num_blocks=1)))
                socks.append(ws)
                if i == 2:
                    third = [await recv_json(ws, 30) for _ in range(2)]  # queued, params (either order)
            fourth = await recv_json(socks[3], 30)
            try:
                await asyncio.wait_for(socks[3].recv(), 30)
                code = "open"
            except websockets.exceptions.ConnectionClosed as exc:
                code = exc.rcvd.code
            for ws in socks[:2]:
                await ws.send(msgpack.packb({"action": "resume"}))
            frames, running_before_frames = 0, None
            while True:  # the queued third runs once a slot frees
                m = await asyncio.wait_for(socks[2].recv(), TIMEOUT)
                if isinstance(m, bytes):
                    frames += 1
                    running_before_frames = bool(running_before_frames)
                elif json.loads(m)["status"] == "running":
                    assert json.loads(m) == {"status": "running", "session_id": "q2"}
                    running_before_frames = frames == 0
                elif json.loads(m)["status"] == "completed":
                    break
            for ws in socks[:2]:
                await until(ws, "completed")
            for ws in socks:
                await ws.close()
            return third, fourth, code, frames, running_before_frames

        third, fourth, code, frames, running_before_frames = asyncio.run(go())
    assert {"status": "queued", "position": 1, "session_id": "q2", "reason": "slots"} in third
    assert any(t["status"] == "params" and t["state"] == "queued" for t in third)
    assert running_before_frames is True  # {status: running} came before the first frame
    assert fourth["status"] == "error" and fourth["error"].startswith("busy") and code == 1013
    assert frames == 9


@pytest.mark.slow
def test_pause_holds_the_session_and_resume_finishes_it(server, refs):
    url, _ = server

    async def go():
        async with websockets.connect(f"ws://{url}/session/pause1?fmt=raw&sdvg=1") as ws:
            await recv_json(ws, 30)
            await ws.send(msgpack.packb(params()))
            await ws.send(msgpack.packb({"action": "pause"}))
            frames, paused_frames, acked = 0, None, False
            while True:
                try:
                    m = await asyncio.wait_for(ws.recv(), 10 if acked and paused_frames is None else TIMEOUT)
                except asyncio.TimeoutError:  # paused: nothing more comes
                    paused_frames = frames
                    await ws.send(msgpack.packb({"action": "resume"}))
                    continue
                if isinstance(m, bytes):
                    frames += 1
                    continue
                msg = json.loads(m)
                acked = acked or (msg["status"] == "ack" and msg["action"] == "pause")
                if msg["status"] == "completed":
                    return paused_frames, frames

    paused_frames, frames = asyncio.run(go())
    assert paused_frames in (0, 9)  # at most the block in progress when the pause arrived
    assert frames == len(refs[5]["frames"])


def _jpegs(n: int, seed: int = 0) -> list[bytes]:
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, size=(48, 80, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def test_webcam_frames_drive_a_video_to_video_session_without_stalling_others(server, tiny_pipe):
    """Krea's webcam mode: `image` messages feed a live video-to-video session (strength 0.6). While it waits for
    frames another socket's session completes; then the frames arrive and the webcam session's raw frames equal,
    bitwise, `pipe.session` fed the same decoded frames."""
    from serve_harness import decode_jpeg

    url, _ = server
    jpegs = _jpegs(9)  # one block's frames

    async def go():
        async with websockets.connect(f"ws://{url}/session/cam1?fmt=raw&sdvg=1", max_size=2**26) as ws:
            await recv_json(ws, 30)
            await ws.send(msgpack.packb(params(num_blocks=1, webcam_mode=True, strength=0.6)))
            assert (await recv_json(ws, 30))["status"] == "params"
            other = await run_session(url, params(num_blocks=1), session_id="notcam")  # not held up by cam1
            for data in jpegs[:5]:
                await ws.send(msgpack.packb({"image": data, "strength": 0.6}))
            frames, texts = [], []
            sent = 5
            while True:
                m = await asyncio.wait_for(ws.recv(), TIMEOUT) if sent == len(jpegs) else None
                if m is None:  # the rest, one by one (each queued in order, read first in first out)
                    await ws.send(msgpack.packb({"image": jpegs[sent]}))
                    sent += 1
                    continue
                if isinstance(m, bytes):
                    item = msgpack.unpackb(m)
                    frames.append(np.frombuffer(item["image"], np.uint8).reshape(item["shape"]))
                    continue
                msg = json.loads(m)
                texts.append(msg)
                if msg["status"] in ("completed", "error"):
                    break
            # a frame still in flight when `completed` came is dropped without a reply; the socket goes on
            await ws.send(msgpack.packb({"image": jpegs[0]}))
            await ws.send(msgpack.packb({"action": "ping", "request_id": "after"}))
            texts.append(await recv_json(ws, 30))
            return other, frames, texts

    other, frames, texts = asyncio.run(go())
    assert texts.pop() == {"status": "pong", "request_id": "after", "timestamp": None}  # no error before it
    assert any(t.get("status") == "completed" for t in other["texts"]) and len(other["frames"]) == 9
    assert texts[-1]["status"] == "completed", texts
    assert not [t for t in texts if t["status"] == "ack"]  # webcam frames are not acknowledged
    session = tiny_pipe.session(PROMPT, num_blocks=1, seed=5, kv_cache_frames=3, keep_first_frame=False,
                                scheduler="reference", input_frames=True, strength=0.6)
    session.update(input_frames=np.stack([decode_jpeg(j) for j in jpegs]))
    want = np.concatenate([b.frames.numpy() for b in session])
    assert np.array_equal(np.stack(frames), want)


def test_an_uploaded_input_video_drives_a_session_and_a_broken_one_is_refused_at_upload(server, tiny_pipe, tmp_path):
    """Krea's input_video, by upload id: read on the server (never a client path), its length capping num_blocks as
    in Krea; the raw frames equal `pipe.session` over the same file. A file that is no video: 415 at its upload."""
    import imageio_ffmpeg

    from sdvg.io.video_input import read_video

    url, _ = server
    src = tmp_path / "in.mp4"
    writer = imageio_ffmpeg.write_frames(str(src), (80, 48), fps=16, quality=None, output_params=["-crf", "0"],
                                         macro_block_size=1)
    writer.send(None)
    rng = np.random.default_rng(3)
    for _ in range(21):  # 2 blocks' worth: num_blocks 9 is capped to 2
        writer.send(rng.integers(0, 256, size=(48, 80, 3), dtype=np.uint8).tobytes())
    writer.close()
    status, body = upload(url, "/upload_video", src.read_bytes(), "in.mp4")
    assert status == 200
    out = asyncio.run(run_session(url, {"prompt": PROMPT, "seed": 5, "input_video": body["id"], "strength": 0.6},
                                  fmt="raw", superset=True, session_id="vid1"))
    session = tiny_pipe.session(PROMPT, num_blocks=2, seed=5, kv_cache_frames=3, keep_first_frame=False,
                                scheduler="reference", input_video=read_video(src, 21, 16), strength=0.6)
    want = np.concatenate([b.frames.numpy() for b in session])
    assert np.array_equal(np.stack(out["frames"]), want)
    # a file that is no video (an MP4 signature, nothing ffmpeg can read): refused at the upload, by its header,
    # naming the upload and never the server's path of it
    status, body = upload(url, "/upload_video", b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64)
    assert status == 415 and "the uploaded video" in body["error"] and "cannot be read" in body["error"], body
    assert str(tmp_path) not in body["error"] and "/uploads/" not in body["error"]


def _write_clip(path, frames=21, seed=3):
    import imageio_ffmpeg

    writer = imageio_ffmpeg.write_frames(str(path), (80, 48), fps=16, quality=None, output_params=["-crf", "0"],
                                         macro_block_size=1)
    writer.send(None)
    rng = np.random.default_rng(seed)
    for _ in range(frames):
        writer.send(rng.integers(0, 256, size=(48, 80, 3), dtype=np.uint8).tobytes())
    writer.close()


@pytest.mark.slow
def test_an_input_video_is_read_off_the_worker_and_its_upload_outlives_its_ttl_while_claimed(tiny_pipe, tmp_path,
                                                                                            monkeypatch):
    """A session's uploaded input video is read on its own thread: while the read is held, another session runs to
    completion and an update to the reading session is refused by name. The upload is claimed by the session that
    names it: queued behind a busy slot past the upload's TTL (1 s), it still starts; once its socket closes the
    upload goes. An unclaimed upload expires after its TTL as before."""
    import threading

    from sdvg.serve.engine import Engine

    src = tmp_path / "in.mp4"
    _write_clip(src)
    held, reading = threading.Event(), threading.Event()
    read_input = Engine.read_input

    def held_read(self, spec):
        reading.set()
        assert held.wait(TIMEOUT)
        return read_input(self, spec)

    monkeypatch.setattr(Engine, "read_input", held_read)
    with running_server(tiny_pipe, tmp_path / "srv", max_sessions=2, upload_ttl_s=1.0) as (url, app):
        uploads = app.state.uploads
        _, body = upload(url, "/upload_video", src.read_bytes(), "in.mp4")
        _, unclaimed = upload(url, "/upload_video", src.read_bytes(), "in.mp4")

        async def go():
            vid = await websockets.connect(f"ws://{url}/session/rd1?fmt=raw&sdvg=1")
            await recv_json(vid, 30)
            await vid.send(msgpack.packb({"prompt": PROMPT, "seed": 5, "input_video": body["id"], "strength": 0.6}))
            assert await asyncio.to_thread(reading.wait, TIMEOUT)
            other = await run_session(url, params(num_blocks=1), fmt="raw", session_id="rd2")  # not held back
            await vid.send(msgpack.packb({"tau": 0.5}))
            refused = None
            while refused is None:
                msg = await recv_json(vid, TIMEOUT)
                if msg.get("status") == "error":
                    refused = msg
            await asyncio.sleep(1.5)  # past the TTL: the claimed upload stays, the unclaimed one goes
            _, again = upload(url, "/upload_video", tiny_mp4())  # (expires others)
            kept = (uploads.known(body["id"]), uploads.known(unclaimed["id"]))
            held.set()
            frames = 0
            while True:
                m = await asyncio.wait_for(vid.recv(), TIMEOUT)
                if isinstance(m, bytes):
                    frames += 1
                elif json.loads(m)["status"] == "completed":
                    break
            await vid.close()
            return other, refused, kept, frames

        other, refused, kept, frames = asyncio.run(go())
        deadline = time.monotonic() + 10
        while uploads.known(body["id"]) and time.monotonic() < deadline:  # released when its socket closed
            time.sleep(0.05)
        gone = not uploads.known(body["id"])
    assert len(other["frames"]) == 9 and other["texts"][-1]["status"] == "completed"
    assert refused["field"] == "tau" and "still being read" in refused["error"]
    assert kept == (True, False)
    assert frames == 21 and gone


def test_a_webcam_reset_with_a_pending_seed_stays_a_webcam_session_and_odd_images_are_refused(server):
    """A `seed` update applies at the next reset (Krea); the reset keeps the session's video input. Webcam frames
    are JPEG/PNG/WebP only (a BMP or GIF is refused by name, PIL opens no other format)."""
    import io

    from PIL import Image

    url, _ = server
    jpegs = _jpegs(9, seed=1)

    def encoded(fmt):
        buf = io.BytesIO()
        Image.new("RGB", (16, 16)).save(buf, format=fmt)
        return buf.getvalue()

    async def go():
        async with websockets.connect(f"ws://{url}/session/cam2?sdvg=1", max_size=2**26) as ws:
            await recv_json(ws, 30)
            await ws.send(msgpack.packb(params(num_blocks=1, webcam_mode=True, strength=0.6)))
            assert (await recv_json(ws, 30))["status"] == "params"
            replies = []
            for fmt in ("BMP", "GIF"):
                await ws.send(msgpack.packb({"image": encoded(fmt)}))
                replies.append(await recv_json(ws, 30))
            await ws.send(msgpack.packb({"seed": 11}))
            replies.append(await recv_json(ws, 30))
            await ws.send(msgpack.packb({"action": "reset"}))
            texts = []
            while True:  # the reset's params (a webcam session still), then its ack
                msg = await recv_json(ws, 30)
                texts.append(msg)
                if msg.get("status") == "ack" and msg.get("field") == "action":
                    break
            for data in jpegs:
                await ws.send(msgpack.packb({"image": data}))
            frames = 0
            while True:
                m = await asyncio.wait_for(ws.recv(), TIMEOUT)
                if isinstance(m, bytes):
                    frames += 1
                elif json.loads(m)["status"] in ("completed", "error"):
                    texts.append(json.loads(m))
                    break
            return replies, texts, frames

    replies, texts, frames = asyncio.run(go())
    assert [r["field"] for r in replies[:2]] == ["image", "image"]
    assert "not a readable JPEG, PNG or WebP image" in replies[0]["error"]
    assert replies[2]["field"] == "seed"
    params_msg = next(t for t in texts if t.get("status") == "params")
    assert params_msg["seed"] == 11 and params_msg["options"]["strength"] == 0.6
    assert texts[-1]["status"] == "completed" and frames == 9


def test_a_slow_webcam_decode_blocks_neither_the_server_nor_the_frame_order(server, tiny_pipe, monkeypatch):
    """Webcam images are decoded off the event loop: while the first one's decode is held, the server answers an
    HTTP request; the socket's later images wait behind it, so the frames are still read in the order sent
    (bitwise `pipe.session` fed the same frames in that order)."""
    import threading

    import sdvg.serve.connection as connection_module
    from serve_harness import decode_jpeg

    url, _ = server
    jpegs = _jpegs(9, seed=4)
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    real = connection_module.decode_frame

    def held_decode(data, max_pixels):
        if data == jpegs[0] and not entered.is_set():
            entered.set()
            release.wait(20)  # held until the test has been answered over HTTP (or 20 s: the test then fails)
            done.set()
        return real(data, max_pixels)

    monkeypatch.setattr(connection_module, "decode_frame", held_decode)  # the socket's decode
    answered = {}

    def probe():
        entered.wait(30)
        t0 = time.perf_counter()
        answered["status"] = http(url, "/")[0]
        answered["held"] = not done.is_set()  # answered while the decode was still held
        answered["s"] = time.perf_counter() - t0
        release.set()

    prober = threading.Thread(target=probe)
    prober.start()

    async def go():
        async with websockets.connect(f"ws://{url}/session/cam3?fmt=raw&sdvg=1", max_size=2**26) as ws:
            await recv_json(ws, 30)
            await ws.send(msgpack.packb(params(num_blocks=1, webcam_mode=True, strength=0.6)))
            assert (await recv_json(ws, 30))["status"] == "params"
            for data in jpegs:
                await ws.send(msgpack.packb({"image": data}))
            frames = []
            while True:
                m = await asyncio.wait_for(ws.recv(), TIMEOUT)
                if isinstance(m, bytes):
                    item = msgpack.unpackb(m)
                    frames.append(np.frombuffer(item["image"], np.uint8).reshape(item["shape"]))
                elif json.loads(m)["status"] in ("completed", "error"):
                    return frames, json.loads(m)

    frames, last = asyncio.run(go())
    prober.join(30)
    assert answered["status"] == 200 and answered["held"], answered
    assert last["status"] == "completed", last
    session = tiny_pipe.session(PROMPT, num_blocks=1, seed=5, kv_cache_frames=3, keep_first_frame=False,
                                scheduler="reference", input_frames=True, strength=0.6)
    session.update(input_frames=np.stack([decode_jpeg(j) for j in jpegs]))
    assert np.array_equal(np.stack(frames), np.concatenate([b.frames.numpy() for b in session]))
