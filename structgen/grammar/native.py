"""xgrammar mask fills on a pool of native threads (`structgen/csrc/grammar_step.cpp`), off the GIL.

A large batch's JSON decode step can be host-bound, much of it mask fills on one core
(docs/performance.md, "Grammar overhead"): xgrammar's own pool was slower with more
threads there, and Python threads pass the GIL around. xgrammar 0.2's matchers are apache-tvm-ffi
objects, so a small C++ library can call their fill method through tvm-ffi's C ABI: one ctypes
call a batch (ctypes lets the GIL go for it), spread over native threads that stay awake
between steps. With one thread it is no faster than xgrammar's batch call, so the backend
uses it only where the pool has two threads or more.

The pool is one per process, shared by every LLM by design: it is sized to the host's cores, not
to a model, and a pool per LLM would multiply workers that spin between steps. It is built once
(`load`); a configured size (`size_pool`, at most `thread_limit()` threads) restarts it only
where no other LLM uses it, and `LLM.close()` leaves it, its workers asleep, for the next LLM.

Built with the system C++ compiler on first use (no torch or Python headers)
into `~/.cache/structgen/native/` (`$STRUCTGEN_CACHE/native`), one file per source and
tvm-ffi version. `load()` returns None where it cannot be built (no compiler, an xgrammar
whose matchers are not tvm-ffi objects, `STRUCTGEN_DISABLE_NATIVE=1`), and the backends then
make their usual Python calls.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from structgen.csrc import build_library, source
from structgen.errors import InvalidParameterError

log = logging.getLogger("structgen.grammar")

# A batch's grammar work cannot use more threads than cores; past a few hundred, thread stacks
# and start-up alone cost more than any host gains (the engine also clamps to the usable cores).
MAX_GRAMMAR_THREADS = 256
SOURCE = source("grammar_step.cpp")
MATCHER_TYPE_KEY = "xgrammar.tvm_ffi_binding.GrammarMatcher"
# Workers stay awake this long after a batch: the next decode step's comes within a
# millisecond, and waking a sleeping thread would cost more than the wait.
SPIN_US = 2000
_ERROR_BYTES = 1024


class NativeGrammarError(RuntimeError):
    """A matcher raised inside a native batch call; the message is xgrammar's."""


def default_threads() -> int:
    """The pool's auto size (`EngineTuning.grammar_threads` 0): `$STRUCTGEN_GRAMMAR_THREADS`
    where set (checked as `check_threads` checks a configured count), else half the cores, at
    most 8, where fills stopped getting faster (docs/performance.md, "Grammar overhead"); a
    2-core machine gets one, and so xgrammar's call."""
    text = os.environ.get("STRUCTGEN_GRAMMAR_THREADS", "").strip()
    if text:
        return _env_threads(text)
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _env_threads(text: str) -> int:
    source = "$STRUCTGEN_GRAMMAR_THREADS"
    try:
        threads = int(text)
    except ValueError:
        threads = 0
    if threads < 1:
        raise InvalidParameterError(f"{source} must be a whole number of threads from 1 to {thread_limit()}, got "
                                    f"{text!r}; or unset it for the auto size (half the cores, at most 8)")
    check_threads(threads, source)
    return threads


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def thread_limit() -> int:
    """The most grammar threads this host takes: 4 a usable core (oversubscribing for an
    experiment is fine; past that, workers that spin between steps only take turns), and never
    more than `MAX_GRAMMAR_THREADS`, however many cores."""
    return min(MAX_GRAMMAR_THREADS, 4 * usable_cores())


def check_threads(threads: int, source: str = "EngineTuning.grammar_threads") -> None:
    """Refuse more grammar threads than `thread_limit()`: each is an OS thread that lives as
    long as the process (the pool is process-wide), so an unbounded count exhausts the host."""
    limit = thread_limit()
    if threads > limit:
        raise InvalidParameterError(
            f"{source}={threads} is more grammar threads than this host takes: at most {limit} (4 for each of its "
            f"{usable_cores()} usable cores, never over {MAX_GRAMMAR_THREADS}); pass a smaller number, or 0 for the "
            "auto size")


