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
  the resize (neither is Krea's).

Sizes are checked before anything is decoded (issue 35: a 49 KB MP4 of 4096x4096 frames took 4 GB, one of
8192x8192 asked torch for 7.2 GB at once):

- a video's width and height come from its container's header (`probe_video`: ffmpeg's `-i` report, no frame
  decoded) and are refused past `max_side` / `max_pixels`; a budget (`max_bytes`) counts what reading and
  fitting really hold (`input_video_bytes`: the uint8 frames kept, one raw frame in flight, the fit's float32
  frame at full size and its cover);
- an image's size comes from its header (`open_image` reads it through the format's own PIL plugin, so PIL's
  decompression-bomb warning or error is never reached: the limits here refuse first, by name);
- `fit_frames` fits one frame at a time: the float32 copy at full size is one frame's, never a block's (the
  result is bitwise the batched arithmetic's: tests/test_input_sizing.py); a frame whose cover (the scaled
  frame before the crop) would pass `max_pixels`, e.g. 2x8192 fitted to 480x832, is refused."""
from __future__ import annotations

import math
import numbers
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAX_SIDE = 8192  # pixels: a pushed or read frame (or an image) with a longer side is refused
MAX_PIXELS = MAX_SIDE * MAX_SIDE  # width x height of one frame or image, at most; also a fit's cover, at most
MAX_PUSH_FRAMES = 1024  # frames one push may carry
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP")  # the image files opened (start frames)
PROBE_TIMEOUT_S = 30.0  # ffmpeg reading a video's header, at most


class VideoInputError(ValueError):
    """Input frames or an input video that cannot be used; the message names the value and the fix."""


class InputTooLarge(VideoInputError):
    """A frame or image whose size (read from its header) passes a limit (or is under 2 pixels a side)."""


def check_frames(frames, where: str = "input_frames", max_frames: int = MAX_PUSH_FRAMES,
                 max_pixels: int = MAX_PIXELS) -> np.ndarray:
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
    if h * w > max_pixels:
        raise VideoInputError(f"{where} frames are {w}x{h} = {h * w} pixels, more than max_pixels {max_pixels}; "
                              "give smaller frames (e.g. 832x480)")
    return np.ascontiguousarray(frames)


def check_size(width: int, height: int, where: str, max_side: int = MAX_SIDE, max_pixels: int = MAX_PIXELS) -> None:
    """A frame or image of width x height (as its header says, before anything is decoded): each side in
    [2, max_side] and width * height <= max_pixels, else `VideoInputError` naming the limit, the size and the fix."""
    if not (2 <= width <= max_side and 2 <= height <= max_side):
        raise InputTooLarge(f"{where} is {width}x{height} (width x height); each side must lie in [2, {max_side}] "
                            f"(max_side); give a smaller one (e.g. 832x480)")
    if width * height > max_pixels:
        raise InputTooLarge(f"{where} is {width}x{height} = {width * height} pixels, more than max_pixels "
                            f"{max_pixels}; give a smaller one (e.g. 832x480)")


def cover_size(h: int, w: int, height: int, width: int) -> tuple[int, int]:
    """The size an h x w frame is scaled to (bicubic, aspect kept) before the centre crop to height x width."""
    if (h, w) == (height, width):
        return h, w
    scale = max(height / h, width / w)
    return max(height, round(h * scale)), max(width, round(w * scale))


def input_video_bytes(count: int, height: int, width: int, fit_size: tuple[int, int] | None = None) -> int:
    """The most memory (bytes) reading `count` frames of width x height and fitting them holds at once: the uint8
    frames kept (count * h * w * 3) plus the larger of one raw frame in flight from ffmpeg (h * w * 3) and the
    fit's working frame (`fit_frames`, one frame at a time: float32 at full size, h * w * 3 * 4, and, given the
    fitted `fit_size` (height, width), its float32 cover before the crop)."""
    frame = height * width * 3
    fit = 4 * frame
    if fit_size is not None:
        ch, cw = cover_size(height, width, *fit_size)
        fit += 4 * 3 * ch * cw if (ch, cw) != (height, width) else 0
    return count * frame + max(frame, fit)


def check_fit(h: int, w: int, height: int, width: int, max_pixels: int = MAX_PIXELS,
              where: str = "input frames") -> tuple[int, int]:
    """The cover size of an h x w frame fitted to height x width (`cover_size`), refused past `max_pixels`."""
    ch, cw = cover_size(h, w, height, width)
    if ch * cw > max_pixels:
        raise VideoInputError(f"{where}: a {w}x{h} frame scaled to cover {width}x{height} would be {cw}x{ch} = "
                              f"{ch * cw} pixels before the crop, more than max_pixels {max_pixels}; give frames "
                              f"closer to the video's aspect ({width}:{height})")
    return ch, cw


def fit_frames(frames, height: int, width: int, max_pixels: int = MAX_PIXELS,
               where: str = "input frames") -> torch.Tensor:
    """uint8 [N, H, W, 3] (or a sequence of uint8 [H, W, 3] frames, each its own size) -> float32
    [N, 3, height, width] in [-1, 1]: scaled to cover (bicubic), centre-cropped.

    One frame at a time (uint8 -> float32 -> cover -> crop into the output): the float32 copy at full size is one
    frame's, never the block's. Bitwise the batched arithmetic (`x.float().div(255).sub(0.5).div(0.5)` on the
    whole block, `interpolate` of the block, crop): the elementwise steps run in place on the same values and
    the bicubic kernel computes each image of a batch alone. A frame whose cover would pass `max_pixels` is
    refused (`VideoInputError`) before anything is allocated for it."""
    n = len(frames)
    for f in frames:  # every frame's cover checked before the first is fitted
        check_fit(f.shape[0], f.shape[1], height, width, max_pixels, where)
    out = torch.empty((n, 3, height, width), dtype=torch.float32)
    work = None  # the float32 frame at full size, [1, 3, H, W] channels-last as `.float()` of the block made it;
    # one buffer for the block's frames (a size change makes another), so the allocator holds one, not several
    for i in range(n):
        frame = frames[i]
        if not frame.flags.c_contiguous or not frame.flags.writeable:
            frame = np.array(frame)  # one uint8 frame (torch.from_numpy warns on a read-only array)
        h, w = frame.shape[:2]
        if work is None or work.shape[-2:] != (h, w):
            work = None
            work = torch.empty((1, h, w, 3), dtype=torch.float32).permute(0, 3, 1, 2)
        x = work
        x.copy_(torch.from_numpy(frame)[None].permute(0, 3, 1, 2))  # uint8 -> float32, exact as .float()
        x.div_(255.0).sub_(0.5).div_(0.5)
        if (h, w) != (height, width):
            size = cover_size(h, w, height, width)
            x = torch.nn.functional.interpolate(x, size=size, mode="bicubic", align_corners=False)
            top, left = (size[0] - height) // 2, (size[1] - width) // 2
            x = x[:, :, top:top + height, left:left + width]
        out[i].copy_(x[0])
        del x
    del work
    return out


def resample_indices(count: int, source_fps: float, fps: float) -> list[int]:
    """The source frame shown at each of the first `count` output frames (output frame j at j / fps s)."""
    return [int(math.floor(j * source_fps / fps + 0.5)) for j in range(count)]


@dataclass(frozen=True)
class VideoHeader:
    """What a video's container says before any frame is decoded (`probe_video`)."""

    width: int  # as displayed (a 90-degree rotation swaps the coded sides, as ffmpeg's decoding does)
    height: int
    fps: float | None  # None: the header gives no rate
    duration_s: float | None  # None: the header gives no duration
    frames: int | None  # round(duration_s * fps) when both are known: an estimate, not a count
    codec: str


