"""The operator's own page (`--static-dir DIR`: its `index.html`, such as Krea's `release_demo.html` saved
there) served at `/` instead of sdvg's, with the files beside it: read-only (GET and HEAD), files only (no
directory listing; a folder is 404), no name beginning with a dot (no dotfiles, no `..`), nothing that
resolves outside DIR (a symlink leading out is 404), at most `MAX_FILE_BYTES` a file."""
from __future__ import annotations

import mimetypes
import os
import stat
from pathlib import Path

MAX_FILE_BYTES = 64 * 2**20
INDEX = "index.html"


class StaticDirError(ValueError):
    """--static-dir names no usable folder; the message says what to fix."""


def check_static_dir(folder: str) -> Path:
    """The folder resolved, with its index.html (StaticDirError before anything loads otherwise)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise StaticDirError(f"--static-dir {folder}: not a folder; give the folder of your page (its index.html "
                             "is served at /)")
    root = root.resolve()
    if not (root / INDEX).is_file():
        raise StaticDirError(f"--static-dir {folder}: no {INDEX} in it; save your page there as {INDEX} (Krea's: "
                             "templates/release_demo.html)")
    return root


def static_file(root: Path, url_path: str) -> Path | None:
    """The file of `url_path` under `root` (`/` is its index.html), or None: a missing file, a folder, a name that
    begins with a dot, a path that resolves outside `root`, something that is not a regular file, a file too large."""
    parts = [p for p in url_path.split("/") if p]
    if any(p.startswith(".") or "\\" in p or "\0" in p for p in parts):
        return None
    candidate = root.joinpath(*parts) if parts else root / INDEX
    try:
        real = Path(os.path.realpath(candidate))
        info = os.stat(real)
    except (OSError, ValueError):
        return None
    if not real.is_relative_to(root) or not stat.S_ISREG(info.st_mode) or info.st_size > MAX_FILE_BYTES:
        return None
    if any(p.startswith(".") for p in real.relative_to(root).parts):  # a link inside to a dotfile
        return None
    return real


def media_type(path: Path) -> str:
    kind, _ = mimetypes.guess_type(path.name)
    return kind or "application/octet-stream"
