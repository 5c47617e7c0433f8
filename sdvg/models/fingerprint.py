"""Cheap identities of weights: what a statistics file or an engine records about where a model
came from, without reading gigabytes."""
from __future__ import annotations

import hashlib
from pathlib import Path

from sdvg.config import check_random_init


def file_fingerprint(path: str | Path) -> str:
    """`name@sha256(16)` over the file's (or folder's files') names, sizes and modification times."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(path) if path.is_dir() else f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return f"{path.name}@{h.hexdigest()[:16]}"


def random_fingerprint(preset_name: str, seed: int, random_init: str = "cpu") -> str:
    """The random weights of a preset and seed: `random:<preset>:seed=<seed>`, one model on every device; with
    `random_init` "device" (drawn with the generator of the device each DiT was built for, the stats' devices)
    `:init=device` is added."""
    check_random_init(random_init)
    return f"random:{preset_name}:seed={seed}" + ("" if random_init == "cpu" else f":init={random_init}")
