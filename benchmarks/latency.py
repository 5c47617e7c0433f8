"""Latency of target-only, draft-only and SDVG (forced acceptance patterns) on one preset.

    python benchmarks/latency.py --preset cpu-bench --out results/latency-cpu
    python benchmarks/latency.py --preset real-size --device cuda:0 --out results/latency-h200

Random weights cannot be trusted to accept anything meaningful, so SDVG runs with fixed,
seeded decision patterns (0%, 50%, the paper's 73.1%, 100% of blocks 1..B-1) and is timed at a
known acceptance rate. Every stage is timed with the device synchronised before and after it;
a warm-up run is excluded; the median of --repeats runs is reported.

Three labelled floors per run (docs/cost-model.md), built from per-block stage costs: a target-made
block b costs what the target-only run paid for block b (attention grows with the block index; under
a recompute context that includes its context forward), each target commit the target-only run's mean
commit; the drafter lane (draft + drafter commit) and the VAE + reward work are this run's own:
  sequential       every stage counted, one after another (what one device can reach);
  drafter_hidden   the drafter lane hidden on a second device: target side + VAE + reward;
  target_side      the target's work only (both sides of a comparison counted alike).
`floor_s` / `floor_ratio` use the floor the measured placement could reach: sequential on one device,
drafter_hidden when drafter and target have their own devices.
Writes results.json, results.csv, results.md (after every run), timeline.png (the measured stage
calls of SDVG at 73.1%, one panel per variant) and speedup.png. With --budget-s or --deadline it
measures target-only and SDVG at 73.1% first, then the rest while time allows. The run-ahead variant
runs SDVG only (target-only has no second role to run ahead of: it is the eager target-only run);
each variant's warm-up time (a compile variant's compilation) is recorded under `warmup_s`.
`main(argv, pipe=...)` measures a pipeline built by the caller (benchmarks/gpu_check.py builds
the models once for every benchmark).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from sdvg.config import get_preset  # noqa: E402
from sdvg.models.components import build_random  # noqa: E402
from sdvg.pipeline import SpeculativeVideoPipeline  # noqa: E402
from sdvg.generation.routers import acceptance_pattern  # noqa: E402
from sdvg.evaluation.timeline import decisions_of, plot_timeline  # noqa: E402

from sdvg.generation.types import STAGE_NAMES as STAGES  # noqa: E402
from provenance import provenance, provenance_line  # noqa: E402
PAPER_ACCEPTANCE = 0.731
PROMPT = "a red fox running through fresh snow at dawn, cinematic"


def peak_memory(devices) -> dict:
    out = {}
    for d in devices:
        if d.type == "cuda":
            out[str(d)] = torch.cuda.max_memory_allocated(d) / 2**30
    out["host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


MAIN_VARIANT = ("eager", "cpp", False, ())
# --variants: name -> (backend, scheduler, run_ahead, other options as sorted (name, value) pairs)
VARIANTS = {"reference": ("eager", "reference", False, ()), "run-ahead": ("eager", "cpp", True, ()),
            "compile": ("compile", "cpp", False, ()), "tensorrt": ("tensorrt", "cpp", False, ()),
            "fp8": ("eager", "cpp", False, (("quantization", "fp8"),)),
            "fp8-compile": ("compile", "cpp", False, (("quantization", "fp8"),)),
            "graphs": ("eager", "cpp", False, (("cuda_graphs", True),))}
# variants measured as SDVG only, against the main target-only run: they change nothing a target-only video runs
SDVG_ONLY = {VARIANTS["run-ahead"], VARIANTS["graphs"]}


def run_once(pipe, mode, num_blocks, pattern=None, variant=MAIN_VARIANT):
    backend, scheduler, run_ahead, options = variant
    kw = dict(mode=mode, num_blocks=num_blocks, seed=0, backend=backend, scheduler=scheduler, run_ahead=run_ahead,
              **dict(options))
    if mode == "sdvg":
        kw.update(router="pattern", pattern=pattern)
    t0 = time.perf_counter()
    stats = pipe(PROMPT, **kw).stats.as_dict()
    for d in {pipe.components.drafter_device, pipe.components.target_device}:
        if d.type == "cuda":
            torch.cuda.synchronize(d)
    stats["result"]["wall_s"] = time.perf_counter() - t0  # the call's wall time, the devices synchronised
    return stats


def summarise(mode, rate, runs, variant=MAIN_VARIANT):
    backend, scheduler, run_ahead, options = variant
    walls = [r["result"]["wall_s"] for r in runs]
    med = runs[walls.index(sorted(walls)[len(walls) // 2])]
    res, opts = med["result"], med["options"]
    stages = {k: sum(b["times"].get(k, 0.0) for b in med["blocks"]) for k in STAGES}
    stages["overhead"] = res["wall_s"] - sum(stages.values())
    return {
        "mode": mode, "backend": backend, "scheduler": scheduler, "run_ahead": run_ahead, "options": dict(options),
        "acceptance": rate, "compile": res["compile"],
        "target_context": opts["target_context"], "drafter_context": opts["drafter_context"],
        "wall_s": statistics.median(walls), "wall_all_s": walls, "stages": stages,
        "decisions": [b["decision"] for b in med["blocks"]],
        "target_forwards": res["target_forwards"], "drafter_forwards": res["drafter_forwards"],
        "skipped_target_commits": res["skipped_target_commits"],
        "timeline": [{"index": b["index"], "decision": b["decision"], "times": b["times"]} for b in med["blocks"]],
        "trace": med.get("trace", []),  # every stage call: block, stage, thread, start_s, end_s
    }


def variant_of(run) -> tuple:
    return run["backend"], run["scheduler"], run["run_ahead"], tuple(sorted(run.get("options", {}).items()))


FLOOR_LABELS = {"sequential": "sequential on one device (every stage)",
                "drafter_hidden": "drafter lane hidden on a second device",
                "target_side": "target side only"}


def variant_name(backend, scheduler, run_ahead, options=()) -> str:
    extra = "".join(f", {k}" if v is True else f", {v}" for k, v in options)
    return f"{backend}, {scheduler}" + (" run-ahead" if run_ahead else "") + extra


TARGET_MADE = ("forced", "rejected", "target")


def commit_calls(run) -> int:
    """Target commit calls of a run (from its trace; the last block is never committed)."""
    return sum(x["stage"] == "target_commit" for x in run.get("trace", []))


def floors(run, tgt) -> dict:
    """The three floors of `run` (see the module doc), from per-block costs: the target side from the
    target-only run `tgt` at the same block indices, the drafter lane and VAE + reward from `run` itself."""
    per_block = [b["times"] for b in tgt["timeline"]]
    mine = [b["times"] for b in run["timeline"]]
    made = [i for i, d in enumerate(run["decisions"]) if d in TARGET_MADE]
    tgt_commits = commit_calls(tgt)
    mean_commit = sum(b["target_commit"] for b in per_block) / tgt_commits if tgt_commits else 0.0
    target_side = sum(per_block[i]["target"] for i in made) + commit_calls(run) * mean_commit
    vae_reward = sum(b["decode"] + b["score"] for b in mine)
    drafter = sum(b["draft"] + b["drafter_commit"] for b in mine)
    return {"sequential": target_side + vae_reward + drafter, "drafter_hidden": target_side + vae_reward,
            "target_side": target_side if run["mode"] != "draft" else drafter}


def plots(results, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    tgt = runs[0]
    sd = [r for r in runs if r["mode"] == "sdvg" and variant_of(r) == variant_of(tgt)]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["acceptance"] for r in sd]
    ax.plot(xs, [tgt["wall_s"] / r["wall_s"] for r in sd], "o-", label=f"measured ({tgt['backend']}, {tgt['scheduler']} scheduler)")
    for name, style in (("sequential", "s--"), ("drafter_hidden", "^--"), ("target_side", "v:")):
        ax.plot(xs, [tgt["floors"][name] / r["floors"][name] for r in sd], style,
                label=f"floor: {FLOOR_LABELS[name]} (both sides)")
    for v in results["variants"]:  # the other variants at the paper's rate, each over its own target-only
        if variant_of(v) != variant_of(tgt):
            ax.plot([v["acceptance"]], [v["speedup_vs_target"]], "D", label=variant_name(*variant_of(v)))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("acceptance rate (blocks 1..B-1)")
    ax.set_ylabel("speed-up over target-only")
    ax.set_title(f"{results['preset']} on {results['device_name']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)

    # The measured timeline of SDVG at the paper's rate, one panel per variant: every stage call
    # where it really ran (run-ahead shows the drafter's calls beside the target's).
    panels = []
    for key in dict.fromkeys(variant_of(r) for r in runs):
        cand = [r for r in runs if r["mode"] == "sdvg" and r.get("trace") and variant_of(r) == key]
        if cand:
            run = min(cand, key=lambda r: abs(r["acceptance"] - PAPER_ACCEPTANCE))
            panels.append({"title": f"{variant_name(*key)}: {run['wall_s']:.2f} s at {run['acceptance']:.0%} "
                                    "acceptance", "trace": run["trace"], "decisions": decisions_of(run["timeline"])})
    if panels:
        plot_timeline(panels, out / "timeline.png")


def assemble(runs, meta):
    """Results dict from the runs measured so far (runs[0] is target-only, eager, cpp, sequential)."""
    tgt = runs[0]
    n = meta["num_blocks"]
    per_step = tgt["stages"]["target"] / (4 * n)
    commits = commit_calls(tgt)
    per_commit = tgt["stages"]["target_commit"] / max(1, commits)
    placement = "drafter_hidden" if meta.get("two_devices") else "sequential"
    for r in runs:
        r["floors"] = floors(r, tgt)
        r["floor_placement"] = placement
        r["floor_s"] = r["floors"][placement]
        r["floor_ratio"] = r["wall_s"] / r["floor_s"] if r["floor_s"] else None
    def nearest_paper(rs):
        return min(rs, key=lambda r: abs(r["acceptance"] - PAPER_ACCEPTANCE))

    main_sdvg = [r for r in runs if r["mode"] == "sdvg" and variant_of(r) == variant_of(tgt)]
    paper = nearest_paper(main_sdvg) if main_sdvg else None
    by_variant = {}
    for r in runs:
        by_variant.setdefault(variant_of(r), {}).setdefault(r["mode"], []).append(r)
    variant_speedups = []
    for (b, s_, ra, options), d in by_variant.items():
        if "sdvg" in d and ("target" in d or (b, s_, ra, options) in SDVG_ONLY):  # those: the main target-only run
            sd, base = nearest_paper(d["sdvg"]), d.get("target", [tgt])[0]
            variant_speedups.append({"backend": b, "scheduler": s_, "run_ahead": ra, "options": dict(options),
                                     "name": variant_name(b, s_, ra, options), "target_s": base["wall_s"],
                                     "sdvg_s": sd["wall_s"], "acceptance": sd["acceptance"],
                                     "speedup_vs_target": base["wall_s"] / sd["wall_s"]})
    return {
        **meta,
        "variants": variant_speedups,
        "per_target_step_s": per_step, "per_target_commit_s": per_commit,
        "speedup_vs_target": tgt["wall_s"] / paper["wall_s"] if paper else None,
        "speedup_vs_target_acceptance": paper["acceptance"] if paper else None,
        "floor_ratio": paper["floor_ratio"] if paper else None,
        "floor_placement": placement,
        "floor_speedup_vs_target": tgt["floor_s"] / paper["floor_s"] if paper else None,
        "floor_speedups_vs_target": {k: tgt["floors"][k] / paper["floors"][k] for k in FLOOR_LABELS
                                     if paper and paper["floors"][k]} if paper else None,
        "runs": runs,
    }, by_variant


def write_results(results, by_variant, out: Path, final: bool):
    """results.json/csv/md after every run (a run cut short by a time limit keeps what it measured); plots at the end."""
    runs = results["runs"]
    tgt = runs[0]
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
    lines = [f"# Latency: {results['preset']}, {results['num_blocks']} blocks, {results['device_name']} "
             f"({results['date']})", "", provenance_line(results["provenance"]), "",
             "| mode | backend (+ options) | scheduler | acceptance | wall s | speed-up vs target (same variant) | "
             "floor s: sequential | drafter hidden | target side | wall / floor (placement) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.1%}"
        base = by_variant[variant_of(r)].get("target", [tgt])[0]
        sched = r["scheduler"] + (" run-ahead" if r["run_ahead"] else "")
        f = r["floors"]
        backend = r["backend"] + "".join(f" + {k}" if v is True else f" + {v}" for k, v in r.get("options", {}).items())
        lines.append(f"| {r['mode']} | {backend} | {sched} | {acc} | {r['wall_s']:.3f} | "
                     f"{base['wall_s'] / r['wall_s']:.2f}x | {f['sequential']:.3f} | {f['drafter_hidden']:.3f} | "
                     f"{f['target_side']:.3f} | {r['floor_ratio']:.2f} ({r['floor_placement']}) |")
    if results["speedup_vs_target"] is not None:
        lines += ["", f"SDVG at {results['speedup_vs_target_acceptance']:.1%} acceptance: "
                  f"{results['speedup_vs_target']:.2f}x over target-only (floor {results['floor_speedup_vs_target']:.2f}x "
                  f"at the measured placement, {results['floor_placement']}; measured/floor {results['floor_ratio']:.2f}); "
                  "eager PyTorch, cpp scheduler, sequential. Floor speed-ups, each side at the same floor: "
                  + ", ".join(f"{FLOOR_LABELS[k]} {v:.2f}x" for k, v in results["floor_speedups_vs_target"].items())
                  + ". Target-made blocks cost what target-only paid at the same block index."]
    if results.get("skipped"):
        lines += ["", "Not run (time budget): " + ", ".join(results["skipped"])]
    if not final:
        lines += ["", "(partial: the benchmark is still running or was stopped)"]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    if final and results["speedup_vs_target"] is not None:
        plots(results, out)
    return lines


def run_label(mode, rate, variant):
    acc = "" if rate is None else f"@{rate:.1%}"
    return f"{mode}{acc} ({variant_name(*variant)})"


def main(argv=None, pipe=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-bench")
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--target-device", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rates", default="0,0.5,0.731,1.0")
    ap.add_argument("--out", default="results/latency")
    ap.add_argument("--variants", default="reference,run-ahead",
                    help="extra runs of target-only and SDVG at 73.1%%: " + ", ".join(VARIANTS) + " (run-ahead and "
                         "graphs: SDVG only)")
    ap.add_argument("--warmup-blocks", type=int, default=None,
                    help="blocks of each variant's warm-up SDVG video (default: the whole video); a compile "
                         "variant compiles every shape within 2 blocks")
    ap.add_argument("--engines", default=None, help="engine folder for the tensorrt variant")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no run (or warm-up) that would end past this many seconds after the models are "
                         "built; target-only and SDVG at 73.1%% are always measured, then the rest in order "
                         "while time allows; the ones left out are listed under 'skipped'")
    ap.add_argument("--reuse", default=None,
                    help="results.json of an earlier run on this pipeline (same process): its eager target-only and "
                         "SDVG-at-73.1%% runs are taken from there instead of measured again (gpu_check.py's compile "
                         "step)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="the same as an absolute time (seconds since the epoch, as `date +%%s` prints)")
    args = ap.parse_args(argv)

    preset = get_preset(args.preset)
    n = args.num_blocks or preset.video.num_blocks
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    unknown = [v for v in args.variants.split(",") if v and v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    t_build = time.perf_counter()
    if pipe is None:
        # random_init "device": timings do not depend on which random model, and a host draw of real-size's
        # 15.4B values takes about 100 s
        pipe = SpeculativeVideoPipeline(build_random(preset, drafter_device=args.device, target_device=args.target_device,
                                                     random_init="device"), engines=args.engines)
    elif pipe.preset.name != preset.name:
        raise ValueError(f"the pipeline given is preset {pipe.preset.name!r}, --preset {preset.name!r}")
    build_s = time.perf_counter() - t_build
    comps = pipe.components
    devices = {comps.drafter_device, comps.target_device}
    rates = [float(x) for x in args.rates.split(",")]
    patterns = {r: acceptance_pattern(n, r, seed=0) for r in rates}
    paper_rate = min(rates, key=lambda r: abs(r - PAPER_ACCEPTANCE))

    main_variant = MAIN_VARIANT
    variants = [VARIANTS[v] for v in args.variants.split(",") if v]
    # (mode, rate, variant) in the order they are reported; measured most important first
    plan = [("target", None, main_variant), ("draft", None, main_variant)]
    plan += [("sdvg", r, main_variant) for r in rates]
    for v in variants:
        if v not in SDVG_ONLY:  # target-only run-ahead (or with drafter graphs) is the main target-only run
            plan.append(("target", None, v))
        plan.append(("sdvg", paper_rate, v))  # same pattern as the main run
    # measured in this order: target-only, SDVG at 73.1%, then each variant (its SDVG at 73.1% before
    # its target-only), then the rest
    first = [plan[0], ("sdvg", paper_rate, main_variant)]
    then = [(m, r, v) for v in variants for m, r in (("sdvg", paper_rate), ("target", None)) if (m, r, v) in plan]
    order = first + [p for p in then if p not in first]
    order += [p for p in plan if p not in order]

    dev0 = comps.target_device
    meta = {
        "preset": preset.name, "num_blocks": n, "precision": preset.precision,
        "device_name": torch.cuda.get_device_name(dev0) if dev0.type == "cuda" else platform.processor() or "cpu",
        "devices": [str(d) for d in devices], "torch": torch.__version__, "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "build_s": build_s,
        "budget_s": args.budget_s, "deadline": args.deadline,
        "two_devices": comps.drafter_device != comps.target_device,
        "target_context": preset.target_context,
        "provenance": provenance(seed=0, prompt=PROMPT, device=dev0),
    }
    t0 = time.perf_counter()
    longest = 0.0  # longest single video so far: the estimate for the next one

    def fits(videos: int) -> bool:
        need = videos * longest
        if args.deadline is not None and time.time() + need > args.deadline:
            return False
        return args.budget_s is None or (time.perf_counter() - t0) + need <= args.budget_s

    def measure(mode, rate, v):
        nonlocal longest
        pattern = patterns[rate] if mode == "sdvg" else None
        repeats = []  # the stats of each repeat
        for _ in range(args.repeats):
            repeats.append(run_once(pipe, mode, n, pattern, v))
            longest = max(longest, repeats[-1]["result"]["wall_s"])
        run = summarise(mode, rate, repeats, v)
        if mode == "sdvg":
            if run["decisions"][1:] != ["accepted" if p else "rejected" for p in pattern[1:]]:
                raise AssertionError("forced pattern not followed")
            run["acceptance"] = sum(d == "accepted" for d in run["decisions"][1:]) / max(1, n - 1)
        return run

    reused = {}  # (mode, rate, variant) -> a run taken from --reuse
    if args.reuse:
        old = [r for r in json.loads(Path(args.reuse).read_text())["runs"] if tuple(variant_of(r)) == main_variant]
        tgt_old = [r for r in old if r["mode"] == "target"]
        sdvg_old = [r for r in old if r["mode"] == "sdvg"]
        if tgt_old:
            reused[("target", None, main_variant)] = tgt_old[0]
        if sdvg_old:
            reused[("sdvg", paper_rate, main_variant)] = min(sdvg_old,
                                                             key=lambda r: abs(r["acceptance"] - paper_rate))
    meta["reused"] = [run_label(*k) for k in reused]
    if args.reuse:  # the main variant's runs come from there only: this call measures the variants
        order = [p for p in order if p[2] != main_variant or p in reused]
    warm = set()
    meta["warmup_s"] = {}  # variant -> its warm-up video's seconds (a compile variant: its compilation)
    done, skipped = {}, []
    results, by_variant = None, None
    for item in order:
        mode, rate, v = item
        if item in reused:
            done[item] = reused[item]
            continue
        if v not in warm:  # warm-up (all stages; compiles), excluded from the timings
            if warm and not fits(1 + args.repeats):
                skipped.append(run_label(*item))
                continue
            t_w = time.perf_counter()
            warm_n = min(n, args.warmup_blocks or n)
            warm_stats = run_once(pipe, "sdvg", warm_n, acceptance_pattern(warm_n, 0.5, seed=0), v)
            warm.add(v)
            meta["warmup_s"][variant_name(*v)] = time.perf_counter() - t_w
            if warm_stats["result"]["compile"] is not None:  # what compiling cost (cold, or from the persistent cache)
                meta.setdefault("warmup_compile", {})[variant_name(*v)] = warm_stats["result"]["compile"]
            if v == main_variant:  # a compiling variant's warm-up says nothing about its runs
                longest = max(longest, time.perf_counter() - t_w)
                for d in devices:
                    if d.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(d)
        if item not in first and not fits(args.repeats):  # target-only and SDVG at 73.1% are always measured
            skipped.append(run_label(*item))
            continue
        done[item] = measure(mode, rate, v)
        print(f"[{time.perf_counter() - t0:7.1f} s] {run_label(*item)}: {done[item]['wall_s']:.3f} s", flush=True)
        runs = [done[p] for p in plan if p in done]
        results, by_variant = assemble(runs, meta)
        results["skipped"] = list(skipped)
        results["peak_memory_gib"] = peak_memory(devices)
        write_results(results, by_variant, out, final=False)
    results["skipped"] = skipped
    lines = write_results(results, by_variant, out, final=True)
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
