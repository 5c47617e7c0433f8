"""Latency of target-only, draft-only and SDVG (forced acceptance patterns) on one preset.

    python benchmarks/latency.py --preset cpu-bench --out results/latency-cpu
    python benchmarks/latency.py --preset real-size --device cuda:0 --out results/latency-h200

Random weights cannot be trusted to accept anything meaningful, so SDVG runs with fixed,
seeded decision patterns (0%, 50%, the paper's 73.1%, 100% of blocks 1..B-1) and is timed at a
known acceptance rate. Every stage is timed with the device synchronised before and after it;
a warm-up run is excluded; the median of --repeats runs is reported.

The cost-model floor (DESIGN.md section 1): with the drafter, VAE and reward hidden behind the
target (a second GPU or stream), a video costs what the target must do: 4 denoising forwards per
rejected block plus one commit forward per block that a later target run reads. The per-forward
times come from the same run's target-only measurement.
Writes results.json, results.csv, results.md, timeline.png and speedup.png.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from sdvg.config import get_preset  # noqa: E402
from sdvg.models import build_random  # noqa: E402
from sdvg.pipeline import SpeculativeVideoPipeline  # noqa: E402
from sdvg.routers import acceptance_pattern  # noqa: E402

STAGES = ("draft", "decode", "score", "target", "drafter_commit", "target_commit")
PAPER_ACCEPTANCE = 0.731
PROMPT = "a red fox running through fresh snow at dawn, cinematic"


def peak_memory(devices) -> dict:
    out = {}
    for d in devices:
        if d.type == "cuda":
            out[str(d)] = torch.cuda.max_memory_allocated(d) / 2**30
    out["host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def run_once(pipe, mode, num_blocks, pattern=None, variant=("eager", "cpp", False)):
    backend, scheduler, run_ahead = variant
    kw = dict(mode=mode, num_blocks=num_blocks, seed=0, backend=backend, scheduler=scheduler, run_ahead=run_ahead)
    if mode == "sdvg":
        kw.update(router="pattern", pattern=pattern)
    t0 = time.perf_counter()
    stats = pipe(PROMPT, **kw).stats
    for d in {pipe.components.drafter_device, pipe.components.target_device}:
        if d.type == "cuda":
            torch.cuda.synchronize(d)
    stats["wall_s"] = time.perf_counter() - t0
    return stats


def summarise(mode, rate, runs, variant=("eager", "cpp", False)):
    backend, scheduler, run_ahead = variant
    walls = [r["wall_s"] for r in runs]
    med = runs[walls.index(sorted(walls)[len(walls) // 2])]
    stages = {k: sum(b["times"].get(k, 0.0) for b in med["blocks"]) for k in STAGES}
    stages["overhead"] = med["wall_s"] - sum(stages.values())
    return {
        "mode": mode, "backend": backend, "scheduler": scheduler, "run_ahead": run_ahead, "acceptance": rate,
        "wall_s": statistics.median(walls), "wall_all_s": walls, "stages": stages,
        "decisions": [b["decision"] for b in med["blocks"]],
        "target_forwards": med["target_forwards"], "drafter_forwards": med["drafter_forwards"],
        "skipped_target_commits": med["skipped_target_commits"],
        "timeline": [{"index": b["index"], "decision": b["decision"], "times": b["times"]} for b in med["blocks"]],
    }


def floor_seconds(run, per_step, per_commit):
    """Target-side cost model: 4 (steps) forwards per target-made block + the commits a later target run reads.
    Draft-only has no target: its floor is the drafter's own work."""
    if run["mode"] == "draft":
        return run["stages"]["draft"] + run["stages"]["drafter_commit"]
    target_blocks = sum(x in ("forced", "rejected", "target") for x in run["decisions"])
    commits = run["target_forwards"] - 4 * target_blocks
    return target_blocks * 4 * per_step + commits * per_commit


