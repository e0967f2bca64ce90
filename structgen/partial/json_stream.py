"""An incremental JSON parser: text arrives in chunks (one per decoded token), each character
is read once, and `feed` says which values opened and which finished, with their paths and
their offsets in the whole text.

It keeps no copy of the text and builds no values: the partial-object tracker
(`structgen/partial.py`) reads a finished value's text and validates it. The one thing it
decodes is the string value still open (`open_string`), escapes included, since a
half-written string cannot be handed to a JSON reader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from structgen.errors import OutputValidationError

Path = tuple[str | int, ...]

# states of the reader between two characters
_VALUE, _FIRST_ITEM, _FIRST_KEY, _KEY, _COLON, _AFTER, _END = range(7)
_STRING, _ESCAPE, _UNICODE, _NUMBER, _LITERAL = range(7, 12)

_WHITESPACE = " \t\n\r"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_STRING_STOP = re.compile(r'["\\]')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"t": "true", "f": "false", "n": "null"}


@dataclass(frozen=True)
class JsonEvent:
    """A value opened (`kind="open"`, containers only) or finished (`kind="done"`, any value)
    at `path`; `start`/`end` are its offsets in the whole text (`end` is -1 while open)."""

    kind: Literal["open", "done"]
    path: Path
    start: int
    end: int = -1
    container: Literal["object", "array", ""] = ""


@dataclass
class _Container:
    """An open object or array: where it is, where it began, its items so far and, in an
    object, the key of the member being read."""

    kind: Literal["object", "array"]
    path: Path
    start: int
    items: int = 0
    key: str = ""


@dataclass
class _OpenString:
    """The string being read: decoded pieces, whether it is an object key, and the escape
    sequence not yet complete (it may be split across chunks)."""

    is_key: bool
    pieces: list[str] = field(default_factory=list)
    escape: str = ""
    high_surrogate: str = ""  # a \\uD800-\\uDBFF held back until the low half after it

    def add(self, text: str) -> None:
        if self.high_surrogate:
            self.pieces.append(self.high_surrogate)
            self.high_surrogate = ""
        self.pieces.append(text)

    def add_code_unit(self, unit: int) -> None:
        if 0xDC00 <= unit <= 0xDFFF and self.high_surrogate:
            high = ord(self.high_surrogate)
            self.high_surrogate = ""
            self.pieces.append(chr(0x10000 + ((high - 0xD800) << 10) + (unit - 0xDC00)))
        elif 0xD800 <= unit <= 0xDBFF:
            self.add("")
            self.high_surrogate = chr(unit)
        else:
            self.add(chr(unit))

    def text(self) -> str:
        if len(self.pieces) > 1:  # joined once, so reading it every token stays linear
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""


class JsonStreamParser:
    """Reads one JSON value from chunks of text. `feed(chunk)` returns the events the chunk
    completed; `finish()` ends the text (a number at the root ends only there). Text that is
    not JSON raises `OutputValidationError` at the first character that cannot continue it."""

    def __init__(self) -> None:
        self.offset = 0  # characters read before the current chunk
        self.state = _VALUE
        self.stack: list[_Container] = []
        self.string: _OpenString | None = None
        self.value_path: Path = ()  # path of the scalar being read
        self.value_start = 0
        self.literal = ""  # the rest of true/false/null still expected
        self._events: list[JsonEvent] = []

    # -- what is open ---------------------------------------------------------------------
    @property
    def open_string_path(self) -> Path | None:
        """The path of the string value being read (None when none is, or it is a key)."""
        if self.string is None or self.string.is_key:
            return None
        return self.value_path

    @property
    def open_string(self) -> str:
        """The decoded text so far of the string value being read ("" when none is)."""
        return self.string.text() if self.string is not None and not self.string.is_key else ""

    @property
    def open_path(self) -> Path | None:
        """The innermost value still open (a scalar being read, else a container); None
        before the value starts and once it has ended."""
        if self.state in (_STRING, _ESCAPE, _UNICODE, _NUMBER, _LITERAL) and not self._reading_key():
            return self.value_path
        return self.stack[-1].path if self.stack else None

    @property
    def done(self) -> bool:
        return self.state == _END

    def _reading_key(self) -> bool:
        return self.string is not None and self.string.is_key

    # -- reading --------------------------------------------------------------------------
    def feed(self, chunk: str) -> list[JsonEvent]:
        """Read `chunk`; the events it completed, in text order."""
        self._events = []
        i, n = 0, len(chunk)
        while i < n:
            i = self._step(chunk, i)
        self.offset += n
        return self._events

    def finish(self) -> list[JsonEvent]:
        """The end of the text: a number still being read ends here; anything else still
        open means the text was cut off (`OutputValidationError`)."""
        self._events = []
        if self.state == _NUMBER:
            self._scalar_done(self.offset)
        if self.state != _END:
            raise OutputValidationError(
                f"the output ended at character {self.offset} before its JSON value was complete; "
                "raise max_tokens", text=""
            )
        return self._events

    def _step(self, chunk: str, i: int) -> int:
        """Read from `chunk[i]` on; the index of the first character not read."""
        state = self.state
        if state == _STRING:
            return self._read_string(chunk, i)
        if state in (_ESCAPE, _UNICODE):
            return self._read_escape(chunk, i)
        if state == _NUMBER:
            return self._read_number(chunk, i)
        if state == _LITERAL:
            return self._read_literal(chunk, i)
        c = chunk[i]
        if c in _WHITESPACE:
            return i + 1
        if state == _VALUE or (state == _FIRST_ITEM and c != "]"):
            return self._begin_value(c, i)
        if state in (_FIRST_KEY, _KEY) and c == '"':
            self.string, self.state = _OpenString(is_key=True), _STRING
            return i + 1
        if state == _COLON and c == ":":
            self.state = _VALUE
            return i + 1
        if state in (_AFTER, _FIRST_ITEM, _FIRST_KEY) and self.stack:
            return self._after_member(c, i)
        return self._unexpected(c, i)

    def _begin_value(self, c: str, i: int) -> int:
        at = self.offset + i
        path = self._child_path()
        if c in "{[":
            kind: Literal["object", "array"] = "object" if c == "{" else "array"
            self.stack.append(_Container(kind, path, at))
            self.state = _FIRST_KEY if c == "{" else _FIRST_ITEM
            self._events.append(JsonEvent("open", path, at, container=kind))
            return i + 1
        self.value_path, self.value_start = path, at
        if c == '"':
            self.string, self.state = _OpenString(is_key=False), _STRING
            return i + 1
        if c == "-" or c.isdigit():
            self.state = _NUMBER
            return i + 1
        if c in _LITERALS:
            self.literal, self.state = _LITERALS[c][1:], _LITERAL
            return i + 1
        return self._unexpected(c, i)

    def _child_path(self) -> Path:
        if not self.stack:
            return ()
        top = self.stack[-1]
        return (*top.path, top.key if top.kind == "object" else top.items)

    def _after_member(self, c: str, i: int) -> int:
        """`,` or the closing bracket after a member (or right after the opening one)."""
        top = self.stack[-1]
        if c == "," and self.state == _AFTER:
            self.state = _KEY if top.kind == "object" else _VALUE
            return i + 1
        if c == ("}" if top.kind == "object" else "]"):
            self.stack.pop()
            self._events.append(JsonEvent("done", top.path, top.start, self.offset + i + 1))
            self._value_ended()
            return i + 1
        return self._unexpected(c, i)

    def _read_string(self, chunk: str, i: int) -> int:
        string = self.string
        assert string is not None
        stop = _STRING_STOP.search(chunk, i)
        j = stop.start() if stop else len(chunk)
        if j > i:
            string.add(chunk[i:j])
        if stop is None:
            return j
        if chunk[j] == "\\":
            self.state = _ESCAPE
            return j + 1
        string.add("")  # a high surrogate with no low half ends as itself, as json.loads reads it
        if string.is_key:
            self.stack[-1].key = string.text()
            self.string, self.state = None, _COLON
        else:
            self.string = None
            self._scalar_done(self.offset + j + 1)
        return j + 1

    def _read_escape(self, chunk: str, i: int) -> int:
        string = self.string
        assert string is not None
        c = chunk[i]
        if self.state == _ESCAPE:
            if c == "u":
                self.state = _UNICODE
            elif c in _ESCAPES:
                string.add(_ESCAPES[c])
                self.state = _STRING
            else:
                return self._unexpected(c, i)
            return i + 1
        if c not in "0123456789abcdefABCDEF":
            return self._unexpected(c, i)
        string.escape += c
        if len(string.escape) == 4:
            string.add_code_unit(int(string.escape, 16))
            string.escape, self.state = "", _STRING
        return i + 1

    def _read_number(self, chunk: str, i: int) -> int:
        j = i
        while j < len(chunk) and chunk[j] in _NUMBER_CHARS:
            j += 1
        if j < len(chunk):  # the first character after the number ends it, and is read next
            self._scalar_done(self.offset + j)
        return j

    def _read_literal(self, chunk: str, i: int) -> int:
        c = chunk[i]
        if c != self.literal[0]:
            return self._unexpected(c, i)
        self.literal = self.literal[1:]
        if not self.literal:
            self._scalar_done(self.offset + i + 1)
        return i + 1

    def _scalar_done(self, end: int) -> None:
        self._events.append(JsonEvent("done", self.value_path, self.value_start, end))
        self._value_ended()

    def _value_ended(self) -> None:
        if not self.stack:
            self.state = _END
            return
        if self.stack[-1].kind == "array":
            self.stack[-1].items += 1
        self.state = _AFTER

    def _unexpected(self, c: str, i: int) -> int:
        where = self.offset + i
        raise OutputValidationError(
            f"the output is not JSON: {c!r} at character {where} cannot continue it, so no partial "
            "object can be built; stream without partial=True, or ask a server that enforces the "
            "JSON schema",
            text="",
        )
