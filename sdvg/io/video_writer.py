"""MP4 written block by block through ffmpeg, playable whatever happens after each block.

Each block's frames go straight to an ffmpeg process (raw RGB on its stdin; the executable comes from
imageio-ffmpeg, started without a shell). The video is written under a temporary name beside its final
path (`.<name>.partial.mp4`) and renamed into place when it is closed, so:

- an interrupted run (Ctrl-C, SIGTERM, an exception) still closes the file and renames it: a playable
  MP4 of the blocks emitted so far, under its final name;
- a run that produced no frame leaves no video file;
- a failed encode (disk full, a read-only folder, ffmpeg dying) raises `VideoWriteError` with
  ffmpeg's own message, and the final path is left untouched (a previous file there survives).

The partial video and ffmpeg's log (`.<name>.partial.log`) are created new by sdvg itself (O_CREAT |
O_EXCL | O_NOFOLLOW, `sdvg.io.safe_files`) and handed to ffmpeg as open descriptors (`/dev/fd/N`), so a
symlink planted at either name is refused by name (before any model loads: `check_output_paths`),
never written through; the rename into place checks the name still holds the file written.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import torch

from sdvg.io import DEFAULT_CRF, DEFAULT_FPS, check_fps
from sdvg.io.safe_files import UnsafePathError, create_new, refuse_planted


class VideoWriteError(RuntimeError):
    """The encoder failed; the message carries ffmpeg's exit status and its last lines."""


def partial_path(path: Path) -> Path:
    """Where a video is written until it is closed."""
    return path.with_name(f".{path.stem}.partial{path.suffix}")


def partial_log_path(path: Path) -> Path:
    """ffmpeg's messages while the video is written."""
    return partial_path(path).with_suffix(".log")


def check_partial_names(path: Path) -> None:
    """Refuse (UnsafePathError, by name) a symlink or a non-regular file at the partial video's or the log's
    name: run before any work, so nothing is computed for a video that could not be written."""
    refuse_planted(partial_path(path), f"the partial video of {path}")
    refuse_planted(partial_log_path(path), f"the encoder log of {path}")


# the colour of every MP4 sdvg writes: BT.709 primaries, transfer and matrix, limited (tv) range, yuv420p
COLOR_TAGS = ("-colorspace", "bt709", "-color_primaries", "bt709", "-color_trc", "bt709", "-color_range", "tv")


