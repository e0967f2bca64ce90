"""The hand-overs between event loops and the engine / compile threads (structgen/async_bridge.py)
and the stream's incremental detokenization, on real objects: a burst of distinct schemas
queues instead of failing, a stream's updates of one engine step arrive with one wake-up, and
decoding only the new tokens gives the text a whole decode gives."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import structgen
from structgen.async_bridge import CompileGate, LoopWaker, ThreadBatch
from structgen.engine.config import EngineConfig

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_the_compile_gate_holds_its_limit_serves_in_order_and_passes_on_a_cancelled_place():
    gate = CompileGate(2)
    held, most, order = 0, 0, []

    async def hold(name: str, release: asyncio.Event) -> None:
        nonlocal held, most
        async with gate.place():
            held += 1
            most = max(most, held)
            order.append(name)
            await release.wait()
            held -= 1

    async def main() -> None:
        events = {n: asyncio.Event() for n in "abcde"}
        tasks = {n: asyncio.create_task(hold(n, events[n])) for n in "abcde"}
        await asyncio.sleep(0.01)
        assert order == ["a", "b"] and gate.waiting == 3
        tasks["c"].cancel()  # a waiter that leaves takes no place
        events["a"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "b", "d"]
        for e in events.values():
            e.set()
        await asyncio.gather(*(t for n, t in tasks.items() if n != "c"))
        assert order == ["a", "b", "d", "e"] and gate.waiting == 0

    asyncio.run(main())
    assert most == 2


def test_the_compile_gate_gives_a_freed_place_to_a_quick_waiter_before_earlier_slow_ones():
    gate = CompileGate(1)
    order: list[str] = []

    async def hold(name: str, quick: bool, release: asyncio.Event) -> None:
        async with gate.place(quick=quick):
            order.append(name)
            await release.wait()

    async def main() -> None:
        go = asyncio.Event()
        go.set()
        first = asyncio.Event()
        tasks = [asyncio.create_task(hold("first", False, first))]
        await asyncio.sleep(0.01)
        tasks += [asyncio.create_task(hold(n, q, go)) for n, q in
                  (("slow 1", False), ("slow 2", False), ("quick 1", True), ("quick 2", True))]
        await asyncio.sleep(0.01)
        assert gate.waiting == 4
        first.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert order == ["first", "quick 1", "quick 2", "slow 1", "slow 2"]


def test_the_compile_gate_gives_a_freed_place_to_the_client_holding_fewest_before_a_floods_earlier_waiters():
    """One client's flood of new schemas waits behind itself, not in front of another client's
    compile; each client's own waiters keep their order, and the quick lane still goes first."""
    gate = CompileGate(2)
    order: list[str] = []

    async def hold(name: str, client: str, release: asyncio.Event, quick: bool = False) -> None:
        async with gate.place(quick, client):
            order.append(name)
            await release.wait()

    async def main() -> None:
        events = {n: asyncio.Event() for n in ("a1", "a2", "a3", "a4", "b1", "c1")}
        tasks = [asyncio.create_task(hold(n, n[0], events[n])) for n in ("a1", "a2", "a3", "a4")]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(hold("b1", "b", events["b1"])))
        await asyncio.sleep(0.01)
        assert order == ["a1", "a2"] and gate.waiting == 3
        events["a1"].set()  # a's place goes to b, which holds none, before a's own a3
        await asyncio.sleep(0.01)
        assert order == ["a1", "a2", "b1"]
        tasks.append(asyncio.create_task(hold("c1", "c", events["c1"], quick=True)))
        await asyncio.sleep(0.01)
        events["a2"].set()  # a quick waiter first, whoever holds what
        await asyncio.sleep(0.01)
        assert order == ["a1", "a2", "b1", "c1"]
        for e in events.values():
            e.set()
        await asyncio.gather(*tasks)
        assert order == ["a1", "a2", "b1", "c1", "a3", "a4"] and gate.waiting == 0
        assert not gate._held  # every place given back, no client kept

    asyncio.run(main())


class OneStep:
    """The engine loop's side of `LoopWaker`: `after_step` callbacks run when `end` is called."""

    def __init__(self):
        self.callbacks: dict = {}

    def after_step(self, callback) -> None:
        self.callbacks[callback] = None

    def end(self) -> None:
        callbacks, self.callbacks = self.callbacks, {}
        for callback in callbacks:
            callback()


def test_a_steps_updates_reach_the_event_loop_in_order_with_one_wake_up():
    async def main() -> tuple[list, int]:
        aloop = asyncio.get_running_loop()
        engine_loop = OneStep()
        waker = LoopWaker(aloop, engine_loop)
        queues = [asyncio.Queue() for _ in range(3)]
        pushers = [waker.pusher(q) for q in queues]
        wake_ups = 0
        deliver = waker._deliver

        def counted() -> None:
            nonlocal wake_ups
            wake_ups += 1
            deliver()

        waker._deliver = counted

        class Progress(tuple):  # a request's update that is not its finish
            finished = False

        def engine_thread() -> None:
            for step in range(2):
                for i, push in enumerate(pushers):
                    push(Progress((step, i)))
                engine_loop.end()

        thread = threading.Thread(target=engine_thread)
        thread.start()
        got = [[tuple(await q.get()) for _ in range(2)] for q in queues]
        thread.join()
        return got, wake_ups

    got, wake_ups = asyncio.run(main())
    assert got == [[(0, i), (1, i)] for i in range(3)]
    assert wake_ups <= 2  # one a step (the second step's may find the first's undelivered)


