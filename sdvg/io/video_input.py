"""Video-to-video input frames: read from a file, checked when pushed, resampled to the model's frame rate
and fitted to the preset's size (docs/live.md, "Video-to-video").

- reading: the file's frames through ffmpeg (imageio-ffmpeg, no shell), raw RGB, never more than the
  video needs; a missing, unreadable or empty file raises `VideoInputError` naming the path and the fix;
- frame rate: output frame j (at j / 16 s) is the source frame nearest to that time, index
  `round(j * source_fps / 16)` (ffmpeg's `fps` filter keeps the nearest frame too; Krea's `v2v.py` runs
  that filter for clips longer than 33 frames and reads shorter ones as they are);
- size: scaled (bicubic, as Krea's `encode_video_latent`) so that it covers the preset's height x width
  with its aspect kept, then centre-cropped. Departure: Krea interpolates straight to height x width,
  stretching a frame of another aspect; sdvg crops instead so faces and circles stay round;
- values: uint8 RGB -> [-1, 1] as Krea's `TF.to_tensor(frame).sub_(0.5).div_(0.5)`; not clamped after
  the resize (neither is Krea's)."""
from __future__ import annotations

import math
import numbers
from pathlib import Path

import numpy as np
import torch

MAX_SIDE = 8192  # pixels: a pushed or read frame larger than this is refused
MAX_PUSH_FRAMES = 1024  # frames one push may carry


class VideoInputError(ValueError):
    """Input frames or an input video that cannot be used; the message names the value and the fix."""


def check_frames(frames, where: str = "input_frames", max_frames: int = MAX_PUSH_FRAMES) -> np.ndarray:
    """Pushed frames: uint8 [N, H, W, 3] (or one frame [H, W, 3]) as a numpy array or a torch tensor ->
    a uint8 numpy array [N, H, W, 3]. Anything else raises `VideoInputError` naming what is wrong."""
    if isinstance(frames, torch.Tensor):
        if frames.dtype != torch.uint8:
            raise VideoInputError(f"{where} must be uint8 RGB frames [N, H, W, 3], got a {frames.dtype} tensor; "
                                  "convert with (x * 255).round().clamp(0, 255).to(torch.uint8)")
        frames = frames.detach().cpu().numpy()
    if not isinstance(frames, np.ndarray):
        raise VideoInputError(f"{where} must be a uint8 array [N, H, W, 3] (numpy or torch), got "
                              f"{type(frames).__name__}")
    if frames.dtype != np.uint8:
        raise VideoInputError(f"{where} must be uint8 RGB frames [N, H, W, 3], got dtype {frames.dtype}; convert "
                              "with (x * 255).round().clip(0, 255).astype(np.uint8)")
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise VideoInputError(f"{where} must be [N, H, W, 3] RGB (channels last), got shape {list(frames.shape)}")
    n, h, w, _ = frames.shape
    if not 1 <= n <= max_frames:
        raise VideoInputError(f"{where} holds {n} frames; give 1 to {max_frames} at a time")
    if not (2 <= h <= MAX_SIDE and 2 <= w <= MAX_SIDE):
        raise VideoInputError(f"{where} frames are {h}x{w}; each side must lie in [2, {MAX_SIDE}]")
    return np.ascontiguousarray(frames)


def fit_frames(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float32 [N, 3, height, width] in [-1, 1]: scaled to cover (bicubic), centre-cropped."""
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).float().div(255.0).sub(0.5).div(0.5)
    h, w = x.shape[-2:]
    if (h, w) != (height, width):
        scale = max(height / h, width / w)
        size = (max(height, round(h * scale)), max(width, round(w * scale)))
        x = torch.nn.functional.interpolate(x, size=size, mode="bicubic", align_corners=False)
        top, left = (size[0] - height) // 2, (size[1] - width) // 2
        x = x[:, :, top:top + height, left:left + width]
    return x.contiguous()


def resample_indices(count: int, source_fps: float, fps: float) -> list[int]:
    """The source frame shown at each of the first `count` output frames (output frame j at j / fps s)."""
    return [int(math.floor(j * source_fps / fps + 0.5)) for j in range(count)]


def read_video(path, count: int, fps: float, max_bytes: int | None = None) -> np.ndarray:
    """The first `count` frames of the video at `path`, resampled to `fps`: uint8 [n, H, W, 3], n <= count (the
    clip may be shorter). Reads no further than those frames need. `max_bytes`: refused (before decoding a frame)
    when `count` frames of its size would pass it."""
    import imageio_ffmpeg

    path = Path(path)
    if not path.is_file():
        raise VideoInputError(f"input video {path} does not exist or is not a file; give a video file (e.g. an MP4)")
    reader = imageio_ffmpeg.read_frames(str(path))
    try:
        try:
            meta = next(reader)
        except (RuntimeError, OSError, StopIteration) as exc:
            raise VideoInputError(f"input video {path} cannot be read ({str(exc).strip()[-200:] or 'no video stream'}); "
                                  "give a video ffmpeg can decode (e.g. an H.264 MP4)") from None
        w, h = meta.get("size", (0, 0))
        if not (2 <= h <= MAX_SIDE and 2 <= w <= MAX_SIDE):
            raise VideoInputError(f"input video {path} has frames of {h}x{w}; each side must lie in [2, {MAX_SIDE}]")
        if max_bytes is not None and count * h * w * 3 > max_bytes:
            raise VideoInputError(f"input video {path.name} has {w}x{h} frames: {count} of them would take "
                                  f"{count * h * w * 3 / 2**30:.1f} GiB, more than {max_bytes / 2**30:.1f} GiB; give a "
                                  "smaller (e.g. 832x480) or shorter video, or fewer blocks")
        source_fps = meta.get("fps")
        if not isinstance(source_fps, numbers.Real) or not math.isfinite(source_fps) or source_fps <= 0:
            source_fps = fps  # no rate in the container: the frames are taken as they come
        wanted = resample_indices(count, float(source_fps), fps)
        frames, index, out = None, 0, []
        for raw in reader:
            frames = np.frombuffer(raw, dtype=np.uint8).reshape(h, w, 3)
            while len(out) < count and wanted[len(out)] == index:
                out.append(frames)
            index += 1
            if len(out) == count:
                break
    except VideoInputError:
        raise
    except (RuntimeError, OSError, ValueError) as exc:
        raise VideoInputError(f"input video {path} failed to decode ({str(exc).strip()[-200:]}); give a video "
                              "ffmpeg can decode (e.g. an H.264 MP4)") from None
    finally:
        reader.close()
    if not out:
        raise VideoInputError(f"input video {path} holds no frame; give a video with at least one frame")
    return np.stack(out)
