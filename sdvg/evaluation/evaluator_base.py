"""What every evaluator is: `MetricSpec` (one metric's sign and direction), `Evaluator` (the base: name,
metrics, the call) and `EvaluatorUnavailable` (an optional evaluator that cannot run). `evaluators` (the
built-in ones and the spec parser) and `external` (the optional packages' evaluators) both build on this."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sdvg.io import DEFAULT_FPS


@dataclass(frozen=True)
class MetricSpec:
    """One metric: `positive` declares every score > 0 (retention may then be a ratio), and
    `higher_is_better` its direction (False for drift)."""

    name: str
    positive: bool = False
    higher_is_better: bool = True

    def as_dict(self) -> dict:
        return {"positive": self.positive, "higher_is_better": self.higher_is_better}


class EvaluatorUnavailable(ValueError):
    """An optional evaluator's package or weights are missing; the message says how to get them."""


class Evaluator:
    """Base of the evaluators: `name`, `metrics`, `needs_video_file`, and the call."""

    name = "evaluator"
    metrics: tuple[MetricSpec, ...] = ()
    needs_video_file = False

    def __call__(self, prompt: str, frames, fps: float = DEFAULT_FPS,
                 video_path: Path | None = None) -> dict[str, float]:
        raise NotImplementedError

    def specs_for(self, values: dict) -> dict[str, MetricSpec]:
        """The spec of each metric in `values` (in their order)."""
        declared = {m.name: m for m in self.metrics}
        missing = [k for k in values if k not in declared]
        if missing:
            raise ValueError(f"evaluator {self.name!r} returned undeclared metrics {missing}")
        return {k: declared[k] for k in values}
