"""Load on `sdvg serve`: N concurrent sessions on loopback, a bounded count and time.

    python benchmarks/serve_load.py --preset tiny --sessions 1 4 8 --num-blocks 3 --out results/serve-load-tiny

For each N, one real server (uvicorn on 127.0.0.1, a free port, the same pipeline loaded once) and N
websocket clients (the `websockets` library, `?sdvg=1`) that start together, each one generation of
--num-blocks blocks. Per session it records when its parameters went out, when each block's frames
and `stats` message arrived, and the server's dropped-frame count. Reported per N:

  ttff_s            parameters sent -> first frame received (p50, max over sessions)
  inter_block_s     interval between consecutive blocks of one session (p50 / p95 / p99 over all)
  jitter_s          |change| of that interval from one block to the next (p50 / p95 / p99)
  dropped_frames    frames the server dropped from full send buffers (slow clients)
  frames_per_s      every session's frames / the wall time of the round

Sessions are interleaved block by block by one worker, so with N sessions each one's inter-block
interval is about N block times: the figures show the fairness and the overhead, not a speed-up.
Writes results.json and results.md into --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_session(url: str, sid: str, prompt: str, num_blocks: int, seed: int, timeout: float) -> dict:
    import msgpack
    import websockets

    rec = {"blocks": [], "frames": 0, "dropped": 0}
    async with websockets.connect(f"ws://{url}/session/{sid}?sdvg=1", max_size=2**26) as ws:
        json.loads(await asyncio.wait_for(ws.recv(), 30))  # ready
        rec["t_params"] = time.perf_counter()
        await ws.send(msgpack.packb({"prompt": prompt, "num_blocks": num_blocks, "seed": seed}))
        while True:
            m = await asyncio.wait_for(ws.recv(), timeout)
            now = time.perf_counter()
            if isinstance(m, bytes):
                rec["frames"] += 1
                rec.setdefault("t_first_frame", now)
                continue
            msg = json.loads(m)
            if msg["status"] == "stats":
                rec["blocks"].append({"t": now, "decision": msg["decision"], "latency_s": msg["latency_s"]})
                rec["dropped"] = msg["dropped_frames"]
            elif msg["status"] == "completed":
                rec["t_done"] = now
                return rec
            elif msg["status"] == "error":
                raise RuntimeError(f"{sid}: {msg['error']}")


def pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarise(recs: list[dict], wall: float) -> dict:
    ttff = [r["t_first_frame"] - r["t_params"] for r in recs]
    intervals, jitter = [], []
    for r in recs:
        t = [b["t"] for b in r["blocks"]]
        d = np.diff(t).tolist()
        intervals += d
        jitter += np.abs(np.diff(d)).tolist()
    return {"sessions": len(recs), "completed": sum("t_done" in r for r in recs),
            "frames": sum(r["frames"] for r in recs), "wall_s": wall,
            "frames_per_s": sum(r["frames"] for r in recs) / wall,
            "ttff_s": {"p50": pct(ttff, 50), "max": max(ttff)},
            "inter_block_s": {"p50": pct(intervals, 50), "p95": pct(intervals, 95), "p99": pct(intervals, 99)},
            "jitter_s": {"p50": pct(jitter, 50), "p95": pct(jitter, 95), "p99": pct(jitter, 99)},
            "worker_block_s": {"p50": pct([b["latency_s"] for r in recs for b in r["blocks"]], 50)},
            "dropped_frames": sum(r["dropped"] for r in recs),
            "decisions": {d: sum(b["decision"] == d for r in recs for b in r["blocks"])
                          for d in ("forced", "accepted", "rejected")}}


@contextmanager
def served(pipe, cfg):
    """`pipe` served by sdvg's app under `cfg` (uvicorn in a thread, on cfg's port) until the block ends; yields
    the app. Used by the serve benchmarks (serve_loop_lag.py too)."""
    from sdvg.serve.app import create_app
    from sdvg.serve.server import DrainingServer, uvicorn_config

    app = create_app(pipe, cfg)
    server = DrainingServer(uvicorn_config(app, cfg))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield app
    finally:
        server.should_exit = True
        thread.join(60)


def run_round(pipe, n: int, args) -> dict:
    from sdvg.serve.config import ServeConfig

    cfg = ServeConfig(port=free_port(), max_sessions=max(n, 1), max_queue=0)
    url = f"127.0.0.1:{cfg.port}"

    async def go():
        return await asyncio.gather(*[one_session(url, f"load{n}-{i}", args.prompt, args.num_blocks, i,
                                                  args.timeout) for i in range(n)])

    with served(pipe, cfg):
        t0 = time.perf_counter()
        recs = asyncio.run(go())
        wall = time.perf_counter() - t0
    return summarise(recs, wall)


def markdown(results: dict) -> str:
    rows = ["| sessions | completed | frames | wall s | frames/s | TTFF p50 / max s | inter-block p50 / p95 / p99 s "
            "| jitter p50 / p95 / p99 s | worker block p50 s | dropped |", "|" + "---|" * 10]
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for r in results["rounds"]:
        ib, jt = r["inter_block_s"], r["jitter_s"]
        rows.append(f"| {r['sessions']} | {r['completed']} | {r['frames']} | {r['wall_s']:.1f} "
                    f"| {r['frames_per_s']:.2f} | {f(r['ttff_s']['p50'])} / {f(r['ttff_s']['max'])} "
                    f"| {f(ib['p50'])} / {f(ib['p95'])} / {f(ib['p99'])} "
                    f"| {f(jt['p50'])} / {f(jt['p95'])} / {f(jt['p99'])} "
                    f"| {f(r['worker_block_s']['p50'])} | {r['dropped_frames']} |")
    return "\n".join(rows) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--num-blocks", type=int, default=3)
    p.add_argument("--prompt", default="a red fox running through fresh snow")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any one message may take")
    p.add_argument("--out", default="results/serve-load-tiny")
    args = p.parse_args()
    if max(args.sessions) > 32 or args.num_blocks > 32:
        p.error("bounded: at most 32 sessions and 32 blocks")
    from sdvg import SpeculativeVideoPipeline

    import torch

    pipe = SpeculativeVideoPipeline.from_preset(args.preset)
    rounds = [run_round(pipe, n, args) for n in args.sessions]
    results = {"preset": args.preset, "num_blocks": args.num_blocks, "machine": platform.machine(),
               "cpu_threads": torch.get_num_threads(), "python": platform.python_version(), "rounds": rounds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
