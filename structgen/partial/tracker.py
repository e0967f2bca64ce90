"""Text deltas of a JSON output -> `Partial` snapshots of its typed value.

The incremental parser (json_stream.py) says which values finished; each is validated once, by
the type of its place (shapes.py), from its own text, and kept; the snapshot is rebuilt only
along the path of the values still open, sharing every finished value. A value that fails its
type stays out of the snapshots (the final parse raises for it)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import pydantic

from structgen.partial.json_stream import JsonEvent, JsonStreamParser, Path
from structgen.partial.shapes import Children, Shape

T = TypeVar("T")


@dataclass(frozen=True)
class Partial(Generic[T]):
    """One snapshot of an output being generated.

    value: the output so far, of the output type's own class: a model built with only its
        finished fields (`model_fields_set` names them), a dataclass with only those set, a
        dict of the finished keys (TypedDicts, dicts, JSON schemas), a list of the finished
        items. Finished values are validated; an open string field shows its text so far; an
        open number, enum, Literal or list item is absent until it is complete.
    finished: the paths of the values that finished since the previous snapshot and are now
        in `value`, in the order they were written (a path is a tuple of keys and list
        indices; () is the root). A list item's own members are not named: the item is, once
        it is finished.
    path: the innermost value still open (None once the output is complete).
    done: True on the last snapshot, whose `value` is the final validated value.
    delta: the text that arrived since the previous snapshot.
    """

    value: T
    finished: tuple[Path, ...]
    path: Path | None
    done: bool
    delta: str


@dataclass
class _OpenContainer:
    """A container being written: the shape of its place, where it is, its finished members."""

    shape: Shape
    path: Path
    kind: Literal["object", "array"]
    children: Children
    shown: Any = None  # an array as last shown: it changes only when an item finishes


@dataclass
class _TextLog:
    """The whole text as its chunks, so a finished value's text is joined from the chunks it
    spans alone."""

    chunks: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    length: int = 0

    def append(self, chunk: str) -> None:
        if chunk:
            self.chunks.append(chunk)
            self.starts.append(self.length)
            self.length += len(chunk)

    def slice(self, start: int, end: int) -> str:
        first = bisect.bisect_right(self.starts, start) - 1
        last = bisect.bisect_left(self.starts, end)
        text = "".join(self.chunks[first:last])
        offset = self.starts[first]
        return text[start - offset : end - offset]


class PartialTracker(Generic[T]):
    """Feed it the text deltas of one JSON output (`feed`), then the final value (`finish`)."""

    def __init__(self, root: Shape):
        self.root = root
        self.parser = JsonStreamParser()
        self.text = _TextLog()
        self.open: list[_OpenContainer] = []
        self.shown_depth = 0  # see _set_open
        self.value: Any = None  # the root, once finished
        self.last_path: Path | None = None  # the open path of the last snapshot
        self.unsent = ""  # text read since the last snapshot

    def feed(self, delta: str) -> Partial[T] | None:
        """The snapshot after `delta`; None while nothing visible changed (whitespace, a
        digit of an open number, text of a value not shown)."""
        self.text.append(delta)
        events = self.parser.feed(delta)
        finished = tuple(path for path in map(self._apply, events) if path is not None)
        shown_text = bool(delta) and self._open_text_shape() is not None
        path = self.parser.open_path
        moved, self.last_path = path != self.last_path, path
        self.unsent += delta
        if not events and not shown_text and not moved:
            return None
        sent, self.unsent = self.unsent, ""
        return Partial(self._snapshot(), finished, path, False, sent)

    def finish(self, value: T, delta: str = "") -> Partial[T]:
        """The last snapshot: the final, validated `value` (from `Completion.value`)."""
        self.text.append(delta)
        events = self.parser.feed(delta) + self.parser.finish() if not self.parser.done else []
        finished = tuple(path for path in map(self._apply, events) if path is not None)
        sent, self.unsent = self.unsent + delta, ""
        return Partial(value, finished, None, True, sent)

    def _apply(self, event: JsonEvent) -> Path | None:
        """Follow one event; the path of a value that finished valid and is shown, else None."""
        members = None
        closing = event.kind == "done" and self.open and self.open[-1].path == event.path
        if closing:
            container = self.open.pop()
            shape, members = container.shape, container.children
            self._set_open()
        parent = self.open[-1] if self.open else None
        if not closing:
            shape = parent.shape.child(event.path[-1]) if parent is not None else self.root
        if event.kind == "open":
            children: Children = {} if event.container == "object" else []
            self.open.append(_OpenContainer(shape, event.path, event.container or "object", children))
            self._set_open()
            return None
        hidden = self.shown_depth < len(self.open)  # inside a list item still open
        if hidden and self.open[self.shown_depth].shape.adapter is not None:
            return None  # that item is validated from its own text once it finishes
        try:
            value = shape.read(self.text.slice(event.start, event.end), members)
        except (pydantic.ValidationError, ValueError):
            return None
        if parent is None:
            self.value = value
        elif isinstance(parent.children, dict):
            parent.children[str(event.path[-1])] = value
        else:
            parent.children.append(value)
            parent.shown = None
        return None if hidden else event.path

    def _open_text_shape(self) -> Shape | None:
        """The shape of the open string value, if there is one and its place shows text."""
        path = self.parser.open_string_path
        if path is None:
            return None
        if not self.open:
            return self.root if self.root.shows_text else None
        if self.shown_depth < len(self.open):  # in a list item still open
            return None
        shape = self.open[-1].shape.child(path[-1])
        return shape if shape.shows_text else None

    def _set_open(self) -> None:
        """After a container opened or closed: how many open containers, from the root, are
        shown (up to the first array: its items are shown once finished)."""
        self.shown_depth = next((i + 1 for i, c in enumerate(self.open) if c.kind == "array"), len(self.open))

    def _snapshot(self) -> Any:
        """The value so far: each open container rebuilt, innermost first, with the open
        member it holds (list items are shown once finished)."""
        if not self.open:
            if self.value is not None or self.parser.done:
                return self.value
            return self.parser.open_string if self._open_text_shape() is not None else None
        inner: Any = None
        inner_key: str | int | None = None
        if self._open_text_shape() is not None:
            inner, inner_key = self.parser.open_string, self.parser.open_string_path[-1]  # type: ignore[index]
        for container in reversed(self.open[: self.shown_depth]):
            if isinstance(container.children, dict):
                members = dict(container.children)
                if inner_key is not None:
                    members[str(inner_key)] = inner
                inner = container.shape.build(members)
            else:  # list items are shown once finished, so the list changes only then
                if container.shown is None:
                    container.shown = container.shape.build(list(container.children))
                inner = container.shown
            inner_key = container.path[-1] if container.path else None
        return inner
