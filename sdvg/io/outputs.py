"""Output paths checked before any model loads, and files written so that nothing already produced is
lost: whole-file writes go through a temporary file and a rename; JSON Lines appends are whole lines,
flushed and fsynced, and a line torn by a crash is cut off before the next append; a lock file keeps a
second run off the same outputs. Every name sdvg creates beside an output (`.<name>.tmp`, `<name>.lock`,
the partial video and its log) is opened O_NOFOLLOW (and O_EXCL for temporaries; `sdvg.io.safe_files`)
and checked here, before any model loads: a symlink or a special file there is refused by name."""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from sdvg.io.locks import OutputBusyError, drop_lock, lock_path, take_lock
from sdvg.io.safe_files import UnsafePathError, open_regular, probe_writable, refuse_planted, write_bytes_atomic


class OutputPathError(ValueError):
    """An output path cannot be used; the message names the path and the fix."""


def derived_names(path: Path) -> dict[str, Path]:
    """The names sdvg creates beside output `path` while writing it (what -> name)."""
    names = {"the temporary file": path.with_name(f".{path.name}.tmp"), "the lock file": lock_path(path)}
    if path.suffix.lower() == ".mp4":
        from sdvg.io.video_writer import partial_log_path, partial_path

        names["the partial video"] = partial_path(path)
        names["the encoder log"] = partial_log_path(path)
    return names


def check_created_names(path: str | Path, flag: str = "output") -> None:
    """Refuse, by name, a symlink or a non-regular file at any name sdvg would create beside `path`."""
    path = Path(path)
    for what, name in derived_names(path).items():
        try:
            refuse_planted(name, f"{flag} {path}, {what}")
        except UnsafePathError as exc:
            raise OutputPathError(str(exc)) from None


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
        if path.suffix.lower() == ".jsonl" and path.is_symlink():
            raise OutputPathError(f"{flag} {path} is a symbolic link; JSON Lines stats are appended in place and sdvg "
                                  "never writes through a link: give the file's own path")
        folder = _existing_parent(resolved.parent)
        check_created_names(path, flag)
        why = probe_writable(folder)  # tried, not read off mode bits: root and special filesystems answer truly
        if why is not None:
            raise OutputPathError(f"{flag} {path}: cannot create a file in the folder {folder} ({why}); choose "
                                  "another location")
        out[name] = resolved
    return out


def check_output_folders(args) -> None:
    """A command with --create-dirs writes only into folders that exist unless it is given: a missing one is
    refused before anything is locked, created or loaded (the outputs' folders are their base names')."""
    from sdvg.io.locks import command_outputs

    if getattr(args, "create_dirs", True):
        return
    for out in command_outputs(args):
        folder = Path(out).parent
        if not folder.is_dir():
            raise OutputPathError(f"{out}: the folder {folder} does not exist; create it (mkdir -p {folder}) or pass "
                                  "--create-dirs")


def numbered(path: Path, n: int) -> Path:
    """`<stem>-<n><suffix>` beside `path` (n = 0: `path` itself)."""
    return path if n == 0 else path.with_name(f"{path.stem}-{n}{path.suffix}")


def unused_outputs(bases: dict[str, Path | None], files_of) -> tuple[dict[str, Path | None], list[Path]]:
    """An existing output is never overwritten silently: `bases` (flag -> path) as given when none of the
    files they name (`files_of(bases)`, flag -> path) exists, else the first numbered set (`<stem>-1<suffix>`,
    `-2`, ...) of which none does. Returns (the bases to write, the existing files that moved them)."""
    existing = [p for p in files_of(bases).values() if p is not None and (p.exists() or p.is_symlink())]
    if not existing:
        return bases, []
    for n in range(1, 10_000):
        moved = {k: None if p is None else numbered(Path(p), n) for k, p in bases.items()}
        if not any(p.exists() or p.is_symlink() for p in files_of(moved).values() if p is not None):
            return moved, existing
    raise OutputPathError(f"{existing[0]} and 9999 numbered names beside it exist; give another path or pass "
                          "--overwrite")


