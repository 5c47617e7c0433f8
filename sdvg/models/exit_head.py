"""The learned exit verifier of Speculative Forcing: a small head on the frozen generator's last
transformer block hidden states that predicts each token's relative gap to the full schedule's output
(`rel_k`, sdvg/generation/early_exit/oracle.py).

LayerNorm over the hidden width, 2x2x2 average pooling of the token grid, then 3D convolutions
dim -> 96 -> 48 -> 1 (two 3x3x3 with GELU, then 1x1x1) and nearest upsampling back to the grid; one
head for every step. About 4.1M parameters at dim 1536.

Files are safetensors with the head's config in the metadata (`format` sdvg-exit-head); loading checks
the format, the width against the generator's, every tensor's name, shape and dtype and that all
values are finite (no pickle is ever read)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HEAD_FORMAT = "sdvg-exit-head"
HEAD_VERSION = 1
# Bounds on a head's config, checked before anything is allocated (a file's metadata is untrusted):
MAX_DIM = 16384  # the generator's hidden width (Wan2.1 14B: 5120)
MAX_CHANNELS = 4096  # each hidden channel count (the head's: 96, 48)
MAX_POOL = 16
MAX_METADATA_BYTES = 1 << 20


def check_head_config(raw, source: str) -> "ExitHeadConfig":
    """An ExitHeadConfig from untrusted metadata (a dict with dim, channels, pool): every entry an integer in
    its bounds, before any allocation; ValueError naming the value otherwise."""
    from sdvg.bounded import quote

    def integer(name, v, high):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= high:
            raise ValueError(f"{source}: {name} {quote(v)} must be an integer in [1, {high}]; retrain the head")
        return v

    if not isinstance(raw, dict) or set(raw) - {"dim", "channels", "pool"} or "dim" not in raw:
        raise ValueError(f"{source}: config metadata {quote(raw)} must be a mapping of dim, channels, pool; retrain "
                         "the head")
    channels = raw.get("channels", [96, 48])
    if not isinstance(channels, list) or len(channels) != 2:
        raise ValueError(f"{source}: channels {quote(channels)} must be two integers; retrain the head")
    return ExitHeadConfig(integer("dim", raw["dim"], MAX_DIM),
                          tuple(integer("channels", c, MAX_CHANNELS) for c in channels),
                          integer("pool", raw.get("pool", 2), MAX_POOL))


def read_metadata_json(meta: dict, key: str, source: str, default=None):
    """`meta[key]` parsed as bounded JSON (size, depth, duplicate keys refused); `default` when absent."""
    from sdvg.bounded import BoundedInputError, load_json_text

    if key not in meta:
        return default
    try:
        return load_json_text(meta[key], f"{source} metadata {key!r}", MAX_METADATA_BYTES)
    except BoundedInputError as exc:
        raise ValueError(f"{exc}; the file is damaged or not sdvg's") from None


HEAD_FILE_FIX = "give the head's .safetensors file (`sdvg train-exit-head` writes head.safetensors in its --out)"


def check_head_file(path: str | Path) -> Path:
    """`path` as a head file may be: a regular file (a symlink to one followed), checked before anything opens it
    (FileNotFoundError when missing, ValueError naming what is there instead: a folder, a named pipe, a device).
    The command line runs it before loading any model (`sdvg generate --exit-head`)."""
    from sdvg.io.safe_files import check_regular_input

    return check_regular_input(path, "exit head file", HEAD_FILE_FIX)


@dataclass(frozen=True)
class ExitHeadConfig:
    dim: int  # the generator's hidden width
    channels: tuple[int, int] = (96, 48)
    pool: int = 2


class ExitHead(nn.Module):
    def __init__(self, config: ExitHeadConfig):
        super().__init__()
        self.config = config
        c1, c2 = config.channels
        self.norm = nn.LayerNorm(config.dim)
        self.conv1 = nn.Conv3d(config.dim, c1, 3, padding=1)
        self.conv2 = nn.Conv3d(c1, c2, 3, padding=1)
        self.out = nn.Conv3d(c2, 1, 1)

    def forward(self, hidden: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """hidden [N, S, dim] (tokens in grid order) -> predicted gaps [N, F, gh, gw] (float32)."""
        n, s, _ = hidden.shape
        gf, gh, gw = grid
        if s != gf * gh * gw:
            raise ValueError(f"exit head: {s} tokens do not fill a {gf}x{gh}x{gw} grid")
        x = self.norm(hidden.float()).transpose(1, 2).reshape(n, -1, gf, gh, gw)  # [N, dim, F, gh, gw]
        p = self.config.pool
        x = F.avg_pool3d(x, p, stride=p, ceil_mode=True)
        x = self.out(F.gelu(self.conv2(F.gelu(self.conv1(x)))))  # [N, 1, F/p, gh/p, gw/p]
        return F.interpolate(x, size=grid, mode="nearest")[:, 0]

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path, extra: dict | None = None) -> bool:
        """Write the head (through a temporary file created O_EXCL | O_NOFOLLOW, then a rename). Refused
        (ValueError, nothing written) when a weight or `extra["final_loss"]` is not finite. A head already at
        `path` trained on the same data (same generator, prompts, seeds and eps in its extra) with a lower
        final loss is kept: returns False (and warns) instead of replacing it with a worse one."""
        import math
        import warnings

        from safetensors.torch import save

        from sdvg.io.safe_files import write_bytes_atomic

        tensors = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        bad = [k for k, v in tensors.items() if not bool(torch.isfinite(v).all())]
        if bad:
            raise ValueError(f"exit head not written to {path}: {', '.join(bad[:4])} hold NaN or inf (training "
                             "diverged; lower --lr or check the records); the previous file is kept")
        loss = (extra or {}).get("final_loss")
        if loss is not None and not math.isfinite(loss):
            raise ValueError(f"exit head not written to {path}: its final loss is {loss}; the previous file is kept")
        path = Path(path)
        if loss is not None and path.is_file():
            old = self.read_extra(path)
            same = all(old.get(k) == json.loads(json.dumps(extra.get(k)))
                       for k in ("generator", "training_prompts", "training_seeds", "eps"))
            old_loss = old.get("final_loss")
            if same and isinstance(old_loss, (int, float)) and math.isfinite(old_loss) and old_loss < loss:
                try:
                    ExitHead.load(path, self.config.dim)
                except (ValueError, FileNotFoundError):
                    pass  # the file there is not a usable head: replace it
                else:
                    warnings.warn(f"{path} holds a head trained on the same data with a lower loss ({old_loss:.6g} < "
                                  f"{loss:.6g}); it is kept", RuntimeWarning, stacklevel=2)
                    return False
        meta = {"format": HEAD_FORMAT, "version": str(HEAD_VERSION),
                "config": json.dumps({**asdict(self.config), "channels": list(self.config.channels)})}
        if extra:
            meta["extra"] = json.dumps(extra)
        write_bytes_atomic(path, save(tensors, metadata=meta), f"exit head {path}")
        return True

    @classmethod
    def load(cls, path: str | Path, dim: int | None = None, device="cpu") -> "ExitHead":
        """A head from its file; `dim`: the generator's width it must match."""
        from safetensors import safe_open

        path = check_head_file(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as exc:
            raise ValueError(f"exit head file {path} is not a readable safetensors file ({str(exc)[:200]}); train a "
                             "new one with `sdvg train-exit-head`") from None
        if meta.get("format") != HEAD_FORMAT:
            from sdvg.bounded import quote

            raise ValueError(f"{path} is not an sdvg exit head (metadata format {quote(meta.get('format'))}, expected "
                             f"{HEAD_FORMAT!r}); train one with `sdvg train-exit-head`")
        if meta.get("version") != str(HEAD_VERSION):
            raise ValueError(f"exit head {path} has format version {str(meta.get('version'))[:20]}, this sdvg reads "
                             f"{HEAD_VERSION}; retrain it with `sdvg train-exit-head`")
        if "config" not in meta:
            raise ValueError(f"exit head {path}: no config metadata; retrain it")
        config = check_head_config(read_metadata_json(meta, "config", f"exit head {path}"), f"exit head {path}")
        if dim is not None and config.dim != dim:
            raise ValueError(f"exit head {path} was trained for a generator of width {config.dim}, but this model's "
                             f"width is {dim}; train a head for this model with `sdvg train-exit-head`")
        with torch.device("meta"):  # the expected shapes, nothing allocated until the file matches them
            want = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
        got = shapes
        if want != got:
            missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
            raise ValueError(f"exit head {path} does not match its config: missing {missing[:6]}, unexpected "
                             f"{unexpected[:6]}, wrong shapes {wrong[:6]}; retrain it")
        try:
            with safe_open(str(path), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:
            raise ValueError(f"exit head file {path} is not a readable safetensors file ({str(exc)[:200]}); train a "
                             "new one with `sdvg train-exit-head`") from None
        head = cls(config)
        for k, v in tensors.items():
            if not v.is_floating_point():
                raise ValueError(f"exit head {path}: tensor {k} has dtype {v.dtype}, expected a floating type")
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"exit head {path}: tensor {k} holds NaN or inf; retrain it")
        head.load_state_dict({k: v.float() for k, v in tensors.items()})
        return head.to(device).eval()

    @staticmethod
    def read_extra(path: str | Path) -> dict:
        """The `extra` metadata of a head file ({} when the file has none or cannot be read: `load` then
        says what is wrong with it)."""
        from safetensors import safe_open

        try:
            check_head_file(path)  # never opened unless a regular file: a named pipe would block the open
            with safe_open(str(path), framework="pt") as f:
                extra = read_metadata_json(f.metadata() or {}, "extra", str(path), {})
        except Exception:  # noqa: BLE001 (unreadable: `load` says why)
            return {}
        return extra if isinstance(extra, dict) else {}