def test_a_burst_of_distinct_schemas_beyond_the_compile_queue_all_complete(model_dir):
    llm = structgen.LLM(model_dir, config=EngineConfig(max_batch_size=16))
    burst = 80  # more distinct schemas at once than the compiler queues (64)
    schemas = [{"enum": [f"value {i}"]} for i in range(burst)]

    async def main() -> list:
        return await asyncio.gather(*(llm.acomplete(s, "Pick the value.", max_tokens=8) for s in schemas))

    try:
        done = asyncio.run(main())
    finally:
        llm.close()
    assert [c.value for c in done] == [f"value {i}" for i in range(burst)]


def test_an_event_loop_that_ended_leaves_no_waker_behind(model_dir):
    """Each `asyncio.run` brings a new event loop; the LLM's waker for one goes with it."""
    import gc

    llm = structgen.LLM(model_dir, config=EngineConfig(max_batch_size=2))
    try:
        for _ in range(3):
            asyncio.run(llm.acomplete({"enum": ["a"]}, "Pick.", max_tokens=4))
        gc.collect()
        assert len(llm._wakers) == 0
    finally:
        llm.close()


def test_closing_the_llm_ends_a_stream_in_progress(model_dir):
    llm = structgen.LLM(model_dir, config=EngineConfig(max_batch_size=2))

    async def main() -> str:
        started = asyncio.Event()

        async def consume() -> str:
            try:
                async for _ in llm.astream(str, "Write a long story.", max_tokens=400):
                    started.set()
            except structgen.StructgenError as exc:
                return type(exc).__name__
            return "finished"

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.to_thread(llm.close)  # its last update is delivered although no step follows
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(main()) == "RequestCancelledError"


def test_a_burst_is_one_batched_call_in_a_worker_thread_and_each_caller_gets_its_own_outcome():
    batches: list[list[int]] = []
    threads: set[int] = set()

    def squares(items: list[int]) -> list:
        batches.append(items)
        threads.add(threading.get_ident())
        return [(None, ValueError(f"no {i}")) if i == 3 else (i * i, None) for i in items]

    batch = ThreadBatch(squares)

    async def one(i: int) -> int | str:
        try:
            return await batch.add(i)
        except ValueError as exc:
            return str(exc)

    async def main() -> list:
        return await asyncio.gather(*(one(i) for i in range(20)))

    assert asyncio.run(main()) == [i * i if i != 3 else "no 3" for i in range(20)]
    assert batches == [list(range(20))] and threading.get_ident() not in threads


def test_a_finish_reaches_its_caller_before_the_step_ends_and_finishes_pushed_meanwhile_share_its_wake_up():
    """A finish wakes the event loop at once, not when the step ends (the step that closes a
    burst's outputs is a long one); the finishes pushed before that wake-up is delivered go
    with it, and a step where nobody finished wakes nobody."""

    class Update:
        def __init__(self, finished: bool):
            self.finished = finished

    async def main() -> tuple[bool, list, int]:
        aloop = asyncio.get_running_loop()
        engine_loop = OneStep()
        waker = LoopWaker(aloop, engine_loop)
        wake_ups, deliver = 0, waker._deliver

        def counted() -> None:
            nonlocal wake_ups
            wake_ups += 1
            deliver()

        waker._deliver = counted
        first = aloop.create_future()
        heard = threading.Event()
        first.add_done_callback(lambda _: heard.set())
        futures = [aloop.create_future() for _ in range(4)]
        finishers = [waker.finisher(f) for f in futures]
        last = [Update(True) for _ in futures]
        before_step_end = []

        def engine_thread() -> None:
            for finish in finishers:  # a step where nobody finished: nothing to wake for
                finish(Update(False))
            engine_loop.end()
            waker.finisher(first)(Update(True))
            before_step_end.append(heard.wait(10))  # the step has not ended
            engine_loop.end()
            for finish, update in zip(finishers, last, strict=True):
                finish(update)

        thread = threading.Thread(target=engine_thread)
        thread.start()
        await first
        time.sleep(0.3)  # the event loop busy while the other four finish: one wake-up takes them
        got = [await f for f in futures]
        thread.join()
        return before_step_end == [True], [g is u for g, u in zip(got, last, strict=True)], wake_ups

    heard_early, same, wake_ups = asyncio.run(main())
    assert heard_early and same == [True] * 4 and wake_ups == 2


def test_256_concurrent_acompletes_of_one_schema_enter_the_batch_within_the_first_steps_and_validate(model_dir):
    """Issue 30's burst: the callers' front work (normalizing, one shared compile, tokenizing)
    hands the engine the whole burst in a few steps, and every output is a valid value."""
    burst = 256
    schema = {"type": "object", "properties": {"tier": {"enum": ["bronze", "silver", "gold"]}},
              "required": ["tier"], "additionalProperties": False}
    llm = structgen.LLM(model_dir, config=EngineConfig(max_batch_size=burst, max_seq_len=64))
    engine, running = llm.engine, []
    step = engine.step

    def observed_step() -> list:  # records the batch size each step ran with
        running.append(len(engine.scheduler.running))
        return step()

    engine.step = observed_step

    async def main() -> list:
        return await asyncio.gather(*(llm.acomplete(schema, f"Customer {i}: which tier?", max_tokens=12, chat=False)
                                      for i in range(burst)))

    try:
        done = asyncio.run(main())
    finally:
        llm.close()
    assert all(c.value["tier"] in ("bronze", "silver", "gold") for c in done)
    assert burst in running[:3]  # the burst arrives at once, not one request a step
