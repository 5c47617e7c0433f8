"""The measurements of benchmarks/gpu_check.sh in one process: the models are built once and every
benchmark runs on that pipeline, each step in its own time box.

    python benchmarks/gpu_check.py --preset real-size --device cuda:0 --work WORK [--dry-run]

Steps, most important first (each box in seconds; an environment variable sets it):

| step | what | box |
|---|---|---|
| models | `build_random` once (drafter, target, VAE, ImageReward, text encoder) | estimate only |
| latency | latency.py: target-only, SDVG at 73.1% (pattern router), the other rates, SDVG run-ahead | LATENCY_S |
| compile | latency.py, variant compile (the eager runs reused from the latency step, `--reuse`): its warm-up (the compilation, recorded as `warmup_s`) counted in the box, persistent inductor cache (TORCHINDUCTOR_CACHE_DIR) | COMPILE_S |
| host_syncs | host_syncs.py: the drafter lane eager, cuda_graphs, events, fast_vae | HOST_SYNCS_S |
| stages | stages.py: per-stage eager then compile, example inputs on the device | STAGES_S |

latency.py stops starting runs at its box's end (`--deadline`); the others are stopped by an
alarm at theirs (SIGALRM: at the next Python instruction, so a call into native code, e.g. a video
in the C++ driver, finishes first; gpu_check.sh's `timeout` is the backstop). Each writes its
results after every unit, so what was measured stays. A step
that would start with less than MIN_STEP_S left is skipped and said so. Every step's files go
under WORK (gpu_check.sh packs WORK into one tarball); `summary.json` there lists each step's
status, seconds and headline numbers.
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

MIN_STEP_S = 10


@dataclass(frozen=True)
class Step:
    name: str
    box_env: str
    box_s: int  # default time box (real-size on one H200)
    what: str


STEPS = (
    Step("latency", "LATENCY_S", 75, "target-only, SDVG at 73.1%, the other rates, SDVG run-ahead"),
    Step("compile", "COMPILE_S", 60, "torch.compile variant: its compilation (persistent inductor cache) + "
                                     "SDVG at 73.1% + target-only"),
    Step("host_syncs", "HOST_SYNCS_S", 20, "drafter lane: eager, cuda_graphs, events, fast_vae"),
    Step("stages", "STAGES_S", 20, "per stage: eager, then compile"),
)
MODELS_S = {"real-size": 60, "wan2.1": 60}  # estimate of building the models (others: a few seconds)


def boxes(env=os.environ) -> dict[str, int]:
    return {s.name: int(env.get(s.box_env, s.box_s)) for s in STEPS}


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
            status = f"failed: {type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return status, time.perf_counter() - t0


def plan_lines(preset: str, steps, box: dict[str, int], models_s: int) -> list[str]:
    lines = [f"  {'models':<11} {models_s:5d} s  build the models once (estimate)"]
    for s in STEPS:
        if s.name in steps:
            lines.append(f"  {s.name:<11} {box[s.name]:5d} s  {s.what} ({s.box_env})")
    return lines


def headline(step: str, work: Path) -> dict:
    """The step's headline numbers from the files it wrote."""
    try:
        if step in ("latency", "compile"):
            d = json.loads((work / ("." if step == "latency" else "compile") / "results.json").read_text())
            return {"speedup_vs_target": d.get("speedup_vs_target"), "floor_ratio": d.get("floor_ratio"),
                    "variants": d.get("variants"), "warmup_s": d.get("warmup_s"), "skipped": d.get("skipped")}
        if step == "host_syncs":
            d = json.loads((work / "host-syncs" / "results.json").read_text())
            return {"runs": [{"variant": r["variant"], "per_block": r.get("per_block")} for r in d["runs"]]}
        if step == "stages":
            return json.loads((work / "stages.json").read_text())["stages"]
    except (OSError, KeyError, ValueError):
        return {}
    return {}


def reuse(results: Path) -> list[str]:
    """latency.py's --reuse of the latency step's results, when it wrote them."""
    return ["--reuse", str(results)] if results.is_file() else []


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
    args = ap.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - {s.name for s in STEPS})
    if unknown:
        ap.error(f"unknown step(s) {unknown}; the steps are {', '.join(s.name for s in STEPS)}")
    box = boxes()
    models_s = MODELS_S.get(args.preset, 5)
    if args.dry_run:
        print("\n".join(plan_lines(args.preset, steps, box, models_s)))
        return 0

    import torch

    import host_syncs
    import latency
    import stages
    from sdvg.config import get_preset
    from sdvg.models.components import build_random
    from sdvg.pipeline import SpeculativeVideoPipeline

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    summary = {"preset": args.preset, "device": args.device, "boxes_s": box, "steps": {}}
    t0 = time.perf_counter()
    pipe = SpeculativeVideoPipeline(build_random(get_preset(args.preset), drafter_device=args.device))
    summary["models_s"] = time.perf_counter() - t0
    print(f"models built once in {summary['models_s']:.1f} s", flush=True)
    common = ["--preset", args.preset, "--device", args.device, "--repeats", str(args.repeats)]
    runs = {
        "latency": lambda end: latency.main(common + ["--num-blocks", str(args.num_blocks), "--variants", "run-ahead",
                                                      "--deadline", str(end), "--out", str(work)], pipe=pipe),
        "compile": lambda end: latency.main(common + ["--num-blocks", str(args.num_blocks), "--rates", "0.731",
                                                      "--variants", "compile", "--deadline", str(end),
                                                      *reuse(work / "results.json"),
                                                      "--out", str(work / "compile")], pipe=pipe),
        "host_syncs": lambda end: host_syncs.main(common + ["--modes", "draft", "--num-blocks", "3", "--variants",
                                                            "eager,cuda_graphs,events,fast_vae",
                                                            "--out", str(work / "host-syncs")], pipe=pipe),
        "stages": lambda end: stages.main(["--preset", args.preset, "--device", args.device, "--repeats", "5",
                                           "--out", str(work)], comps=pipe.components),
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
        status, took = run_boxed(lambda: runs[name](end), seconds + (30 if name in ("latency", "compile") else 0))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        summary["steps"][name] = {"status": status, "seconds": took, "box_s": box[name], **{"headline": headline(
            name, work)}}
        print(f"[{name}] {status} in {took:.1f} s", flush=True)
        (work / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (work / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    failed = [n for n, s in summary["steps"].items() if s["status"].startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
