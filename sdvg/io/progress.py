"""Progress bars (tqdm) on stderr, drawn only where something can redraw them: a terminal, or a notebook's widget
for the Python API. Written to a file or a pipe (a log, CI, `docker logs`), a bar would fill it with carriage
returns and cursor-movement escapes, so it is off there; `show=False` (--quiet, disable=True) turns it off
everywhere, `show=True` with `force=True` (a caller's explicit disable=False) draws it anyway."""
from __future__ import annotations

import sys


def in_notebook() -> bool:
    """A Jupyter kernel: tqdm.auto draws its widget there (stderr is no terminal, but the bar is wanted)."""
    shell = sys.modules.get("IPython")
    try:
        return shell is not None and type(shell.get_ipython()).__name__ == "ZMQInteractiveShell"
    except Exception:  # noqa: BLE001 (an IPython without a running shell)
        return False


def draws(stream=None) -> bool:
    """Whether a bar on `stream` (default stderr) can be redrawn in place."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty()) or in_notebook()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress_bar(total: int, *, show: bool = True, force: bool = False, auto: bool = False, **kw):
    """A tqdm bar of `total` steps on stderr: off unless `show`, and off where it cannot be redrawn unless `force`.
    `auto`: tqdm.auto (the notebook widget in Jupyter; the API's bar)."""
    if auto:
        from tqdm.auto import tqdm
    else:
        from tqdm import tqdm
    stream = kw.pop("file", sys.stderr)
    return tqdm(total=total, file=stream, disable=not show or not (force or draws(stream)), **kw)
