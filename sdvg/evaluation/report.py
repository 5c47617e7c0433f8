"""Sweep reports: the paper-shaped table, acceptance per block index, the Pareto plot.

The table (method, seconds per video, speed-up, acceptance over blocks 1..B-1, quality, retention) is
written as `report.md`, `report.csv` and `report.json`, with every metric of the evaluators and its
own retention beside it (`metric.<name>`, `retention.<name>`); the accepted share of each block index at
each tau goes into `report.md`, `report.json` and `acceptance_by_block.png`; `pareto.png` is the
quality-speed plot (see docs/evaluation.md)."""
from __future__ import annotations

import csv
import io
from pathlib import Path

from sdvg.evaluation.sweep import PAPER_TAUS, PUBLISHED_PAPER_TAUS, all_rows, plot, summary_json, tau_to_json
from sdvg.generation.types import strict_json

UNPUBLISHED_PAPER_TAUS = tuple(t for t in PAPER_TAUS if t not in PUBLISHED_PAPER_TAUS)
COLUMNS = ("method", "tau", "prompts", "seconds_per_video", "speedup", "acceptance", "quality", "retention")


def table_rows(summary: dict) -> list[dict]:
    """One row per method: target-only, draft-only, then SDVG from the highest tau down."""
    rows = all_rows(summary)
    fixed = [r for r in rows if r["tau"] in ("target", "draft")]
    swept = sorted((r for r in rows if r["tau"] not in ("target", "draft")), key=lambda r: -float(r["tau"]))
    names = list(summary.get("metrics") or {})
    return [{"method": r["method"], "tau": tau_to_json(r["tau"]) if r["tau"] not in ("target", "draft") else None,
             "prompts": r["prompts"], "seconds_per_video": r["seconds"], "seconds_per_video_min": r["seconds_min"],
             "speedup": r["speedup"], "acceptance": r["acceptance"], "quality": r["quality"],
             "retention": r["retention"],
             **{f"{k}.{n}": r.get("metrics", {}).get(n, {}).get(f) for n in names
                for k, f in (("metric", "quality"), ("retention", "retention"))}} for r in fixed + swept]


def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def _formula(positive: bool, higher_is_better: bool = True, formula: str | None = None) -> str:
    a, b = ("q", "q_target") if higher_is_better else ("q_target", "q")
    return (formula or (f"{a} / {b}" if positive else f"{a} - {b}")).replace(" - ", " − ")


def retention_header(summary: dict) -> str:
    formula = _formula(summary.get("quality_positive"), summary.get("quality_higher_is_better", True),
                       summary.get("retention_formula"))
    return f"retention ({formula})"


def _ret(v, positive: bool) -> str:
    return _fmt(v, ".1%") if positive else _fmt(v, "+.4f")


def metrics_section(summary: dict) -> list[str]:
    """Every metric per method, with its own retention (for more than one metric)."""
    specs = summary.get("metrics") or {}
    if len(specs) < 2:
        return []
    arrow = {True: "↑", False: "↓"}
    head = " | ".join(f"{n} {arrow[s['higher_is_better']]} | "
                      f"retention ({_formula(s['positive'], s['higher_is_better'])})" for n, s in specs.items())
    lines = ["## Metrics", "", f"| method | {head} |", "|---|" + "---|---|" * len(specs)]
    fixed = [r for r in all_rows(summary) if r["tau"] in ("target", "draft")]
    swept = sorted((r for r in all_rows(summary) if r["tau"] not in ("target", "draft")), key=lambda r: -float(r["tau"]))
    for r in fixed + swept:
        cells = []
        for n, s in specs.items():
            m = r.get("metrics", {}).get(n)
            cells += ["—", "—"] if m is None else [_fmt(m["quality"], ".4f"), _ret(m["retention"], s["positive"])]
        lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
    lines += ["", "↑ higher is better, ↓ lower is better. Each retention follows its metric's declaration: a ratio "
              "only for a metric declared positive, else a difference; for a lower-is-better metric q_target "
              "comes first, so more retention is better for every metric.", ""]
    return lines


