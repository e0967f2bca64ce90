"""One LLM used as applications use it, on the real default model (CPU): many threads at once
(a web server's pool), sync and async callers and several event loops together, callers that
cancel, time out, leave a stream or press Ctrl-C, a close from another thread, and processes
forked after the LLM exists (a prefork server). Every answer is its own caller's, every request
that nobody waits for any more gives its slot back, and nothing hangs: each wait here has a
deadline, so a hang fails the test instead of blocking the suite."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from pydantic import BaseModel

import structgen
from structgen.engine.garbage_collection import HELD_THRESHOLD
from structgen.errors import RequestCancelledError, StructgenError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONFIG = {"max_batch_size": 8, "max_seq_len": 512}
NUMBERS = list(range(100, 124))  # three-digit numbers, which the model repeats
DIGITS = structgen.Regex(r"[0-9]{3}")
# An output that cannot end before its token budget: a request that runs until cancelled.
ENDLESS = structgen.Regex(r"[a-z ]{3000}")
ENDLESS_TOKENS = 400
WAIT_S = 60  # past this, a wait is a hang
CHILD_WAIT_S = 30  # a forked child that loads its own LLM answers well within this


class Echo(BaseModel):
    number: int


def _ask(llm: structgen.LLM, n: int) -> Any:
    """Caller `n`'s own question: its number back as digits, as its own enum value (a schema
    no other caller compiles) or as a typed object."""
    prompt = f"Repeat this number exactly: {n}"
    if n % 3 == 0:
        return llm.generate(DIGITS, prompt, max_tokens=8)
    if n % 3 == 1:
        return llm.generate({"enum": [f"v{n}", f"w{n}"]}, prompt, max_tokens=8)
    return llm.generate(Echo, prompt, max_tokens=16)


async def _aask(llm: structgen.LLM, n: int) -> Any:
    """`_ask` for asyncio: the enum listed the other way round (the same outputs, compiled
    anew, on the event loop's side), the typed object streamed."""
    prompt = f"Repeat this number exactly: {n}"
    if n % 3 == 0:
        return await llm.agenerate(DIGITS, prompt, max_tokens=8)
    if n % 3 == 1:
        return await llm.agenerate({"enum": [f"w{n}", f"v{n}"]}, prompt, max_tokens=8)
    stream = llm.astream(Echo, prompt, max_tokens=16)
    async for _ in stream:
        pass
    assert stream.completion is not None
    return stream.completion.value


def _typed(values: list[Any]) -> list[tuple[type, Any]]:
    return [(type(v), v) for v in values]


def _passes_to_drain(llm: structgen.LLM) -> int:
    """Engine steps taken until no request is queued or running and every slot is free."""
    scheduler, start = llm.engine.scheduler, llm.engine.runner.forward_passes
    deadline = time.monotonic() + WAIT_S
    while scheduler.running or scheduler.waiting or scheduler.pages.free_slots < CONFIG["max_batch_size"]:
        assert time.monotonic() < deadline, "requests still hold the engine"
        time.sleep(0.01)
    return llm.engine.runner.forward_passes - start


def _wait_running(llm: structgen.LLM, count: int = 1) -> None:
    deadline = time.monotonic() + WAIT_S
    while len(llm.engine.scheduler.running) < count:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def llm() -> Iterator[structgen.LLM]:
    with structgen.LLM(config=CONFIG) as shared:
        yield shared


@pytest.fixture(scope="module")
def answers(llm: structgen.LLM) -> dict[int, Any]:
    """Each caller's answer asked alone: what it must get however many ask beside it."""
    return {n: _ask(llm, n) for n in NUMBERS}


def test_sixteen_threads_calling_generate_at_once_each_get_their_own_typed_answer(llm, answers):
    asked = NUMBERS * 2
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda n: _ask(llm, n), asked, timeout=WAIT_S))
    assert _typed(got) == _typed([answers[n] for n in asked])
    _passes_to_drain(llm)


