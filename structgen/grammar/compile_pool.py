"""`GrammarCompiler.submit`: compiles on a small pool of the compiler's own, so slow grammar
work cannot take the threads other requests need, with a bounded queue, one compile per
constraint in flight, and cancellation.

Each `submit` gets its own Future; the Futures of one constraint share one `_CompileJob`. A
Future is cancelled like any pending one (it never runs itself); when every Future of a job is
cancelled, the job's `CompileBudget` is, and its Python-side work stops at the next
`check_budget()`. `close` cancels every job and ends the workers (`LLM.close()`), so that each
LLM's compile threads end with it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from structgen.errors import CompilerBusyError, StructgenError
from structgen.schema.budget import CompileBudget, within

if TYPE_CHECKING:
    from structgen.grammar.backends.base import CompiledGrammar
    from structgen.grammar.compiler import GrammarCompiler


class _CompileJob:
    """One constraint compiling, and the Futures waiting for it."""

    def __init__(self, budget: CompileBudget):
        self.budget = budget
        self.waiters: list[CompileFuture] = []
        self.queued_at = time.monotonic()


class CompileFuture(Future):
    """A caller's Future of a shared compile: cancelling it stops the compile once no other
    caller still waits for it."""

    def __init__(self, pool: CompilePool, job: _CompileJob):
        super().__init__()
        self._pool = pool
        self._job = job

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled:
            self._pool.forget(self._job)
        return cancelled


class CompilePool:
    """`workers` threads compiling for one `GrammarCompiler`; at most `max_queued` jobs
    waiting or running."""

    def __init__(self, compiler: GrammarCompiler, workers: int, max_queued: int):
        self._compiler = compiler
        self._workers = workers
        self._max_queued = max_queued
        self._executor: ThreadPoolExecutor | None = None  # started on first use
        self._jobs: dict[tuple, _CompileJob] = {}
        # queued jobs, quick compiles (`GrammarCompiler.compiles_quickly`) before slow ones
        self._queued: tuple[deque[_Queued], deque[_Queued]] = (deque(), deque())
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, output: Any, backend: str | None, strict: bool = True) -> Future[CompiledGrammar]:
        from structgen.types import Constraint

        name = backend or self._compiler.backend
        if isinstance(output, Constraint):
            key: tuple | None = (output.key, name)
            hit = self._compiler._cached(key)
            if hit is not None:
                done: Future[CompiledGrammar] = Future()
                done.set_result(hit)
                return done
        else:  # an output type: `to_constraint` runs on the pool too (normalization is slow)
            key = ("output type", output, strict, name) if _hashable(output) else None
        with self._lock:
            self._check_open()
            job = self._jobs.get(key) if key is not None else None
            if job is None or job.budget.cancelled:  # a cancelled job is not joined: start anew
                if len(self._jobs) >= self._max_queued:
                    raise CompilerBusyError(
                        f"{len(self._jobs)} grammars are already compiling or waiting to compile "
                        f"(max_queued={self._max_queued}); retry shortly, or raise "
                        "GrammarCompiler(max_queued=...)"
                    )
                description = getattr(output, "description", None) or f"{output!r:.80}"
                job = _CompileJob(CompileBudget(self._compiler.compile_timeout, description))
                self._jobs[key if key is not None else ("unshared", id(job))] = job
                self._start(job, output, backend, strict)
            future = CompileFuture(self, job)
            job.waiters.append(future)
        return future

    def join(self, constraint: Any, backend: str | None) -> Future[CompiledGrammar] | None:
        """A Future sharing the compile of `constraint` already in flight, or None where none
        is (joining adds nothing to the queue, so it needs no place in it)."""
        key = (constraint.key, backend or self._compiler.backend)
        with self._lock:
            job = self._jobs.get(key)
            if job is None or job.budget.cancelled:
                return None
            future = CompileFuture(self, job)
            job.waiters.append(future)
        return future

    def close(self) -> None:
        """Cancel every job (their waiters get `RequestCancelledError`) and end the workers,
        waiting for a compile in progress to reach its next budget check (a native compile, to
        end); later `submit`s that need a compile raise (cache hits are still served). Idempotent."""
        with self._lock:
            self._closed = True
            for job in self._jobs.values():
                job.budget.cancel()
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)  # queued jobs still run, and fail at once as cancelled

    def _check_open(self) -> None:
        if self._closed:
            raise StructgenError("this GrammarCompiler is closed (its close(), which LLM.close() calls); "
                                 "create a new structgen.LLM() or GrammarCompiler to compile on")

    def _start(self, job: _CompileJob, output: Any, backend: str | None, strict: bool) -> None:
        from structgen.types import Constraint

        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="structgen-compile")
        quick = isinstance(output, Constraint) and self._compiler.compiles_quickly(output)
        self._queued[0 if quick else 1].append((job, output, backend, strict))
        self._executor.submit(self._run_next)  # one run per job: each takes the first queued

    def _run_next(self) -> None:
        with self._lock:
            lane = self._queued[0] if self._queued[0] else self._queued[1]
            job, output, backend, strict = lane.popleft()
        self._run(job, output, backend, strict)

    def _run(self, job: _CompileJob, output: Any, backend: str | None, strict: bool) -> None:
        from structgen.types import to_constraint

        result: CompiledGrammar | None = None
        error: BaseException | None = None
        try:
            self._started(job)
            with within(job.budget):
                result = self._compiler.compile(to_constraint(output, strict=strict), backend)
        except BaseException as e:  # handed to the waiters, whatever it is
            error = e
        with self._lock:
            for key in [k for k, j in self._jobs.items() if j is job]:
                del self._jobs[key]
            waiters, job.waiters = job.waiters, []
        for future in waiters:
            if not future.set_running_or_notify_cancel():
                continue
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def _started(self, job: _CompileJob) -> None:
        """A job leaving the queue: cancelled meanwhile, or queued longer than a compile may
        take (the workers were busy: the caller's constraint is not at fault, so not
        ConstraintTooLargeError), it stops; else its time budget starts now."""
        if job.budget.cancelled:
            job.budget.check()  # (raises that it was cancelled)
        waited = time.monotonic() - job.queued_at
        if waited > self._compiler.compile_timeout:
            raise CompilerBusyError(
                f"the grammar compiler was busy with other constraints for {waited:.0f} s before it "
                f"could start on {job.budget.description}; retry shortly")
        job.budget.restart()

    def forget(self, job: _CompileJob) -> None:
        """A waiter of `job` cancelled: cancel the job when none is left."""
        with self._lock:
            if job.waiters and all(f.cancelled() for f in job.waiters):
                job.budget.cancel()


_Queued = tuple[_CompileJob, Any, "str | None", bool]  # a job, its output type, backend and strict


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
