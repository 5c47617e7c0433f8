"""Inputs sized before they are decoded (issue 35, item 1; sdvg/io/video_input.py).

Before: a 49 KB MP4 of 4096x4096 frames raised the server's RSS from 1.0 to 5.0 GB (the uint8 frames kept twice
by `np.stack`, then each block converted to float32 whole, twice over); a 193 KB one of 8192x8192 frames asked
torch for 7.2 GB at once, although the 2 GiB cap (`max_bytes`) let both through: it counted the uint8 frames
only. Here: the header's size is checked against `max_side` / `max_pixels` before a frame is decoded, the budget
counts what is held (`input_video_bytes`), `fit_frames` fits one frame at a time (bitwise the batched
arithmetic), and an image's header is checked before its pixels are decoded, PIL's bomb warning never reached.

The videos are tiny files of large black frames (imageio-ffmpeg, ~50 KB for two 4096x4096 frames, under a second
to write); the memory checks run in a subprocess and read its peak RSS (ru_maxrss), torch's allocations included."""
import io
import json
import struct
import subprocess
import sys
import textwrap
import warnings
import zlib

import numpy as np
import pytest
import torch

from sdvg.io.video_input import VideoInputError, fit_frames, read_video

FRAME_4K = 4096 * 4096 * 3  # bytes of one uint8 4096x4096 RGB frame
GiB = 2**30


def _batched_fit(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """The old `fit_frames`, verbatim: the whole block to float32 at full size, then one interpolate."""
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).float().div(255.0).sub(0.5).div(0.5)
    h, w = x.shape[-2:]
    if (h, w) != (height, width):
        scale = max(height / h, width / w)
        size = (max(height, round(h * scale)), max(width, round(w * scale)))
        x = torch.nn.functional.interpolate(x, size=size, mode="bicubic", align_corners=False)
        top, left = (size[0] - height) // 2, (size[1] - width) // 2
        x = x[:, :, top:top + height, left:left + width]
    return x.contiguous()


def _black_video(path, side: int, frames: int, fps: int = 16) -> None:
    import imageio_ffmpeg

    writer = imageio_ffmpeg.write_frames(str(path), (side, side), fps=fps, macro_block_size=1,
                                         output_params=["-preset", "ultrafast"])
    writer.send(None)
    black = bytes(side * side * 3)
    for _ in range(frames):
        writer.send(black)
    writer.close()


@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    """Two black 4096x4096 frames at 16 frames/s: ~50 KB on disk, 96 MiB as uint8, 384 MiB as float32."""
    path = tmp_path_factory.mktemp("bomb") / "bomb4096.mp4"
    _black_video(path, 4096, 2)
    assert path.stat().st_size < 200_000
    return path


