"""The run types both schedulers share: stage and counter names (exported once by the native core),
one block record, and one run-statistics type with its record's groups and reader (`FIELDS`,
`read_stats`; the stage calls are `calls.StageCalls`).

The reference loop (`reference.py`) and the native driver (`native.py`) both import this module and
neither imports the other; the API, the CLI, the JSON statistics and the benchmarks read the same
`BlockRecord` and `RunStats`. The statistics record (docs/stats.md) is grouped since schema 9; `read_stats`
reads a record of any schema (the flat 1-8 converted) as 9.
"""
from __future__ import annotations

import copy
import datetime
import json
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from sdvg._native import _C
from sdvg.io import DEFAULT_FPS
from sdvg.io.strict_json import nonfinite_paths, strict_json  # noqa: F401 (re-exported)
from sdvg.options import OPTION_NAMES, GenerationOptions
from sdvg.runtime import host_state

STAGE_NAMES: tuple[str, ...] = tuple(_C.STAGE_NAMES)  # draft, decode, score, target, drafter_commit, target_commit, recache
COUNTER_NAMES: tuple[str, ...] = tuple(_C.COUNTER_NAMES)
DECISIONS: tuple[str, ...] = tuple(_C.DECISION_NAMES)  # forced, accepted, rejected, target, draft
# Per-block stage times: the native stages plus `commit` (drafter_commit + target_commit).
BLOCK_TIME_KEYS: tuple[str, ...] = STAGE_NAMES + ("commit",)
# The stage totals of a run (commit covers both roles' commits).
TOTAL_KEYS: tuple[str, ...] = ("draft", "decode", "score", "target", "commit", "recache")

Counters = _C.Counters  # the native counters struct; the reference loop counts into the same type

# The statistics file's schema (docs/stats.md). Bump on any change of a field's name, meaning or place.
SCHEMA_VERSION = 10  # 2: early exit (the exit_* options, mean_steps, max_steps, exit_roles; block exit fields)
# 3: live sessions and prompt schedules (options interp_blocks, force_reject_after_switch; block `live`;
#    top level `live`, `updates`, `prompts`, `segments`, `prompt_encodes`, `blocks_started` when live)
# 4: `host` (thread settings, OpenMP wait policy, load average of the run's machine)
# 5: video-to-video (option `strength`; top level `input_video`, and `input_ended` when live); re-cache (option
#    `recache`; `recache_forwards` when live, block `live.recache_forwards`)
# 6: `blocks_dropped` (the oldest block entries a long live session folded into the totals, `record_blocks`)
# 7: the option `target_steps` (the target's denoising step count, Krea's num_denoising_steps)
# 8: `build` (how sdvg._C was built: CUDA or not, its CUDA runtime and torch; the installed torch's CUDA)
# 9: grouped (`run`, `video`, `options`, `result`, and `live` / `cli` when they apply; FIELDS below); new:
#    run.started_at, run.argv, run.hostname, run.load_s, video.height, video.width, video.fps. `read_stats`
#    reads every schema (1-8 are flat: converted by FIELDS).
# 10: a re-cache is a stage of its own: block `times` and `result.stage_totals` have `recache` (before, its seconds
#    were inside the stage of the role's first work on the block: draft, target, drafter_commit or target_commit;
#    `read_stats` gives older records `recache` 0.0).

