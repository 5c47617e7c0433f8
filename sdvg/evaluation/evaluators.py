"""Quality evaluators for sweeps: a callable (prompt, frames uint8 [F, H, W, 3]) -> float.

`imagereward` is the mean normalised ImageReward of the frames (the pipeline's own scorer).
`python:<module>:<function>` loads a user's evaluator (e.g. a VisionReward wrapper) from an
importable module; it is called with the same arguments."""
from __future__ import annotations

import importlib
from typing import Callable

import torch

Evaluator = Callable[[str, torch.Tensor], float]


def image_reward_evaluator(scorer, max_frames: int = 16) -> Evaluator:
    def evaluate(prompt: str, frames: torch.Tensor) -> float:
        idx = torch.linspace(0, frames.shape[0] - 1, min(max_frames, frames.shape[0])).round().long()
        return float(scorer.score(prompt, frames[idx]).mean())

    return evaluate


def load_evaluator(spec: str, pipe) -> Evaluator:
    if spec == "imagereward":
        if pipe.components.scorer is None:
            raise ValueError("evaluator 'imagereward' needs the pipeline's ImageReward model")
        return image_reward_evaluator(pipe.components.scorer)
    if spec.startswith("python:"):
        try:
            _, module, fn = spec.split(":", 2)
        except ValueError:
            raise ValueError(f"evaluator {spec!r} must look like python:<module>:<function>") from None
        obj = getattr(importlib.import_module(module), fn, None)
        if not callable(obj):
            raise ValueError(f"evaluator {spec!r}: {module}.{fn} is not a callable")
        return obj
    raise ValueError(f"unknown evaluator {spec!r}; use 'imagereward' or 'python:<module>:<function>'")
