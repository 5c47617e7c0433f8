"""Whole-video calls against `stream()` and the CLI, on a quiet machine and beside a CPU burner.

A whole-video call (`pipe(...)`) and `stream()` make the same video; on a loaded machine they must also
take the same time. Each round runs, in one process with the models loaded once: `pipe(prompt)`,
`list(pipe.stream(prompt))`, then `sdvg generate` in a fresh process (the second video of a two-line
prompts file, its wall time from its stats record: loading and first-call costs excluded). The rounds run first on the quiet machine, then with `--burners` busy
processes (default: one per core) spinning beside them. Reported: the median wall per variant and
condition, and the ratios whole / stream and CLI / stream under load (goal: within 1.2), with the
thread settings (`sdvg.runtime.thread_settings()`) and the load average.

Two processes, one after the other: `openmp-default/` imports torch before sdvg, so OpenMP keeps its
default (waiting threads spin: sdvg before sdvg/runtime.py), and `sdvg/` imports sdvg first, as the
CLI does (OMP_WAIT_POLICY=PASSIVE). The CLI variant of the first inherits OMP_WAIT_POLICY=ACTIVE
(spinning: the variable unset is not inheritable, and sdvg would set it). results.md compares them.

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


def _cli_seconds(blocks: int, seed: int, preset: str, env: dict) -> float:
    """`sdvg generate` over a prompts file of the prompt twice: the second video's wall time (its stats
    record's `result.wall_s`, read by `sdvg.read_stats`), so a fresh process's one-time costs (loading, first-call allocations) stay out,
    as the warm-up keeps them out of the in-process variants."""
    with tempfile.TemporaryDirectory() as tmp:
        prompts, stats = Path(tmp) / "p.txt", Path(tmp) / "v.jsonl"
        prompts.write_text(f"{PROMPT}\n{PROMPT}\n")
        subprocess.run([sys.executable, "-m", "sdvg.cli", "generate", "--preset", preset, "--prompts-file",
                        str(prompts), "--num-blocks", str(blocks), "--seed", str(seed), "--out",
                        str(Path(tmp) / "v.mp4"), "--stats", str(stats), "--quiet"], check=True, cwd=ROOT,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", **env}, capture_output=True)
        from sdvg import read_stats

        return float(read_stats(json.loads(stats.read_text().splitlines()[1]))["result"]["wall_s"])


def _round(pipe, blocks: int, seed: int, preset: str, cli: bool, policy: str = "sdvg") -> dict[str, float]:
    kw = dict(num_blocks=blocks, seed=seed)
    out = {}
    t0 = time.perf_counter()
    pipe(PROMPT, **kw)
    out["whole-video call"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    list(pipe.stream(PROMPT, num_blocks=blocks, seed=seed))
    out["stream()"] = time.perf_counter() - t0
    if cli:
        out["CLI"] = _cli_seconds(blocks, seed, preset, {"OMP_WAIT_POLICY": "ACTIVE"} if policy == "openmp-default"
                                  else {})
    return out


def _condition(pipe, args, burners: int) -> dict:
    stop = mp.Event()
    procs = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(burners)]
    for p in procs:
        p.start()
    try:
        time.sleep(1.0 if burners else 0.0)
        rounds = [_round(pipe, args.blocks, args.seed, args.preset, not args.no_cli, args.policy)
                  for _ in range(args.rounds)]
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
    ap.add_argument("--policy", choices=("openmp-default", "sdvg"),
                    help="one process of the pair (default: run both, each in a fresh process, and compare)")
    args = ap.parse_args(argv)
    if args.policy is None:
        return _both(args, argv or sys.argv[1:])

    if args.policy == "openmp-default":
        import torch  # noqa: F401  (first: OpenMP loads with its default wait policy)
    from sdvg import SpeculativeVideoPipeline  # (before torch: the wait policy, sdvg/runtime.py)
    from benchmarks.provenance import provenance
    from sdvg.runtime import thread_settings

    pipe = SpeculativeVideoPipeline.from_preset(args.preset)
    pipe.set_progress_bar_config(disable=True)
    _round(pipe, 1, args.seed, args.preset, cli=False)  # warm-up (first-call allocations)
    quiet = _condition(pipe, args, 0)
    busy = _condition(pipe, args, args.burners)
    ratios = {cond["burners"] and "under load" or "quiet":
              {f"{n} / stream()": cond["median_s"][n] / cond["median_s"]["stream()"]
               for n in cond["median_s"] if n != "stream()"} for cond in (quiet, busy)}
    res = {"provenance": provenance(seed=args.seed, prompt=PROMPT, device="cpu"), "threads": thread_settings(),
           "policy": args.policy, "preset": args.preset, "blocks": args.blocks, "rounds": args.rounds, "quiet": quiet, "busy": busy,
           "ratios": ratios, "goal": "every ratio under load within 1.2"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2))
    lines = [f"# Busy machine, {args.policy} ({res['provenance']['date']}; {args.preset}, {args.blocks} blocks, median of "
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


def report(out: Path, runs: dict) -> None:
    """results.md of the pair: each process's medians and its ratios to stream() under load."""
    first = next(iter(runs.values()))
    lines = [f"# Busy machine: whole-video call, stream() and the CLI, quiet and beside {first['busy']['burners']} "
             "CPU burners", "",
             f"{first['preset']}, {first['blocks']} blocks, median of {first['rounds']} rounds; each row's process in "
             "turn (`benchmarks/busy_machine.py`). Goal: every ratio to stream() within 1.2 under load.", "",
             "| process (OpenMP wait policy) | variant | quiet s | under load s | / stream() under load |",
             "|---|---|---|---|---|"]
    label = {"openmp-default": "torch imported first (OpenMP's default: spin)",
             "sdvg": "sdvg imported first (PASSIVE, as the CLI)"}
    for policy, r in runs.items():
        for n in r["quiet"]["median_s"]:
            ratio = r["busy"]["median_s"][n] / r["busy"]["median_s"]["stream()"]
            lines.append(f"| {label[policy]} | {n} | {r['quiet']['median_s'][n]:.2f} | {r['busy']['median_s'][n]:.2f} "
                         f"| {ratio:.2f} |")
    lines += ["", "Load average under load: " + ", ".join(f"{p} {r['busy']['load_average_1m']:.1f}"
                                                          for p, r in runs.items()) + ".",
              "The CLI row of the first process runs with OMP_WAIT_POLICY=ACTIVE (a child cannot inherit an unset "
              "variable once sdvg would set it)."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _both(args, argv: list[str]) -> dict:
    out = Path(args.out)
    runs = {}
    for policy in ("openmp-default", "sdvg"):
        sub = out / policy
        subprocess.run([sys.executable, __file__, *argv, "--policy", policy, "--out", str(sub)], check=True,
                       env={k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"})
        runs[policy] = json.loads((sub / "results.json").read_text())
    report(out, runs)
    return runs


if __name__ == "__main__":
    main()