def test_sync_callers_and_two_event_loops_in_threads_at_once_get_their_own_answers(llm, answers):
    def on_own_loop(numbers: list[int]) -> list[Any]:
        async def main() -> list[Any]:
            return await asyncio.gather(*(_aask(llm, n) for n in numbers))

        return asyncio.run(main())

    threads = None
    for _ in range(3):  # the same work again leaves no more threads behind
        with ThreadPoolExecutor(18) as pool:
            evens, odds = pool.submit(on_own_loop, NUMBERS[::2]), pool.submit(on_own_loop, NUMBERS[1::2])
            sync = [pool.submit(_ask, llm, n) for n in NUMBERS]
            got_sync = [f.result(WAIT_S) for f in sync]
            got_async = evens.result(WAIT_S) + odds.result(WAIT_S)
        assert _typed(got_sync) == _typed([answers[n] for n in NUMBERS])
        assert _typed(got_async) == _typed([answers[n] for n in NUMBERS[::2] + NUMBERS[1::2]])
        threads = threads or threading.active_count()
        assert threading.active_count() <= threads
    _passes_to_drain(llm)


def test_a_hundred_gathered_agenerates_each_get_their_own_answer(llm, answers):
    asked = NUMBERS * 4 + NUMBERS[:4]

    async def main() -> list[Any]:
        return await asyncio.wait_for(asyncio.gather(*(_aask(llm, n) for n in asked)), WAIT_S)

    assert _typed(asyncio.run(main())) == _typed([answers[n] for n in asked])
    _passes_to_drain(llm)


def test_event_loops_that_each_waited_for_a_new_schema_are_freed_once_they_end(llm):
    """A sync web handler's `asyncio.run` per request, each with a schema not seen before:
    the LLM keeps none of their event loops (nor its waker for each)."""
    for i in range(4):
        schema = {"type": "object", "properties": {f"field_{i}_{j}": {"type": "integer"} for j in range(20)}}
        asyncio.run(asyncio.wait_for(llm.acomplete(schema, "Give an object.", max_tokens=16), WAIT_S))
    deadline = time.monotonic() + 5  # (a compile worker lets go of its last job a moment later)
    gc.collect()
    while llm._wakers:
        assert time.monotonic() < deadline, f"{len(llm._wakers)} ended event loops are kept"
        time.sleep(0.05)
        gc.collect()


def test_cancelled_and_timed_out_agenerates_give_their_slots_back_and_the_others_finish(llm, answers):
    async def main() -> tuple[list[str], list[Any]]:
        endless = [asyncio.create_task(llm.agenerate(ENDLESS, "Write.", max_tokens=ENDLESS_TOKENS)) for _ in range(6)]
        others = [asyncio.create_task(_aask(llm, n)) for n in NUMBERS[:9]]
        await asyncio.to_thread(_wait_running, llm, 6)
        for task in endless[:3]:
            task.cancel()
        outcomes = []
        for task in endless:
            try:
                await asyncio.wait_for(task, 0.2)  # the running ones time out
                outcomes.append("finished")
            except (asyncio.CancelledError, asyncio.TimeoutError) as e:
                outcomes.append(type(e).__name__)
        return outcomes, await asyncio.wait_for(asyncio.gather(*others), WAIT_S)

    outcomes, got = asyncio.run(main())
    assert outcomes == ["CancelledError"] * 3 + ["TimeoutError"] * 3
    assert _typed(got) == _typed([answers[n] for n in NUMBERS[:9]])
    assert _passes_to_drain(llm) < ENDLESS_TOKENS // 4  # aborted, not run to their budget


def test_a_sync_stream_left_by_break_is_aborted(llm):
    for _ in llm.stream(ENDLESS, "Write.", max_tokens=ENDLESS_TOKENS):
        break
    assert _passes_to_drain(llm) < ENDLESS_TOKENS // 4


def test_an_async_stream_left_by_break_without_closing_is_aborted(llm):
    async def main() -> int:
        async for _ in llm.astream(ENDLESS, "Write.", max_tokens=ENDLESS_TOKENS):
            break
        return await asyncio.to_thread(_passes_to_drain, llm)  # while the event loop runs on

    assert asyncio.run(main()) < ENDLESS_TOKENS // 4


