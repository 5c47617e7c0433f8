"""Whole-video calls against `stream()` and the CLI, on a quiet machine and beside a CPU burner.

A whole-video call (`pipe(...)`) and `stream()` make the same video; on a loaded machine they must also
take the same time. Each round runs, in one process with the models loaded once: `pipe(prompt)`,
`list(pipe.stream(prompt))`, then `sdvg generate` in a fresh process (its generation wall time from its
stats file, loading excluded). The rounds run first on the quiet machine, then with `--burners` busy
processes (default: one per core) spinning beside them. Reported: the median wall per variant and
condition, and the ratios whole / stream and CLI / stream under load (goal: within 1.2), with the
thread settings (`sdvg.runtime.thread_settings()`) and the load average.

    python benchmarks/busy_machine.py --out results/busy-machine-cpu
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "a red fox running through fresh snow"


def _burn(stop) -> None:  # one core kept busy until told to stop
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def _cli_seconds(blocks: int, seed: int, preset: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "v.json"
        subprocess.run([sys.executable, "-m", "sdvg", "generate", "--preset", preset, "--prompt", PROMPT,
                        "--num-blocks", str(blocks), "--seed", str(seed), "--out", str(Path(tmp) / "v.mp4"),
                        "--stats", str(stats), "--quiet"], check=True, cwd=ROOT,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
        return float(json.loads(stats.read_text())["wall_s"])


def _round(pipe, blocks: int, seed: int, preset: str, cli: bool) -> dict[str, float]:
    kw = dict(num_blocks=blocks, seed=seed, progress=False)
    out = {}
    t0 = time.perf_counter()
    pipe(PROMPT, **kw)
    out["whole-video call"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    list(pipe.stream(PROMPT, num_blocks=blocks, seed=seed))
    out["stream()"] = time.perf_counter() - t0
    if cli:
        out["CLI"] = _cli_seconds(blocks, seed, preset)
    return out


def _condition(pipe, args, burners: int) -> dict:
    stop = mp.Event()
    procs = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(burners)]
    for p in procs:
        p.start()
    try:
        time.sleep(1.0 if burners else 0.0)
        rounds = [_round(pipe, args.blocks, args.seed, args.preset, not args.no_cli) for _ in range(args.rounds)]
        load = os.getloadavg()[0]
    finally:
        stop.set()
        for p in procs:
            p.join(10)
    names = list(rounds[0])
    return {"burners": burners, "load_average_1m": load,
            "median_s": {n: statistics.median(r[n] for r in rounds) for n in names},
            "all_s": {n: [r[n] for r in rounds] for n in names}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/busy-machine-cpu")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--burners", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-cli", action="store_true", help="skip the CLI variant (a fresh process per round)")
    args = ap.parse_args(argv)

    from benchmarks.provenance import provenance
    from sdvg import SpeculativeVideoPipeline
    from sdvg.runtime import thread_settings

    pipe = SpeculativeVideoPipeline.from_preset(args.preset)
    _round(pipe, 1, args.seed, args.preset, cli=False)  # warm-up (first-call allocations)
    quiet = _condition(pipe, args, 0)
    busy = _condition(pipe, args, args.burners)
    ratios = {cond["burners"] and "under load" or "quiet":
              {f"{n} / stream()": cond["median_s"][n] / cond["median_s"]["stream()"]
               for n in cond["median_s"] if n != "stream()"} for cond in (quiet, busy)}
    res = {"provenance": provenance(seed=args.seed, prompt=PROMPT, device="cpu"), "threads": thread_settings(),
           "preset": args.preset, "blocks": args.blocks, "rounds": args.rounds, "quiet": quiet, "busy": busy,
           "ratios": ratios, "goal": "every ratio under load within 1.2"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2))
    lines = [f"# Busy machine ({res['provenance']['date']}; {args.preset}, {args.blocks} blocks, median of "
             f"{args.rounds} rounds; threads {res['threads']})", "",
             "| variant | quiet s | busy s (" + f"{args.burners} burners, load {busy['load_average_1m']:.1f}) |",
             "|---|---|---|"]
    for n in quiet["median_s"]:
        lines.append(f"| {n} | {quiet['median_s'][n]:.2f} | {busy['median_s'][n]:.2f} |")
    lines += ["", "| ratio | quiet | under load |", "|---|---|---|"]
    for k in ratios["quiet"]:
        lines.append(f"| {k} | {ratios['quiet'][k]:.2f} | {ratios['under load'][k]:.2f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return res


if __name__ == "__main__":
    main()
