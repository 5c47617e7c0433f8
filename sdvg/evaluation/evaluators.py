"""Quality evaluators for sweeps: named per-video metrics, each declaring its sign and direction.

An evaluator has a `name`, the `metrics` it returns (`MetricSpec`: name, `positive`, `higher_is_better`)
and is called as `evaluator(prompt, frames uint8 [F, H, W, 3], fps, video_path=None) -> {metric: value}`;
one with `needs_video_file = True` reads the video's MP4 (the sweep writes it and passes its path).
`positive` (every score > 0) makes retention a ratio, otherwise it is a difference; `higher_is_better`
orients it (see `sdvg.evaluation.sweep.retention`).

`--evaluator` takes a comma list (e.g. `imagereward,drift`); the first metric of the first evaluator
is a run's `quality`, every metric goes into its `metrics`:

- `imagereward`: the mean normalised ImageReward of up to 16 frames. This is the router's own model
  (the score SDVG accepts or rejects drafts on), so it is not an independent judge of the result;
- `drift`: Speculative Forcing's drift, the spread of MUSIQ over 2-second segments (pyiqa; optional);
- `vbench[:dim+dim...]`: VBench dimensions through the vbench package in its own interpreter (optional);
- `visionreward[:<folder>]`: VisionReward-Video from a local folder through transformers (optional);
- `python:<module>:<name>`: an `Evaluator` instance, or a callable (prompt, frames) returning a float
  (one metric named after it; attributes `positive` / `higher_is_better` declare it) or a dict of
  floats (one metric per key, each with those attributes).

`check_evaluator(spec)` checks names, packages and weights before any model loads (an unknown
evaluator is a ValueError, a missing package or weights an `EvaluatorUnavailable` that says how to get
them); `load_evaluator(spec, pipe)` then builds the evaluators (docs/evaluation.md)."""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sdvg.evaluation.evaluator_base import Evaluator, EvaluatorUnavailable, MetricSpec  # noqa: F401 (the API's names)
from sdvg.io import DEFAULT_FPS


class ImageRewardEvaluator(Evaluator):
    """The mean normalised ImageReward of up to `max_frames` evenly spaced frames, with the pipeline's
    own scorer: the router's model, so a sweep's ImageReward favours what the router accepted."""

    name = "imagereward"
    metrics = (MetricSpec("imagereward", positive=False, higher_is_better=True),)

    def __init__(self, scorer, max_frames: int = 16):
        self.scorer, self.max_frames = scorer, max_frames

    def __call__(self, prompt, frames, fps=DEFAULT_FPS, video_path=None):
        import torch

        idx = torch.linspace(0, frames.shape[0] - 1, min(self.max_frames, frames.shape[0])).round().long()
        return {"imagereward": float(self.scorer.score(prompt, frames[idx]).mean())}


def image_reward_evaluator(scorer, max_frames: int = 16) -> ImageRewardEvaluator:
    return ImageRewardEvaluator(scorer, max_frames)


class CallableEvaluator(Evaluator):
    """A plain callable (prompt, frames) -> float (one metric named `name`) or -> {metric: float}; its
    attributes `positive` and `higher_is_better` declare every metric it returns."""

    def __init__(self, fn: Callable, name: str):
        self.fn, self.name = fn, name
        self.positive = getattr(fn, "positive", False) is True
        self.higher_is_better = getattr(fn, "higher_is_better", True) is not False
        self.metrics = (MetricSpec(name, self.positive, self.higher_is_better),)

    def __call__(self, prompt, frames, fps=DEFAULT_FPS, video_path=None):
        out = self.fn(prompt, frames)
        if isinstance(out, dict):
            return {str(k): float(v) for k, v in out.items()}
        return {self.name: float(out)}

    def specs_for(self, values):
        return {k: MetricSpec(k, self.positive, self.higher_is_better) for k in values}


class EvaluatorSet(Evaluator):
    """Several evaluators as one: their metrics in order (names must differ)."""

    def __init__(self, evaluators: list[Evaluator]):
        if not evaluators:
            raise ValueError("no evaluator given")
        self.evaluators = list(evaluators)
        self.name = ",".join(e.name for e in evaluators)
        self.metrics = tuple(m for e in evaluators for m in e.metrics)
        self.needs_video_file = any(e.needs_video_file for e in evaluators)
        _unique([m.name for m in self.metrics], "metric")

    def __call__(self, prompt, frames, fps=DEFAULT_FPS, video_path=None):
        self._specs: dict[str, MetricSpec] = {}
        out: dict[str, float] = {}
        for e in self.evaluators:
            values = e(prompt, frames, fps=fps, video_path=video_path)
            for k, spec in e.specs_for(values).items():
                if k in out:
                    raise ValueError(f"metric {k!r} is returned by two evaluators ({self.name})")
                out[k] = float(values[k])
                self._specs[k] = spec
        return out

    def specs_for(self, values):
        return {k: self._specs[k] for k in values}


