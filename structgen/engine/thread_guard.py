"""One thread in the engine at a time. An LLM's engine is driven by its loop thread
(engine/loop.py); a second thread stepping it or adding to it meanwhile (`llm.engine.step()`,
`Engine.run` beside a serving LLM) used to reach the grammar matchers from two threads at once:
the mask and the matcher then disagreed, and native memory was freed twice, killing the
process. The second thread now gets a clear error instead, and the first goes on; the loop
thread itself waits its turn (`holding`) rather than fail its steps."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

from structgen.errors import EngineError

BUSY = ("this engine is in use on another thread (an LLM's engine is stepped by that LLM's loop "
        "thread): call the LLM's methods (generate, complete, acomplete, astream) instead of its "
        "engine's, or give each thread its own LLM")


class ThreadGuard:
    """`enter()` claims the engine for the calling thread (False where that thread holds it
    already: a step's own hooks may add requests) or raises EngineError where another holds
    it; `leave()` after an `enter()` that returned True."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def enter(self) -> bool:
        me = threading.get_ident()
        if self._owner == me:
            return False
        if not self._lock.acquire(blocking=False):
            raise EngineError(BUSY)
        self._owner = me
        return True

    def leave(self) -> None:
        self._owner = None
        self._lock.release()

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the engine for this thread, waiting while another has it (the loop thread
        around taking requests in and stepping)."""
        self._lock.acquire()
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            self.leave()


P = ParamSpec("P")
R = TypeVar("R")


def one_thread(method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
    """An engine method that runs only on the thread holding the engine's `thread_guard`."""

    @functools.wraps(method)
    def guarded(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        took = self.thread_guard.enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            if took:
                self.thread_guard.leave()

    return guarded
