"""Video-to-video in the loop: each block's input frames, encoded by the streaming VAE encoder and noised to
the schedule's first sigma, replace the block's pure noise for both roles (docs/live.md, "Video-to-video").

Block b of a video takes `1 + 4 (F - 1)` pixel frames (b = 0) or `4 F` (b > 0) from its source, in order
(`ClipFrames`: a file's frames; `LiveFrames`: frames pushed into a live session, waited for). The frames
are encoded once per block (`VideoInput.latents`, under a lock: under run-ahead the drafter's lane may ask
for block b + 1 while the target's lane still reads block b), and every role starts its denoising from

    x_b = (1 - sigma_0) * E(frames_b) + sigma_0 * noise_b

with noise_b the block noise both roles share and sigma_0 the role's first schedule sigma (both roles'
schedules start at step `strength * 1000`, so with one shift they start from the same x_b and SDVG's rule
holds: a rejected block is redone by the target from the drafter's very input). Krea (`release_server.py`,
webcam and input-video paths) forms the same mix with `denoising_step_list[0] / 1000` (the table's
timestep / 1000, within one float32 ulp of the table's sigma) in bfloat16."""
from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np
import torch

from sdvg.io.video_input import MAX_PIXELS, check_fit, check_frames, fit_frames


class InputEnded(RuntimeError):
    """The source has no more frames for the block (a clip's end, a closed or timed-out live source)."""


class ClipFrames:
    """A clip's frames (uint8 [N, H, W, 3], already at the model's frame rate), fitted per block."""

    def __init__(self, frames: np.ndarray, height: int, width: int):
        self.frames, self.height, self.width = frames, height, width
        self.position = 0

    def restart(self) -> None:
        self.position = 0

    def unread(self, count: int) -> None:
        """Give the last `count` taken frames back."""
        self.position -= count

    def take(self, count: int, timeout_s: float | None = None) -> torch.Tensor:
        if self.position + count > len(self.frames):
            raise InputEnded(f"the input video's {len(self.frames)} frames are used up")
        out = fit_frames(self.frames[self.position:self.position + count], self.height, self.width)
        self.position += count
        return out


class LiveFrames:
    """Frames pushed into a live session (`push`, any thread), checked on arrival, kept as uint8 and fitted when
    a block takes them, in order (FIFO: every pushed frame is read by exactly one block, so a session fed the same
    frames gives the same video). `take` waits up to `timeout_s` for the frames a block needs. At most
    `max_queued` frames wait: one more is refused (`VideoInputError`), or with `drop_oldest` the oldest queued
    frame makes room (counted in `dropped`; the server's webcam policy, so a client faster than the generation
    loses its oldest frames, not the session). Departure: Krea's webcam path takes every frame queued at block
    time and resamples them to the count (`resample_array`), which drops or repeats frames as the client's rate
    drifts and makes the video depend on timing."""

    def __init__(self, height: int, width: int, max_queued: int = 1024, drop_oldest: bool = False):
        self.height, self.width, self.max_queued, self.drop_oldest = height, width, max_queued, drop_oldest
        self._frames: deque = deque()  # uint8 [H, W, 3] each (a block's frames are fitted when taken)
        self._cond = threading.Condition()
        self._closed = False
        self.pushed = 0
        self.taken = 0
        self.dropped = 0
        self._recent: deque = deque(maxlen=64)  # the last frames taken (a segment that ends gives them back)

    def push(self, frames) -> int:
        """Queue uint8 frames [N, H, W, 3] (checked); returns how many frames were queued before them."""
        frames = check_frames(frames)
        check_fit(frames.shape[1], frames.shape[2], self.height, self.width, MAX_PIXELS, "input_frames")
        with self._cond:
            if self._closed:
                raise RuntimeError("the session's input has ended; start a new session")
            room = self.max_queued - len(self._frames)
            if len(frames) > room and not self.drop_oldest:
                from sdvg.io.video_input import VideoInputError

                raise VideoInputError(f"{len(self._frames)} input frames are already queued (at most "
                                      f"{self.max_queued}); push at the video's pace (16 frames/s)")
            frames = frames[-self.max_queued:]
            while len(self._frames) + len(frames) > self.max_queued:
                self._frames.popleft()
                self.dropped += 1
            before = len(self._frames)
            self._frames.extend(frames)
            self.pushed += len(frames)
            self._cond.notify_all()
            return before

    def queued(self) -> int:
        with self._cond:
            return len(self._frames)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def restart(self) -> None:
        """A session restart reads on from the next queued frame."""

    def unread(self, count: int) -> None:
        """Put the last `count` taken frames back at the front of the queue, in order."""
        with self._cond:
            for _ in range(count):
                self._frames.appendleft(self._recent.pop())
            self.taken -= count
            self._cond.notify_all()

    def take(self, count: int, timeout_s: float | None = None) -> torch.Tensor:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while len(self._frames) < count:
                if self._closed:
                    raise InputEnded("the session's input was closed")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise InputEnded(f"the input frames of the next block ({count}; {len(self._frames)} queued) did "
                                     f"not arrive within {timeout_s:g} s")
                self._cond.wait(left)
            taken = [self._frames.popleft() for _ in range(count)]
            self._recent.extend(taken)
            self.taken += count
        return fit_frames(taken, self.height, self.width)  # frame by frame: no stacked copy of the block


