"""The time budget and cancel flag of one compile, checked by the Python-side work inside it.

Normalizing a schema and analysing a grammar are Python loops that a hostile constraint can
make long. `GrammarCompiler` runs each compile under a `CompileBudget` (a context variable, so
deep helpers need no extra parameter); those loops call `check_budget()`, which raises once the
deadline passed or every caller cancelled. Native work (xgrammar's and llguidance's compile)
cannot be interrupted; its result is thrown away if the budget ran out meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from structgen.errors import ConstraintTooLargeError, RequestCancelledError

DEFAULT_COMPILE_TIMEOUT_S = 30.0  # seconds one compile may take (`GrammarCompiler`, `LLM`)


class CompileBudget:
    """A deadline (`seconds` from now) and a cancel flag for the compile of `description`."""

    def __init__(self, seconds: float, description: str = "the constraint"):
        self.seconds = seconds
        self.description = description
        self.deadline = time.monotonic() + seconds
        self._cancelled = threading.Event()

    def restart(self) -> None:
        """Start the `seconds` afresh (a compile that waited in a queue: the wait is not its own)."""
        self.deadline = time.monotonic() + self.seconds

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def check(self) -> None:
        """Raise `RequestCancelledError` if cancelled, `ConstraintTooLargeError` if past the
        deadline."""
        if self._cancelled.is_set():
            raise RequestCancelledError(f"the compile of {self.description} was cancelled")
        if time.monotonic() > self.deadline:
            raise ConstraintTooLargeError(
                f"compiling {self.description} took longer than the compile time budget of {self.seconds:g} s",
                limit="compile_timeout", remedy="simplify it (fewer enum values, less nesting)")


_current: ContextVar[CompileBudget | None] = ContextVar("structgen_compile_budget", default=None)


def current_budget() -> CompileBudget | None:
    """The budget of the compile running in this context, if any."""
    return _current.get()


def check_budget() -> None:
    """Raise if the compile running on this thread is over its budget or cancelled; a no-op
    outside a budgeted compile."""
    budget = _current.get()
    if budget is not None:
        budget.check()


@contextmanager
def within(budget: CompileBudget | None) -> Iterator[None]:
    """Run the block under `budget` (None: keep the current one)."""
    if budget is None:
        yield
        return
    token = _current.set(budget)
    try:
        yield
    finally:
        _current.reset(token)
