"""tau sweeps and calibration.

A sweep runs, for every prompt, the target-only baseline, the drafter alone (draft-only) and SDVG
at each tau, and records acceptance, wall time and the evaluators' metrics per run (`quality` is the
first metric), one JSON line each.
Every record carries the full resolved options, the preset's and checkpoints' identities, sdvg's
version and the prompt with its hash. A folder holds one configuration: `sweep.json` (the
manifest) is written when the folder is first used, and a rerun resumes into the folder only when
its configuration matches (checked before any model loads); it then runs the missing
(prompt, variant) pairs. A crash can leave a cut-off last line: it is dropped and its pair redone.

Timing compares like with like: one warm-up run per variant before the timed ones (not recorded),
the prompt encoded before the timed runs of every variant (the text encoder caches it), the
variants interleaved per prompt, and `repeats` timed runs per pair (min and median recorded).

Under torchrun each process takes the prompts i with i % WORLD_SIZE == RANK onto its own GPU pair
(cuda:2*LOCAL_RANK for the drafter, cuda:2*LOCAL_RANK+1 for the target when two GPUs per process
are visible) and writes its own shard; `summarise` merges the shards (see `sdvg.evaluation.report`
for the tables and plots).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from pathlib import Path

from sdvg.evaluation.pareto import all_rows, pareto  # noqa: F401 (the sweep's API)
from sdvg.generation.types import strict_json
from sdvg.options import GenerationOptions

TARGET_KEY = "target"
DRAFT_KEY = "draft"
VARIANT_KEYS = (TARGET_KEY, DRAFT_KEY)  # the non-numeric "tau" values of the baseline rows
MANIFEST = "sweep.json"
MANIFEST_VERSION = 1

# The paper (Table/Fig. of the tau sweep) names only -0.7, -1.0, -1.5 and -2.5 of its seven values;
# -1.25, -1.75 and -2.0 fill the gaps and are not published values.
PAPER_TAUS: tuple[float, ...] = (-0.7, -1.0, -1.25, -1.5, -1.75, -2.0, -2.5)
PUBLISHED_PAPER_TAUS: tuple[float, ...] = (-0.7, -1.0, -1.5, -2.5)

# manifest fields a resume does not compare: where the prompts file lies and how many of its prompts
# are selected may change (each record carries its prompt's hash); checkpoints are compared once loaded
_NOT_COMPARED = ("prompts_file", "limit", "checkpoints")


class SweepConfigError(ValueError):
    """The output folder holds a sweep of another configuration (or is unreadable)."""


def shard(prompts: list, rank: int, world: int) -> list[tuple[int, str]]:
    """This rank's (index, prompt) pairs; `prompts` is a list of prompts or of (index, prompt) pairs."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} / world size {world} are inconsistent")
    pairs = _indexed(prompts)
    return [(i, p) for i, p in pairs if i % world == rank]


def _indexed(prompts: list) -> list[tuple[int, str]]:
    return [tuple(p) if isinstance(p, (tuple, list)) else (i, p) for i, p in enumerate(prompts)]


def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) otherwise."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_file(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _key(rec: dict) -> tuple:
    return rec["prompt_index"], rec["tau"]


def tau_to_json(tau):
    """Records are strict JSON: an infinite tau is written as the string "inf" / "-inf"."""
    return tau if tau in VARIANT_KEYS or math.isfinite(tau) else str(tau)


def _tau_from_json(tau):
    return tau if tau in VARIANT_KEYS else float(tau)


def mode_of(variant) -> str:
    return variant if variant in VARIANT_KEYS else "sdvg"


def variant_options(options: GenerationOptions, variant) -> GenerationOptions:
    """The options of one variant: target-only, draft-only, or SDVG at tau = variant."""
    if variant in VARIANT_KEYS:
        return options.replace(mode=variant)
    return options.replace(mode="sdvg", tau=variant)


