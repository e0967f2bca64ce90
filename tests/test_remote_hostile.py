"""`RemoteLLM` against servers that misbehave: a fake HTTP server on a loopback port answers
each request with raw bytes (silence, a trickle, gigabytes, HTML, broken JSON or event
streams, error statuses, 429s, redirects, output that ignores the schema). Every case ends in
a structgen exception that names the problem, within the client's limits, through the sync,
async and streaming paths."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pydantic
import pytest

from structgen.errors import EngineError, InvalidParameterError, OutputValidationError
from structgen.remote import RemoteLLM
from structgen.tools import tool

KEY = "sk-secret-key"
MIB = 1024 * 1024


class Person(pydantic.BaseModel):
    name: str
    age: int


# -- the fake server -------------------------------------------------------------------------
@dataclass
class Seen:
    """One request as the fake server read it; `index` counts the server's requests from 0."""

    index: int
    path: str
    headers: dict[str, str]  # names lower-cased
    body: dict[str, Any]


class Wire:
    """The fake server's end of one connection."""

    def __init__(self, conn: socket.socket, server: FakeServer):
        self.conn, self.server = conn, server

    def send(self, data: bytes | str) -> None:
        data = data.encode() if isinstance(data, str) else data
        self.conn.sendall(data)
        self.server.sent += len(data)

    def wait_for_hangup(self) -> None:
        self.conn.settimeout(30)
        self.conn.recv(1)


Reply = Callable[[Seen, Wire], None]


