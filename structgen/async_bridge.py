"""What event loops and the threads beside them (the engine loop, the grammar compile pool)
hand each other, so that hundreds of async callers cost the engine thread little:

- `LoopWaker`: the engine's stream updates reach an event loop with one wake-up of that loop
  per engine step, not one per stream and step (each wake-up is a write to the loop's socket,
  on which the engine thread lets the event loop take the GIL);
- `CompileGate`: async callers hand the compile pool only as many compiles as it can start
  soon; the rest wait in order on their own event loops, where waiting costs nothing of a
  compile's time budget, instead of failing on a full compile queue;
- `ThreadBatch`: the blocking work (prompt tokenizing) that a burst of callers asks for within
  one turn of their event loop runs as one batched call in one worker-thread job with one
  wake-up of the loop, not a thread hop and a wake-up per caller; work that may run long
  (normalizing a hostile schema) does not belong in one, where it holds up the rest.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import weakref
from collections import Counter, deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from structgen.engine.loop import EngineLoop

# What a `ThreadBatch`'s process gives for each of its items: a result, or the error to raise
# in that item's caller.
Outcome = tuple[Any, BaseException | None]


class UpdateSink(Protocol):
    """Where a `LoopWaker` puts a request's updates, on the event loop's thread."""

    def put_nowait(self, item: Any) -> None: ...


class LoopWaker:
    """Puts request updates from the engine thread on one event loop's queues: a step's
    progress updates with one wake-up, sent when the step ends; a finish at once, with the
    updates pending beside it (the step that closes a burst's outputs is a long one, and the
    wake-up then waits for the GIL while the step goes on, not after it)."""

    def __init__(self, aloop: asyncio.AbstractEventLoop, engine_loop: EngineLoop):
        # Weakly: the LLM keeps wakers in a dict keyed weakly by their loops, which a strong
        # reference here would keep alive forever (one per `asyncio.run`).
        self._aloop, self._engine_loop = weakref.ref(aloop), engine_loop
        self._lock = threading.Lock()
        self._pending: list[tuple[UpdateSink, Any]] = []
        self._sent = False  # a wake-up is on its way to the event loop, not yet delivered
        self._at_step_end = False  # one is due when the step in progress ends

    def pusher(self, updates: UpdateSink) -> Callable[[Any], None]:
        """The `on_update` callback that puts a request's updates on `updates` (an
        `asyncio.Queue`, or what takes each update at once on the event loop)."""
        return functools.partial(self._push, updates)

    def finisher(self, finished: asyncio.Future[Any]) -> Callable[[Any], None]:
        """The `on_update` callback that resolves `finished` with the request once it has
        finished (its other updates cost one attribute read): the requests that finish in one
        step wake the event loop once, not once each."""
        return functools.partial(self._push_finished, _FutureSink(finished))

    def _push_finished(self, sink: _FutureSink, req: Any) -> None:
        if req.finished:
            self._push(sink, req)

    def _push(self, updates: UpdateSink, req: Any) -> None:
        now = req.finished
        with self._lock:
            self._pending.append((updates, req))
            if self._sent or (self._at_step_end and not now):
                return  # a wake-up on its way, or due soon enough, takes this one too
            if now:
                self._sent = True
            else:
                self._at_step_end = True
        if now:
            self._send()
        else:
            self._engine_loop.after_step(self._wake_at_step_end)

    def _wake_at_step_end(self) -> None:
        with self._lock:
            self._at_step_end = False
            if self._sent or not self._pending:
                return  # a finish sent them already
            self._sent = True
        self._send()

    def _send(self) -> None:
        aloop = self._aloop()
        try:
            if aloop is None:
                raise RuntimeError("the event loop is gone")
            aloop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop is closed or gone: nobody waits for the updates
            self._abort_pending()

    def _abort_pending(self) -> None:
        """Drop the updates that cannot reach their event loop and abort their requests: a
        stream left open on a closed event loop would otherwise hold its slot and decode to
        its last token for nobody. (An abort's own update comes back here, finished.)"""
        with self._lock:
            pending, self._pending = self._pending, []
            self._sent = False
        for _, req in pending:
            if not req.finished:
                self._engine_loop.abort(req)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._sent = False
        for updates, req in pending:
            updates.put_nowait(req)


class _FutureSink:
    """An `UpdateSink` that resolves an asyncio future with the first update it gets, then
    lets go of it (a request the engine still holds must not keep the event loop alive)."""

    def __init__(self, future: asyncio.Future[Any]):
        self.future: asyncio.Future[Any] | None = future

    def put_nowait(self, item: Any) -> None:
        future, self.future = self.future, None
        if future is not None and not future.done():  # (a cancelled caller's future is done)
            future.set_result(item)


class CompileGate:
    """At most `limit` holders at once, across event loops; the others wait, the quick lane's
    before the slow one's, and within a lane the waiter of the client holding the fewest places
    first, then the oldest. `async with gate.place(quick, client):` holds a place.

    Two lanes because compile times differ by 30x: in a burst of new schemas, one that
    llguidance compiles in milliseconds must not queue behind others' xgrammar compiles of
    hundreds (docs/performance.md, "Compiles of a burst, quick ones first"). Clients (the
    server's client addresses, engine/request.py) because one client's flood of new schemas
    must not hold another's compile until its budget runs out (`CompilerBusyError`)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._held: Counter[Hashable] = Counter()  # places held, by client
        # Per lane (quick, slow), the waiters by client, each client's oldest first.
        self._lanes: tuple[dict[Hashable, deque[_Waiter]], dict[Hashable, deque[_Waiter]]] = ({}, {})
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(len(queue) for lane in self._lanes for queue in lane.values())

    def place(self, quick: bool = False, client: Hashable = None) -> _Place:
        return _Place(self, self._lanes[0 if quick else 1], client)

    async def _enter(self, lane: dict[Hashable, deque[_Waiter]], client: Hashable) -> None:
        aloop = asyncio.get_running_loop()
        with self._lock:
            if self._held.total() < self.limit and not self.waiting:
                self._held[client] += 1
                return
            waiter = _Waiter(aloop, aloop.create_future(), next(self._arrivals))
            lane.setdefault(client, deque()).append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            with self._lock:
                queue = lane.get(client)
                queued = queue is not None and waiter in queue
                if queued:
                    queue.remove(waiter)
                    if not queue:
                        del lane[client]
            if not queued and waiter.future.done() and not waiter.future.cancelled():
                self._release(client)  # given a place just as it was cancelled: pass it on
            raise

    def _release(self, client: Hashable) -> None:
        """Give `client`'s place to the next waiter (the module docstring), or give it back."""
        with self._lock:
            self._held[client] -= 1
            if not self._held[client]:
                del self._held[client]  # (a server meets many clients: only holders are kept)
            lane = next((lane for lane in self._lanes if lane), None)
            if lane is None:
                return
            taker = min(lane, key=lambda c: (self._held[c], lane[c][0].arrival))
            queue = lane[taker]
            waiter = queue.popleft()
            if not queue:
                del lane[taker]
            self._held[taker] += 1
        try:
            waiter.loop.call_soon_threadsafe(self._grant, waiter.future, taker)
        except RuntimeError:  # that waiter's event loop is closed: the next one
            self._release(taker)

    def _grant(self, future: asyncio.Future[None], client: Hashable) -> None:
        if future.cancelled():
            self._release(client)
        else:
            future.set_result(None)


class _Waiter(NamedTuple):
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    arrival: int


class _Place:
    """`async with gate.place(quick, client):` a place in one of the gate's lanes."""

    def __init__(self, gate: CompileGate, lane: dict[Hashable, deque[_Waiter]], client: Hashable):
        self.gate = gate
        self.lane = lane
        self.client = client

    async def __aenter__(self) -> None:
        await self.gate._enter(self.lane, self.client)

    async def __aexit__(self, *exc: object) -> None:
        self.gate._release(self.client)


class ThreadBatch:
    """`await batch.add(item)` hands `item` to `process(items)` in a worker thread, together
    with the other items added on the same event loop before it next polls: a burst of callers
    costs one job of the loop's default executor, one batched call and one wake-up of the
    loop, not a thread hop and a wake-up per caller. `process` returns one `Outcome` per item;
    an item's error is raised in its own caller only."""

    def __init__(self, process: Callable[[list[Any]], list[Outcome]]) -> None:
        self.process = process
        self._pending: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[tuple[Any, asyncio.Future[Any]]]] = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()

    async def add(self, item: Any) -> Any:
        return await self.submit(item)

    def submit(self, item: Any) -> asyncio.Future[Any]:
        """`add` without waiting: the future of `item`'s result (cancel it if no longer wanted)."""
        aloop = asyncio.get_running_loop()
        future = aloop.create_future()
        with self._lock:
            pending = self._pending.setdefault(aloop, [])
        pending.append((item, future))
        if len(pending) == 1:  # the first of this turn: the rest join it until the loop polls
            aloop.call_soon(self._flush, aloop)
        return future

    def _flush(self, aloop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            items = self._pending.pop(aloop, [])
        aloop.run_in_executor(None, self._run_job, aloop, items)

    def _run_job(self, aloop: asyncio.AbstractEventLoop, items: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        items = [(item, future) for item, future in items if not future.cancelled()]  # callers gone
        futures = [future for _, future in items]
        try:
            results = self.process([item for item, _ in items])
        except BaseException as e:  # a failure of the whole batch reaches each of its callers
            results = [(None, e)] * len(items)
        outcomes = [(future, result, error) for future, (result, error) in zip(futures, results, strict=True)]
        try:
            aloop.call_soon_threadsafe(_settle, outcomes)
        except RuntimeError:  # the event loop closed: nobody waits for the results
            pass


def _settle(outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for future, result, error in outcomes:
        if future.done():
            continue
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
