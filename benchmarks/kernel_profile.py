"""Where each variant's device time goes: kernel classes and the device-busy fraction of short videos.

    python benchmarks/kernel_profile.py --preset real-size --device cuda:0 --variants eager,compile,fp8 \
        --out results/kernel-profile-h200
    python benchmarks/kernel_profile.py --preset tiny --out /tmp/kp    # the CPU: aten operators, not kernels

For each variant (latency.py's names: eager, compile, fp8, fp8-compile, graphs) and mode (target-only and
draft-only; `graphs` only captures the drafter, so draft-only), one video of --num-blocks blocks runs
(stage_timing events by default: no wait after each stage, so the busy fraction is what a run that does
not time its stages gets) under torch.profiler after an unprofiled warm-up video of the same length (a compile variant compiles
there). On CUDA every kernel is classed by its name (`CLASSES`: gemm, attention, conv, copy, norm,
fused (inductor's Triton kernels), elementwise, other); the device-busy fraction is the union of the
kernels' intervals over the profiled wall time (one device: the lanes' streams overlap on it). On the
CPU there are no kernels: the top-level aten operators are classed instead (benchmarks/copy_counts.py's
classes), which exercises the code, not the GPU's proportions. Writes results.json and results.md."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from copy_counts import op_class  # noqa: E402
from latency import PROMPT, VARIANTS  # noqa: E402
from provenance import provenance, provenance_line  # noqa: E402

# (class, substrings of a CUDA kernel's name), the first match decides
CLASSES = (
    ("attention", ("fmha", "flash", "sdpa", "attention", "attn")),
    ("conv", ("fprop", "dgrad", "wgrad", "conv", "implicit_gemm")),
    ("gemm", ("gemm", "nvjet", "cutlass", "cublas", "scaled_mm", "f8f8", "sm90_xmma", "splitk")),
    ("copy", ("copy", "catarray", "index_select", "indexselect", "gather", "scatter", "index_put")),
    ("norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "group_norm", "groupnorm")),
    ("fused", ("triton_",)),
    ("elementwise", ("elementwise", "reduce_kernel", "reduction", "vectorized", "unrolled")),
)
MODES_OF = {"graphs": ("draft",)}  # variant -> the modes profiled (default: target and draft)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def union_s(intervals) -> float:
    """Seconds covered by the union of (start_ns, end_ns) intervals."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e9


def classify(kernels) -> dict:
    """Device seconds per class, the busy union and the top kernels of (name, class, start_ns, duration_ns)."""
    by_class, top, intervals = {}, {}, []
    for name, cls, a, d in kernels:
        intervals.append((a, a + d))
        by_class[cls] = by_class.get(cls, 0.0) + d / 1e9
        top[name] = top.get(name, 0.0) + d / 1e9
    return {"by_class_s": by_class, "busy_s": union_s(intervals), "launches": len(intervals),
            "top": sorted(([round(s, 6), n[:140]] for n, s in top.items()), reverse=True)[:12]}


def kernels_of(prof, cuda: bool):
    """(name, class, start_ns, duration_ns) of each CUDA kernel, or on the CPU of each top-level aten operator."""
    if cuda:
        return [(e.name(), kernel_class(e.name()), e.start_ns(), e.duration_ns())
                for e in prof.profiler.kineto_results.events() if "cuda" in str(e.device_type()).lower()]
    return [(e.name, op_class(e.name[len("aten::"):]), int(e.time_range.start * 1000),
             int((e.time_range.end - e.time_range.start) * 1000))
            for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]