_VIDEO_STREAM = re.compile(r"^\s*Stream #\S+: Video: (\S+)(.*)$", re.M)
_SIZE = re.compile(r" (\d{1,9})x(\d{1,9})[, ]")
_FPS = re.compile(r", (\d+(?:\.\d+)?) fps")
_DURATION = re.compile(r"Duration: (\d+):(\d+):(\d+(?:\.\d+)?)")
_ROTATION = re.compile(r"rotation of (-?\d+(?:\.\d+)?) degrees")


def probe_video(path, max_side: int = MAX_SIDE, max_pixels: int = MAX_PIXELS, where: str | None = None) -> VideoHeader:
    """The header of the video at `path` (ffmpeg's report of its input, `ffmpeg -i`, no shell, no frame decoded
    nor piped), its frame size checked: a side past `max_side` or more than `max_pixels` pixels raises
    `VideoInputError` naming the limit, the size found and the fix, as does a missing file, an unreadable one or
    one with no video stream. `where`: how the messages name the video (default: `input video <path>`)."""
    import imageio_ffmpeg

    path = Path(path)
    where = where or f"input video {path}"
    if not path.is_file():
        raise VideoInputError(f"{where} does not exist or is not a file; give a video file (e.g. an MP4)")
    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-nostdin", "-i", os.fspath(path)]
    try:
        run = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise VideoInputError(f"{where}: ffmpeg did not read its header within {PROBE_TIMEOUT_S:g} s; give a video "
                              "ffmpeg can decode (e.g. an H.264 MP4)") from None
    report = run.stderr.decode("utf-8", "replace")
    found = []  # (pixels, width, height, stream) of every video stream: ffmpeg decodes the largest by default
    for stream in _VIDEO_STREAM.finditer(report):
        size = _SIZE.search(stream.group(2))
        if size is None:
            continue
        width, height = int(size.group(1)), int(size.group(2))
        rotation = _ROTATION.search(report[stream.end():].split("Stream #", 1)[0])
        if rotation and round(abs(float(rotation.group(1)))) % 180 == 90:
            width, height = height, width
        found.append((width * height, width, height, stream))
    if not found:
        said = [line for line in report.strip().splitlines() if "output file must be specified" not in line]
        why = "no video stream" if not said or "Input #" in report else said[-1][-200:]
        raise VideoInputError(f"{where} cannot be read ({why}); give a video ffmpeg can decode (e.g. an H.264 MP4)")
    _, width, height, stream = max(found, key=lambda f: f[0])
    fps = _FPS.search(stream.group(2))
    fps = float(fps.group(1)) if fps and float(fps.group(1)) > 0 else None
    duration = _DURATION.search(report)
    duration = 3600 * int(duration.group(1)) + 60 * int(duration.group(2)) + float(duration.group(3)) \
        if duration else None
    frames = round(duration * fps) if duration is not None and fps is not None else None
    check_size(width, height, where, max_side, max_pixels)
    return VideoHeader(width, height, fps, duration, frames, stream.group(1).rstrip(","))


