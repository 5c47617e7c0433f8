"""One lock per output set: a command locks every output it writes (`<output>.lock` beside each, taken in
a fixed order) before any model loads, and a second run on any of them is refused naming the holder's pid.

The locks are `fcntl.flock` on lock files opened with O_NOFOLLOW (a planted symlink is refused, never
followed); the OS releases them when the process dies, so a crash leaves no stale lock. A lock file is
removed when released; a run that opened the old file meanwhile notices (the name now points elsewhere)
and tries again. Within one process the locks are re-entrant (a command may lock an output the
command line already locked)."""
from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from sdvg.io.safe_files import UnsafePathError, open_regular, refuse_planted


class OutputBusyError(ValueError):
    """Another run holds a lock on one of the outputs; the message names the output and the holder."""


def lock_path(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(output.name + ".lock")


_HELD: dict[Path, list] = {}  # lock file (absolute) -> [fd, count]


def _holder(path: Path) -> str:
    try:
        fd = open_regular(path, "lock file", os.O_RDONLY)
    except (UnsafePathError, OSError):
        return "an unknown process"
    try:
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return f"process {text}" if text.isdigit() else "an unknown process"


def _make_folder(folder: Path, output: Path) -> None:
    """Create the folder of an output (and its lock) or refuse with a one-line reason (exit 2)."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise OutputBusyError(f"{output}: {probe} is a file, so no folder can be created under it; choose another "
                              "path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputBusyError(f"{output}: cannot create the folder {folder} ({exc.strerror}); choose another "
                              "location") from None


def take_lock(path: Path, output: Path) -> int:
    """Lock `path` (the lock file of `output`) for this open file; returns its descriptor. Refused
    (OutputBusyError) naming the holder's pid when another open file holds it (another run, or another
    `take_lock` of this process)."""
    import fcntl

    refuse_planted(path, f"the lock file of {output}")
    _make_folder(path.parent, output)
    for _ in range(100):
        try:
            fd = open_regular(path, f"the lock file of {output}", os.O_RDWR | os.O_CREAT)
        except UnsafePathError:
            raise
        except OSError as exc:
            raise OutputBusyError(f"cannot create the lock file {path} of {output} ({exc.strerror}); choose "
                                  "another location") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputBusyError(f"another sdvg run is writing {output} ({_holder(path)} holds {path}); wait for "
                                  "it to finish or write elsewhere") from None
        try:
            now = os.lstat(path)
        except FileNotFoundError:
            now = None
        mine = os.fstat(fd)
        if now is not None and stat.S_ISREG(now.st_mode) and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)  # the holder removed the file between our open and our lock: take the new one
    raise OutputBusyError(f"could not lock {output}: {path} keeps being replaced; check no other program touches it")


def drop_lock(path: Path, fd: int) -> None:
    """Release `take_lock`'s lock: the file is removed while still held (when it is still ours), so a run
    that opened it meanwhile notices and creates a fresh one."""
    try:
        st, mine = os.lstat(path), os.fstat(fd)
        if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            os.unlink(path)
    except OSError:
        pass
    os.close(fd)


def _acquire(path: Path, output: Path) -> None:
    key = Path(os.path.abspath(path))
    if key in _HELD:
        _HELD[key][1] += 1
        return
    _HELD[key] = [take_lock(key, output), 1]


def _release(path: Path) -> None:
    key = Path(os.path.abspath(path))
    entry = _HELD.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _HELD[key]
        drop_lock(key, entry[0])


@contextlib.contextmanager
def lock_outputs(*outputs):
    """Hold `<output>.lock` for every output given (None skipped) for the duration of the block; refused
    (OutputBusyError, exit 2) naming the holder when another run holds any of them. Locks are taken in
    sorted order (two runs sharing outputs cannot deadlock) and released in reverse."""
    paths = sorted({Path(os.path.abspath(Path(o))) for o in outputs if o is not None and str(o) != ""})
    for out in paths:  # a device or a pipe is no output (and gets no lock file beside it, e.g. in /dev)
        try:
            mode = os.stat(out).st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            from sdvg.io.safe_files import kind_of

            raise OutputBusyError(f"{out} is not a regular file ({kind_of(mode)}); give a file path")
    taken: list[Path] = []
    try:
        for out in paths:
            lp = lock_path(out)
            _acquire(lp, out)
            taken.append(lp)
        yield paths
    finally:
        for lp in reversed(taken):
            _release(lp)


def held_locks() -> list[Path]:
    """The lock files this process holds (for tests and diagnostics)."""
    return sorted(_HELD)


def command_outputs(args) -> list[Path]:
    """Every output a parsed `sdvg` command line writes (the base names; per-prompt files derive from
    them): generate: --out, --stats (or its default), --timeline, --exit-map; sweep / calibrate /
    train-exit-head: the --out folder; calibrate-exit: the --out report. `memory` and `config` write
    nothing."""
    command = getattr(args, "command", None)
    if command == "generate":
        out = Path(args.out)
        many = getattr(args, "prompts_file", None) is not None
        stats = Path(args.stats) if getattr(args, "stats", None) else out.with_suffix(".jsonl" if many else ".json")
        return [p for p in (out, stats, getattr(args, "timeline", None), getattr(args, "exit_map", None))
                if p is not None]
    if command in ("sweep", "calibrate", "calibrate-exit", "train-exit-head"):
        out = Path(args.out)  # a folder (or calibrate-exit's report); sweep --report-only writes there too
        world = os.environ.get("WORLD_SIZE", "1")
        if command in ("sweep", "calibrate") and world.isdigit() and int(world) > 1:
            # torchrun: the ranks of one job share the folder (each writes its own shard): one lock per rank
            return [out.with_name(f"{out.name}.rank{os.environ.get('RANK', '0')[:8]}")]
        return [out]
    return []


def lock_command_outputs(args):
    """`lock_outputs` over `command_outputs(args)`: the one lock the command line takes per run."""
    return lock_outputs(*command_outputs(args))


def lock_engine_folder(folder: str | Path):
    """The lock `python -m build_engines` should hold while it writes an engine folder (call it before
    exporting, around the whole build: `with lock_engine_folder(args.out): ...`)."""
    return lock_outputs(Path(folder))
