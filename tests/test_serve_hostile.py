"""`sdvg serve` against hostile clients (docs/server.md, "Security"): a page on another site cannot drive it (Origin),
DNS rebinding cannot reach it under another name (Host), a message cannot stall it (msgpack limits), every refused
message counts against one budget per socket, and each refusal is counted in /metrics by reason. Loopback only,
every wait bounded."""
from __future__ import annotations

import asyncio
import http.client
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
