"""Start-up cost of the package and the command line: `import sdvg`, `sdvg --help`, `sdvg generate --help`,
against `import torch` (what `import sdvg` cost when it imported torch). Each in a fresh interpreter,
median of --repeats; the load average is recorded (a shared machine slows every row alike).

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

CASES = {
    "import torch": "import torch",
    "import sdvg": "import sdvg",
    "sdvg --help": "import sys; sys.argv = ['sdvg', '--help']\nfrom sdvg.cli import main\ntry:\n    main()\nexcept SystemExit:\n    pass",
    "sdvg generate --help": "import sys\nfrom sdvg.cli import main\ntry:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass",
}


def seconds(code: str) -> tuple[float, bool]:
    probe = code + "\nimport sys as _s; print('torch' in _s.modules, file=_s.stderr)"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                       cwd=Path(__file__).resolve().parents[1])
    return time.perf_counter() - t0, r.stderr.strip().splitlines()[-1] == "True"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/startup-cpu")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rows = {}
    for name, code in CASES.items():
        runs = [seconds(code) for _ in range(args.repeats)]
        rows[name] = {"median_s": statistics.median(t for t, _ in runs), "all_s": [t for t, _ in runs],
                      "imports_torch": runs[0][1]}
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_average_1m": os.getloadavg()[0],
           "python": sys.version.split()[0], "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2))
    lines = [f"# Start-up ({res['date']}, load {res['load_average_1m']:.1f})", "",
             "| what | median s | imports torch |", "|---|---|---|"]
    lines += [f"| {k} | {v['median_s']:.3f} | {v['imports_torch']} |" for k, v in rows.items()]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return res


if __name__ == "__main__":
    main()
