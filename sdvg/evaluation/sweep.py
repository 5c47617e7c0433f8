"""tau sweeps and calibration.

A sweep runs, for every prompt, the target-only baseline and SDVG at each tau, and records
acceptance, wall time and a quality proxy per run, one JSON line each (resumable: a rerun skips
finished (prompt, tau) pairs). Under torchrun each process takes the prompts i with
i % WORLD_SIZE == RANK onto its own GPU pair (cuda:2*LOCAL_RANK for the drafter,
cuda:2*LOCAL_RANK+1 for the target when two GPUs per process are visible) and writes its own
shard; `report` merges the shards and draws the quality-speed Pareto curve.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

from sdvg.generation.types import strict_json
from sdvg.options import GenerationOptions

TARGET_KEY = "target"


def shard(prompts: list[str], rank: int, world: int) -> list[tuple[int, str]]:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} / world size {world} are inconsistent")
    return [(i, p) for i, p in enumerate(prompts) if i % world == rank]


def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) otherwise."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def _key(rec: dict) -> tuple:
    return rec["prompt_index"], rec["tau"]


def tau_to_json(tau):
    """Records are strict JSON: an infinite tau is written as the string "inf" / "-inf"."""
    return tau if tau == TARGET_KEY or math.isfinite(tau) else str(tau)


def _tau_from_json(tau):
    return tau if tau == TARGET_KEY else float(tau)


def read_records(folder: Path) -> list[dict]:
    recs = []
    for f in sorted(folder.glob("sweep.rank*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                rec["tau"] = _tau_from_json(rec["tau"])
                recs.append(rec)
            except json.JSONDecodeError:
                continue  # a line cut off by a crash; the run is redone
    return recs


def run_sweep(pipe, prompts: list[str], taus: list[float], out: Path, evaluator, options: GenerationOptions,
              rank: int = 0, world: int = 1, progress=None) -> list[dict]:
    """Target-only and SDVG at each tau for every prompt of this rank, with every other option as given."""
    out.mkdir(parents=True, exist_ok=True)
    done = {_key(r) for r in read_records(out)}
    path = out / f"sweep.rank{rank}.jsonl"
    new = []
    todo = shard(prompts, rank, world)
    for i, prompt in todo:
        for tau in [TARGET_KEY] + list(taus):
            if (i, tau) in done:
                continue
            mode = "target" if tau == TARGET_KEY else "sdvg"
            run_opts = options.replace(mode=mode) if mode == "target" else options.replace(mode=mode, tau=tau)
            out_ = pipe.generate(prompt, run_opts)
            rec = {"prompt_index": i, "prompt": prompt, "tau": tau, "mode": mode,
                   "options": out_.stats.options.as_dict(),
                   "acceptance_rate": out_.stats["acceptance_rate"], "wall_s": out_.stats["wall_s"],
                   "quality": evaluator(prompt, out_.frames),
                   "block_scores": [b["score"] for b in out_.stats["blocks"]],
                   "decisions": [b["decision"] for b in out_.stats["blocks"]]}
            with path.open("a", encoding="utf-8") as f:
                f.write(strict_json({**rec, "tau": tau_to_json(tau)}) + "\n")
            new.append(rec)
            if progress:
                progress(rec)
    return new


def summarise(records: list[dict]) -> dict:
    """Per tau: mean acceptance, speed-up over target-only and quality retention (paired per prompt)."""
    base = {r["prompt_index"]: r for r in records if r["tau"] == TARGET_KEY}
    by_tau: dict = {}
    for r in records:
        if r["tau"] == TARGET_KEY or r["prompt_index"] not in base:
            continue
        by_tau.setdefault(r["tau"], []).append(r)
    rows = []
    for tau, rs in sorted(by_tau.items(), key=lambda kv: kv[0]):
        t_base = sum(base[r["prompt_index"]]["wall_s"] for r in rs)
        q_base = statistics.mean(base[r["prompt_index"]]["quality"] for r in rs)
        q = statistics.mean(r["quality"] for r in rs)
        rows.append({"tau": tau, "prompts": len(rs),
                     "acceptance": _mean_or_none([r["acceptance_rate"] for r in rs]),
                     "speedup": t_base / sum(r["wall_s"] for r in rs),
                     "quality": q, "target_quality": q_base,
                     "retention": q / q_base if q_base not in (0, 0.0) else math.nan})
    return {"taus": rows, "prompts": len(base)}


def _mean_or_none(values: list) -> float | None:
    """Mean of the known values (acceptance is None for a one-block video: no block 1..B-1)."""
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def summary_json(summary: dict) -> str:
    """The summary as strict JSON (infinite taus as "inf" / "-inf", as in the records)."""
    return strict_json({**summary, "taus": [{**r, "tau": tau_to_json(r["tau"])} for r in summary["taus"]]}, indent=2)


def pareto(rows: list[dict]) -> list[dict]:
    """Rows not dominated in (speed-up, quality)."""
    keep = []
    for r in rows:
        if not any(o is not r and o["speedup"] >= r["speedup"] and o["quality"] >= r["quality"]
                   and (o["speedup"] > r["speedup"] or o["quality"] > r["quality"]) for o in rows):
            keep.append(r)
    return sorted(keep, key=lambda r: r["speedup"])


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["taus"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([r["speedup"] for r in rows], [r["quality"] for r in rows], label="SDVG at tau")
    for r in rows:
        ax.annotate(f"{r['tau']:g} ({r['acceptance']:.0%})", (r["speedup"], r["quality"]), fontsize=7)
    front = pareto(rows)
    ax.plot([r["speedup"] for r in front], [r["quality"] for r in front], "--", label="Pareto front")
    if rows:
        ax.scatter([1.0], [rows[0]["target_quality"]], marker="*", s=120, label="target-only")
    ax.set_xlabel("speed-up over target-only")
    ax.set_ylabel("quality (mean evaluator score)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def calibrate_acceptance(block_scores: list[float], acceptance: float) -> float:
    """tau that accepts a fraction `acceptance` of these draft scores: their (1 - a) quantile."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance {acceptance} must lie in [0, 1]")
    s = sorted(x for x in block_scores if x is not None)
    if not s:
        raise ValueError("no draft scores to calibrate on")
    k = int(math.floor((1.0 - acceptance) * len(s)))
    if k >= len(s):
        return math.inf
    return s[k]


def calibrate_retention(summary: dict, retention: float) -> dict:
    """The fastest tau whose quality retention reaches `retention`."""
    ok = [r for r in summary["taus"] if r["retention"] >= retention]
    if not ok:
        raise ValueError(f"no swept tau reaches {retention:.1%} quality retention; sweep higher taus")
    return max(ok, key=lambda r: r["speedup"])