# The engines that may fill on the pool now (`use_pool`): a restart replaces the pool under
# them, so it waits until the engine sizing it is the only one.
_POOL_USERS: weakref.WeakSet[object] = weakref.WeakSet()


def use_pool(engine: object) -> None:
    """Count `engine` among the pool's users until `release_pool(engine)` or until it is freed."""
    _POOL_USERS.add(engine)


def release_pool(engine: object) -> None:
    _POOL_USERS.discard(engine)


def pool_has_users() -> bool:
    """Whether an engine of this process uses the pool now (so `size_pool` would keep its size)."""
    return len(_POOL_USERS) > 0


def size_pool(threads: int, engine: object) -> None:
    """Restart the process-wide pool with `threads` threads where it builds and has another
    size (`EngineTuning.grammar_threads`), unless another engine uses it: a restart frees the
    pool and its workers while that engine's steps may be filling on them, so the pool then
    keeps its size (a warning says so). The pool outlives the engine (see the module's
    docstring): its workers sleep once they have spun `SPIN_US` after a batch."""
    pool = load()
    if pool is None or pool.threads == threads:
        return
    if any(user is not engine for user in list(_POOL_USERS)):
        log.warning("grammar_threads=%d: the process-wide grammar pool keeps its %d threads while another LLM "
                    "of this process uses it (close that LLM first to resize it)", threads, pool.threads)
        return
    pool.set_threads(threads)


def pool_in_use() -> bool:
    """Whether xgrammar batch fills go through the pool here (it builds, with 2+ threads)."""
    pool = load()
    return pool is not None and pool.threads > 1


class NativeGrammar:
    """Mask fills of xgrammar matchers (given by their tvm-ffi handles, `handle()`) on a pool
    of native threads, one per process. Calls may come from several threads (the prefetch's
    workers): one has the pool, the others fill on their own thread. A matcher must not be in
    two calls at once."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        # The pool's size, kept here: asked every step (`pool_in_use`), and a ctypes call
        # lets the GIL go, so the engine thread would wait to take it back behind any other.
        self._threads = 0
        # A forked child's pool is one thread (grammar_step.cpp's fork handler).
        os.register_at_fork(after_in_child=self._read_threads)

    def _read_threads(self) -> None:
        self._threads = self._lib.sg_threads()

    @property
    def threads(self) -> int:
        """Threads a batch is spread over, the caller's included."""
        return self._threads

    def set_threads(self, threads: int, spin_us: int = SPIN_US) -> None:
        """Restart the pool with `threads` threads whose workers stay awake `spin_us` after a
        batch; no call may be in flight."""
        check_threads(threads)
        if self._lib.sg_init(MATCHER_TYPE_KEY.encode(), max(1, threads), spin_us) != 0:
            raise NativeGrammarError(self.take_error())
        self._read_threads()

    def take_error(self) -> str:
        """The first matcher error since the last call that took it ("" if none)."""
        buf = ctypes.create_string_buffer(_ERROR_BYTES)
        self._lib.sg_take_error(buf, _ERROR_BYTES)
        return buf.value.decode("utf-8", "replace")

    def fill(self, handles: Sequence[int], bitmask: Any, rows: Sequence[int], fill_words: int | None = None) -> None:
        """Fill `bitmask[rows[i]]` from the matcher whose handle is `handles[i]`. `bitmask`: a
        CPU int32 tensor or array `[*, W]` with contiguous rows; xgrammar writes the first
        `fill_words` words a row (default W) and the rest are zeroed. Raises
        NativeGrammarError if any matcher raised (the other rows are filled)."""
        n = len(handles)
        if n == 0:
            return
        ptr, row_words = _row_major(bitmask)
        a = _scratch(n)
        a.handles[:n] = handles
        a.rows[:n] = rows
        bad = self._lib.sg_fill(a.at_handles, n, ptr, row_words, row_words if fill_words is None else fill_words,
                                a.at_rows, a.at_status)
        if bad:
            raise NativeGrammarError(f"{bad} of {n} mask rows failed: {self.take_error()}")

    def advance(self, handles: Sequence[int], tokens: Sequence[int], check_jump: bool = False,
                bitmask: Any = None, rows: Sequence[int] | None = None, fill_words: int | None = None) -> list[int]:
        """Matcher i accepts `tokens[i]`; returns a status per matcher, the bits of
        `backends.base.ACCEPTED`...: JUMPS only with `check_jump`, FILLED where its next mask
        was filled into `bitmask[rows[i]]`, FAILED where it raised (`take_error()` says why).
        Never raises for a matcher's failure: the caller fails that row alone."""
        n = len(handles)
        if n == 0:
            return []
        a = _scratch(n)
        a.handles[:n] = handles
        a.tokens[:n] = tokens
        ptr = row_words = 0
        if bitmask is not None:
            ptr, row_words = _row_major(bitmask)
            a.rows[:n] = rows
        self._lib.sg_advance(a.at_handles, n, a.at_tokens, int(check_jump), ptr or None, row_words,
                             row_words if fill_words is None else fill_words, a.at_rows, a.at_status)
        return a.status[:n].tolist()


