"""Off-loopback access for pages: the token from a file or the environment (never argv alone), a browser's cookie
from `GET /?token=`, no token in any log line, --cors-origin, and --static-dir serving the operator's own page."""
from __future__ import annotations

import asyncio
import http.client
import logging
import os

import pytest

pytest.importorskip("fastapi")
websockets = pytest.importorskip("websockets")

from serve_harness import running_server, tiny_mp4, upload  # noqa: E402

from sdvg.serve.security import BindError, cookie_value, resolve_token  # noqa: E402

TOKEN = "s3cret-token-for-tests-0123"


def request(url, method, path, headers=None, body=None):
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def test_the_token_comes_from_a_file_or_the_environment(tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    assert resolve_token(None, str(f), {}) == TOKEN
    assert resolve_token(None, None, {"SDVG_SERVE_TOKEN": TOKEN}) == TOKEN
    assert resolve_token(None, str(f), {"SDVG_SERVE_TOKEN": "other-token-other-token"}) == TOKEN  # the file wins
    assert resolve_token(TOKEN, None, {}) == TOKEN and resolve_token(None, None, {}) is None
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "big").write_bytes(b"x" * 5000)
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    for args, words in (((TOKEN, str(f)), "one way"), ((None, str(tmp_path / "none")), "cannot be read"),
                        ((None, str(tmp_path / "empty")), "empty"), ((None, str(tmp_path / "big")), "4096 bytes"),
                        ((None, str(tmp_path / "bin")), "not UTF-8")):
        with pytest.raises(BindError, match=words):
            resolve_token(*args, {})


def test_serve_takes_the_token_file_and_refuses_a_public_bind_without_one(tmp_path, monkeypatch, capsys):
    import sdvg.serve.app
    import sdvg.serve.server
    from sdvg.cli.main import main

    f = tmp_path / "token"
    f.write_text(TOKEN)
    seen = {}
    monkeypatch.setattr(sdvg.serve.app, "create_app", lambda pipe, cfg, defaults: seen.setdefault("cfg", cfg))
    monkeypatch.setattr(sdvg.serve.server, "serve", lambda app, cfg, log_level, sock: None)
    monkeypatch.delenv("SDVG_SERVE_TOKEN", raising=False)
    assert main(["serve", "--preset", "tiny", "--host", "127.0.0.2", "--port", "0", "--token-file", str(f),
                 "--quiet"], load_pipeline=lambda args: object()) == 0
    assert seen["cfg"].token == TOKEN
    assert main(["serve", "--preset", "tiny", "--host", "127.0.0.2", "--port", "0", "--quiet"],
                load_pipeline=lambda args: pytest.fail("no model may load")) == 2
    assert "--token-file FILE or the SDVG_SERVE_TOKEN environment variable" in capsys.readouterr().err
    monkeypatch.setenv("SDVG_SERVE_TOKEN", TOKEN)
    seen.clear()
    assert main(["serve", "--preset", "tiny", "--host", "127.0.0.2", "--port", "0", "--quiet"],
                load_pipeline=lambda args: object()) == 0
    assert seen["cfg"].token == TOKEN
    for bad in (["--cors-origin", "*"], ["--cors-origin", "https://a.example/path"], ["--static-dir", str(tmp_path)]):
        assert main(["serve", "--preset", "tiny", "--port", "0", "--quiet", *bad],
                    load_pipeline=lambda args: pytest.fail("no model may load")) == 2
    err = capsys.readouterr().err
    assert "'*' is not taken" in err and "scheme://host[:port]" in err and "no index.html" in err


def test_a_browser_shows_the_token_once_and_its_cookie_opens_the_socket_and_uploads(tiny_pipe, tmp_path):
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    with running_server(tiny_pipe, tmp_path, host="127.0.0.2", token=TOKEN) as (url, _):
        status, headers, _ = request(url, "GET", f"/?token={TOKEN}")
        cookie = headers["set-cookie"]
        assert status == 303 and headers["location"] == "/" and headers["cache-control"] == "no-store"
        assert cookie.startswith(f"sdvg_token={cookie_value(TOKEN)};") and TOKEN not in cookie
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
        jar = {"Cookie": f"sdvg_token={cookie_value(TOKEN)}"}
        assert request(url, "GET", "/", jar)[0] == 200
        assert request(url, "GET", "/", {"Cookie": f"sdvg_token={TOKEN}"})[0] == 401  # the token is no cookie
        # another site: refused by the Origin rule before the cookie is read
        assert request(url, "GET", "/metrics", {**jar, "Origin": "https://evil.example"})[0] == 403
        assert request(url, "GET", "/metrics", {**jar, "Origin": f"http://{url}"})[0] == 200
        assert request(url, "GET", "/", {"Cookie": "sdvg_token=nope"})[0] == 401

        async def ws(headers):
            try:
                async with websockets.connect(f"ws://{url}/session/cookie1", additional_headers=headers) as w:
                    return (__import__("json").loads(await asyncio.wait_for(w.recv(), 30)))["status"]
            except websockets.exceptions.InvalidStatus as exc:
                return exc.response.status_code

        assert asyncio.run(ws(jar)) == "ready"
        assert asyncio.run(ws({**jar, "Origin": "https://evil.example"})) == 403
        assert asyncio.run(ws({})) == 403
        boundary = "b0undary"
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.png\"\r\n"
                "Content-Type: image/png\r\n\r\n").encode() + png.getvalue() + f"\r\n--{boundary}--\r\n".encode()
        form = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
        assert request(url, "POST", "/upload_start_frame", {**jar, **form}, body)[0] == 200
        assert request(url, "POST", "/upload_start_frame", form, body)[0] == 401