def _run(code: str) -> dict:
    """Run `code` in a fresh interpreter (the repository's sdvg); it prints one JSON line last."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ fit_frames: one frame at a time, exactly


@pytest.mark.parametrize("n,h,w,height,width", [
    (3, 48, 80, 48, 80),     # no resize
    (4, 60, 100, 48, 80),    # same aspect, down
    (2, 30, 50, 48, 80),     # same aspect, up
    (3, 64, 64, 48, 80),     # square into wide: crops rows
    (2, 100, 40, 48, 80),    # tall into wide
    (5, 33, 17, 20, 28),     # odd sizes, up
    (2, 48, 120, 48, 80),    # same height, wider: resized to itself, then cropped
    (1, 7, 9, 64, 64),       # tiny
])
def test_fit_frames_frame_by_frame_equals_the_batched_arithmetic_bitwise(n, h, w, height, width):
    frames = np.random.default_rng(h * w + n).integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)
    want = _batched_fit(frames, height, width)
    got = fit_frames(frames, height, width)
    assert got.dtype == torch.float32 and got.shape == (n, 3, height, width) and got.is_contiguous()
    assert torch.equal(got, want)
    # the live path hands the frames over as a list (no stacked copy), a file's as a read-only buffer may be
    assert torch.equal(fit_frames(list(frames), height, width), want)
    ro = np.frombuffer(frames.tobytes(), dtype=np.uint8).reshape(frames.shape)
    assert not ro.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.from_numpy's warning on a read-only array is not hit
        assert torch.equal(fit_frames(ro, height, width), want)


def test_fit_frames_never_allocates_a_block_in_float32():
    """torch's own memory profiler (CPU): apart from the fitted output, no allocation during the fit is larger than
    one frame's float32 at full size; the batched version made four of the whole block's (to float32, /255, -0.5,
    /0.5) and interpolated the block at once."""
    from torch.profiler import ProfilerActivity, profile

    n, h, w, height, width = 6, 40, 64, 32, 32
    frames = np.random.default_rng(0).integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fit_frames(frames, height, width)
    made = sorted((e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0), reverse=True)
    output, frame32 = out.numel() * 4, h * w * 3 * 4
    assert made[0] == output, made
    assert made[1] <= frame32 < n * frame32, made  # the working frame (the batched fit: n * frame32, four times)
    cover32 = 3 * 32 * 51 * 4  # a 40x64 frame covers 32x32 at 32x51
    assert sum(made[1:]) <= frame32 + n * 2 * cover32 < 4 * n * frame32, made  # one working frame; covers


def test_fit_frames_peak_memory_is_one_frames_float32_not_the_blocks():
    """16 frames of 1024x1024 (12 MiB each as float32, 192 MiB as a block) fitted to 48x80: the peak RSS grows
    by one frame's float32 (the working buffer, reused for every frame of the block), not the block's (the batched
    version grew by 270 to 384 MiB: up to two float32 copies of the block)."""
    got = _run("""
        import json, resource, numpy as np, torch
        from sdvg.io.video_input import fit_frames
        torch.set_num_threads(2)
        frames = np.random.default_rng(0).integers(0, 256, size=(16, 1024, 1024, 3), dtype=np.uint8)
        fit_frames(frames[:1, :64, :64], 48, 80)  # kernels and thread pools warmed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = fit_frames(frames, 48, 80)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"grew": (after - before) * 1024, "shape": list(out.shape)}))
    """)
    frame32, block32 = 1024 * 1024 * 3 * 4, 16 * 1024 * 1024 * 3 * 4
    assert got["shape"] == [16, 3, 48, 80]
    assert got["grew"] < 2 * frame32, (got, frame32, block32)  # measured: 1.04 frame32; batched: 23 to 32


# ------------------------------------------------------------------ videos: the header first


def test_the_budget_counts_what_reading_and_fitting_hold():
    from sdvg.io.video_input import cover_size, input_video_bytes

    # the cases under the server's 2 GiB: 33 frames of 4096x4096 fit (1.7 GiB held, ~6 GiB before),
    # 9 of 8192x8192 do not (the uint8 count, 1.7 GiB, let them through to a 7.2 GB float32 block)
    assert cover_size(4096, 4096, 480, 832) == (832, 832)
    assert input_video_bytes(33, 4096, 4096, (480, 832)) == 33 * FRAME_4K + 4 * FRAME_4K + 4 * 3 * 832 * 832
    assert input_video_bytes(33, 4096, 4096, (480, 832)) < 2 * GiB
    assert 9 * 8192 * 8192 * 3 < 2 * GiB < input_video_bytes(9, 8192, 8192)
    # no fit size: the fit's float32 frame; a frame already at the fitted size has no cover to count
    assert input_video_bytes(5, 32, 48) == 5 * 32 * 48 * 3 + 4 * 32 * 48 * 3
    assert input_video_bytes(5, 32, 48, (32, 48)) == input_video_bytes(5, 32, 48)


def test_probe_video_reads_the_header_without_decoding(bomb, tmp_path):
    from sdvg.io.video_input import VideoHeader, probe_video

    header = probe_video(bomb)
    assert header == VideoHeader(width=4096, height=4096, fps=16.0, duration_s=header.duration_s, frames=2,
                                 codec="h264")
    assert header.duration_s == pytest.approx(2 / 16, abs=0.02)
    with pytest.raises(VideoInputError) as e:
        probe_video(bomb, max_pixels=1920 * 1080)
    assert all(s in str(e.value) for s in ("bomb4096.mp4", "4096x4096", "max_pixels 2073600", "smaller")), e.value
    with pytest.raises(VideoInputError) as e:
        probe_video(bomb, max_side=2048, where="the upload")
    assert all(s in str(e.value) for s in ("the upload", "4096x4096", "[2, 2048]", "max_side")), e.value
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00\x00\x00\x18ftypisom" + b"\x00" * 64)
    with pytest.raises(VideoInputError, match="cannot be read"):
        probe_video(bad)
    with pytest.raises(VideoInputError, match="does not exist"):
        probe_video(tmp_path / "missing.mp4")


def test_a_large_frame_video_is_refused_before_a_frame_is_decoded(bomb, monkeypatch):
    """42 frames of 4096x4096 are 1.97 GiB of uint8 (under 2 GiB: the old cap let them through and decoded
    them), but 2.16 GiB with the fit's float32 frame: refused with ffmpeg's frames never started. The size
    limits refuse too, naming themselves."""
    import imageio_ffmpeg

    started = []
    monkeypatch.setattr(imageio_ffmpeg, "read_frames", lambda *a, **k: started.append(a) or iter(()))
    assert 42 * FRAME_4K < 2 * GiB
    with pytest.raises(VideoInputError) as e:
        read_video(bomb, 42, fps=16, max_bytes=2 * GiB)
    assert all(s in str(e.value) for s in ("bomb4096.mp4", "4096x4096", "42", "2.16 GiB", "2.00 GiB", "max_bytes",
                                           "smaller")), e.value
    with pytest.raises(VideoInputError, match=r"more than max_pixels 2073600"):
        read_video(bomb, 9, fps=16, max_pixels=1920 * 1080)
    with pytest.raises(VideoInputError, match=r"each side must lie in \[2, 1024\] \(max_side\)"):
        read_video(bomb, 9, fps=16, max_side=1024)
    assert started == []  # no decoder was started for any of them


def test_a_large_frame_video_is_read_and_fitted_within_its_budget(bomb):
    """The issue's bomb through the server's path (`read_video` with the 2 GiB cap and the fit size, then the
    blocks' fit), in a fresh process: refused, it grows by almost nothing; read and fitted, by about the
    budget's `input_video_bytes` of the frames it holds (the old code: ~1 GiB for these two frames)."""
    got = _run(f"""
        import json, resource, torch
        from sdvg.io.video_input import VideoInputError, fit_frames, read_video
        torch.set_num_threads(2)
        fit_frames(torch.zeros(1, 8, 8, 3, dtype=torch.uint8).numpy(), 48, 80)  # kernels and thread pools warmed
        rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        start = rss()
        try:
            read_video({str(bomb)!r}, 42, 16, max_bytes=2 * 2**30, fit_size=(480, 832))
            refused = False
        except VideoInputError:
            refused = True
        after_refusal = rss()
        frames = read_video({str(bomb)!r}, 9, 16, max_bytes=2 * 2**30, fit_size=(480, 832))
        after_read = rss()
        out = fit_frames(frames, 480, 832)
        after_fit = rss()
        print(json.dumps(dict(refused=refused, refusal=after_refusal - start, read=after_read - start,
                              fit=after_fit - start, frames=len(frames), shape=list(out.shape))))
    """)
    from sdvg.io.video_input import input_video_bytes

    assert got["refused"] and got["frames"] == 2 and got["shape"] == [2, 3, 480, 832]
    assert got["refusal"] < 16 * 2**20, got  # not a frame decoded
    held = input_video_bytes(2, 4096, 4096, (480, 832))  # 2 frames kept, one float32 frame and its cover
    assert got["read"] < 3 * FRAME_4K + 32 * 2**20, got  # the frames kept and one in flight: no stacked copy
    assert got["fit"] < held + 2 * 3 * 480 * 832 * 4 + 64 * 2**20, (got, held)


# ------------------------------------------------------------------ frames pushed or given whose fit would explode


def test_frames_whose_cover_would_explode_are_refused_before_the_fit():
    """A 2x8192 frame is small (16 K pixels) but covers 480x832 at 480x1966080 (944 M pixels, 11 GB as float32):
    refused when pushed, not when a block takes it."""
    from sdvg.generation.video_input import LiveFrames

    live = LiveFrames(480, 832)
    with pytest.raises(VideoInputError) as e:
        live.push(np.zeros((1, 2, 8192, 3), np.uint8))
    assert all(s in str(e.value) for s in ("8192x2", "943718400", "max_pixels 67108864")), e.value
    assert live.queued() == 0
    live.push(np.zeros((2, 240, 416, 3), np.uint8))  # an ordinary aspect is queued
    assert live.queued() == 2
    with pytest.raises(VideoInputError, match=r"more than max_pixels 1000000"):
        fit_frames(np.zeros((1, 2, 2048, 3), np.uint8), 480, 832, max_pixels=10**6)


# ------------------------------------------------------------------ images: the header first, no PIL bomb warning


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header says width x height, its pixel data a few bytes (PIL reads the header lazily)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + \
        chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [10000, 20000])  # past PIL's warning (89 M pixels), past its error (179 M)
