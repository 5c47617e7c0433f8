"""Output paths checked before any model loads, and files written so that nothing already produced is
lost: whole-file writes go through a temporary file and a rename; JSON Lines appends are whole lines,
flushed and fsynced, and a line torn by a crash is cut off before the next append; a lock file keeps a
second run off the same outputs."""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path


class OutputPathError(ValueError):
    """An output path cannot be used; the message names the path and the fix."""


def check_output_paths(**paths) -> dict[str, Path]:
    """`name=path` pairs (None skipped): every path distinct (after resolving symlinks), not an existing
    non-regular file (a folder, a device, or a symlink to one), and its folder creatable and writable.
    Returns the resolved paths."""
    out: dict[str, Path] = {}
    seen: dict[Path, str] = {}
    for name, raw in paths.items():
        if raw is None:
            continue
        path = Path(raw)
        flag = "--" + name.replace("_", "-")
        if path.exists():  # follows a symlink (a dangling one names a file still to be created)
            try:
                mode = os.stat(path).st_mode
            except OSError as exc:
                raise OutputPathError(f"{flag} {path}: cannot inspect it ({exc.strerror}); choose another path") from None
            if not stat.S_ISREG(mode):
                kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a device, a pipe or a socket)"
                raise OutputPathError(f"{flag} {path} is {kind}; give a file path")
        resolved = path.resolve()
        if resolved in seen:
            raise OutputPathError(f"{flag} and --{seen[resolved].replace('_', '-')} are the same file ({path}); give "
                                  "each output its own path")
        seen[resolved] = name
        folder = _existing_parent(resolved.parent)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise OutputPathError(f"{flag} {path}: the folder {folder} is not writable; choose another location")
        out[name] = resolved
    return out


def _existing_parent(folder: Path) -> Path:
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise OutputPathError(f"{folder} is a file, so no folder can be created under it")
    return folder


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a whole file through `<name>.tmp` and a rename: a reader never sees half a file, and a failed
    write (disk full) leaves the previous file as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def prompt_sha256(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def repair_jsonl(path: str | Path) -> int:
    """Cut a line torn by a crash (no trailing newline) off the end of a JSON Lines file. Returns the bytes
    removed (0 when the file ends cleanly or does not exist)."""
    path = Path(path)
    if not path.is_file():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # find the last newline
        pos, block = size, 1 << 16
        keep = 0
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return size - keep


def append_jsonl(path: str | Path, line: str) -> None:
    """Append one whole line (flushed and fsynced): a crash leaves at most a torn last line, which
    `repair_jsonl` cuts off."""
    if "\n" in line:
        raise ValueError("a JSON Lines record must be one line")
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


class OutputLock:
    """An exclusive lock on `<path>.lock` (fcntl.flock, released by the OS when the process dies): a second
    run on the same outputs is refused with a clear message instead of writing them twice."""

    def __init__(self, path: str | Path):
        self.path = Path(path).with_name(Path(path).name + ".lock")
        self._fd: int | None = None

    def __enter__(self) -> "OutputLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputPathError(f"another sdvg run is writing {self.path.with_suffix('')} (it holds {self.path}); "
                                  "wait for it to finish or write elsewhere") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            # unlinked while still held: a run that opened it meanwhile was refused (non-blocking), and the
            # next one creates a fresh file
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None
