"""The worst requests a client can send a structgen server (issue 27), for `bench_server
--adversarial`: each `Attack` sends one kind over and over until told to stop, and counts how
the server answered (an HTTP status, or the transport error's name).

Sizes scale with `scale` (1.0: the audit's sizes) so that a quick check on a small CPU host
can use smaller ones."""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

# A half-open connection sends its next byte, and sees a stop, this often (seconds).
HALF_OPEN_POLL_S = 1.0
# The attackers' own loopback address: a server tells clients apart by address, and the good
# clients of the benchmark connect from 127.0.0.1.
ATTACKER_ADDRESS = "127.0.0.2"


def self_referential_schema() -> dict[str, Any]:
    """An object that must contain itself: no finite JSON satisfies it."""
    return {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]}


def deep_schema(depth: int) -> dict[str, Any]:
    """Arrays nested `depth` deep."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


@dataclass
class AttackContext:
    client: httpx.AsyncClient  # base_url: the server's /v1 URL
    model: str
    scale: float
    stop: asyncio.Event

    def chat(self, content: str, schema: Any = None, **extra: Any) -> dict[str, Any]:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 16,
            **extra,
        }
        if schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": schema},
            }
        return body


async def _post(ctx: AttackContext, path: str, body: dict[str, Any]) -> str:
    r = await ctx.client.post(
        path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    return str(r.status_code)


async def huge_prompt(ctx: AttackContext) -> str:
    return await _post(ctx, "/chat/completions", ctx.chat("word " * int(2_000_000 * ctx.scale)))


async def fan_out(ctx: AttackContext) -> str:
    prompts = [f"Count to {i}:" for i in range(max(1, int(500 * ctx.scale)))]
    return await _post(
        ctx, "/completions", {"model": ctx.model, "prompt": prompts, "n": 16, "max_tokens": 16}
    )


async def big_enum(ctx: AttackContext) -> str:
    values = [f"value-{i}" for i in range(max(1, int(20_000 * ctx.scale)))]
    return await _post(ctx, "/chat/completions", ctx.chat("Pick one.", {"enum": values}))


async def deep_nesting(ctx: AttackContext) -> str:
    return await _post(ctx, "/chat/completions", ctx.chat("Nest.", deep_schema(300)))


async def self_reference(ctx: AttackContext) -> str:
    return await _post(
        ctx, "/chat/completions", ctx.chat("Describe yourself.", self_referential_schema())
    )


async def disconnect_mid_stream(ctx: AttackContext) -> str:
    body = ctx.chat("Write a long story.", stream=True, max_tokens=256)
    async with ctx.client.stream("POST", "/chat/completions", json=body) as r:
        async for _ in r.aiter_bytes():
            break  # leave after the first chunk: the server must free the slot
        return f"{r.status_code}-left"


async def half_open(ctx: AttackContext) -> str:
    """Slowloris: a request line and one header, then a byte a second, never the end."""
    url = urlsplit(str(ctx.client.base_url))
    reader, writer = await asyncio.open_connection(url.hostname, url.port, local_addr=(ATTACKER_ADDRESS, 0))
    try:
        writer.write(
            f"POST {url.path}/chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\n".encode()
        )
        await writer.drain()
        while not ctx.stop.is_set():
            writer.write(b"X")
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1), timeout=HALF_OPEN_POLL_S) == b"":
                    return "closed-by-server"
            except asyncio.TimeoutError:
                continue
            return "answered"
        return "held-to-end"
    finally:
        writer.close()


ATTACKS: dict[str, Callable[[AttackContext], Awaitable[str]]] = {
    "huge_prompt": huge_prompt,
    "fan_out": fan_out,
    "big_enum": big_enum,
    "deep_schema": deep_nesting,
    "self_reference": self_reference,
    "disconnect_mid_stream": disconnect_mid_stream,
    "half_open": half_open,
}


@dataclass
class AttackLog:
    """What each attack got back: kind -> outcome (status or error name) -> count."""

    outcomes: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )

    def record(self, kind: str, outcome: str) -> None:
        self.outcomes[kind][outcome] += 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {kind: dict(counts) for kind, counts in sorted(self.outcomes.items())}


async def attack_until_stopped(ctx: AttackContext, kind: str, log: AttackLog) -> None:
    """Send `kind` back to back until `ctx.stop` is set; one attempt's failure is counted and
    the next one sent (a server that refuses connections shows up as ConnectError)."""
    attack = ATTACKS[kind]
    while not ctx.stop.is_set():
        try:
            outcome = await attack(ctx)
        except (httpx.HTTPError, OSError) as exc:
            outcome = type(exc).__name__
            await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            log.record(kind, "unanswered-at-end")
            raise
        log.record(kind, outcome)


async def run_attacks(
    url: str,
    model: str,
    scale: float,
    stop: asyncio.Event,
    log: AttackLog,
    copies: int = 2,
    timeout_s: float = 120.0,
) -> None:
    """`copies` attackers of every kind (twice as many half-open connections) until `stop`."""
    async with httpx.AsyncClient(
        base_url=url,
        timeout=timeout_s,
        transport=httpx.AsyncHTTPTransport(
            local_address=ATTACKER_ADDRESS, limits=httpx.Limits(max_connections=None)
        ),
    ) as client:
        ctx = AttackContext(client, model, scale, stop)
        tasks = [
            asyncio.create_task(attack_until_stopped(ctx, kind, log))
            for kind in ATTACKS
            for _ in range(copies * (2 if kind == "half_open" else 1))
        ]
        await stop.wait()
        await asyncio.wait(tasks, timeout=HALF_OPEN_POLL_S * 2)  # half-open ones see the stop
        for t in tasks:
            t.cancel()  # in-flight attacks are dropped: their connections close
        await asyncio.gather(*tasks, return_exceptions=True)


def attack_process(url: str, model: str, scale: float, stop: Any, results: Any) -> None:
    """`run_attacks` in a process of its own until the multiprocessing event `stop` is set;
    puts the `AttackLog` (as a dict) on `results`. Its own process, so that building and sending
    the attacks does not slow the good clients' event loop: the benchmark times the server."""

    async def main() -> dict[str, dict[str, int]]:
        done, log = asyncio.Event(), AttackLog()
        task = asyncio.create_task(run_attacks(url, model, scale, done, log))
        while not stop.is_set():
            await asyncio.sleep(0.2)
        done.set()
        await task
        return log.as_dict()

    results.put(asyncio.run(main()))
