"""Prompts from text: a prompts file read as UTF-8 lines (a BOM dropped; `\\r\\n`, `\\r` and `\\n` line ends all
ending a line; invalid UTF-8 refused naming the line), and every prompt checked to be a valid string before
it reaches a tokenizer (no lone surrogates from an undecodable command line, no NUL, not blank)."""
from __future__ import annotations

from pathlib import Path

from sdvg.bounded import BoundedInputError, decode_utf8, quote, read_bounded

MAX_PROMPTS_BYTES = 64 << 20  # a prompts file: MovieGenVideoBench's 1003 prompts take 250 KB
MAX_PROMPT_CHARS = 100_000  # one prompt (the text encoder reads 512 tokens of it)


class PromptError(ValueError):
    """A prompt or a prompts file cannot be used; the message names the place and the fix."""


def check_prompt(text, where: str = "--prompt") -> str:
    """`text` if it is a prompt a tokenizer can take: a non-blank str, encodable as UTF-8 (a command line in
    another encoding gives lone surrogates), without NUL, at most MAX_PROMPT_CHARS characters."""
    if not isinstance(text, str):
        raise PromptError(f"{where}: a prompt must be text, got {type(text).__name__} {quote(text)}")
    if not text.strip():
        raise PromptError(f"{where} is empty; give a non-empty prompt")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(f"{where} is not valid UTF-8 text (character {exc.start + 1} cannot be encoded: the "
                          "terminal or file is in another encoding); give the prompt as UTF-8") from None
    if "\x00" in text:
        raise PromptError(f"{where} holds a NUL character (at {text.index(chr(0)) + 1}); remove it")
    if len(text) > MAX_PROMPT_CHARS:
        raise PromptError(f"{where} has {len(text)} characters, more than {MAX_PROMPT_CHARS}; shorten it")
    return text


def split_lines(text: str) -> list[str]:
    """Lines of `text` ended by `\\r\\n`, `\\r` or `\\n` (only these: a form feed or a Unicode line separator is
    part of a prompt); a final line end adds no empty line."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line, UTF-8 (a BOM dropped); blank lines are an error (they would shift prompt
    indices); invalid UTF-8 is refused naming its line and column."""
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"prompts file {path} is not a file; give a text file with one prompt per line")
    try:
        text = decode_utf8(read_bounded(path, "prompts file", MAX_PROMPTS_BYTES), str(path), "prompts file")
    except BoundedInputError as exc:
        raise PromptError(str(exc)) from None
    lines = split_lines(text)
    blank = [i + 1 for i, line in enumerate(lines) if not line.strip()]
    if blank:
        raise PromptError(f"prompts file {path} has blank lines at {blank[:10]}; remove them")
    if not lines:
        raise PromptError(f"prompts file {path} holds no prompt")
    for i, line in enumerate(lines):
        check_prompt(line, f"prompts file {path} line {i + 1}")
    return lines
