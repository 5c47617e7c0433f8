"""Soak: many videos in one process must not leak memory or file descriptors.

Generates --videos videos (default 50) on the tiny preset with one pipeline, cycling through the
scheduler variants (reference; cpp; cpp with run-ahead) and writing each video's MP4 through the
incremental writer, as `sdvg generate --prompts-file` does. After every video it records the resident
set size (VmRSS) and the number of open file descriptors. Pass criteria (docs/invariants.md): RSS grows
less than 5% from video 5 to the last; the descriptors end where they started.

    python benchmarks/soak.py --out results/soak-cpu
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ({"scheduler": "reference"}, {"scheduler": "cpp"}, {"scheduler": "cpp", "run_ahead": True})


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def malloc_trim() -> bool:
    """Hand freed heap pages back to the OS (glibc); False where unavailable."""
    import ctypes
    import ctypes.util

    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--videos", type=int, default=50)
    ap.add_argument("--num-blocks", type=int, default=3)
    ap.add_argument("--warm", type=int, default=5, help="videos before the RSS baseline (default: 5)")
    ap.add_argument("--out", type=Path, default=Path("results/soak-cpu"))
    ap.add_argument("--trim", action=argparse.BooleanOptionalAction, default=True,
                    help="call glibc's malloc_trim(0) after each video before reading RSS (default: on; both values "
                         "are recorded)")
    args = ap.parse_args(argv)
    if args.videos <= args.warm:
        ap.error("--videos must exceed --warm")

    import torch

    from sdvg import SpeculativeVideoPipeline
    from sdvg.cli import run_one
    from sdvg.options import GenerationOptions

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    pipe = SpeculativeVideoPipeline.from_preset("tiny")
    rows = []
    fds_start = open_fds()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.videos):
            variant = VARIANTS[i % len(VARIANTS)]
            opts = GenerationOptions(num_blocks=args.num_blocks, seed=i, tau=-0.05, **variant)
            stats = run_one(pipe, f"a paper boat, take {i}", opts, Path(tmp) / f"v{i}.mp4", progress=False)
            (Path(tmp) / f"v{i}.mp4").unlink()
            gc.collect()
            before_trim = rss_mib()
            if args.trim:
                malloc_trim()
            rows.append({"video": i, **variant, "rss_mib": rss_mib(), "rss_before_trim_mib": before_trim,
                         "open_fds": open_fds(),
                         "frames": stats.frames, "wall_s": stats.wall_s})
            print(f"{i:3d} {rows[-1]['rss_mib']:8.1f} MiB {rows[-1]['open_fds']:3d} fds", file=sys.stderr)
    base, last = rows[args.warm - 1]["rss_mib"], rows[-1]["rss_mib"]
    growth = (last - base) / base
    result = {
        "videos": args.videos, "num_blocks": args.num_blocks, "variants": list(VARIANTS),
        "rss_mib_after_warm": base, "rss_mib_last": last, "rss_growth_after_warm": growth,
        "rss_mib_max": max(r["rss_mib"] for r in rows),
        "open_fds_start": fds_start, "open_fds_end": rows[-1]["open_fds"],
        "pass_rss": growth < 0.05, "pass_fds": rows[-1]["open_fds"] == fds_start,
        "total_s": time.perf_counter() - t0, "load_average": os.getloadavg(), "torch": torch.__version__,
        "per_video": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    print(f"RSS {base:.1f} MiB after {args.warm} videos -> {last:.1f} MiB after {args.videos} ({growth:+.2%}); "
          f"fds {fds_start} -> {rows[-1]['open_fds']}; written to {args.out / 'results.json'}")
    return 0 if result["pass_rss"] and result["pass_fds"] else 1


if __name__ == "__main__":
    sys.exit(main())
