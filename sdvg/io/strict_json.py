"""Strict JSON: what the statistics, records and reports are written as (non-finite floats become null and
their paths are listed by the caller, so strict parsers accept every file sdvg writes)."""
from __future__ import annotations

import json
import math


def nonfinite_paths(obj, prefix: str = "") -> list[str]:
    """Dotted paths of the non-finite floats in a JSON-like object (list items as [i])."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [prefix]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() if k != "nonfinite_fields"
                for p in nonfinite_paths(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in nonfinite_paths(v, f"{prefix}[{i}]")]
    return []


def _finite_or_none(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def strict_json(obj, indent: int | None = None) -> str:
    """JSON that strict parsers accept: non-finite floats become null (callers list them)."""
    return json.dumps(_finite_or_none(obj), indent=indent, allow_nan=False)
