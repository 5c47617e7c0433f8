"""Bounded parsing of small structured inputs (config files, metadata JSON): size and depth limits, YAML
aliases and anchors refused (no billion-laughs expansion), duplicate keys refused (no silent last-wins),
and error messages that quote only a bounded prefix of a value. Torch-free.

`quote(value)` is what every message about an untrusted value should use: its text is at most a few
dozen characters whatever the value (a 1 GB string, a 10,000-digit integer, a deep list)."""
from __future__ import annotations

import json
import reprlib

MAX_CONFIG_BYTES = 1 << 20  # a config or metadata blob: 1 MiB is far above any real one
MAX_DEPTH = 32  # nesting of mappings and lists
MAX_NODES = 100_000  # scalars, mappings and lists in all


class BoundedInputError(ValueError):
    """A structured input breaks a bound or a rule (alias, duplicate key, size, depth); the message names the
    source, the place and the fix."""


_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxlevel = 3
_REPR.maxlong = 40


def quote(value, limit: int = 60) -> str:
    """A bounded repr of `value`: strings cut to `limit` characters (with their full length named), big
    integers, long lists and deep nests shortened."""
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return repr(value[:limit]) + f"... ({len(value)} characters)"
    if isinstance(value, (bytes, bytearray)):  # reprlib would repr the whole of it before cutting
        if len(value) <= limit:
            return repr(value)
        return repr(bytes(value[:limit])) + f"... ({len(value)} bytes)"
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        try:
            return _REPR.repr(value)
        except ValueError:  # more digits than Python converts to text
            return f"<an integer of about {int(value.bit_length() * 0.30103)} digits>"
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 (a value whose repr fails is still named)
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 4 * limit else text[:4 * limit] + "..."


def decode_utf8(raw: bytes, source: str, what: str = "file") -> str:
    """`raw` as UTF-8 text, a leading BOM dropped; invalid UTF-8 refused naming the line and column."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise BoundedInputError(f"{what} {source} is not valid UTF-8 (line {line}, column {col}: byte "
                                f"0x{raw[exc.start]:02x}); re-save it as UTF-8") from None


def read_bounded(path, what: str = "file", max_bytes: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a regular file of at most `max_bytes` (read no further than that)."""
    import os
    import stat
    from pathlib import Path

    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO cannot block us
    except FileNotFoundError:
        raise BoundedInputError(f"{what} {path} not found") from None
    except OSError as exc:
        raise BoundedInputError(f"{what} {path} cannot be read ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BoundedInputError(f"{what} {path} is not a regular file; give a file")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        raise BoundedInputError(f"{what} {path} is larger than {max_bytes} bytes; a {what} is small text, give the "
                                "right file")
    return raw


def _check_tree(value, source: str, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> None:
    """Depth and node count of parsed data, iteratively (no recursion to exhaust)."""
    stack, nodes = [(value, 1)], 0
    while stack:
        v, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise BoundedInputError(f"{source} holds more than {max_nodes} values; a config is small")
        if isinstance(v, (dict, list, tuple)):
            if depth > max_depth:
                raise BoundedInputError(f"{source} nests deeper than {max_depth} levels")
            items = v.values() if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)


def _yaml_loader():
    import yaml

    class BoundedSafeLoader(yaml.SafeLoader):
        """yaml's SafeLoader (plain data only) that refuses aliases and anchors (so a few hundred bytes
        cannot expand to gigabytes), duplicate keys, and nesting or node counts beyond the bounds."""

        def __init__(self, stream):
            super().__init__(stream)
            self._depth = 0
            self._nodes = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise BoundedInputError(f"YAML alias *{quote(event.anchor, 40)} at line {event.start_mark.line + 1}: "
                                        "anchors and aliases are not read (write the value out)")
            event = self.peek_event()
            if getattr(event, "anchor", None) is not None:
                raise BoundedInputError(f"YAML anchor &{quote(event.anchor, 40)} at line {event.start_mark.line + 1}: "
                                        "anchors and aliases are not read (write the value out)")
            self._nodes += 1
            if self._nodes > MAX_NODES:
                raise BoundedInputError(f"YAML holds more than {MAX_NODES} values; a config is small")
            self._depth += 1
            try:
                if self._depth > MAX_DEPTH:
                    raise BoundedInputError(f"YAML nests deeper than {MAX_DEPTH} levels (line "
                                            f"{event.start_mark.line + 1})")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    raise BoundedInputError(f"YAML key at line {key_node.start_mark.line + 1} is not a plain value")
                if key in seen:
                    raise BoundedInputError(f"YAML key {quote(key, 40)} appears twice (lines {seen[key]} and "
                                            f"{key_node.start_mark.line + 1}); keep one")
                seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep)

    return BoundedSafeLoader


