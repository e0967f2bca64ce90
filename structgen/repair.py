"""Field-level repair, the API's half: `llm.generate(Model, prompt, repair=N)`.

`FieldRepair` is a request's output validator (engine/repair.py calls it where the request
would finish, before its KV slot is released). It validates the output as the caller will; where
a validator rejects it, it finds the field the error points at (pydantic's `loc`; a model
validator's error points at its object, and rolls back to the first of the object's fields its
message names, or to the whole object) and answers a `Rewind` to the token where that field's
value starts. The engine decodes that field again under the grammar, off the rejected text;
the fields before it are kept token for token, and the answer is never regenerated whole. Each
field is repaired at most N times; every attempt is kept for the error when repair fails.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from structgen.engine.repair import Rewind
from structgen.errors import OutputValidationError
from structgen.partial import JsonStreamParser, Path

if TYPE_CHECKING:
    from structgen.engine.request import Request
    from structgen.types import Constraint


@dataclass(frozen=True)
class RepairAttempt:
    """One output the validator rejected: its text, the error, and the field rolled back to
    (`()`: the whole output)."""

    text: str
    error: str
    field: Path


class FieldRepair:
    """The validator of one request: `repair(req)` is None where the output validates (its
    value is kept in `value`) or may not be repaired again, else where to rewind it to.
    `tokens`: every token id's bytes (the output's text is their concatenation)."""

    def __init__(self, constraint: Constraint, tokens: tuple[bytes, ...], max_repairs: int):
        self.constraint = constraint
        self.tokens = tokens
        self.max_repairs = max_repairs
        self.attempts: list[RepairAttempt] = []
        self.repairs: Counter[Path] = Counter()
        self.value: tuple[str, Any] | None = None  # (text, value) of the last output that validated

    def __call__(self, req: Request) -> Rewind | None:
        ids = req.answer_ids  # the think section, if any, is not the value's text
        data = b"".join(self.tokens[t] for t in ids)
        text = data.decode("utf-8", errors="replace")
        try:
            self.value = (text, self.constraint.parse(text))
            return None
        except OutputValidationError as error:
            spans = value_spans(text)
            field = failing_field(error, spans) if spans else ()
            forced = any(a.text == text for a in self.attempts)  # the grammar left no other value
            self.attempts.append(RepairAttempt(text, str(error), field))
            if not spans or forced or self.repairs[field] >= self.max_repairs:
                return None
            self.repairs[field] += 1
            return _rewind(text, spans[field], ids, self.tokens)

    def exhausted(self, error: OutputValidationError, stats: Any) -> OutputValidationError:
        """The error to raise where repair gave up: `error`, naming the field and carrying
        every attempt and the request's `stats`."""
        if not self.attempts:
            error.stats = stats
            return error
        field = ".".join(map(str, self.attempts[-1].field)) or "the whole output"
        return OutputValidationError(
            f"{error} (repair={self.max_repairs}: {field} was decoded again {self.repairs[self.attempts[-1].field]} "
            f"time(s) and {len(self.attempts)} output(s) failed, see .attempts; raise repair, or relax the "
            "validator)", text=error.text, attempts=self.attempts, stats=stats)


def value_spans(text: str) -> dict[Path, tuple[int, int]] | None:
    """Every JSON value of `text` by path: its (start, end) character offsets; None where
    `text` is not JSON."""
    parser = JsonStreamParser()
    try:
        events = parser.feed(text) + parser.finish()
    except OutputValidationError:
        return None
    return {e.path: (e.start, e.end) for e in events if e.kind == "done"}


def failing_field(error: OutputValidationError, spans: dict[Path, tuple[int, int]]) -> Path:
    """The field to decode again: of the fields pydantic's errors point at, the first in the
    text (rolling back to it redoes the later ones too); the whole output where the error
    names none."""
    cause = error.__cause__
    details = cause.errors() if callable(getattr(cause, "errors", None)) else [{"loc": (), "msg": str(error)}]
    fields = [_field_of(tuple(d.get("loc", ())), str(d.get("msg", "")), spans) for d in details]
    return min(fields, key=lambda f: spans[f][0]) if fields else ()


def _field_of(loc: tuple[Any, ...], message: str, spans: dict[Path, tuple[int, int]]) -> Path:
    """The deepest value of the output on `loc` (parts that are no key or index of it, such as
    a union member's name, are passed over). An error on an object (a model validator) goes to
    the first of its members whose name its message says, if any."""
    path: Path = ()
    for part in loc:
        if (*path, part) in spans:
            path = (*path, part)
    named = [p for p in spans if len(p) == len(path) + 1 and p[:-1] == path and isinstance(p[-1], str)
             and re.search(rf"(?<!\w){re.escape(p[-1])}(?!\w)", message)]
    return min(named, key=lambda p: spans[p][0]) if named else path


def _rewind(text: str, span: tuple[int, int], ids: list[int], tokens: tuple[bytes, ...]) -> Rewind:
    """Back to the token where the value at `span` starts (inside a string: its first
    character); the rejected text runs from there to the value's end (a number's with the
    character after it, so that a longer number is not rejected with it)."""
    start, end = span
    first = start + 1 if text[start] == '"' else start
    if text[start] in "-0123456789":
        end = min(end + 1, len(text))
    at, stop = len(text[:first].encode()), len(text[:end].encode())
    keep, written = 0, 0
    while keep < len(ids) and written + len(tokens[ids[keep]]) <= at:
        written += len(tokens[ids[keep]])
        keep += 1
    return Rewind(keep, text.encode()[written:stop])


__all__ = ["FieldRepair", "RepairAttempt", "failing_field", "value_spans"]
