"""Live memory: an unbounded live session must keep its memory flat once its window is full.

Runs one unbounded session (`pipe.session(..., num_blocks=None)`, --scheduler reference (default) or cpp
(the native scheduler, --run-ahead optional), mode sdvg) on the tiny preset per configuration (--configs):

- recompute: drafter and target under the recompute context (kv_cache_frames clean frames rebuilt
  before each block, Krea's inference): no block bound;
- windowed-full: drafter and target under the full context with a window (--window-frames,
  --sink-frames): bounded by the RoPE table (`unbounded_horizon`: 340 tiny blocks), so a --blocks past
  it stops there (recorded as stopped_at_horizon);
- mixed: the drafter's windowed full context, the target's recompute context;
- recompute-no-updates, windowed-full-no-updates: the same without prompt updates, so no block is
  forced after block 0 and, the tiny drafter's blocks being all accepted, the target never runs again:
  the reference loop's lazy target commits (`lazy_target_commit`) are never made;
- recompute-no-updates-eager: recompute-no-updates with lazy_target_commit off (the control).

Each session runs --blocks blocks (default 300), sends (unless -no-updates) a prompt update every
--update-every blocks (cycling three prompts, interp_blocks --interp-blocks: each prompt is encoded
once, the blends' text K/V rebuilt, the first block of each switch forced to the target), and ends
with `session.close()`. After every block it records:

- rss_mib: the resident set size (VmRSS of /proc/self/status after glibc's malloc_trim; the value
  before the trim is rss_before_trim_mib);
- kv: per role, the bytes of the K/V buffer of its `sdvg._C.KVCache` (`cache.buffer`'s storage: what
  the cache allocated, read from the cache itself; the loop's stage calls and setup are caught
  by a subclass of the loops' `StageCalls` put in their place while the benchmark runs, no source
  change), its visible frames (what attention reads)
  and the frames committed so far (absolute); kv_bytes sums the roles;
- tensors / tensor_bytes: the torch.Tensor objects the garbage collector tracks and the bytes of their
  distinct storages (the Python-visible tensors: recompute contexts, text K/V, prompt embeddings, RoPE
  tables, VAE cache, pending commits...; the KV buffers live in C++ and are counted in kv only);
- objects: the objects the garbage collector tracks (`len(gc.get_objects())`);
- the per-block bookkeeping an unbounded session keeps: the statistics' block entries
  (`RunStats.blocks`), the reference loop's trace spans and per-block times (`StageCalls.trace`,
  `.times`) and its target commits not made yet (`pending`, read from the suspended loop's frame).

Flat (per config, from block max(--warm, the block the window filled) to the last): RSS at most
--tolerance (5%) above its value at that block at every block, the KV buffer bytes of every role
exactly constant (and a windowed role's visible frames), the live tensor bytes at most --tolerance
above their value there, and the live tensors (count and bytes) bounded: their peak over the last
third of those blocks no higher than over the first third. The Python objects' growth is reported,
not judged. Exits 1 when a config is not flat.

    python benchmarks/live_memory.py --out results/live-memory-tiny
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402
from soak import malloc_trim, rss_mib  # noqa: E402

PROMPTS = ("a red fox in the snow", "an owl at night", "a lighthouse in a storm")
CONFIGS = {  # name -> (session options, prompt updates sent)
    "recompute": ({"drafter_cache": "recompute", "target_context": "recompute"}, True),
    "windowed-full": ({"drafter_cache": "full", "target_context": "full", "window": True}, True),
    "mixed": ({"drafter_cache": "full", "target_context": "recompute", "window": True}, True),
    # no update: no forced block; the tiny drafter's every block is accepted, so the target never runs
    "recompute-no-updates": ({"drafter_cache": "recompute", "target_context": "recompute"}, False),
    "windowed-full-no-updates": ({"drafter_cache": "full", "target_context": "full", "window": True}, False),
    # ... and the same with the target's commits made at once (lazy_target_commit off)
    "recompute-no-updates-eager": ({"drafter_cache": "recompute", "target_context": "recompute",
                                    "lazy_target_commit": False}, False),
}


BOOKKEEPING = ("stats_blocks", "trace_spans", "block_times", "pending_target_commits")


def live_tensors() -> dict:
    """The torch tensors the garbage collector tracks: their count, the bytes of their distinct
    storages, and the number of tracked objects."""
    import torch

    objects = gc.get_objects()
    seen, total, count = set(), 0, 0
    tensor = torch.Tensor
    for obj in objects:
        if issubclass(type(obj), tensor):  # type(): no __class__ lookup on a deprecated proxy (a warning)
            count += 1
            if obj.is_meta:
                continue
            try:
                storage = obj.untyped_storage()
                key = (storage.data_ptr(), obj.device.type)
            except RuntimeError:  # a fake or functional tensor (another tracer's, alive in this process): no storage
                continue
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    n = len(objects)
    del objects
    return {"tensors": count, "tensor_bytes": total, "objects": n}


def kv_state(setup) -> dict:
    """Per role: the K/V buffer bytes its cache allocated, its visible and committed frames."""
    out = {}
    for model in (setup.drafter, setup.target):
        if model is None:
            continue
        cache = model.cache
        out[model.role] = {"context": model.context.mode, "bytes": cache.buffer.untyped_storage().nbytes(),
                           "visible_frames": len(cache.visible_frames()), "committed_frames": model.committed_frames}
    return out


def _slope(xs, ys) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def _series(rows, key) -> dict:
    xs, ys = [r["block"] for r in rows], [r[key] for r in rows]
    base = ys[0]
    return {"at_baseline": base, "last": ys[-1], "min": min(ys), "max": max(ys), "max_minus_min": max(ys) - min(ys),
            "growth": (ys[-1] - base) / base if base else 0.0, "max_growth": (max(ys) - base) / base if base else 0.0,
            "slope_per_block": _slope(xs, ys)}


def window_filled_block(rows) -> int | None:
    """The first block from which no windowed (full-context) role's visible frames change any more (the
    window has filled); None without such a role."""
    full = [role for role, kv in rows[0]["kv"].items() if kv["context"] == "full"]
    if not full:
        return None
    for i, row in enumerate(rows):
        if all(all(r["kv"][role]["visible_frames"] == row["kv"][role]["visible_frames"] for r in rows[i:])
               for role in full):
            return row["block"]
    return rows[-1]["block"]


def summarize(rows: list[dict], warm: int, tolerance: float) -> dict:
    """The flatness verdict of one config's per-block rows (see the module docstring)."""
    filled = window_filled_block(rows)
    start = max(warm, filled or 0)
    after = [r for r in rows if r["block"] >= start]
    if len(after) < 2:
        settled = filled is None or len(rows) < 2 or filled < rows[-1]["block"]
        return {"baseline_block": start, "window_filled_block": filled, "flat": False,
                "reasons": [f"fewer than two blocks from block {start} on" if settled else
                            "a windowed cache's visible frames never stopped changing"]}
    roles = list(after[0]["kv"])
    kv = {role: {"bytes": sorted({r["kv"][role]["bytes"] for r in after}),
                 "visible_frames": sorted({r["kv"][role]["visible_frames"] for r in after}),
                 "context": after[0]["kv"][role]["context"]} for role in roles}
    out = {"baseline_block": start, "window_filled_block": filled, "last_block": after[-1]["block"],
           "rss_mib": _series(after, "rss_mib"), "kv_bytes": _series(after, "kv_bytes"), "kv": kv,
           "tensors": _series(after, "tensors"), "tensor_bytes": _series(after, "tensor_bytes"),
           "objects": _series(after, "objects"), "tolerance": tolerance}
    reasons = []
    if out["rss_mib"]["max_growth"] >= tolerance:
        reasons.append(f"RSS grew {out['rss_mib']['max_growth']:+.2%} from block {start} (tolerance {tolerance:.0%})")
    for role, k in kv.items():
        if len(k["bytes"]) != 1:
            reasons.append(f"{role} KV bytes not constant: {k['bytes']}")
        if k["context"] == "full" and len(k["visible_frames"]) != 1:
            reasons.append(f"{role} visible KV frames not constant: {k['visible_frames']}")
    if out["tensor_bytes"]["max_growth"] >= tolerance:
        reasons.append(f"live tensor bytes grew {out['tensor_bytes']['max_growth']:+.2%} from block {start}")
    third = max(len(after) // 3, 1)
    for key in ("tensors", "tensor_bytes"):  # bounded: the last third never exceeds the first third's peak
        first, last = max(r[key] for r in after[:third]), max(r[key] for r in after[-third:])
        out[key]["peak_first_third"], out[key]["peak_last_third"] = first, last
        if last > first:
            reasons.append(f"live {key.replace('_', ' ')} still rising: peak {last} in the last third of the blocks "
                           f"from {start}, {first} in the first")
    out["bookkeeping"] = {key: {"at_baseline": after[0][key], "last": after[-1][key],
                                "per_block": _slope([r["block"] for r in after], [r[key] for r in after])}
                          for key in BOOKKEEPING if after[0].get(key) is not None}
    out["reasons"], out["flat"] = reasons, not reasons
    return out


def _pending_list(setup):
    """The reference loop's list of target commits not made yet (`pending` in
    sdvg/generation/reference.py, lazy_target_commit): read from the suspended loop's frame, found
    through the setup it holds; None where not found."""
    for obj in gc.get_objects():
        if type(obj).__name__ == "generator" and getattr(obj, "gi_code", None) is not None \
                and obj.gi_code.co_name == "generate_blocks" and obj.gi_frame is not None \
                and obj.gi_frame.f_locals.get("setup") is setup:
            return obj.gi_frame.f_locals.get("pending")
    return None


def _wait_until_at_rest(calls, timeout_s: float = 30.0, settle_s: float = 0.5) -> None:
    """The native scheduler runs on its own threads: wait until its main thread waits to hand a block over (its
    queue of one holds the next block and it is blocked putting the one after: a waiter on the queue's not_full
    condition), then `settle_s` for its lane to finish the draft it may still be making, so each sample sees the
    same blocks in flight."""
    deadline = time.perf_counter() + timeout_s
    while not calls.sink.not_full._waiters and time.perf_counter() < deadline:
        time.sleep(0.01)
    time.sleep(settle_s)


def run_config(pipe, name: str, args) -> dict:
    spec, updates = CONFIGS[name]
    spec = dict(spec)
    if spec.pop("window", False):
        spec.update(window_frames=args.window_frames, sink_frames=args.sink_frames)
    update_every = args.update_every if updates else 0
    session = pipe.session(PROMPTS[0], num_blocks=None, scheduler=args.scheduler, run_ahead=args.run_ahead,
                           mode=args.mode, interp_blocks=args.interp_blocks, seed=0, **spec)
    horizon = session.limit  # None: no bound (recompute only); else the RoPE table's end
    blocks = args.blocks if horizon is None else min(args.blocks, horizon)
    held = {}
    rows, t0 = [], time.perf_counter()
    with _catching_stage_calls(held):
        stats = _sample(session, blocks, update_every, args, held, rows, name, t0)
    held.clear()
    summary = summarize(rows, args.warm, args.tolerance)
    return {"config": name, "options": spec, "update_every": update_every, "horizon": horizon,
            "blocks_asked": args.blocks, "blocks_run": len(rows),
            "stopped_at_horizon": horizon is not None and args.blocks > horizon,
            "updates": len(stats["live"]["updates"]), "prompt_encodes": stats["live"]["prompt_encodes"],
            "decisions": {d: sum(r["decision"] == d for r in rows) for d in sorted({r["decision"] for r in rows})},
            "wall_s": time.perf_counter() - t0, "summary": summary, "blocks": rows}


@contextlib.contextmanager
def _catching_stage_calls(held: dict):
    """Both loops' stage calls, caught as each segment makes them (with the setup they hold: the RoleModels, their
    caches) into `held`; the loops' own class is back after."""
    from sdvg.generation import native, reference
    from sdvg.generation.calls import StageCalls

    class CaughtCalls(StageCalls):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            held.update(calls=self, setup=self.setup)

    saved = native.StageCalls, reference.StageCalls
    native.StageCalls = reference.StageCalls = CaughtCalls
    try:
        yield
    finally:
        native.StageCalls, reference.StageCalls = saved


def _sample(session, blocks: int, update_every: int, args, held: dict, rows: list, name: str, t0: float) -> dict:
    """Run `session` for `blocks` blocks, one row of memory samples per block into `rows`; its final stats."""
    for block in session:
        b = block.live["block"]
        if update_every and (b + 1) % update_every == 0:
            session.update(prompt=PROMPTS[(b + 1) // update_every % len(PROMPTS)])
        decision = block.decision
        del block
        if "pending" not in held:
            held["pending"] = _pending_list(held["setup"])
        calls = held["calls"]
        if args.scheduler == "cpp":  # sampled at rest: the scheduler holding the next block, its lane waiting
            _wait_until_at_rest(calls)
        before = rss_mib()
        malloc_trim()
        kv = kv_state(held["setup"])
        rows.append({"block": b, "decision": decision, "rss_mib": rss_mib(), "rss_before_trim_mib": before, "kv": kv,
                     "kv_bytes": sum(k["bytes"] for k in kv.values()), **live_tensors(),
                     # per-block bookkeeping the session keeps: the statistics' block entries, the reference
                     # loop's trace spans and per-block times, the target commits it has not made yet
                     "stats_blocks": len(session.stats.blocks), "trace_spans": len(calls.trace or ()),
                     "block_times": len(calls.times),
                     "pending_target_commits": None if held["pending"] is None else len(held["pending"]),
                     "seconds": round(time.perf_counter() - t0, 3)})
        if b % 25 == 0 or b + 1 >= blocks:
            r = rows[-1]
            print(f"{name:26s} block {b:4d}  RSS {r['rss_mib']:8.1f} MiB  KV {r['kv_bytes']:8d} B  "
                  f"tensors {r['tensors']:5d} ({r['tensor_bytes']:9d} B)  objects {r['objects']:7d}  "
                  f"pending {r['pending_target_commits']}  {r['seconds']:7.1f} s", file=sys.stderr, flush=True)
        if b + 1 >= blocks:
            break
    return session.close().as_dict()


def _dumps(result: dict) -> str:
    """The results JSON: indented, one line per block row."""
    text = json.dumps({**result, "configs": [{k: v for k, v in c.items() if k != "blocks"} | {"blocks": "@@"}
                                             for c in result["configs"]]}, indent=2)
    for c in result["configs"]:
        rows = ",\n        ".join(json.dumps(r, separators=(",", ":")) for r in c["blocks"])
        text = text.replace('"blocks": "@@"', f'"blocks": [\n        {rows}\n      ]', 1)
    return text + "\n"


def summary_md(result: dict) -> str:
    p = result["provenance"]
    lines = ["# Live memory (tiny preset, unbounded sessions)", "",
             f"`{result['command']}`", "",
             f"{p['date']}; torch {p['torch']}; commit `{p['commit']}`{' (dirty)' if p['dirty'] else ''}; "
             f"{p['device_name']}, {result['torch_threads']} torch thread; scheduler {result['scheduler']}"
             f"{' (run-ahead)' if result.get('run_ahead') else ''}, mode {result['mode']}; "
             f"prompt updates every {result['update_every']} blocks (3 prompts, interp_blocks "
             f"{result['interp_blocks']}) unless -no-updates; window {result['window_frames']} frames with "
             f"{result['sink_frames']} sinks; tolerance {result['tolerance']:.0%}. After every block: RSS after "
             "malloc_trim, each role's KV buffer bytes, the gc-tracked tensors and objects.", "",
             f"Verdict: {'flat' if result['flat'] else 'NOT flat'} "
             f"({sum(c['summary']['flat'] for c in result['configs'])} of {len(result['configs'])} configs flat).", "",
             "| config | blocks | from block | RSS there -> last (MiB) | RSS max growth "
             "| KV bytes per role (constant?) "
             "| tensors there -> last | tensor bytes there -> last | pending target commits there -> last "
             "| objects per block | flat |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["configs"]:
        s = c["summary"]
        if "rss_mib" not in s:
            lines.append(f"| {c['config']} | {c['blocks_run']} | {s['baseline_block']} | | | | | | | | no |")
            continue
        kv = ", ".join(f"{role} {'/'.join(str(b) for b in k['bytes'])} ({'yes' if len(k['bytes']) == 1 else 'no'})"
                       for role, k in s["kv"].items())
        blocks = f"{c['blocks_run']}" + (f" (horizon {c['horizon']})" if c["stopped_at_horizon"] else "")
        pend = s["bookkeeping"].get("pending_target_commits")
        lines.append(
            f"| {c['config']} | {blocks} | {s['baseline_block']} "
            f"| {s['rss_mib']['at_baseline']:.1f} -> {s['rss_mib']['last']:.1f} | {s['rss_mib']['max_growth']:+.2%} "
            f"| {kv} | {s['tensors']['at_baseline']} -> {s['tensors']['last']} "
            f"| {s['tensor_bytes']['at_baseline']} -> {s['tensor_bytes']['last']} "
            f"| {'' if pend is None else str(pend['at_baseline']) + ' -> ' + str(pend['last'])} "
            f"| {s['objects']['slope_per_block']:+.1f} "
            f"| {'yes' if s['flat'] else 'no: ' + '; '.join(s['reasons'])} |")
    lines += ["", "From block: the baseline, max(--warm, the block a windowed cache's visible frames stopped "
              "changing). "
              "RSS max growth: the largest RSS from there on over the RSS there. KV bytes: each role's K/V buffer "
              "(`sdvg._C.KVCache.buffer`), allocated once per video: a windowed cache is a ring of sink + window + "
              "slack slots, a recompute cache kv_cache_frames + one block. Tensors: the torch tensors the garbage "
              "collector tracks (the KV buffers, held in C++, are not among them). Pending target commits: the "
              "accepted blocks the reference loop holds until the target next runs (lazy_target_commit). Objects per "
              "block: the least-squares slope of the gc-tracked objects (the statistics' block entries, trace spans "
              "and per-block times an unbounded session keeps), reported, not judged.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=300, help="blocks per session (a windowed full context stops at "
                    "its RoPE horizon if that comes first)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--warm", type=int, default=50, help="the baseline block (or the block the window filled, if "
                    "later); the default is past every prompt's first encode at the default --update-every")
    ap.add_argument("--update-every", type=int, default=10)
    ap.add_argument("--interp-blocks", type=int, default=3)
    ap.add_argument("--window-frames", type=int, default=6)
    ap.add_argument("--sink-frames", type=int, default=3)
    ap.add_argument("--mode", default="sdvg", choices=("sdvg", "draft", "target"))
    ap.add_argument("--scheduler", default="reference", choices=("reference", "cpp"),
                    help="cpp: the native scheduler (its own threads, sampled at rest: once it holds the next block; "
                         "the trace, per-block times and pending commits are the scheduler's, not read here)")
    ap.add_argument("--run-ahead", action="store_true", help="with --scheduler cpp: the drafter's lane drafts ahead")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=Path("results/live-memory-tiny"))
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        ap.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    if args.blocks <= args.warm + 1:
        ap.error("--blocks must exceed --warm + 1")

    import torch

    from sdvg import SpeculativeVideoPipeline

    torch.set_num_threads(1)
    pipe = SpeculativeVideoPipeline.from_preset("tiny")
    command = "python benchmarks/live_memory.py " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    runs = []
    for name in configs:
        gc.collect()  # each config starts from a collected heap: its samples count its own objects only
        runs.append(run_config(pipe, name, args))
    result = {"command": command.strip(), "preset": "tiny", "scheduler": args.scheduler, "run_ahead": args.run_ahead,
              "mode": args.mode,
              "blocks": args.blocks, "warm": args.warm, "update_every": args.update_every,
              "interp_blocks": args.interp_blocks, "window_frames": args.window_frames,
              "sink_frames": args.sink_frames, "tolerance": args.tolerance,
              "flat": all(r["summary"]["flat"] for r in runs), "torch_threads": torch.get_num_threads(),
              "provenance": provenance(seed=0, prompt=PROMPTS[0], device="cpu"), "configs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(_dumps(result))
    (args.out / "summary.md").write_text(summary_md(result))
    for r in runs:
        s = r["summary"]
        numbers = (f" (RSS {s['rss_mib']['at_baseline']:.1f} -> {s['rss_mib']['last']:.1f} MiB, "
                   f"KV {s['kv_bytes']['last']} B)") if "rss_mib" in s else ""
        print(f"{r['config']}: {r['blocks_run']} blocks, flat {s['flat']}{numbers}"
              + ("" if s["flat"] else f": {'; '.join(s['reasons'])}"))
    print(f"written to {args.out}")
    return 0 if result["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