def plots(results, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    tgt = runs[0]
    sd = [r for r in runs if r["mode"] == "sdvg" and (r["backend"], r["scheduler"], r["run_ahead"]) ==
          (tgt["backend"], tgt["scheduler"], tgt["run_ahead"])]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["acceptance"] for r in sd]
    ax.plot(xs, [tgt["wall_s"] / r["wall_s"] for r in sd], "o-", label=f"measured ({tgt['backend']}, {tgt['scheduler']} scheduler)")
    ax.plot(xs, [tgt["wall_s"] / r["floor_s"] for r in sd], "s--", label="cost-model floor (drafter hidden)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("acceptance rate (blocks 1..B-1)")
    ax.set_ylabel("speed-up over target-only")
    ax.set_title(f"{results['preset']} on {results['device_name']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)

    run = min(sd, key=lambda r: abs(r["acceptance"] - PAPER_ACCEPTANCE))
    fig, ax = plt.subplots(figsize=(9, 2.8))
    colors = {"draft": "tab:blue", "decode": "tab:green", "score": "tab:olive", "target": "tab:red",
              "drafter_commit": "tab:cyan", "target_commit": "tab:orange"}
    rows = {"draft": 1, "decode": 1, "score": 1, "drafter_commit": 1, "target": 0, "target_commit": 0}
    t = 0.0
    for blk in run["timeline"]:
        for stage in ("target_commit", "draft", "decode", "score", "target", "drafter_commit"):
            dur = blk["times"].get(stage, 0.0)
            if dur > 0:
                ax.barh(rows[stage], dur, left=t, color=colors[stage], edgecolor="black", lw=0.3)
                t += dur
        ax.axvline(t, color="black", lw=0.3)
        ax.text(t, 1.45, f"{blk['index']}{blk['decision'][0]}", fontsize=7, ha="right")
    ax.set_yticks([0, 1], ["target device", "drafter device"])
    ax.set_xlabel("seconds (sequential reference order; f/a/r = forced/accepted/rejected)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-bench")
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--target-device", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rates", default="0,0.5,0.731,1.0")
    ap.add_argument("--out", default="results/latency")
    ap.add_argument("--variants", default="reference,run-ahead",
                    help="extra runs of target-only and SDVG at 73.1%%: reference, run-ahead, compile, tensorrt")
    ap.add_argument("--engines", default=None, help="engine folder for the tensorrt variant")
    args = ap.parse_args(argv)

    preset = get_preset(args.preset)
    n = args.num_blocks or preset.video.num_blocks
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_build = time.perf_counter()
    pipe = SpeculativeVideoPipeline(build_random(preset, drafter_device=args.device,
                                                 target_device=args.target_device), engines=args.engines)
    build_s = time.perf_counter() - t_build
    comps = pipe.components
    devices = {comps.drafter_device, comps.target_device}
    rates = [float(x) for x in args.rates.split(",")]
    patterns = {r: acceptance_pattern(n, r, seed=0) for r in rates}

    main_variant = ("eager", "cpp", False)
    extra = {"reference": ("eager", "reference", False), "run-ahead": ("eager", "cpp", True),
             "compile": ("compile", "cpp", False), "tensorrt": ("tensorrt", "cpp", False)}
    variants = [extra[v] for v in args.variants.split(",") if v]
    paper_pattern = acceptance_pattern(n, PAPER_ACCEPTANCE, seed=0)
    for v in [main_variant] + variants:  # warm-up (all stages; compiles), excluded
        run_once(pipe, "sdvg", n, patterns[rates[len(rates) // 2]], v)
    for d in devices:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)

    def sdvg_run(rate, pattern, v):
        run = summarise("sdvg", rate, [run_once(pipe, "sdvg", n, pattern, v) for _ in range(args.repeats)], v)
        if run["decisions"][1:] != ["accepted" if p else "rejected" for p in pattern[1:]]:
            raise AssertionError("forced pattern not followed")
        run["acceptance"] = sum(d == "accepted" for d in run["decisions"][1:]) / max(1, n - 1)
        return run

    runs = []
    for mode in ("target", "draft"):
        runs.append(summarise(mode, None, [run_once(pipe, mode, n, None, main_variant) for _ in range(args.repeats)],
                              main_variant))
    for r in rates:
        runs.append(sdvg_run(r, patterns[r], main_variant))
    for v in variants:
        runs.append(summarise("target", None, [run_once(pipe, "target", n, None, v) for _ in range(args.repeats)], v))
        runs.append(sdvg_run(PAPER_ACCEPTANCE, paper_pattern, v))

    tgt = runs[0]  # eager, cpp scheduler, sequential
    per_step = tgt["stages"]["target"] / (4 * n)
    commits = tgt["target_forwards"] - 4 * n
    per_commit = tgt["stages"]["target_commit"] / max(1, commits)
    for r in runs:
        r["floor_s"] = floor_seconds(r, per_step, per_commit)
        r["floor_ratio"] = r["wall_s"] / r["floor_s"] if r["floor_s"] else None
    main_sdvg = [r for r in runs if r["mode"] == "sdvg" and (r["backend"], r["scheduler"], r["run_ahead"]) ==
                 main_variant]
    paper = min(main_sdvg, key=lambda r: abs(r["acceptance"] - PAPER_ACCEPTANCE))
    by_variant = {}
    for r in runs:
        by_variant.setdefault((r["backend"], r["scheduler"], r["run_ahead"]), {})[r["mode"]] = r
    variant_speedups = [
        {"backend": b, "scheduler": s_, "run_ahead": ra, "target_s": d["target"]["wall_s"],
         "sdvg_s": min((r for r in runs if r["mode"] == "sdvg" and (r["backend"], r["scheduler"], r["run_ahead"]) ==
                        (b, s_, ra)), key=lambda r: abs(r["acceptance"] - PAPER_ACCEPTANCE))["wall_s"]}
        for (b, s_, ra), d in by_variant.items() if "target" in d]
    for v in variant_speedups:
        v["speedup_vs_target"] = v["target_s"] / v["sdvg_s"]
    dev0 = comps.target_device
    results = {
        "preset": preset.name, "num_blocks": n, "precision": preset.precision,
        "device_name": torch.cuda.get_device_name(dev0) if dev0.type == "cuda" else platform.processor() or "cpu",
        "devices": [str(d) for d in devices], "torch": torch.__version__, "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "build_s": build_s,
        "variants": variant_speedups,
        "per_target_step_s": per_step, "per_target_commit_s": per_commit,
        "speedup_vs_target": tgt["wall_s"] / paper["wall_s"],
        "speedup_vs_target_acceptance": paper["acceptance"],
        "floor_ratio": paper["floor_ratio"],
        "floor_speedup_vs_target": tgt["wall_s"] / paper["floor_s"],
        "peak_memory_gib": peak_memory(devices),
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", "backend", "scheduler", "run_ahead", "acceptance", "wall_s", "floor_s", "floor_ratio",
                    "target_forwards", "drafter_forwards", *STAGES, "overhead"])
        for r in runs:
            w.writerow([r["mode"], r["backend"], r["scheduler"], r["run_ahead"], r["acceptance"], f"{r['wall_s']:.4f}",
                        f"{r['floor_s']:.4f}", f"{r['floor_ratio']:.3f}", r["target_forwards"],
                        r["drafter_forwards"], *(f"{r['stages'][k]:.4f}" for k in STAGES),
                        f"{r['stages']['overhead']:.4f}"])
    lines = [f"# Latency: {preset.name}, {n} blocks, {results['device_name']} ({results['date']})", "",
             "| mode | backend | scheduler | acceptance | wall s | speed-up vs target (same variant) | floor s | "
             "wall / floor |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.1%}"
        base = by_variant[(r["backend"], r["scheduler"], r["run_ahead"])].get("target", tgt)
        sched = r["scheduler"] + (" run-ahead" if r["run_ahead"] else "")
        lines.append(f"| {r['mode']} | {r['backend']} | {sched} | {acc} | {r['wall_s']:.3f} | "
                     f"{base['wall_s'] / r['wall_s']:.2f}x | {r['floor_s']:.3f} | {r['floor_ratio']:.2f} |")
    lines += ["", f"SDVG at {paper['acceptance']:.1%} acceptance: {results['speedup_vs_target']:.2f}x over "
              f"target-only (floor {results['floor_speedup_vs_target']:.2f}x, measured/floor "
              f"{results['floor_ratio']:.2f}); eager PyTorch, cpp scheduler, sequential. The floor counts only the "
              "target's forwards (drafter, VAE and reward hidden on another device or stream)."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plots(results, out)
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