def load_yaml_text(text: str, source: str):
    """Parse YAML `text` (from `source`, named in errors) within the bounds."""
    import yaml

    if len(text) > MAX_CONFIG_BYTES:
        raise BoundedInputError(f"{source} is larger than {MAX_CONFIG_BYTES} bytes; a config is small text")
    loader = None
    try:  # the loader too: its reader refuses a character YAML does not allow (a NUL byte) as it is built
        loader = _yaml_loader()(text)
        data = loader.get_single_data()
    except BoundedInputError as exc:
        raise BoundedInputError(f"{source}: {exc}") from None
    except yaml.reader.ReaderError as exc:
        raise BoundedInputError(_unreadable_character(text, exc, source)) from None
    except yaml.YAMLError as exc:
        raise BoundedInputError(f"{source} is not valid YAML: {_bounded_text(str(exc))}") from None
    except (ValueError, RecursionError, OverflowError) as exc:  # e.g. an integer of too many digits
        raise BoundedInputError(f"{source}: a value cannot be read ({_bounded_text(str(exc))})") from None
    finally:
        if loader is not None:
            loader.dispose()
    _check_tree(data, source)
    return data


def _unreadable_character(text: str, exc, source: str) -> str:
    """yaml's ReaderError (a character YAML does not allow: NUL, other control characters) as a message naming
    the source, the character's code and its line and column."""
    pos = exc.position if isinstance(exc.position, int) and 0 <= exc.position <= len(text) else None
    code = exc.character if isinstance(exc.character, int) else None
    what = "a character" if code is None else "a NUL byte (0x00)" if code == 0 else f"the character U+{code:04X}"
    if pos is not None:
        line = text.count("\n", 0, pos) + 1
        what += f" at line {line}, column {pos - (text.rfind(chr(10), 0, pos) + 1) + 1}"
    return (f"{source} holds {what}, which YAML does not allow; a config is plain text: remove it (or re-save the "
            "file as UTF-8 text)")


def _refuse_duplicates(source: str):
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise BoundedInputError(f"{source}: JSON key {quote(k, 40)} appears twice; keep one")
            out[k] = v
        return out
    return hook


def load_json_text(text: str, source: str, max_bytes: int = MAX_CONFIG_BYTES):
    """Parse JSON `text` within the bounds: size, depth, node count, duplicate keys refused; NaN and
    infinities are read as Python floats (callers check ranges)."""
    if len(text) > max_bytes:
        raise BoundedInputError(f"{source} is larger than {max_bytes} bytes")
    depth, in_string, escaped = 0, False, False
    for ch in text:  # a pre-check (strings skipped) so the parser's recursion cannot be exhausted
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise BoundedInputError(f"{source} nests deeper than {MAX_DEPTH} levels")
        elif ch in "]}":
            depth -= 1
    try:
        data = json.loads(text, object_pairs_hook=_refuse_duplicates(source))
    except BoundedInputError:
        raise
    except json.JSONDecodeError as exc:
        raise BoundedInputError(f"{source} is not valid JSON: {_bounded_text(str(exc))}") from None
    except (ValueError, RecursionError) as exc:
        raise BoundedInputError(f"{source}: a value cannot be read ({_bounded_text(str(exc))})") from None
    _check_tree(data, source)
    return data


def _bounded_text(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