# Where each field of a record sits: its name in a flat record of schemas 1-8 (the keys of `RunStats.extra`
# too) -> its group and name in schema 9. The one table the writer (`RunStats.as_dict`) and the reader
# (`read_stats`) both group by; "" is the record's top level. Schema 9's fields no flat record has are
# listed under their own name (NEW_IN_9).
FIELDS: dict[str, tuple[str, str]] = {
    "schema_version": ("", "schema_version"),
    **{k: ("run", k) for k in ("started_at", "argv", "hostname", "host", "build", "sdvg_version", "torch_version",
                                "devices", "precision", "fp8_impl", "preset", "preset_fingerprint", "checkpoints",
                                "load_s")},
    **{k: ("video", k) for k in ("prompt", "height", "width", "fps", "frames", "blocks_done", "blocks_dropped",
                                  "interrupted", "input_video", "start_frame")},
    **{k: ("options", k) for k in OPTION_NAMES},
    **{k: ("result", k) for k in ("acceptance_rate", "accepted_blocks", *COUNTER_NAMES, "wall_s", "stage_totals",
                                   "stage_device_s", "compile", "mean_steps", "max_steps", "exit_roles")},
    "live": ("live", ""),  # a flat record's `live: true`: schema 9 has the `live` group instead
    **{k: ("live", k) for k in ("updates", "prompts", "segments", "prompt_encodes", "blocks_started",
                                 "recache_forwards", "input_ended")},
    "video": ("cli", "video_path"),  # the MP4 written (renamed: `video` is schema 9's group)
    **{k: ("cli", k) for k in ("interrupted_by", "protocol", "infinite_options", "prompt_index", "prompt_sha256")},
    **{k: ("", k) for k in ("blocks", "trace", "nonfinite_fields")},
}
GROUPS: tuple[str, ...] = ("run", "video", "options", "result", "live", "cli")  # in the record's order
ALWAYS: tuple[str, ...] = ("run", "video", "options", "result")  # `live` and `cli` only where they apply
NEW_IN_9: tuple[str, ...] = ("started_at", "argv", "hostname", "load_s", "height", "width", "fps")  # null when read
# from a flat record (it could not know them); any other field a flat record lacks stays absent
assert len({v for v in FIELDS.values() if v[1]}) == len(FIELDS) - 1, "two fields share a place in FIELDS"


def group_record(flat: Mapping[str, Any]) -> dict:
    """A flat record (schemas 1-8, or `RunStats`'s fields before grouping) grouped as schema 9 by FIELDS, in
    FIELDS' order within each group; `schema_version` and `nonfinite_fields` are the caller's. A field FIELDS
    does not know is refused (ValueError naming it): every field has its place in the table."""
    unknown = sorted(set(flat) - set(FIELDS))
    if unknown:
        raise ValueError(f"statistics field(s) {', '.join(unknown)} have no group: add them to "
                         "sdvg.generation.types.FIELDS (and docs/stats.md)")
    out: dict[str, Any] = {"schema_version": SCHEMA_VERSION, **{g: {} for g in ALWAYS}}
    for key, (group, name) in FIELDS.items():
        if group == "live" and not name:
            if flat.get("live"):
                out.setdefault("live", {})
        elif key in flat and group:
            out.setdefault(group, {})[name] = flat[key]
    for key in ("blocks", "trace"):
        if key in flat:
            out[key] = flat[key]
    return {k: out[k] for k in ("schema_version", *GROUPS, "blocks", "trace") if k in out}


def _grouped_path(path: str) -> str:
    """A flat record's `nonfinite_fields` path (`tau`, `exit_thresholds[1]`, `blocks[0].score`) in schema 9."""
    head = path.split(".", 1)[0].split("[", 1)[0]
    group, name = FIELDS.get(head, ("", head))
    return f"{group}.{name}{path[len(head):]}" if group else path


