"""A stop signal drains `structgen serve` (structgen_server/draining.py), a single server and a
`--data-parallel N` front end alike: a stream in flight finishes, a request that arrives
meanwhile gets the JSON 503 `server_shutting_down` (on a new connection or a kept-alive one,
never a reset), `/health` says "stopping", the engine or the replicas are stopped and the
process exits 0. A request the drain cannot wait for ends with a 503, or its error event and
[DONE] once streaming. And a client that leaves a relayed request stops its generation on the
replica. The servers serve the default model on the CPU, whose 200-token stream takes a second
or two there: long enough to send requests while it runs, well inside the drain."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import httpx
import pytest

from structgen_server.draining import DRAIN_S
from structgen_server.process import ServerProcess
from structgen_server.replicas import Replica, ReplicaSet, create_front_app
from tests.server.asgi_client import children, post_and_stay, running

MODEL = "m"
ARGS = ["--device", "cpu", "--max-seq-len", "1024", "--max-batch-size", "2", "--served-model-name", MODEL]
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Write a's and b's."}], "max_tokens": 200,
        "regex": "[ab]{4000}"}  # never ends before max_tokens
SHORT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}


def _shutting_down(r: httpx.Response) -> None:
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    assert r.json()["error"]["code"] == "server_shutting_down" and r.headers["connection"] == "close"


def _stopping_health(server: ServerProcess) -> dict[str, Any]:
    """The server's health once the stop signal has reached it (a 503 saying so)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        r = httpx.get(f"{server.root}/health", timeout=5)
        if r.json()["status"] == "stopping":
            assert r.status_code == 503
            return r.json()
        time.sleep(0.02)
    raise AssertionError("the server never reported that it is stopping")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc (Linux)")
@pytest.mark.parametrize("extra", [[], ["--data-parallel", "2"], ["--front-processes", "2"]],
                         ids=["single server", "data-parallel front end", "front processes"])
def test_a_stop_signal_lets_the_stream_in_flight_finish_and_answers_new_requests_503(extra):
    replicas = "--data-parallel" in extra
    with ServerProcess([*extra, *ARGS], startup_timeout=240) as server:
        pids = [r["pid"] for r in httpx.get(f"{server.root}/health", timeout=10).json().get("replicas", [])]
        pids += children(server.proc.pid) if "--front-processes" in extra else []
        with httpx.Client(base_url=server.url, timeout=60) as kept:
            assert kept.post("/chat/completions", json=SHORT).status_code == 200  # kept alive, idle at the signal
            with httpx.stream("POST", f"{server.url}/chat/completions", json={**LONG, "stream": True},
                              timeout=60) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")
                server.proc.send_signal(signal.SIGTERM)
                stopped_at = time.monotonic()
                health = _stopping_health(server)
                if replicas:
                    assert any(r["outstanding_tokens"] > 0 for r in health["replicas"])  # the stream still runs
                _shutting_down(httpx.post(f"{server.url}/chat/completions", json=SHORT, timeout=10))
                _shutting_down(kept.post("/chat/completions", json=SHORT))
                events = [line.removeprefix("data: ") for line in lines if line]
        assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"  # it ran to its end
        assert server.proc.wait(timeout=30) == 0
        assert time.monotonic() - stopped_at < DRAIN_S + 10
        assert not any(running(p) for p in pids), "the server exited before stopping its replicas or fronts"


# --------------------------------------------------------------------------- the drain runs out


@pytest.fixture(scope="module")
def replica_server():
    with ServerProcess(ARGS, startup_timeout=240) as server:
        yield server


async def relay_then_cut(replica_server: ServerProcess, body: dict[str, Any]) -> tuple[list[dict[str, Any]], Replica]:
    """POST `body` to an in-process front end of one replica, then, once the replica runs it
    (a stream: once its first event went out), cancel the request's task as uvicorn does when
    the drain and its graceful timeout ran out; the ASGI messages it sent, and the replica."""
    replicas = ReplicaSet([Replica(0, [], {}, process=replica_server, up=True)])
    app = create_front_app(replicas, default_max_tokens=16)
    task, sent = post_and_stay(app, body)
    started = (lambda: any(m.get("body") for m in sent)) if body.get("stream") else (lambda: replicas.replicas[0].outstanding)
    deadline = time.monotonic() + 30
    while not started() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    replicas.stopping = True
    task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
    try:
        await asyncio.wait_for(task, 10)
    except asyncio.CancelledError:
        pass
    return sent, replicas.replicas[0]


def test_a_request_the_drain_cannot_wait_for_gets_a_json_503(replica_server):
    sent, replica = asyncio.run(relay_then_cut(replica_server, LONG))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    assert start["status"] == 503 and (b"content-type", b"application/json") in start["headers"]
    error = json.loads(body)["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error", error
    assert replica.outstanding == 0  # its tokens given back


def test_a_stream_the_drain_cannot_wait_for_ends_with_an_error_event_and_done(replica_server):
    sent, replica = asyncio.run(relay_then_cut(replica_server, {**LONG, "stream": True}))
    assert sent[0]["status"] == 200 and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    events = [m["body"].decode() for m in sent[1:] if m.get("body")]
    assert events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down", error
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)  # whole events, never a torn one
    assert replica.outstanding == 0


# --------------------------------------------------------------------------- a client that leaves


def test_a_client_leaving_a_relayed_request_stops_its_generation_on_the_replica(replica_server):
    # A non-streamed answer's headers come only when it is done, so the front end once waited
    # for them while the replica generated for a client long gone.
    async def leave_midway() -> list[dict[str, Any]]:
        replicas = ReplicaSet([Replica(0, [], {}, process=replica_server, up=True)])
        leave = asyncio.Event()
        task, sent = post_and_stay(create_front_app(replicas, default_max_tokens=16), {**LONG, "max_tokens": 900},
                                   leave=leave)
        while not _replica_running(replica_server):
            await asyncio.sleep(0.01)
        leave.set()
        await asyncio.wait_for(task, 5)
        return sent

    sent = asyncio.run(leave_midway())
    assert sent[0]["status"] == 499
    deadline = time.monotonic() + 5  # the 900 tokens take ten seconds or more on the CPU
    while _replica_running(replica_server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _replica_running(replica_server), "the replica kept generating for a client that left"


def _replica_running(server: ServerProcess) -> int:
    return httpx.get(f"{server.root}/health", timeout=5).json()["running"]
