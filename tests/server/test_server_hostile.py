"""The server against hostile and careless clients: a real `python -m structgen_server` with an
API key and a 6 GB address-space limit, started once for the module. Every case asserts the
status, the error's wording (what to fix) and that a good request sent right after is served in
its normal time: no request can hurt the others."""

from __future__ import annotations

import json
import re
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from structgen.errors import (
    CompilerBusyError,
    ConstraintTooLargeError,
    EngineBusyError,
    EngineError,
    InvalidParameterError,
    OutputValidationError,
    StructgenError,
    UnsatisfiableConstraintError,
)
from structgen_server.errors import to_api_error
from structgen_server.guard import default_allowed_hosts, host_allowed
from structgen_server.process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
KEY = "hostile-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_SEQ_LEN = 2048
MAX_BODY = 8 * 1024 * 1024
CLIENT_ERROR_LIMIT = 200
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


@dataclass
class Server:
    process: ServerProcess
    client: httpx.Client  # one for the module: a new client per call costs tens of ms
    normal_s: float = 0.0  # how long a good request takes on this machine when the server is idle

    @property
    def root(self) -> str:
        return self.process.root

    def post(self, path: str, body: Any = None, *, headers: dict[str, str] | None = None,
             content: Any = None, timeout: float = 60) -> httpx.Response:
        headers = {"content-type": "application/json", **(AUTH if headers is None else headers)}
        if content is None:  # ASCII JSON: a lone surrogate travels as the escape \ud800
            content = json.dumps(body).encode()
        return self.client.post(f"{self.root}{path}", headers=headers, content=content, timeout=timeout)

    def get(self, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        return self.client.get(f"{self.root}{path}", headers=AUTH if headers is None else headers, timeout=10)

    def good_request_is_served(self) -> None:
        """A good request right now is answered 200 within its normal time (with slack for a
        loaded two-core machine)."""
        t0 = time.perf_counter()
        r = self.post("/v1/chat/completions", GOOD)
        took = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        assert took < 3 * self.normal_s + 2.0, f"good request took {took:.1f} s (normal {self.normal_s:.1f} s)"


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[Server]:
    # The module's own bad requests stay under the throttle's limit (tested from another address).
    args = ["--device", "cpu", "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch-size", "4",
            "--max-client-errors", str(CLIENT_ERROR_LIMIT), "--log-level", "warning"]
    with ServerProcess(args, env={"STRUCTGEN_API_KEY": KEY}, address_space_headroom=4 * 2**30) as process, httpx.Client() as client:
        s = Server(process, client)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            assert s.post("/v1/chat/completions", GOOD).status_code == 200
            times.append(time.perf_counter() - t0)
        s.normal_s = statistics.median(times)
        yield s


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The OpenAI-format error of a response, checked for shape."""
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err) and err["message"], err
    return err


def chat(**fields: Any) -> dict[str, Any]:
    return {**GOOD, **fields}


# --------------------------------------------------------------------------- bad bodies

# (name, path, body, status, code, param, words the message must contain)
BAD_BODIES: list[tuple[str, str, dict[str, Any], int, str, str | None, tuple[str, ...]]] = [
    ("stream as a string", "/v1/chat/completions", chat(stream="yes"), 400, "invalid_request", "stream", ("boolean", '"yes"')),
    ("max_tokens as a bool", "/v1/chat/completions", chat(max_tokens=True), 400, "invalid_request", "max_tokens", ("integer", "true")),
    ("n as a float", "/v1/chat/completions", chat(n=2.0), 400, "invalid_request", "n", ("integer",)),
    ("seed past 64 bits", "/v1/chat/completions", chat(seed=2**63), 400, "invalid_request", "seed", ("9223372036854775807",)),
    ("negative seed", "/v1/chat/completions", chat(seed=-1), 400, "invalid_request", "seed", ("greater than or equal to 0",)),
    ("tools on completions", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2, "tool_choice": "required",
     "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "unsupported_parameter", "tools",
     ("/v1/chat/completions",)),
    ("misspelled response_format", "/v1/chat/completions", chat(response_fromat={"type": "json_object"}),
     400, "unknown_field", "response_fromat", ("did you mean 'response_format'",)),
    ("misspelled response_format (2)", "/v1/chat/completions", chat(reponse_format={"type": "json_object"}),
     400, "unknown_field", "reponse_format", ("did you mean 'response_format'",)),
    ("misspelled guided_json", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2, "guided_jsn": {"type": "integer"}},
     400, "unknown_field", "guided_jsn", ("did you mean 'guided_json'",)),
    ("fan-out of 8,000 generations", "/v1/completions", {"model": MODEL, "prompt": ["a"] * 500, "n": 16, "max_tokens": 2},
     400, "too_many_generations", "prompt", ("8000", "at most 128", "split")),
    ("prompt that can never fit", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "a" * 3_000_000}]),
     400, "context_length_exceeded", "messages", ("3000", "characters", "shorten")),
    ("prompt over the context", "/v1/completions", {"model": MODEL, "prompt": "word " * 12_000, "max_tokens": 2},
     400, "context_length_exceeded", "prompt", (str(MAX_SEQ_LEN), "shorten the prompt")),
    ("lone surrogate in a message", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "bad \ud800 text"}]),
     400, "invalid_parameter", None, ("surrogate",)),
]


@pytest.mark.parametrize("case", BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_body_is_a_400_naming_the_fix(server: Server, case) -> None:
    _, path, body, status, code, param, words = case
    r = server.post(path, body)
    assert r.status_code == status, r.text
    err = error_of(r)
    assert err["code"] == code and (param is None or err["param"] == param), err
    for word in words:
        assert word.lower() in err["message"].lower(), err
    server.good_request_is_served()


def test_a_form_encoded_body_is_a_415_naming_the_content_type(server: Server) -> None:
    # what `curl -d '{...}'` sends without -H 'Content-Type: application/json'
    headers = {**AUTH, "content-type": "application/x-www-form-urlencoded"}
    r = server.post("/v1/chat/completions", content=json.dumps(GOOD).encode(), headers=headers)
    assert r.status_code == 415, r.text
    err = error_of(r)
    assert err["code"] == "unsupported_media_type" and "Content-Type: application/json" in err["message"], err
    server.good_request_is_served()


def test_unknown_extra_fields_stay_accepted(server: Server) -> None:
    r = server.post("/v1/chat/completions", chat(guided_decoding_backend="xgrammar", metadata={"a": "b"}, store=False))
    assert r.status_code == 200, r.text


# --------------------------------------------------------------------------- constraints
# These depend on the grammar layer refusing such constraints at compile time
# (UnsatisfiableConstraintError / ConstraintTooLargeError).

def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


SELF_REQUIRED = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}}}

# (name, body fields, code, words the message must contain)
BAD_CONSTRAINTS: list[tuple[str, dict[str, Any], str, tuple[str, ...]]] = [
    ("self-referential required schema", {"guided_json": SELF_REQUIRED}, "unsatisfiable_constraint", ("next",)),
    ("grammar with no finite output", {"grammar": 'root ::= "ab" root'}, "unsatisfiable_constraint", ("root",)),
    ("grammar with an empty language", {"grammar": 'root ::= root "a"'}, "unsatisfiable_constraint", ("root",)),
    ("schema nested 300 deep", {"guided_json": _nested(300)}, "constraint_too_large", ("depth",)),
    ("enum of 20,000 values", {"guided_json": {"enum": [f"v{i}" for i in range(20_000)]}}, "constraint_too_large", ("enum",)),
    ("regex of a lone surrogate", {"guided_regex": "\ud800"}, "invalid_constraint", ("surrogate",)),
    # Found while generating: SmolLM2's vocabulary has no token holding the byte 0xF1 that
    # starts U+40000, so after "0" no token can follow (both backends' masks dead-end).
    ("choice the vocabulary cannot spell", {"guided_choice": ["0\U00040000"]}, "unsatisfiable_constraint",
     ("vocabulary",)),
]


@pytest.mark.parametrize("case", BAD_CONSTRAINTS, ids=[c[0] for c in BAD_CONSTRAINTS])
def test_bad_constraint_is_a_400_at_compile_time(server: Server, case) -> None:
    _, fields, code, words = case
    t0 = time.perf_counter()
    r = server.post("/v1/chat/completions", chat(**fields), timeout=30)
    assert time.perf_counter() - t0 < 15
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["code"] == code, err
    for word in words:
        assert word.lower() in err["message"].lower(), err
    server.good_request_is_served()


def test_a_dead_end_found_while_streaming_is_an_error_event(server: Server) -> None:
    body = chat(guided_choice=["0\U00040000"], stream=True)
    with server.client.stream("POST", f"{server.root}/v1/chat/completions", headers=AUTH, json=body,
                              timeout=30) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "unsatisfiable_constraint" and "vocabulary" in err["message"], err
    server.good_request_is_served()


@pytest.mark.parametrize("exc", [RuntimeError("secret internals at 0x7f"), EngineError("forward pass failed: secret")])
def test_an_unexpected_exception_is_a_500_with_a_request_id_only(exc: Exception) -> None:
    err = to_api_error(exc)
    assert err.status == 500 and err.code == "internal_error"
    assert "secret" not in err.message and type(exc).__name__ not in err.message
    assert re.search(r"request id req_[0-9a-f]{16}", err.message)


@pytest.mark.parametrize("exc", [UnsatisfiableConstraintError("x"), ConstraintTooLargeError("x"),
                                 InvalidParameterError("x"), OutputValidationError("x"), StructgenError("x")])
def test_every_structgen_error_of_a_request_is_a_4xx(exc: Exception) -> None:
    err = to_api_error(exc)
    assert 400 <= err.status < 500 and err.type == "invalid_request_error" and err.message == "x"


@pytest.mark.parametrize("exc", [EngineBusyError("full"), CompilerBusyError("full")])
def test_a_busy_engine_or_compiler_is_a_503_to_retry_after_a_moment(exc: Exception) -> None:
    err = to_api_error(exc)
    assert err.status == 503 and err.message == "full" and err.headers == {"retry-after": "1"}


# --------------------------------------------------------------------------- size and time


def test_body_over_the_limit_is_a_413_by_content_length(server: Server) -> None:
    r = server.post("/v1/chat/completions", content=b"x" * (MAX_BODY + 1))
    assert r.status_code == 413
    err = error_of(r)
    assert err["code"] == "request_too_large" and "--max-body-bytes" in err["message"]
    server.good_request_is_served()
    # a declared length over the limit, the body never sent: answered, and the connection closed
    host, port = server.root.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):  # ends when the server closes the connection
            answer += chunk
    head = answer.split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 413") and b"connection: close" in head, head


def test_streamed_body_over_the_limit_is_a_413_while_reading(server: Server) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
        for _ in range(MAX_BODY // 65536 + 2):
            yield b" " * 65536

    r = server.post("/v1/chat/completions", content=chunks())
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    server.good_request_is_served()


def test_huge_prompts_do_not_stall_other_requests(server: Server) -> None:
    """Prompts of megabytes are refused by their length before any tokenizing: /health
    answers at once while several are in flight."""
    body = {"model": MODEL, "prompt": "lorem ipsum " * 650_000, "max_tokens": 2}  # 7.8 MB
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(server.post("/v1/completions", body).status_code))
               for _ in range(4)]
    for t in threads:
        t.start()
    worst = 0.0
    while any(t.is_alive() for t in threads):
        t0 = time.perf_counter()
        assert server.get("/health", headers={}).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert results == [400] * 4
    assert worst < 1.0, f"/health took {worst:.2f} s while long prompts were tokenized"
    server.good_request_is_served()


def test_a_conversation_of_more_messages_or_tool_call_text_than_the_context_holds_is_refused_at_once(
        server: Server) -> None:
    """Each message renders to a token at least, and past tool calls are prompt text too: a body of
    many tiny messages (20 s of chat template for 250,000) or of huge tool-call arguments is
    refused before rendering, naming the field."""
    many = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 100_000, "max_tokens": 2}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "x" * (MAX_SEQ_LEN * 40)}}
    history = {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
    for body, says in ((many, "100000 messages"), (history, "characters")):
        t0 = time.perf_counter()
        r = server.post("/v1/chat/completions", body)
        assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text
        assert says in error_of(r)["message"] and error_of(r)["param"] == "messages"
        assert time.perf_counter() - t0 < 5.0
    server.good_request_is_served()


def _idle(server: Server) -> bool:
    health = server.get("/health", headers={}).json()
    return health["running"] == 0 and health["waiting"] == 0


def test_a_fan_out_does_not_starve_a_normal_request(server: Server) -> None:
    """128 generations (the cap) of one request queue on 4 slots; a normal request sent after
    them is admitted at the next free slot, not after all of them."""
    fan_out = {"model": MODEL, "prompt": [f"List {i}:" for i in range(8)], "n": 16, "max_tokens": 8,
               "temperature": 1.0, "seed": 1}
    outcome: list[Any] = []

    def send() -> None:
        try:  # the client gives up: the server aborts what is left of it
            outcome.append(httpx.post(f"{server.root}/v1/completions", json=fan_out, headers=AUTH, timeout=8).status_code)
        except httpx.ReadTimeout:
            outcome.append("gave up")

    thread = threading.Thread(target=send)
    thread.start()
    deadline = time.monotonic() + 10
    while server.get("/health", headers={}).json()["waiting"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.perf_counter()
    r = server.post("/v1/chat/completions", GOOD)
    took = time.perf_counter() - t0
    assert r.status_code == 200
    assert thread.is_alive(), "the fan-out finished first: the test did not load the server"
    thread.join()
    assert took < 3 * server.normal_s + 4.0, f"normal request took {took:.1f} s behind a fan-out"
    deadline = time.monotonic() + 20
    while not _idle(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _idle(server), "the abandoned fan-out still holds the engine"
    server.good_request_is_served()


@pytest.mark.parametrize("head", [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon in this header\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: twelve\r\n\r\n",
])  # fmt: skip
def test_a_malformed_request_head_is_a_json_400_and_the_connection_closes(server: Server, head: bytes) -> None:
    with socket.create_connection((server.process.host, server.process.port), timeout=10) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):  # ends when the server closes the connection
            answer += chunk
    status_and_headers, _, body = answer.partition(b"\r\n\r\n")
    assert status_and_headers.startswith(b"HTTP/1.1 400"), answer
    assert b"content-type: application/json" in status_and_headers.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "malformed_request" and "request line or headers" in err["message"]
    server.good_request_is_served()


def test_half_open_connections_are_dropped(server: Server) -> None:
    silent = socket.create_connection((server.process.host, server.process.port))
    partial = socket.create_connection((server.process.host, server.process.port))
    partial.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    server.good_request_is_served()  # served while both are held
    for conn in (silent, partial):
        conn.settimeout(20)
        t0 = time.perf_counter()
        assert conn.recv(100) == b""  # closed by the server
        assert time.perf_counter() - t0 < 15
        conn.close()


# --------------------------------------------------------------------------- access


def test_the_key_is_checked_before_the_body_is_read(server: Server) -> None:
    r = server.post("/v1/chat/completions", content=b"x" * (MAX_BODY + 1), headers={})
    assert r.status_code == 401
    err = error_of(r)
    assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
    assert server.post("/v1/chat/completions", GOOD, headers={"authorization": "Bearer wrong"}).status_code == 401
    server.good_request_is_served()


def test_the_bearer_scheme_is_case_insensitive(server: Server) -> None:
    r = server.post("/v1/chat/completions", GOOD, headers={"authorization": f"bearer {KEY}"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/metrics", "/v1/models"])
def test_every_route_but_health_needs_the_key(server: Server, path: str) -> None:
    r = server.get(path, headers={})
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    assert server.get(path).status_code == 200
    assert server.get("/health", headers={}).status_code == 200


@pytest.mark.parametrize("host", ["evil.example:80", "attacker.test", "127.0.0.1.nip.io:8000"])
def test_a_foreign_host_header_is_refused_on_loopback(server: Server, host: str) -> None:
    r = server.get("/v1/models", headers={**AUTH, "host": host})
    assert r.status_code == 421
    err = error_of(r)
    assert err["code"] == "host_not_allowed" and "--allowed-hosts" in err["message"]
    for ok in (f"localhost:{server.process.port}", f"127.0.0.1:{server.process.port}"):
        assert server.get("/v1/models", headers={**AUTH, "host": ok}).status_code == 200


def test_a_client_whose_requests_keep_failing_is_refused_before_its_body_is_read(server: Server) -> None:
    # From another loopback address: the throttle counts by client address.
    transport = httpx.HTTPTransport(local_address="127.0.0.3")
    with httpx.Client(transport=transport, base_url=server.root, headers=AUTH, timeout=30) as other:
        statuses = [other.post("/v1/chat/completions", content=b"{not json",
                               headers={"content-type": "application/json"}).status_code
                    for _ in range(CLIENT_ERROR_LIMIT + 5)]
        assert statuses[:CLIENT_ERROR_LIMIT] == [400] * CLIENT_ERROR_LIMIT
        assert statuses[CLIENT_ERROR_LIMIT:] == [429] * 5
        r = other.post("/v1/chat/completions", json=GOOD)  # even a good one, for the window
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 10
        err = error_of(r)
        assert err["code"] == "too_many_failed_requests" and "400" in err["message"], err
        assert other.get("/health").status_code == 200
    server.good_request_is_served()  # the other clients are not affected


# --------------------------------------------------------------------------- metrics

_SAMPLE = re.compile(r'^[a-z_]+(\{([a-z_]+="([^"\\\n]|\\.)*",?)*\})? [0-9.e+-]+$')


def _metrics(server: Server) -> str:
    return server.get("/metrics").text


def test_metrics_stay_well_formed_and_bounded_under_unknown_paths(server: Server) -> None:
    server.get("/x")
    before = len(_metrics(server))
    for i in range(200):
        assert server.get(f'/p{i}"\\{{}}').status_code == 404
    text = _metrics(server)
    bad = [line for line in text.splitlines() if line and not line.startswith("#") and not _SAMPLE.match(line)]
    assert not bad, bad[:3]
    assert len(text) - before < 200, "unknown paths added series"
    assert re.search(r'endpoint="unknown",status="404"\} ([0-9]+)', text)
    server.good_request_is_served()


def test_a_rejected_request_is_counted_with_a_fixed_label(server: Server) -> None:
    server.post("/v1/chat/completions", chat(max_tokens="ten"))
    text = _metrics(server)
    assert re.search(r'endpoint="chat",status="400"\} [1-9]', text)
    assert json.dumps("ten") not in text


# --------------------------------------------------------------------------- configuration


def test_host_allow_list_defaults_to_loopback_names_with_the_port() -> None:
    allowed = default_allowed_hosts("127.0.0.1", 8000)
    assert allowed is not None
    assert host_allowed("localhost:8000", allowed) and host_allowed("[::1]:8000", allowed)
    assert not host_allowed("localhost:9000", allowed) and not host_allowed("evil.test:8000", allowed)
    assert default_allowed_hosts("0.0.0.0", 8000) is None
    assert host_allowed("api.example.com:443", frozenset({"api.example.com"}))


def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch) -> None:
    from structgen.cli import _api_key, build_parser

    def key(*argv: str) -> str | None:
        return _api_key(build_parser().parse_args(["serve", *argv]))

    (tmp_path / "key").write_text("from-file\n")
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("STRUCTGEN_API_KEY", "from-env")
    assert key("--api-key-file", str(tmp_path / "key")) == "from-file"
    assert key() == "from-env"
    with pytest.raises(InvalidParameterError, match="is empty"):
        key("--api-key-file", str(tmp_path / "empty"))
    with pytest.raises(InvalidParameterError, match="not both"):
        key("--api-key-file", str(tmp_path / "key"), "--api-key", "x")
    monkeypatch.delenv("STRUCTGEN_API_KEY")
    assert key() is None
