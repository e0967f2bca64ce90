"""EngineLoop: one background thread owns the engine and steps it while there is work, so
every caller (sync, async, server) shares the same batches. Callers hand requests over and
get a `concurrent.futures.Future` that resolves when the request finishes."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from structgen.engine.engine import Engine
from structgen.engine.request import Request
from structgen.errors import EngineError

log = logging.getLogger("structgen.engine")


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._cond = threading.Condition()
        self._incoming: deque[Request] = deque()
        self._aborts: deque[Request] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        engine.interrupted = self._has_news

    def _has_news(self) -> bool:
        return bool(self._incoming or self._aborts)

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

        request.on_update = on_update
        with self._cond:
            if self._closed:
                raise EngineError("the engine loop is closed; create a new LLM to generate again")
            self._incoming.append(request)
            self._ensure_thread()
            self._cond.notify()
        return future

    def abort(self, request: Request) -> None:
        """Cancel a queued or running request; its slot is freed on the loop thread."""
        with self._cond:
            self._aborts.append(request)
            self._cond.notify()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="structgen-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._incoming or self._aborts or self.engine.has_work() or self._closed):
                    self._cond.wait()
                incoming, self._incoming = list(self._incoming), deque()
                aborts, self._aborts = list(self._aborts), deque()
                if self._closed:
                    aborts += incoming + list(self.engine.scheduler.waiting) + self.engine.scheduler.running
                    incoming = []
            for req in incoming:
                try:
                    self.engine.add_request(req)
                except Exception as exc:  # refused (prompt too long...): finished with the error,
                    req.finish("error", exc)  # so waiters and streams all hear of it
                    self.engine._notify(req)
            for req in aborts:
                self.engine.abort(req)
            if self._closed:
                return
            try:
                self.engine.step()
            except Exception:  # pragma: no cover - step guards its own failures
                log.exception("engine step failed")

    def close(self, timeout_s: float = 10.0) -> None:
        """Abort every queued and running request and stop the loop thread (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
