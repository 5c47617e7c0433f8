"""Prompt files that ship with sdvg, by name: `--prompts-file moviegen` works from any directory, inside the
clone or not (`sdvg/data/MovieGenVideoBench.txt` resolves only inside the clone).

    python -c "from sdvg.io.prompts import prompts_file; print(prompts_file('moviegen'))"   # its path
"""
from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"  # sdvg/data, installed with the package
BUILTIN_PROMPTS = {"moviegen": DATA / "MovieGenVideoBench.txt"}  # name -> the packaged file
ALIASES = {"moviegenvideobench": "moviegen", "moviegenvideobench.txt": "moviegen"}


def prompts_file(value: str | Path | None) -> Path | None:
    """A prompts-file argument as a path: an existing file as given (it always wins), else a built-in name
    (`moviegen`, also `MovieGenVideoBench[.txt]`, any case) as the packaged file; anything else unchanged
    (the reader then reports it missing). None stays None."""
    if value is None:
        return None
    path = Path(value)
    if path.exists():
        return path
    name = str(value).strip().lower()
    name = ALIASES.get(name, name)
    return BUILTIN_PROMPTS.get(name, path)


def with_prompts_file_resolved(args):
    """The parsed command line with its `--prompts-file` (where the subcommand has one) resolved by
    `prompts_file`; returns `args`."""
    if getattr(args, "prompts_file", None) is not None:
        args.prompts_file = str(prompts_file(args.prompts_file))
    return args
