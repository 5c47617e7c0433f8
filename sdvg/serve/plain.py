"""Plain clients: a socket opened without `sdvg=1`, as Krea Realtime Video's page and `test_client.py` open
theirs. The rule: an sdvg rule never breaks a plain client. Where sdvg is stricter than Krea's server, the
client is answered as Krea answers and the operator is told (a line on the `sdvg.serve` logger, once per
session and reason, and `sdvg_serve_plain_adjusted_total{reason}`); `sdvg=1` clients get sdvg's strict
replies instead (docs/server.md, "Plain clients").

- Parameters are read as Krea's pydantic model reads them (`KreaWire`: its field types in lax mode, unknown
  fields ignored), then made into what sdvg's strict rules take (`plain_params`): what sdvg does not do is
  dropped as Krea drops it or has no effect there (context_noise, resume_latents, interp_blocks, another
  timestep_shift, strength without video input, a start frame that is no image upload), a size is floored
  to the models' multiple, `num_blocks` and `webcam_fps` are capped at the server's bounds. A value Krea's
  pydantic refuses, or one past a bound sdvg cannot degrade (steps, pixels, the prompt's length), gets
  Krea's reply to bad parameters, `{"error": [{"type", "loc", "msg"}]}` (`params_error`), and the socket
  waits for another parameters message, as Krea's does.
- Updates are read as Krea's loop reads them (`plain_update`: `interp_steps` by `int()`, 4 when it is not
  a number; a seed by `int()`); anything sdvg would refuse is dropped without a reply.
- No sdvg message ever: no `queued` (a queued client waits silently), `params`, `running`, `ack`, `stats`,
  `pong` or `{"status": "error"}`. A run that cannot start or fails gets `{"error": "<what>"}`, the shape
  Krea's page shows as a server error (`failure`)."""
from __future__ import annotations

import logging
import threading

from pydantic import BaseModel, ConfigDict, ValidationError

from sdvg.bounded import quote
from sdvg.serve.protocol import UPLOAD_ID, GenerateParams, KreaParams, ProtocolError

log = logging.getLogger("sdvg.serve")

MAX_INTERP_STEPS = 64  # a prompt blend (Update.interp_steps' bound)
SDVG_UPDATE_FIELDS = ("tau", "router", "accept_prob", "pattern")
SDVG_ACTIONS = ("pause", "resume", "ping")
KREA_UPDATE_FIELDS = ("action", "prompt", "interp_steps", "interpolation_steps", "seed", "image", "strength",
                      "request_id", "timestamp")


class KreaWire(BaseModel):
    """Krea's `GenerateParams` as its server validates it: the same field types in pydantic's lax mode, unknown
    fields ignored. Every default is None here: a field left out is left to sdvg's defaults."""

    model_config = ConfigDict(extra="ignore")
    prompt: str
    width: int | None = None
    height: int | None = None
    seed: int | None = None
    resume_latents: bytes | None = None
    strength: float | None = None
    request_id: str | None = None
    interp_blocks: int | None = None
    context_noise: float | None = None
    keep_first_frame: bool | None = None
    kv_cache_num_frames: int | None = None
    num_blocks: int | None = None
    num_denoising_steps: int | None = None
    block_on_frame: bool | None = None
    input_video: str | None = None
    start_frame: bytes | str | None = None
    timestep_shift: float | None = None
    webcam_mode: bool | None = None
    webcam_fps: int | None = None


class Adjusted:
    """What a plain client's messages became, told to the operator: each (reason, what) is counted; the first of
    each reason per session is logged (the later ones only counted). Thread-safe (the worker tells it too)."""

    def __init__(self, session_id: str, counter):
        self.session_id, self.counter = session_id, counter
        self.logged: set[str] = set()
        self.lock = threading.Lock()

    def tell(self, reason: str, what: str) -> None:
        self.counter.labels(reason).inc()
        with self.lock:
            first = reason not in self.logged
            self.logged.add(reason)
        if first:
            log.warning("session %s (plain client): %s [%s; later ones are counted in "
                        "sdvg_serve_plain_adjusted_total]", self.session_id, what, reason)


def params_error(error: ProtocolError) -> dict:
    """Krea's reply to parameters its pydantic refuses, `{"error": e.errors()}`, with what each error says."""
    return {"error": error.details or [{"type": "value_error", "loc": [error.field] if error.field else [],
                                        "msg": error.message}]}


def failure(message: str) -> dict:
    """A run that could not start or failed, in the shape Krea's page shows as a server error."""
    return {"error": message}


