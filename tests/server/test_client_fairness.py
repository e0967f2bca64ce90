"""One client's flood against another client's request, through the app in this process
(httpx's ASGI transport, each client at its own address) over the default model on CPU, one
slot and a queue of two: the flood cannot take the other client's place in the queue."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

import structgen
from structgen.engine.config import EngineConfig
from structgen_server.app import create_app
from tests.server.asgi_client import post_and_stay

FLOOD, OTHER = "10.0.0.1", "10.0.0.2"
SHORT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3, "temperature": 0}
LONG = {"messages": [{"role": "user", "content": "Count from one to two hundred in words."}], "max_tokens": 400,
        "temperature": 0, "stream": True}
WAIT_S = 60


@pytest.fixture(scope="module")
def served(model_dir):
    llm = structgen.LLM(model_dir, config=EngineConfig(max_batch_size=1, max_waiting=2, max_seq_len=1024))
    yield llm, create_app(llm)
    llm.close()


def queued(llm: structgen.LLM) -> int:
    return len(llm.loop._incoming) + len(llm.engine.scheduler.waiting)


async def until(condition: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_full_queue_makes_room_for_another_client_by_dropping_the_floods_newest(served) -> None:
    llm, app = served

    async def post(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
        return await client.post("/v1/chat/completions", json={"model": llm.model_name, **body})

    async def main() -> None:
        leave = asyncio.Event()
        holder, sent = post_and_stay(app, {"model": llm.model_name, **LONG}, leave=leave, client=FLOOD)
        await until(lambda: any(m.get("body", b"").startswith(b"data: {") for m in sent))  # it holds the slot
        flood = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(FLOOD, 1)), base_url="http://x")
        other = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(OTHER, 1)), base_url="http://x")
        async with flood, other:
            waiting = [asyncio.ensure_future(post(flood, SHORT)) for _ in range(2)]
            await until(lambda: queued(llm) == 2)
            refused = await post(flood, SHORT)  # the queue is full and all of it is this client's
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert "max_waiting" in refused.json()["error"]["message"]

            served_other = asyncio.ensure_future(post(other, SHORT))  # taken: it holds no place
            dropped = await asyncio.wait_for(asyncio.shield(waiting[1]), WAIT_S)  # the flood's newest
            assert dropped.status_code == 503, dropped.text
            assert "dropped to make room for another client's" in dropped.json()["error"]["message"]
            assert queued(llm) == 2 and llm.engine.scheduler.waiting.by_client == {FLOOD: 1, OTHER: 1}

            leave.set()  # the holder leaves: its slot goes to the queue
            await asyncio.wait_for(holder, WAIT_S)
            assert (await asyncio.wait_for(served_other, WAIT_S)).status_code == 200
            assert (await asyncio.wait_for(waiting[0], WAIT_S)).status_code == 200

            # with the two clients waiting, each holds at most half of the queue
            leave = asyncio.Event()
            holder, sent = post_and_stay(app, {"model": llm.model_name, **LONG}, leave=leave, client=FLOOD)
            await until(lambda: any(m.get("body", b"").startswith(b"data: {") for m in sent))
            first = [asyncio.ensure_future(post(flood, SHORT)), asyncio.ensure_future(post(other, SHORT))]
            await until(lambda: queued(llm) == 2)
            again = await post(flood, SHORT)
            assert again.status_code == 503
            assert "this client holds 1 of them, its share while 2 clients wait is 1" in again.json()["error"]["message"]
            leave.set()
            await asyncio.wait_for(holder, WAIT_S)
            assert [(await asyncio.wait_for(f, WAIT_S)).status_code for f in first] == [200, 200]
            await until(lambda: not llm.engine.scheduler.running)  # (the holder's abort lands in a step)
        assert queued(llm) == 0

    asyncio.run(main())


def test_when_one_choice_of_a_request_fails_its_other_choices_stop() -> None:
    """A full queue drops one generation (the newest): the request is answered 503, and its
    other choices (`n` > 1) must not go on decoding for nobody."""
    from structgen.arguments import EncodedPrompt
    from structgen.errors import EngineBusyError
    from structgen_server.app import _run_all
    from structgen_server.serving import Job

    stopped: list[int] = []

    class Engine:
        async def acomplete(self, output_type: Any, prompt: Any, **options: Any) -> Any:
            if options["seed"] == 1:
                await asyncio.sleep(0.05)
                raise EngineBusyError("dropped to make room")
            try:
                await asyncio.sleep(WAIT_S)
            except asyncio.CancelledError:
                stopped.append(options["seed"])
                raise

    async def main() -> None:
        jobs = [Job(str, EncodedPrompt((1, 2)), {"seed": seed}) for seed in range(4)]
        with pytest.raises(EngineBusyError):
            await asyncio.wait_for(_run_all(Engine(), jobs), WAIT_S / 2)
        await asyncio.sleep(0.01)
        assert sorted(stopped) == [0, 2, 3]  # (not left to the end of the event loop)

    asyncio.run(main())
