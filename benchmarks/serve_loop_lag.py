"""How long one hostile message holds `sdvg serve`'s event loop (every socket waits while it does).

    python benchmarks/serve_loop_lag.py --preset tiny --out results/serve-loop-lag-tiny

One real server (uvicorn on 127.0.0.1, a free port, `tiny` loaded once). For each case, a fresh socket sends the
message a bounded number of times (--repeats) while a probe on another socket-free timer measures how late the
loop wakes; the case's figure is the server's own `sdvg_serve_event_loop_lag_max_seconds` after it (reset per
case by a fresh server) and the client-side round trip of `GET /health` sent right after the message. Cases:
an 850k-key msgpack map (7.5 MB, refused by the decoder's limits), a 50-deep nested list, 8 MB of garbage bytes,
a 5.6 MB base64 string where a prompt goes, and a plain valid update (the baseline). Goal (docs/server.md):
under 0.1 s each. Writes results.json and results.md into --out.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from serve_load import free_port, served  # noqa: E402 (benchmarks/ is this script's folder)


def cases() -> dict[str, bytes]:
    import msgpack

    return {
        "valid parameters (baseline)": msgpack.packb({"prompt": "a fox", "num_blocks": 1, "seed": 1}),
        "850k-key map (7.5 MB)": msgpack.packb({f"k{i}": 0 for i in range(850_000)}),
        "50-deep nested list": b"\x91" * 50 + b"\x01",
        "8 MB garbage": b"\xc1" + bytes(8 * 2**20 - 64),
        "5.6 MB string as prompt": msgpack.packb({"prompt": "A" * (5_600_000)}),
    }


def metric(port: int, name: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def health_s(port: int) -> float:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    conn.getresponse().read()
    conn.close()
    return time.perf_counter() - t0


def one_case(pipe, message: bytes, repeats: int) -> dict:
    import websockets

    from sdvg.serve.config import ServeConfig

    cfg = ServeConfig(port=free_port())
    healths = []
    with served(pipe, cfg):
        time.sleep(0.5)  # the lag watcher's first samples

        async def go():
            async with websockets.connect(f"ws://127.0.0.1:{cfg.port}/session/lag?sdvg=1", max_size=2**26) as ws:
                await asyncio.wait_for(ws.recv(), 30)  # ready
                for _ in range(repeats):
                    await ws.send(message)
                    healths.append(await asyncio.to_thread(health_s, cfg.port))
                    await asyncio.wait_for(ws.recv(), 60)  # the reply (an error, or params)

        asyncio.run(go())
        time.sleep(0.3)
        lag = metric(cfg.port, "sdvg_serve_event_loop_lag_max_seconds")
    return {"bytes": len(message), "repeats": repeats, "loop_lag_max_s": lag, "health_max_s": max(healths)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/serve-loop-lag-tiny")
    args = ap.parse_args()
    from sdvg import SpeculativeVideoPipeline

    pipe = SpeculativeVideoPipeline.from_preset(args.preset, seed=0)
    rows = {name: one_case(pipe, message, args.repeats) for name, message in cases().items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"preset": args.preset, "machine": platform.platform(), "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d"), "goal_s": 0.1, "cases": rows}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Event-loop lag under hostile messages (`benchmarks/serve_loop_lag.py`)", "",
             f"{result['date']}, {result['machine']}, preset {args.preset}, {args.repeats} sends per case; goal: "
             "under 0.1 s", "", "| message | bytes | loop lag max s | /health right after, max s |", "|---|---|---|---|"]
    lines += [f"| {name} | {r['bytes']} | {r['loop_lag_max_s']:.3f} | {r['health_max_s']:.3f} |"
              for name, r in rows.items()]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
