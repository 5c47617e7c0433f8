"""Every client message, validated (pydantic): the generation parameters (the first binary frame)
and the mid-stream updates. Field names and defaults are Krea Realtime Video's (`release_server.py`,
`GenerateParams` and the update loop of `ws_session`) plus sdvg's generation options under their
option names (`sdvg.options`). A message that fails becomes one `error` reply naming the field
(`ProtocolError`); unknown fields are refused, never ignored (docs/server.md)."""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from sdvg.live.updates import ROUTER_FIELDS
from sdvg.options import FIELDS, MAX_INTERP_BLOCKS, OPTION_NAMES, SEED_MAX

UPLOAD_ID = re.compile(r"^up_[0-9a-f]{32}$")  # what POST /upload_* returns; nothing else names a file

# sdvg options a client may set (the others belong to the server, with the reason named in the error)
SERVER_OWNED: dict[str, str] = {
    "seed": "use Krea's `seed`",
    "num_blocks": "use Krea's `num_blocks`",
    "kv_cache_frames": "use Krea's `kv_cache_num_frames`",
    "keep_first_frame": "use Krea's `keep_first_frame`",
    "backend": "the stage backend is the server's (sdvg serve --backend)",
    "exit_head": "a file path; the server never opens a path a client names (sdvg serve --exit-head)",
    "run_ahead": "sessions are interleaved block by block on one worker, which run-ahead's drafter thread "
                 "would break (sdvg serve decides)",
    "run_ahead_blocks": "run-ahead is off on the server",
    "scheduler": "the server runs every session on the reference loop (bitwise the native scheduler's video): "
                 "the native scheduler on the caller's thread yields a video's blocks only at its end, which would "
                 "stop block-by-block interleaving",
    "cuda_graphs": "CUDA graphs keep one KV cache per pipeline, shared by interleaved sessions (sdvg serve "
                   "--cuda-graphs with --max-sessions 1)",
}
CLIENT_OPTIONS: tuple[str, ...] = tuple(n for n in OPTION_NAMES if n not in SERVER_OWNED)


MAX_MAP_LEN = 128  # keys of one map: the parameters have about 50 fields (Krea's and sdvg's options)
MAX_DEPTH = 4  # maps and arrays nested (a message is a map of scalars, a pattern list at most)


def decode_message(data: bytes, max_array_len: int, max_str_len: int, max_bin_len: int):
    """One binary message as msgpack, bounded while it is decoded (msgpack's own max_*_len: an 850k-key map is
    refused by the decoder, before a Python object is made for it), then its nesting checked without
    recursion; ProtocolError naming the limit otherwise."""
    import msgpack

    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_map_len=MAX_MAP_LEN,
                              max_array_len=max_array_len, max_str_len=max_str_len, max_bin_len=max_bin_len)
    except ValueError as exc:
        text = str(exc)
        if "exceeds max" in text or isinstance(exc, msgpack.exceptions.StackError):  # "... exceeds max_map_len(128)"
            raise ProtocolError(None, f"message refused by the decoder's limits ({text[:120] or 'nested too deep'}): "
                                f"maps of at most {MAX_MAP_LEN} keys, arrays of {max_array_len} items, strings of "
                                f"{max_str_len} bytes, binaries of {max_bin_len} bytes", reason="limits") from None
        raise ProtocolError(None, f"malformed msgpack ({type(exc).__name__})") from None
    except Exception as exc:  # noqa: BLE001 (msgpack raises several kinds for bad bytes)
        raise ProtocolError(None, f"malformed msgpack ({type(exc).__name__})") from None
    pending = [(obj, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise ProtocolError(None, f"message nested more than {MAX_DEPTH} deep; send a map of values",
                                    reason="limits")
            items = value.values() if isinstance(value, dict) else value
            pending.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))
    return obj


class ProtocolError(ValueError):
    """A client message the server refuses: `field` names the field (None: the whole message)."""

    def __init__(self, field: str | None, message: str, details: list[dict] | None = None, reason: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.field, self.message = field, message
        self.reason = reason  # how /metrics counts it, where the caller's own reason is not the right one
        self.details = details  # Krea's error list, when its pydantic would refuse the message (sdvg.serve.plain)

    def reply(self) -> dict:
        return {"status": "error", "error": str(self), "field": self.field}


_STRICT = ConfigDict(extra="forbid", strict=True)


class KreaParams(BaseModel):
    """Krea's `GenerateParams`, field for field (defaults as Krea's unless said)."""

    model_config = _STRICT
    prompt: str = Field(min_length=1)
    width: int | None = None  # Krea: 832; sdvg: the preset's (another size is refused)
    height: int | None = None  # Krea: 480; sdvg: the preset's
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)  # None: random in [0, 2**24) as Krea
    resume_latents: bytes | None = None
    strength: float = 1.0
    request_id: str | None = Field(default=None, max_length=128)
    interp_blocks: int = -1
    context_noise: float = 0.0
    keep_first_frame: bool = False
    kv_cache_num_frames: int = Field(default=3, ge=1)
    num_blocks: int = Field(default=9, ge=1)
    num_denoising_steps: int | None = None  # Krea: 5 (its recompute schedule); sdvg: the model's
    block_on_frame: bool = False
    input_video: str | None = None
    start_frame: bytes | str | None = None
    timestep_shift: float | None = None  # Krea: 5.0; sdvg: the preset's
    webcam_mode: bool = False
    webcam_fps: int = Field(default=10, ge=1, le=120)


