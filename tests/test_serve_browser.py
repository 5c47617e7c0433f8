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
from contextlib import contextmanager
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


NEEDS_CHROMIUM = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs "
                                                             "it: apt-get install -y chromium)")


@contextmanager
def chromium(url: str, tmp_path: Path):
    """Headless Chromium on `url` (fake camera allowed); yields its page's DevTools websocket URL."""
    port = free_port()
    browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                                "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
                                "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
                                f"--remote-debugging-port={port}", "--window-size=900,1000",
                                url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
        yield pages[0]["webSocketDebuggerUrl"]
    finally:
        browser.terminate()
        browser.wait(30)


@pytest.mark.slow
@NEEDS_CHROMIUM
def test_page_in_headless_chromium(tiny_pipe, tmp_path):
    with running_server(tiny_pipe, tmp_path / "server") as (url, app), chromium(f"http://{url}/", tmp_path) as page:
        # the page's first session waits after block 0 for its mid-stream update (it cannot end before the click)
        with block_gate(app) as gate:
            shot = asyncio.run(drive(page, tmp_path))
        assert not gate.timed_out and gate.seen >= 1
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
        said = await dt.js("$status()")  # Krea's blend: the acked block at weight 0, the next one blends in
        assert said == (f"the new prompt blends in from block {int(block) + 1} (block {block} at weight 0.00), "
                        f"whole from block {int(block) + 1}"), said
        assert await dt.js("!document.getElementById('notice').hidden && "
                           "document.getElementById('notice').textContent.includes('random weights')")
        assert await dt.js("!!document.querySelector('meta[name=viewport]')")
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


@pytest.mark.slow
@NEEDS_CHROMIUM
def test_page_paces_playback_recovers_resets_and_downloads(tiny_pipe, tmp_path):
    """The player draws one frame per frame interval of its clock (replaced here by one the test moves), never a
    block at once, every frame received drawn once; a refused start (empty prompt, too many blocks) leaves the page
    ready to start again; Reset clears the run and restarts it; Stop keeps Download open; a video upload drives a
    session; the achieved rate on the real clock is the video's."""
    clip = tmp_path / "clip.mp4"
    write_clip(clip)
    with running_server(tiny_pipe, tmp_path / "server", max_blocks=64) as (url, _), \
            chromium(f"http://{url}/", tmp_path) as page:
        result = asyncio.run(drive_playback(page, base64.b64encode(clip.read_bytes()).decode()))
    assert result["real_fps"] == pytest.approx(16, abs=1.0), result
    print(f"achieved playback: {result['real_fps']} fps over {result['real_frames']} frames (video: 16 fps)")


def write_clip(path: Path, frames: int = 21) -> None:
    import imageio_ffmpeg
    import numpy as np

    writer = imageio_ffmpeg.write_frames(str(path), (80, 48), fps=16, quality=None, output_params=["-crf", "0"],
                                         macro_block_size=1)
    writer.send(None)
    rng = np.random.default_rng(3)
    for _ in range(frames):
        writer.send(rng.integers(0, 256, size=(48, 80, 3), dtype=np.uint8).tobytes())
    writer.close()