def markdown(summary: dict) -> str:
    positive = summary.get("quality_positive")
    metric = summary.get("quality_metric")
    higher = summary.get("quality_higher_is_better", True)
    lines = [f"# Sweep report (prompts: {summary['prompts']})", "",
             *([f"Quality: `{metric}` ({'higher' if higher else 'lower'} is better), the first metric of the "
                "first evaluator.", ""] if metric else []),
             f"| method | s / video | speed-up | acceptance (blocks 1..B-1) | quality | {retention_header(summary)} |",
             "|---|---|---|---|---|---|"]
    for r in table_rows(summary):
        ret = _ret(r["retention"], positive)
        lines.append(f"| {r['method']} | {_fmt(r['seconds_per_video'], '.2f')} | {_fmt(r['speedup'], '.2f')}x | "
                     f"{_fmt(r['acceptance'], '.1%')} | {_fmt(r['quality'], '.4f')} | {ret} |")
    repeats = "/".join(str(n) for n in summary.get("repeats", [1]))
    warm = "after one warm-up run per method" if summary.get("warmup") else "without warm-up runs"
    lines += ["", f"Seconds per video: the mean over prompts of each video's median wall time over its {repeats} "
              f"timed run(s) (the prompt encoded before timing, {warm}); methods interleaved per prompt. "
              "Speed-up: target-only's total time over the method's, on the same prompts. Retention: "
              + ("the quality ratio to target-only (the metric is declared positive)" if positive else
                 "the quality difference to target-only (the metric is not declared positive, so a ratio "
                 "would mislead)")
              + ("." if higher else f", taken as target-only's {'over' if positive else 'minus'} the method's "
                 "(lower is better), so more retention is better."), ""]
    lines += metrics_section(summary)
    unpublished = [r["tau"] for r in summary["taus"] if r["tau"] in UNPUBLISHED_PAPER_TAUS]
    if unpublished:
        lines += [f"tau {', '.join(f'{t:g}' for t in unpublished)}: not published values (the paper names only "
                  "-0.7, -1.0, -1.5 and -2.5 of the seven taus of its sweep).", ""]
    by_block = acceptance_table(summary)
    if by_block["blocks"]:
        lines += ["## Acceptance per block index", "",
                  "| tau | " + " | ".join(f"block {b}" for b in by_block["blocks"]) + " |",
                  "|---|" + "---|" * len(by_block["blocks"])]
        for tau, shares in by_block["rows"]:
            lines.append(f"| {tau:g} | " + " | ".join(_fmt(s, ".0%") for s in shares) + " |")
        lines.append("")
    return "\n".join(lines)


def acceptance_table(summary: dict) -> dict:
    """{"blocks": [1..B-1], "rows": [(tau, [share per block or None])]}, taus from the highest down."""
    rows = sorted(summary["taus"], key=lambda r: -float(r["tau"]))
    blocks = sorted({int(b) for r in rows for b in r.get("acceptance_by_block", {})})
    return {"blocks": blocks,
            "rows": [(r["tau"], [r["acceptance_by_block"].get(str(b)) for b in blocks]) for r in rows]}


def csv_text(summary: dict) -> str:
    buf = io.StringIO()
    rows = table_rows(summary)
    w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else list(COLUMNS), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if v is None else v for k, v in r.items()})
    return buf.getvalue()


def plot_acceptance_by_block(summary: dict, path: Path) -> None:
    """The accepted share per block index at each tau (`sdvg.evaluation.plots.acceptance_by_block_plot`)."""
    from sdvg.evaluation.plots import acceptance_by_block_plot

    acceptance_by_block_plot(acceptance_table(summary), path)


def write_reports(summary: dict, out: Path) -> dict[str, Path]:
    """summary.json, report.md / .csv / .json, pareto.png and acceptance_by_block.png in `out`."""
    out = Path(out)
    paths = {name: out / name for name in ("summary.json", "report.md", "report.csv", "report.json", "pareto.png",
                                           "acceptance_by_block.png")}
    paths["summary.json"].write_text(summary_json(summary))
    paths["report.md"].write_text(markdown(summary), encoding="utf-8")
    paths["report.csv"].write_text(csv_text(summary), encoding="utf-8")
    table = acceptance_table(summary)
    paths["report.json"].write_text(strict_json({
        "prompts": summary["prompts"], "retention_kind": summary["retention_kind"],
        "quality_metric": summary.get("quality_metric"), "metrics": summary.get("metrics", {}),
        "rows": table_rows(summary),
        "acceptance_by_block": {"blocks": table["blocks"],
                                "rows": [{"tau": tau_to_json(t), "accepted_share": s} for t, s in table["rows"]]},
    }, indent=2))
    plot(summary, paths["pareto.png"])
    plot_acceptance_by_block(summary, paths["acceptance_by_block.png"])
    return paths
