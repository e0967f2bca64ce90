"""Data-parallel replicas (structgen_server/replicas.py): `structgen serve --data-parallel 2`
on the CPU answers through one front end, spreads concurrent requests over both engines,
and restarts a replica that dies while the request it was streaming ends with an error
naming it. The replicas serve conftest's tiny Llama (`tiny_llama_dir`), which loads in a
second, so three processes fit the test's budget."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from starlette.requests import Request

from structgen_server.process import ServerProcess
from structgen_server.replicas import (
    AFFINITY_SLACK_TOKENS,
    Replica,
    ReplicaSet,
    Route,
    forwarded_headers,
)
from tests.server.asgi_client import running

TOOL_CATALOGUE = [{"type": "function", "function": {"name": f"lookup_{i}", "description": "Look a record up " * 8,
                                                   "parameters": {"type": "object", "properties": {}}}}
                  for i in range(4)]


def _chat(max_tokens: int, **extra: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens, **extra}


def _with_system(system: str, question: str, max_tokens: int = 4) -> dict:
    return {"model": "tiny", "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


SYSTEM_A = "You are the billing assistant of Acme. Answer briefly and politely. " * 8
SYSTEM_B = "You are a weather bot for sailors; report wind and waves in knots and metres. " * 8


def test_requests_sharing_a_tool_catalogue_go_to_the_replica_that_served_it_until_it_is_too_busy():
    replicas = ReplicaSet([Replica(i, [], {}, up=True) for i in range(2)])

    def route(question: str) -> Route:
        body = {"model": "m", "tools": TOOL_CATALOGUE, "messages": [{"role": "user", "content": question}]}
        return Route.of(json.dumps(body).encode(), 64)

    first = replicas.pick(route("Find order 1."))
    other = replicas.pick(Route.of(json.dumps(_with_system(SYSTEM_B, "Wind?")).encode(), 64))
    assert other is not first  # a new prefix goes to the least loaded replica
    assert replicas.pick(route("Find order 2.")) is first  # the catalogue's replica, though busier
    first.outstanding = other.outstanding + AFFINITY_SLACK_TOKENS + 1
    assert replicas.pick(route("Find order 3.")) is other  # too busy: balance wins
    assert replicas.pick(route("Find order 4.")) is other  # and the prefix now lives there
    first.outstanding = other.outstanding = 0  # every request finished
    short = [replicas.pick(Route.of(json.dumps(_chat(4)).encode(), 64)) for _ in range(2)]
    assert short[0] is not short[1]  # prompts shorter than a block are balanced, not pinned


@pytest.mark.parametrize("body", [{"messages": 5}, {"messages": [{"role": "user", "content": [{"text": None}]}]},
                                  {"messages": [{"content": [{"type": "text", "text": 5}]}]}, {"tools": "x", "prompt": 3},
                                  ["not", "an", "object"]])
def test_the_front_end_routes_any_json_body_and_leaves_refusing_it_to_the_replica(body):
    """Routing reads only what is text: a malformed body goes to a replica, whose 400 names
    the problem, instead of failing the front end with a 500."""
    route = Route.of(json.dumps(body).encode(), 64)
    assert ReplicaSet([Replica(0, [], {}, up=True)]).pick(route) is not None


def test_a_replica_is_told_the_clients_address_and_not_the_one_a_client_claims():
    """The replica trusts X-Forwarded-For from the loopback front: the front sets it to the
    client's address (its throttle and fair admission then see clients), replacing any a client
    sent, and drops the hop-by-hop headers."""
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
             "headers": [(b"host", b"front:8000"), (b"x-forwarded-for", b"10.9.9.9"), (b"authorization", b"Bearer k"),
                         (b"connection", b"keep-alive")], "client": ("203.0.113.7", 5000)}
    assert forwarded_headers(Request(scope)) == {"x-forwarded-for": "203.0.113.7", "authorization": "Bearer k"}


@pytest.fixture(scope="module")
def replicated(tiny_llama_dir):
    with ServerProcess(["--data-parallel", "2", "--device", "cpu", "--model", str(tiny_llama_dir),
                        "--served-model-name", "tiny"], startup_timeout=240) as server:
        yield server


def _health(server: ServerProcess) -> dict:
    return httpx.get(f"{server.root}/health", timeout=10).json()


def test_concurrent_requests_are_answered_by_both_replicas(replicated):
    def post(_: int) -> int:
        return httpx.post(f"{replicated.url}/chat/completions", json=_chat(48), timeout=120).status_code

    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(post, range(4)))
    assert codes == [200] * 4
    replicas = _health(replicated)["replicas"]
    assert all(r["up"] and r["requests"] > 0 for r in replicas)  # the second went to the idle one
    assert all(r["outstanding_tokens"] == 0 for r in replicas)  # given back as each finished


def test_a_shared_system_prompt_keeps_its_requests_on_one_replica(replicated):
    before = [r["requests"] for r in _health(replicated)["replicas"]]
    url = f"{replicated.url}/chat/completions"
    bodies = [_with_system(SYSTEM_A, "Hi."), _with_system(SYSTEM_B, "Wind?"),
              _with_system(SYSTEM_B, "Waves?"), _with_system(SYSTEM_B, "Tide?")]
    assert [httpx.post(url, json=b, timeout=120).status_code for b in bodies] == [200] * 4
    served = [r["requests"] - b for r, b in zip(_health(replicated)["replicas"], before, strict=True)]
    assert sorted(served) == [1, 3]  # by load alone they would have alternated 2 and 2


def test_a_replica_that_dies_mid_stream_fails_its_request_and_is_restarted(replicated):
    with httpx.stream("POST", f"{replicated.url}/chat/completions", json=_chat(200, stream=True), timeout=120) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        busy = max(_health(replicated)["replicas"], key=lambda x: x["outstanding_tokens"])
        os.kill(busy["pid"], signal.SIGKILL)
        rest = [line for line in lines if line]
    assert "engine replica" in rest[-1] and "replica_failed" in rest[-1]
    # The other replica answers at once; the dead one comes back.
    assert httpx.post(f"{replicated.url}/chat/completions", json=_chat(4), timeout=120).status_code == 200
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        replicas = _health(replicated)["replicas"]
        if all(x["up"] for x in replicas) and replicas[busy["index"]]["restarts"] == 1:
            break
        time.sleep(0.5)
    assert replicas[busy["index"]]["up"] and replicas[busy["index"]]["pid"] != busy["pid"]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc (Linux)")
def test_replicas_stop_when_the_front_end_is_killed_outright(tiny_llama_dir):
    """A front end killed with SIGKILL, which gives it no time to stop its replicas, leaves
    no engine process behind: each replica watches its parent and stops once it is gone."""
    with ServerProcess(["--data-parallel", "2", "--device", "cpu", "--model", str(tiny_llama_dir),
                        "--served-model-name", "tiny"], startup_timeout=240) as server:
        pids = [r["pid"] for r in httpx.get(f"{server.root}/health", timeout=10).json()["replicas"]]
        assert len(pids) == 2 and all(running(p) for p in pids)
        server.proc.kill()
        server.proc.wait()
    deadline = time.monotonic() + 30
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(running(p) for p in pids), "a replica outlived its killed front end"
