"""A real browser on sdvg serve's page: Debian's headless Chromium, driven over the Chrome DevTools
protocol (its websocket, with the `websockets` library): it starts a session, sees frames drawn and
block decisions listed, changes the prompt, runs a webcam session on Chromium's fake camera, starts a session
from an uploaded start frame, and saves a screenshot."""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
websockets = pytest.importorskip("websockets")

from serve_harness import block_gate, free_port, running_server  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class DevTools:
    def __init__(self, ws):
        self.ws, self.ids = ws, itertools.count(1)

    async def call(self, method: str, **params):
        i = next(self.ids)
        await self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(await asyncio.wait_for(self.ws.recv(), 60))
            if msg.get("id") == i:
                assert "error" not in msg, msg
                return msg["result"]

    async def js(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    async def until(self, expression: str, timeout: float = 240):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = await self.js(expression)
            if value:
                return value
            await asyncio.sleep(0.5)
        raise AssertionError(f"timed out waiting for {expression}; status: {await self.js('$status()')}")


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it: "
                                             "apt-get install -y chromium)")
def test_page_in_headless_chromium(tiny_pipe, tmp_path):
    with running_server(tiny_pipe, tmp_path / "server") as (url, _):
        port = free_port()
        browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                                    "--no-first-run", "--disable-background-networking", "--disable-component-update",
                                    "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
                                    "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
                                    f"--remote-debugging-port={port}", "--window-size=900,1000",
                                    f"http://{url}/"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                        pages = [t for t in json.loads(r.read()) if t["type"] == "page"]
                    if pages:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline and browser.poll() is None, "chromium did not start"
                time.sleep(0.5)
            # the page's first session waits after block 0 for its mid-stream update (it cannot end before the click)
            with block_gate() as gate:
                shot = asyncio.run(drive(pages[0]["webSocketDebuggerUrl"], tmp_path))
            assert not gate.timed_out and gate.seen >= 1
        finally:
            browser.terminate()
            browser.wait(30)
    assert shot.stat().st_size > 1000


