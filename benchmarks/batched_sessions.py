"""N live sessions batched together against the same sessions run one after another, in one process.

    python benchmarks/batched_sessions.py --preset tiny --sessions 4 --out results/batched-sessions-cpu
    python benchmarks/batched_sessions.py --preset real-size --device cuda:0 --sessions 4   # inside gpu_check

What the server's batched worker does (sdvg/generation/batching.py), without the server: `--sessions` sessions
(their own prompts and seeds, each at 75% acceptance from a fixed pattern, as `latency.py`'s SDVG runs) make
`--num-blocks` blocks each, first one after another (each alone: the round-robin worker's work), then together as
rounds of a `StageBatcher` (one block of every session per round, their denoising, commits and scores batched).
Both orders are timed after a warm-up of each; the aggregate frames/s of each and their ratio are the result, and
every batched session's video is checked against its run alone: whether every decision agreed, the largest latent
difference (0 on the CPU), frame difference in uint8 levels and score difference (batched VAE decodes; with
--no-batch-decode every session is bitwise its own). Writes results.json and results.md under --out.
`main(argv, pipe=...)` measures a pipeline built by the caller (benchmarks/gpu_check.py's `sessions` step).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from sdvg.config import get_preset  # noqa: E402
from sdvg.generation.batching import StageBatcher  # noqa: E402
from sdvg.generation.routers import acceptance_pattern  # noqa: E402
from sdvg.models.components import build_random  # noqa: E402
from sdvg.pipeline import SpeculativeVideoPipeline  # noqa: E402
from provenance import provenance, provenance_line  # noqa: E402

ACCEPTANCE = 0.75
PROMPTS = ("a red fox running through fresh snow at dawn, cinematic", "a lighthouse on a cliff in a storm",
           "a busy night market with lanterns", "a paper boat drifting down a rainy street",
           "a hot air balloon over green hills", "a cat asleep on a sunny windowsill",
           "waves breaking on black volcanic sand", "a train crossing a snowy bridge")


def _sessions(pipe, count: int, blocks: int, batcher=None) -> list:
    pattern = "".join("1" if a else "0" for a in acceptance_pattern(blocks, ACCEPTANCE))
    return [pipe.session(PROMPTS[i % len(PROMPTS)], seed=i, num_blocks=blocks, scheduler="reference",
                         router="pattern", pattern=pattern, batcher=batcher) for i in range(count)]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def alone(pipe, count: int, blocks: int) -> tuple[float, list]:
    """Each session's blocks, one session after another -> (seconds, per session its blocks)."""
    _sync(pipe.components.target_device)
    t0 = time.perf_counter()
    videos = [list(s) for s in _sessions(pipe, count, blocks)]
    _sync(pipe.components.target_device)
    return time.perf_counter() - t0, videos


def together(pipe, count: int, blocks: int, batch_decode: bool = True) -> tuple[float, list, dict]:
    """The sessions' blocks as rounds of one batcher -> (seconds, per session its blocks, the batcher's calls)."""
    batcher = StageBatcher(max_rows=count, batch_decode=batch_decode)
    sessions = _sessions(pipe, count, blocks, batcher)
    videos = [[] for _ in sessions]
    _sync(pipe.components.target_device)
    t0 = time.perf_counter()
    live = list(range(count))
    while live:
        results = batcher.run_round([sessions[i].__next__ for i in live])
        ended = []
        for i, (ok, outcome) in zip(live, results):
            if ok:
                videos[i].append(outcome)
            elif isinstance(outcome, StopIteration):
                ended.append(i)
            else:
                raise outcome
        live = [i for i in live if i not in ended]
    _sync(pipe.components.target_device)
    calls = {f"{kind} x{rows}": n for (kind, rows), n in sorted(batcher.stats.calls.items())}
    return time.perf_counter() - t0, videos, calls


def compare(solo: list, batched: list) -> dict:
    """Every session's batched blocks against its blocks alone: bitwise, the largest latent difference, decisions."""
    bitwise, decisions, latents, levels, scores = True, True, 0.0, 0, 0.0
    for a_blocks, b_blocks in zip(solo, batched):
        for a, b in zip(a_blocks, b_blocks):
            decisions &= a.decision == b.decision
            bitwise &= torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames) and a.score == b.score
            latents = max(latents, float((a.latents.float() - b.latents.float()).abs().max()))
            levels = max(levels, int((a.frames.int() - b.frames.int()).abs().max()))
            if a.score is not None and b.score is not None:
                scores = max(scores, abs(a.score - b.score))
        decisions &= len(a_blocks) == len(b_blocks)
    return {"bitwise": bool(bitwise), "decisions_equal": bool(decisions), "max_abs_latent_diff": latents,
            "max_frame_level_diff": levels, "max_abs_score_diff": scores}


def main(argv=None, pipe=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=3)
    ap.add_argument("--no-batch-decode", dest="batch_decode", action="store_false",
                    help="decode each session alone (every session bitwise its own)")
    ap.add_argument("--out", type=Path, default=Path("results/batched-sessions-cpu"))
    args = ap.parse_args(argv)
    if args.sessions < 1 or args.num_blocks < 2:
        ap.error("--sessions must be >= 1 and --num-blocks >= 2 (block 0 is the target's)")
    if pipe is None:
        pipe = SpeculativeVideoPipeline(build_random(get_preset(args.preset), drafter_device=args.device))
    frames = args.sessions * pipe.preset.video.pixel_frames(pipe.preset.vae, args.num_blocks)
    alone(pipe, 1, 2)  # warm-ups: the first calls of each path
    together(pipe, min(2, args.sessions), 2, args.batch_decode)
    solo_s, solo = alone(pipe, args.sessions, args.num_blocks)
    batched_s, batched, calls = together(pipe, args.sessions, args.num_blocks, args.batch_decode)
    result = {
        "preset": pipe.preset.name, "device": args.device, "sessions": args.sessions, "num_blocks": args.num_blocks,
        "acceptance": ACCEPTANCE, "frames": frames, "batch_decode": args.batch_decode,
        "alone_s": solo_s, "batched_s": batched_s,
        "alone_frames_per_s": frames / solo_s, "batched_frames_per_s": frames / batched_s,
        "speedup": solo_s / batched_s, "batched_calls": calls, **compare(solo, batched),
        "provenance": provenance(device=args.device),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    (args.out / "results.md").write_text(
        f"# {args.sessions} sessions batched vs one after another ({result['preset']}, {args.num_blocks} blocks, "
        f"75% acceptance)\n\n| order | seconds | frames/s |\n|---|---|---|\n"
        f"| one after another | {solo_s:.3f} | {result['alone_frames_per_s']:.2f} |\n"
        f"| batched rounds | {batched_s:.3f} | {result['batched_frames_per_s']:.2f} |\n\n"
        f"speed-up {result['speedup']:.2f}x; bitwise {result['bitwise']}, decisions equal "
        f"{result['decisions_equal']}, max |latent diff| {result['max_abs_latent_diff']:.3g}, frames within "
        f"{result['max_frame_level_diff']} levels, max |score diff| {result['max_abs_score_diff']:.3g}; calls {calls}\n\n"
        f"{provenance_line(result['provenance'])}\n")
    print(f"{args.sessions} sessions x {args.num_blocks} blocks: alone {solo_s:.2f} s, batched {batched_s:.2f} s "
          f"({result['speedup']:.2f}x); bitwise {result['bitwise']}, decisions equal {result['decisions_equal']}",
          flush=True)
    return result


if __name__ == "__main__":
    main()
