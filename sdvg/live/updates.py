"""What a live session is told and what it answers: `Update` (validated on construction, each error
naming the value and the fix), `UpdateAck` (the session block at which it takes effect), and the
prompt schedule of a batch run (`parse_schedule`), which is the list of updates in one format."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from pathlib import Path

from sdvg.bounded import quote
from sdvg.options import GenerationOptions, OptionError

# The router's options a live update may change (from the acknowledged block on), tau first.
ROUTER_FIELDS = ("tau", "router", "accept_prob", "pattern")


class UpdateError(ValueError):
    """An update has a value it cannot take; the session goes on unchanged."""


def check_prompt(prompt, where: str = "prompt") -> str:
    if not isinstance(prompt, str):
        raise UpdateError(f"{where} must be a string, got {type(prompt).__name__}; give a text prompt")
    if not prompt.strip():
        raise UpdateError(f"{where} is empty; give a non-empty text prompt")
    return prompt


def _check_int(name: str, value, low: int, high: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UpdateError(f"{name} must be an integer, got {quote(value)}; {fix}")
    if not low <= int(value) <= high:
        raise UpdateError(f"{name} {quote(int(value))} must lie in [{low}, {high}]; {fix}")
    return int(value)


def _as_option(name: str, value):
    """`value` checked and normalised by the option's own rule (sdvg/options.py), the one place each option's
    bounds live; its refusal, naming the value and the fix, becomes the update's."""
    # a router is checked by its own rule (its name); whether the pattern router has a pattern is checked against
    # the session's options, which the update may not repeat (sdvg/live/session.py)
    companion = {"pattern": "1"} if name == "router" else {}
    try:
        return getattr(GenerationOptions(**{name: value, **companion}), name)
    except (OptionError, TypeError, ValueError) as exc:
        raise UpdateError(str(exc)) from None


@dataclass(frozen=True)
class Update:
    """One change of a live session, taking effect at a block boundary (all fields optional, combinable;
    at least one given). `prompt` is blended in over `interp_blocks` blocks (None: the session's
    option); `seed` or `reset=True` restarts the video from its block 0 with fresh caches (the seed
    kept when not given); `tau` is the reward router's threshold from then on."""

    prompt: str | None = None
    interp_blocks: int | None = None
    seed: int | None = None
    reset: bool = False
    tau: float | None = None
    router: str | None = None
    accept_prob: float | None = None
    pattern: tuple | str | None = None

    def __post_init__(self) -> None:
        if self.prompt is not None:
            check_prompt(self.prompt)
        if self.interp_blocks is not None and self.prompt is None:
            raise UpdateError(f"interp_blocks {self.interp_blocks} given without a prompt; it sets how a new "
                              "prompt is blended in: pass prompt=... with it")
        if not isinstance(self.reset, bool):
            raise UpdateError(f"reset must be True or False, got {quote(self.reset)}")
        for name in ("interp_blocks", "seed", *ROUTER_FIELDS):  # each checked (and normalised) as the option is
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _as_option(name, value))
        if self.pattern is not None and not self.pattern:  # () is the options' "no pattern"; an update sets one
            raise UpdateError("pattern is empty: an update sets the pattern router's decisions from its block on; give "
                              "at least one (e.g. '0110'), or leave pattern out")
        # (whether the router options fit together, e.g. router 'pattern' with a pattern, the session checks
        # against its own: sdvg/live/session.py)
        if self.prompt is None and self.seed is None and not self.reset and not self.router_changes:
            raise UpdateError("an update changes nothing; give prompt=, seed=, reset=True, tau= or a router option "
                              "(router=, accept_prob=, pattern=)")

    @property
    def router_changes(self) -> dict:
        """The router options this update sets (tau and the others), by option name."""
        return {name: getattr(self, name) for name in ROUTER_FIELDS if getattr(self, name) is not None}

    @property
    def restarts(self) -> bool:
        return self.reset or self.seed is not None

    def as_entry(self, block: int) -> dict:
        """The update in the prompt-schedule format (`parse_schedule` reads it back)."""
        entry: dict = {"block": block}
        for name in ("prompt", "interp_blocks", "seed", *ROUTER_FIELDS):
            value = getattr(self, name)
            if value is not None:
                entry[name] = "".join("1" if x else "0" for x in value) if name == "pattern" else value
        if self.reset:
            entry["reset"] = True
        return entry


@dataclass(frozen=True)
class UpdateAck:
    """An update accepted: it takes effect at session block `block` (the first block whose drafting had
    not started when it arrived); `index` is its position in the session's update list. Input frames alone:
    `block` is the block that will read the first of them, `index` -1, `update` None."""

    block: int
    index: int  # -1: input frames only (not an entry of the update list)
    update: Update | None
    frames: int = 0  # input frames queued with it