def as_evaluator(obj, name: str | None = None) -> Evaluator:
    """An `Evaluator` as it is; a plain callable wrapped as `CallableEvaluator` (named `name`, else its
    `__name__`, else "quality")."""
    if isinstance(obj, Evaluator):
        return obj
    if not callable(obj):
        raise ValueError(f"evaluator {obj!r} is not callable")
    fn_name = getattr(obj, "__name__", None)
    return CallableEvaluator(obj, name or (fn_name if fn_name and fn_name != "<lambda>" else "quality"))


def primary_metric(evaluator: Evaluator, values: dict) -> str:
    """The run's `quality`: the first metric returned."""
    if not values:
        raise ValueError(f"evaluator {evaluator.name!r} returned no metric")
    return next(iter(values))


def finite_metrics(evaluator: Evaluator, values: dict) -> None:
    bad = [k for k, v in values.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"evaluator {evaluator.name!r} returned non-finite {bad}")


# ---------------------------------------------------------------------------- the --evaluator spec
BUILTIN = ("imagereward", "drift", "vbench", "visionreward")
_TAKES_ARGUMENT = ("vbench", "visionreward")


def _unique(names: list[str], what: str) -> None:
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{what}s {dup} appear twice")


def parse_spec(spec: str) -> list[tuple[str, str | None]]:
    """(evaluator, argument or None) per comma-separated item; raises ValueError naming what is wrong."""
    items = [p.strip() for p in str(spec).split(",")]
    if not spec or any(not p for p in items):
        raise ValueError(f"--evaluator {spec!r}: give a comma list of evaluators, e.g. imagereward,drift")
    out = []
    for item in items:
        if item.startswith("python:"):
            parts = item.split(":", 2)
            if len(parts) != 3 or not parts[1] or not parts[2]:
                raise ValueError(f"evaluator {item!r} must look like python:<module>:<name>")
            out.append(("python", item[len("python:"):]))
            continue
        name, colon, arg = item.partition(":")
        if name not in BUILTIN:
            raise ValueError(f"unknown evaluator {name!r}; use {', '.join(BUILTIN)} or python:<module>:<name> "
                             "(a comma list for several)")
        if colon and name not in _TAKES_ARGUMENT:
            raise ValueError(f"evaluator {name!r} takes no argument (got {item!r})")
        if colon and not arg:
            raise ValueError(f"evaluator {item!r}: empty argument after ':'")
        out.append((name, arg or None))
    _unique([n if n != "python" else f"python:{a}" for n, a in out], "evaluator")
    return out


def _python_object(arg: str):
    module, attr = arg.split(":", 1)
    try:
        obj = getattr(importlib.import_module(module), attr, None)
    except ImportError as exc:
        raise ValueError(f"evaluator python:{arg}: cannot import {module} ({exc})") from None
    if not callable(obj):
        raise ValueError(f"evaluator python:{arg}: {module}.{attr} is not a callable")
    return obj


def check_evaluator(spec: str) -> list[tuple[str, str | None]]:
    """Everything about `spec` that can be checked before any model loads: the names, the python:
    imports, the optional packages and weights (one message per evaluator that cannot run)."""
    from sdvg.evaluation import external

    parsed = parse_spec(spec)
    for name, arg in parsed:
        if name == "python":
            _python_object(arg)
        elif name == "drift":
            external.check_drift()
        elif name == "vbench":
            external.check_vbench(arg)
        elif name == "visionreward":
            external.check_visionreward(arg)
    return parsed


def evaluator_device(pipe) -> str:
    """Where the optional evaluators run: the pipeline's drafter device (with the VAE and the reward)."""
    dev = getattr(getattr(pipe, "components", None), "drafter_device", None)
    if dev is not None:
        return str(dev)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_evaluator(spec: str, pipe) -> Evaluator:
    """The evaluators of `spec` (one, or an `EvaluatorSet`), built once the pipeline is loaded."""
    from sdvg.evaluation import external

    parsed = check_evaluator(spec)
    built: list[Evaluator] = []
    for name, arg in parsed:
        if name == "imagereward":
            scorer = getattr(getattr(pipe, "components", None), "scorer", None)
            if scorer is None:
                raise ValueError("evaluator 'imagereward' needs the pipeline's ImageReward model")
            built.append(ImageRewardEvaluator(scorer))
        elif name == "python":
            built.append(as_evaluator(_python_object(arg), name=arg.split(":", 1)[1]))
        elif name == "drift":
            built.append(external.DriftEvaluator.from_pyiqa(device=evaluator_device(pipe)))
        elif name == "vbench":
            built.append(external.VBenchEvaluator(external.check_vbench(arg), device=evaluator_device(pipe)))
        elif name == "visionreward":
            built.append(external.VisionRewardEvaluator(external.check_visionreward(arg),
                                                        device=evaluator_device(pipe)))
    return built[0] if len(built) == 1 else EvaluatorSet(built)
