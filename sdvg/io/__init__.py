"""Output files: the incremental MP4 writer (`video_writer`). The defaults live here, torch-free, so the
command line can show them without importing torch."""

DEFAULT_FPS = 16  # Wan2.1's frame rate
DEFAULT_CRF = 10  # libx264 constant rate factor (imageio's quality 8): near-lossless
# The frame rates an MP4 is written at (bounded at parse time, before any model loads, and by the writer): the
# models make 16 frames/s; below 1 a "video" is a slideshow, and ffmpeg's MP4 muxer refuses a duration from a rate
# as small as 1e-9 only when the file is finished, after the whole video; 240 is the highest rate cameras, screens
# and players commonly take (ffmpeg itself writes more, nothing plays it).
MIN_FPS = 1
MAX_FPS = 240
FPS_RANGE = f"[{MIN_FPS}, {MAX_FPS}]"


def check_fps(value) -> float:
    """A frame rate as a float in [MIN_FPS, MAX_FPS] (a number: not a bool, finite); ValueError naming the value,
    the range and the default otherwise. The one rule of --fps and of `IncrementalMP4Writer(fps=...)`."""
    import math
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"fps must be a number of frames per second in {FPS_RANGE}, got {type(value).__name__}")
    try:
        fps = float(value)
    except OverflowError:
        fps = math.inf
    if not math.isfinite(fps) or not MIN_FPS <= fps <= MAX_FPS:
        shown = f"{fps:g}" if math.isfinite(fps) or math.isnan(fps) else str(fps)
        raise ValueError(f"fps {shown} must be a number of frames per second in {FPS_RANGE} (default: {DEFAULT_FPS}, "
                         "the models' rate)")
    return fps


def fps_type(text: str) -> float:
    """argparse type of --fps: `check_fps` of the number (inf, NaN, 1e-9 and 1e9 refused before any work)."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text[:40]!r} (give a number in {FPS_RANGE})") from None
    try:
        return check_fps(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