async def drive(debugger_url: str, tmp_path: Path) -> Path:
    async with websockets.connect(debugger_url, max_size=2**27) as ws:
        dt = DevTools(ws)
        await dt.until("document.readyState === 'complete' && !!document.getElementById('start')", 60)
        await dt.js("window.$status = () => document.getElementById('status').textContent; true")
        await dt.js("document.getElementById('numBlocks').value = '5';"
                    "document.getElementById('prompt').value = 'a lighthouse at dusk';"
                    "document.getElementById('start').click(); true")
        await dt.until("Number(document.body.dataset.framesDrawn || 0) >= 9")  # block 0 drawn
        await dt.until("document.querySelectorAll('#blocks div').length >= 1")
        # change the prompt mid-stream, blended over 2 blocks: acked at a block, which the block list then shows
        await dt.js("document.getElementById('prompt').value = 'a lighthouse in a storm';"
                    "document.getElementById('blend').value = '2';"
                    "document.getElementById('apply').click(); true")
        ack = await dt.until("document.body.dataset.lastAck || document.body.dataset.lastError || ''", 60)
        field, _, block = ack.partition(":")
        assert field == "prompt" and 1 <= int(block) < 5, ack
        await dt.until("document.getElementById('status').textContent === 'completed'")
        await dt.until("Number(document.body.dataset.framesDrawn) >= 9 + 12 * 4", 60)  # drawn as they decode
        frames = await dt.js("Number(document.body.dataset.framesDrawn)")
        decisions = await dt.js("[...document.querySelectorAll('#blocks div')].map(d => d.dataset.decision)")
        prompts = await dt.js("[...document.querySelectorAll('#blocks div')].map(d => d.dataset.promptIndex)")
        assert frames == 9 + 12 * 4, frames
        assert decisions[0] == "forced" and len(decisions) == 5
        assert prompts == ["0"] * int(block) + ["1"] * (5 - int(block)), (prompts, block)
        assert set(decisions) <= {"forced", "accepted", "rejected"}
        assert await dt.js("!document.getElementById('download').disabled")
        # the canvas holds the last frame (not black)
        lit = await dt.js("(() => { const c = document.getElementById('canvas');"
                          "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
                          "let s = 0; for (let i = 0; i < d.length; i += 4) s += d[i] + d[i+1] + d[i+2];"
                          "return s; })()")
        assert lit > 0
        # Webcam: Chromium's fake camera feeds a live video-to-video session (Krea's webcam_mode, `image` frames)
        await dt.js("delete document.body.dataset.lastError; document.body.dataset.framesDrawn = '0';"
                    "document.getElementById('status').textContent = 'starting';"
                    "document.getElementById('webcam').checked = true;"
                    "document.getElementById('numBlocks').value = '2';"
                    "document.getElementById('start').click(); true")
        await dt.until("document.getElementById('status').textContent === 'completed' || "
                       "!!document.body.dataset.lastError")
        assert not await dt.js("document.body.dataset.lastError || ''")
        assert await dt.js("Number(document.body.dataset.strength)") == 0.6  # a video-to-video session
        await dt.until("Number(document.body.dataset.framesDrawn) >= 9 + 12", 60)
        assert await dt.js("Number(document.body.dataset.framesDrawn)") == 9 + 12
        assert await dt.js("Number(document.body.dataset.webcamFramesSent)") >= 9 + 12  # each block read its own
        assert await dt.js("document.getElementById('camera').srcObject === null")  # the camera is closed after
        # Start frame: a file that is no image is refused by the upload (nothing starts); an 80x48 PNG made in
        # the page is uploaded and the session starts from it (the server's params echo its decoded size)
        chosen = ("(async (bytes, type) => { const input = document.getElementById('startFrame');"
                  "const dt = new DataTransfer(); dt.items.add(new File([await bytes], 'start.png', {type}));"
                  "input.files = dt.files; return input.files.length; })")
        await dt.js("document.getElementById('webcam').checked = false; document.body.dataset.framesDrawn = '0';"
                    "document.getElementById('numBlocks').value = '1'; true")
        assert await dt.js(chosen + "(new Blob(['#!/bin/sh']), 'image/png')") == 1
        await dt.js("document.getElementById('start').click(); true")
        error = await dt.until("document.body.dataset.lastError || ''", 60)
        assert error.startswith("start frame: ") and "not one of" in error, error
        assert await dt.js("!document.getElementById('start').disabled && document.body.dataset.framesDrawn === '0'")
        png = ("new Promise((done) => { const c = document.createElement('canvas'); c.width = 80; c.height = 48;"
               "const g = c.getContext('2d'); g.fillStyle = '#c03020'; g.fillRect(0, 0, 80, 48);"
               "c.toBlob(done, 'image/png'); })")
        assert await dt.js(chosen + f"({png}, 'image/png')") == 1
        await dt.js("delete document.body.dataset.lastError;"
                    "document.getElementById('status').textContent = 'starting';"
                    "document.getElementById('start').click(); true")
        await dt.until("document.getElementById('status').textContent === 'completed' || "
                       "!!document.body.dataset.lastError")
        assert not await dt.js("document.body.dataset.lastError || ''")
        assert await dt.js("document.body.dataset.startFrame") == "80x48"
        await dt.until("Number(document.body.dataset.framesDrawn) >= 9", 60)  # drawn as their bitmaps decode
        await asyncio.sleep(0.5)
        assert await dt.js("Number(document.body.dataset.framesDrawn)") == 9
        png = (await dt.call("Page.captureScreenshot", format="png"))["data"]
        shot = tmp_path / "serve_page.png"
        shot.write_bytes(base64.b64decode(png))
        print(f"screenshot: {shot}")
        return shot
