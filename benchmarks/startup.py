"""Start-up cost of the package and the command line, against `import torch` on the same machine: `import sdvg`,
`sdvg --help`, `sdvg --version`, `sdvg generate --help`, and how fast the command line refuses bad input
(an unknown preset, no prompt, a non-MP4 output, a misspelt flag, a preset `download` does not know). Each in
a fresh interpreter, median of --repeats; each row records whether torch was imported, the exit status and
whether a "loading" line was printed; the load average is recorded (a shared machine slows every row alike).
The check: a bad preset is refused, with exit 2 and no "loading" line, in under --max-ratio (0.6) of
`import torch`'s time.

    python benchmarks/startup.py --out results/startup-cpu
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli(argv: list[str]) -> str:
    """A command line run as `python -m sdvg` runs it, in a fresh interpreter, reporting torch afterwards."""
    return ("import sys\nfrom sdvg.cli import main\ntry:\n    code = main(%r)\nexcept SystemExit as exc:\n"
            "    code = exc.code\nprint('torch' in sys.modules, file=sys.stderr)\nsys.exit(code)" % (argv,))


CASES = {
    "import torch": "import torch\nimport sys\nprint('torch' in sys.modules, file=sys.stderr)",
    "import sdvg": "import sdvg\nimport sys\nprint('torch' in sys.modules, file=sys.stderr)",
    "sdvg --help": _cli(["--help"]),
    "sdvg --version": _cli(["--version"]),
    "sdvg generate --help": _cli(["generate", "--help"]),
    "refused: generate --preset tinyy": _cli(["generate", "--preset", "tinyy", "--prompt", "a fox"]),
    "refused: generate without --prompt": _cli(["generate", "--preset", "tiny"]),
    "refused: generate --out a.avi": _cli(["generate", "--preset", "tiny", "--prompt", "a fox", "--out", "a.avi"]),
    "refused: generate --promt (misspelt)": _cli(["generate", "--promt", "a fox"]),
    "refused: download tinyy": _cli(["download", "tinyy"]),
}
BAD_PRESET = "refused: generate --preset tinyy"


def run_case(code: str) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    seconds = time.perf_counter() - t0
    lines = r.stderr.strip().splitlines()
    return {"s": seconds, "imports_torch": lines[-1] == "True", "exit": r.returncode,
            "loading_line": any(ln.startswith("loading") for ln in lines),
            "said": next((ln for ln in lines if "error:" in ln), "")[:200]}


def _share(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.0%}"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/startup-cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", default=None, help="comma list of case names (default: all)")
    ap.add_argument("--max-ratio", type=float, default=0.6,
                    help="the bad preset's refusal must take under this share of `import torch`'s time")
    args = ap.parse_args(argv)
    names = list(CASES) if args.cases is None else [c.strip() for c in args.cases.split(",")]
    rows = {}
    for _ in range(args.repeats):  # interleaved: a load change on the machine touches every row alike
        for name in names:
            run = run_case(CASES[name])
            row = rows.setdefault(name, {"all_s": [], **{k: v for k, v in run.items() if k != "s"}})
            row["all_s"].append(run["s"])
    for row in rows.values():
        row["median_s"] = statistics.median(row["all_s"])
    torch_s = rows.get("import torch", {}).get("median_s")
    for row in rows.values():
        row["of_import_torch"] = None if not torch_s else row["median_s"] / torch_s
    check = None
    if torch_s and BAD_PRESET in rows:
        bad = rows[BAD_PRESET]
        check = {"max_ratio": args.max_ratio, "ratio": bad["of_import_torch"],
                 "passed": bad["of_import_torch"] < args.max_ratio and bad["exit"] == 2 and not bad["loading_line"]
                 and not bad["imports_torch"]}
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_average_1m": os.getloadavg()[0],
           "python": sys.version.split()[0], "repeats": args.repeats, "rows": rows, "check": check}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2))
    lines = [f"# Start-up ({res['date']}, load {res['load_average_1m']:.1f}, median of {args.repeats})", "",
             "| what | median s | of `import torch` | imports torch | exit | loading line |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {k} | {v['median_s']:.3f} | {_share(v['of_import_torch'])} | {v['imports_torch']} | {v['exit']} "
              f"| {v['loading_line']} |" for k, v in rows.items()]
    if check is not None:
        lines += ["", f"Check: a bad preset refused in {check['ratio']:.0%} of `import torch`'s time (under "
                      f"{check['max_ratio']:.0%}, exit 2, no loading line, torch not imported): "
                      f"{'passed' if check['passed'] else 'FAILED'}"]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return res


if __name__ == "__main__":
    main()
