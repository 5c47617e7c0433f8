"""Load on `sdvg serve`: N concurrent sessions, the `batched` and `round_robin` session schedulers side by side.

    python benchmarks/serve_load.py                  # tiny and cpu-bench, 1, 2, 4, 8 sessions -> results/serve-load-cpu
    python benchmarks/serve_load.py --presets tiny --sessions 1,4 --blocks 3 --out /tmp/serve-load

For each preset the pipeline is built once (random weights, seed 0) and shared: first every session's video is
made alone in-process (`pipe.session(prompt, seed=..., num_blocks=..., scheduler="reference", router="pattern",
pattern=..., kv_cache_frames=3, keep_first_frame=False)`: the options a client's parameters resolve to; computed
once per preset and cached), then for each session count N one round per session scheduler (they take turns
going first, so a load that drifts hits both alike), each on a real server of its own, the only one up
(`create_app(pipe, cfg, defaults)` under uvicorn on 127.0.0.1, a free port, `max_sessions` = the largest session
count, no queue, the default send buffer; the server's default options carry router='pattern', see ROUTER_NOTE), of N
concurrent websocket clients (the `websockets` library, sdvg's superset `?sdvg=1`, `fmt=raw`: the pipeline's
uint8 frames, bitwise). The N clients connect, wait for every `ready`, then each sends its parameters (its own
prompt and seed, --blocks blocks, --pattern) and reads every message as it comes (frames kept as bytes, decoded
after the round) until `completed`.

At the default pattern `1110` (block b takes pattern[b % 4]; block 0 comes from the target anyway) blocks 1, 2
and 4 are accepted and block 3 is rejected: exactly 75% of blocks 1..4 with the default 5 blocks (a cycle of 3
accepts in 4 after block 0; with 4 blocks it would be 2 of 3, so the default is 5). Every session runs the same
pattern, so their rounds stay in step.

Per (preset, scheduler, sessions), in results.json `runs`:

  frames_per_s        every client's frames / seconds (the first parameters sent -> the last frame received)
  ttff_s              median over the sessions of parameters sent -> first frame received (ttff_max_s: the max)
  inter_block_p99_s   p99 over every session's intervals between consecutive blocks' arrivals (a block arrives
                      with its last frame); p50 beside it
  dropped_frames      the sum of the sessions' `dropped_frames` (their last `stats`); the server's own
                      sdvg_serve_dropped_frames_total over the round as dropped_frames_metric
  equal_to_solo       every session completed and its frames equal, bitwise, its video made alone (`mismatch`:
                      per session that is not, the blocks that differ and by how many levels; the batched
                      server's decodes batched, its default, differ by design by up to one level:
                      --no-batch-decode for the bitwise server)
  within_decode_tolerance  (when not bitwise) every frame there and within one uint8 level: batched VAE decodes
  session_fps         per session, its frames / (its parameters sent -> its last frame); session_fps_min the least
  deadline_misses     blocks made after their session's playback (at the server's --fps) had run dry
                      (sdvg_serve_deadline_misses_total over the round); late_s_max the most a block was late
  lane_seconds        the batched worker's model-call seconds by lane (sdvg_serve_lane_seconds_total; drafter,
                      target, vae, reward); lane_busy the same over the run's seconds: each lane's utilisation
  acceptance          each session's last `stats` acceptance (accepted share of blocks 1..)
  round_sessions_mean the batched worker's sessions per round (sdvg_serve_round_sessions; null for round_robin)
  batched_calls       the batched worker's model calls by kind and rows (sdvg_serve_batched_calls_total)

and `speedup`: batched / round_robin frames/s per (preset, sessions), with the goals at 4 sessions (tiny >= 1.5,
cpu-bench >= 1.1) and nothing dropped, reported as measured. Bounded: --time-limit-s for the whole run (rounds
that would start past it are listed under `skipped`; a round in progress is cut by its clients' timeouts), a
--client-timeout-s per client (its whole session) and 30 s for a `ready`; loopback only. results.json and
results.md are rewritten after every round; the provenance (commit, torch, host threads, load average before and
after) as latency.py records it. `main(argv)` returns the results dict (tests/test_benchmarks.py runs it).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sdvg  # noqa: E402,F401 (before torch: OMP_WAIT_POLICY=PASSIVE as `sdvg serve` runs, sdvg/runtime.py)

SCHEDULERS = ("round_robin", "batched")
GOALS = {"tiny": 1.5, "cpu-bench": 1.1}  # batched / round_robin aggregate frames/s at GOAL_SESSIONS sessions
GOAL_SESSIONS = 4
PROMPTS = ("a red fox running through fresh snow", "a lighthouse on a cliff at night, waves crashing",
           "a cat riding a skateboard down a sunny street", "timelapse of clouds over a mountain lake",
           "an astronaut walking on a dusty red plain", "a paper boat drifting along a rainy gutter",
           "a hummingbird hovering over a purple flower", "neon signs reflected in a wet city street at night")
KREA_CONTEXT = {"kv_cache_frames": 3, "keep_first_frame": False}  # what Krea's parameters default to on the wire
READY_TIMEOUT_S = 30.0
ROUTER_NOTE = ("the server's default options carry router='pattern' (as `sdvg serve --router pattern`); the clients "
               "send `pattern`. A client's `router: \"pattern\"` in its parameters is refused (`router 'pattern' needs "
               "a decision pattern`) even with `pattern` in the same message: sdvg/serve/engine.py Engine.spec checks "
               "each option alone first (--router-in-params sends it anyway)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(pipe, cfg, defaults=None):
    """`pipe` served by sdvg's app under `cfg` (uvicorn in a thread, on cfg's port; `defaults`: the server's
    GenerationOptions, as `sdvg serve --router ...` sets them) until the block ends; yields the app. Used by the
    serve benchmarks (serve_loop_lag.py too)."""
    from sdvg.serve.app import create_app
    from sdvg.serve.server import DrainingServer, uvicorn_config

    app = create_app(pipe, cfg, defaults)
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


# --------------------------------------------------------------------------- sessions
def session_params(i: int, blocks: int, pattern: str, router_in_params: bool = False) -> dict:
    """Client i's parameters: its own prompt and seed, the pattern router's decisions (`router: "pattern"` itself
    only with `router_in_params`: the server refuses it there, see ROUTER_NOTE; the server's default gives it)."""
    prompt = PROMPTS[i % len(PROMPTS)] + (f", take {i // len(PROMPTS) + 1}" if i >= len(PROMPTS) else "")
    params = {"prompt": prompt, "seed": 1000 + i, "num_blocks": blocks, "pattern": pattern}
    return {**params, "router": "pattern"} if router_in_params else params


def solo_video(pipe, params: dict) -> tuple[np.ndarray, dict]:
    """The session's video made alone in-process, as the server's options for `params` make it: (uint8 frames
    [T, H, W, 3], seconds per stage summed over its blocks)."""
    session = pipe.session(params["prompt"], seed=params["seed"], num_blocks=params["num_blocks"],
                           scheduler="reference", router="pattern", pattern=params["pattern"], **KREA_CONTEXT)
    try:
        blocks = list(session)
    finally:
        session.close()
    stages = {}
    for b in blocks:
        for k, v in b.times.items():
            if k != "commit":  # drafter_commit + target_commit, counted in those
                stages[k] = stages.get(k, 0.0) + v
    return np.concatenate([b.frames.cpu().numpy() for b in blocks]), stages


async def one_client(url: str, sid: str, params: dict, ready: asyncio.Barrier, timeout: float) -> dict:
    """One session to `completed`: every message's arrival time; frames kept as bytes (decoded after the round,
    so the client reads as fast as the server sends)."""
    import msgpack
    import websockets

    rec = {"id": sid, "frames": [], "stats": [], "errors": []}
    async with websockets.connect(f"ws://{url}/session/{sid}?fmt=raw&sdvg=1", max_size=2**26,
                                  open_timeout=READY_TIMEOUT_S) as ws:
        rec["ready"] = json.loads(await asyncio.wait_for(ws.recv(), READY_TIMEOUT_S))
        await asyncio.wait_for(ready.wait(), READY_TIMEOUT_S)  # every client connected: they start together
        rec["t_params"] = time.perf_counter()
        await ws.send(msgpack.packb(params))
        end = rec["t_params"] + timeout
        while True:
            m = await asyncio.wait_for(ws.recv(), max(0.001, end - time.perf_counter()))
            now = time.perf_counter()
            if isinstance(m, bytes):
                rec["frames"].append((now, m))
                continue
            msg = json.loads(m)
            status = msg.get("status")
            if status == "params":
                rec["options"] = msg["options"]
            elif status == "stats":
                rec["stats"].append({"t": now, "block": msg["block"], "decision": msg["decision"],
                                     "acceptance": msg["acceptance"], "dropped_frames": msg["dropped_frames"],
                                     "latency_s": msg["latency_s"], "late_s": msg.get("late_s")})
            elif status == "error":
                rec["errors"].append(msg)
                if msg.get("field") is not None or any(w in msg.get("error", "") for w in ("failed", "could not start",
                                                                                         "busy")):
                    return rec
            elif status == "completed":
                rec["t_done"] = now
                return rec


def decode(rec: dict) -> dict:
    """The round's bytes -> frames uint8 [T, H, W, 3], per-frame block and frame indices, block arrival times."""
    import msgpack

    frames, blocks, ids, arrived = [], [], [], {}
    for t, m in rec["frames"]:
        d = msgpack.unpackb(m)
        frames.append(np.frombuffer(d["image"], np.uint8).reshape(d["shape"]))
        blocks.append(d["block"])
        ids.append(d["frame"])
        arrived[d["block"]] = t  # a block arrives with its last frame
    return {"frames": np.stack(frames) if frames else None, "blocks": blocks, "frame_ids": ids,
            "block_times": [arrived[b] for b in sorted(arrived)]}


# --------------------------------------------------------------------------- the server's metrics
def scrape(port: int) -> dict[str, float]:
    """GET /metrics as {'name{labels}': value} (samples only)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def metrics_delta(before: dict, after: dict) -> dict:
    diff = {k: v - before.get(k, 0.0) for k, v in after.items()}
    rounds = diff.get("sdvg_serve_round_sessions_count", 0.0)
    calls = {}
    for k, v in diff.items():
        if k.startswith("sdvg_serve_batched_calls_total{") and v:
            labels = dict(part.split("=", 1) for part in k[k.index("{") + 1:-1].split(","))
            calls[f"{labels['kind'].strip(chr(34))} x{labels['rows'].strip(chr(34))}"] = int(v)
    lanes = {k[k.index('"') + 1:k.rindex('"')]: round(v, 4) for k, v in diff.items()
             if k.startswith("sdvg_serve_lane_seconds_total{") and v}
    return {"dropped_frames_metric": int(diff.get("sdvg_serve_dropped_frames_total", 0.0)),
            "deadline_misses": int(diff.get("sdvg_serve_deadline_misses_total", 0.0)),
            "lane_seconds": dict(sorted(lanes.items())) or None,
            "rounds": int(rounds) or None,
            "round_sessions_mean": diff["sdvg_serve_round_sessions_sum"] / rounds if rounds else None,
            "batched_calls": dict(sorted(calls.items())) or None}


# --------------------------------------------------------------------------- one round
def pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def run_round(port: int, preset: str, scheduler: str, n: int, args, solos: dict, limit_at: float) -> dict:
    """N clients at once on the server at `port`; their figures, checked against the solo videos."""
    url = f"127.0.0.1:{port}"
    params = [session_params(i, args.blocks, args.pattern, args.router_in_params) for i in range(n)]
    timeout = max(1.0, min(args.client_timeout_s, limit_at - time.monotonic()))

    async def go():
        ready = asyncio.Barrier(n)
        tasks = [asyncio.wait_for(one_client(url, f"{scheduler}-{n}-{i}", p, ready, timeout),
                                  timeout + READY_TIMEOUT_S) for i, p in enumerate(params)]
        return await asyncio.gather(*tasks, return_exceptions=True)

    before = scrape(port)
    results = asyncio.run(go())
    time.sleep(0.2)  # the last stats and counters
    after = scrape(port)
    recs, failures = [], []
    for i, r in enumerate(results):
        if isinstance(r, BaseException):
            failures.append(f"session {i}: {type(r).__name__}: {r}"[:300])
        else:
            recs.append((i, r))
            failures += [f"session {i}: {e.get('error')}"[:300] for e in r["errors"]]
    decoded = {i: decode(r) for i, r in recs}
    equal = [i for i, r in recs if "t_done" in r and decoded[i]["frames"] is not None
             and np.array_equal(decoded[i]["frames"], solos[i])
             and decoded[i]["frame_ids"] == list(range(len(solos[i])))]
    mismatch = [mismatch_of(i, r, decoded[i], solos[i]) for i, r in recs if i not in equal]
    # batched decodes (the default): every frame there, each within one uint8 level of the solo video's
    within = len(recs) == n and all(m.get("max_abs", 99) <= DECODE_LEVELS and m["frames"] == m["solo_frames"]
                                    and m["completed"] for m in mismatch)
    t_params = [r["t_params"] for _, r in recs]
    t_last = [r["frames"][-1][0] for _, r in recs if r["frames"]]
    seconds = max(t_last) - min(t_params) if t_last else None
    frames = sum(len(r["frames"]) for _, r in recs)
    ttff = [r["frames"][0][0] - r["t_params"] for _, r in recs if r["frames"]]
    intervals = [d for i, _ in recs for d in np.diff(decoded[i]["block_times"]).tolist()]
    last_stats = [r["stats"][-1] for _, r in recs if r["stats"]]
    session_fps = [round(len(r["frames"]) / (r["frames"][-1][0] - r["t_params"]), 3) for _, r in recs if r["frames"]]
    measured = metrics_delta(before, after)
    busy = {lane: round(v / seconds, 3) for lane, v in (measured["lane_seconds"] or {}).items()} if seconds else None
    return {
        "preset": preset, "scheduler": scheduler, "sessions": n, "blocks": args.blocks, "pattern": args.pattern,
        "completed": sum("t_done" in r for _, r in recs), "frames": frames, "seconds": seconds,
        "frames_per_s": frames / seconds if seconds else None,
        "ttff_s": statistics.median(ttff) if ttff else None, "ttff_max_s": max(ttff) if ttff else None,
        "inter_block_p50_s": pct(intervals, 50), "inter_block_p99_s": pct(intervals, 99),
        "session_fps": session_fps,
        "session_fps_min": min(session_fps) if session_fps else None,
        "late_s_max": max((s["late_s"] for _, r in recs for s in r["stats"] if s["late_s"] is not None), default=None),
        "dropped_frames": sum(s["dropped_frames"] for s in last_stats),
        **measured,
        "lane_busy": busy or None,
        "equal_to_solo": len(equal) == n, "sessions_equal_to_solo": len(equal), "mismatch": mismatch,
        "within_decode_tolerance": within,
        "acceptance": sorted({s["acceptance"] for s in last_stats}, key=lambda a: (a is None, a)),
        "decisions": [list(d) for d in sorted({tuple(s["decision"] for s in r["stats"]) for _, r in recs})],
        "worker_block_p50_s": pct([s["latency_s"] for _, r in recs for s in r["stats"]], 50),
        "options_differ": sorted({k for i, r in recs for k in options_differ(r.get("options", {}), params[i])}),
        "failures": failures,
    }


DECODE_LEVELS = 1  # a batched VAE decode's frames: within one uint8 level of the session alone (docs/server.md)


def mismatch_of(i: int, rec: dict, got: dict, solo: np.ndarray) -> dict:
    """How session i's frames differ from its solo video: the first frame and block that differ, the largest
    difference, how many frames differ."""
    out = {"session": i, "completed": "t_done" in rec, "frames": len(got["frame_ids"]), "solo_frames": len(solo)}
    if got["frames"] is not None and got["frames"].shape == solo.shape:
        diff = np.abs(got["frames"].astype(np.int16) - solo.astype(np.int16)).reshape(len(solo), -1).max(axis=1)
        bad = np.flatnonzero(diff)
        if len(bad):
            out.update(first_frame=int(bad[0]), first_block=int(got["blocks"][bad[0]]), frames_differ=len(bad),
                       blocks_differ=sorted({int(got["blocks"][j]) for j in bad}), max_abs=int(diff.max()))
    return out


def options_differ(echoed: dict, params: dict) -> list[str]:
    """The options the server echoed (`params.options`) that differ from the solo run's."""
    want = {"router": "pattern", "pattern": params["pattern"], "seed": params["seed"],
            "num_blocks": params["num_blocks"], "scheduler": "reference", **KREA_CONTEXT}
    return [k for k, v in want.items() if echoed.get(k) != v]


# --------------------------------------------------------------------------- results
def speedups(runs: list[dict]) -> list[dict]:
    out = []
    by = {(r["preset"], r["scheduler"], r["sessions"]): r for r in runs}
    for (preset, sched, n), rr in by.items():
        b = by.get((preset, "batched", n))
        if sched != "round_robin" or b is None or not rr["frames_per_s"] or not b["frames_per_s"]:
            continue
        ratio = b["frames_per_s"] / rr["frames_per_s"]
        goal = GOALS.get(preset) if n == GOAL_SESSIONS else None
        out.append({"preset": preset, "sessions": n, "round_robin_frames_per_s": rr["frames_per_s"],
                    "batched_frames_per_s": b["frames_per_s"], "speedup": ratio, "goal": goal,
                    "goal_met": None if goal is None else ratio >= goal})
    return out


def markdown(results: dict) -> str:
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    prov, host = results["provenance"], results["host"]
    rates = sorted({f"{a:.0%}" for r in results["runs"] for a in r["acceptance"] if a is not None})
    lines = [f"# `sdvg serve` under load: batched vs round_robin ({results['date']})", "",
             f"{results['blocks']} blocks per session, pattern router `{results['pattern']}` (acceptance of blocks "
             f"1..: {', '.join(rates)}; the router from the {results['router_from']}), batched decodes "
             f"{ {True: 'on', False: 'off', None: '(none on this server)'}[results.get('batch_decode')] }"
             f", fmt=raw, sdvg superset; a server of its own per run (the only one up), the pipeline shared; "
             f"torch threads {host['torch_threads']}, {host['cpu_count']} CPUs, OMP_WAIT_POLICY "
             f"{host['omp_wait_policy']}; load average before {host['loadavg_before']}, after "
             f"{host.get('loadavg_after')}", "",
             f"commit `{prov['commit']}`{' (dirty)' if prov['dirty'] else ''}; torch {prov['torch']}; "
             f"{prov['device_name']}; python {prov['python']}"
             + ("" if results.get("commit_after", {}).get("commit") in (None, prov["commit"]) else
                f"; the tree was at `{results['commit_after']['commit']}` when it ended (others committed meanwhile)"),
             "",
             "| preset | scheduler | sessions | completed | frames | seconds | frames/s | least session's frames/s "
             "| TTFF median / max s | inter-block p50 / p99 s | deadline misses | sessions per round | lanes busy "
             "| dropped | equal to solo |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        busy = ", ".join(f"{k} {v:.0%}" for k, v in (r.get("lane_busy") or {}).items()) or "-"
        lines.append(f"| {r['preset']} | {r['scheduler']} | {r['sessions']} | {r['completed']} | {r['frames']} "
                     f"| {f(r['seconds'], 2)} | {f(r['frames_per_s'], 2)} | {f(r.get('session_fps_min'), 2)} "
                     f"| {f(r['ttff_s'])} / {f(r['ttff_max_s'])} "
                     f"| {f(r['inter_block_p50_s'])} / {f(r['inter_block_p99_s'])} | {r.get('deadline_misses', '-')} "
                     f"| {f(r['round_sessions_mean'], 2)} | {busy} | {r['dropped_frames']} | {r['equal_to_solo']} |")
    if results["speedup"]:
        lines += ["", "| preset | sessions | round_robin frames/s | batched frames/s | batched / round_robin | goal |",
                  "|---|---|---|---|---|---|"]
        for s in results["speedup"]:
            goal = "" if s["goal"] is None else f">= {s['goal']}x: {'met' if s['goal_met'] else 'NOT met'}"
            lines.append(f"| {s['preset']} | {s['sessions']} | {s['round_robin_frames_per_s']:.2f} "
                         f"| {s['batched_frames_per_s']:.2f} | {s['speedup']:.2f}x | {goal} |")
    for preset, share in results["solo_stage_share"].items():
        lines += ["", f"{preset} alone (the solo videos), time by stage: "
                  + ", ".join(f"{k} {v:.0%}" for k, v in sorted(share.items(), key=lambda kv: -kv[1]))
                  + " (what the batched worker put together: `batched_calls` in results.json)"]
    dropped = sum(r["dropped_frames"] + r["dropped_frames_metric"] for r in results["runs"])
    lines += ["", f"Dropped frames, every run: {dropped} (goal 0). Equal to solo: "
              f"{sum(r['equal_to_solo'] for r in results['runs'])} of {len(results['runs'])} runs bitwise; the others "
              f"within the batched decode's tolerance (every frame within {DECODE_LEVELS} level): "
              f"{all(r['equal_to_solo'] or r['within_decode_tolerance'] for r in results['runs'])}."]
    unequal = [f"{r['preset']} {r['scheduler']} {r['sessions']}: session {m['session']}: "
               + (f"{m['frames_differ']} of {m['solo_frames']} frames differ (blocks {m['blocks_differ']}), at most "
                  f"{m['max_abs']} levels" if "max_abs" in m else f"{m['frames']} of {m['solo_frames']} frames, "
                  f"completed {m['completed']}") for r in results["runs"] for m in r["mismatch"]]
    if unequal:
        lines += ["", "Not equal to the solo video:", *[f"- {x}" for x in unequal]]
    failures = [f"{r['preset']} {r['scheduler']} {r['sessions']}: {x}" for r in results["runs"] for x in r["failures"]]
    if failures:
        lines += ["", "Failures:", *[f"- {x}" for x in failures]]
    if results["skipped"]:
        lines += ["", "Not run (--time-limit-s): " + ", ".join(results["skipped"])]
    if not results.get("final"):
        lines += ["", "(partial: the benchmark is still running or was stopped)"]
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> None:
    results["speedup"] = speedups(results["runs"])
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(markdown(results))


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="tiny,cpu-bench")
    ap.add_argument("--schedulers", default=",".join(SCHEDULERS))
    ap.add_argument("--sessions", default="1,2,4,8", help="session counts, comma-separated")
    ap.add_argument("--blocks", type=int, default=5, help="blocks per session (5: block 0 + one 4-block cycle)")
    ap.add_argument("--pattern", default="1110", help="the pattern router's decisions (block b: pattern[b %% len])")
    ap.add_argument("--router-in-params", action="store_true",
                    help="clients also send router='pattern' (refused by the server as of this script; ROUTER_NOTE)")
    ap.add_argument("--no-batch-decode", dest="batch_decode", action="store_false",
                    help="the batched server decodes each session alone (`sdvg serve --no-batch-decode`: every session "
                         "bitwise its own; batched decodes differ from alone by at most one level)")
    ap.add_argument("--client-timeout-s", type=float, default=600.0, help="one client's whole session")
    ap.add_argument("--time-limit-s", type=float, default=1800.0, help="the whole run: no round starts after it")
    ap.add_argument("--out", default="results/serve-load-cpu")
    args = ap.parse_args(argv)
    presets = [p for p in args.presets.split(",") if p]
    schedulers = [s for s in args.schedulers.split(",") if s]
    sessions = int_list(args.sessions)
    if not set(schedulers) <= set(SCHEDULERS):
        ap.error(f"--schedulers: choose from {', '.join(SCHEDULERS)}")
    if not sessions or min(sessions) < 1 or max(sessions) > 32 or not 1 <= args.blocks <= 32:
        ap.error("bounded: 1 to 32 sessions, 1 to 32 blocks")

    import torch

    from provenance import commit_of, provenance
    from sdvg import SpeculativeVideoPipeline
    from sdvg.options import GenerationOptions
    from sdvg.serve.config import ServeConfig

    # a server from before batched decodes (ServeConfig without batch_decode) decodes each session alone
    has_switch = "batch_decode" in {f.name for f in dataclasses.fields(ServeConfig)}
    decode = {"batch_decode": args.batch_decode} if has_switch else {}
    t0 = time.monotonic()
    limit_at = t0 + args.time_limit_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"presets": presets, "schedulers": schedulers, "sessions": sessions, "blocks": args.blocks,
               "pattern": args.pattern, "router": "pattern",
               "router_from": "params" if args.router_in_params else "server default", "router_note": ROUTER_NOTE,
               "kv_context": KREA_CONTEXT, "fmt": "raw",
               "batch_decode": args.batch_decode if has_switch else None, "client_timeout_s": args.client_timeout_s,
               "time_limit_s": args.time_limit_s, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "provenance": provenance(seed=[session_params(i, args.blocks, args.pattern)["seed"]
                                              for i in range(max(sessions))], prompt=None, device="cpu"),
               "host": {"torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "machine": platform.machine(),
                        "loadavg_before": [round(x, 2) for x in os.getloadavg()]},
               "goals": {"speedup_at_sessions": GOAL_SESSIONS, "speedup": GOALS, "dropped_frames": 0},
               "solo_s": {}, "solo_stage_share": {}, "build_s": {}, "runs": [], "skipped": [], "final": False}
    for preset in presets:
        if time.monotonic() > limit_at:
            results["skipped"] += [f"{preset} {s} {n}" for s in schedulers for n in sessions]
            continue
        tb = time.perf_counter()
        pipe = SpeculativeVideoPipeline.from_preset(preset, seed=0)
        results["build_s"][preset] = time.perf_counter() - tb
        ts = time.perf_counter()
        solos, stages = {}, {}
        for i in range(max(sessions)):
            solos[i], times = solo_video(pipe, session_params(i, args.blocks, args.pattern))
            for k, v in times.items():
                stages[k] = stages.get(k, 0.0) + v
        results["solo_s"][preset] = time.perf_counter() - ts
        # where a video's time goes alone (the batched worker batches `draft`/`target` denoising and `score`)
        results["solo_stage_share"][preset] = {k: round(v / sum(stages.values()), 4) for k, v in stages.items() if v}
        print(f"[{time.monotonic() - t0:7.1f} s] {preset}: built, {len(solos)} solo videos in "
              f"{results['solo_s'][preset]:.1f} s", flush=True)
        for k, n in enumerate(sessions):
            for scheduler in schedulers if k % 2 == 0 else schedulers[::-1]:  # each goes first in turn
                if time.monotonic() > limit_at:
                    results["skipped"].append(f"{preset} {scheduler} {n}")
                    continue
                # a server of its own for each run, the only one up (a second server idle in the process slowed
                # the run measured after the other's by up to 40% on 2 CPUs, whichever scheduler it was)
                with tempfile.TemporaryDirectory(prefix="sdvg-serve-load-") as videos:
                    cfg = ServeConfig(port=free_port(), max_sessions=max(sessions), max_queue=0,
                                      session_scheduler=scheduler, video_dir=videos, **decode)
                    with served(pipe, cfg, GenerationOptions(router="pattern", pattern=args.pattern)):
                        run = run_round(cfg.port, preset, scheduler, n, args, solos, limit_at)
                run["measured"] = len(results["runs"])  # the order the rounds ran in
                results["runs"].append(run)
                results["runs"].sort(key=lambda r: (presets.index(r["preset"]), schedulers.index(r["scheduler"]),
                                                    r["sessions"]))
                print(f"[{time.monotonic() - t0:7.1f} s] {preset} {scheduler} x{n}: "
                      f"{run['frames_per_s'] or 0:.2f} frames/s, ttff {run['ttff_s'] or 0:.2f} s, "
                      f"equal {run['equal_to_solo']}, dropped {run['dropped_frames']}", flush=True)
                write(results, out)
        del pipe
    results["host"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    results["commit_after"] = commit_of()  # others may commit while it runs: the tree it ended on
    results["seconds_total"] = time.monotonic() - t0
    results["final"] = True
    write(results, out)
    print(markdown(results))
    return results


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["runs"] and all(r["equal_to_solo"] or r["within_decode_tolerance"] for r in res["runs"]) else 1)
