"""The adapter between the server and the pipeline: the options of one session from its parameters
(refusing what sdvg cannot honour, by field), the block iterator of one generation, and updates.

A generation is a live session (`pipe.session(prompt, **options)`, sdvg/live/session.py) on the
reference scheduler (bitwise the native scheduler's video): it runs on the caller's thread and yields
each block as soon as it is final, so the one generation worker decides which session's next block
runs (round-robin) and no two videos' stages ever run at once. (The native scheduler cannot serve
here: threaded, its thread would run stages concurrently with other sessions'; unthreaded, it yields a
video's blocks only when the whole video is done.) Mid-stream prompt and router (tau, ...) updates go to
`session.update(...)`, which acknowledges the block they take effect at; a pipeline without
`session` (a stand-in) runs `pipe.run` and refuses live updates by field."""
from __future__ import annotations

import random
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

from sdvg.options import GenerationOptions, OptionError
from sdvg.serve.protocol import KreaParams, ProtocolError, UPLOAD_ID, option_fields

WEBCAM_QUEUE_FRAMES = 24  # webcam frames a session keeps waiting (2 blocks); the oldest make room beyond
SIZES_KEPT = 4  # pipeline views (one per video size) kept; each shares the weights, only its runners are its own


@dataclass(frozen=True)
class SessionSpec:
    """What one generation runs: the prompt, the resolved options, its video input (webcam frames pushed
    with `image` messages, or an uploaded video's server-side path) and its start frame (the uploaded image,
    decoded: uint8 [H, W, 3]; every run of the socket, resets included, starts from it as in Krea)."""

    prompt: str
    options: GenerationOptions
    request_id: str | None
    webcam: bool = False
    input_video: str | None = None
    start_frame: Any = None
    height: int | None = None  # the video's size (None: the preset's)
    width: int | None = None