def test_a_stream_left_open_on_an_event_loop_that_is_closed_is_aborted(llm):
    aloop = asyncio.new_event_loop()
    stream = llm.astream(ENDLESS, "Write.", max_tokens=ENDLESS_TOKENS)
    deltas = stream.__aiter__()
    aloop.run_until_complete(asyncio.wait_for(deltas.__anext__(), WAIT_S))
    aloop.close()  # its stream neither finished nor closed: nobody will read its updates
    _passes_to_drain(llm)
    assert stream.request is not None and stream.request.finish_reason == "abort"
    asyncio.run(deltas.aclose())  # (the closed event loop cannot finalize it)


def _interrupted_when_running(llm: structgen.LLM, call: Callable[[], object]) -> None:
    """`call()` in the main thread, and Ctrl-C once its request runs."""
    done = threading.Event()

    def interrupt() -> None:
        while not llm.engine.scheduler.running:
            if done.wait(0.01):
                return
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    try:
        call()
    finally:
        done.set()


def _on_alarm(*_: object) -> None:
    raise TimeoutError("the interrupted call hung")


@pytest.mark.parametrize("call", ["generate", "stream", "asyncio.run(agenerate)"])
def test_ctrl_c_during_a_call_in_the_main_thread_aborts_its_request_and_the_llm_works_after(llm, answers, call):
    calls: dict[str, Callable[[], object]] = {
        "generate": lambda: llm.generate(ENDLESS, "Write.", max_tokens=ENDLESS_TOKENS),
        "stream": lambda: list(llm.stream(ENDLESS, "Write.", max_tokens=ENDLESS_TOKENS)),
        "asyncio.run(agenerate)": lambda: asyncio.run(llm.agenerate(ENDLESS, "Write.", max_tokens=ENDLESS_TOKENS)),
    }
    before = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(WAIT_S)
    try:
        with pytest.raises(KeyboardInterrupt):
            _interrupted_when_running(llm, calls[call])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert _passes_to_drain(llm) < ENDLESS_TOKENS // 4
    assert _ask(llm, NUMBERS[0]) == answers[NUMBERS[0]]


def test_closing_from_another_thread_ends_every_caller_at_once_with_an_error():
    llm = structgen.LLM(config=CONFIG)

    def stream() -> None:
        for _ in llm.stream(ENDLESS, "Write.", max_tokens=ENDLESS_TOKENS):
            pass

    calls = [lambda: llm.generate(ENDLESS, "Write.", max_tokens=ENDLESS_TOKENS), stream,
             lambda: asyncio.run(llm.agenerate(ENDLESS, "Write.", max_tokens=ENDLESS_TOKENS))] * 4
    with llm, ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        _wait_running(llm, CONFIG["max_batch_size"])  # the rest are waiting for a slot
        started = time.monotonic()
        threading.Thread(target=llm.close).start()
        errors = [f.exception(WAIT_S) for f in futures]
        took = time.monotonic() - started
    assert all(isinstance(e, StructgenError) for e in errors), errors
    assert took < 5


def test_a_request_cut_short_by_close_says_the_llm_was_closed():
    llm = structgen.LLM(config=CONFIG)
    with llm, ThreadPoolExecutor(1) as pool:
        future = pool.submit(llm.generate, ENDLESS, "Write.", max_tokens=ENDLESS_TOKENS)
        _wait_running(llm)
        llm.close()
        error = future.exception(WAIT_S)
    assert isinstance(error, RequestCancelledError) and "closed" in str(error)


def _report(work: Callable[[], object], send: Any) -> None:
    try:
        send.send(work())
    except BaseException as e:
        send.send(f"{type(e).__name__}: {e}")