def profile_video(pipe, mode: str, num_blocks: int, variant: tuple, warmup: bool = True,
                  stage_timing: str = "events") -> dict:
    from torch.profiler import ProfilerActivity, profile

    from latency import run_once

    cuda = pipe.components.target_device.type == "cuda" or pipe.components.drafter_device.type == "cuda"
    backend, scheduler, run_ahead, options = variant
    variant = (backend, scheduler, run_ahead, tuple(sorted({**dict(options), "stage_timing": stage_timing}.items())))
    if warmup:
        run_once(pipe, mode, num_blocks, None, variant)  # compiles, captures, quantizes
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        stats = run_once(pipe, mode, num_blocks, None, variant)
        wall = time.perf_counter() - t0
    c = classify(kernels_of(prof, cuda))
    device_s = sum(c["by_class_s"].values())
    return {"mode": mode, "stage_timing": stage_timing, "wall_s": wall, "video_wall_s": stats["result"]["wall_s"], "busy_fraction": c["busy_s"] / wall,
            "device_s": device_s, "launches": c["launches"], "by_class_s": c["by_class_s"],
            "share": {k: v / device_s for k, v in c["by_class_s"].items()} if device_s else {},
            "forwards": {"target": stats["result"]["target_forwards"], "drafter": stats["result"]["drafter_forwards"]},
            "top": c["top"], "kernels": "cuda" if cuda else "cpu aten operators"}


def write_md(results: dict, path: Path) -> None:
    classes = [c for c, _ in CLASSES] + ["other"]
    lines = [f"# Kernel classes per variant: {results['preset']}, {results['num_blocks']} blocks "
             f"({results['kernels']})", "", provenance_line(results["provenance"]), "",
             "| variant | mode | wall s | device busy | launches | " + " | ".join(classes) + " |",
             "|---|---|---|---|---|" + "---|" * len(classes)]
    for r in results["runs"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['mode']} | failed: {r['error'][:80]} |")
            continue
        shares = " | ".join(f"{r['share'].get(c, 0.0):.0%}" for c in classes)
        lines.append(f"| {r['variant']} | {r['mode']} | {r['wall_s']:.2f} | {r['busy_fraction']:.0%} | "
                     f"{r['launches']} | {shares} |")
    lines += ["", "Shares are of the device time (the sum of kernel durations); device busy is the union of the "
              "kernels' intervals over the profiled video's wall time."]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None, pipe=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-blocks", type=int, default=2)
    ap.add_argument("--variants", default="eager", help="eager and latency.py's: " + ", ".join(VARIANTS))
    ap.add_argument("--deadline", type=float, default=None, help="start no video past this time (date +%%s)")
    ap.add_argument("--stage-timing", choices=("sync", "events"), default="events",
                    help="events (default): no wait after each stage, as a run that is not timing its stages runs; "
                         "sync: the latency benchmark's per-stage waits")
    ap.add_argument("--no-warmup", action="store_true",
                    help="no unprofiled video first (the variants already ran on this pipeline: gpu_check.py)")
    ap.add_argument("--out", default="results/kernel-profile")
    args = ap.parse_args(argv)
    from latency import MAIN_VARIANT

    names = [v for v in args.variants.split(",") if v]
    table = {"eager": MAIN_VARIANT, **VARIANTS}
    unknown = [v for v in names if v not in table]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {sorted(table)}")
    if pipe is None:
        from sdvg.config import get_preset
        from sdvg.models.components import build_random
        from sdvg.pipeline import SpeculativeVideoPipeline

        pipe = SpeculativeVideoPipeline(build_random(get_preset(args.preset), drafter_device=args.device,
                                                     random_init="device"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = pipe.components.target_device.type == "cuda"
    results = {"preset": pipe.preset.name, "num_blocks": args.num_blocks,
               "kernels": "CUDA kernels" if cuda else "CPU aten operators",
               "provenance": provenance(prompt=PROMPT, device=pipe.components.target_device), "runs": [],
               "skipped": []}
    for name in names:
        for mode in MODES_OF.get(name, ("target", "draft")):
            if args.deadline is not None and time.time() > args.deadline:
                results["skipped"].append(f"{name} {mode}")
                continue
            try:
                run = profile_video(pipe, mode, args.num_blocks, table[name], warmup=not args.no_warmup,
                                    stage_timing=args.stage_timing)
            except Exception as exc:  # one variant's failure keeps the others
                run = {"mode": mode, "error": f"{type(exc).__name__}: {exc}"}
            results["runs"].append({"variant": name, **run})
            (out / "results.json").write_text(json.dumps(results, indent=2))
            write_md(results, out / "results.md")
            print(f"[profile] {name} {mode}: " + ("failed" if "error" in run else
                  f"{run['wall_s']:.2f} s, busy {run['busy_fraction']:.0%}"), flush=True)
    return results


if __name__ == "__main__":
    main()