# sdvg's own options, by option name; None = the server's default (`sdvg serve --tau ...`), then sdvg's
GenerateParams = create_model("GenerateParams", __base__=KreaParams,
                              **{name: (Any, None) for name in CLIENT_OPTIONS
                                 if name not in KreaParams.model_fields})


class Update(BaseModel):
    """A mid-stream message (Krea's names: `action`, `prompt`, `interp_steps` / `interpolation_steps`,
    `seed`, `image`, `strength`, `request_id`, `timestamp`; sdvg's: `tau`, `router`, `accept_prob`, `pattern`,
    actions pause / resume / ping)."""

    model_config = _STRICT
    action: Literal["reset", "pause", "resume", "ping"] | None = None
    prompt: str | None = Field(default=None, min_length=1)
    # the bound is the option's (interp_blocks, sdvg/options.py): a client's blend is what the API allows
    interp_steps: int | None = Field(default=None, ge=1, le=MAX_INTERP_BLOCKS)
    interpolation_steps: int | None = Field(default=None, ge=1, le=MAX_INTERP_BLOCKS)
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    image: bytes | str | None = None  # the bytes, base64 or a base64 data URL (uploads.image_bytes)
    strength: float | None = Field(default=None, ge=0.0, le=1.0)
    request_id: str | None = Field(default=None, max_length=128)
    timestamp: float | None = None
    tau: float | None = None
    router: str | None = Field(default=None, max_length=16)
    accept_prob: float | None = None
    pattern: str | None = Field(default=None, max_length=4096)


def _first_error(exc: ValidationError) -> ProtocolError:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or None
    kind = err["type"]
    if kind == "extra_forbidden":
        return ProtocolError(field, "unknown field; see docs/server.md for the fields this server takes")
    if kind == "missing":
        return ProtocolError(field, "missing (required)")
    return ProtocolError(field, f"{err['msg']} (got {type(err.get('input')).__name__})")


def _validate(model, data: Any, prompt_limit: int):
    if not isinstance(data, dict):
        raise ProtocolError(None, f"a message must be a msgpack map, got {type(data).__name__}")
    bad_keys = [k for k in data if not isinstance(k, str)]
    if bad_keys:
        raise ProtocolError(None, f"map keys must be strings, got {bad_keys[0]!r:.40}")
    prompt = data.get("prompt")
    if isinstance(prompt, str) and len(prompt) > prompt_limit:
        raise ProtocolError("prompt", f"{len(prompt)} characters; at most {prompt_limit}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _first_error(exc) from None


def parse_params(data: Any, prompt_limit: int = 2000) -> KreaParams:
    if isinstance(data, dict):
        refuse_server_owned(data)
    params = _validate(GenerateParams, data, prompt_limit)
    if not params.prompt.strip():
        raise ProtocolError("prompt", "empty; give a text prompt")
    return params


def parse_update(data: Any, prompt_limit: int = 2000) -> Update:
    update = _validate(Update, data, prompt_limit)
    if update.interp_steps is not None and update.interpolation_steps is not None:
        raise ProtocolError("interpolation_steps", "give interp_steps or interpolation_steps, not both")
    if not any(v is not None for k, v in update.model_dump().items() if k not in ("request_id", "timestamp")):
        raise ProtocolError(None, "an update must carry at least one of action, prompt, seed, image, "
                                  + ", ".join(ROUTER_FIELDS))
    return update


def option_fields(params: KreaParams) -> dict:
    """The sdvg options the client set (by option name), an explicit null included: the option's own validator
    takes it where None is its declared default and refuses it, naming the field, where it is not."""
    return {name: getattr(params, name) for name in CLIENT_OPTIONS
            if name in FIELDS and name not in KreaParams.model_fields and name in params.model_fields_set}


def refuse_server_owned(data: dict) -> None:
    for name, why in SERVER_OWNED.items():
        if name in data and name not in KreaParams.model_fields:
            raise ProtocolError(name, f"not settable by a client: {why}")