def test_a_huge_start_frame_is_refused_by_its_header_without_pils_bomb_warning(side, tmp_path):
    from sdvg.generation.start_frame import start_frame_image

    path = tmp_path / f"huge{side}.png"
    path.write_bytes(_png_header(side, side))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(VideoInputError) as e:
            start_frame_image(path)
        assert all(s in str(e.value) for s in ("start_frame", f"huge{side}.png", f"{side}x{side}", "[2, 8192]",
                                               "max_side")), e.value
    assert not [w for w in caught if "decompression bomb" in str(w.message)], [str(w.message) for w in caught]


def test_open_image_checks_the_header_before_decoding():
    """The server's call (`open_image(data, max_side=..., max_pixels=..., where=...)`): bytes in, the lazily opened
    image out; past a limit refused with nothing decoded; not JPEG/PNG/WebP refused."""
    from PIL import Image

    from sdvg.io.video_input import open_image

    with pytest.raises(VideoInputError) as e:
        open_image(_png_header(5000, 3000), max_pixels=1920 * 1080, where="the upload")
    assert all(s in str(e.value) for s in ("the upload", "5000x3000", "max_pixels 2073600")), e.value
    with pytest.raises(VideoInputError, match=r"is not a readable JPEG, PNG or WebP image"):
        open_image(b"GIF89a" + bytes(32))
    image = np.random.default_rng(1).integers(0, 256, size=(20, 30, 3), dtype=np.uint8)
    for fmt in ("PNG", "WEBP", "JPEG"):
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
        with open_image(buf.getvalue(), max_side=64, max_pixels=30 * 20) as img:
            assert img.size == (30, 20) and img.format == fmt
            pixels = np.asarray(img.convert("RGB"))
        with Image.open(io.BytesIO(buf.getvalue())) as ref:
            assert np.array_equal(pixels, np.asarray(ref.convert("RGB")))


def test_a_lazily_opened_pil_start_frame_is_checked_before_it_is_decoded():
    from PIL import Image

    from sdvg.generation.start_frame import start_frame_image
    from sdvg.io.video_input import check_image_header

    img = Image.open(io.BytesIO(_png_header(9000, 3000)))  # 27 M pixels: under PIL's limit, past max_side
    decoded = []
    img.load = lambda: decoded.append(True)  # noqa: E731 - convert() decodes through load()
    with pytest.raises(VideoInputError) as e:
        start_frame_image(img)
    assert all(s in str(e.value) for s in ("start_frame", "9000x3000", "[2, 8192]")), e.value
    assert decoded == []
    assert check_image_header(Image.open(io.BytesIO(_png_header(640, 480))), max_side=640) == (640, 480)
