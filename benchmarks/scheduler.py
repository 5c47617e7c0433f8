"""Scheduler benchmark (CPU): overhead per block of the `cpp` and `reference` backends, and
run-ahead vs sequential with stages of controlled cost against the cost-model floor.

    python benchmarks/scheduler.py --out results/scheduler-cpu

1. Overhead: the tiny preset end to end; overhead = wall time - time inside stage calls (main
   thread), per block, median of --repeats, both backends on the same pipeline in one run.
2. Run-ahead: stages that sleep for set durations (sleep releases the GIL, like device work), a
   drafter:target forward cost of 1:10 (1.3B vs 14B), 9 blocks at the paper's 73.1% acceptance as
   a fixed pattern. The floor is the target-side cost model of docs/cost-model.md (the target's
   own forwards; everything on the drafter side hidden) plus what the main lane must still do
   (decode and score of each block).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdvg.generation.fake_stages import FakeStages, fake_scheduler  # noqa: E402
from sdvg.generation.routers import acceptance_pattern  # noqa: E402
from sdvg.generation.types import STAGE_NAMES  # noqa: E402
from sdvg.options import GenerationOptions  # noqa: E402


def run_sleep(costs, pattern, run_ahead, policy="committed"):
    """One video of sleeping stages (the shared fake); the scheduler's counters."""
    opts = GenerationOptions(router="pattern", pattern=pattern, num_blocks=len(pattern), run_ahead=run_ahead,
                             drafter_context=policy)
    sched = fake_scheduler(FakeStages(costs=costs), opts)
    sched.run()
    return sched.counters()


def overhead(repeats: int, num_blocks: int) -> dict:
    from sdvg import SpeculativeVideoPipeline

    pipe = SpeculativeVideoPipeline.from_preset("tiny")
    out = {}
    kw = dict(router="pattern", pattern=acceptance_pattern(num_blocks, 0.731), num_blocks=num_blocks, seed=0)
    for name, scheduler, streaming in (("reference", "reference", False), ("cpp", "cpp", False),
                                       ("cpp streaming (worker thread + queue)", "cpp", True)):
        pipe("warm-up", scheduler=scheduler, **kw)
        per_block = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if streaming:
                stream = pipe.stream("a fox", scheduler=scheduler, **kw)
                for _ in stream:
                    pass
                stats = stream.stats
            else:
                stats = pipe("a fox", scheduler=scheduler, **kw).stats
            wall = time.perf_counter() - t0
            inside = sum(sum(b["times"][k] for k in STAGE_NAMES) for b in stats.blocks)
            per_block.append((wall - inside) / num_blocks)
        out[name] = {"overhead_per_block_ms": 1e3 * statistics.median(per_block),
                     "all_ms": [1e3 * x for x in per_block]}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/scheduler-cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--unit-ms", type=float, default=5.0, help="drafter forward cost")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    u = args.unit_ms / 1e3
    T = 10 * u  # target forward : drafter forward = 10 : 1
    costs = {"draft": 4 * u, "drafter_commit": u, "target": 4 * T, "target_commit": T, "decode": 2 * u,
             "score": u}
    B = 9
    pattern = acceptance_pattern(B, 0.731)
    rejected = sum(not p for p in pattern)  # block 0 included
    # Target-side floor: 4 forwards per target block + commits a later target run reads (the lazy
    # schedule commits accepted blocks only before the next rejection, never after the last one).
    last_target = max(i for i, p in enumerate(pattern) if not p)
    commits = last_target  # blocks 0..last_target-1 must be in the target's cache when it runs
    floor_target = rejected * 4 * T + commits * T
    floor_main = floor_target + B * (costs["decode"] + costs["score"]) + (rejected - 1) * costs["decode"]
    target_only = B * 4 * T + (B - 1) * T + B * costs["decode"]
    runs = {}
    for name, ra, pol in (("sequential", False, "committed"), ("run_ahead", True, "committed"),
                          ("run_ahead_own", True, "own")):
        walls = [run_sleep(costs, pattern, ra, pol).scheduler_wall_s for _ in range(args.repeats)]
        runs[name] = statistics.median(walls)
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "stage_costs_s": costs, "blocks": B, "pattern": pattern, "acceptance": sum(pattern[1:]) / (B - 1),
        "target_only_model_s": target_only, "floor_target_side_s": floor_target,
        "floor_with_main_lane_s": floor_main, "wall_s": runs,
        "speedup_vs_target_only": {k: target_only / v for k, v in runs.items()},
        "wall_over_floor": {k: v / floor_main for k, v in runs.items()},
        "overhead": overhead(args.repeats, 5),
    }
    (out / "results.json").write_text(json.dumps(res, indent=2))
    lines = [f"# Scheduler benchmark ({res['date']})", "",
             f"Sleep stages, drafter forward {args.unit_ms} ms, target forward {10 * args.unit_ms} ms, 9 blocks, "
             f"{res['acceptance']:.1%} acceptance (pattern {''.join('A' if p else 'R' for p in pattern)}).", "",
             "| schedule | wall s | speed-up vs target-only model | wall / floor |", "|---|---|---|---|"]
    for k, v in runs.items():
        lines.append(f"| {k} | {v:.3f} | {res['speedup_vs_target_only'][k]:.2f}x | {res['wall_over_floor'][k]:.3f} |")
    lines += ["", f"Floor (target side + decode/score lane): {floor_main:.3f} s; target-only model: "
              f"{target_only:.3f} s; target-side floor alone {floor_target:.3f} s.", "",
              "| backend | scheduler overhead per block (ms, tiny preset) |", "|---|---|"]
    for k, v in res["overhead"].items():
        lines.append(f"| {k} | {v['overhead_per_block_ms']:.2f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return res


if __name__ == "__main__":
    main()
