"""Run native grammar compiles on a thread with a large stack.

xgrammar and llguidance build a grammar by recursing once per nested rule or `$ref`, so a chain
of a few thousand (well within the source-size limit) overflows a default 8 MiB thread stack,
and a native stack overflow kills the whole process instead of raising. The stack reserved here
covers the longest chains the default `ConstraintLimits` admit; its pages are committed only as
they are used.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
LARGE_STACK_BYTES = 256 << 20
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide


@dataclass
class _Outcome(Generic[T]):
    value: T | None = None
    error: BaseException | None = None


def call_on_large_stack(fn: Callable[[], T]) -> T:
    """`fn()` run on a fresh thread with a `LARGE_STACK_BYTES` stack, in a copy of the caller's
    context (so the compile budget applies); returns its result or raises its exception in the
    caller."""
    outcome: _Outcome[T] = _Outcome()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            outcome.value = context.run(fn)
        except BaseException as e:  # handed to the caller below
            outcome.error = e

    with _STACK_SIZE_LOCK:
        previous = threading.stack_size(LARGE_STACK_BYTES)
        try:
            worker = threading.Thread(target=run, name="structgen-native-compile", daemon=True)
            worker.start()
        finally:
            threading.stack_size(previous)
    worker.join()
    if outcome.error is not None:
        raise outcome.error
    return outcome.value  # type: ignore[return-value]