class FakeServer:
    """HTTP/1.1 on a free loopback port: each request is read whole, kept in `seen`, and
    answered by `reply` with raw bytes (one connection per request); `sent` counts bytes out."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.seen: list[Seen] = []
        self.sent = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.origin = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.url = self.origin + "/v1"
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            reader = conn.makefile("rb")
            path = reader.readline().split()[1].decode()
            headers = {}
            while (line := reader.readline().strip()) != b"":
                name, _, value = line.decode().partition(":")
                headers[name.lower()] = value.strip()
            body = reader.read(int(headers.get("content-length", 0)))
            seen = Seen(len(self.seen), path, headers, json.loads(body) if body else {})
            self.seen.append(seen)
            try:
                self.reply(seen, Wire(conn, self))
            except OSError:
                pass  # the client hung up, as it should on a hostile reply


@pytest.fixture
def serve() -> Iterator[Callable[[Reply], FakeServer]]:
    servers: list[FakeServer] = []

    def start(reply: Reply) -> FakeServer:
        servers.append(FakeServer(reply))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def http(status: int, body: Any, headers: dict[str, str] | None = None) -> bytes:
    """A whole response: `body` as is where bytes or str, else as JSON."""
    data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    head = {"content-type": "application/json", "content-length": str(len(data)), "connection": "close", **(headers or {})}
    return f"HTTP/1.1 {status} Status\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + b"\r\n" + data


def events(*items: Any, done: bool = True) -> bytes:
    """An event stream of `items` (JSON unless str), then `[DONE]` where `done`."""
    lines = [f"data: {i if isinstance(i, str) else json.dumps(i)}\n\n" for i in items]
    return http(200, "".join(lines) + ("data: [DONE]\n\n" if done else ""), {"content-type": "text/event-stream"})


def chat(content: Any, finish_reason: Any = "stop", **message: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content, **message},
                         "finish_reason": finish_reason}]}


def delta(content: Any, finish_reason: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish_reason}]}


def answer(content: str) -> Reply:
    """A well-behaved reply of `content`: one JSON body, or deltas when the request streams."""

    def reply(seen: Seen, wire: Wire) -> None:
        if seen.body.get("stream"):
            wire.send(events(delta(content[: len(content) // 2]), delta(content[len(content) // 2 :], "stop")))
        else:
            wire.send(http(200, chat(content)))

    return reply


def then(first: Reply, later: Reply, times: int) -> Reply:
    """`first` for the first `times` requests, `later` after."""
    return lambda seen, wire: (first if seen.index < times else later)(seen, wire)


# -- the ways to ask --------------------------------------------------------------------------
def sync_generate(llm: RemoteLLM, output_type: Any) -> Any:
    return llm.generate(output_type, "p")


def async_generate(llm: RemoteLLM, output_type: Any) -> Any:
    return asyncio.run(llm.agenerate(output_type, "p"))


def sync_stream(llm: RemoteLLM, output_type: Any) -> Any:
    stream = llm.stream(output_type, "p")
    list(stream)
    return stream.completion.value


def async_stream(llm: RemoteLLM, output_type: Any) -> Any:
    async def run() -> Any:
        stream = llm.astream(output_type, "p")
        _ = [d async for d in stream]
        return stream.completion.value

    return asyncio.run(run())


Way = Callable[[RemoteLLM, Any], Any]
PLAIN: list[Way] = [sync_generate, async_generate]
STREAMED: list[Way] = [sync_stream, async_stream]
EVERY_WAY = PLAIN + STREAMED


class Attempt(threading.Thread):
    """One call on its own daemon thread, so that a hang fails the test instead of stalling it."""

    def __init__(self, call: Callable[[], Any]):
        super().__init__(daemon=True)
        self.call = call
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.call()
        except BaseException as e:
            self.error = e


def outcome(call: Callable[[], Any], within_s: float = 5.0) -> tuple[Any, BaseException | None, float]:
    """(value, error, seconds) of `call()`; fails the test where it runs past `within_s`."""
    attempt, t0 = Attempt(call), time.monotonic()
    attempt.start()
    attempt.join(within_s)
    if attempt.is_alive():
        pytest.fail(f"still running after {within_s} s: the client hangs")
    return attempt.value, attempt.error, time.monotonic() - t0


def raises(cls: type[BaseException], match: str, call: Callable[[], Any], within_s: float = 5.0) -> tuple[BaseException, float]:
    """The error `call()` raised, checked to be a `cls` whose message matches `match`."""
    value, error, seconds = outcome(call, within_s)
    assert error is not None, f"returned {value!r} instead of raising {cls.__name__}"
    assert type(error) is cls, f"raised {type(error).__name__}: {error}"
    assert re.search(match, str(error)), f"{match!r} not in: {error}"
    return error, seconds


# -- time -------------------------------------------------------------------------------------
def silent(seen: Seen, wire: Wire) -> None:
    wire.wait_for_hangup()


def trickle(seen: Seen, wire: Wire) -> None:
    """Headers of a reply that ends when the connection does, then a space every 20 ms: every
    read gets a byte in time."""
    wire.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
    for _ in range(1500):
        wire.send(b" ")
        time.sleep(0.02)


def stall_after_headers(seen: Seen, wire: Wire) -> None:
    """Headers after three quarters of the client's timeout, then nothing."""
    time.sleep(0.45)
    wire.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 100\r\n\r\n")
    wire.wait_for_hangup()


@pytest.mark.parametrize("way", EVERY_WAY)
@pytest.mark.parametrize("reply", [silent, trickle, stall_after_headers])
def test_a_reply_that_never_ends_is_cut_at_the_timeout(serve, reply: Reply, way: Way) -> None:
    server = serve(reply)
    llm = RemoteLLM(server.url, "m", timeout=0.6)
    _, seconds = raises(EngineError, r"no complete reply .* within timeout=0.6 s.*raise timeout=", lambda: way(llm, str))
    assert 0.5 < seconds < 0.9


def test_a_cancelled_acomplete_hangs_up_at_once_and_keeps_no_thread_busy(serve) -> None:
    hangups = threading.Semaphore(0)

    def stall_then_note_the_hangup(seen: Seen, wire: Wire) -> None:
        stall_after_headers(seen, wire)
        hangups.release()

    server = serve(stall_then_note_the_hangup)
    llm = RemoteLLM(server.url, "m", timeout=60)

    async def cancelled() -> list[Any]:
        calls = [asyncio.wait_for(llm.acomplete(Person, "p"), 0.8) for _ in range(3)]  # past the 0.45 s of headers
        return await asyncio.gather(*calls, return_exceptions=True)

    # asyncio.run returns only once its worker threads are done, so a thread still reading would hold it.
    results, error, seconds = outcome(lambda: asyncio.run(cancelled()), within_s=5)
    assert error is None and [type(r) for r in results] == [TimeoutError] * 3 and seconds < 2
    assert all(hangups.acquire(timeout=2) for _ in range(3)), "a cancelled call kept its connection open"


