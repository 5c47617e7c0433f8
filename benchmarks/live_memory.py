"""Live memory: an unbounded live session must keep its memory flat once its window is full.

Runs one `pipe.session(..., num_blocks=None)` on the tiny preset (the drafter's full context under a
window, --window-frames / --sink-frames; the target's recompute context), sends a prompt update every
--update-every blocks (cycling three prompts, so each is encoded once), and after every --sample
blocks records the resident set size (VmRSS, after glibc's malloc_trim) and the bytes of every live
torch tensor (the KV caches, text K/V, VAE cache and anything the session keeps). Pass criterion:
both grow less than --tolerance (5%) from the sample after --warm blocks to the last.

    python benchmarks/live_memory.py --blocks 300 --out results/live-memory-cpu
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402
from soak import malloc_trim, rss_mib  # noqa: E402

PROMPTS = ("a red fox in the snow", "an owl at night", "a lighthouse in a storm")


def tensor_bytes() -> int:
    import torch

    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            key = storage.data_ptr()
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=300)
    ap.add_argument("--sample", type=int, default=10, help="blocks between samples")
    ap.add_argument("--warm", type=int, default=100, help="blocks before the baseline (the window has filled and "
                    "every prompt has been encoded and its text K/V made: 3 updates at the default 25)")
    ap.add_argument("--update-every", type=int, default=25)
    ap.add_argument("--window-frames", type=int, default=6)
    ap.add_argument("--sink-frames", type=int, default=3)
    ap.add_argument("--mode", default="sdvg", choices=("sdvg", "draft", "target"))
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=Path("results/live-memory-cpu"))
    args = ap.parse_args(argv)
    if args.blocks <= args.warm:
        ap.error("--blocks must exceed --warm")

    import torch

    from sdvg import SpeculativeVideoPipeline

    torch.set_num_threads(1)
    pipe = SpeculativeVideoPipeline.from_preset("tiny")
    session = pipe.session(PROMPTS[0], num_blocks=None, scheduler="reference", mode=args.mode,
                           window_frames=args.window_frames, sink_frames=args.sink_frames, interp_blocks=2)
    samples, t0 = [], time.perf_counter()
    for block in session:
        b = block.live["block"]
        if (b + 1) % args.update_every == 0:
            session.update(prompt=PROMPTS[(b + 1) // args.update_every % len(PROMPTS)])
        if (b + 1) % args.sample == 0:
            malloc_trim()
            samples.append({"block": b + 1, "rss_mib": rss_mib(), "tensor_bytes": tensor_bytes(),
                            "seconds": time.perf_counter() - t0})
            print(json.dumps(samples[-1]), flush=True)
        if b + 1 >= args.blocks:
            break
    stats = session.close().as_dict()
    base = next(s for s in samples if s["block"] >= args.warm)
    last = samples[-1]
    growth = {k: last[k] / base[k] - 1 for k in ("rss_mib", "tensor_bytes")}
    result = {"blocks": args.blocks, "mode": args.mode, "window_frames": args.window_frames,
              "sink_frames": args.sink_frames, "updates": len(stats["updates"]),
              "prompt_encodes": stats["prompt_encodes"], "baseline_block": base["block"], "growth": growth,
              "pass": all(g < args.tolerance for g in growth.values()), "samples": samples,
              "provenance": provenance(seed=0, prompt=PROMPTS[0], device="cpu")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("blocks", "growth", "pass", "updates", "prompt_encodes")}))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
