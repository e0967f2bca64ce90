"""EngineLoop: one background thread owns the engine and steps it while there is work, so
every caller (sync, async, server) shares the same batches. Callers hand requests over and
get a `concurrent.futures.Future` that resolves when the request finishes.

The thread is a daemon (a forgotten LLM must not keep the process alive), so it is stopped at
interpreter exit by an `atexit` hook: a daemon thread still inside a step when the interpreter
finalizes is killed as it next takes the GIL, and where that happens inside a C++ frame (a torch
tensor's destructor, a grammar library's call) the process aborts with "terminate called
without an active exception"."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future

from structgen.engine.engine import Engine
from structgen.engine.garbage_collection import FULL_COLLECTIONS, FullCollectionHold
from structgen.engine.request import Request
from structgen.errors import EngineBusyError, EngineError

log = logging.getLogger("structgen.engine")
# Seconds `close` waits for the step in progress: longer than the slowest step (a CPU prefill
# of a full context).
CLOSE_TIMEOUT_S = 30.0
# Seconds without a request before the engine, out of work, lets the full collection it held
# back run (engine/garbage_collection.py).
IDLE_BEFORE_COLLECTION_S = 0.1


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._cond = threading.Condition()
        self._incoming: deque[Request] = deque()
        self._incoming_by_client: Counter[Hashable] = Counter()  # (changed under `_cond`)
        self._aborts: deque[Request] = deque()
        self._thread: threading.Thread | None = None
        self._closing = False
        # the LLM was dropped unclosed (`abandon`): the thread closes the engine as it ends
        self._abandoned = False
        self._ended = False  # the loop thread has run to its end
        # Run once after the step in progress (deduplicated): update callbacks that batch
        # their hand-over to another thread put it here.
        self._after_step: dict[Callable[[], None], None] = {}
        self._holding = False  # this loop holds full garbage collections off (it has work)
        engine.interrupted = self._has_news
        _OPEN_LOOPS.add(self)

    def _has_news(self) -> bool:
        return bool(self._incoming or self._aborts or self._closing)

    def submit(self, request: Request) -> Future:
        """Queue `request`; the future resolves to it once finished (a request the engine
        refuses finishes at once with reason "error" and the refusal in `.error`)."""
        future: Future = Future()
        user_cb = request.on_update

        def on_update(req: Request, _cb: Callable | None = user_cb) -> None:
            if _cb is not None:
                _cb(req)
            if req.finished and not future.done():
                future.set_result(req)
                # The future holds the request now: dropping this callback breaks the cycle
                # request -> callback -> future -> request, which reference counting cannot
                # free, so a burst's requests are not left to the next full collection
                # (on the engine thread, tens of milliseconds after a burst).
                req.on_update = None

        with self._cond:
            if self._closing:
                raise EngineError("this LLM's engine loop is closed (the interpreter is exiting or its "
                                  "close() was called); create a new LLM to generate again")
            self.check_room([request])
            request.on_update = on_update
            self._incoming.append(request)
            self._incoming_by_client[request.client] += 1
            self._ensure_thread()
            self._cond.notify()
        return future

    def check_room(self, requests: Sequence[Request]) -> None:
        """Raise EngineBusyError where `requests` (one client's) would take the queue past
        `EngineConfig.max_waiting`, unless their client holds less than its share of it: the
        limit over the clients waiting. Those are taken, and the loop makes room by dropping
        the newest requests of the client that holds the most (`_make_room`), so one client's
        flood cannot lock the others out. (An estimate read off the loop thread: the bound is a
        cap on a flood, not an exact count.)"""
        limit = self.engine.config.max_waiting
        if limit is None or not requests:
            return
        waiting = len(self._incoming) + len(self.engine.scheduler.waiting)
        if waiting + len(requests) <= limit:
            return
        client = requests[0].client
        queued = self.engine.scheduler.waiting.by_client
        holds = queued.get(client, 0) + self._incoming_by_client.get(client, 0)
        clients = len({client, *queued, *self._incoming_by_client})
        share = limit // clients
        if holds + len(requests) <= share:
            return
        raise EngineBusyError(
            f"the engine has {waiting} requests waiting for a slot and takes at most {limit} "
            f"(EngineConfig.max_waiting; structgen serve --max-waiting)"
            + (f"; this client holds {holds} of them, its share while {clients} clients wait is {share}"
               if clients > 1 else "")
            + "; retry in a moment")

    def _make_room(self) -> None:
        """Drop the newest waiting requests of the client that holds the most of the queue,
        while the queue is past `max_waiting` and that client past its share (`check_room`
        took another client's requests on that promise); each finishes with EngineBusyError."""
        limit = self.engine.config.max_waiting
        scheduler = self.engine.scheduler
        while limit is not None and len(scheduler.waiting) > limit and len(scheduler.waiting.by_client) > 1:
            counts = scheduler.waiting.by_client
            victim = scheduler.waiting.newest_of_largest_client()
            if victim is None or counts[victim.client] <= limit // len(counts):
                return
            self.engine.abort(victim, "error", EngineBusyError(
                f"the engine's queue was full ({limit} requests waiting for a slot, "
                f"EngineConfig.max_waiting; structgen serve --max-waiting) and this client held the "
                f"most places ({counts[victim.client]}): its newest request was dropped to make room "
                "for another client's; retry in a moment"))

    def after_step(self, callback: Callable[[], None]) -> None:
        """Run `callback` once on the loop thread when the step in progress ends (at once when
        called from another thread): a stream's updates of a whole step go over together."""
        if threading.current_thread() is not self._thread:
            callback()
            return
        self._after_step[callback] = None

    def _run_after_step(self) -> None:
        callbacks, self._after_step = self._after_step, {}
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a broken callback must not break the loop
                log.exception("after-step callback failed")

    def abort(self, request: Request) -> None:
        """Cancel a queued or running request; its slot is freed on the loop thread."""
        with self._cond:
            self._aborts.append(request)
            self._cond.notify()

    def stop(self) -> None:
        """Abort every queued and running request and let the loop thread end after the step in
        progress, without waiting for it; later `submit`s raise EngineError. An LLM dropped
        unclosed calls this (the thread holds the engine, so would keep the model alive)."""
        with self._cond:
            self._closing = True
            self._cond.notify()

    def abandon(self) -> None:
        """`stop`, for an LLM dropped unclosed, then close the engine (its tensor-parallel
        ranks, which would otherwise keep their GPUs until this process exits, and its memory)
        once nothing steps it: as the loop thread ends, or at once where none runs. Never
        waits (a garbage collection on the loop thread itself may call it)."""
        with self._cond:
            self._closing = self._abandoned = True
            self._cond.notify()
            close_now = self._thread is None or self._ended
        if close_now:
            self.engine.close(release_memory=True)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """`stop`, then wait up to `timeout` seconds for the loop thread to end; whether it has
        (so that nothing steps the engine any more)."""
        self.stop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="structgen-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        holds = self.engine.config.tuning.hold_full_collections
        try:
            self._serve(FULL_COLLECTIONS if holds else None)
        finally:
            if holds and self._holding:
                self._holding = False
                FULL_COLLECTIONS.release()
            with self._cond:
                self._ended = True
                abandoned = self._abandoned
            if abandoned:
                self.engine.close(release_memory=True)

    def _serve(self, collections: FullCollectionHold | None) -> None:
        """Step while there is work; `collections`: held off while there is
        (engine/garbage_collection.py)."""
        while True:
            if self._holding and not self._has_news() and not self.engine.has_work() and self._stays_idle():
                self._holding = False  # out of work: the held collection may run now (not
                collections.release()  # under the lock, which submitting callers take)
            with self._cond:
                while not (self._incoming or self._aborts or self._closing or self.engine.has_work()):
                    self._cond.wait()
                incoming, self._incoming = list(self._incoming), deque()
                self._incoming_by_client.clear()
                aborts, self._aborts = list(self._aborts), deque()
                closing = self._closing
            if closing:
                with self.engine.thread_guard.holding():
                    self._abort_all(incoming)
                self._run_after_step()  # the aborted streams' last updates
                return
            if collections is not None:
                if not self._holding:
                    self._holding = True
                    collections.acquire()
                collections.at_step()
            with self.engine.thread_guard.holding():  # (another thread's direct step: wait for it)
                self._take_in(incoming, aborts)
                del incoming, aborts  # (not kept alive while the loop waits for the next work)
                try:
                    self.engine.step()
                except Exception:  # pragma: no cover - step guards its own failures
                    log.exception("engine step failed")
            self._run_after_step()

    def _take_in(self, incoming: list[Request], aborts: list[Request]) -> None:
        """Add the submitted requests to the engine (a refused one finishes with its error) and
        abort the cancelled ones."""
        for req in incoming:
            try:
                self.engine.add_request(req)
            except Exception as exc:  # refused (prompt too long...): finished with the error,
                req.finish("error", exc)  # so waiters and streams all hear of it
                self.engine._notify(req)
        for req in aborts:
            self.engine.abort(req)
        self._make_room()

    def _stays_idle(self) -> bool:
        """Whether no request comes within `IDLE_BEFORE_COLLECTION_S`: the held full collection
        (tens of milliseconds on the engine thread, the GIL held) waits for a pause, not for the
        end of each burst, where the next burst's callers would wait for it."""
        with self._cond:
            return not self._cond.wait_for(self._has_news, IDLE_BEFORE_COLLECTION_S)

    def _abort_all(self, incoming: list[Request]) -> None:
        """Finish every request the loop holds as aborted, so that no waiter hangs."""
        scheduler = self.engine.scheduler
        for req in [*incoming, *scheduler.waiting, *scheduler.running]:
            self.engine.abort(req)


# Loops whose thread may still run; weak, so that an LLM dropped by its owner is collected.
_OPEN_LOOPS: weakref.WeakSet[EngineLoop] = weakref.WeakSet()


@atexit.register
def _close_open_loops() -> None:
    for loop in list(_OPEN_LOOPS):
        loop.close()