def read_video(path, count: int, fps: float, max_bytes: int | None = None, *, max_side: int = MAX_SIDE,
               max_pixels: int = MAX_PIXELS, fit_size: tuple[int, int] | None = None) -> np.ndarray:
    """The first `count` frames of the video at `path`, resampled to `fps`: uint8 [n, H, W, 3], n <= count (the
    clip may be shorter). Reads no further than those frames need, into one array (no second copy).

    Before a frame is decoded: the header's size is checked against `max_side` and `max_pixels`
    (`probe_video`), and with `max_bytes` the video is refused when `input_video_bytes(count, H, W, fit_size)`
    would pass it: the `count` uint8 frames kept plus the fit's float32 working frame (`fit_size`, the size the
    frames will be fitted to, adds the fit's cover)."""
    import imageio_ffmpeg

    path = Path(path)
    header = probe_video(path, max_side, max_pixels)
    if fit_size is not None:
        check_fit(header.height, header.width, *fit_size, max_pixels, f"input video {path}")
    _check_budget(path, count, header.height, header.width, max_bytes, fit_size)
    reader = imageio_ffmpeg.read_frames(str(path))
    out, kept = None, 0
    try:
        try:
            meta = next(reader)
        except (RuntimeError, OSError, StopIteration) as exc:
            raise VideoInputError(f"input video {path} cannot be read ({str(exc).strip()[-200:] or 'no video stream'}); "
                                  "give a video ffmpeg can decode (e.g. an H.264 MP4)") from None
        w, h = meta.get("size", (0, 0))
        if (w, h) != (header.width, header.height):  # the frames as ffmpeg sends them: checked as the header was
            check_size(w, h, f"input video {path}", max_side, max_pixels)
            if fit_size is not None:
                check_fit(h, w, *fit_size, max_pixels, f"input video {path}")
            _check_budget(path, count, h, w, max_bytes, fit_size)
        source_fps = meta.get("fps")
        if not isinstance(source_fps, numbers.Real) or not math.isfinite(source_fps) or source_fps <= 0:
            source_fps = fps  # no rate in the container: the frames are taken as they come
        wanted = resample_indices(count, float(source_fps), fps)
        # the pages of frames never read are never touched (nor counted in the RSS); a short clip is shrunk below
        out = np.empty((count, h, w, 3), dtype=np.uint8)
        index = 0
        for raw in reader:
            if kept < count and wanted[kept] == index:
                out[kept] = np.frombuffer(raw, dtype=np.uint8).reshape(h, w, 3)
                kept += 1
                while kept < count and wanted[kept] == index:  # a slower source: the frame shown again
                    out[kept] = out[kept - 1]
                    kept += 1
            del raw
            index += 1
            if kept == count:
                break
    except VideoInputError:
        raise
    except (RuntimeError, OSError, ValueError) as exc:
        raise VideoInputError(f"input video {path} failed to decode ({str(exc).strip()[-200:]}); give a video "
                              "ffmpeg can decode (e.g. an H.264 MP4)") from None
    finally:
        reader.close()
    if not kept:
        raise VideoInputError(f"input video {path} holds no frame; give a video with at least one frame")
    if kept < count:
        try:
            out.resize((kept, h, w, 3))  # in place (realloc): no copy of the frames read
        except ValueError:  # referenced elsewhere (a debugger): a copy instead
            out = out[:kept].copy()
    return out


