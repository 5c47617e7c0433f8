"""The Pareto front of a sweep's rows (speed-up against quality) and the rows it is drawn from: used by the
sweep's summary, its report and its plot."""
from __future__ import annotations


def pareto(rows: list[dict], higher_is_better: bool = True) -> list[dict]:
    """Rows not dominated in (speed-up, quality); quality counts downwards for a lower-is-better metric."""
    sign = 1.0 if higher_is_better else -1.0
    keep = []
    for r in rows:
        q = sign * r["quality"]
        if not any(o is not r and o["speedup"] >= r["speedup"] and sign * o["quality"] >= q
                   and (o["speedup"] > r["speedup"] or sign * o["quality"] > q) for o in rows):
            keep.append(r)
    return sorted(keep, key=lambda r: r["speedup"])


def all_rows(summary: dict) -> list[dict]:
    """target-only, draft-only (when swept) and SDVG at each tau."""
    return [r for r in (summary.get("target"), summary.get("draft")) if r is not None] + list(summary["taus"])
