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
    def save(self, path: str | Path, extra: dict | None = None) -> None:
        from safetensors.torch import save_file

        meta = {"format": HEAD_FORMAT, "version": str(HEAD_VERSION),
                "config": json.dumps({**asdict(self.config), "channels": list(self.config.channels)})}
        if extra:
            meta["extra"] = json.dumps(extra)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.partial")
        save_file({k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}, str(tmp),
                  metadata=meta)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path, dim: int | None = None, device="cpu") -> "ExitHead":
        """A head from its file; `dim`: the generator's width it must match."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"exit head file {path} not found; train one with `sdvg train-exit-head`")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:
            raise ValueError(f"exit head file {path} is not a readable safetensors file ({exc}); train a new one "
                             "with `sdvg train-exit-head`") from None
        if meta.get("format") != HEAD_FORMAT:
            raise ValueError(f"{path} is not an sdvg exit head (metadata format {meta.get('format')!r}, expected "
                             f"{HEAD_FORMAT!r}); train one with `sdvg train-exit-head`")
        if meta.get("version") != str(HEAD_VERSION):
            raise ValueError(f"exit head {path} has format version {meta.get('version')}, this sdvg reads "
                             f"{HEAD_VERSION}; retrain it with `sdvg train-exit-head`")
        try:
            raw = json.loads(meta["config"])
            config = ExitHeadConfig(int(raw["dim"]), tuple(int(c) for c in raw["channels"]), int(raw["pool"]))
        except Exception:
            raise ValueError(f"exit head {path}: unreadable config metadata; retrain it") from None
        if dim is not None and config.dim != dim:
            raise ValueError(f"exit head {path} was trained for a generator of width {config.dim}, but this model's "
                             f"width is {dim}; train a head for this model with `sdvg train-exit-head`")
        head = cls(config)
        want = {k: v.shape for k, v in head.state_dict().items()}
        got = {k: v.shape for k, v in tensors.items()}
        if want != got:
            missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
            raise ValueError(f"exit head {path} does not match its config: missing {missing}, unexpected "
                             f"{unexpected}, wrong shapes {wrong}; retrain it")
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
            with safe_open(str(path), framework="pt") as f:
                extra = json.loads((f.metadata() or {}).get("extra", "{}"))
        except Exception:
            return {}
        return extra if isinstance(extra, dict) else {}
