"""What is asked of the generation worker, one frozen dataclass per command. A socket, a download or an input
reader queues one on its session (`SessionManager.command`); the worker applies it between two blocks
(`SessionManager._apply` dispatches on the type). Pause / resume and a socket's close are not commands: they take
effect at once, under the manager's lock (`SessionManager.pause`, `SessionManager.release`)."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

from sdvg.serve.engine import SessionSpec


@dataclass(frozen=True, slots=True)
class Start:
    """(Re)start the session's generation as run `run` (an admission, a reset, a promotion from the queue)."""
    run: int
    spec: SessionSpec


@dataclass(frozen=True, slots=True)
class InputRead:
    """The uploaded input video of run `run`, read off the worker: its frames, or why it could not be read."""
    run: int
    spec: SessionSpec
    clip: Any  # the frames as `Engine.read_input` returns them, or the Exception it raised


@dataclass(frozen=True, slots=True)
class LiveUpdate:
    """A live update (`Engine.update(generation, **changes)`), acked to an sdvg client naming `field` (a webcam
    frame's `image` is not acked)."""
    changes: dict
    field: str
    request_id: Any = None


@dataclass(frozen=True, slots=True)
class EndRun:
    """End the run now (a pause past --max-pause-s): `why` is told to the client; the socket stays open."""
    why: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A download of the run being written: the worker cuts its video between two blocks and sets `future` to the
    finished segments' hard links (cancelled when the run will not be stepped again)."""
    future: concurrent.futures.Future


Command = Start | InputRead | LiveUpdate | EndRun | Snapshot
