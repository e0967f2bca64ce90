"""Data-parallel replicas (structgen_server/replicas.py): `structgen serve --data-parallel 2`
on the CPU answers through one front end, spreads concurrent requests over both engines,
and restarts a replica that dies while the request it was streaming ends with an error
naming it. The replicas serve conftest's tiny Llama (`tiny_llama_dir`), which loads in a
second, so three processes fit the test's budget."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from structgen_server.process import ServerProcess


def _chat(max_tokens: int, **extra: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens, **extra}


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
