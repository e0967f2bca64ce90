"""Python functions as CUDA host callbacks that can live inside CUDA graphs.

    @hostfunc
    def advance(step: int) -> None:          # runs on a CUDA thread, in stream order
        snap = snapshots.pop()               # this iteration's request state, not the live one
        ...                                  # grammar work on the CPU; no CUDA calls

    with torch.cuda.graph(g):
        ...; advance.launch(0); ...          # captured: runs at every replay
    snapshots.push(state_for_this_step); replay(g); synchronize()

Why: the grammar work of a guided step (advance matchers, fill the next bitmask) can then be
ordered inside one graph with the GPU work, instead of a host round trip per step.

The rules that keep it deadlock-free (the callback takes the GIL on a CUDA-internal thread):

1. Callbacks make no CUDA calls (no torch CUDA ops, no `.item()`/`.cpu()`, no syncs): CUDA
   forbids them in host functions, and any that waits on the stream waits on itself.
2. The main thread never blocks on the GPU while holding the GIL: wait with `synchronize`,
   `wait_event` and `replay` below (they drop it); an implicit sync such as `.item()` or
   `.tolist()` behind a pending callback hangs, since the callback can never get the GIL.
3. What a callback reads of request state is a snapshot pushed per iteration onto a
   `SnapshotQueue` before that iteration's launch: iterations overlap (the host runs ahead of
   the GPU), so the live state may already belong to a later step when the callback runs.

A callback that raises cannot raise into anyone: the exception is recorded and re-raised on
the main thread as `HostCallbackError` by the next `synchronize`/`wait_event`/`raise_pending`.
Arguments given to a captured launch are fixed at capture time (replays reuse the same
objects); pass mutable holders or read a `SnapshotQueue` for per-iteration data.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from structgen.engine.kernels import csrc_ext
from structgen.errors import StructgenError

T = TypeVar("T")

_errors: deque[tuple[str, BaseException]] = deque()
_local = threading.local()


class HostCallbackError(StructgenError):
    """A host callback raised; the original exception is the `__cause__`."""


def in_callback() -> bool:
    """True while the calling thread is running a host callback (for asserting rule 1)."""
    return getattr(_local, "depth", 0) > 0


def raise_pending() -> None:
    """Re-raise (once) the oldest exception a host callback recorded; drops the others."""
    if not _errors:
        return
    name, exc = _errors.popleft()
    dropped = len(_errors)
    _errors.clear()
    more = f" ({dropped} more callback errors dropped)" if dropped else ""
    raise HostCallbackError(f"host callback {name} raised {exc!r}{more}") from exc


class HostFunction:
    """A function launchable as a host callback (`launch`) and still callable directly."""

    def __init__(self, fn: Callable[..., object]):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = getattr(fn, "__qualname__", repr(fn))

    def __call__(self, *args: object) -> object:
        return self.fn(*args)

    def _run(self, *args: object) -> None:
        # The C++ trampoline calls this with the GIL held, on a CUDA thread.
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            self.fn(*args)
        except BaseException as exc:  # noqa: BLE001 - nothing above us can catch it
            _errors.append((self.name, exc))
        finally:
            _local.depth -= 1

    def launch(self, *args: object, stream: torch.cuda.Stream | None = None) -> int:
        """Enqueue `fn(*args)` on `stream` (default: the current stream).

        Returns 0 when the stream is not capturing (the callback runs once, then its argument
        block is freed), else the id of the captured block: it stays alive for every replay
        until `release(id)`/`release_all()` (at exit at the latest).
        """
        ext = csrc_ext.load()
        s = stream if stream is not None else torch.cuda.current_stream()
        return ext.launch(self._run, tuple(args), s.cuda_stream)


def hostfunc(fn: Callable[..., object]) -> HostFunction:
    """Decorator: make `fn` launchable as a CUDA host callback (`fn.launch(*args)`)."""
    return HostFunction(fn)


class SnapshotQueue(Generic[T]):
    """Per-iteration snapshots of the state host callbacks read (rule 3).

    The main thread `push`es one snapshot per launched iteration, before launching it; each
    callback `pop`s the oldest. Stream order runs callbacks in launch order, so the k-th pop
    gets the k-th push however far the host has run ahead. Push immutable values (tuples,
    frozen dataclasses, copies): the point is that later host work cannot change them.
    """

    def __init__(self) -> None:
        self._items: deque[T] = deque()  # append/popleft are atomic under the GIL

    def push(self, snapshot: T) -> None:
        self._items.append(snapshot)

    def pop(self) -> T:
        if not self._items:
            raise RuntimeError("SnapshotQueue.pop: no snapshot queued for this iteration")
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


# ----------------------------------------------------------------------------- GIL-free waits


def synchronize(stream: torch.cuda.Stream | None = None) -> None:
    """Wait for `stream` (default: current) with the GIL released, then raise callback errors."""
    s = stream if stream is not None else torch.cuda.current_stream()
    csrc_ext.load().stream_synchronize(s.cuda_stream)
    raise_pending()


def wait_event(event: torch.cuda.Event) -> None:
    """Wait for a recorded event with the GIL released, then raise callback errors."""
    handle = getattr(event, "cuda_event", None)
    if handle is None:
        event.synchronize()  # torch's binding also waits without the GIL
    elif handle:
        csrc_ext.load().event_synchronize(handle)
    raise_pending()


def replay(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream | None = None) -> None:
    """Launch a captured graph on `stream` (default: current) with the GIL released.

    Uses the graph's cudaGraphExec_t directly, so torch's RNG offsets are not advanced: use it
    for graphs whose randomness comes from explicit seeds (ours), `graph.replay()` otherwise.
    """
    s = stream if stream is not None else torch.cuda.current_stream()
    csrc_ext.load().graph_launch(graph.raw_cuda_graph_exec(), s.cuda_stream)


def release(block_id: int) -> bool:
    """Free one captured callback block (only once no graph that holds it will replay)."""
    return bool(block_id) and csrc_ext.load().release(block_id)


def release_all() -> int:
    """Free every captured callback block; returns how many were freed."""
    return csrc_ext.load().release_all()


def stats() -> dict[str, int]:
    """Callbacks run, callbacks that raised, and captured blocks still alive."""
    ext = csrc_ext.load()
    return {"calls": ext.calls(), "errors": ext.errors(), "captured": ext.captured_count()}