def read_stats(record: Mapping[str, Any] | str | Path) -> dict:
    """A statistics record as the current schema (docs/stats.md): `record` is a parsed record (a dict, a
    `RunStats`) or the path of a `--stats` file holding one JSON object. A current record comes back as it is;
    a flat one of schemas 1-8 is grouped by FIELDS: the fields schema 9 added (NEW_IN_9) are null, any other
    field the older schema lacked stays absent, and `nonfinite_fields` names the grouped paths; a record of
    schema 9 or older gets the `recache` stage time 0.0 (schema 10; its seconds are inside the other stages'),
    and says the current `schema_version` (the shape it now has). A record without `schema_version`, or of a schema newer than
    this sdvg reads, is refused (ValueError)."""
    if isinstance(record, (str, Path)):
        record = json.loads(Path(record).read_text(encoding="utf-8"))
    if isinstance(record, RunStats):
        record = record.as_dict()
    if not isinstance(record, Mapping):
        raise ValueError(f"a statistics record is a JSON object, not {type(record).__name__}")
    version = record.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"not an sdvg statistics record: no integer schema_version (got {version!r}); sdvg "
                         f"reads schemas 1-{SCHEMA_VERSION} (docs/stats.md)")
    if version > SCHEMA_VERSION:
        raise ValueError(f"statistics schema {version} is newer than this sdvg reads (1-{SCHEMA_VERSION}): "
                         "upgrade sdvg (pip install -U sdvg) to read it")
    if version < 1:
        raise ValueError(f"statistics schema {version} does not exist; sdvg reads schemas 1-{SCHEMA_VERSION}")
    if version == SCHEMA_VERSION:
        return dict(record)
    record = copy.deepcopy(dict(record))  # converted in a copy: the caller's record stays as it was
    if version == 9:
        out = record
    else:
        out = group_record({k: v for k, v in record.items() if k not in ("schema_version", "nonfinite_fields")})
        for key in NEW_IN_9:
            group, name = FIELDS[key]
            out[group][name] = None
        for group in ALWAYS:  # the table's order within each group, the fields it added in place
            out[group] = {name: out[group][name] for k, (g, name) in FIELDS.items()
                          if g == group and name in out[group]}
        out["nonfinite_fields"] = [_grouped_path(p) for p in record.get("nonfinite_fields", [])]
    for block in out.get("blocks") or []:  # schema 10: the re-cache's own stage time
        if isinstance(block.get("times"), dict):
            block["times"].setdefault("recache", 0.0)
    totals = out.get("result", {}).get("stage_totals")
    if isinstance(totals, dict):
        totals.setdefault("recache", 0.0)
    out["schema_version"] = SCHEMA_VERSION  # the shape it now has
    return out


def block_times(stage_seconds: Mapping[str, float]) -> dict[str, float]:
    """Per-block stage times with the derived `commit` entry."""
    times = {k: float(stage_seconds.get(k, 0.0)) for k in STAGE_NAMES}
    times["commit"] = times["drafter_commit"] + times["target_commit"]
    return times


@dataclass
class BlockRecord:
    """One emitted block."""

    index: int
    decision: str  # forced | accepted | rejected | target | draft
    latents: torch.Tensor  # float32 [1, z, frames_per_block, h, w], the emitted block
    frames: torch.Tensor  # uint8 [T, H, W, 3]
    score: float | None  # the aggregated score of the draft (None: not scored)
    frame_scores: list[float]
    times: dict[str, float]  # seconds per BLOCK_TIME_KEYS (those known when the block was emitted)
    draft_latents: torch.Tensor | None = None  # the drafter's proposal (sdvg mode)
    emitted_scores: list[float] | None = None  # the emitted frames' scores (score_emitted)
    exits: Any = None  # early exit: the block's BlockExits (sdvg/generation/early_exit/record.py)
    redrafts: int = 0  # run-ahead drafts of this block thrown away after a rejection (scheduler cpp)
    # re-cache forwards made under the conditioning of this block or an earlier one, not reported before (a live
    # session's `live["recache_forwards"]`)
    recache_forwards: int = 0
    live: dict | None = None  # live sessions / prompt schedules (docs/live.md): block (the session's), segment,
    # prompt_index, blend_weight, forced_by_update

    def stats(self) -> dict:
        """The block's entry in the statistics (JSON-ready)."""
        out = {"index": self.index, "decision": self.decision, "score": self.score,
               "frame_scores": list(self.frame_scores), "times": dict(self.times),
               "frames": int(self.frames.shape[0]), "redrafts": self.redrafts}
        if self.emitted_scores is not None:
            out["emitted_scores"] = list(self.emitted_scores)
        if self.exits is not None:
            out.update(self.exits.stats())
        if self.live is not None:
            out["live"] = dict(self.live)
        return out


@dataclass
class LoopReport:
    """What a scheduler knows only when the video is done; filled by either loop at its end."""

    counters: Any = None  # _C.Counters
    trace: list[dict] = field(default_factory=list)  # every stage call: block, stage, thread, start_s, end_s
    # block -> its stage times once every call has ended (the native scheduler's; those it kept)
    final_times: dict[int, dict[str, float]] | None = None
    stage_device_s: dict[str, float] | None = None  # stage_timing "events" on CUDA: device seconds per stage
    compile: dict | None = None  # backend compile: what compiling cost during the video (CompileClock.since)
    drafter_cache: Any = None
    target_cache: Any = None


