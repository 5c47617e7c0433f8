"""Frames on the wire, one binary websocket message per frame (docs/server.md):

- `fmt=jpeg` (Krea's default): the JPEG bytes (quality 90);
- `fmt=msgpack` (Krea's): a msgpack map {image: JPEG bytes, request_id, block, frame};
- `fmt=raw` (sdvg's): a msgpack map {image: the uint8 RGB bytes, shape: [H, W, 3], request_id, block,
  frame}: bitwise the pipeline's frames.
`block` is the block index of the current run, `frame` the frame's index within the run; `request_id` the
parameters' `request_id`, or Krea's nil UUID string when the client sent none (as Krea's frames carry)."""
from __future__ import annotations

import io

import msgpack
import numpy as np

FORMATS = ("jpeg", "msgpack", "raw")
NIL_REQUEST_ID = "00000000-0000-0000-0000-000000000000"  # Krea's UUID_NIL: a frame's id when none was given


def jpeg(frame: np.ndarray, quality: int) -> bytes:
    """frame uint8 [H, W, 3] -> JPEG bytes."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(frame).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def encode_block(frames: np.ndarray, fmt: str, block: int, first_frame: int, request_id: str | None,
                 quality: int) -> list[bytes]:
    """frames uint8 [T, H, W, 3] -> one message per frame, in order."""
    request_id = NIL_REQUEST_ID if request_id is None else request_id
    out = []
    for t, frame in enumerate(frames):
        if fmt == "raw":
            image = np.ascontiguousarray(frame).tobytes()
            out.append(msgpack.packb({"image": image, "shape": list(frame.shape), "request_id": request_id,
                                      "block": block, "frame": first_frame + t}))
            continue
        data = jpeg(frame, quality)
        if fmt == "jpeg":
            out.append(data)
        else:
            out.append(msgpack.packb({"image": data, "request_id": request_id, "block": block,
                                      "frame": first_frame + t}))
    return out