async def drive_playback(debugger_url: str, clip_b64: str) -> dict:
    async with websockets.connect(debugger_url, max_size=2**27) as ws:
        dt = DevTools(ws)
        await dt.until("document.readyState === 'complete' && !!document.getElementById('start')", 60)
        await dt.js("window.$status = () => document.getElementById('status').textContent; true")
        data = "document.body.dataset"
        # refused starts: the page is ready to start again (Start on, Apply and Reset off), nothing drawn
        for prompt, blocks, words in (("   ", 1, "prompt"), ("a fox", 500, "num_blocks")):
            await dt.js(f"document.getElementById('prompt').value = {json.dumps(prompt)};"
                        f"document.getElementById('numBlocks').value = '{blocks}';"
                        "document.getElementById('start').click(); true")
            error = await dt.until(f"{data}.lastError || ''", 60)
            assert error.startswith(words), error
            await dt.until("!document.getElementById('start').disabled", 30)
            assert (await dt.js("$status()")).startswith("refused: " + words)
            assert await dt.js("document.getElementById('apply').disabled && document.getElementById('reset').disabled"
                               " && document.getElementById('stop').disabled")
        # paced playback on a clock the test moves: every repaint of the canvas counted
        await dt.js("window.fakeNow = 0; window.sdvgClock = () => window.fakeNow; window.repaints = 0;"
                    "const draw = CanvasRenderingContext2D.prototype.drawImage;"
                    "CanvasRenderingContext2D.prototype.drawImage = function (...a) {"
                    "  if (this.canvas.id === 'canvas') window.repaints += 1; return draw.apply(this, a); }; true")
        await dt.js("document.getElementById('prompt').value = 'a lighthouse at dusk';"
                    "document.getElementById('numBlocks').value = '2';"
                    "document.getElementById('start').click(); true")
        await dt.until("document.getElementById('status').textContent === 'completed'")
        await dt.until(f"Number({data}.framesReceived) === 21 && "
                       "Number(document.getElementById('buffered').textContent) === 20", 60)
        frames = []
        for step in range(30):  # the clock moves one frame interval (62.5 ms) at a time, then 5 at once
            await dt.js(f"window.fakeNow += {62.5 * (5 if step % 7 == 6 else 1)}; true")
            await dt.js("new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))")
            frames.append(await dt.js("window.repaints"))
        assert frames[:20] == list(range(2, 22)), frames  # one repaint per interval, the first on arrival
        assert frames[-1] == 21 and await dt.js(f"Number({data}.maxDrawsPerTick)") == 1
        assert await dt.js(f"Number({data}.framesDrawn)") == 21
        # Reset: the run restarts at block 0, the page's counters and blocks cleared first
        await dt.js("window.sdvgClock = () => performance.now(); document.getElementById('numBlocks').value = '3';"
                    "true")
        await dt.js("document.getElementById('reset').click(); true")
        await dt.until(f"({data}.lastAck || '') === 'action:0'", 60)
        await dt.until("document.getElementById('status').textContent === 'completed'")
        await dt.until(f"Number({data}.framesDrawn) === 21", 60)
        assert await dt.js("document.querySelectorAll('#blocks div').length") == 2
        # Stop mid-run: Download stays open and gives the video so far
        await dt.js("document.getElementById('numBlocks').value = '60'; document.getElementById('start').click(); true")
        await dt.until(f"Number({data}.framesReceived || 0) >= 9", 120)
        await dt.js("document.getElementById('stop').click(); true")
        await dt.until("!document.getElementById('download').disabled && !document.getElementById('start').disabled", 60)
        await dt.js("document.getElementById('download').click(); true")
        assert await dt.until(f"Number({data}.downloadedBytes || 0)", 60) > 1000
        # a video upload drives a session (video-to-video at the strength slider's 0.6)
        await dt.js("(async () => { const b = Uint8Array.from(atob(" + json.dumps(clip_b64) + "), c => c.charCodeAt(0));"
                    "const t = new DataTransfer(); t.items.add(new File([b], 'clip.mp4', {type: 'video/mp4'}));"
                    "document.getElementById('inputVideo').files = t.files; })()")
        await dt.js(f"delete {data}.lastError; document.getElementById('numBlocks').value = '9';"
                    "document.getElementById('start').click(); true")
        await dt.until("document.getElementById('status').textContent === 'completed' || "
                       f"!!{data}.lastError", 120)
        assert not await dt.js(f"{data}.lastError || ''")
        assert await dt.js(f"Number({data}.strength)") == 0.6
        await dt.until(f"Number({data}.framesDrawn) === 21", 60)  # the clip covers 2 blocks
        # the real clock: a longer run, frames arriving faster than they play
        await dt.js("document.getElementById('inputVideo').value = ''; document.getElementById('numBlocks').value = '6';"
                    "document.getElementById('start').click(); true")
        await dt.until("document.getElementById('status').textContent === 'completed'", 120)
        await dt.until(f"Number({data}.framesDrawn) === 9 + 12 * 5", 60)
        return {"real_fps": float(await dt.js(f"{data}.achievedFps")), "real_frames": 9 + 12 * 5}
