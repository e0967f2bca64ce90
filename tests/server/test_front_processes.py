"""`structgen serve --front-processes N`: the HTTP server in N processes of its own, the engine
in the first (structgen_server/fronts.py, front_main.py, engine_host.py, engine_client.py, engine_link.py).
On the default model on the CPU: answers, streams and errors as the single server gives them,
metrics of all fronts together, a client that leaves stops its generation, a front that dies is
replaced, and fronts never outlive their engine process."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest

from structgen.errors import IncompleteOutputError, StructgenError
from structgen_server.engine_link import Outbox, portable_error, read_batch
from structgen_server.errors import APIError
from structgen_server.process import ServerProcess
from tests.server.asgi_client import children, running

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process trees from /proc (Linux)")

MODEL = "m"
ARGS = ["--device", "cpu", "--max-seq-len", "1024", "--max-batch-size", "4", "--served-model-name", MODEL,
        "--front-processes", "2"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PERSON = {"model": MODEL, "messages": [{"role": "user", "content": "Give me a person as JSON."}], "max_tokens": 40, "temperature": 0,
          "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Write a's and b's."}], "max_tokens": 400,
        "regex": "[ab]{4000}"}  # never ends before max_tokens


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not after {timeout} s")
        time.sleep(0.05)


def chat_requests_ok(server: ServerProcess) -> int:
    """The engine's count of chat requests answered 200 (every front's, whichever answers)."""
    with httpx.Client(timeout=10) as fresh:  # a new connection: any front may answer
        text = fresh.get(f"{server.root}/metrics").text
    line = next((x for x in text.splitlines() if x.startswith("structgen_requests_total") and
                 'endpoint="chat"' in x and 'status="200"' in x), None)
    return int(line.rsplit(" ", 1)[1]) if line else 0


@pytest.fixture(scope="module")
def server():
    with ServerProcess(ARGS, startup_timeout=240) as s:
        wait_for(lambda: len(children(s.proc.pid)) == 2, 60, "two front processes")
        yield s


def test_a_streams_plan_and_first_text_are_timed_in_the_engine_process_whichever_front_sends_it(server):
    def counted(name: str = "structgen_stream_first_text_seconds") -> int:
        with httpx.Client(timeout=10) as fresh:
            text = fresh.get(f"{server.root}/metrics").text
        line = next(x for x in text.splitlines() if x.startswith(f"{name}_count"))
        return int(line.rsplit(" ", 1)[1])

    before, planned = counted(), counted("structgen_request_plan_seconds")
    for _ in range(3):  # each on a new connection: any front may serve it
        with httpx.Client(timeout=120) as fresh, fresh.stream(
                "POST", f"{server.url}/chat/completions", json={**PERSON, "stream": True}) as r:
            assert r.status_code == 200
            r.read()
    wait_for(lambda: counted() == before + 3, 10, "three first texts counted")
    wait_for(lambda: counted("structgen_request_plan_seconds") == planned + 3, 10, "three plans counted")


def test_a_json_answer_and_its_stream_agree_and_validate(server):
    answer = httpx.post(f"{server.url}/chat/completions", json=PERSON, timeout=120).json()
    text = answer["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), SCHEMA)
    pieces, usage = [], None
    with httpx.stream("POST", f"{server.url}/chat/completions", timeout=120,
                      json={**PERSON, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if event["choices"]:
                    pieces.append(event["choices"][0]["delta"].get("content") or "")
                usage = event.get("usage") or usage
    assert "".join(pieces) == text  # greedy: the same text, streamed
    assert usage["completion_tokens"] == answer["usage"]["completion_tokens"]


@pytest.mark.parametrize(("body", "status", "code"), [
    ({**PERSON, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     400, "invalid_constraint"),
    ({**PERSON, "regex": "(unclosed"}, 400, None),
    ({**PERSON, "model": "other"}, 404, "model_not_found"),
    ({**PERSON, "messages": [{"role": "user", "content": "x " * 20_000}]}, 400, "context_length_exceeded"),
])  # fmt: skip
def test_errors_are_the_single_servers(server, body, status, code):
    r = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and (code is None or error["code"] == code), error


def test_concurrent_requests_on_many_connections_are_answered_and_counted_together(server):
    before = chat_requests_ok(server)

    def one(i: int) -> dict[str, Any]:
        with httpx.Client(timeout=180) as own:  # its own connection: the kernel picks a front
            return json.loads(own.post(f"{server.url}/chat/completions", json={**PERSON, "seed": i, "temperature": 1}).json()
                              ["choices"][0]["message"]["content"])

    with ThreadPoolExecutor(12) as pool:
        values = list(pool.map(one, range(12)))
    for v in values:
        jsonschema.validate(v, SCHEMA)
    counts = {chat_requests_ok(server) for _ in range(6)}  # scrapes that reach either front
    assert counts == {before + 12}


def test_a_client_leaving_a_stream_stops_its_generation(server):
    def engine_running() -> int:
        return httpx.get(f"{server.root}/health", timeout=10).json()["running"]

    with httpx.stream("POST", f"{server.url}/chat/completions", json={**LONG, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine_running() == 1
    wait_for(lambda: engine_running() == 0, 5, "the generation stopped")  # 400 tokens take far longer


def test_a_front_that_dies_is_replaced(server):
    first, second = children(server.proc.pid)
    os.kill(first, signal.SIGKILL)
    for _ in range(6):  # the other front answers meanwhile
        r = httpx.post(f"{server.url}/chat/completions", json={**PERSON, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
    wait_for(lambda: len(children(server.proc.pid)) == 2, 30, "a new front")
    assert second in children(server.proc.pid) and first not in children(server.proc.pid)


def test_fronts_stop_when_the_engine_process_dies():
    with ServerProcess(ARGS, startup_timeout=240) as s:
        wait_for(lambda: len(children(s.proc.pid)) == 2, 60, "two front processes")
        fronts = children(s.proc.pid)
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait()
        wait_for(lambda: not any(running(p) for p in fronts), 10, "the fronts exited")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{s.root}/health", timeout=2)


# --------------------------------------------------------------------------- the link itself


def test_an_outbox_sends_one_turns_messages_as_one_frame():
    async def exchange() -> list[list[tuple[Any, ...]]]:
        left, right = socket.socketpair()
        _, writer = await asyncio.open_connection(sock=left)
        reader, _ = await asyncio.open_connection(sock=right)
        outbox = Outbox(writer)
        for i in range(300):
            outbox.put(("delta", i, f"piece {i}"))
        await asyncio.sleep(0)
        outbox.put(("ok", 300, None))
        frames = [await read_batch(reader), await read_batch(reader)]
        writer.close()
        return frames

    frames = asyncio.run(exchange())
    assert [len(f) for f in frames] == [300, 1]
    assert frames[0][299] == ("delta", 299, "piece 299") and frames[1] == [("ok", 300, None)]


class Unpicklable(StructgenError):
    def __init__(self, message: str, thing: Any):
        super().__init__(message)
        self.thing = thing


def test_errors_cross_the_link_as_themselves_or_as_their_api_error():
    truncated = portable_error(IncompleteOutputError("cut", partial_text='{"a', token_ids=[1, 2]))
    back = pickle.loads(pickle.dumps(truncated))
    assert isinstance(back, IncompleteOutputError) and back.partial_text == '{"a' and back.token_ids == [1, 2]
    odd = portable_error(Unpicklable("bad thing", thing=lambda: 0))
    assert isinstance(odd, APIError) and odd.status == 400 and "bad thing" in odd.message
    api = pickle.loads(pickle.dumps(portable_error(APIError(503, "busy", code="compiler_busy", type="server_error"))))
    assert (api.status, api.message, api.code, api.type) == (503, "busy", "compiler_busy", "server_error")


def test_a_fronts_calls_carry_its_client_and_group_to_the_engine_process() -> None:
    """The engine process runs a front's prepare (the compile gate) and complete (the slots)
    under the client and group the front's request had, so both are shared fairly between
    clients as in one process (engine/waiting.py, async_bridge.CompileGate)."""
    import contextvars

    from structgen.engine.request import request_client, request_group
    from structgen_server.engine_client import EngineClient
    from structgen_server.engine_host import FrontLink
    from structgen_server.engine_link import Admission

    sent: list[tuple[str, tuple[Any, ...]]] = []

    async def call(kind: str, *args: Any) -> Any:
        sent.append((kind, pickle.loads(pickle.dumps(args))))  # as the link carries them

    front = EngineClient.__new__(EngineClient)
    front.call = call
    seen: list[tuple[str, Any, Any]] = []

    class Engine:
        async def aprepare(self, output_type: Any, *, strict: bool) -> Any:
            seen.append(("prepare", request_group.get(), request_client.get()))
            return output_type

        async def acomplete(self, output_type: Any, prompt: Any, **options: Any) -> Any:
            seen.append(("complete", request_group.get(), request_client.get()))
            raise StructgenError("enough")

    link = FrontLink.__new__(FrontLink)
    link.llm, link.host = Engine(), type("Host", (), {"keep": staticmethod(lambda c: c),
                                                    "resolve": staticmethod(lambda c: c)})()

    async def main() -> None:
        request_group.set("http-7")
        request_client.set("203.0.113.9")
        await front.aprepare("schema")
        await front.acomplete("schema", "hi")
        assert [args[0] for _, args in sent] == [Admission("http-7", "203.0.113.9")] * 2
        # each as a task of the engine process, in whose context nothing is set
        await contextvars.Context().run(asyncio.ensure_future, link._prepare(1, *sent[0][1]))
        with pytest.raises(StructgenError):
            await contextvars.Context().run(asyncio.ensure_future, link._complete(2, *sent[1][1]))

    asyncio.run(main())
    assert seen == [("prepare", "http-7", "203.0.113.9"), ("complete", "http-7", "203.0.113.9")]
