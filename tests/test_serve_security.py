"""sdvg serve's rules on what is let in, unit by unit, and the token on a real non-default bind."""
from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
websockets = pytest.importorskip("websockets")

from sdvg.serve.protocol import ProtocolError, parse_params, parse_update  # noqa: E402
from sdvg.serve.security import BindError, RateLimit, check_bind, token_matches, valid_session_id  # noqa: E402

TOKEN = "s3cret-token-for-tests-0123"


def test_bind_rule_needs_a_token_beyond_the_loopback_default():
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    for host in ("0.0.0.0", "192.168.1.5", "127.0.0.2", "::"):
        with pytest.raises(BindError, match="--token"):
            check_bind(host, None)
        check_bind(host, TOKEN)
    with pytest.raises(BindError, match="16 characters"):
        check_bind("0.0.0.0", "short")


def test_token_compare_and_session_ids():
    assert token_matches(TOKEN, TOKEN)
    assert not token_matches(TOKEN[:-1], TOKEN) and not token_matches(None, TOKEN) and not token_matches("", TOKEN)
    assert valid_session_id("abc-DEF_123") and valid_session_id("x" * 64)
    for bad in ("", "../etc", "a/b", "a.b", "x" * 65, "a b", "é"):
        assert not valid_session_id(bad), bad


def test_rate_limit_is_a_token_bucket():
    now = [0.0]
    rate = RateLimit(10.0, 5, clock=lambda: now[0])
    assert [rate.allow() for _ in range(7)] == [True] * 5 + [False] * 2
    now[0] += 0.5  # 5 more tokens
    assert sum(rate.allow() for _ in range(10)) == 5 and rate.refused == 7


def test_every_message_is_validated_with_the_field_named():
    cases = {"prompt": {"prompt": ""}, "seed": {"prompt": "x", "seed": -1}, "width": {"prompt": "x", "width": 1.5},
             "request_id": {"prompt": "x", "request_id": "r" * 200}, "backend": {"prompt": "x", "backend": "tensorrt"},
             "run_ahead": {"prompt": "x", "run_ahead": True}, "cuda_graphs": {"prompt": "x", "cuda_graphs": True}}
    for field, data in cases.items():
        with pytest.raises(ProtocolError) as exc:
            parse_params(data)
        assert exc.value.field == field, (field, exc.value)
    with pytest.raises(ProtocolError, match="at most 2000"):
        parse_params({"prompt": "x" * 2001})
    with pytest.raises(ProtocolError) as exc:
        parse_update({"prompt": "a", "extra": 1})
    assert exc.value.field == "extra"
    with pytest.raises(ProtocolError, match="at least one"):
        parse_update({"request_id": "x"})
    with pytest.raises(ProtocolError) as exc:
        parse_update({1: 2})
    assert "keys must be strings" in str(exc.value)


def test_outbox_drops_the_oldest_frame_and_counts_it():
    from sdvg.serve.metrics import ServeMetrics
    from sdvg.serve.sessions import Outbox

    async def go():
        metrics = ServeMetrics()
        box = Outbox(3, metrics)
        box.text({"status": "ready"})
        for i in range(5):
            box.frame(bytes([i]))
        box.text({"status": "completed"})
        got = [await box.next() for _ in range(5)]
        return got, box.dropped, metrics.dropped._value.get()

    got, dropped, counted = asyncio.run(go())
    assert [g[1] if g[0] == "frame" else g[1]["status"] for g in got] == ["ready", b"\x02", b"\x03", b"\x04",
                                                                            "completed"]
    assert dropped == counted == 2


def test_token_is_checked_on_http_and_websocket_off_the_default_bind(tiny_pipe, tmp_path):
    from serve_harness import recv_json, running_server

    with running_server(tiny_pipe, tmp_path, host="127.0.0.2", token=TOKEN) as (url, _):
        def status(path, headers=None):
            req = urllib.request.Request(f"http://{url}{path}", headers=headers or {})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        assert status("/health") == 200  # says OK and nothing else
        assert status("/") == 401 and status("/metrics") == 401
        assert status("/", {"Authorization": "Bearer wrong-token-wrong-token"}) == 401
        assert status(f"/?token={TOKEN}x") == 401
        assert status("/", {"Authorization": f"Bearer {TOKEN}"}) == 200
        assert status(f"/metrics?token={TOKEN}") == 200

        async def ws(query):
            try:
                async with websockets.connect(f"ws://{url}/session/tok1{query}") as w:
                    return (await recv_json(w, 30))["status"]
            except websockets.exceptions.InvalidStatus as exc:
                return exc.response.status_code

        assert asyncio.run(ws("")) == 403
        assert asyncio.run(ws("?token=nope")) == 403
        assert asyncio.run(ws(f"?token={TOKEN}")) == "ready"