class _Scratch(threading.local):
    """A calling thread's argument arrays, kept between calls with their addresses: numpy's
    `.ctypes` conversions cost more than a small batch's native work."""

    size = 0

    def grow(self, n: int) -> None:
        self.size = max(n, 2 * self.size, 64)
        self.handles = np.zeros(self.size, dtype=np.uint64)
        self.tokens = np.zeros(self.size, dtype=np.int32)
        self.rows = np.zeros(self.size, dtype=np.int32)
        self.status = np.zeros(self.size, dtype=np.uint8)
        self.at_handles, self.at_tokens = self.handles.ctypes.data, self.tokens.ctypes.data
        self.at_rows, self.at_status = self.rows.ctypes.data, self.status.ctypes.data


_SCRATCH = _Scratch()


def _scratch(n: int) -> _Scratch:
    if _SCRATCH.size < n:
        _SCRATCH.grow(n)
    return _SCRATCH


def handle(matcher: Any) -> int:
    """The tvm-ffi object handle of an `xgr.GrammarMatcher` (valid while it lives)."""
    return matcher._handle.__chandle__()


def _row_major(bitmask: Any) -> tuple[int, int]:
    if isinstance(bitmask, np.ndarray):
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.strides[1] != 4:
            raise ValueError("bitmask must be an int32 [rows, words] array with contiguous rows")
        return bitmask.ctypes.data, bitmask.strides[0] // 4
    import torch

    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(1) != 1 or bitmask.device.type != "cpu":
        raise ValueError("bitmask must be a CPU int32 [rows, words] tensor with contiguous rows")
    return bitmask.data_ptr(), bitmask.stride(0)


@functools.cache
def load() -> NativeGrammar | None:
    """The native library with its pool of `default_threads()`, built on first use; None
    (logged once) where it cannot be had."""
    if os.environ.get("STRUCTGEN_DISABLE_NATIVE") == "1":
        return None
    threads = default_threads()  # outside the try: a bad $STRUCTGEN_GRAMMAR_THREADS is the user's error
    try:
        lib = ctypes.CDLL(str(build()))
        lib.sg_init.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        lib.sg_fill.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        lib.sg_advance.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        lib.sg_take_error.argtypes = [ctypes.c_char_p, ctypes.c_int]
        import xgrammar  # noqa: F401  (registers the matcher type with tvm-ffi)

        native = NativeGrammar(lib)
        native.set_threads(threads)
        return native
    except Exception as exc:  # no compiler, no tvm-ffi headers, an xgrammar of another make
        log.warning("native grammar mask fills unavailable (%s); using xgrammar's batch fill", exc)
        return None


def build() -> Path:
    """The pool's shared library, compiled once per machine (csrc.build_library)."""
    import tvm_ffi
    from tvm_ffi import libinfo

    include, lib = Path(libinfo.find_include_path()), Path(libinfo.find_libtvm_ffi())

    def commands(compiler: str, source: Path, output: Path) -> list[list[str]]:
        return [[compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-pthread",
                 f"-I{include}", f"-I{libinfo.find_dlpack_include_path()}", str(source),
                 f"-L{lib.parent}", "-ltvm_ffi", f"-Wl,-rpath,{lib.parent}", "-o", str(output)]]

    return build_library(SOURCE.name, commands, key=tvm_ffi.__version__.encode() + str(include).encode())
