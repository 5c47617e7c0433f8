"""The server's limits and policies, one frozen config (the CLI flags of `sdvg serve` fill it)."""
from __future__ import annotations

from dataclasses import dataclass

MAX_PORT = 65535


def check_port(port: int) -> int:
    """A TCP port to listen on: 0 (any free port) to 65535; a ValueError naming the fix otherwise."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
        raise ValueError(f"port {port!r} must be an integer from 0 to {MAX_PORT} (0: any free port)")
    return port


SESSION_SCHEDULERS = ("batched", "round_robin")  # how the worker runs the sessions (sdvg/serve/sessions.py)


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None  # required for any bind other than the loopback default (security.check_bind)
    max_sessions: int = 4  # generations in progress at once (interleaved block by block)
    # how the worker runs them: "batched" (each runnable session's next block in one round, the model work that can
    # go together batched) or "round_robin" (one session's block at a time); sdvg/serve/sessions.py
    session_scheduler: str = "batched"
    # batched: the sessions' VAE decodes batched too (pixels within a uint8 level of each session alone); False: each
    # decode alone, every session's video bitwise its own (sdvg/generation/batching.py)
    batch_decode: bool = True
    # admit a session only while the measured round costs say every admitted one keeps this many frames/s (0: no
    # such rule, `max_sessions` only); sdvg/serve/capacity.py
    min_session_fps: float = 0.0
    max_queue: int = 8  # sessions waiting for a slot; one more gets `busy`
    idle_timeout_s: float = 300.0  # no client message while not generating (after completed)
    first_message_timeout_s: float = 30.0  # from the socket's opening to its parameters (refused messages don't count)
    header_timeout_s: float = 10.0  # a connection's first request headers must be complete by then
    max_connections: int = 1000  # open at once (lowered to fit the open-file limit); past it: 503 and close
    max_connections_per_client: int = 32  # open at once from one client address (a proxy: raise it)
    upload_min_bytes_per_s: int = 32 * 1024  # an upload body's least average rate once upload_grace_s passed; else 408
    upload_grace_s: float = 10.0  # an upload body's first seconds, before its least rate applies
    upload_deadline_s: float = 600.0  # an upload body's whole time
    max_pause_s: float = 60.0  # a paused run holds its slot this long (pings do not extend it), then it ends
    send_buffer_frames: int = 64  # per socket; when full the oldest unsent frame is dropped (counted)
    send_stall_s: float = 10.0  # one send not done by then: the client stopped reading; its socket is cut (counted)
    max_message_bytes: int = 8 * 2**20  # one websocket message (uvicorn closes with 1009 above it)
    max_image_bytes: int = 4 * 2**20  # a webcam `image` or a start frame
    max_image_pixels: int = 4096 * 4096  # decoded image limit (uploads)
    max_webcam_pixels: int = 1920 * 1080  # a webcam `image` frame (kept until its block reads it)
    max_input_video_bytes: int = 2 * 2**30  # an uploaded input video's frames as read and fitted (uint8 + the fit's)
    max_input_video_pixels: int = 1920 * 1080  # one frame of an uploaded video, from its header (refused at upload)
    max_upload_bytes: int = 256 * 2**20  # POST /upload_video
    max_prompt_chars: int = 2000
    max_blocks: int = 256  # num_blocks a client may ask for
    max_steps: int = 8  # num_denoising_steps a client may ask for (the target's; 1..max_steps)
    max_pixels: int = 832 * 480  # width * height a client may ask for (Krea's default size; the preset's is always made)
    updates_per_s: float = 20.0  # sustained mid-stream update rate per socket
    update_burst: int = 40  # updates allowed at once before the rate applies
    input_frames_per_s: float = 60.0  # webcam `image` frames per socket per second (their own budget; burst: 1 s)
    flood_close_after: int = 200  # refused messages of any kind on one socket before it is closed (1008)
    upload_ttl_s: float = 600.0  # an unclaimed upload is deleted after this
    max_upload_store_bytes: int = 4 * 2**30  # every upload held at once (claimed ones too); a POST past it: 507
    max_concurrent_uploads: int = 4  # POSTs received at once (each body is held in memory while read); more: 503
    max_concurrent_snapshots: int = 2  # downloads of runs in progress joined at once (an ffmpeg each); more: 503
    keep_videos: int = 64  # finished session MP4s kept for download (oldest deleted first)
    jpeg_quality: int = 90  # Krea's
    fps: float = 16.0  # of the MP4s
    drain_timeout_s: float = 30.0  # SIGTERM: time given to the block in progress before sockets close
    video_dir: str | None = None  # where session MP4s and uploads live (default: a temporary folder)
    cors_origins: tuple[str, ...] = ()  # web pages on other origins allowed to call the server (scheme://host[:port])
    allowed_hosts: tuple[str, ...] = ()  # Host names clients may use beyond the bind address (DNS rebinding rule)
    static_dir: str | None = None  # the operator's own page, served at / instead of sdvg's (its index.html)

    def __post_init__(self) -> None:
        from sdvg.serve.security import check_allowed_host, check_origin

        check_port(self.port)
        for origin in self.cors_origins:
            check_origin(origin)
        for name in self.allowed_hosts:
            check_allowed_host(name)
        for name in ("max_sessions", "send_buffer_frames", "max_message_bytes", "max_image_bytes", "max_blocks",
                     "update_burst", "flood_close_after", "keep_videos", "max_prompt_chars", "max_upload_store_bytes",
                     "max_concurrent_uploads", "max_steps", "max_pixels", "max_concurrent_snapshots", "max_connections",
                     "max_connections_per_client", "upload_min_bytes_per_s", "max_input_video_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        if self.session_scheduler not in SESSION_SCHEDULERS:
            raise ValueError(f"session_scheduler {self.session_scheduler!r} must be one of {', '.join(SESSION_SCHEDULERS)}")
        if not self.min_session_fps >= 0:
            raise ValueError(f"min_session_fps {self.min_session_fps} must be >= 0 (0: admit by --max-sessions only)")
        if self.max_queue < 0:
            raise ValueError(f"max_queue {self.max_queue} must be >= 0 (0: refuse when every slot is taken)")
        for name in ("idle_timeout_s", "first_message_timeout_s", "max_pause_s", "header_timeout_s", "upload_deadline_s",
                     "upload_grace_s", "updates_per_s", "input_frames_per_s", "upload_ttl_s", "fps", "drain_timeout_s",
                     "send_stall_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} {getattr(self, name)} must be > 0")
        if not 1 <= self.jpeg_quality <= 100:
            raise ValueError(f"jpeg_quality {self.jpeg_quality} must be in [1, 100]")