def _in_forked_child(work: Callable[[], object]) -> Any:
    """What `work()` returns in a child forked from this process, or the error it raises as
    "Type: message"; a child that hangs fails the test."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_report, args=(work, send), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(CHILD_WAIT_S):
            pytest.fail(f"the forked child hung ({CHILD_WAIT_S} s without an answer)")
        return receive.recv()
    finally:
        child.kill()
        child.join()


def test_a_forked_child_that_uses_its_parents_llm_gets_an_error_that_says_what_to_do(llm, answers):
    def use_inherited() -> list[str]:
        outcomes = []
        for call in (lambda: llm.generate(DIGITS, "Repeat this number exactly: 123", max_tokens=8),
                     lambda: asyncio.run(llm.agenerate(structgen.Regex("[0-9]{2}"), "Repeat: 12", max_tokens=8))):
            try:
                outcomes.append(repr(call()))
            except StructgenError as e:
                outcomes.append(str(e))
            if "fork" not in outcomes[-1]:
                break  # it answered: the next may wait forever for threads the fork left behind
        return outcomes

    outcomes = _in_forked_child(use_inherited)
    assert len(outcomes) == 2 and all("fork" in o and "structgen.LLM()" in o for o in outcomes), outcomes
    assert _ask(llm, NUMBERS[0]) == answers[NUMBERS[0]]  # the parent's own goes on


def test_a_forked_child_creates_and_uses_its_own_llm_while_the_parent_serves_on(llm, answers):
    def own_llm() -> Any:
        with structgen.LLM(config=CONFIG) as mine:
            return _ask(mine, NUMBERS[0])

    with ThreadPoolExecutor(8) as pool:  # the parent's requests in flight as the child forks
        pool.submit(llm.generate, ENDLESS, "Write.", max_tokens=ENDLESS_TOKENS // 4)
        busy = [pool.submit(_ask, llm, n) for n in NUMBERS]
        _wait_running(llm)
        child_answer = _in_forked_child(own_llm)
        assert _typed([f.result(WAIT_S) for f in busy]) == _typed([answers[n] for n in NUMBERS])
    assert _typed([child_answer]) == _typed([answers[NUMBERS[0]]])


def test_a_child_forked_while_the_parent_generates_collects_its_garbage_as_usual(llm):
    """The parent's engine holds full collections off while it has work; the threads that
    would let go did not pass to the child."""
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(llm.generate, ENDLESS, "Write.", max_tokens=ENDLESS_TOKENS // 4)
        _wait_running(llm)
        assert gc.get_threshold()[2] == HELD_THRESHOLD  # (held in the parent as it forks)
        child_threshold = _in_forked_child(lambda: gc.get_threshold()[2])
        busy.exception(WAIT_S)  # (cut off by its budget)
    assert child_threshold != HELD_THRESHOLD


def test_a_full_queue_refuses_the_next_request_at_once_and_serves_the_rest() -> None:
    """`EngineConfig.max_waiting`: with one slot busy and one request waiting for it, a third is
    refused at once (EngineBusyError, a server's 503) instead of queueing; the two finish, and
    a batch that does not fit is refused whole (none of it left running)."""
    from structgen.errors import EngineBusyError

    config = structgen.EngineConfig(device="cpu", max_batch_size=1, max_waiting=1, max_seq_len=512)
    with structgen.LLM(config=config) as llm:
        def queued() -> int:
            return len(llm.loop._incoming) + len(llm.engine.scheduler.waiting)

        async def main() -> None:
            stream = llm.astream(str, "Count from one to fifty in words.", max_tokens=48)
            pieces = stream.__aiter__()
            await pieces.__anext__()  # running: it holds the only slot
            waiting = asyncio.ensure_future(llm.acomplete(str, "Say hi.", max_tokens=4))
            deadline = time.monotonic() + 10
            while queued() < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert queued() == 1
            with pytest.raises(EngineBusyError, match="max_waiting"):
                await llm.acomplete(str, "Say hi.", max_tokens=4)
            async for _ in pieces:
                pass
            assert (await waiting).text

        asyncio.run(main())
        with pytest.raises(EngineBusyError):
            llm.generate_batch(str, ["a", "b", "c"], max_tokens=2)
        assert queued() == 0 and not llm.engine.scheduler.running
        assert llm.generate(str, "Say hi.", max_tokens=2)