_ENTRY_KEYS = ("block", "prompt", "interp_blocks", "seed", "reset", "tau", "router", "accept_prob", "pattern")


def parse_schedule(schedule) -> list[tuple[int, Update | str]]:
    """A prompt schedule -> [(block, first prompt)] + [(block, Update)], sorted by block (stable).

    `schedule` is a list of `(block, prompt)` pairs or of mappings with the keys `block` and any of
    `prompt`, `interp_blocks`, `seed`, `reset`, `tau`, `router`, `accept_prob`, `pattern` (a live
    session's `stats["live"]["updates"]`), or a path
    to a JSON/YAML file holding such a list. The first entry must be at block 0 with a prompt."""
    if isinstance(schedule, (str, Path)):
        schedule = _read_schedule_file(Path(schedule))
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise UpdateError(f"prompt_schedule must be a non-empty list of (block, prompt) pairs or "
                          f"{{block, prompt, interp_blocks}} entries, got {quote(schedule)}")
    entries = []
    for i, item in enumerate(schedule):
        where = f"prompt_schedule[{i}]"
        if isinstance(item, dict):
            unknown = sorted(quote(k, 40) for k in item if k not in _ENTRY_KEYS)
            if unknown:
                raise UpdateError(f"{where} has unknown keys {', '.join(unknown[:10])}; use {', '.join(_ENTRY_KEYS)}")
            if "block" not in item:
                raise UpdateError(f"{where} has no 'block'; give the block index the entry takes effect at")
            fields = {k: v for k, v in item.items() if k != "block"}
            block = item["block"]
        elif isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], Update):  # parsed already
            block, fields = item[0], {k: v for k, v in item[1].as_entry(0).items() if k != "block"}
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            block, fields = item[0], {"prompt": item[1]}
        else:
            raise UpdateError(f"{where} is {quote(item)}; give (block, prompt) or {{block: N, prompt: ...}}")
        block = _check_int(f"{where} block", block, 0, 2**62, "blocks count from 0")
        if "prompt" in fields:
            check_prompt(fields["prompt"], f"{where} prompt")
        entries.append((block, fields, where))
    entries.sort(key=lambda e: e[0])
    block0, first, where = entries[0]
    if block0 != 0 or "prompt" not in first:
        raise UpdateError(f"the schedule must start with a prompt at block 0 (its first entry is at block {block0}"
                          f"{'' if 'prompt' in first else ' without a prompt'}); add (0, 'your first prompt')")
    out: list = [(0, first["prompt"])]
    rest = {k: v for k, v in first.items() if k != "prompt"}
    if rest:
        raise UpdateError(f"{where}: the first entry sets the starting prompt only, got {sorted(rest)}; pass those "
                          "as options (seed=..., tau=...)")
    for block, fields, where in entries[1:]:
        try:
            out.append((block, Update(**fields)))
        except UpdateError as exc:
            raise UpdateError(f"{where}: {exc}") from None
    return out


def _read_schedule_file(path: Path) -> list:
    """A JSON or YAML list of entries, read as every config is (sdvg.bounded: a regular file of bounded size, UTF-8,
    no YAML aliases, bounded depth and node count; never unpickled, never executed)."""
    from sdvg.bounded import BoundedInputError, decode_utf8, load_json_text, load_yaml_text, read_bounded

    what = "prompt schedule file"
    try:
        text = decode_utf8(read_bounded(path, what), str(path), what)
        return load_json_text(text, str(path)) if path.suffix.lower() == ".json" else load_yaml_text(text, str(path))
    except BoundedInputError as exc:
        raise UpdateError(f"{exc}; give a JSON or YAML list of {{block, prompt, interp_blocks}} entries") from None


class ScheduledPrompt(str):
    """The first prompt of a schedule, carrying the schedule (`.schedule`, parsed): what the CLI's
    `--prompt-schedule FILE` passes where a prompt goes; `pipe.run` runs it as `prompt_schedule`."""

    schedule: list

    def __new__(cls, schedule) -> "ScheduledPrompt":
        parsed = parse_schedule(schedule)
        out = super().__new__(cls, parsed[0][1])
        out.schedule = parsed
        return out


def cli_prompt(args):
    """`sdvg generate`: the prompt to run: `--prompt`, or with `--prompt-schedule FILE` a `ScheduledPrompt`
    (refused together with --prompt / --prompts-file)."""
    path = getattr(args, "prompt_schedule", None)
    if path is None:
        return args.prompt
    if args.prompt is not None or getattr(args, "prompts_file", None) is not None:
        raise UpdateError("--prompt-schedule gives the prompts; drop --prompt / --prompts-file")
    return ScheduledPrompt(path)
