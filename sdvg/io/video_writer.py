"""MP4 written block by block (imageio-ffmpeg), playable whatever happens after each block.

Each block's frames go straight to ffmpeg; `close()` (also on exceptions, via the context
manager) finalises the file, so a run interrupted half-way leaves a valid MP4 of what was emitted."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from sdvg.io import DEFAULT_CRF, DEFAULT_FPS




class IncrementalMP4Writer:
    """fps: frames per second; crf: libx264's constant rate factor, 0 (lossless) to 51."""

    def __init__(self, path: str | Path, fps: float = DEFAULT_FPS, crf: int = DEFAULT_CRF):
        import imageio.v2 as imageio

        if not fps > 0:
            raise ValueError(f"fps {fps} must be > 0")
        if isinstance(crf, bool) or not isinstance(crf, int) or not 0 <= crf <= 51:
            raise ValueError(f"crf {crf!r} must be an integer in [0, 51] (libx264; lower is better quality)")

        self.path = Path(path)
        if self.path.suffix.lower() != ".mp4":
            raise ValueError(f"output {self.path} must end in .mp4")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = imageio.get_writer(str(self.path), fps=fps, codec="libx264", quality=None,
                                          output_params=["-crf", str(crf)], macro_block_size=1,
                                          ffmpeg_log_level="error")
        self.frames_written = 0

    def write(self, frames: torch.Tensor) -> None:
        """frames uint8 [T, H, W, 3]."""
        if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
        for f in frames.numpy():
            self._writer.append_data(np.ascontiguousarray(f))
        self.frames_written += frames.shape[0]

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def read_mp4_frames(path: str | Path) -> np.ndarray:
    import imageio.v2 as imageio

    reader = imageio.get_reader(str(path))
    try:
        return np.stack([f for f in reader])
    finally:
        reader.close()