@dataclass
class RunStats(Mapping):
    """The statistics of one video: what `out.stats` is and what `--stats` writes (`as_dict()`, schema 10:
    grouped, docs/stats.md).

    Read it like a dict of the groups (`stats["result"]["acceptance_rate"]`, `stats["options"]["seed"]`); the
    keys are those of `as_dict()`. The attributes `.acceptance_rate`, `.accepted_blocks`, `.frames`, `.wall_s`,
    `.blocks`, `.options`, `.interrupted` read the same values directly."""

    prompt: str
    preset: str
    options: GenerationOptions  # resolved (num_blocks filled in)
    provenance: dict[str, Any] = field(default_factory=dict)  # versions, devices, fingerprints (the pipeline's)
    blocks: list[dict] = field(default_factory=list)  # BlockRecord.stats() per emitted block
    interrupted: bool = False
    counters: dict[str, float] = field(default_factory=dict)  # COUNTER_NAMES
    trace: list[dict] = field(default_factory=list)
    wall_s: float | None = None
    stage_device_s: dict[str, float] | None = None
    compile: dict | None = None  # backend compile: seconds compiling, graphs, inductor cache hits and misses
    extra: dict[str, Any] = field(default_factory=dict)  # set by the caller (video path, prompt index)
    host: dict[str, Any] = field(default_factory=host_state)  # threads, wait policy, load (sdvg/runtime.py)
    # block entries kept (None: all); past it the oldest is folded into `dropped` (the totals stay exact)
    keep_blocks: int | None = None
    dropped: dict[str, Any] = field(default_factory=lambda: _folded())
    argv: list[str] | None = None  # the command line of `sdvg generate` (None from the Python API)
    fps: float = DEFAULT_FPS  # the rate the frames are meant to play at (the CLI's --fps; sdvg.io.DEFAULT_FPS)
    size: tuple[int, int] | None = None  # (height, width) of the emitted frames (None until a block is emitted)
    started_at: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="milliseconds").replace("+00:00", "Z"))
    hostname: str = field(default_factory=socket.gethostname)
    _t0: float = field(default_factory=time.perf_counter, repr=False)

    def add(self, block: BlockRecord) -> None:
        if self.size is None:
            self.size = (int(block.frames.shape[1]), int(block.frames.shape[2]))
        self.blocks.append(block.stats())
        if self.keep_blocks is not None and len(self.blocks) > self.keep_blocks:
            _fold(self.dropped, self.blocks.pop(0))

    def finish(self, report: LoopReport | None, interrupted: bool = False) -> "RunStats":
        if report is not None:
            if report.counters is not None:
                self.counters = report.counters.as_dict()
            self.trace = list(report.trace)
            self.stage_device_s = report.stage_device_s
            self.compile = report.compile
            if report.final_times is not None:  # run-ahead: a drafter commit may end after its block is emitted
                for b in self.blocks:
                    if (final := report.final_times.get(b["index"])) is not None:
                        b["times"] = block_times(final)
        self.wall_s = time.perf_counter() - self._t0
        self.interrupted = interrupted
        return self

    # ----------------------------------------------------------------- derived
    @property
    def frames(self) -> int:
        return self.dropped["frames"] + sum(b["frames"] for b in self.blocks)

    @property
    def accepted_blocks(self) -> int:
        return self.dropped["accepted"] + sum(b["decision"] == "accepted" for b in self.blocks if b["index"] > 0)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted share of blocks 1..B-1 (block 0 is forced to the target); None outside sdvg mode."""
        later = self.dropped["later"] + sum(b["index"] > 0 for b in self.blocks)
        return self.accepted_blocks / later if later and self.options.mode == "sdvg" else None

    def exit_summary(self) -> dict:
        """Early exit over the emitted video: `mean_steps` (k_bar over every emitted token; blocks have equal
        token counts), `max_steps`, and per role the calls and token evaluations of every denoise it made
        for an emitted block."""
        if self.options.early_exit == "none":
            return {"mean_steps": None, "max_steps": None, "exit_roles": {}}
        total = _folded()
        for key in ("exit_blocks", "mean_steps_sum", "max_steps"):
            total[key] = self.dropped[key]
        total["exit_roles"] = {role: dict(agg) for role, agg in self.dropped["exit_roles"].items()}
        for b in self.blocks:
            _fold_exit(total, b)
        n = total["exit_blocks"]
        roles = total["exit_roles"]
        for agg in roles.values():
            agg["mean_steps"] = agg["token_evals"] / agg["tokens"]
        return {"mean_steps": total["mean_steps_sum"] / n if n else None, "max_steps": total["max_steps"],
                "exit_roles": roles}

    def stage_totals(self) -> dict[str, float]:
        return {k: self.dropped["times"][k] + sum(b["times"].get(k, 0.0) for b in self.blocks) for k in TOTAL_KEYS}

    def flat_fields(self) -> dict:
        """Every field of the record by its flat name (FIELDS' keys): what `as_dict()` groups."""
        d: dict[str, Any] = {**self.provenance, "prompt": self.prompt, "preset": self.preset,
                             "started_at": self.started_at, "argv": self.argv, "hostname": self.hostname,
                             "host": self.host, "height": self.size[0] if self.size else None,
                             "width": self.size[1] if self.size else None, "fps": self.fps}
        d.update(self.options.as_dict())
        d.update(blocks=self.blocks, frames=self.frames, interrupted=self.interrupted,
                 acceptance_rate=self.acceptance_rate, accepted_blocks=self.accepted_blocks,
                 blocks_done=self.dropped["blocks"] + len(self.blocks), blocks_dropped=self.dropped["blocks"])
        d.update({k: self.counters.get(k, 0) for k in COUNTER_NAMES})
        d.update(trace=self.trace, wall_s=self.wall_s, stage_totals=self.stage_totals(),
                 stage_device_s=self.stage_device_s, compile=self.compile)
        d.update(self.exit_summary())
        d.update(self.extra)
        return d

    def as_dict(self) -> dict:
        """The record, schema 10: `schema_version`, the groups `run`, `video`, `options`, `result` (and `live`,
        `cli` where they apply), `blocks`, `trace`, `nonfinite_fields` (docs/stats.md)."""
        d = group_record(self.flat_fields())
        d["nonfinite_fields"] = nonfinite_paths(d)
        return d

    def to_json(self, indent: int | None = None) -> str:
        """Strict JSON (no NaN / Infinity): a non-finite number is written as null and its path is
        listed in `nonfinite_fields` (e.g. `options.tau` for tau = inf)."""
        return strict_json(self.as_dict(), indent=indent)

    # Mapping over as_dict()
    def __getitem__(self, key: str):
        d = self.as_dict()
        if key not in d and key in FIELDS and key not in GROUPS:
            group, name = FIELDS[key]
            raise KeyError(f"{key!r}: the statistics are grouped since schema 9; read stats[{group!r}]"
                           + (f"[{name!r}]" if name else "") + " (docs/stats.md)")
        return d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


def _folded() -> dict[str, Any]:
    """The totals of block entries no longer kept (`RunStats.keep_blocks`)."""
    return {"blocks": 0, "frames": 0, "later": 0, "accepted": 0, "times": {k: 0.0 for k in TOTAL_KEYS},
            "exit_blocks": 0, "mean_steps_sum": 0.0, "max_steps": None, "exit_roles": {}}


def _fold(total: dict, b: dict) -> None:
    """One block entry into `total` (what every derived statistic reads of it)."""
    total["blocks"] += 1
    total["frames"] += b["frames"]
    total["later"] += b["index"] > 0
    total["accepted"] += b["index"] > 0 and b["decision"] == "accepted"
    for k in TOTAL_KEYS:
        total["times"][k] += b["times"].get(k, 0.0)
    _fold_exit(total, b)


def _fold_exit(total: dict, b: dict) -> None:
    """Early exit: the block's mean and max steps and each role's calls and token evaluations."""
    if "mean_steps" not in b:
        return
    total["exit_blocks"] += 1
    total["mean_steps_sum"] += b["mean_steps"]
    total["max_steps"] = b["max_steps"] if total["max_steps"] is None else max(total["max_steps"], b["max_steps"])
    for role, r in b["exit"].items():
        if role == "producer":
            continue
        agg = total["exit_roles"].setdefault(role, {"denoises": 0, "forwards": 0, "oracle_forwards": 0,
                                                    "token_evals": 0, "tokens": 0})
        agg["denoises"] += 1
        for key in ("forwards", "oracle_forwards", "token_evals", "tokens"):
            agg[key] += r[key]
