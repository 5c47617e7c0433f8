"""Files sdvg creates beside its outputs (locks, temporaries, partial videos), created so that a planted
symlink or special file cannot redirect a write.

Every such name is opened with `O_NOFOLLOW` (a symlink at the name fails with ELOOP instead of being
followed) and, for a temporary, `O_CREAT | O_EXCL` (the file must be new: nothing planted there is
reused). `refuse_planted` checks a name before any work starts, so a run is refused by name up front
rather than after the video is computed. Stale regular files of an earlier crash (a `.x.tmp`) are
removed first; anything else at the name (a symlink, a folder, a FIFO, a device) is refused."""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path


class UnsafePathError(ValueError):
    """A name sdvg would create holds a symlink or a non-regular file; the message names it and the fix."""


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def kind_of(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def refuse_planted(path: str | Path, what: str) -> None:
    """Refuse `path` (a name sdvg creates: `what` says which) when something other than a regular file is
    there, without following a symlink. Nothing there, or a regular file, passes."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise UnsafePathError(f"{what}: {path}: a part of its folder is a file; choose another path") from None
    if not stat.S_ISREG(mode):
        raise UnsafePathError(f"{what}: {path} is {kind_of(mode)}, which sdvg never writes through; remove it "
                              "(it may have been planted) or choose another path")


def check_regular_input(path: str | Path, what: str, fix: str) -> Path:
    """`path`, checked to name a regular file (a symlink to one is followed: model caches are made of them) with
    stat, before anything opens it: a named pipe would block the open (and a reader after it) forever, a folder or
    a device fails later or never. FileNotFoundError when nothing is there, ValueError for anything else; both
    name `what`, the path, what is there and `fix`."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} not found; {fix}") from None
    except NotADirectoryError:
        raise FileNotFoundError(f"{what} {path} not found (a part of its folder is a file); {fix}") from None
    except OSError as exc:
        raise ValueError(f"{what} {path} cannot be read ({exc.strerror}); {fix}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{what} {path} is {kind_of(mode)}, not a regular file; {fix}")
    return path


def _open_error(path: Path, what: str, exc: OSError) -> UnsafePathError:
    if exc.errno in (errno.ELOOP, errno.EMLINK):
        return UnsafePathError(f"{what}: {path} is a symbolic link, which sdvg never writes through; remove it (it "
                               "may have been planted) or choose another path")
    if exc.errno == errno.EEXIST:
        return UnsafePathError(f"{what}: {path} appeared while sdvg was creating it (another process?); remove it "
                               "or choose another path")
    return UnsafePathError(f"{what}: {path}: {exc.strerror}; choose another path")


def create_new(path: str | Path, what: str, mode: int = 0o644, remove_stale: bool = True,
               readable: bool = False) -> int:
    """A file descriptor (write-only, or read-write when `readable`) of a file created new at `path`:
    O_CREAT | O_EXCL | O_NOFOLLOW. A stale regular file there is removed first (`remove_stale`); a symlink
    or a special file is refused."""
    path = Path(path)
    refuse_planted(path, what)
    if remove_stale:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    try:
        flags = (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        return os.open(path, flags | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        raise _open_error(path, what, exc) from None


def open_regular(path: str | Path, what: str, flags: int, mode: int = 0o644) -> int:
    """A descriptor of `path` opened with `flags | O_NOFOLLOW | O_NONBLOCK` (a FIFO cannot block the open)
    and checked to be a regular file (fstat, so no swap between check and use)."""
    path = Path(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        raise _open_error(path, what, exc) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafePathError(f"{what}: {path} is {kind_of(st.st_mode)}, which sdvg never writes; remove it or "
                              "choose another path")
    os.set_blocking(fd, True)
    return fd


def private_folder(beside: str | Path, what: str) -> Path:
    """A new folder only this user can enter (0700, an unpredictable name) beside `beside`: files made in it
    cannot be planted by others; they are renamed into place when done."""
    beside = Path(beside)
    beside.parent.mkdir(parents=True, exist_ok=True)
    try:
        return Path(tempfile.mkdtemp(prefix=f".{beside.name}.", suffix=".partial", dir=beside.parent))
    except OSError as exc:
        raise UnsafePathError(f"{what}: cannot create a temporary folder beside {beside} ({exc.strerror}); check "
                              "the folder is writable") from None


def remove_private_folder(folder: Path) -> None:
    """Remove a `private_folder` and the plain files in it (nothing is followed)."""
    try:
        for entry in os.scandir(folder):
            if entry.is_dir(follow_symlinks=False):
                remove_private_folder(Path(entry.path))
            else:
                os.unlink(entry.path)
        os.rmdir(folder)
    except FileNotFoundError:
        pass


def write_bytes_atomic(path: str | Path, data: bytes, what: str = "output") -> None:
    """Write a whole file through `.<name>.tmp` (created new, O_EXCL | O_NOFOLLOW), fsync and a rename: a
    reader never sees half a file, a failed write leaves the previous file, and a planted symlink at the
    temporary name is refused rather than followed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = create_new(tmp, f"the temporary file of {what}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            if stat.S_ISREG(os.lstat(tmp).st_mode):
                os.unlink(tmp)
        except OSError:
            pass
        raise


def probe_writable(folder: str | Path) -> str | None:
    """None when a file can be created in `folder` (tried: a probe file created O_EXCL and removed, so root,
    read-only mounts and special filesystems all answer truthfully), else the reason."""
    folder = Path(folder)
    try:
        fd, name = tempfile.mkstemp(prefix=".sdvg-probe-", dir=folder)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    try:
        os.unlink(name)
    except OSError:
        pass
    return None


def save_figure(fig, path: str | Path, dpi: int) -> None:
    """A matplotlib figure written like every other output: rendered in memory (format from the suffix), then
    `write_bytes_atomic` (no write through a planted link, no half-written image)."""
    import io

    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format=path.suffix.lstrip(".").lower() or "png")
    write_bytes_atomic(path, buf.getvalue(), f"figure {path}")


def append_line(path: str | Path, line: str, what: str = "records file") -> None:
    """Append one line (text without a newline) to `path`, opened O_APPEND | O_NOFOLLOW and checked regular."""
    fd = open_regular(path, what, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
