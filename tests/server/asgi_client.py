"""Helpers of the server tests (not tests): a request sent to an ASGI app in process by a client
that stays connected, and whether a process is still running."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any


def post_and_stay(app: Any, body: dict[str, Any], path: str = "/v1/chat/completions",
                  leave: asyncio.Event | None = None, client: str = "127.0.0.1",
                  ) -> tuple[asyncio.Future[Any], list[dict[str, Any]]]:
    """Start POSTing `body` to `app` from a client (at address `client`) that stays connected
    (until `leave` is set, where given): the request's task (to cancel as uvicorn does) and the
    list its ASGI messages are appended to as it sends them. Call it inside a running event loop."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"host", b"localhost"), (b"content-length", str(len(raw)).encode()),
                                          (b"content-type", b"application/json")],
             "client": (client, 5000), "server": ("127.0.0.1", 8000)}
    requests = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if requests:
            return requests.pop(0)
        await (leave or asyncio.Event()).wait()  # the client stays connected until it leaves
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    return asyncio.ensure_future(app(scope, receive, send)), sent


def running(pid: int) -> bool:
    """Whether `pid` is a live process (an exited one that nobody reaped yet is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    """The live child processes of `pid`."""
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return [c for c in found if running(c)]