def evaluator_positive(evaluator) -> bool:
    """Whether the evaluator's first metric is declared positive (a plain callable: `positive = True`):
    only then is its retention a ratio; otherwise it is a difference."""
    from sdvg.evaluation.evaluators import as_evaluator

    ev = as_evaluator(evaluator)
    return bool(ev.metrics) and ev.metrics[0].positive


def video_name(prompt_index: int, variant) -> str:
    """The MP4 of a run in `<out>/videos/` (written when an evaluator reads video files)."""
    return f"p{prompt_index:05d}_" + (variant if variant in VARIANT_KEYS else f"tau{variant:g}") + ".mp4"


# ---------------------------------------------------------------------------- records
def read_records(folder: Path) -> list[dict]:
    recs = []
    for f in sorted(Path(folder).glob("sweep.rank*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                rec["tau"] = _tau_from_json(rec["tau"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # a line cut off by a crash; the run is redone
            if isinstance(rec, dict) and "prompt_index" in rec:
                recs.append(rec)
    return recs


def _drop_torn_tail(path: Path) -> None:
    """A crash while writing leaves a last line without its newline: cut it off, so the next record
    starts on a line of its own (its pair is redone)."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


# ---------------------------------------------------------------------------- the manifest
def build_manifest(options: GenerationOptions, *, preset: str, preset_fingerprint: str, checkpoint_flags: dict,
                   evaluator: str, prompts_file: str, prompts_sha256: str, prompt_count: int, limit: int,
                   repeats: int, warmup: bool, sdvg_version: str) -> dict:
    """What makes two sweeps comparable: the resolved options minus mode and tau (the sweep sets them
    per run), the preset and the checkpoint flags given, the evaluator, the prompts file's hash, the
    timing protocol and sdvg's version."""
    opts = {k: v for k, v in options.as_dict().items() if k not in ("mode", "tau")}
    return {"manifest_version": MANIFEST_VERSION, "sdvg_version": sdvg_version, "preset": preset,
            "preset_fingerprint": preset_fingerprint, "checkpoint_flags": dict(checkpoint_flags),
            "evaluator": evaluator, "prompts_file": str(prompts_file), "prompts_sha256": prompts_sha256,
            "prompt_count": prompt_count, "limit": limit, "repeats": repeats, "warmup": warmup, "options": opts}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def manifest_differences(stored: dict, new: dict, ignore: tuple[str, ...] = _NOT_COMPARED) -> list[str]:
    """'field: stored -> new' for every compared field that differs (dotted paths, e.g. options.aggregation)."""
    a = {k: v for k, v in _flat(stored).items() if k.split(".")[0] not in ignore}
    b = {k: v for k, v in _flat(new).items() if k.split(".")[0] not in ignore}
    return [f"{k}: {a.get(k, '<absent>')!r} in the folder, {b.get(k, '<absent>')!r} now"
            for k in sorted(set(a) | set(b)) if a.get(k, "<absent>") != b.get(k, "<absent>")]


def _refuse(out: Path, diffs: list[str]) -> SweepConfigError:
    return SweepConfigError(f"{out} holds a sweep of another configuration; differing fields: {'; '.join(diffs)}. "
                            "Use another --out, or rerun with the folder's configuration (see its "
                            f"{MANIFEST})")


def prepare_folder(out: Path, manifest: dict, prompts: list) -> None:
    """Check that `out` may take this sweep, before any model loads: its manifest equals `manifest`
    (every compared field), and its records carry the same options, versions and prompts (by hash).
    A new folder gets the manifest. Raises SweepConfigError naming the differing fields."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise SweepConfigError(f"--out {out} is a file; give a folder")
    path = out / MANIFEST
    recs = read_records(out) if out.is_dir() else []
    if path.is_file():
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise SweepConfigError(f"{path} is not valid JSON ({exc}); use another --out") from None
        diffs = manifest_differences(stored, manifest)
        if diffs:
            raise _refuse(out, diffs)
    elif recs:
        raise SweepConfigError(f"{out} holds sweep records but no {MANIFEST} (written by an older sdvg?): their "
                               "configuration cannot be checked; use another --out")
    hashes = {i: sha256_text(p) for i, p in _indexed(prompts)}
    for rec in recs:
        diffs = record_differences(rec, manifest, hashes)
        if diffs:
            raise _refuse(out, [f"record of prompt {rec['prompt_index']}, tau {rec['tau']}: {d}" for d in diffs])
    if not path.is_file():
        write_manifest(out, manifest)


def record_differences(rec: dict, manifest: dict, prompt_hashes: dict[int, str]) -> list[str]:
    diffs = []
    opts = {k: v for k, v in rec.get("options", {}).items() if k not in ("mode", "tau")}
    for k in sorted(set(opts) | set(manifest["options"])):
        if opts.get(k, "<absent>") != manifest["options"].get(k, "<absent>"):
            diffs.append(f"options.{k}: {opts.get(k, '<absent>')!r} in the folder, "
                         f"{manifest['options'].get(k, '<absent>')!r} now")
    for k in ("sdvg_version", "preset", "preset_fingerprint"):
        if rec.get(k) != manifest[k]:
            diffs.append(f"{k}: {rec.get(k)!r} in the folder, {manifest[k]!r} now")
    i = rec["prompt_index"]
    if i in prompt_hashes and rec.get("prompt_sha256") != prompt_hashes[i]:
        diffs.append(f"prompt_sha256 (prompt {i}): the folder's prompt {rec.get('prompt', '')[:40]!r} differs "
                     "from the prompts file's")
    return diffs


def write_manifest(out: Path, manifest: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{MANIFEST}.{os.getpid()}.tmp"  # several ranks may write it: each atomically
    tmp.write_text(strict_json(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / MANIFEST)


def check_checkpoints(out: Path, provenance: dict) -> None:
    """Once the pipeline is loaded: its preset and checkpoints must be those of the folder (the
    manifest keeps the first run's; a checkpoint file changed in place is refused here)."""
    path = Path(out) / MANIFEST
    stored = json.loads(path.read_text(encoding="utf-8"))
    now = {"preset_fingerprint": provenance["preset_fingerprint"], "checkpoints": dict(provenance["checkpoints"])}
    if "checkpoints" in stored:
        diffs = manifest_differences({k: stored.get(k) for k in now}, now, ignore=())
        if diffs:
            raise _refuse(Path(out), diffs)
    else:
        write_manifest(Path(out), {**stored, "checkpoints": now["checkpoints"]})


# ---------------------------------------------------------------------------- the sweep
def missing_pairs(out: Path, prompts: list, taus: list[float], rank: int = 0, world: int = 1,
                  draft: bool = True) -> list[tuple[int, str, list]]:
    """(index, prompt, variants not yet recorded) for this rank's prompts that miss any."""
    done = {_key(r) for r in read_records(Path(out))} if Path(out).is_dir() else set()
    variants = [TARGET_KEY] + ([DRAFT_KEY] if draft else []) + list(taus)
    pending = [(i, p, [v for v in variants if (i, v) not in done]) for i, p in shard(prompts, rank, world)]
    return [x for x in pending if x[2]]


def run_sweep(pipe, prompts: list, taus: list[float], out: Path, evaluator, options: GenerationOptions,
              rank: int = 0, world: int = 1, progress=None, repeats: int = 1, warmup: bool = True,
              draft: bool = True, evaluator_name: str | None = None, fps: float | None = None) -> list[dict]:
    """Target-only, draft-only (unless `draft` is False) and SDVG at each tau for every prompt of this
    rank, with every other option as given. `prompts`: prompts, or (index, prompt) pairs. `evaluator`:
    an `Evaluator` (`sdvg.evaluation.evaluators`) or a plain callable (prompt, frames) -> float; `fps`
    is the videos' frame rate (default: sdvg's MP4 rate, 16)."""
    from sdvg.evaluation.evaluators import as_evaluator, finite_metrics, primary_metric
    from sdvg.io import DEFAULT_FPS

    fps = DEFAULT_FPS if fps is None else fps
    if repeats < 1:
        raise ValueError(f"repeats {repeats} must be >= 1")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sweep.rank{rank}.jsonl"
    _drop_torn_tail(path)
    pending = missing_pairs(out, prompts, taus, rank, world, draft)
    if not pending:
        return []
    ev = as_evaluator(evaluator)
    prov = pipe.provenance()
    encode = pipe.components.text_encoder.encode  # caches the embedding: later calls cost a lookup
    if warmup:  # one untimed run per variant still to run, on this rank's first pending prompt
        i0, p0, _ = pending[0]
        encode(p0)
        for v in dict.fromkeys(v for _, _, vs in pending for v in vs):
            pipe.generate(p0, variant_options(options, v))
    new = []
    for i, prompt, vs in pending:
        for v in vs:  # the variants interleaved per prompt
            run_opts = variant_options(options, v)
            encode(prompt)  # outside the timed region, for every variant alike
            outs = [pipe.generate(prompt, run_opts) for _ in range(repeats)]
            walls = [o.stats.wall_s for o in outs]
            first = outs[0]
            stats = first.stats  # RunStats: its attributes are the grouped record's values
            video = _write_video(out, i, v, first.frames, fps) if ev.needs_video_file else None
            metrics = ev(prompt, first.frames, fps=fps, video_path=video)
            finite_metrics(ev, metrics)
            specs = ev.specs_for(metrics)
            main = primary_metric(ev, metrics)
            rec = {"prompt_index": i, "prompt": prompt, "prompt_sha256": sha256_text(prompt), "tau": v,
                   "mode": run_opts.mode, "options": first.stats.options.as_dict(),
                   "acceptance_rate": stats.acceptance_rate, "accepted_blocks": stats.accepted_blocks,
                   "wall_s": statistics.median(walls), "wall_s_min": min(walls),
                   "wall_s_median": statistics.median(walls), "wall_s_runs": walls, "repeats": repeats,
                   "warmup": warmup, "quality": float(metrics[main]), "quality_metric": main,
                   "quality_positive": specs[main].positive, "quality_higher_is_better": specs[main].higher_is_better,
                   "metrics": {k: float(x) for k, x in metrics.items()},
                   "metric_specs": {k: s.as_dict() for k, s in specs.items()}, "evaluator": evaluator_name,
                   "block_scores": [b["score"] for b in stats.blocks],
                   "frame_scores": [b["frame_scores"] for b in stats.blocks],
                   "decisions": [b["decision"] for b in stats.blocks],
                   "num_blocks": run_opts.num_blocks if run_opts.num_blocks else len(stats.blocks),
                   "frames": stats.frames, "preset": stats.preset,
                   "preset_fingerprint": prov["preset_fingerprint"], "checkpoints": prov["checkpoints"],
                   "devices": prov["devices"], "sdvg_version": prov["sdvg_version"],
                   "torch_version": prov["torch_version"]}
            if video is not None:
                rec["video"] = video.relative_to(out).as_posix()
            with path.open("a", encoding="utf-8") as f:
                f.write(strict_json({**rec, "tau": tau_to_json(v)}) + "\n")
            new.append(rec)
            if progress:
                progress(rec)
    return new


def _write_video(out: Path, i: int, variant, frames, fps: float) -> Path:
    from sdvg.io.video_writer import IncrementalMP4Writer

    path = out / "videos" / video_name(i, variant)
    with IncrementalMP4Writer(path, fps=fps) as w:
        w.write(frames)
    return path


# ---------------------------------------------------------------------------- summary
def _mean_or_none(values: list) -> float | None:
    """Mean of the known values (acceptance is None for a one-block video: no block 1..B-1)."""
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def retention(q: float, q_target: float, positive: bool, higher_is_better: bool = True) -> float:
    """Quality retention, oriented so that more is better: q / q_target for a positive metric, q - q_target
    otherwise (a sign-indefinite score such as normalised ImageReward: a ratio of two negative scores
    would show a worse one as more than 100 %). For a lower-is-better metric (drift) the two swap:
    q_target / q, or q_target - q."""
    a, b = (q, q_target) if higher_is_better else (q_target, q)
    if positive:
        return a / b if b != 0 else math.nan
    return a - b


def retention_formula(positive: bool, higher_is_better: bool = True) -> str:
    a, b = ("q", "q_target") if higher_is_better else ("q_target", "q")
    return f"{a} / {b}" if positive else f"{a} - {b}"


def acceptance_by_block(records: list[dict]) -> dict[int, float]:
    """Accepted share of each block index 1..B-1 over these SDVG runs."""
    counts: dict[int, list[int]] = {}
    for r in records:
        for b, d in enumerate(r.get("decisions") or []):
            if b > 0 and d in ("accepted", "rejected"):
                counts.setdefault(b, []).append(d == "accepted")
    return {b: sum(v) / len(v) for b, v in sorted(counts.items())}


def _record_metrics(r: dict) -> dict[str, float]:
    """A record's metrics; a record of an older sdvg has only `quality`."""
    return r.get("metrics") or {r.get("quality_metric") or "quality": r["quality"]}


def _record_specs(r: dict) -> dict[str, dict]:
    return r.get("metric_specs") or {next(iter(_record_metrics(r))): {
        "positive": r.get("quality_positive", False) is True,
        "higher_is_better": r.get("quality_higher_is_better", True) is not False}}


def metric_specs(records: list[dict]) -> dict[str, dict]:
    """Each metric's rule over these records, in first-seen order: positive only when every record
    declares it so; a metric whose direction differs between records is refused."""
    specs: dict[str, dict] = {}
    for r in records:
        for name, s in _record_specs(r).items():
            cur = specs.setdefault(name, {"positive": True, "higher_is_better": s.get("higher_is_better", True)})
            if cur["higher_is_better"] != s.get("higher_is_better", True):
                raise ValueError(f"metric {name!r} is declared higher-is-better in some records, lower in others")
            cur["positive"] = cur["positive"] and s.get("positive") is True
    for s in specs.values():
        s["retention_kind"] = "ratio" if s["positive"] else "difference"
        s["retention_formula"] = retention_formula(s["positive"], s["higher_is_better"])
    return specs


def summarise(records: list[dict]) -> dict:
    """Per variant (target-only, draft-only, SDVG at each tau), paired per prompt with target-only:
    seconds per video, speed-up, acceptance, quality (the first metric) and its retention, and each
    metric with its own retention (a difference, or a ratio for positive metrics; oriented so that
    more is better)."""
    base = {r["prompt_index"]: r for r in records if r["tau"] == TARGET_KEY}
    specs = metric_specs(records)
    positive = bool(records) and all(r.get("quality_positive", False) for r in records)
    higher = all(r.get("quality_higher_is_better", True) is not False for r in records)
    names = {r.get("quality_metric") or "quality" for r in records}
    if len(names) > 1:
        raise ValueError(f"the records' quality is of different metrics: {sorted(names)}")
    by_variant: dict = {}
    for r in records:
        if r["tau"] != TARGET_KEY and r["prompt_index"] in base:
            by_variant.setdefault(r["tau"], []).append(r)

    def metric_rows(rs: list[dict]) -> dict:
        out = {}
        for name, spec in specs.items():
            pairs = [(_record_metrics(r)[name], _record_metrics(base[r["prompt_index"]])[name]) for r in rs
                     if name in _record_metrics(r) and name in _record_metrics(base[r["prompt_index"]])]
            if pairs:
                q, qb = statistics.mean(p[0] for p in pairs), statistics.mean(p[1] for p in pairs)
                out[name] = {"quality": q, "target_quality": qb, "delta": q - qb, "prompts": len(pairs),
                             "retention": retention(q, qb, spec["positive"], spec["higher_is_better"])}
        return out

    def row(variant, rs: list[dict]) -> dict:
        t_base = sum(base[r["prompt_index"]]["wall_s"] for r in rs)
        q_base = statistics.mean(base[r["prompt_index"]]["quality"] for r in rs)
        q = statistics.mean(r["quality"] for r in rs)
        return {"tau": variant, "method": method_name(variant), "prompts": len(rs),
                "acceptance": _mean_or_none([r["acceptance_rate"] for r in rs]),
                "seconds": statistics.mean(r["wall_s"] for r in rs),
                "seconds_min": statistics.mean(r.get("wall_s_min", r["wall_s"]) for r in rs),
                "speedup": t_base / sum(r["wall_s"] for r in rs),
                "quality": q, "target_quality": q_base, "quality_delta": q - q_base,
                "retention": retention(q, q_base, positive, higher),
                "metrics": metric_rows(rs),
                "acceptance_by_block": {str(b): a for b, a in acceptance_by_block(rs).items()}}

    taus = sorted((v for v in by_variant if v not in VARIANT_KEYS), key=float)
    return {"prompts": len(base), "quality_positive": positive, "quality_higher_is_better": higher,
            "quality_metric": names.pop() if names else None,
            "repeats": sorted({r.get("repeats", 1) for r in records}),
            "warmup": bool(records) and all(r.get("warmup", False) for r in records),
            "retention_kind": "ratio" if positive else "difference",
            "retention_formula": retention_formula(positive, higher), "metrics": specs,
            "target": row(TARGET_KEY, list(base.values())) if base else None,
            "draft": row(DRAFT_KEY, by_variant[DRAFT_KEY]) if DRAFT_KEY in by_variant else None,
            "taus": [row(t, by_variant[t]) for t in taus]}


def method_name(variant) -> str:
    if variant == TARGET_KEY:
        return "target-only"
    if variant == DRAFT_KEY:
        return "draft-only"
    return f"SDVG (tau={variant:g})"


def _row_json(r):
    return None if r is None else {**r, "tau": tau_to_json(r["tau"])}


def summary_json(summary: dict) -> str:
    """The summary as strict JSON (infinite taus as "inf" / "-inf", as in the records)."""
    return strict_json({**summary, "target": _row_json(summary.get("target")),
                        "draft": _row_json(summary.get("draft")),
                        "taus": [_row_json(r) for r in summary["taus"]]}, indent=2)


def plot(summary: dict, path: Path) -> None:
    """Quality against speed-up: SDVG at each tau, target-only and draft-only, and the Pareto front of
    all of them (target-only is on the front when nothing is at least as good and as fast); drawn by
    `sdvg.evaluation.plots.pareto_plot`."""
    from sdvg.evaluation.plots import pareto_plot

    pareto_plot(summary, path)


# ---------------------------------------------------------------------------- calibration
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


def retention_goal(positive: bool, retention: float | None = None, quality_drop: float | None = None) -> float:
    """The least retention a tau must reach: `retention` as given (a difference q - q_target, e.g.
    -0.01, or for a positive metric a ratio, e.g. 0.98), or from `quality_drop` D >= 0 (the quality
    one accepts to lose: -D as a difference, 1 - D as a ratio)."""
    if (retention is None) == (quality_drop is None):
        raise ValueError("give exactly one of retention or quality_drop")
    if quality_drop is not None:
        if not quality_drop >= 0:
            raise ValueError(f"quality drop {quality_drop} must be >= 0")
        return 1.0 - quality_drop if positive else -quality_drop
    return retention


def calibrate_retention(summary: dict, retention: float | None = None, quality_drop: float | None = None) -> dict:
    """The fastest swept tau whose retention reaches the goal (`retention_goal`'s rule; retention is
    oriented so that more is better, also for a lower-is-better metric)."""
    positive = summary.get("quality_positive", False)
    goal = retention_goal(positive, retention, quality_drop)
    ok = [r for r in summary["taus"] if r["retention"] >= goal]
    if not ok:
        formula = summary.get("retention_formula") or retention_formula(positive)
        kind = f"ratio {formula}" if positive else f"difference {formula}"
        raise ValueError(f"no swept tau reaches a quality retention of {goal:g} (as a {kind}); sweep higher taus"
                         + ("" if positive or goal <= 0 else
                            " (this metric is sign-indefinite: retention is a difference, e.g. -0.01, "
                            "or use --quality-drop)"))
    return max(ok, key=lambda r: r["speedup"])
