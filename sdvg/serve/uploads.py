"""Uploaded files, known only by the ids the server makes (`up_` + 32 hex): never a client's path.

Each upload is checked by its first bytes (MP4/MOV/WebM for videos; JPEG/PNG/WebP for images,
which are also decoded under a pixel limit), capped in size while it is read, stored under the
server's own folder with a name made from the id, and deleted `upload_ttl_s` after its POST or when the
server stops. A session that names an upload claims it: a claimed upload outlives its TTL (a queued
session, a reset) until every socket that claimed it has closed.
Webcam frames (`image_bytes`, `decode_frame`) are not uploads: they are decoded from the message itself."""
from __future__ import annotations

import asyncio
import base64
import binascii
import re
import secrets
import threading
import time
from pathlib import Path

VIDEO_KINDS = {"mp4": lambda h: h[4:8] == b"ftyp", "webm": lambda h: h[:4] == b"\x1a\x45\xdf\xa3"}
IMAGE_KINDS = {"jpeg": lambda h: h[:3] == b"\xff\xd8\xff", "png": lambda h: h[:8] == b"\x89PNG\r\n\x1a\n",
               "webp": lambda h: h[:4] == b"RIFF" and h[8:12] == b"WEBP"}


DATA_URL = re.compile(r"data:[\w.+/-]{0,100}(?:;[\w.+=-]{1,100}){0,4},")  # `data:image/jpeg;base64,` before the data


class UploadError(ValueError):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers


def sniff(head: bytes, kinds: dict) -> str | None:
    return next((name for name, test in kinds.items() if test(head)), None)


def _open_image(data: bytes, max_pixels: int, where: str):
    """An image (JPEG, PNG or WebP) opened lazily, its size checked from the header before any pixel is decoded
    (`sdvg.io.video_input.open_image`: PIL's own bomb check never runs); UploadError 413 past `max_pixels`."""
    from sdvg.io.video_input import InputTooLarge, VideoInputError, open_image

    try:
        return open_image(data, max_pixels=max_pixels, where=where)
    except VideoInputError as exc:
        raise UploadError(413 if isinstance(exc, InputTooLarge) else 400, str(exc)) from None


def check_image(data: bytes, max_pixels: int) -> tuple[int, int]:
    """Decode an image under a pixel limit (read from the header before decoding); its (width, height)."""
    img = _open_image(data, max_pixels, "the uploaded image")
    try:
        with img:
            img.load()
            return img.width, img.height
    except Exception as exc:  # PIL's many decode errors
        raise UploadError(400, f"not a decodable image ({type(exc).__name__})") from None


def check_video_upload(store: "UploadStore", upload_id: str, max_pixels: int) -> None:
    """A stored video upload's frame size from its container's header (ffmpeg, no frame decoded); past `max_pixels`
    or unreadable, the upload is deleted and UploadError (413 / 415) names the limit and the flag."""
    from sdvg.io.video_input import InputTooLarge, VideoInputError, probe_video

    path = store.path(upload_id)
    try:
        probe_video(path, max_pixels=max_pixels, where="the uploaded video")
    except VideoInputError as exc:
        store.delete(upload_id)
        text = str(exc).replace(str(path), "the uploaded video")
        too_big = isinstance(exc, InputTooLarge)
        raise UploadError(413 if too_big else 415, text + (" (sdvg serve --max-input-video-pixels)" if too_big
                                                           else "")) from None


def image_bytes(image: bytes | str, max_bytes: int) -> bytes:
    """A webcam `image` as its bytes: bytes as sent, or text in base64 or as a base64 data URL (Krea's page sends the
    base64 part of a data URL; Krea's server decodes both); the length is checked before anything is decoded.
    UploadError names what is wrong."""
    if isinstance(image, (bytes, bytearray)):
        data = bytes(image)
    else:
        text = image
        if text.startswith("data:"):
            header = DATA_URL.match(text)
            if header is None or ";base64," not in header.group(0):
                raise UploadError(400, "a data URL must be base64 (data:image/jpeg;base64,...)")
            text = text[header.end():]
        if len(text) > (max_bytes + 2) // 3 * 4:
            raise UploadError(413, f"{len(text)} base64 characters: more than {max_bytes} bytes")
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise UploadError(400, "text that is not base64: send the image's bytes, base64 or a base64 data "
                                   "URL") from None
    if len(data) > max_bytes:
        raise UploadError(413, f"{len(data)} bytes; at most {max_bytes}")
    return data


