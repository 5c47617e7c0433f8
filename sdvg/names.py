"""Names a person types (presets, flags, commands): the close matches offered when one is misspelt."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """" (did you mean 'x'?)" (or "'x' or 'y'") for the choices close to `word`, or "" when none is."""
    close = difflib.get_close_matches(word, list(choices), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
