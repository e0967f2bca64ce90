"""`PartialStream`: the snapshots of one streamed JSON output, read from any source of text
deltas (the local engine's stream, a remote server's), sync or async, then `.completion`."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from structgen.completion import ReasoningDelta
from structgen.errors import InvalidParameterError
from structgen.partial.shapes import root_shape
from structgen.partial.tracker import Partial, PartialTracker

if TYPE_CHECKING:
    from structgen.completion import Completion
    from structgen.types import Constraint

T = TypeVar("T")


def partial_tracker(output_type: Any, constraint: Constraint | None = None) -> PartialTracker[Any]:
    """A tracker for one output of `output_type` (whose `constraint` is built when not given);
    `InvalidParameterError` when the output is not JSON (regexes, grammars, choices, scalars
    and free text have no fields to report)."""
    if constraint is None:
        from structgen.types import to_constraint

        constraint = to_constraint(output_type)
    if constraint.kind != "json_schema":
        raise InvalidParameterError(
            f"partial=True needs a JSON output type (a pydantic model, dataclass, TypedDict, list "
            f"or dict type, or a JSON schema), not {constraint.description}; stream its text "
            "without partial=True"
        )
    return PartialTracker(root_shape(output_type))


class PartialStream(Generic[T]):
    """`for snapshot in stream` (from `stream(..., partial=True)`) or `async for snapshot in
    stream` (from `astream(..., partial=True)`): `Partial[T]` snapshots, the last with
    `done=True` and the final value; then `.completion`. Leaving the loop early closes the
    source, which cancels the request.

    `deltas` is the source of text deltas: a generator that returns the `Completion`, or an
    iterable (sync or async) whose `.completion` is set once it is exhausted."""

    def __init__(self, tracker: PartialTracker[T], deltas: Iterable[str] | AsyncIterable[str]):
        self.tracker = tracker
        self.completion: Completion[T] | None = None
        self._deltas = deltas

    def __iter__(self) -> Iterator[Partial[T]]:
        if not isinstance(self._deltas, Iterable):
            raise TypeError("this partial stream is asynchronous: read it with `async for`")
        return self._read(self._deltas)

    def __aiter__(self) -> AsyncIterator[Partial[T]]:
        if not isinstance(self._deltas, AsyncIterable):
            raise TypeError("this partial stream is synchronous: read it with `for`")
        return self._aread(self._deltas)

    def _read(self, deltas: Iterable[str]) -> Iterator[Partial[T]]:
        source = iter(deltas)
        returned = None
        try:
            while True:
                try:
                    delta = next(source)
                except StopIteration as stop:
                    returned = stop.value
                    break
                if isinstance(delta, ReasoningDelta):  # the snapshots follow the answer only
                    continue
                if (snapshot := self.tracker.feed(delta)) is not None:
                    yield snapshot
        finally:  # the consumer left early: close the source, which aborts the request
            close = getattr(source, "close", None)
            if close is not None:
                close()
        yield self._last(returned)

    async def _aread(self, deltas: AsyncIterable[str]) -> AsyncIterator[Partial[T]]:
        source = deltas.__aiter__()
        try:
            async for delta in source:
                if isinstance(delta, ReasoningDelta):  # the snapshots follow the answer only
                    continue
                if (snapshot := self.tracker.feed(delta)) is not None:
                    yield snapshot
        finally:
            close = getattr(source, "aclose", None)
            if close is not None:
                await close()
        yield self._last(None)

    def _last(self, returned: Completion[T] | None) -> Partial[T]:
        completion = returned if returned is not None else getattr(self._deltas, "completion", None)
        assert completion is not None, "a delta source ended without its completion"
        self.completion = completion
        return self.tracker.finish(completion.value)