def decode_frame(data: bytes, max_pixels: int):
    """A webcam `image` (JPEG, PNG or WebP bytes; no other format is opened) -> uint8 RGB [H, W, 3], under a pixel
    limit (read from the header before decoding); `UploadError` names what is wrong."""
    import numpy as np

    img = _open_image(data, max_pixels, "image")
    try:
        with img:
            return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except Exception as exc:  # PIL's many decode errors
        raise UploadError(400, f"not a decodable image ({type(exc).__name__})") from None


class UploadStore:
    """The uploads on disk, by id: at most `max_bytes` of them at once (a POST that would pass it, once the expired
    ones are gone, is refused with 507, so that clients cannot fill the server's disk within a TTL)."""

    def __init__(self, folder: Path, ttl_s: float, max_bytes: int | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._items: dict[str, tuple[Path, float, str, int]] = {}  # id -> (file, created, kind, bytes)
        self._claims: dict[str, int] = {}  # id -> sessions holding it (kept past its TTL while > 0)
        self._reserved = 0  # bytes held: stored uploads plus the ones being written
        self._lock = threading.Lock()

    def add(self, data: bytes, kind: str) -> str:
        self.expire()
        size = len(data)
        with self._lock:
            if self.max_bytes is not None and self._reserved + size > self.max_bytes:
                raise UploadError(507, f"the server holds {self._reserved} bytes of uploads and takes at most "
                                       f"{self.max_bytes}; this one ({size} bytes) does not fit: try again once "
                                       f"older uploads expire (after {self.ttl_s:g} s) or their sessions end")
            self._reserved += size
        upload_id = "up_" + secrets.token_hex(16)
        path = self.folder / f"{upload_id}.{kind}"
        try:
            path.write_bytes(data)
        except BaseException:
            path.unlink(missing_ok=True)
            with self._lock:
                self._reserved -= size
            raise
        with self._lock:
            self._items[upload_id] = (path, time.monotonic(), kind, size)
        return upload_id

    @property
    def nbytes(self) -> int:
        """Bytes of the uploads held (and being written)."""
        with self._lock:
            return self._reserved

    def known(self, upload_id: str) -> bool:
        with self._lock:
            return upload_id in self._items

    def path(self, upload_id: str) -> Path | None:
        """The server-side file of an upload this store made (None when unknown or expired)."""
        with self._lock:
            item = self._items.get(upload_id)
        return None if item is None else item[0]

    def claim(self, upload_id: str) -> Path | None:
        """A session names the upload: its file (None when unknown or expired), kept until `release`."""
        with self._lock:
            item = self._items.get(upload_id)
            if item is None:
                return None
            self._claims[upload_id] = self._claims.get(upload_id, 0) + 1
        return item[0]

    def release(self, upload_id: str) -> None:
        """The session that claimed the upload is gone: past its TTL and unclaimed, it is deleted."""
        with self._lock:
            left = self._claims.pop(upload_id, 0) - 1
            if left > 0:
                self._claims[upload_id] = left
        self.expire()

    def delete(self, upload_id: str) -> None:
        with self._lock:
            item = self._items.pop(upload_id, None)
            if item is not None:
                self._reserved -= item[3]
        if item is not None:
            item[0].unlink(missing_ok=True)

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [k for k, (_, t, _, _) in self._items.items() if now - t > self.ttl_s and k not in self._claims]
        for k in old:
            self.delete(k)

    def clear(self) -> None:
        with self._lock:
            ids = list(self._items)
            self._claims.clear()
        for k in ids:
            self.delete(k)

    def __len__(self) -> int:
        return len(self._items)


class UploadReceiver:
    """POST /upload_video and /upload_start_frame: at most `max_concurrent_uploads` bodies received at once (each is
    held in memory while read; one more is refused 503), each capped in size and read at a least rate, its file
    checked by its bytes (and an image decoded, a video's frame size read from its header) before it is stored.
    Every refusal is an UploadError (status, message, headers), counted as
    `sdvg_serve_refused_messages_total{reason="upload"}`."""

    def __init__(self, store: UploadStore, cfg, metrics):
        self.store, self.cfg, self.metrics = store, cfg, metrics
        self.receiving = 0  # uploads being received on this event loop
        metrics.uploads_receiving.set_function(lambda: self.receiving)  # read at each scrape

    async def receive(self, request, image: bool) -> dict:
        """The upload's reply: its id (`path`, Krea's name for what its page sends back, and `id`), file name, size
        and kind."""
        cfg = self.cfg
        kinds, limit = (IMAGE_KINDS, cfg.max_image_bytes) if image else (VIDEO_KINDS, cfg.max_upload_bytes)
        if self.receiving >= cfg.max_concurrent_uploads:
            self.metrics.refused.labels("upload").inc()
            raise UploadError(503, f"busy: {self.receiving} uploads are being received (at most "
                              f"{cfg.max_concurrent_uploads} at once); retry in a moment", {"Retry-After": "1"})
        self.receiving += 1
        try:
            data, kind, filename = await self._read(request, kinds, limit)
            if image:
                await asyncio.to_thread(check_image, data, cfg.max_image_pixels)
            upload_id = await asyncio.to_thread(self.store.add, data, kind)  # 507 past max_upload_store_bytes
            if not image:  # its frame size from the container's header (ffmpeg -i, nothing decoded)
                await asyncio.to_thread(check_video_upload, self.store, upload_id, cfg.max_input_video_pixels)
        except UploadError:
            self.metrics.refused.labels("upload").inc()
            raise
        finally:
            self.receiving -= 1
        # `path`: Krea's name for what its page sends back as start_frame / input_video; here the same opaque id
        return {"path": upload_id, "id": upload_id, "filename": Path(filename or "").name[:128], "bytes": len(data),
                "type": kind}

    async def _read(self, request, kinds: dict, limit: int):
        cfg = self.cfg
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit + 65536):
            raise UploadError(413, f"upload larger than {limit} bytes")
        body = bytearray()
        stream, t0 = request.stream().__aiter__(), time.monotonic()
        while True:
            # the next chunk must come before the body's average rate falls under the floor (after a 10 s grace)
            # and before the deadline
            due = t0 + min(cfg.upload_deadline_s, max(cfg.upload_grace_s, (len(body) + 1) / cfg.upload_min_bytes_per_s))
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), max(0.0, due - time.monotonic()))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise UploadError(408, f"upload too slow: {len(body)} bytes in {time.monotonic() - t0:.0f} s (at least "
                                  f"{cfg.upload_min_bytes_per_s} bytes/s after {cfg.upload_grace_s:g} s, "
                                  f"--upload-min-rate; all within {cfg.upload_deadline_s:g} s, --upload-deadline)"
                                  ) from None
            body += chunk
            if len(body) > limit + 65536:
                raise UploadError(413, f"upload larger than {limit} bytes")
        request._body = bytes(body)  # the form parser reads the capped body
        try:
            form = await request.form(max_files=1, max_fields=4)
        except Exception as exc:
            raise UploadError(400, f"a multipart form with one `file` field is expected ({exc})") from None
        file = form.get("file")
        if file is None or isinstance(file, str):
            raise UploadError(400, "the form has no `file` field")
        data = await file.read(limit + 1)
        if len(data) > limit:
            raise UploadError(413, f"file larger than {limit} bytes")
        kind = sniff(data[:16], kinds)
        if kind is None:
            raise UploadError(415, f"not one of {', '.join(kinds)} (judged by the file's bytes, not its name)")
        return data, kind, file.filename