class Engine:
    """`pipe`: a SpeculativeVideoPipeline (models loaded once); `defaults`: the server's options
    (`sdvg serve --tau ...`) that a client's fields override."""

    def __init__(self, pipe, defaults: GenerationOptions | None = None, max_input_video_bytes: int | None = None,
                 max_steps: int = 8, max_pixels: int | None = None, max_input_video_pixels: int | None = None):
        self.pipe = pipe
        self.max_input_video_bytes = max_input_video_bytes  # an uploaded input video's frames, as read and fitted
        self.max_input_video_pixels = max_input_video_pixels  # one frame of an uploaded input video (its header's)
        self.defaults = defaults or GenerationOptions()
        self.preset = pipe.preset
        self.max_steps = max_steps  # num_denoising_steps: 1..max_steps
        self.max_pixels = max_pixels  # width * height of a size other than the preset's (None: the preset's only)
        self._views: OrderedDict[tuple[int, int], Any] = OrderedDict()  # (height, width) -> pipe.resized(...)
        self._views_lock = threading.Lock()

    @property
    def live(self) -> bool:
        """Whether generations are live sessions that take mid-stream updates."""
        return hasattr(self.pipe, "session")

    @property
    def size(self) -> tuple[int, int]:  # height, width
        return self.preset.video.height, self.preset.video.width

    @property
    def size_multiple(self) -> int:
        """What each side of a video must be a multiple of (the VAE stride times the patch size)."""
        return self.preset.video.size_multiple(self.preset.vae, self.preset.target)

    def pipe_at(self, height: int | None, width: int | None):
        """The pipeline making `height` x `width` videos (None: the preset's size): a view sharing the weights
        (`pipe.resized`), the last SIZES_KEPT kept; a pipeline without views makes its preset's size only."""
        if height is None or (height, width) == self.size or not hasattr(self.pipe, "resized"):
            return self.pipe
        with self._views_lock:
            view = self._views.pop((height, width), None) or self.pipe.resized(height, width)
            self._views[(height, width)] = view
            while len(self._views) > SIZES_KEPT:
                self._views.popitem(last=False)
        return view

    def check_size(self, width: int, height: int) -> None:
        """A size this server makes: each side a positive multiple of `size_multiple`, at most `max_pixels` pixels
        (the preset's own size always), the eager backend for another size; ProtocolError naming the field."""
        if (height, width) == self.size:
            return
        m = self.size_multiple
        for name, value in (("width", width), ("height", height)):
            if value < m or value % m:
                near = max(m, value // m * m)
                raise ProtocolError(name, f"{value}: the models make sides that are multiples of {m} (the VAE's "
                                    f"stride times the patch size); send {near}")
        if self.max_pixels is None or width * height > self.max_pixels:
            most = "" if self.max_pixels is None else f"at most {self.max_pixels} pixels (--max-pixels), or "
            raise ProtocolError("width", f"{width}x{height} is {width * height} pixels; this server makes {most}"
                                f"{self.size[1]}x{self.size[0]}, its preset's size")
        if not hasattr(self.pipe, "resized") or getattr(self.pipe, "default_backend", "eager") != "eager":
            raise ProtocolError("width", f"{width}x{height}: this server's stages are built for its preset's "
                                f"{self.size[1]}x{self.size[0]} (backend eager makes other sizes); send that size")

    # ------------------------------------------------------------------ parameters -> options
    def spec(self, params: KreaParams, max_blocks: int, upload_known, upload_path=None,
             start_image=None) -> SessionSpec:
        """The session's options; a field sdvg cannot honour raises ProtocolError naming it. `upload_path(id)`:
        an upload's server-side file or None (the server passes `UploadStore.claim`: the session keeps it)."""
        height = self.size[0] if params.height is None else params.height
        width = self.size[1] if params.width is None else params.width
        self.check_size(width, height)
        steps = params.num_denoising_steps
        if steps is not None and not 1 <= steps <= self.max_steps:
            raise ProtocolError("num_denoising_steps", f"{steps}: this server runs 1 to {self.max_steps} steps "
                                "(--max-steps); leave it out for the preset's")
        if params.timestep_shift is not None and params.timestep_shift != self.preset.shift:
            raise ProtocolError("timestep_shift", f"{params.timestep_shift}: the preset's schedule uses shift "
                                f"{self.preset.shift:g}; send it or leave it out")
        if params.num_blocks > max_blocks:
            raise ProtocolError("num_blocks", f"{params.num_blocks}: at most {max_blocks} on this server")
        if params.context_noise != 0.0:
            raise ProtocolError("context_noise", "only 0.0: sdvg's context is clean (no context noise)")
        if params.resume_latents is not None:
            raise ProtocolError("resume_latents", "resuming from client latents is not supported")
        if params.interp_blocks != -1:
            raise ProtocolError("interp_blocks", "only -1: each prompt change sets its own blend (the update's "
                                "`interp_steps`, default 4)")
        for name in ("input_video", "start_frame"):
            value = getattr(params, name)
            if value is None:
                continue
            if isinstance(value, bytes) or not UPLOAD_ID.match(value):
                raise ProtocolError(name, "must be an id returned by POST /upload_"
                                    + ("video" if name == "input_video" else "start_frame")
                                    + "; the server never opens a path or URL a client names")
            if not upload_known(value):
                raise ProtocolError(name, f"{value}: no such upload (expired, used, or never made)")
            if name == "start_frame" and start_image is None:  # the caller decodes it (off the event loop)
                raise ProtocolError(name, f"{value}: no such image upload (expired, or never made)")
        video_input = params.webcam_mode or params.input_video is not None
        if params.webcam_mode and params.input_video is not None:
            raise ProtocolError("webcam_mode", "send webcam_mode (frames in `image` messages) or input_video, not both")
        if video_input and not self.live:
            field = "webcam_mode" if params.webcam_mode else "input_video"
            raise ProtocolError(field, "this server's pipeline has no live sessions (pipe.session); video input "
                                "needs one")
        if not 0.0 < params.strength <= 1.0:
            raise ProtocolError("strength", f"{params.strength} must lie in (0, 1] (1.0: pure noise, lower keeps more "
                                "of the input)")
        if params.strength != 1.0 and not video_input:
            raise ProtocolError("strength", f"{params.strength}: strength sets how much of the video input is kept; "
                                "send it with webcam_mode: true or input_video")
        seed = params.seed if params.seed is not None else random.randint(0, 2**24 - 1)  # Krea's rule
        values = {**option_fields(params), "seed": seed, "num_blocks": params.num_blocks,
                  "kv_cache_frames": params.kv_cache_num_frames, "keep_first_frame": params.keep_first_frame,
                  "scheduler": "reference", "run_ahead": False, "strength": params.strength,
                  "target_steps": steps}
        fields = option_fields(params)
        try:
            GenerationOptions(**fields)  # together: a rule across fields (router 'pattern' with its pattern) holds
        except (OptionError, TypeError, ValueError) as together:
            for name, value in fields.items():  # each alone: the error names its field
                try:
                    GenerationOptions(**{name: value})
                except (OptionError, TypeError, ValueError) as exc:
                    raise ProtocolError(name, str(exc)) from None
            raise ProtocolError(None, str(together)) from None
        pipe = self.pipe_at(height, width)
        try:
            options = self.defaults.replace(**values)
            options = pipe.resolve(options)
        except (OptionError, TypeError, ValueError) as exc:
            field = next((n for n in values if n in str(exc).split()[:3] or str(exc).startswith(n)), None)
            if field == "kv_cache_frames":
                field = "kv_cache_num_frames"
            raise ProtocolError(field, str(exc)) from None
        path = None
        if params.input_video is not None:
            path = upload_path(params.input_video) if upload_path is not None else None
            if path is None:
                raise ProtocolError("input_video", f"{params.input_video}: no such upload (expired, used, or never made)")
            path = str(path)
        if start_image is not None:
            from sdvg.generation.prepare import start_frame_conflict

            why = start_frame_conflict(options)
            if why:
                raise ProtocolError("start_frame", why)
        return SessionSpec(params.prompt, options, params.request_id, bool(params.webcam_mode), path,
                           start_image if params.start_frame is not None else None, height, width)

    # ------------------------------------------------------------------ generation
    def read_input(self, spec: SessionSpec) -> tuple[GenerationOptions, Any]:
        """An uploaded input video's frames, read (ffmpeg) and fitted: (options with num_blocks capped by the
        clip, as in Krea, uint8 frames). It touches no model, so it runs off the generation worker."""
        try:
            return self.pipe_at(spec.height, spec.width).input_clip(spec.input_video, spec.options, fit_blocks=True,
                                                                    max_bytes=self.max_input_video_bytes,
                                                                    max_pixels=self.max_input_video_pixels)
        except Exception as exc:  # the reply names the upload, never the server's path of it
            raise type(exc)(str(exc).replace(spec.input_video, "the uploaded video")) from None

    def start(self, spec: SessionSpec, clip: tuple[GenerationOptions, Any] | None = None,
              batcher=None) -> Iterator:
        """The blocks of one generation (run on the generation worker's thread only). `clip`: the input video
        `read_input` read (read here when not given). `batcher`: the batched worker's (a live session's model
        work then goes through it, with the other sessions' of its round)."""
        pipe = self.pipe_at(spec.height, spec.width)
        if self.live:
            keywords = _keywords(spec.options)
            num_blocks = keywords.pop("num_blocks")
            frames = None
            if spec.input_video is not None:  # Krea's rule: the video's length caps num_blocks
                options, frames = clip if clip is not None else self.read_input(spec)
                num_blocks = options.num_blocks
            return pipe.session(spec.prompt, num_blocks=num_blocks, input_video=frames,
                                input_frames=spec.webcam, input_timeout_s=3600.0,
                                input_queue_frames=WEBCAM_QUEUE_FRAMES, input_drop_oldest=True,
                                start_frame=spec.start_frame, batcher=batcher, **keywords)
        if spec.start_frame is not None:
            return pipe.run(spec.prompt, spec.options, start_frame=spec.start_frame)
        return pipe.run(spec.prompt, spec.options)

    @staticmethod
    def input_ready(generation) -> bool:
        """Whether the generation's next block has its webcam frames (a stand-in without the method: always)."""
        ready = getattr(generation, "input_ready", None)
        return True if ready is None else ready()

    @staticmethod
    def close(generation) -> Any:
        return generation.close()


def _keywords(options: GenerationOptions) -> dict:
    return {name: getattr(options, name) for name in GenerationOptions.__dataclass_fields__}


def pipe_devices(pipe) -> list[str]:
    """The devices the pipeline's models sit on."""
    c = pipe.components
    return sorted({str(d) for d in (c.drafter_device, c.target_device, c.vae.device)})


def build_labels(pipe) -> dict[str, str]:
    """sdvg_serve_build_info's labels: the versions and sdvg._C's build (as the statistics' `build` records it),
    the preset, its precision and the devices."""
    prov = pipe.provenance()
    return {"sdvg_version": prov["sdvg_version"], "torch_version": prov["torch_version"],
            **{k: "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
               for k, v in prov["build"].items()},
            "preset": pipe.preset.name, "precision": str(prov["precision"]),
            **{f"{role}_device": name for role, name in prov["devices"].items()}}