def test_the_upload_store_holds_at_most_its_bytes(tmp_path, monkeypatch):
    """Uploads held at once are capped (claimed ones count): past the cap a POST is refused (507) naming both sizes,
    nothing is written; an expired or deleted upload frees its bytes; a write that fails frees its reservation."""
    import time

    from sdvg.serve.uploads import UploadError, UploadStore

    store = UploadStore(tmp_path, ttl_s=60.0, max_bytes=100)
    a = store.add(b"a" * 60, "png")
    assert store.claim(a) is not None and store.nbytes == 60
    with pytest.raises(UploadError) as exc:
        store.add(b"b" * 41, "png")
    assert all(s in str(exc.value) for s in ("60 bytes", "at most 100")), exc.value
    assert exc.value.status == 507 and len(list(tmp_path.iterdir())) == 1
    b = store.add(b"b" * 40, "jpeg")  # exactly full
    store.release(a)  # unclaimed but inside its TTL: still held
    with pytest.raises(UploadError):
        store.add(b"c", "png")
    store.delete(b)
    assert store.nbytes == 60
    clock = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: clock + 61)  # a's TTL is over: the next POST expires it first
    c = store.add(b"c" * 100, "webp")
    assert not store.known(a) and store.known(c) and store.nbytes == 100
    store.delete(c)
    def full_disk(path, data):
        raise OSError("disk full")

    monkeypatch.setattr(type(tmp_path), "write_bytes", full_disk)
    with pytest.raises(OSError, match="disk full"):
        store.add(b"d" * 10, "png")
    assert store.nbytes == 0 and not list(tmp_path.iterdir())


def test_a_post_past_the_upload_store_cap_is_refused_507(tiny_pipe, tmp_path):
    import io

    from PIL import Image
    from serve_harness import running_server
    from test_serve import upload

    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    data = png.getvalue()
    with running_server(tiny_pipe, tmp_path, max_upload_store_bytes=len(data) * 2) as (url, app):
        assert [upload(url, "/upload_start_frame", data)[0] for _ in range(2)] == [200, 200]
        status, body = upload(url, "/upload_start_frame", data)
        assert status == 507 and f"takes at most {len(data) * 2}" in body["error"]
        assert len(app.state.uploads) == 2
        text = urllib.request.urlopen(f"http://{url}/metrics", timeout=30).read().decode()
        assert 'sdvg_serve_refused_messages_total{reason="upload"} 1.0' in text


def test_uploads_received_at_once_are_capped_503(tiny_pipe, tmp_path):
    """While one upload's body is still arriving (a raw socket sends half of it), a second POST past
    max_concurrent_uploads = 1 is refused with 503 and Retry-After; once the first completes, uploads go through
    again. The gauges show the upload being received and the bytes stored."""
    import io
    import socket
    import time

    from PIL import Image
    from serve_harness import running_server
    from test_serve import upload

    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    data = png.getvalue()
    boundary = "sdvgboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.png\"\r\n"
            "Content-Type: image/png\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    with running_server(tiny_pipe, tmp_path, max_concurrent_uploads=1) as (url, app):
        def gauge(name):
            text = urllib.request.urlopen(f"http://{url}/metrics", timeout=30).read().decode()
            return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

        host, port = url.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as slow:
            slow.sendall((f"POST /upload_start_frame HTTP/1.1\r\nHost: {url}\r\nConnection: close\r\n"
                          f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n").encode() + body[:40])
            deadline = time.monotonic() + 30
            while gauge("sdvg_serve_uploads_receiving") < 1:
                assert time.monotonic() < deadline, "the first upload never reached the server"
                time.sleep(0.05)
            req = urllib.request.Request(f"http://{url}/upload_start_frame", data=body, method="POST",
                                         headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(req, timeout=30)
            assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
            assert "at most 1 at once" in refused.value.read().decode()
            slow.sendall(body[40:])
            reply = b""
            while chunk := slow.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200") and b'"id":"up_' in reply
        assert upload(url, "/upload_start_frame", data)[0] == 200  # the slot is free again
        assert gauge("sdvg_serve_uploads_receiving") == 0
        assert gauge("sdvg_serve_upload_bytes") == 2 * len(data) == app.state.uploads.nbytes


def test_serve_cli_refuses_a_public_bind_without_token(capsys):
    from sdvg.cli import main

    assert main(["serve", "--preset", "tiny", "--host", "0.0.0.0", "--quiet"]) == 2
    assert "--token" in capsys.readouterr().err


def test_idle_socket_is_closed(tiny_pipe, tmp_path):
    from serve_harness import recv_json, running_server

    with running_server(tiny_pipe, tmp_path, idle_timeout_s=1.0, first_message_timeout_s=1.0) as (url, _):
        async def go(query, sid):
            async with websockets.connect(f"ws://{url}/session/{sid}{query}") as ws:
                await recv_json(ws, 30)
                said = []
                try:
                    while True:  # no parameters sent
                        said.append(await recv_json(ws, 30))
                except websockets.exceptions.ConnectionClosed as exc:
                    return said, exc.rcvd.code
        async def both():  # at once: each waits out its own timeout
            return await asyncio.gather(go("?sdvg=1", "idle1"), go("", "idle2"))

        (said, code), (plain_said, plain_code) = asyncio.run(both())
    assert len(said) == 1 and said[0]["status"] == "error" and "no parameters" in said[0]["error"] and code == 1000
    assert plain_said == [] and plain_code == 1000  # a plain client: the close alone (Krea has no such message)


def test_a_blend_and_a_seed_take_the_options_bounds():
    """interp_steps and seed are bounded by the options' own limits (sdvg/options.py), not a copy of them."""
    from sdvg.options import MAX_INTERP_BLOCKS, SEED_MAX

    assert parse_update({"prompt": "a", "interp_steps": MAX_INTERP_BLOCKS}).interp_steps == MAX_INTERP_BLOCKS
    assert parse_update({"seed": SEED_MAX}).seed == SEED_MAX
    for field, value in (("interp_steps", MAX_INTERP_BLOCKS + 1), ("interpolation_steps", 0), ("seed", SEED_MAX + 1)):
        with pytest.raises(ProtocolError) as err:
            parse_update({"prompt": "a", field: value})
        assert err.value.field == field
