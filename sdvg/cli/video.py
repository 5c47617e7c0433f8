"""One video written as its blocks arrive, with a progress bar, closed cleanly on Ctrl-C, SIGTERM or
SIGHUP; and the exit status its stats give."""
from __future__ import annotations

from pathlib import Path

from sdvg.io import DEFAULT_CRF, DEFAULT_FPS


def video_path(out: Path, index: int, many: bool) -> Path:
    """--out itself, or <stem>_<line>.<suffix> per prompt of a prompts file."""
    return out if not many else out.with_name(f"{out.stem}_{index:04d}{out.suffix}")


def run_one(pipe, prompt: str, opts, video: Path, progress: bool = True, fps: float = DEFAULT_FPS,
            crf: int = DEFAULT_CRF, on_block=None, nested: bool = False, input_video=None, start_frame=None):
    """Generate one video, writing the MP4 as blocks arrive at `fps` (the stats' video.fps); returns its
    `RunStats`. On Ctrl-C, SIGTERM or SIGHUP the MP4 of the blocks emitted so far is closed (playable; no file
    when no block was emitted) and the stats (same fields) are marked interrupted, with `cli.interrupted_by`
    naming the signal. A failed
    encode raises `VideoWriteError`. `nested`: the block bar sits under an outer bar (a prompts file's)
    and is cleared when the video is done. `input_video`: video-to-video's input file, `start_frame`: the start
    frame's image file (`pipe.run`)."""
    from sdvg.io.interrupts import Interrupted, shielded, signals_interrupt
    from sdvg.io.progress import progress_bar
    from sdvg.io.video_writer import IncrementalMP4Writer

    opts = pipe.resolve(opts)
    bar = progress_bar(opts.num_blocks, show=progress, desc=video.name, unit="block",
                       position=1 if nested else None, leave=not nested)
    counts = {"forced": 0, "accepted": 0, "rejected": 0}
    writer = IncrementalMP4Writer(video, fps=fps, crf=crf)
    stream = pipe.run(prompt, opts, input_video=input_video, start_frame=start_frame)
    stream.stats.fps = fps
    signum = None
    failed = True
    try:
        with signals_interrupt():
            try:
                for block in stream:
                    writer.write(block.frames)
                    if on_block is not None:
                        on_block(block)
                    if block.decision in counts:
                        counts[block.decision] += 1
                        bar.set_postfix(counts)
                    bar.update(1)
                failed = False
            except KeyboardInterrupt as exc:  # the stream is closed below: its stats are marked interrupted
                signum = exc.signum if isinstance(exc, Interrupted) else 2
                failed = False
    finally:
        with shielded() as later:  # a second Ctrl-C cannot cut the closing short
            bar.close()
            stream.close()  # stops the scheduler thread of an unfinished video
            if failed:
                writer._cleanup(keep=False)  # an error: no half-written file under the final name
            else:
                writer.close()
        if signum is None and later:
            signum = later[0]
    stats = stream.stats  # final: complete, or marked interrupted by close()
    import signal as _signal

    stats.extra["video"] = str(video) if writer.frames_written else None
    stats.extra["interrupted_by"] = None if signum is None else _signal.Signals(signum).name
    return stats


def exit_code(stats) -> int:
    """0, or 128 + the signal that interrupted the run (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""
    import signal as _signal

    by = stats.extra.get("interrupted_by")
    return 0 if by is None else 128 + int(_signal.Signals[by])
