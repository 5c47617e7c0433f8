"""sdvg: speculative decoding for block-autoregressive video diffusion.

The public names are imported lazily, so `import sdvg` (and `sdvg --help`) does not import torch:

    from sdvg import SpeculativeVideoPipeline, GenerationOptions
"""
import logging
import os

from sdvg.runtime import claim_wait_policy

# The library logs to the `sdvg` logger (and its children, one per module) and never prints; an
# application chooses where records go (`sdvg --log-level` on the command line).
logging.getLogger("sdvg").addHandler(logging.NullHandler())

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
claim_wait_policy()  # before torch loads OpenMP: waiting threads sleep (sdvg/runtime.py says why)

__version__ = "0.1.0"

_LAZY = {
    "SpeculativeVideoPipeline": "sdvg.pipeline",
    "PipelineOutput": "sdvg.pipeline",
    "VideoOutput": "sdvg.pipeline",
    "BlockStream": "sdvg.pipeline",
    "GenerationOptions": "sdvg.options",
    "OptionError": "sdvg.options",
    "PRESETS": "sdvg.config",
    "Preset": "sdvg.config",
    "get_preset": "sdvg.config",
    "ConfigError": "sdvg.config",
    "BlockRecord": "sdvg.generation.types",
    "RunStats": "sdvg.generation.types",
    "read_stats": "sdvg.generation.types",
}

__all__ = sorted(_LAZY)


def source_module(name: str) -> str:
    """The module that defines the public name `name` (one of `__all__`), without importing it: e.g.
    "sdvg.pipeline" for "SpeculativeVideoPipeline"; KeyError for a name sdvg does not export. For tools that
    follow `from sdvg import X` to its module (tests/test_architecture.py's import layers)."""
    return _LAZY[name]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sdvg' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