def plain_params(data, engine, cfg, tell, upload_known=lambda upload_id: True) -> dict:
    """A plain client's parameters as sdvg's strict `parse_params` takes them; `tell(reason, what)` hears every
    change; `upload_known(id)`: whether an upload id is one of this server's. ProtocolError (with Krea's error list
    as `details`) for what Krea's pydantic refuses."""
    if not isinstance(data, dict):
        raise ProtocolError(None, "Input should be a valid dictionary", details=[
            {"type": "model_type", "loc": [], "msg": "Input should be a valid dictionary or instance of GenerateParams"}])
    known = set(GenerateParams.model_fields)
    for key in [k for k in data if k not in known]:
        tell("ignored_field", f"unknown parameter {quote(key)} ignored (Krea ignores it)")
    try:
        wire = KreaWire.model_validate({k: v for k, v in data.items() if isinstance(k, str)})
    except ValidationError as exc:
        details = [{"type": e["type"], "loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()[:8]]
        raise ProtocolError(".".join(map(str, details[0]["loc"])) or None, details[0]["msg"], details=details) from None
    values = {k: getattr(wire, k) for k in wire.model_fields_set if getattr(wire, k) is not None}  # None: unset
    values.update({k: data[k] for k in data if k in known and k not in KreaWire.model_fields})  # sdvg's options
    for name, default, why in (("context_noise", 0.0, "sdvg's context is clean"),
                               ("resume_latents", None, "resuming from client latents is not supported"),
                               ("interp_blocks", -1, "each prompt update sets its own blend (interp_steps)"),
                               ("timestep_shift", engine.preset.shift, "the preset's schedule has its own shift"),
                               ("block_on_frame", False, "Krea's server overrides it too")):
        if name in values and values[name] != default:
            tell("ignored_field", f"{name} {quote(values[name])} ignored ({why})")
            del values[name]
    video_input = bool(values.get("webcam_mode")) or values.get("input_video") is not None
    if values.get("strength") not in (None, 1.0) and not video_input:  # Krea: strength 1.0 without video input
        tell("ignored_field", f"strength {quote(values['strength'])} without video input ignored (as Krea)")
        values["strength"] = 1.0
    if values.get("webcam_mode") and values.get("input_video") is not None:  # Krea denoises the webcam's frames
        tell("ignored_field", "input_video ignored beside webcam_mode (as Krea)")
        del values["input_video"]
    start = values.get("start_frame")
    if start is not None and not (isinstance(start, str) and UPLOAD_ID.match(start) and upload_known(start)):
        tell("ignored_field", f"start_frame {quote(start)} is not an upload of this server; ignored (Krea goes on "
                              "without a start frame it cannot load)")
        del values["start_frame"]
    if values.get("request_id") is not None and len(values["request_id"]) > 128:
        tell("ignored_field", "request_id longer than 128 characters ignored")
        del values["request_id"]
    blocks = values.get("num_blocks")
    if blocks is not None and blocks > cfg.max_blocks:
        tell("capped", f"num_blocks {quote(blocks)} capped at this server's {cfg.max_blocks} (--max-blocks)")
        values["num_blocks"] = cfg.max_blocks
    fps = values.get("webcam_fps")
    if fps is not None and not 1 <= fps <= 120:
        values["webcam_fps"] = min(max(fps, 1), 120)
        tell("capped", f"webcam_fps {quote(fps)} brought into [1, 120]")
    m = engine.size_multiple
    for name in ("width", "height"):
        side = values.get(name)
        if side is not None and side % m and side > m:
            values[name] = side // m * m
            tell("floored", f"{name} {side} floored to {values[name]}, a multiple of {m} (Krea floors to 8)")
    return values


def plain_update(data, prompt: str, tell) -> dict | None:
    """A plain client's update as Krea's loop reads it, for sdvg's strict `parse_update`; None when nothing is
    left to do. `tell(reason, what)` hears what is dropped (Krea ignores it, or it is sdvg's superset)."""
    if not isinstance(data, dict):
        tell("dropped_update", "a message that is not a map dropped (Krea ignores it)")
        return None
    out = {}
    for key in data:
        if key in SDVG_UPDATE_FIELDS:
            tell("dropped_update", f"{key} dropped: sdvg's superset (connect with ?sdvg=1)")
        elif key not in KREA_UPDATE_FIELDS:
            tell("ignored_field", f"unknown update field {quote(key)} ignored (Krea ignores it)")
    action = data.get("action")
    if action == "reset":
        out["action"] = "reset"
    elif action is not None:
        tell("dropped_update", f"action {quote(action)} dropped" + (": sdvg's superset (connect with ?sdvg=1)"
                                                                    if action in SDVG_ACTIONS else ""))
    new = data.get("prompt", prompt)
    if isinstance(new, str) and new != prompt and new.strip():
        out["prompt"] = new
        steps = data.get("interp_steps", data.get("interpolation_steps", 4))
        try:
            steps = int(steps)
        except (TypeError, ValueError, OverflowError):
            steps = 4  # Krea's fallback
        out["interp_steps"] = min(max(1, steps), MAX_INTERP_STEPS)
    elif new != prompt:
        tell("dropped_update", f"prompt {quote(new)} dropped (not a non-empty string)")
    seed = data.get("seed")
    if seed is not None:
        try:
            seed = int(seed)
        except (TypeError, ValueError, OverflowError):
            seed = -1
        if 0 <= seed < 2**63:
            out["seed"] = seed
        else:
            tell("dropped_update", f"seed {quote(data['seed'])} dropped (an integer from 0 to 2^63 - 1)")
    image = data.get("image")
    if isinstance(image, (bytes, str)) and image:
        out["image"] = image
    elif image:
        tell("dropped_update", f"image of type {type(image).__name__} dropped (bytes or base64 text)")
    for name, kinds in (("request_id", str), ("timestamp", (int, float))):
        value = data.get(name)
        if isinstance(value, kinds) and not isinstance(value, bool) and (name != "request_id" or len(value) <= 128):
            out[name] = float(value) if name == "timestamp" else value
    if not any(k in out for k in ("action", "prompt", "seed", "image")):
        return None
    return out