def _check_budget(path: Path, count: int, h: int, w: int, max_bytes: int | None, fit_size) -> None:
    if max_bytes is None:
        return
    need = input_video_bytes(count, h, w, fit_size)
    if need > max_bytes:
        raise VideoInputError(f"input video {path.name} has {w}x{h} frames: {count} of them would take "
                              f"{need / 2**30:.2f} GiB as read and fitted ({count} uint8 frames and a float32 working "
                              f"frame), more than {max_bytes / 2**30:.2f} GiB (max_bytes); give a smaller "
                              "(e.g. 832x480) or shorter video, or fewer blocks")


def check_image_header(img, max_side: int = MAX_SIDE, max_pixels: int = MAX_PIXELS, where: str = "start_frame") -> \
        tuple[int, int]:
    """A PIL image's (width, height), checked (`check_size`) before its pixels are decoded: call it between
    `Image.open` (lazy: it reads the header only) and `.load()` / `.convert()`. Returns (width, height)."""
    width, height = img.size
    check_size(width, height, where, max_side, max_pixels)
    return width, height


def open_image(source, max_side: int = MAX_SIDE, max_pixels: int = MAX_PIXELS, where: str = "start_frame",
               formats=IMAGE_FORMATS):
    """An image (a path, bytes, or a binary file) opened lazily as one of `formats` (JPEG, PNG, WebP), its size
    read from the header and checked (`check_image_header`) before a pixel is decoded: returns the open PIL image
    (use it in `with`; `.convert("RGB")` decodes it). PIL's `Image.open` would first run its own
    decompression-bomb check (a warning past `Image.MAX_IMAGE_PIXELS`, 89 M pixels, an error past twice that);
    here the format's plugin reads the header directly, so the limits here refuse first, by name, with no
    warning and without touching the process's warnings filters (safe from any thread). Anything else raises
    `VideoInputError` naming `where`."""
    import io

    from PIL import Image

    if isinstance(source, (bytes, bytearray, memoryview)):
        fp, own = io.BytesIO(bytes(source)), True
    elif isinstance(source, (str, os.PathLike)):
        try:
            fp, own = open(source, "rb"), True
        except OSError as exc:
            raise VideoInputError(f"{where} {os.fspath(source)} cannot be opened ({exc.strerror}); give an image "
                                  "file (JPEG, PNG or WebP)") from None
    else:
        fp, own = source, False
    names = "JPEG, PNG or WebP" if tuple(formats) == IMAGE_FORMATS else ", ".join(formats)
    try:
        prefix = fp.read(16)
        Image.init()
        for name in formats:
            factory, accept = Image.OPEN[name.upper()]
            if accept is not None and accept(prefix) is not True:
                continue
            fp.seek(0)
            try:
                img = factory(fp, os.fspath(source) if isinstance(source, (str, os.PathLike)) else "")
            except (SyntaxError, IndexError, TypeError, ValueError, OSError, EOFError) as exc:
                raise VideoInputError(f"{where} is not a readable {names} image ({type(exc).__name__}: "
                                      f"{exc})") from None
            img._exclusive_fp = own  # closed with the image, as Image.open's
            try:
                check_image_header(img, max_side, max_pixels, where)
            except VideoInputError:
                img.close()
                raise
            return img
        raise VideoInputError(f"{where} is not a readable {names} image (its first bytes are none of those)")
    except BaseException:
        if own:
            fp.close()
        raise
