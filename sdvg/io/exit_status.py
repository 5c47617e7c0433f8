"""Which failures are bad input (exit 2) and which are runtime failures (exit 1), for errors whose class
alone does not say (docs/cli.md, "Exit statuses"). Torch-free; nothing here imports the modules it names."""
from __future__ import annotations

# Errors about a file or folder the user gave (an engine folder stale, corrupt or missing an engine):
# raised as RuntimeError subclasses by their modules, but input refusals all the same.
INPUT_ERROR_CLASSES = ("EngineCacheError",)


def is_input_error(exc: BaseException) -> bool:
    """True when `exc` refuses an input file or folder (exit 2) although it is not a ValueError."""
    return any(cls.__name__ in INPUT_ERROR_CLASSES for cls in type(exc).__mro__)


DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


def device_type(text: str) -> str:
    """argparse type of a device flag: cpu, cuda, cuda:N (or mps, xpu[:N]); `meta` and others refused before
    any model loads (a meta tensor holds no data: nothing could be generated on it)."""
    import argparse
    import re

    if not re.fullmatch(r"(cpu|mps|(cuda|xpu)(:\d{1,3})?)", text or ""):
        raise argparse.ArgumentTypeError(f"device {text[:40]!r} is not one sdvg runs on; give cpu, cuda or cuda:N")
    return text
