"""The measurements of benchmarks/gpu_check.sh in one process: the models are built once and every
variant is measured on that pipeline against the eager baseline, each step in its own time box.

    python benchmarks/gpu_check.py --preset real-size --device cuda:0 --work WORK [--dry-run]

Steps, in order (each box in seconds; an environment variable sets it; a compile warm-up's default box is its
cold one, or its warm one with `--cache warm`: the inductor cache carried from an earlier check):

| step | what | box |
|---|---|---|
| models | `build_random` once (drafter, target, VAE, ImageReward, text encoder; `random_init="device"`) | estimate only |
| eager | latency.py: target-only, SDVG at 73.1%, draft-only, eager bf16 (the baseline) | EAGER_S |
| compile_warmup | a 2-block SDVG video with backend compile: every graph compiled (cold, or from the persistent inductor cache); its `compile` statistics | COMPILE_WARMUP_S |
| compile | latency.py variant compile: target-only, SDVG at 73.1% | COMPILE_S |
| fp8 | both DiTs quantized (seconds recorded), latency.py variant fp8 | FP8_S |
| fp8_compile_warmup | as compile_warmup, FP8 DiTs | FP8_COMPILE_WARMUP_S |
| fp8_compile | latency.py variant fp8-compile | FP8_COMPILE_S |
| fp8_quality | fp8_quality.py: each role's per-forward error, a 2-block video's latent channel statistics, tiny SDVG decisions | FP8_QUALITY_S |
| profile | kernel_profile.py: kernel classes and device-busy fraction of 2-block videos per variant | PROFILE_S |
| graphs | latency.py variant graphs (the drafter's CUDA graphs): SDVG at 73.1% | GRAPHS_S |

latency.py stops starting runs at its box's end (`--deadline`); every step is also stopped by an alarm
(SIGALRM: at the next Python instruction, so a call into native code finishes first; gpu_check.sh's
`timeout` is the backstop). Each writes its results after every unit, so what was measured stays; a
step's failure is recorded and the next step runs. A step that would start with less than MIN_STEP_S
left is skipped and said so. Every step's files go under WORK (gpu_check.sh packs WORK into one
tarball); `summary.json` there lists each step's status, seconds and headline numbers, and
`summary.md` the table of every variant against the eager baseline and the goals.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MIN_STEP_S = 8
PAPER_RATE = "0.731"


@dataclass(frozen=True)
class Step:
    name: str
    box_env: str
    box_s: int  # default time box (real-size on one H200; for a compile warm-up: a cold inductor cache)
    what: str
    warm_box_s: int | None = None  # the default box when the inductor cache is warm (carried from an earlier check)


STEPS = (
    Step("eager", "EAGER_S", 55, "eager baseline: target-only, SDVG at 73.1%, draft-only"),
    Step("compile_warmup", "COMPILE_WARMUP_S", 180, "backend compile: a 2-block video compiles every graph "
                                                   "(persistent inductor cache)", warm_box_s=40),
    Step("compile", "COMPILE_S", 30, "compile: target-only, SDVG at 73.1%"),
    Step("fp8", "FP8_S", 40, "FP8 DiTs: quantize, target-only, SDVG at 73.1%"),
    Step("fp8_compile_warmup", "FP8_COMPILE_WARMUP_S", 90, "FP8 + compile: a 2-block video compiles its graphs",
         warm_box_s=25),
    Step("fp8_compile", "FP8_COMPILE_S", 25, "FP8 + compile: target-only, SDVG at 73.1%"),
    Step("fp8_quality", "FP8_QUALITY_S", 25, "FP8 quality gate: per-forward error, latent channel statistics, "
                                              "decisions (fp8_quality.py)"),
    Step("profile", "PROFILE_S", 30, "kernel classes and device-busy fraction per variant (2-block videos)"),
    Step("graphs", "GRAPHS_S", 20, "the drafter's CUDA graphs: SDVG at 73.1%"),
    Step("sessions", "SESSIONS_S", 60, "4 live sessions batched against one after another, 3 blocks at 75% "
                                       "(batched_sessions.py): aggregate frames/s, decisions equal"),
)
MODELS_S = {"real-size": 26, "wan2.1": 60}  # estimate of building the models (others: a few seconds)
# the goals of one H200 at real size, 9 blocks (docs/engines.md): eager target-only measured 22.04 s
GOALS = {"target_s": 13.8, "sdvg_s": 8.0, "eager_sdvg_s": 13.95, "compile_cold_s": 90.0, "compile_warm_s": 15.0,
         "target_busy": 0.90, "drafter_busy": 0.75}


def boxes(env=os.environ, warm_cache: bool = False) -> dict[str, int]:
    """Each step's time box: its variable when set, else its default for a cold or a warm inductor cache."""
    def default(s: Step) -> int:
        return s.warm_box_s if warm_cache and s.warm_box_s is not None else s.box_s

    return {s.name: int(env.get(s.box_env, default(s))) for s in STEPS}


