"""Output files: the incremental MP4 writer (`video_writer`). The defaults live here, torch-free, so the
command line can show them without importing torch."""

DEFAULT_FPS = 16  # Wan2.1's frame rate
DEFAULT_CRF = 10  # libx264 constant rate factor (imageio's quality 8): near-lossless
MAX_FPS = 1000  # frames per second an MP4 is written at, at most (bounded before any model loads)


def fps_type(text: str) -> float:
    """argparse type of --fps: a finite number in (0, MAX_FPS] (inf and NaN refused before any work)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text[:40]!r} (give a number in (0, {MAX_FPS}])") from None
    if not math.isfinite(value) or not 0 < value <= MAX_FPS:
        raise argparse.ArgumentTypeError(f"{text[:40]} must be a number in (0, {MAX_FPS}] (default: {DEFAULT_FPS})")
    return value
