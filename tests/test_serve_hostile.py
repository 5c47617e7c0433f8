"""`sdvg serve` against hostile clients (docs/server.md, "Security"): a page on another site cannot drive it (Origin),
DNS rebinding cannot reach it under another name (Host), a message cannot stall it (msgpack limits), every refused
message counts against one budget per socket, and each refusal is counted in /metrics by reason. Loopback only,
every wait bounded."""
from __future__ import annotations

import asyncio
import http.client
import json
import time

import pytest

pytest.importorskip("fastapi")
msgpack = pytest.importorskip("msgpack")
websockets = pytest.importorskip("websockets")
pytest.importorskip("prometheus_client")

from serve_harness import recv_json, running_server, upload  # noqa: E402

from sdvg.serve.security import check_allowed_host, host_allowed, host_of, origin_allowed  # noqa: E402


def _get(url: str, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest("GET", path, skip_host="host" in {k.lower() for k in (headers or {})})
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


async def _ws_status(url: str, sid: str, headers: dict, query: str = "?sdvg=1"):
    """'ready', or the HTTP status the handshake was refused with."""
    try:
        async with websockets.connect(f"ws://{url}/session/{sid}{query}", additional_headers=headers) as ws:
            return (await recv_json(ws, 30))["status"]
    except websockets.exceptions.InvalidStatus as exc:
        return exc.response.status_code


def _raw_ws_status(url: str, path: str, host: str) -> int:
    """The HTTP status of a websocket handshake sent by hand under `Host: host` (a client library sets its own)."""
    import socket

    h, port = url.rsplit(":", 1)
    with socket.create_connection((h, int(port)), timeout=30) as sock:
        sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        return int(sock.recv(4096).split(b" ", 2)[1])


def _refused(url: str, reason: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = _get(url, "/metrics")[1].decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "sdvg_serve_refused_messages_total" and s.labels.get("reason") == reason)


def test_host_rule_defeats_dns_rebinding():
    assert host_of("127.0.0.1:8000") == "127.0.0.1" and host_of("[::1]:80") == "::1" and host_of("LocalHost") == "localhost"
    assert host_of("a b") is None and host_of("x:y") is None and host_of("[zz]") is None
    # a loopback bind: loopback names and addresses only
    assert host_allowed("127.0.0.1:8000", "127.0.0.1") and host_allowed("localhost:8000", "127.0.0.1")
    assert host_allowed("[::1]:8000", "127.0.0.1") and host_allowed("127.0.0.5", "localhost")
    assert not host_allowed("rebind.evil.example:8000", "127.0.0.1")
    assert not host_allowed("10.0.0.1:8000", "127.0.0.1")
    # a named address: that address; a wildcard bind: any address, names only when allowed
    assert host_allowed("10.0.0.7:8000", "10.0.0.7") and not host_allowed("evil.example", "10.0.0.7")
    assert host_allowed("10.0.0.7", "0.0.0.0") and host_allowed("[fe80::1]", "::")
    assert not host_allowed("gpu1.example.com", "0.0.0.0")
    assert host_allowed("gpu1.example.com:443", "0.0.0.0", ("gpu1.example.com",))
    assert host_allowed("a.b.example.com", "0.0.0.0", (".example.com",))
    assert host_allowed("example.com", "0.0.0.0", (".example.com",))
    assert not host_allowed("badexample.com", "0.0.0.0", (".example.com",))
    assert host_allowed("anything.example", "0.0.0.0", ("*",))
    assert host_allowed(None, "127.0.0.1")  # HTTP/1.0 without Host: no browser
    for bad in ("http://x", "a/b", "", "-x.com", "a..b"):
        with pytest.raises(ValueError, match="--allowed-host"):
            check_allowed_host(bad)


def test_origin_rule_is_same_origin_or_named():
    assert origin_allowed(None, "127.0.0.1:8000", "http")  # not a browser page
    assert origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000", "http")
    assert origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000", "ws")
    assert origin_allowed("https://gpu.example", "gpu.example", "wss")
    assert not origin_allowed("http://gpu.example", "gpu.example", "wss")  # the scheme too
    assert not origin_allowed("http://evil.example", "127.0.0.1:8000", "http")
    assert not origin_allowed("null", "127.0.0.1:8000", "http")  # a sandboxed frame or a file:// page
    assert not origin_allowed("http://127.0.0.1:9999", "127.0.0.1:8000", "http")
    assert origin_allowed("https://studio.example", "127.0.0.1:8000", "http", ("https://studio.example",))


def test_a_page_on_another_site_cannot_drive_the_default_server(tiny_pipe, tmp_path):
    """The no-token loopback server: a cross-origin socket and upload are refused before anything runs; the
    server's own page (same origin) and non-browser clients (no Origin) are not."""
    with running_server(tiny_pipe, tmp_path) as (url, _):
        own = f"http://{url}"
        assert asyncio.run(_ws_status(url, "o1", {"Origin": "http://evil.example"})) == 403
        assert asyncio.run(_ws_status(url, "o2", {"Origin": "null"}, "")) == 403
        assert asyncio.run(_ws_status(url, "o3", {"Origin": own})) == "ready"
        assert asyncio.run(_ws_status(url, "o4", {})) == "ready"
        import urllib.error
        import urllib.request

        body = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.png\"\r\n\r\nxx\r\n--b--\r\n"
        req = urllib.request.Request(f"http://{url}/upload_start_frame", data=body, method="POST",
                                     headers={"Content-Type": "multipart/form-data; boundary=b",
                                              "Origin": "http://evil.example"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 403 and b"--cors-origin" in err.value.read()
        assert _get(url, "/metrics", {"Origin": "http://evil.example"})[0] == 403
        assert _refused(url, "origin") == 4
        # the same upload from the page's own origin reaches the upload check (not an image: 415)
        req.remove_header("Origin")
        req.add_header("Origin", own)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 415


def test_dns_rebinding_names_are_refused_and_health_stays_open(tiny_pipe, tmp_path):
    with running_server(tiny_pipe, tmp_path) as (url, _):
        evil = {"Host": "rebind.evil.example:" + url.rsplit(":", 1)[1]}
        status, body = _get(url, "/metrics", evil)
        assert status == 400 and b"--allowed-host" in body
        assert _get(url, "/download_video/s1", evil)[0] == 400
        assert _get(url, "/", evil)[0] == 400
        assert _get(url, "/health", evil) == (200, b'"OK"')
        assert _raw_ws_status(url, "/session/h1?sdvg=1", evil["Host"]) == 403
        assert _raw_ws_status(url, "/session/h2?sdvg=1", url) == 101  # the same handshake under its own name
        assert _get(url, "/metrics", {"Host": "localhost:1"})[0] == 200  # a loopback name for a loopback bind
        assert _refused(url, "host") == 4
    with running_server(tiny_pipe, tmp_path, allowed_hosts=("rebind.evil.example",)) as (url, _):
        evil = {"Host": "rebind.evil.example:" + url.rsplit(":", 1)[1]}
        assert _get(url, "/metrics", evil)[0] == 200  # named by the operator


def test_a_huge_map_is_refused_by_the_decoder_and_refusals_close_the_socket(tiny_pipe, tmp_path):
    """An 850k-key map (7.5 MB, under the message cap) is refused by msgpack's own limits, not decoded; every
    refused message, whatever its kind (text, garbage, limits, invalid), counts against one budget per socket that
    closes it (1008) once spent, before the parameters too."""
    huge = msgpack.packb({f"k{i}": 0 for i in range(850_000)})
    assert 7_000_000 < len(huge) < 8 * 2**20
    deep = b"\x91" * 50 + b"\x01"  # [[[[...1]]]]
    with running_server(tiny_pipe, tmp_path, flood_close_after=6) as (url, _):
        async def go():
            async with websockets.connect(f"ws://{url}/session/flood1?sdvg=1", max_size=2**26) as ws:
                await recv_json(ws, 30)
                said = []
                for message in (huge, deep, "text", b"\xc1garbage", msgpack.packb({"prompt": 5}),
                                msgpack.packb({"prompt": "x", "nope": 1})):
                    await ws.send(message)
                try:
                    while True:
                        said.append(await recv_json(ws, 30))
                except websockets.exceptions.ConnectionClosed as exc:
                    return said, exc.rcvd.code

        said, code = asyncio.run(go())
        assert code == 1008 and len(said) == 6
        assert "max_map_len" in said[0]["error"] and "128 keys" in said[0]["error"]
        assert "nested more than 4" in said[1]["error"] and "text frames" in said[2]["error"]
        assert "malformed" in said[3]["error"] and said[4]["field"] == "prompt"
        assert "6 messages refused" in said[5]["error"] and "--max-refused-messages" in said[5]["error"]
        assert _refused(url, "limits") == 2 and _refused(url, "text") == 1 and _refused(url, "malformed") == 1
        from prometheus_client.parser import text_string_to_metric_families

        lag = {s.name: s.value for f in text_string_to_metric_families(_get(url, "/metrics")[1].decode())
               for s in f.samples if s.name.startswith("sdvg_serve_event_loop_lag")}
        assert lag["sdvg_serve_event_loop_lag_seconds_count"] > 0 and "sdvg_serve_event_loop_lag_max_seconds" in lag
        # a plain client is closed the same way, told nothing more than Krea's error list for its bad parameters
        async def plain():
            async with websockets.connect(f"ws://{url}/session/flood2") as ws:
                await recv_json(ws, 30)
                for _ in range(6):
                    await ws.send("text")
                try:
                    while True:
                        await asyncio.wait_for(ws.recv(), 30)
                except websockets.exceptions.ConnectionClosed as exc:
                    return exc.rcvd.code

        assert asyncio.run(plain()) == 1008


def test_a_pinging_paused_session_gives_its_slot_up_after_max_pause(tiny_pipe, tmp_path):
    """--max-pause-s: a paused run keeps its slot that long from the pause, pings or not; then it ends with
    `completed` (its MP4 finished) and the queued session runs."""
    with running_server(tiny_pipe, tmp_path, max_sessions=1, max_pause_s=1.5, send_buffer_frames=4096) as (url, _):
        async def paused():
            async with websockets.connect(f"ws://{url}/session/p1?sdvg=1", max_size=2**26) as ws:
                await recv_json(ws, 30)
                await ws.send(msgpack.packb({"prompt": "a fox", "num_blocks": 200, "seed": 1}))
                while not isinstance(await asyncio.wait_for(ws.recv(), 240), bytes):
                    pass
                await ws.send(msgpack.packb({"action": "pause"}))

                async def pings():  # every 0.3 s, as a page keeping its socket alive would
                    while True:
                        await ws.send(msgpack.packb({"action": "ping", "timestamp": 1.0}))
                        await asyncio.sleep(0.3)

                pinger = asyncio.create_task(pings())
                texts = []
                try:
                    while not texts or texts[-1].get("status") != "completed":
                        m = await asyncio.wait_for(ws.recv(), 60)
                        if isinstance(m, str):
                            texts.append(json.loads(m))
                finally:
                    pinger.cancel()
                return texts

        async def queued():
            await asyncio.sleep(1.0)
            async with websockets.connect(f"ws://{url}/session/p2?sdvg=1") as ws:
                await recv_json(ws, 30)
                await ws.send(msgpack.packb({"prompt": "a cat", "num_blocks": 1, "seed": 2}))
                statuses = []
                while not statuses or statuses[-1] != "completed":
                    m = await asyncio.wait_for(ws.recv(), 240)
                    if isinstance(m, str):
                        statuses.append(json.loads(m)["status"])
                return statuses

        async def both():
            return await asyncio.gather(paused(), queued())

        texts, statuses = asyncio.run(both())
        assert _get(url, texts[-1]["download_url"])[0] == 200  # its MP4 finished
    ended = [t for t in texts if t.get("status") == "error"]
    assert ended and "--max-pause-s" in ended[0]["error"], texts
    assert texts[-1]["status"] == "completed" and texts[-1]["session_id"] == "p1"
    assert texts[-1]["download_url"].startswith("/download_video/p1~")
    assert "queued" in statuses and "running" in statuses and statuses[-1] == "completed"


class _Transport:
    def __init__(self):
        self.closed = False

    def is_closing(self):
        return self.closed


def test_connection_caps_count_open_transports_and_never_cut_one():
    from sdvg.serve.connections import ConnectionGuard, fd_budget

    seen = []
    guard = ConnectionGuard(max_connections=4, max_per_client=2, header_timeout_s=1.0, refused=seen.append)
    a1, a2, a3, b1, c1, d1 = (_Transport() for _ in range(6))
    assert guard.admit(a1, "10.0.0.1") is None and guard.admit(a2, "10.0.0.1") is None
    assert guard.admit(a3, "10.0.0.1") == "client_connections"  # a third from one address
    assert guard.admit(b1, "10.0.0.2") is None and guard.admit(c1, "10.0.0.3") is None
    assert guard.admit(d1, "10.0.0.4") == "connections"  # four open in all
    assert not any(t.closed for t in (a1, a2, b1, c1))  # the guard closes nothing already admitted
    a1.closed = True  # one closes: room again, for its address too
    assert guard.admit(a3, "10.0.0.1") is None
    assert seen == ["client_connections", "connections"]
    assert fd_budget(1000, 256) == 192 and fd_budget(100, 4096) == 100 and fd_budget(1000, 0) == 1000
    assert fd_budget(1000, 40) == 8


def test_repeated_loop_errors_are_logged_once_per_interval(caplog):
    from sdvg.serve.connections import ThrottledLoopErrors

    now = [0.0]
    handler = ThrottledLoopErrors(interval_s=10.0, clock=lambda: now[0])
    exc = OSError(24, "Too many open files")
    with caplog.at_level("WARNING", logger="sdvg.serve.loop"):
        for i in range(1000):
            now[0] = i * 0.01
            handler(None, {"message": "socket.accept() out of system resource", "exception": exc})
        now[0] = 10.5
        handler(None, {"message": "socket.accept() out of system resource", "exception": exc})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "999 more like it" in lines[1]


def _silent(source: str, port: int):
    import socket

    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    return s


def test_silent_and_slow_clients_do_not_hold_the_server(tiny_pipe, tmp_path):
    """A connection that sends no request is closed after --header-timeout; one client address holds at most
    --max-connections-per-client (one more: 503, closed at once) while other addresses get in; an upload body that
    trickles is cut with 408; a websocket is not touched by the header timeout."""
    import socket

    with running_server(tiny_pipe, tmp_path, header_timeout_s=1.0, max_connections_per_client=3,
                        upload_grace_s=0.5, upload_min_bytes_per_s=1000) as (url, app):
        port = int(url.rsplit(":", 1)[1])
        held = [_silent("127.0.0.3", port) for _ in range(3)]
        extra = _silent("127.0.0.3", port)
        assert extra.recv(4096).startswith(b"HTTP/1.1 503")  # refused as it arrived
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=("127.0.0.2", 0))
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200  # another address is not held back
        conn.close()
        t0 = time.monotonic()
        for s in held:  # the server closes each silent one
            assert s.recv(4096) == b""
        assert time.monotonic() - t0 < 25
        # an upload trickling a byte at a time: 408 once its average rate falls under the floor
        up = socket.create_connection(("127.0.0.1", port), timeout=30)
        up.sendall(b"POST /upload_video HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; "
                   b"boundary=b\r\nContent-Length: 100000\r\n\r\n--b")
        answer = b""
        while b"\r\n\r\n" not in answer:
            time.sleep(0.2)
            try:
                up.sendall(b"x")
            except OSError:
                pass
            answer += up.recv(4096)
        # the body, if it came apart from the head (one more recv once the whole answer is in would wait for the
        # server to close the kept-alive socket: seconds)
        while b"--upload-min-rate" not in answer:
            more = up.recv(4096)
            if not more:
                break
            answer += more
        assert answer.startswith(b"HTTP/1.1 408") and b"--upload-min-rate" in answer
        up.close()

        # a websocket stays past the header timeout: its socket has left HTTP
        async def ws():
            async with websockets.connect(f"ws://{url}/session/w1?sdvg=1") as w:
                await recv_json(w, 30)
                await asyncio.sleep(2.0)
                await w.send(msgpack.packb({"action": "ping", "timestamp": 2.0}))
                return await recv_json(w, 30)

        assert asyncio.run(ws())["status"] == "error"  # a ping before parameters: refused, but answered
        for extra_s in (extra,):
            extra_s.close()
        assert _refused(url, "client_connections") == 1 and _refused(url, "header_timeout") >= 3


@pytest.mark.slow
def test_300_silent_connections_at_ulimit_256_leave_a_running_session_and_health_alone(tmp_path):
    """The load case: `sdvg serve` under `ulimit -n 256` with a session running; 300 silent connections from one
    address. The session finishes with every frame, /health answers from another address while they are open,
    the silent ones are closed by the header timeout, and the log stays short (no traceback per connection)."""
    import resource

    from serve_harness import start_server

    def limit_files():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    proc, port = start_server(tmp_path, "--header-timeout", "3", "--send-buffer-frames", "4096",
                              preexec_fn=limit_files)
    silent = []
    try:
        async def session():
            frames = 0
            async with websockets.connect(f"ws://127.0.0.1:{port}/session/load1", max_size=2**26) as ws:
                await recv_json(ws, 30)
                await ws.send(msgpack.packb({"prompt": "a fox", "num_blocks": 6, "seed": 1}))
                while True:
                    m = await asyncio.wait_for(ws.recv(), 240)
                    if isinstance(m, bytes):
                        frames += 1
                        if frames == 1:  # running: now the flood
                            for _ in range(300):
                                try:
                                    silent.append(_silent("127.0.0.3", port))
                                except OSError:
                                    break
                            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30,
                                                              source_address=("127.0.0.2", 0))
                            conn.request("GET", "/health")
                            health = conn.getresponse().status
                            conn.close()
                    elif json.loads(m).get("status") == "completed":
                        return frames, health

        frames, health = asyncio.run(session())
        assert health == 200 and frames == 9 + 5 * 12  # every frame of the 6 blocks
        assert len(silent) == 300  # every connection was taken (refused ones: 503 and closed)
        closed = 0
        for s in silent:  # each is answered 503 at once or closed after the header timeout
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            closed += data == b"" or data.startswith(b"HTTP/1.1 503")
        assert closed == 300
    finally:
        for s in silent:
            s.close()
        proc.terminate()
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = b""
    while not proc.lines.empty():
        log += proc.lines.get()
    assert log.count(b"Traceback") <= 2 and len(log) < 200_000, log[-2000:]


def test_a_reused_id_never_replaces_a_finished_video(tiny_pipe, tmp_path):
    """Each run's video is its own file: an sdvg client's `download_url` keeps answering its own video after the
    owner's socket closed and another client reused the id (and after a reset on one socket); Krea's
    /download_video/{id} answers the latest video of the id."""
    from sdvg.io.video_writer import read_mp4_frames

    def frames_at(url, path):
        status, body = _get(url, path)
        assert status == 200, (path, status)
        out = tmp_path / f"dl-{len(list(tmp_path.glob('dl-*')))}.mp4"
        out.write_bytes(body)
        return len(read_mp4_frames(out))

    async def run(url, sid, query, blocks, resets=0):
        done = []
        async with websockets.connect(f"ws://{url}/session/{sid}{query}", max_size=2**26) as ws:
            await recv_json(ws, 30)
            await ws.send(msgpack.packb({"prompt": "a fox", "num_blocks": blocks, "seed": blocks}))
            while True:
                m = await asyncio.wait_for(ws.recv(), 240)
                if isinstance(m, str) and json.loads(m).get("status") == "completed":
                    done.append(json.loads(m))
                    if len(done) > resets:
                        return done
                    await ws.send(msgpack.packb({"action": "reset"}))

    with running_server(tiny_pipe, tmp_path / "server") as (url, _):
        first = asyncio.run(run(url, "own", "?sdvg=1", 1))[0]
        assert first["download_url"].startswith("/download_video/own~")
        later = asyncio.run(run(url, "own", "", 2))[0]  # the id reused once the first socket closed
        assert later == {"session_id": "own", "status": "completed"}
        assert frames_at(url, first["download_url"]) == 9  # still the first client's video
        assert frames_at(url, "/download_video/own") == 21  # Krea's download: the latest of the id
        two = asyncio.run(run(url, "rs", "?sdvg=1", 1, resets=1))  # a reset: two runs, two videos
        assert two[0]["download_url"] != two[1]["download_url"]
        assert frames_at(url, two[0]["download_url"]) == 9 and frames_at(url, two[1]["download_url"]) == 9
        assert _get(url, "/download_video/own~0123456789abcdef")[0] == 404  # a run key never made


def test_an_mp4_bomb_is_refused_at_upload_before_a_frame_is_decoded(tiny_pipe, tmp_path):
    """A ~50 KB MP4 of 4096x4096 frames: refused by its header at POST /upload_video (413 naming the flag), not
    stored, not decoded; an image past the pixel limit likewise (by its header, PIL's bomb check never runs); a
    small video goes through."""
    import struct
    import zlib

    from serve_harness import tiny_mp4

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")
    bomb = tiny_mp4(frames=2, side=4096)
    assert len(bomb) < 200_000
    with running_server(tiny_pipe, tmp_path / "server") as (url, app):
        status, body = upload(url, "/upload_video", bomb, "bomb.mp4")
        assert status == 413 and "4096x4096" in body["error"] and "--max-input-video-pixels" in body["error"]
        assert app.state.uploads.nbytes == 0 and not list((tmp_path / "server" / "uploads").iterdir())
        status, body = upload(url, "/upload_start_frame", png, "huge.png")
        assert status == 413 and "20000x20000" in body["error"]
        status, body = upload(url, "/upload_video", tiny_mp4(frames=4, side=64), "ok.mp4")
        assert status == 200 and body["type"] == "mp4"


def test_each_session_event_is_one_log_line(tiny_pipe, tmp_path, caplog):
    """The operator's view (`sdvg.serve.sessions` at INFO): started and completed with their numbers, the first
    refusal of each reason, a socket closed mid-run; never the prompt's text."""
    import logging

    from serve_harness import run_session

    with caplog.at_level(logging.INFO, logger="sdvg.serve.sessions"), running_server(tiny_pipe, tmp_path) as (url, _):
        asyncio.run(run_session(url, {"prompt": "a secret prompt", "num_blocks": 2, "seed": 3}, session_id="log1"))

        async def refused_then_gone():
            async with websockets.connect(f"ws://{url}/session/log2?sdvg=1") as ws:
                await recv_json(ws, 30)
                for _ in range(3):
                    await ws.send("text")
                    await recv_json(ws, 30)
                await ws.send(msgpack.packb({"prompt": "x", "num_blocks": 200, "seed": 1}))
                while not isinstance(await asyncio.wait_for(ws.recv(), 60), bytes):  # running: leave mid-run
                    pass

        asyncio.run(refused_then_gone())
        deadline = time.monotonic() + 60
        while not any("session log2 closed" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.1)
    lines = [r.getMessage() for r in caplog.records if r.name == "sdvg.serve.sessions"]
    started = [m for m in lines if m.startswith("session log1 started")]
    completed = [m for m in lines if m.startswith("session log1 completed")]
    assert len(started) == 1 and "kind=plain" in started[0] and "blocks=2" in started[0] and "client=127.0.0.1:" in \
        started[0] and "prompt_chars=15" in started[0]
    assert len(completed) == 1 and "blocks=2" in completed[0] and "frames=21" in completed[0]
    refused = [m for m in lines if m.startswith("session log2 refused")]
    assert len(refused) == 1 and "reason=text" in refused[0]  # the first of its reason only
    assert any(m.startswith("session log2 closed") and "during=run" in m for m in lines)
    assert not any("secret" in m for m in lines)


def test_an_explicit_null_option_is_refused_by_its_validator_not_dropped(tiny_pipe, tmp_path):
    """`mode: null` from an sdvg client reaches the option's own validator (refused naming the field) instead of
    silently becoming the default; a null where None is the declared default (target_context: the preset's) runs."""
    with running_server(tiny_pipe, tmp_path) as (url, _):
        async def first_reply(params):
            async with websockets.connect(f"ws://{url}/session/null1?sdvg=1") as ws:
                await recv_json(ws, 30)
                await ws.send(msgpack.packb(params))
                return await recv_json(ws, 60)

        refused = asyncio.run(first_reply({"prompt": "a fox", "num_blocks": 1, "mode": None}))
        assert refused["status"] == "error" and refused["field"] == "mode", refused
        taken = asyncio.run(first_reply({"prompt": "a fox", "num_blocks": 1, "target_context": None}))
        assert taken["status"] == "params", taken