class StepTimeout(Exception):
    """A step's time box ended."""


def _alarm(signum, frame):
    raise StepTimeout()


def _timed_out(exc: BaseException) -> bool:
    """Whether `exc` is the box's alarm, also when a library wrapped it (inductor re-raises it as its own)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, StepTimeout):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def run_boxed(fn, seconds: float):
    """`fn()` stopped by SIGALRM after `seconds` (main thread): (status, seconds taken)."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    t0 = time.perf_counter()
    try:
        fn()
        status = "done"
    except Exception as exc:  # one benchmark's failure must not lose the others
        if _timed_out(exc):
            status = "stopped at its time box (results so far kept)"
        else:
            traceback.print_exc()
            status = f"failed: {type(exc).__name__}: {str(exc)[:400]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return status, time.perf_counter() - t0


def plan_lines(preset: str, steps, box: dict[str, int], models_s: int) -> list[str]:
    lines = [f"  {'models':<19} {models_s:5d} s  build the models once (estimate)"]
    for s in STEPS:
        if s.name in steps:
            lines.append(f"  {s.name:<19} {box[s.name]:5d} s  {s.what} ({s.box_env})")
    return lines


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def variant_rows(work: Path) -> list[dict]:
    """One row per variant measured: target-only and SDVG at 73.1% seconds, frames/s, speed-ups against the
    eager target-only run, compile warm-up and profile numbers."""
    base = _json(work / "eager" / "results.json")
    runs = list(base.get("runs", []))
    for name in ("compile", "fp8", "fp8-compile", "graphs"):
        runs += [r for r in _json(work / name / "results.json").get("runs", [])
                 if (r["backend"], r.get("options", {})) != ("eager", {})]
    eager_target = next((r["wall_s"] for r in runs if r["mode"] == "target" and r["backend"] == "eager"
                         and not r.get("options")), None)
    rows = {}
    for r in runs:
        key = r["backend"] + "".join(f" + {k}" if v is True else f" + {v}" for k, v in r.get("options", {}).items())
        row = rows.setdefault(key, {"variant": key})
        if r["mode"] == "target":
            row["target_s"] = r["wall_s"]
        elif r["mode"] == "sdvg" and not r["run_ahead"]:
            row["sdvg_s"], row["acceptance"] = r["wall_s"], r["acceptance"]
        elif r["mode"] == "draft":
            row["draft_s"] = r["wall_s"]
    for row in rows.values():
        if eager_target:
            for k in ("target_s", "sdvg_s"):
                if k in row:
                    row[k.replace("_s", "_speedup_vs_eager_target")] = eager_target / row[k]
    return list(rows.values())


