"""Playback of sdvg's page (`sdvg serve`'s `GET /`) in headless Chromium: the rate it achieves and how even it is.

    python benchmarks/page_playback.py --preset tiny --num-blocks 6 --runs 3 --out results/page-playback-tiny

One real server on 127.0.0.1 (a free port, the pipeline loaded once) and Debian's `chromium` driven over the
DevTools protocol; each run presses Start with --num-blocks blocks and waits until every frame received has
been drawn (a bounded time, --timeout-s). The page paces playback at the video's frame rate from a jitter
buffer (docs/server.md, "The page"); every repaint of its canvas is timed in the page. Reported per run:

  frames_received / frames_drawn   every frame received is drawn once
  achieved_fps                     the page's own figure: (drawn - 1) / (last draw - first draw)
  interval_ms p50 / p95 / max      between consecutive repaints (62.5 ms at 16 fps on average; a 60 Hz display's
                                   animation frames make them 50 or 66.7 ms each)
  max_draws_per_animation_frame    1: never a block in one burst
  underruns                        the buffer ran dry mid-run (generation slower than playback)

Writes results.json and results.md into --out.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DevTools:
    def __init__(self, ws):
        self.ws, self.ids = ws, itertools.count(1)

    async def js(self, expression: str):
        i = next(self.ids)
        await self.ws.send(json.dumps({"id": i, "method": "Runtime.evaluate",
                                       "params": {"expression": expression, "returnByValue": True,
                                                  "awaitPromise": True}}))
        while True:
            msg = json.loads(await asyncio.wait_for(self.ws.recv(), 60))
            if msg.get("id") == i:
                result = msg["result"]
                if "exceptionDetails" in result:
                    raise RuntimeError(result["exceptionDetails"])
                return result["result"].get("value")

    async def until(self, expression: str, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.js(expression):
                return
            await asyncio.sleep(0.25)
        raise TimeoutError(f"timed out waiting for {expression}")


async def measure(debugger_url: str, args) -> list[dict]:
    import websockets

    data = "document.body.dataset"
    async with websockets.connect(debugger_url, max_size=2**27) as ws:
        dt = DevTools(ws)
        await dt.until("document.readyState === 'complete' && !!document.getElementById('start')", 60)
        await dt.js("window.paints = []; const draw = CanvasRenderingContext2D.prototype.drawImage;"
                    "CanvasRenderingContext2D.prototype.drawImage = function (...a) {"
                    "  if (this.canvas.id === 'canvas') window.paints.push(performance.now());"
                    "  return draw.apply(this, a); }; true")
        runs = []
        for run in range(args.runs):
            await dt.js(f"window.paints = []; document.getElementById('numBlocks').value = '{args.num_blocks}';"
                        f"document.getElementById('seed').value = '{run}';"
                        "document.getElementById('start').click(); true")
            want = 9 + 12 * (args.num_blocks - 1)  # every preset: 9 frames in block 0, 12 in each later one
            await dt.until(f"Number({data}.framesReceived) >= {want} || !!{data}.lastError", args.timeout_s)
            await dt.until(f"Number({data}.framesDrawn) >= Number({data}.framesReceived) || !!{data}.lastError",
                           args.timeout_s)
            paints = np.array(await dt.js("window.paints"))
            gaps = np.diff(paints) if len(paints) > 1 else np.zeros(1)
            runs.append({"frames_received": int(await dt.js(f"Number({data}.framesReceived)")),
                         "frames_drawn": int(await dt.js(f"Number({data}.framesDrawn)")),
                         "achieved_fps": float(await dt.js(f"Number({data}.achievedFps)")),
                         "interval_ms": {"p50": float(np.percentile(gaps, 50)), "p95": float(np.percentile(gaps, 95)),
                                         "max": float(gaps.max())},
                         "max_draws_per_animation_frame": int(await dt.js(f"Number({data}.maxDrawsPerTick)")),
                         "underruns": int(await dt.js("Number(document.body.dataset.underruns || 0)")),
                         "error": await dt.js(f"{data}.lastError || null")})
        return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--num-blocks", type=int, default=6)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("error: Debian's chromium is needed: apt-get install -y chromium", file=sys.stderr)
        return 2
    from sdvg import SpeculativeVideoPipeline
    from sdvg.serve.app import create_app
    from sdvg.serve.config import ServeConfig
    from sdvg.serve.server import DrainingServer, uvicorn_config

    pipe = SpeculativeVideoPipeline.from_preset(args.preset)
    with tempfile.TemporaryDirectory(prefix="sdvg-page-playback-") as tmp:
        cfg = ServeConfig(port=free_port(), video_dir=tmp)
        server = DrainingServer(uvicorn_config(create_app(pipe, cfg), cfg))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        cdp = free_port()
        browser = subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                    "--disable-background-networking", f"--user-data-dir={tmp}/profile",
                                    f"--remote-debugging-port={cdp}", f"http://127.0.0.1:{cfg.port}/"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{cdp}/json/list", timeout=5) as r:
                        pages = [t for t in json.loads(r.read()) if t["type"] == "page"]
                    if pages:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("chromium did not start")
                time.sleep(0.5)
            runs = asyncio.run(measure(pages[0]["webSocketDebuggerUrl"], args))
        finally:
            browser.terminate()
            browser.wait(30)
            server.should_exit = True
            thread.join(60)
    out = {"preset": args.preset, "num_blocks": args.num_blocks, "video_fps": cfg.fps, "runs": runs,
           "host": platform.node(), "machine": platform.machine()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# Page playback, preset {args.preset}, {args.num_blocks} blocks, video {cfg.fps:g} fps", "",
             "| run | received | drawn | achieved fps | interval p50 / p95 / max ms | max draws per frame | underruns |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs):
        iv = r["interval_ms"]
        lines.append(f"| {i} | {r['frames_received']} | {r['frames_drawn']} | {r['achieved_fps']:.2f} | "
                     f"{iv['p50']:.1f} / {iv['p95']:.1f} / {iv['max']:.1f} | {r['max_draws_per_animation_frame']} | "
                     f"{r['underruns']} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["frames_drawn"] == r["frames_received"] and not r["error"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