def test_async_calls_on_one_event_loop_reuse_its_connection() -> None:
    # One connection a call would cost a TLS handshake a call against a remote API.
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    connections: list[str] = []
    reply = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()

    class KeepAlive(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            connections.append(str(self.client_address))
            super().setup()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    llm = RemoteLLM(f"http://127.0.0.1:{server.server_port}/v1", "m")

    async def calls() -> list[str]:
        texts = [(await llm.acomplete(str, "p")).text for _ in range(3)]
        await llm.aclose()
        return texts

    try:
        assert asyncio.run(calls()) == ["hi"] * 3 and len(connections) == 1, connections
    finally:
        server.shutdown()


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), None])
def test_the_limits_must_be_numbers_that_bound(value: Any) -> None:
    for kw in ("timeout", "max_response_bytes", "max_retries"):
        if kw == "max_retries" and value == 0:
            continue  # no retries is a fine choice
        with pytest.raises(InvalidParameterError, match=kw):
            RemoteLLM("http://127.0.0.1:9", "m", **{kw: value})


# -- size -------------------------------------------------------------------------------------
def declared_2gb(seen: Seen, wire: Wire) -> None:
    wire.send(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2000000000\r\n\r\n")
    while True:
        wire.send(b" " * 65536)


def endless_without_newlines(seen: Seen, wire: Wire) -> None:
    wire.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: ")
    while True:
        wire.send(b"x" * 65536)


def endless_events(seen: Seen, wire: Wire) -> None:
    wire.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
    event = f"data: {json.dumps(delta('x' * 100))}\n\n".encode() * 500
    while True:
        wire.send(event)


@pytest.mark.parametrize("way", EVERY_WAY)
@pytest.mark.parametrize("reply", [declared_2gb, endless_without_newlines, endless_events])
def test_a_huge_or_endless_reply_is_refused_at_max_response_bytes(serve, reply: Reply, way: Way) -> None:
    server = serve(reply)
    llm = RemoteLLM(server.url, "m", max_response_bytes=MIB)
    raises(EngineError, r"more than max_response_bytes=1048576", lambda: way(llm, str))
    assert server.sent < 32 * MIB  # what the socket buffers hold besides the 1 MiB read


# -- malformed replies ------------------------------------------------------------------------
@pytest.mark.parametrize("way", PLAIN)
@pytest.mark.parametrize(
    "body, match",
    [
        (b'{"choices": [', r"not JSON .*'\{\"choices\": \['"),
        (b"<html><body><h1>Welcome to nginx!</h1></body></html>", r"not JSON \(text/html\).*Welcome to nginx"),
        (b"[" * 100_000, r"not JSON"),
        (b"", r"not JSON"),
        (b'{"choices": [{"message": {"content": "\xff\xfe"}}]}', r"not UTF-8"),
    ],
    ids=["cut-json", "html", "deep-nesting", "empty", "invalid-utf8"],
)
def test_a_body_that_is_not_json_says_so_with_an_excerpt(serve, body: bytes, match: str, way: Way) -> None:
    content_type = "text/html" if body.startswith(b"<html") else "application/json"
    server = serve(lambda seen, wire: wire.send(http(200, body, {"content-type": content_type})))
    error, _ = raises(EngineError, match, lambda: way(RemoteLLM(server.url, "m"), int))
    assert len(str(error)) < 800


@pytest.mark.parametrize("way", PLAIN)
@pytest.mark.parametrize(
    "body",
    [{}, [1, 2], {"choices": []}, {"choices": "x"}, {"choices": [1]}, {"choices": [{"message": "hi"}]},
     chat(5), chat("1", finish_reason=7)],
    ids=["empty-object", "list", "no-choices", "choices-str", "choice-int", "message-str", "content-int", "finish-int"],
)
def test_a_reply_of_the_wrong_shape_is_named_not_openai_compatible(serve, body: Any, way: Way) -> None:
    server = serve(lambda seen, wire: wire.send(http(200, body)))
    raises(EngineError, r"not an OpenAI-compatible reply.*expected", lambda: way(RemoteLLM(server.url, "m"), int))


@pytest.mark.parametrize("usage", [[1], {"prompt_tokens": "many", "prompt_tokens_details": [1]}])
def test_usage_of_the_wrong_shape_leaves_the_stats_unknown(serve, usage: Any) -> None:
    server = serve(lambda seen, wire: wire.send(http(200, {**chat("1"), "usage": usage})))
    done = RemoteLLM(server.url, "m").complete(int, "p")
    assert done.value == 1 and done.stats.prompt_tokens is None and done.stats.cached_prompt_tokens is None


def test_a_model_list_of_the_wrong_shape_is_named_not_openai_compatible(serve) -> None:
    server = serve(lambda seen, wire: wire.send(http(200, {"data": "x"})))
    raises(EngineError, r"not an OpenAI-compatible reply", RemoteLLM(server.url, "m").models)


@pytest.mark.parametrize("way", STREAMED)
@pytest.mark.parametrize(
    "reply, match",
    [
        (http(200, ": comment\n\nevent: ping\n\n", {"content-type": "text/event-stream"}), r"ended before .*finished"),
        (events(delta("1"), done=False), r"ended before .*finished"),
        (http(200, chat("1")), r"ended before .*application/json"),
        (events("{oops"), r"not JSON"),
        (events({"choices": "x"}), r"not an OpenAI-compatible reply"),
        (events([1]), r"not an OpenAI-compatible reply"),
        (events({"choices": [{"delta": "x"}]}), r"not an OpenAI-compatible reply"),
        (events(delta(5)), r"not an OpenAI-compatible reply"),
        (http(200, b'data: {"choices": [{"delta": {"content": "\xff"}}]}\n\n', {"content-type": "text/event-stream"}),
         r"not UTF-8"),
    ],
    ids=["no-data-lines", "no-done-no-finish", "json-not-sse", "event-not-json", "choices-str", "event-list",
         "delta-str", "content-int", "invalid-utf8"],
)
def test_a_broken_event_stream_says_what_is_wrong(serve, reply: bytes, match: str, way: Way) -> None:
    server = serve(lambda seen, wire: wire.send(reply))
    raises(EngineError, match, lambda: way(RemoteLLM(server.url, "m"), int))


@pytest.mark.parametrize("way", STREAMED)
def test_a_stream_with_a_finish_reason_but_no_done_is_complete(serve, way: Way) -> None:
    server = serve(lambda seen, wire: wire.send(events(delta("4"), delta("2", "stop"), done=False)))
    assert way(RemoteLLM(server.url, "m"), int) == 42


def done_then_silence(seen: Seen, wire: Wire) -> None:
    """A whole stream, then a connection left open as if more were to come."""
    wire.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 100000\r\n\r\n")
    wire.send(f"data: {json.dumps(delta('42', 'stop'))}\n\ndata: [DONE]\n\n")
    wire.wait_for_hangup()


@pytest.mark.parametrize("way", STREAMED)
def test_a_stream_is_whole_at_done_though_the_connection_stays_open(serve, way: Way) -> None:
    server = serve(done_then_silence)
    assert outcome(lambda: way(RemoteLLM(server.url, "m", timeout=3), int), within_s=1)[:2] == (42, None)


# -- error statuses, retries, redirects -------------------------------------------------------
def endless_error(seen: Seen, wire: Wire) -> None:
    wire.send(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\ncontent-length: 2000000000\r\n\r\n")
    while True:
        wire.send(b"oops " * 10000)


@pytest.mark.parametrize("way", EVERY_WAY)
@pytest.mark.parametrize(
    "reply, cls, match",
    [
        (http(400, {"error": {"message": "max_tokens is too large", "type": "invalid_request_error"}}),
         InvalidParameterError, r"returned 400: max_tokens is too large"),
        (http(500, {"error": {"message": "CUDA out of memory"}}), EngineError, r"returned 500: CUDA out of memory"),
        (http(502, "<html><h1>502 Bad Gateway</h1></html>", {"content-type": "text/html"}), EngineError,
         r"returned 502: .*Bad Gateway"),
        (http(401, {"error": "invalid key"}), InvalidParameterError, r"returned 401: invalid key.*api_key"),
        (endless_error, EngineError, r"returned 500: oops oops"),
    ],
    ids=["400-openai", "500-openai", "502-html", "401", "500-2gb"],
)
def test_an_error_status_is_a_structgen_error_with_the_servers_words(serve, reply: Any, cls: type, match: str, way: Way) -> None:
    server = serve(reply if callable(reply) else lambda seen, wire: wire.send(reply))
    error, _ = raises(cls, match, lambda: way(RemoteLLM(server.url, "m", api_key=KEY), int))
    assert len(str(error)) < 1500 and server.sent < 32 * MIB


def busy(status: int, retry_after: str) -> Reply:
    return lambda seen, wire: wire.send(http(status, {"error": {"message": "slow down"}}, {"retry-after": retry_after}))


@pytest.mark.parametrize("way", EVERY_WAY)
def test_a_busy_server_is_asked_again_as_retry_after_says(serve, way: Way) -> None:
    server = serve(then(busy(429, "0"), answer("42"), times=2))
    assert way(RemoteLLM(server.url, "m"), int) == 42
    assert len(server.seen) == 3


def test_retry_after_is_waited_for(serve) -> None:
    server = serve(then(busy(503, "1"), answer("42"), times=1))
    value, error, seconds = outcome(lambda: RemoteLLM(server.url, "m").generate(int, "p"))
    assert (value, error, len(server.seen)) == (42, None, 2) and seconds > 0.9


@pytest.mark.parametrize("way", EVERY_WAY)
@pytest.mark.parametrize("status", [429, 503])
def test_retries_are_bounded_by_max_retries(serve, status: int, way: Way) -> None:
    server = serve(busy(status, "0"))
    raises(EngineError, rf"returned {status}: slow down .*3 times.*max_retries=2",
           lambda: way(RemoteLLM(server.url, "m", max_retries=2), int))
    assert len(server.seen) == 3


def test_a_throttled_client_is_not_retried(serve) -> None:
    # Our server's throttle answers 429 to a client whose requests keep failing: a retry
    # would only keep it throttled.
    throttled = {"error": {"message": "too many failed requests", "code": "too_many_failed_requests"}}
    server = serve(lambda seen, wire: wire.send(http(429, throttled, {"retry-after": "0"})))
    raises(EngineError, "429: too many failed requests", lambda: RemoteLLM(server.url, "m").generate(int, "p"))
    assert len(server.seen) == 1


@pytest.mark.parametrize("way", EVERY_WAY)
def test_a_retry_after_past_the_timeout_is_not_waited_for(serve, way: Way) -> None:
    server = serve(busy(429, "3600"))
    _, seconds = raises(EngineError, r"returned 429: slow down.*asks to wait 3600 s.*timeout=5",
                        lambda: way(RemoteLLM(server.url, "m", timeout=5), int))
    assert seconds < 1 and len(server.seen) == 1


@pytest.mark.parametrize("way", EVERY_WAY)
@pytest.mark.parametrize("status", [302, 307, 308])
def test_a_redirect_is_not_followed_so_the_key_stays_with_base_url(serve, status: int, way: Way) -> None:
    elsewhere = serve(answer("42"))
    location = elsewhere.url + "/chat/completions"
    server = serve(lambda seen, wire: wire.send(http(status, "", {"location": location})))
    raises(EngineError, rf"returned {status}: a redirect to {location}.*base_url",
           lambda: way(RemoteLLM(server.url, "m", api_key=KEY), int))
    assert server.seen[0].headers["authorization"] == f"Bearer {KEY}"
    assert elsewhere.seen == []


# -- output that ignores the requested type ---------------------------------------------------
@pytest.mark.parametrize("way", EVERY_WAY)
@pytest.mark.parametrize(
    "output_type, text",
    [
        (Person, "Sure! Here is the person you asked for: " + "blah " * 2000),
        (Person, '{"name": 5, "age": "old"}'),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, json.dumps(["x" * 10_000])),
    ],
    ids=["prose", "wrong-types", "jsonschema-big-instance"],
)
def test_text_that_ignores_the_type_is_an_output_error_with_an_excerpt(serve, output_type: Any, text: str, way: Way) -> None:
    server = serve(answer(text))
    error, _ = raises(OutputValidationError, r"returned text that does not match the requested type",
                      lambda: way(RemoteLLM(server.url, "m"), output_type))
    assert len(str(error)) < 1500 and text[:40] in str(error) and error.text == text


def refuse(seen: Seen, wire: Wire) -> None:
    """A refusal as OpenAI sends it: `message.refusal`, or in a stream `refusal` deltas (the
    first one empty) beside a null `content`."""
    words = "I can't help with that."
    if not seen.body.get("stream"):
        wire.send(http(200, chat(None, refusal=words)))
        return
    pieces = [{"role": "assistant", "content": None, "refusal": ""}, {"refusal": words[:6]}, {"refusal": words[6:]}, {}]
    chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": "stop" if not d else None}]} for d in pieces]
    wire.send(events(*chunks))


@pytest.mark.parametrize("way", EVERY_WAY)
def test_a_refusal_is_an_output_error_that_quotes_it(serve, way: Way) -> None:
    server = serve(refuse)
    error, _ = raises(OutputValidationError, r'refused: "I can\'t help with that."',
                      lambda: way(RemoteLLM(server.url, "m"), Person))
    assert error.stats is not None


# -- tool calls -------------------------------------------------------------------------------
@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def tool_call(name: Any, arguments: Any) -> dict[str, Any]:
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return chat(None, "tool_calls", tool_calls=[call])


@pytest.mark.parametrize(
    "body, cls, match",
    [
        (tool_call("add", '{"a": 1, "b":'), OutputValidationError, r"arguments of 'add' are not JSON: '\{\"a\": 1, \"b\":'"),
        (tool_call("add", "[1, 2]"), OutputValidationError, r"arguments of 'add' are not a JSON object"),
        (tool_call("add", '{"a": "one", "b": 2}'), OutputValidationError, r"arguments of 'add' do not validate"),
        (tool_call("rm_rf" * 1000, "{}"), OutputValidationError, r"unknown tool 'rm_rfrm_rf.*'add'"),
        (tool_call(5, "{}"), EngineError, r"not an OpenAI-compatible reply"),
        (tool_call("add", {"a": 1, "b": 2}), EngineError, r"not an OpenAI-compatible reply"),
        (chat(None, "tool_calls", tool_calls="add"), EngineError, r"not an OpenAI-compatible reply"),
        (chat(None, "tool_calls", tool_calls=[{"id": "x"}]), EngineError, r"not an OpenAI-compatible reply"),
    ],
    ids=["args-cut-json", "args-list", "args-invalid", "unknown-tool", "name-int", "args-object", "calls-str",
         "no-function"],
)
def test_a_bad_tool_call_is_named(serve, body: Any, cls: type, match: str) -> None:
    server = serve(lambda seen, wire: wire.send(http(200, body)))
    error, _ = raises(cls, match, lambda: RemoteLLM(server.url, "m").call("p", tools=[add]))
    assert len(str(error)) < 1500


def test_a_good_tool_call_still_works(serve) -> None:
    server = serve(lambda seen, wire: wire.send(http(200, tool_call("add", '{"a": 1, "b": 2}'))))
    calls = RemoteLLM(server.url, "m").call("p", tools=[add])
    assert [c.invoke() for c in calls] == [3]