def test_no_token_reaches_a_log_line(tiny_pipe, tmp_path):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    keep = Keep()
    loggers = [logging.getLogger(n) for n in ("uvicorn.access", "uvicorn.error", "sdvg.serve")]
    try:
        with running_server(tiny_pipe, tmp_path, host="127.0.0.2", token=TOKEN, log_level="info") as (url, _):
            for logger in loggers:  # after uvicorn configured its loggers (it drops their handlers)
                logger.addHandler(keep)
            request(url, "GET", f"/?token={TOKEN}")
            request(url, "GET", f"/metrics?token={TOKEN}&x=1")
            request(url, "GET", f"/?token={TOKEN}x")  # a wrong one is not written either

            async def ws():
                async with websockets.connect(f"ws://{url}/session/logs1?token={TOKEN}") as w:
                    await asyncio.wait_for(w.recv(), 30)

            asyncio.run(ws())
    finally:
        for logger in loggers:
            logger.removeHandler(keep)
    text = "\n".join(records)
    assert "token=<redacted>" in text and "/metrics?token=<redacted>&x=1" in text, text
    assert TOKEN not in text


def test_cors_origins_are_the_ones_given(tiny_pipe, tmp_path):
    allowed = "https://studio.example"
    with running_server(tiny_pipe, tmp_path, cors_origins=(allowed,)) as (url, _):
        preflight = {"Origin": allowed, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization"}
        status, headers, _ = request(url, "OPTIONS", "/upload_video", preflight)
        assert status == 200 and headers["access-control-allow-origin"] == allowed
        # not named: the Origin rule refuses it first
        assert request(url, "OPTIONS", "/upload_video", {**preflight, "Origin": "https://other.example"})[0] == 403
        status, headers, _ = request(url, "GET", "/health", {"Origin": allowed})
        assert status == 200 and headers["access-control-allow-origin"] == allowed
        assert "access-control-allow-origin" not in request(url, "GET", "/health", {"Origin": "https://o.example"})[1]
    with running_server(tiny_pipe, tmp_path / "none") as (url, _):  # none given: no CORS header at all
        assert "access-control-allow-origin" not in request(url, "GET", "/health", {"Origin": allowed})[1]


def test_static_dir_serves_the_operators_page_read_only(tiny_pipe, tmp_path):
    site = tmp_path / "site"
    (site / "sub").mkdir(parents=True)
    (site / "index.html").write_text("<html>my page</html>")
    (site / "app.js").write_text("console.log(1)")
    (site / "sub" / "a.css").write_text("body{}")
    (site / ".secret").write_text("no")
    (site / ".git").mkdir()
    (site / ".git" / "config").write_text("no")
    (tmp_path / "outside.txt").write_text("no")
    os.symlink(tmp_path / "outside.txt", site / "link.txt")
    os.symlink(site / ".secret", site / "inside-link")
    with running_server(tiny_pipe, tmp_path / "server", static_dir=str(site)) as (url, _):
        status, headers, body = request(url, "GET", "/")
        assert status == 200 and body == b"<html>my page</html>" and headers["content-type"].startswith("text/html")
        status, headers, body = request(url, "GET", "/app.js")
        assert status == 200 and body == b"console.log(1)" and "javascript" in headers["content-type"]
        assert request(url, "GET", "/sub/a.css")[0] == 200
        for path in ("/.secret", "/.git/config", "/sub", "/sub/", "/link.txt", "/inside-link", "/../outside.txt",
                     "/%2e%2e/outside.txt", "/sub/..%2f..%2foutside.txt", "/static/app.js", "/nothing"):
            assert request(url, "GET", path)[0] == 404, path
        assert request(url, "POST", "/app.js")[0] == 405
        assert request(url, "GET", "/health")[0] == 200 and request(url, "GET", "/metrics")[0] == 200
        assert upload(url, "/upload_video", tiny_mp4())[0] == 200  # routes still first
