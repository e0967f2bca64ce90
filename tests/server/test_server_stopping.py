"""A request that arrives while the server drains after a stop signal (draining.py) gets the
JSON 503 `server_shutting_down`; one still running when the drain runs out (uvicorn cancels its
task after `timeout_graceful_shutdown`) is answered with OpenAI's JSON error, 503
`server_shutting_down`, not uvicorn's plain-text 500; a stream ends with that error event and
`[DONE]`. In process, on a stub LLM whose generations never end, cancelling the request's task
as uvicorn does once the stop signal marked the server as stopping."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from structgen_server.app import create_app
from tests.server.asgi_client import post_and_stay

MODEL = "stub-model"


class EndlessLLM:
    """Just enough of `structgen.LLM`: generations start (`started` is set) and never end."""

    model_name = MODEL

    def __init__(self) -> None:
        self.engine = SimpleNamespace(max_seq_len=4096)
        self.started = asyncio.Event()
        self.cancelled = 0

    async def aencode_prompt(self, prompt: Any, chat: bool = False, tools: Any = None) -> list[int]:
        return [1, 2, 3]

    async def aprepare(self, output_type: Any, strict: bool = True) -> Any:
        return output_type

    async def acomplete(self, output_type: Any, prompt: Any, **kwargs: Any) -> Any:
        await self._forever()

    def astream(self, output_type: Any, prompt: Any, **kwargs: Any) -> AsyncIterator[str]:
        async def pieces() -> AsyncIterator[str]:
            yield "Hel"
            await self._forever()
            yield "never"
        return pieces()

    async def _forever(self) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1  # the engine request would be aborted here
            raise


async def call_then_stop(body: dict[str, Any], stopping: bool) -> tuple[list[dict[str, Any]], EndlessLLM]:
    """POST `body` to the app, cancel the request's task once its generation runs (as uvicorn
    does when the graceful timeout runs out), and return the ASGI messages it sent."""
    llm = EndlessLLM()
    app = create_app(llm)
    task, sent = post_and_stay(app, body)
    await asyncio.wait_for(llm.started.wait(), 10)
    await asyncio.sleep(0.05)  # let a stream send its first event
    app.state.server.stopping = stopping
    task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
    try:
        await asyncio.wait_for(task, 10)
    except asyncio.CancelledError:
        pass
    return sent, llm


BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


def test_a_request_cut_by_the_graceful_stop_gets_a_json_503() -> None:
    sent, llm = asyncio.run(call_then_stop(BODY, stopping=True))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    assert start["status"] == 503
    assert (b"content-type", b"application/json") in start["headers"]
    error = json.loads(body)["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error", error
    assert llm.cancelled == 1  # its generation was cancelled, not left running


def test_a_stream_cut_by_the_graceful_stop_ends_with_an_error_event() -> None:
    sent, llm = asyncio.run(call_then_stop({**BODY, "stream": True}, stopping=True))
    assert sent[0]["status"] == 200 and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    events = [m["body"].decode() for m in sent[1:] if m.get("body")]
    assert events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down", error
    assert llm.cancelled == 1


def test_a_cancellation_while_not_stopping_is_not_taken_for_a_stop() -> None:
    sent, _ = asyncio.run(call_then_stop(BODY, stopping=False))
    assert not any(m.get("status") == 503 for m in sent)


def test_the_stop_signal_marks_the_server_as_stopping_and_it_refuses_new_requests() -> None:
    import signal

    import httpx

    from structgen_server.app import server_config
    from structgen_server.draining import draining_server

    app = create_app(EndlessLLM())
    server = draining_server(server_config(app, "127.0.0.1", 0), app.state.server.mark_stopping)
    server.handle_exit(signal.SIGTERM, None)
    assert app.state.server.stopping and server.should_exit and not server.force_exit
    server.handle_exit(signal.SIGTERM, None)  # a second signal: stop without waiting
    assert server.force_exit and server.stop_signal == signal.SIGTERM

    async def ask() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post("/v1/chat/completions", json=BODY), await client.get("/health")

    answer, health = asyncio.run(ask())
    assert answer.status_code == 503 and answer.headers["connection"] == "close"
    assert answer.json()["error"]["code"] == "server_shutting_down"
    assert health.status_code == 503 and health.json()["status"] == "stopping"