class IncrementalMP4Writer:
    """fps: frames per second; crf: libx264's constant rate factor, 0 (lossless) to 51. The ffmpeg
    process starts with the first frames (their size fixes the video's)."""

    def __init__(self, path: str | Path, fps: float = DEFAULT_FPS, crf: int = DEFAULT_CRF):
        fps = check_fps(fps)  # [MIN_FPS, MAX_FPS]: refused here, not by ffmpeg once the video is done
        if isinstance(crf, bool) or not isinstance(crf, int) or not 0 <= crf <= 51:
            raise ValueError(f"crf {crf!r} must be an integer in [0, 51] (libx264; lower is better quality)")
        self.path = Path(path)
        if self.path.suffix.lower() != ".mp4":
            raise ValueError(f"output {self.path} must end in .mp4")
        self.fps, self.crf = float(fps), crf
        self.tmp = partial_path(self.path)
        check_partial_names(self.path)
        self._fd: int | None = None  # the partial video, created by us
        self._proc: subprocess.Popen | None = None
        self._stderr = None
        self._size: tuple[int, int] | None = None
        self.frames_written = 0
        self.closed = False

    def _start(self, height: int, width: int) -> None:
        import imageio_ffmpeg

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._stderr = os.fdopen(create_new(partial_log_path(self.path), f"the encoder log of {self.path}",
                                           readable=True), "w+b")
        try:
            self._fd = create_new(self.tmp, f"the partial video of {self.path}")
        except UnsafePathError:
            self._cleanup(keep=False)
            raise
        # RGB -> YUV with the BT.709 matrix into limited range, and the stream tagged so (COLOR_TAGS): players
        # read what was written instead of guessing (an untagged stream is BT.601 to some, BT.709 to others)
        scale = ("scale=out_color_matrix=bt709:out_range=tv,"
                 "setparams=color_primaries=bt709:color_trc=bt709:colorspace=bt709:range=tv")
        pad = "pad=ceil(iw/2)*2:ceil(ih/2)*2," if height % 2 or width % 2 else ""  # yuv420p needs even sides
        args = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error", "-f", "rawvideo", "-vcodec", "rawvideo",
                "-s", f"{width}x{height}", "-pix_fmt", "rgb24", "-r", f"{self.fps:g}", "-i", "-", "-an",
                "-vf", pad + scale, "-vcodec", "libx264", "-pix_fmt", "yuv420p", *COLOR_TAGS, "-crf", str(self.crf),
                "-movflags", "+faststart",
                "-f", "mp4", f"file:/dev/fd/{self._fd}"]  # the file we created; ffmpeg reopens it for faststart
        # its own session: a Ctrl-C in the terminal reaches sdvg, which then closes the file properly
        self._proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self._stderr,
                                      start_new_session=True, pass_fds=(self._fd,))
        self._size = (height, width)

    def write(self, frames: torch.Tensor) -> None:
        """frames uint8 [T, H, W, 3]."""
        if self.closed:
            raise ValueError(f"{self.path}: write after close")
        if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
        if self._proc is not None and tuple(frames.shape[1:3]) != self._size:
            raise ValueError(f"frames of {tuple(frames.shape[1:3])} in a {self._size} video")
        data = np.ascontiguousarray(frames.cpu().numpy()).tobytes()
        from sdvg.io.interrupts import Interrupted, shielded

        with shielded() as later:  # a block goes to the encoder whole: a signal now is raised right after
            if self._proc is None:
                self._start(frames.shape[1], frames.shape[2])
            try:
                self._proc.stdin.write(data)
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._fail("ffmpeg stopped reading frames")
            self.frames_written += frames.shape[0]
        if later:
            raise Interrupted(later[0])

    def _ffmpeg_message(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        lines = self._stderr.read().decode("utf-8", "replace").strip().splitlines()
        return "; ".join(lines[-3:])

    def _fail(self, what: str) -> None:
        code = self._proc.wait() if self._proc is not None else None
        msg = self._ffmpeg_message()
        self._cleanup(keep=False)
        raise VideoWriteError(f"writing {self.path} failed: {what} (ffmpeg exit status {code}"
                              + (f": {msg}" if msg else "") + "); check free disk space and that the folder is "
                              "writable")

    def close(self) -> None:
        """Finish the file and move it into place (nothing is left when no frame was written)."""
        if self.closed:
            return
        if self._proc is None:
            self._cleanup(keep=False)
            return
        try:
            self._proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        code = self._proc.wait()
        if code != 0:
            self._fail("the encoder exited with an error")
        if not self._still_ours():
            self._cleanup(keep=False)
            raise VideoWriteError(f"writing {self.path} failed: {self.tmp} was replaced while the video was written "
                                  "(another program?); nothing was moved into place")
        os.replace(self.tmp, self.path)
        self._cleanup(keep=True)

    def _still_ours(self) -> bool:
        """The partial name still names the file we created (not swapped for a link or another file)."""
        if self._fd is None:
            return False
        try:
            now, mine = os.lstat(self.tmp), os.fstat(self._fd)
        except OSError:
            return False
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def _cleanup(self, keep: bool) -> None:
        self.closed = True
        if self._stderr is not None:
            self._stderr.close()
            _unlink_regular(partial_log_path(self.path))
            self._stderr = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._fd is not None:
            if not keep and self._still_ours():
                self.tmp.unlink()
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _unlink_regular(path: Path) -> None:
    """Remove `path` when it is a regular file (a symlink or anything else put there is left alone)."""
    import stat

    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


def read_mp4_frames(path: str | Path) -> np.ndarray:
    import imageio.v2 as imageio

    reader = imageio.get_reader(str(path))
    try:
        return np.stack([f for f in reader])
    finally:
        reader.close()
