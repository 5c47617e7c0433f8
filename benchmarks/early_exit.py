"""Early exit (Speculative Forcing) against the full 4-step loop, and composed with SDVG.

    python benchmarks/early_exit.py --preset cpu-bench --out results/early-exit-cpu
    python benchmarks/early_exit.py --preset cpu-bench --height 128 --width 192 --num-blocks 5 \
        --out results/early-exit-cpu-128x192

--height / --width change the preset's resolution (more tokens per block): on a CPU, a block of few
tokens leaves the DiT's matmuls bound by reading the weights, which early exit cannot shrink, so the
ratio to the ideal rises with the tokens per block.

Random weights say nothing about which tokens converge, so the `pattern` verifier exits a fixed,
seeded share of tokens per step with the paper's mean of 1.65 steps (`--mean-steps`). Measured side
by side in one process, each the median of --repeats runs after a warm-up:

  target        target-only, the full loop (4 steps + the t = 0 commit per block)
  target+exit   target-only with early exit in the target
  sdvg          SDVG at the paper's 73.1% acceptance (a fixed decision pattern)
  sdvg+exit     the same SDVG with early exit in the target (forced and rejected blocks get cheaper)

The four run in rounds (one video of each per round, a warm-up round first), medians per run.

The ideal speed-up of the target's work is 5 / (k_bar + 1) (docs/early-exit.md, "Cost"); the measured
one is the target stages' time (denoise + commit) of `target` over `target+exit`, and `of_ideal` their
ratio (goal: >= 0.85). The whole-video speed-ups (VAE and reward included) are reported beside it.
Writes results.json and results.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import provenance, provenance_line  # noqa: E402
from sdvg.generation.routers import acceptance_pattern  # noqa: E402
from sdvg.pipeline import SpeculativeVideoPipeline  # noqa: E402

PAPER_ACCEPTANCE = 0.731
PROMPT = "a red fox running through fresh snow at dawn, cinematic"


def once(pipe, **options) -> tuple[float, float, dict]:
    """(wall s, target stage s (denoise + commit), stats) of one video."""
    t0 = time.perf_counter()
    out = pipe(PROMPT, output_type="latent", **options)
    wall = time.perf_counter() - t0
    stats = out.stats.as_dict()
    target_s = stats["result"]["stage_totals"]["target"] + sum(b["times"]["target_commit"] for b in stats["blocks"])
    return wall, target_s, stats


def run_interleaved(pipe, plan: dict, repeats: int) -> dict:
    """Each configuration of `plan` once per round, rounds repeated (a warm-up round first, not counted), so
    that a noisy machine slows every configuration alike; medians per configuration."""
    for kw in plan.values():
        once(pipe, **kw)  # warm-up
    samples: dict = {name: [] for name in plan}
    for _ in range(repeats):
        for name, kw in plan.items():
            samples[name].append(once(pipe, **kw))
    runs = {}
    for name, got in samples.items():
        stats = got[-1][2]
        res = stats["result"]
        runs[name] = {"wall_s": statistics.median(w for w, _, _ in got),
                      "target_stage_s": statistics.median(t for _, t, _ in got),
                      "walls": [w for w, _, _ in got], "target_stages": [t for _, t, _ in got],
                      "mean_steps": res["mean_steps"], "max_steps": res["max_steps"],
                      "acceptance_rate": res["acceptance_rate"], "target_forwards": res["target_forwards"],
                      "exit_roles": res["exit_roles"], "decisions": [b["decision"] for b in stats["blocks"]]}
        print(f"{name}: {runs[name]['wall_s']:.3f} s (target stages {runs[name]['target_stage_s']:.3f} s, "
              f"k_bar {runs[name]['mean_steps']})", flush=True)
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-bench")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-blocks", type=int, default=None, help="default: the preset's")
    ap.add_argument("--height", type=int, default=None, help="pixel height (default: the preset's)")
    ap.add_argument("--width", type=int, default=None, help="pixel width (default: the preset's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mean-steps", type=float, default=1.65, help="the pattern verifier's mean steps")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", default="results/early-exit")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from sdvg.config import get_preset

    video = get_preset(args.preset).video
    size = {k: v for k, v in (("height", args.height), ("width", args.width)) if v is not None}
    changes = {"video": dataclasses.replace(video, **size)} if size else {}
    pipe = SpeculativeVideoPipeline.from_preset(args.preset, device=args.device, **changes)
    tokens = pipe.preset.video.frames_per_block * pipe.preset.video.tokens_per_frame(pipe.preset.vae,
                                                                                   pipe.preset.target)
    n = args.num_blocks or pipe.preset.video.num_blocks
    pattern = "".join("1" if a else "0" for a in acceptance_pattern(n, PAPER_ACCEPTANCE))
    common = dict(num_blocks=n, seed=args.seed, scheduler="cpp")
    exit_kw = dict(early_exit="target", exit_verifier="pattern", exit_pattern_steps=args.mean_steps)
    sdvg_kw = dict(mode="sdvg", router="pattern", pattern=pattern)
    plan = {"target": dict(mode="target"), "target+exit": dict(mode="target", **exit_kw),
            "sdvg": sdvg_kw, "sdvg+exit": dict(**sdvg_kw, **exit_kw)}
    runs = run_interleaved(pipe, {name: {**common, **kw} for name, kw in plan.items()}, args.repeats)

    k_bar = runs["target+exit"]["mean_steps"]
    steps = pipe.preset.timesteps
    ideal = (len(steps) + 1) / (k_bar + 1)
    measured = runs["target"]["target_stage_s"] / runs["target+exit"]["target_stage_s"]
    results = {
        "provenance": provenance(seed=args.seed, prompt=PROMPT, device=args.device),
        "preset": args.preset, "num_blocks": n, "height": pipe.preset.video.height, "width": pipe.preset.video.width,
        "tokens_per_block": tokens, "threads": torch.get_num_threads(), "repeats": args.repeats,
        "verifier": "pattern", "requested_mean_steps": args.mean_steps, "acceptance_pattern": pattern,
        "k_bar": k_bar, "ideal_target_speedup": ideal, "measured_target_speedup": measured,
        "of_ideal": measured / ideal,
        "wall_speedup_target": runs["target"]["wall_s"] / runs["target+exit"]["wall_s"],
        "sdvg_exit_vs_sdvg": runs["sdvg"]["wall_s"] / runs["sdvg+exit"]["wall_s"],
        "sdvg_exit_vs_target": runs["target"]["wall_s"] / runs["sdvg+exit"]["wall_s"],
        "sdvg_vs_target": runs["target"]["wall_s"] / runs["sdvg"]["wall_s"],
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    prov = results["provenance"]
    lines = [f"# Early exit: {args.preset} at {results['width']}x{results['height']} ({tokens} target tokens per block), "
             f"{n} blocks, {prov['device_name']} ({prov['date']})", "", provenance_line(prov), "",
             f"Pattern verifier at a requested mean of {args.mean_steps} steps: measured k_bar {k_bar:.3f}.", "",
             "| run | wall s | target stages s | k_bar | acceptance |", "|---|---|---|---|---|"]
    for name, r in runs.items():
        acc = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}"
        lines.append(f"| {name} | {r['wall_s']:.3f} | {r['target_stage_s']:.3f} | {r['mean_steps'] or 4:.3f} | {acc} |")
    lines += ["", f"Target stages (denoise + commit): measured {measured:.2f}x, ideal 5 / (k_bar + 1) = {ideal:.2f}x, "
              f"measured / ideal {measured / ideal:.2f} (goal >= 0.85).",
              f"Whole video, target-only: {results['wall_speedup_target']:.2f}x with early exit.",
              f"SDVG at 73.1%: {results['sdvg_vs_target']:.2f}x over target-only; with early exit in the target "
              f"{results['sdvg_exit_vs_target']:.2f}x over target-only ({results['sdvg_exit_vs_sdvg']:.2f}x over plain "
              "SDVG).", "", "Eager PyTorch, cpp scheduler, one device, fp32; medians of "
              f"{args.repeats} interleaved rounds after a warm-up round, all in one process."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
