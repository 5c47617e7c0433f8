"""SIGTERM and SIGHUP follow Ctrl-C's path: each raises `Interrupted` (a KeyboardInterrupt) in the main
thread, so the video being written is closed and its statistics are marked interrupted. Exit statuses
follow the shell's convention, 128 + the signal: 130 (SIGINT), 143 (SIGTERM), 129 (SIGHUP)."""
from __future__ import annotations

import contextlib
import signal
import threading

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def exit_code_of(exc: BaseException) -> int:
    """130 for a plain KeyboardInterrupt (Ctrl-C), 128 + signal for an `Interrupted`."""
    return exc.exit_code if isinstance(exc, Interrupted) else 128 + signal.SIGINT


@contextlib.contextmanager
def signals_interrupt(received: list | None = None):
    """Within the block, SIGINT, SIGTERM and SIGHUP raise `Interrupted` (main thread only; elsewhere a no-op). Each
    signal is also appended to `received`: an interruption that lands inside C code (an import: numpy's turns it
    into an ImportError) reaches the caller as another error, and the caller can still tell it was a signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupted(signum, frame):
        if received is not None:
            received.append(signum)
        raise Interrupted(signum)

    old = {s: signal.signal(s, raise_interrupted) for s in HANDLED}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def shielded():
    """Within the block (closing files after an interruption), SIGINT / SIGTERM / SIGHUP are recorded in
    the yielded list instead of raised, so a second Ctrl-C cannot leave a half-written file."""
    pending: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return
    old = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in HANDLED}
    try:
        yield pending
    finally:
        for s, h in old.items():
            signal.signal(s, h)