class VideoInput:
    """One video's input: block b's frames taken from `source` (in block order, once), encoded with the
    streaming encoder's cache of this video, and mixed with the block noise (`noised`)."""

    KEEP = 16  # encoded blocks kept behind the newest (the roles read a block within run_ahead_blocks of each other)

    def __init__(self, source, encoder, frames_per_block: int, timeout_s: float | None = None):
        self.source, self.encoder, self.frames_per_block, self.timeout_s = source, encoder, frames_per_block, timeout_s
        self.cache = encoder.new_cache()
        self._pixels: dict[int, torch.Tensor] = {}  # taken, not yet encoded
        self._latents: dict[int, torch.Tensor] = {}
        self._next = 0  # the next block whose frames are taken
        self._lock = threading.Lock()
        source.restart()

    @property
    def next_block(self) -> int:
        """The first block whose frames are not taken yet."""
        return self._next

    def unread(self) -> None:
        """Give the frames taken but not encoded back to the source (a segment that ends before using them)."""
        with self._lock:
            for b in sorted(self._pixels, reverse=True):
                self.source.unread(len(self._pixels.pop(b)))
                self._next = b

    def frames_needed(self, block: int) -> int:
        s = self.encoder.temporal_stride
        return 1 + s * (self.frames_per_block - 1) if block == 0 else s * self.frames_per_block

    def fetch(self, block: int) -> None:
        """Take the frames of every block up to `block` from the source (waiting for a live one); raises
        `InputEnded` when they do not come."""
        with self._lock:
            while self._next <= block:
                self._pixels[self._next] = self.source.take(self.frames_needed(self._next), self.timeout_s)
                self._next += 1

    def latents(self, block: int) -> torch.Tensor:
        """E(frames_b): [1, z, F, h, w] float32 normalised, on the VAE's device (encoded once, in block order)."""
        self.fetch(block)
        with self._lock:
            if block not in self._latents:
                for b in sorted(k for k in self._pixels if k <= block):
                    pixels = self._pixels.pop(b)  # [T, 3, H, W]
                    self._latents[b] = self.encoder.encode(pixels.permute(1, 0, 2, 3)[None], self.cache)
                newest = max(self._latents)
                for b in [k for k in self._latents if k < newest - self.KEEP]:
                    del self._latents[b]
            return self._latents[block]

    def noised(self, block: int, noise: torch.Tensor, sigma: float, device) -> torch.Tensor:
        """(1 - sigma) * E(frames_b) + sigma * noise_b, float32 on `device`."""
        e = self.latents(block).to(device)
        return (1.0 - sigma) * e + sigma * noise.to(device)
