"""Live generation: an unbounded session whose prompt, seed and router threshold change between blocks
(docs/live.md). `LiveSession` (session.py) runs the blocks; `Update`/`UpdateAck` (updates.py) are what a
caller sends and gets back; `ConditioningTable` (conditioning.py) freezes each block's text conditioning.

The names are imported lazily, so the torch-free parts (updates.py: what the command line checks before
any model loads) do not import torch."""
_LAZY = {
    "ConditioningTable": "sdvg.live.conditioning",
    "PromptBank": "sdvg.live.conditioning",
    "blend_weights": "sdvg.live.conditioning",
    "LiveSession": "sdvg.live.session",
    "Update": "sdvg.live.updates",
    "UpdateAck": "sdvg.live.updates",
    "parse_schedule": "sdvg.live.updates",
}

__all__ = ["LiveSession", "Update", "UpdateAck", "ConditioningTable", "PromptBank", "blend_weights", "parse_schedule"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sdvg.live' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