def _existing_parent(folder: Path) -> Path:
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise OutputPathError(f"{folder} is a file, so no folder can be created under it")
    return folder


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a whole file through `<name>.tmp` and a rename: a reader never sees half a file, and a failed
    write (disk full) leaves the previous file as it was."""
    try:
        write_bytes_atomic(path, text.encode("utf-8"), str(path))
    except UnsafePathError as exc:
        raise OutputPathError(str(exc)) from None


def prompt_sha256(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def repair_jsonl(path: str | Path) -> int:
    """Cut a line torn by a crash (no trailing newline) off the end of a JSON Lines file. Returns the bytes
    removed (0 when the file ends cleanly or does not exist)."""
    path = Path(path)
    if not os.path.lexists(path):
        return 0
    try:
        fd = open_regular(path, "stats file", os.O_RDWR)
    except UnsafePathError as exc:
        raise OutputPathError(str(exc)) from None
    with os.fdopen(fd, "rb+") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0
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
    try:
        fd = open_regular(path, "stats file", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except UnsafePathError as exc:
        raise OutputPathError(str(exc)) from None
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


class OutputLock:
    """An exclusive lock on `<path>.lock` (`sdvg.io.locks.take_lock`: fcntl.flock on a file opened
    O_NOFOLLOW, released by the OS when the process dies): a second run on the same outputs is refused with
    a clear message naming the holder instead of writing them twice. Each OutputLock is its own holder
    (not re-entrant); the command line uses `sdvg.io.locks.lock_outputs` for a whole output set."""

    def __init__(self, path: str | Path):
        self.output = Path(path)
        self.path = lock_path(self.output)
        self._fd: int | None = None

    def __enter__(self) -> "OutputLock":
        try:
            self._fd = take_lock(self.path, self.output)
        except (OutputBusyError, UnsafePathError) as exc:
            raise OutputPathError(str(exc)) from None
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            drop_lock(self.path, self._fd)
            self._fd = None


# ------------------------------------------------------------------ what a CLI record adds, and resume's comparison
def _infinities(obj, prefix: str = "") -> dict[str, str]:
    """Dotted paths of the infinite floats in a JSON-like object -> "inf" / "-inf" (strict JSON writes them
    as null, losing the sign)."""
    import math

    if isinstance(obj, float) and math.isinf(obj):
        return {prefix: "inf" if obj > 0 else "-inf"}
    if isinstance(obj, dict):
        return {p: s for k, v in obj.items() for p, s in _infinities(v, f"{prefix}.{k}" if prefix else str(k)).items()}
    if isinstance(obj, (list, tuple)):
        return {p: s for i, v in enumerate(obj) for p, s in _infinities(v, f"{prefix}[{i}]").items()}
    return {}


def record_fields(protocol: str | None, options: dict) -> dict:
    """The fields the command line adds to a video's stats: `protocol` (the --protocol it ran under, or None)
    and `infinite_options` (each option path holding inf or -inf -> its sign, so `--resume` can tell
    tau = inf from tau = -inf although strict JSON writes both as null)."""
    return {"protocol": protocol, "infinite_options": _infinities(options)}


def stored_option_matches(options: dict, infinite_options: dict | None, key: str, value) -> bool:
    """Whether a stats record's option `key` (its `options` group) holds option value `value` as this run would
    write it: non-finite numbers compared through their null and their sign in the record's
    `cli.infinite_options` (older records without it, None, match either sign), tuples as lists."""
    from sdvg.io.strict_json import strict_json
    import json as _json

    stored = options.get(key)
    if _json.loads(strict_json(value)) != stored:
        return False
    signs = _infinities(value, key)
    if not signs or infinite_options is None:
        return True
    saved = infinite_options if isinstance(infinite_options, dict) else {}
    return all(saved.get(path) == sign for path, sign in signs.items())


def generate_outputs(stats: Path, videos: dict[int, Path], timeline, exit_map, many: bool) -> dict[str, Path]:
    """Every file `sdvg generate` writes, by flag, for `check_output_paths`: the stats, each video and, per
    prompt with a prompts file, each derived timeline and exit-map name (`<stem>_<line>.png`), so a derived
    name equal to another output (e.g. a timeline name landing on the stats JSONL) is refused up front."""
    def derived(base, i: int) -> Path:
        base = Path(base)
        return base.with_name(f"{base.stem}_{i:04d}{base.suffix}") if many else base

    out: dict[str, Path] = {"stats": stats}
    for i, video in videos.items():
        out["out" if not many else f"out_{i}"] = video
        for name, base in (("timeline", timeline), ("exit_map", exit_map)):
            if base is not None:
                out[name if not many else f"{name}_{i}"] = derived(base, i)
    return out
