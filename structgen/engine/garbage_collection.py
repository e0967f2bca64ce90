"""Python's cyclic garbage collector around the engines: what it walks, and when.

A collection holds the GIL for as long as it walks objects, so where and how often it runs is
time taken from the steps and from the callers making requests:

- `freeze_heap`: the heap left by the imports (torch, transformers, xgrammar: ~240k container
  objects) is frozen once, before the first engine, so that no collection walks it.
- `FULL_COLLECTIONS`: while any engine has work, collections of the oldest generation are held
  off; the young generations are collected as usual. A full collection walks every live object,
  and CPython starts one whenever the objects that survived into the oldest generation grew by
  a quarter, which a burst of requests does: a burst of agent turns holds hundreds of prompts
  of thousands of token ids, and the collection stalled the thread making the turns
  (docs/performance.md, "Serving under load"). The held collection runs when the last busy
  engine has been idle a moment (`loop.IDLE_BEFORE_COLLECTION_S`: a burst that follows another
  does not wait for it), and at least every `FULL_COLLECTION_EVERY_S` of work without a pause, so
  cyclic garbage stays bounded under a load that never lets up. (Written for the generations
  of CPython 3.10-3.13; 3.14 collects its old generation incrementally.)
- `untracked_ints`: a list of token ids is taken out of the collector's sight. A young
  collection walks every reference of every new container, and a 3,000-token prompt is a
  list of 3,000: each turn of an agent burst was walked twice (young, then middle
  generation), time the thread making the other turns and the engine thread waited for
  (docs/performance.md, "Serving under load").
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import sys
import threading
import time
from collections.abc import Callable

# Seconds of uninterrupted work after which a held full collection runs at the next step.
FULL_COLLECTION_EVERY_S = 10.0
# The oldest generation's threshold while held: a count of young collections never reached.
HELD_THRESHOLD = 1 << 30

_HEAP_FROZEN = False


def _untrack_call() -> Callable[[object], None] | None:
    """CPython's `PyObject_GC_UnTrack` (called with the GIL held, as `ctypes.pythonapi` calls
    are); None on other interpreters."""
    if sys.implementation.name != "cpython":
        return None
    call = ctypes.pythonapi.PyObject_GC_UnTrack
    call.argtypes, call.restype = [ctypes.py_object], None
    return call


_gc_untrack = _untrack_call()


def untracked_ints(values: list[int]) -> list[int]:
    """`values`, no longer tracked by the cyclic collector (appends do not track it again).

    A list that holds only ints can be in no reference cycle, so walking it finds nothing:
    the collector skips it from now on, while reference counting frees it as before. The
    caller keeps the promise that only ints (or other objects the collector does not track,
    such as numpy scalars) ever go into it. Outside CPython, `values` as it is."""
    if _gc_untrack is not None:
        _gc_untrack(values)
    return values


def freeze_heap() -> None:
    """Take the objects alive before the first engine out of the collector's sight, once per
    process (`gc.freeze`).

    The step loop allocates enough to trigger full collections, and each walked that whole
    heap: long stalls in the middle of requests, worst with jump-forward on (the notebook in
    docs/notes/, "Garbage collection").
    `Engine.__new__` calls it before the engine object exists, so engines are never frozen:
    one that is dropped is still collected, reference cycles and GPU memory included."""
    global _HEAP_FROZEN
    if not _HEAP_FROZEN:
        gc.collect()
        gc.freeze()
        # At exit the frozen objects go back to the collector, so the interpreter's final
        # collection still finalises them (nanobind modules report "leaked" objects otherwise).
        atexit.register(gc.unfreeze)
        _HEAP_FROZEN = True


class FullCollectionHold:
    """Process-wide, as the collector is: an engine loop calls `acquire` when it gets work,
    `release` when it runs out and `at_step` once a step. Nothing is held where automatic
    collection is off, and a threshold someone else set during a hold is left as they set it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._saved: int | None = None  # the oldest generation's threshold before the hold
        self._last = 0.0  # when the hold began or last ran a full collection (monotonic)

    @property
    def held(self) -> bool:
        return self._saved is not None

    def acquire(self) -> None:
        with self._lock:
            self._holders += 1
            if self._holders > 1 or not gc.isenabled():
                return
            young, middle, oldest = gc.get_threshold()
            if oldest == HELD_THRESHOLD:  # (a hold this object lost track of: nothing to save)
                return
            self._saved, self._last = oldest, time.monotonic()
            gc.set_threshold(young, middle, HELD_THRESHOLD)

    def release(self) -> None:
        """The last holder out restores the threshold and runs the full collection the hold
        kept back, if one was due."""
        with self._lock:
            self._holders = max(0, self._holders - 1)
            if self._holders or self._saved is None:
                return
            saved, self._saved = self._saved, None
            young, middle, oldest = gc.get_threshold()
            if oldest != HELD_THRESHOLD:
                return  # set by someone else meanwhile: theirs stands
            gc.set_threshold(young, middle, saved)
            due = gc.get_count()[2] > saved
        if due:
            gc.collect()

    def at_step(self) -> None:
        """Run the held full collection if it is due and the hold has lasted
        `FULL_COLLECTION_EVERY_S` since it began or last ran one."""
        saved = self._saved
        if saved is None or time.monotonic() - self._last < FULL_COLLECTION_EVERY_S:
            return
        self._last = time.monotonic()
        if gc.get_count()[2] > saved:
            gc.collect()

    def forget_holders(self) -> None:
        """In a forked child: the engine threads that held collections stayed in the parent,
        and would never let go; the hold ends, its threshold restored."""
        self._lock = threading.Lock()
        self._holders = 0
        saved, self._saved = self._saved, None
        young, middle, oldest = gc.get_threshold()
        if saved is not None and oldest == HELD_THRESHOLD:
            gc.set_threshold(young, middle, saved)


FULL_COLLECTIONS = FullCollectionHold()
os.register_at_fork(after_in_child=FULL_COLLECTIONS.forget_holders)