def write_summary_md(summary: dict, work: Path) -> None:
    rows = variant_rows(work)
    n_frames = summary.get("frames")
    lines = [f"# GPU check: {summary['preset']}, {summary['num_blocks']} blocks on {summary['device']}", "",
             "| variant | target-only s | SDVG at 73.1% s | frames/s (SDVG) | target / eager target | "
             "eager target / SDVG | draft-only s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        fps = f"{n_frames / r['sdvg_s']:.1f}" if n_frames and r.get("sdvg_s") else ""
        lines.append(f"| {r['variant']} | {r.get('target_s', float('nan')):.2f} | {r.get('sdvg_s', float('nan')):.2f} | "
                     f"{fps} | {r.get('target_speedup_vs_eager_target', float('nan')):.2f}x | "
                     f"{r.get('sdvg_speedup_vs_eager_target', float('nan')):.2f}x | "
                     f"{r.get('draft_s', float('nan')):.2f} |")
    for name in ("compile_warmup", "fp8_compile_warmup"):
        w = summary["steps"].get(name, {}).get("headline") or {}
        if w:
            lines.append(f"\n{name}: {w.get('wall_s', float('nan')):.1f} s for a {w.get('blocks')}-block video; "
                         f"compile statistics {w.get('compile')}; latents vs eager: max relative "
                         f"{w.get('rel_max_diff_vs_eager', float('nan')):.2e}, mean relative "
                         f"{w.get('rel_mean_diff_vs_eager', float('nan')):.2e}")
    fp8 = summary["steps"].get("fp8", {}).get("headline") or {}
    if fp8:
        lines.append(f"\nFP8: both DiTs quantized in {fp8.get('quantize_s', float('nan')):.1f} s ({fp8.get('impl')})")
    gate = summary["steps"].get("fp8_quality", {}).get("headline") or {}
    if gate:
        lines.append(f"\nFP8 quality gate: {'passed' if gate.get('passed') else 'FAILED'}: per-forward relative error "
                     f"{gate.get('forward_relative_error')}, latent channel mean shift {gate.get('max_mean_shift_in_std')} "
                     f"std, std change {gate.get('max_std_change')}; tiny SDVG decisions {gate.get('decisions')}")
    sessions = _json(work / "sessions" / "results.json")
    if sessions:
        lines.append(f"\n{sessions['sessions']} live sessions, {sessions['num_blocks']} blocks at 75%: one after another "
                     f"{sessions['alone_frames_per_s']:.1f} frames/s, batched {sessions['batched_frames_per_s']:.1f} "
                     f"frames/s ({sessions['speedup']:.2f}x); decisions equal {sessions['decisions_equal']}, max latent "
                     f"difference {sessions['max_abs_latent_diff']:.3g}, frames within "
                     f"{sessions['max_frame_level_diff']} levels")
    prof = _json(work / "profile" / "results.json").get("runs", [])
    if prof:
        lines += ["", "| profile: variant | mode | device busy | gemm | attention | copy | fused | elementwise | "
                  "norm | conv | other |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in prof:
            if "error" in p:
                lines.append(f"| {p['variant']} | {p['mode']} | failed: {p['error'][:60]} |")
                continue
            s = p["share"]
            lines.append(f"| {p['variant']} | {p['mode']} | {p['busy_fraction']:.0%} | " + " | ".join(
                f"{s.get(c, 0.0):.0%}" for c in ("gemm", "attention", "copy", "fused", "elementwise", "norm", "conv",
                                                 "other")) + " |")
    lines += ["", f"Goals (one H200): target-only <= {GOALS['target_s']} s, SDVG at 73.1% <= {GOALS['sdvg_s']} s, "
              f"eager SDVG <= {GOALS['eager_sdvg_s']} s, compile warm-up <= {GOALS['compile_cold_s']:.0f} s cold and "
              f"<= {GOALS['compile_warm_s']:.0f} s from the persistent cache, device busy >= "
              f"{GOALS['target_busy']:.0%} (target-only) and >= {GOALS['drafter_busy']:.0%} (drafter lane)."]
    (work / "summary.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="real-size")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--num-blocks", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", default=",".join(s.name for s in STEPS))
    ap.add_argument("--work", type=Path, required=True, help="folder every step writes into")
    ap.add_argument("--deadline", type=float, default=None, help="absolute end of all steps (date +%%s)")
    ap.add_argument("--dry-run", action="store_true", help="print the steps and their boxes; run nothing")
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold",
                    help="the inductor cache the compile warm-ups start from (warm: carried from an earlier check); "
                         "sets their default boxes")
    args = ap.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - {s.name for s in STEPS})
    if unknown:
        ap.error(f"unknown step(s) {unknown}; the steps are {', '.join(s.name for s in STEPS)}")
    box = boxes(warm_cache=args.cache == "warm")
    models_s = MODELS_S.get(args.preset, 5)
    if args.dry_run:
        print("\n".join(plan_lines(args.preset, steps, box, models_s)))
        return 0

    import logging

    import torch

    import batched_sessions
    import kernel_profile

    # each compiled part as it compiles, with its seconds: a cold start's cost even when a box ends it
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    compile_log = logging.getLogger("sdvg.generation.compile")
    compile_log.setLevel(logging.INFO)
    compile_log.addHandler(handler)
    import latency
    from sdvg.config import get_preset
    from sdvg.models.components import build_random
    from sdvg.pipeline import SpeculativeVideoPipeline

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    summary = {"preset": args.preset, "device": args.device, "num_blocks": args.num_blocks, "boxes_s": box,
               "steps": {}}
    t0 = time.perf_counter()
    # random_init "device": timings do not depend on which random model; a host draw of 15.4B values takes ~100 s
    pipe = SpeculativeVideoPipeline(build_random(get_preset(args.preset), drafter_device=args.device,
                                                 random_init="device"))
    summary["models_s"] = time.perf_counter() - t0
    summary["frames"] = pipe.preset.video.pixel_frames(pipe.preset.vae, args.num_blocks)
    print(f"models built once in {summary['models_s']:.1f} s", flush=True)
    common = ["--preset", args.preset, "--device", args.device, "--repeats", str(args.repeats),
              "--num-blocks", str(args.num_blocks), "--rates", PAPER_RATE]
    base = work / "eager" / "results.json"

    def variant(name: str, end: float):
        reuse = ["--reuse", str(base)] if base.is_file() else []  # else the eager runs are measured here
        return latency.main(common + ["--variants", name, "--warmup-blocks", "2", *reuse,
                                      "--deadline", str(end), "--out", str(work / name)], pipe=pipe)

    reference = {}  # the eager 2-block video every warm-up is compared with

    def warmup(options: dict, name: str):
        """A 2-block SDVG video of the variant: what compiling it costs (cold, or from the persistent cache), and
        how far its latents are from the eager video's (at real size: COMPILE_TOLERANCE's check)."""
        kw = dict(num_blocks=2, seed=0, router="pattern", pattern="01")
        prompt = "a red fox running through fresh snow at dawn, cinematic"
        t = time.perf_counter()
        result = pipe(prompt, **kw, **options)
        out = {"wall_s": time.perf_counter() - t, "blocks": 2, "compile": result.stats["result"]["compile"]}
        (work / f"{name}.json").write_text(json.dumps(out, indent=2))
        if "latents" not in reference:
            reference["latents"] = pipe(prompt, **kw).latents.float()
        ref = reference["latents"]
        diff = (result.latents.float() - ref).abs()
        out.update(max_abs_diff_vs_eager=float(diff.max()), rel_max_diff_vs_eager=float(diff.max() / ref.abs().max()),
                   rel_mean_diff_vs_eager=float(diff.mean() / ref.abs().mean()))
        (work / f"{name}.json").write_text(json.dumps(out, indent=2))
        return out

    def fp8_step(end: float):
        from sdvg.models.fp8 import role_dit

        t = time.perf_counter()
        impls = {role: role_dit(getattr(pipe.components, role), role, True)._sdvg_fp8.impl
                 for role in ("drafter", "target")}  # each FP8 copy made once and kept for every later call
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        head = {"quantize_s": time.perf_counter() - t, "impl": impls}
        (work / "fp8.json").write_text(json.dumps(head, indent=2))
        variant("fp8", end)

    def fp8_quality_step(end: float):
        import fp8_quality

        gate = fp8_quality.main(["--preset", args.preset, "--device", args.device, "--num-blocks", "2",
                                 "--decision-blocks", "5", "--out", str(work / "fp8-quality")], pipe=pipe)
        head = {"passed": bool(gate.get("passed")),
                "forward_relative_error": {r: v["relative_error"] for r, v in gate.get("forward", {}).items()},
                "max_mean_shift_in_std": gate.get("latents", {}).get("max_mean_shift_in_std"),
                "max_std_change": gate.get("latents", {}).get("max_std_change"),
                "decisions": gate.get("decisions", {}).get("decisions")}
        (work / "fp8_quality.json").write_text(json.dumps(head, indent=2))

    runs = {
        "eager": lambda end: latency.main(common + ["--variants", "", "--warmup-blocks", "2", "--deadline", str(end),
                                                    "--out", str(work / "eager")], pipe=pipe),
        "compile_warmup": lambda end: warmup({"backend": "compile"}, "compile_warmup"),
        "compile": lambda end: variant("compile", end),
        "fp8": fp8_step,
        "fp8_quality": fp8_quality_step,
        "fp8_compile_warmup": lambda end: warmup({"backend": "compile", "quantization": "fp8"}, "fp8_compile_warmup"),
        "fp8_compile": lambda end: variant("fp8-compile", end),
        "graphs": lambda end: variant("graphs", end),
        "sessions": lambda end: batched_sessions.main(["--preset", args.preset, "--device", args.device, "--sessions",
                                                       "4", "--num-blocks", "3", "--out", str(work / "sessions")],
                                                      pipe=pipe),
        "profile": lambda end: kernel_profile.main(
            ["--num-blocks", "2", "--no-warmup", "--deadline", str(end), "--out", str(work / "profile"), "--variants",
             ",".join(v for v, s in (("eager", "eager"), ("compile", "compile_warmup"), ("fp8", "fp8"),
                                     ("fp8-compile", "fp8_compile_warmup"), ("graphs", "graphs"))
                      if summary["steps"].get(s, {}).get("status") == "done")], pipe=pipe),
    }
    headlines = {
        "compile_warmup": lambda: _json(work / "compile_warmup.json"),
        "fp8_compile_warmup": lambda: _json(work / "fp8_compile_warmup.json"),
        "fp8": lambda: _json(work / "fp8.json"),
        "fp8_quality": lambda: _json(work / "fp8_quality.json"),
        "sessions": lambda: {k: v for k, v in _json(work / "sessions" / "results.json").items()
                             if k in ("alone_frames_per_s", "batched_frames_per_s", "speedup", "decisions_equal",
                                      "max_abs_latent_diff", "max_frame_level_diff")},
    }
    for name in steps:
        left = None if args.deadline is None else args.deadline - time.time()
        seconds = box[name] if left is None else min(box[name], left)
        if seconds < MIN_STEP_S:
            summary["steps"][name] = {"status": f"skipped: {max(0.0, seconds):.0f} s left of its box"}
            print(f"[{name}] skipped: {max(0.0, seconds):.0f} s left", flush=True)
            continue
        end = time.time() + seconds
        print(f"[{name}] up to {seconds:.0f} s", flush=True)
        # latency.py ends its own runs at `end`; the alarm (a little later) is the backstop
        status, took = run_boxed(lambda: runs[name](end), seconds + 20)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        summary["steps"][name] = {"status": status, "seconds": took, "box_s": box[name],
                                  "headline": headlines.get(name, dict)()}
        print(f"[{name}] {status} in {took:.1f} s", flush=True)
        summary["variants"] = variant_rows(work)
        (work / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        write_summary_md(summary, work)
    if torch.cuda.is_available():
        summary["peak_memory_gib"] = torch.cuda.max_memory_allocated(torch.device(args.device)) / 2**30
    (work / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    write_summary_md(summary, work)
    print((work / "summary.md").read_text(), flush=True)
    failed = [n for n, s in summary["steps"].items() if s["status"].startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
