"""Data-parallel replicas behind one HTTP front end (`structgen serve --data-parallel N`).

Each replica is a whole `structgen serve` process (its own engine, one GPU each where there
are GPUs: `CUDA_VISIBLE_DEVICES`) on a loopback port. The front end checks Host, key and body
size as a single server does (guard.py), then relays each request to the replica with the
fewest outstanding tokens (prompt bytes / 4 + max_tokens of the requests it is running) and
streams its answer back unchanged. Prefix affinity: a request whose prompt starts as an earlier
one did (the same tool catalogue and system prompt) goes to the replica that served that
prefix, whose prefix cache holds its KV pages, unless that replica's outstanding tokens exceed
the least loaded one's by more than `affinity_slack_tokens`. A replica that exits is restarted; the requests it was
running end with a 503 (or, mid-stream, an error event) that names it, never a hang.

A stop signal drains the front end as it does a single server (draining.py), then stops the
replicas; none is restarted meanwhile.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from structgen_server.app import server_config, stream_error_end, uncancel
from structgen_server.draining import (
    draining_server,
    no_new_requests_error,
    shutting_down_error,
)
from structgen_server.errors import APIError
from structgen_server.event_stream import EventStream
from structgen_server.guard import GuardConfig, RequestGuard
from structgen_server.metrics import Metrics
from structgen_server.process import PARENT_PID_ENV, ServerProcess
from structgen_server.serving import ClientDisconnected, cancel_on_disconnect

log = logging.getLogger("structgen.server")

WATCH_INTERVAL_S = 0.5
BYTES_PER_PROMPT_TOKEN = 4  # a rough count: the front end does not tokenize
# Prompts are matched in blocks of this many characters (about 64 tokens): shorter shared
# starts save too little prefill to be worth an unbalanced route.
AFFINITY_BLOCK_CHARS = 256
AFFINITY_BLOCKS = 64  # the longest prefix matched: a 16k-character tool catalogue
AFFINITY_ENTRIES = 65536  # prefix blocks remembered, least recently routed forgotten first
# How far a replica's outstanding tokens may exceed the least loaded one's and still get the
# requests whose prefix it holds (a prefill of the shared part costs about this much).
AFFINITY_SLACK_TOKENS = 4096
# Headers that describe one hop of the connection, not the request or response itself.
HOP_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade"})


@dataclass
class Replica:
    """One engine process and the tokens of the requests it is running."""

    index: int
    args: list[str]
    env: dict[str, str]
    process: ServerProcess | None = None
    outstanding: int = 0
    requests: int = 0  # relayed to it, over its restarts
    restarts: int = 0
    up: bool = False

    def start(self) -> None:
        """Start the process and wait until it is healthy (blocking); it stops by itself if
        this front end dies. The process is known while it starts, so that a stop ends it."""
        self.process = ServerProcess(self.args, env={**self.env, PARENT_PID_ENV: str(os.getpid())})
        self.process.start()
        self.up = True

    def release(self, tokens: int) -> None:
        """A request it was running ended: its tokens are no longer outstanding."""
        self.outstanding = max(0, self.outstanding - tokens)

    def exited(self) -> bool:
        return self.process is not None and self.process.proc is not None and self.process.proc.poll() is not None


@dataclass(frozen=True)
class Route:
    """What the front end routes a request by: the tokens it adds to its replica's load and
    the hashes of its prompt's leading blocks (each hash covers every block before it)."""

    cost: int
    prefix: tuple[str, ...] = ()

    @classmethod
    def of(cls, body: bytes, default_max_tokens: int) -> Route:
        parsed = _json_object(body)
        return cls(request_cost(body, parsed, default_max_tokens), prefix_blocks(prompt_text(parsed)))


@dataclass
class PrefixAffinity:
    """Which replica last served each prompt prefix (the one whose prefix cache holds it)."""

    entries: int = AFFINITY_ENTRIES
    owners: OrderedDict[str, int] = field(default_factory=OrderedDict)

    def owner(self, prefix: tuple[str, ...]) -> int | None:
        """The replica that served the longest of `prefix`'s blocks, if any did."""
        for block in reversed(prefix):
            if block in self.owners:
                return self.owners[block]
        return None

    def served(self, prefix: tuple[str, ...], replica: int) -> None:
        for block in prefix:
            self.owners[block] = replica
            self.owners.move_to_end(block)
        while len(self.owners) > self.entries:
            self.owners.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A restarted replica's cache is empty: route its prefixes afresh."""
        for block in [b for b, r in self.owners.items() if r == replica]:
            del self.owners[block]


class ReplicaSet:
    """The replicas, the routing rule, and the watch that restarts a replica that exited."""

    def __init__(self, replicas: list[Replica], affinity_slack_tokens: int = AFFINITY_SLACK_TOKENS):
        self.replicas = replicas
        self.affinity = PrefixAffinity()
        self.affinity_slack_tokens = affinity_slack_tokens
        self.stopping = False  # a stop signal arrived: no new requests, no restarts

    def start(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.replicas)) as pool:
            list(pool.map(Replica.start, self.replicas))

    def mark_stopping(self) -> None:
        """A stop signal arrived (`draining_server`): no new requests, no restarts."""
        self.stopping = True

    def pick(self, route: Route, refused: frozenset[int] = frozenset()) -> Replica:
        """The live replica (but those in `refused`) that served the route's prefix, unless
        it is more than the slack busier than the least loaded one, which is picked then
        (ties: the one relayed fewer requests); it takes the route's cost. A 503 while stopping."""
        if self.stopping:
            raise no_new_requests_error()
        live = [r for r in self.replicas if r.up and not r.exited() and r.index not in refused]
        if not live:
            raise APIError(503, "no engine replica is running (one is restarting); retry in a few seconds",
                           type="server_error", code="replica_unavailable")
        replica = min(live, key=lambda r: (r.outstanding, r.requests, r.index))
        owner = self.affinity.owner(route.prefix)
        holder = next((r for r in live if r.index == owner), None)
        if holder is not None and holder.outstanding - replica.outstanding <= self.affinity_slack_tokens:
            replica = holder
        self.affinity.served(route.prefix, replica.index)
        replica.outstanding += route.cost
        replica.requests += 1
        return replica

    async def watch(self) -> None:
        """Restart every replica that exits, until the server stops (a replica that exits then
        may have had the stop signal too). Its requests in flight fail on their own: the kernel
        closes its connections, and the relay turns that into an error naming it."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.stopping:
                return
            for replica in self.replicas:
                if replica.up and replica.exited():
                    replica.up = False
                    code = replica.process.proc.returncode
                    log.error("replica %d exited with code %s (its log: %s); restarting it",
                              replica.index, code, replica.process.log_path)
                    asyncio.create_task(self._restart(replica))

    async def _restart(self, replica: Replica) -> None:
        try:
            await asyncio.to_thread(replica.start)
            replica.restarts += 1
            replica.outstanding = 0
            self.affinity.forget(replica.index)
            log.info("replica %d is back on port %d", replica.index, replica.process.port)
        except RuntimeError as e:
            log.error("replica %d did not restart: %s", replica.index, e)

    def stop(self) -> None:
        """Ask every replica to stop at once, then wait for each (a slow one does not hold up
        the others' shutdown)."""
        for replica in self.replicas:
            replica.up = False
            if replica.process is not None and replica.process.proc is not None and replica.process.proc.poll() is None:
                replica.process.proc.terminate()
        for replica in self.replicas:
            if replica.process is not None:
                replica.process.stop()

    def health(self) -> dict:
        return {"status": "stopping" if self.stopping else "ok" if any(r.up for r in self.replicas) else "unavailable",
                "replicas": [{"index": r.index, "up": r.up, "pid": r.process.proc.pid if r.process and r.process.proc else None,
                              "outstanding_tokens": r.outstanding, "requests": r.requests, "restarts": r.restarts}
                             for r in self.replicas]}


def _json_object(body: bytes) -> dict:
    try:
        parsed = json.loads(body) if body else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def prompt_text(parsed: dict) -> str:
    """A request's prompt as the front end sees it, in the order a chat template lays it out
    (tools, then the messages; or the completion prompt)."""
    # Any JSON may arrive here (the replica validates it, and answers a 400): read what is text.
    tools = parsed.get("tools")
    parts = [json.dumps(tools, sort_keys=True, default=str)] if tools else []
    messages = parsed.get("messages")
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict):
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            parts.append(f"{message.get('role')}:{content}")
    prompt = parsed.get("prompt")
    if isinstance(prompt, str):
        parts.append(prompt)
    return "\n".join(parts)


def prefix_blocks(text: str) -> tuple[str, ...]:
    """Chained hashes of `text`'s whole leading blocks: two prompts share the first k hashes
    exactly when they share their first k blocks."""
    hashes, chain = [], hashlib.blake2b(digest_size=16)
    for start in range(0, min(len(text), AFFINITY_BLOCKS * AFFINITY_BLOCK_CHARS) - AFFINITY_BLOCK_CHARS + 1,
                       AFFINITY_BLOCK_CHARS):
        chain.update(text[start : start + AFFINITY_BLOCK_CHARS].encode())
        hashes.append(chain.copy().hexdigest())
    return tuple(hashes)


def request_cost(body: bytes, parsed: dict, default_max_tokens: int) -> int:
    """Outstanding tokens a request adds: its prompt (estimated from its size) and its
    max_tokens for each of its `n` generations."""
    max_tokens = parsed.get("max_completion_tokens") or parsed.get("max_tokens") or default_max_tokens
    n = parsed.get("n") or 1
    try:
        return len(body) // BYTES_PER_PROMPT_TOKEN + int(max_tokens) * int(n)
    except (TypeError, ValueError):
        return len(body) // BYTES_PER_PROMPT_TOKEN + default_max_tokens


class Relay:
    """One request relayed to one replica: the answer streamed back, the replica's
    outstanding tokens given back at the end, and a replica failure or a stop that cuts it
    turned into an error that says so."""

    def __init__(self, replicas: ReplicaSet, replica: Replica, cost: int, response: httpx.Response):
        self.replicas, self.replica, self.cost, self.response = replicas, replica, cost, response

    @property
    def streaming(self) -> bool:
        content_type = self.response.headers.get("content-type", "")
        return self.response.status_code == 200 and content_type.startswith("text/event-stream")

    async def body(self) -> AsyncIterator[bytes]:
        """A whole answer's bytes, as they come."""
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
        finally:
            await self.close()

    async def events(self) -> AsyncIterator[str]:
        """A stream's server-sent events, each whole (so that an error event can follow any of
        them), as they come. A replica that fails ends it with an error event naming the
        replica; a stop that cuts it, with the single server's error event and [DONE]."""
        pending = b""
        try:
            async for chunk in self.response.aiter_raw():
                events, end, pending = (pending + chunk).rpartition(b"\n\n")
                if end:
                    yield (events + end).decode()
        except httpx.HTTPError:
            error_event, _ = stream_error_end(_replica_failed(self.replica))
            yield error_event
        except asyncio.CancelledError:
            if not self.replicas.stopping:  # the client went away
                raise
            uncancel()  # the drain ran out: end the stream as a single server does
            for event in stream_error_end(shutting_down_error()):
                yield event
        finally:
            await self.close()

    async def close(self) -> None:
        self.replica.release(self.cost)
        await self.response.aclose()


def _replica_failed(replica: Replica) -> APIError:
    return APIError(503, f"engine replica {replica.index} failed while serving this request (it is being "
                         "restarted); retry the request", type="server_error", code="replica_failed")


def forwarded_headers(request: Request) -> dict[str, str]:
    """The headers a replica gets: the client's, less the hop-by-hop ones, with the client's
    address as `X-Forwarded-For` (which the replica's uvicorn trusts from this loopback front), so
    that its client throttle and fair admission see each client, not this front. A value the
    client sent is replaced: trusted here, it would let a client pose as any number of others."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS and k.lower() != "x-forwarded-for"}
    if request.client is not None:
        headers["x-forwarded-for"] = request.client.host
    return headers


async def send_to_replica(client: httpx.AsyncClient, replicas: ReplicaSet, route: Route, request: Request,
                          path: str, body: bytes) -> Relay:
    """Send the request to the replica `pick` chooses (to the next one where a replica refuses
    the connection: it never saw the request) and return its answer once its headers arrive."""
    headers = forwarded_headers(request)
    refused: set[int] = set()
    for _ in replicas.replicas:
        replica = replicas.pick(route, frozenset(refused))
        upstream = client.build_request(request.method, f"{replica.process.root}/{path}", headers=headers,
                                        params=request.query_params, content=body)
        try:
            return Relay(replicas, replica, route.cost, await client.send(upstream, stream=True))
        except httpx.ConnectError:
            replica.release(route.cost)
            refused.add(replica.index)
        except httpx.HTTPError as e:
            replica.release(route.cost)
            raise _replica_failed(replica) from e
        except asyncio.CancelledError:  # the client went away, or the drain ran out (the relay answers)
            replica.release(route.cost)
            raise
    raise _replica_failed(replica)


def create_front_app(replicas: ReplicaSet, default_max_tokens: int) -> FastAPI:
    """The front end: /health of its own, every other path relayed to a replica."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watch = asyncio.create_task(replicas.watch())
        yield
        watch.cancel()
        await client.aclose()
        await asyncio.to_thread(replicas.stop)  # here, so that a replica being restarted stops too

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.get("/health")
    @app.head("/health", include_in_schema=False)  # load balancers probe with either
    async def health() -> JSONResponse:
        body = replicas.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def relay(path: str, request: Request) -> Response:
        body = await request.body()
        route = Route.of(body, default_max_tokens) if request.method == "POST" else Route(0)
        try:  # a non-streamed answer's headers come when it is done: until then, watch the client
            answer = await cancel_on_disconnect(send_to_replica(client, replicas, route, request, path, body), request)
        except ClientDisconnected:  # the relay was cancelled, which the replica takes as a disconnect too
            return Response(status_code=499)
        except asyncio.CancelledError:
            if not replicas.stopping:
                raise
            uncancel()  # the drain ran out: answer as a single server does
            raise shutting_down_error() from None
        if answer.streaming:
            return EventStream(answer.events())
        kept = {k: v for k, v in answer.response.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(answer.body(), status_code=answer.response.status_code, headers=kept)

    return app


def run_replicated_server(replica_args: list[str], count: int, *, host: str, port: int, api_key: str | None,
                          allowed_hosts: frozenset[str] | None, max_body_bytes: int, max_client_errors: int,
                          default_max_tokens: int, gpus_per_replica: int, log_level: str = "info") -> None:
    """Start `count` replicas (GPUs split among them where there are any), then serve the
    front end on host:port until a stop signal has drained it; the replicas stop with it."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = {"STRUCTGEN_API_KEY": api_key} if api_key else {}
    gpus = visible_gpus()
    replicas = ReplicaSet([
        Replica(i, replica_args, {**env, **_replica_gpus(gpus, i, gpus_per_replica)}) for i in range(count)])
    replicas.start()
    log.info("%d replicas ready on ports %s", count, [r.process.port for r in replicas.replicas])
    guard = GuardConfig(api_key=api_key, allowed_hosts=allowed_hosts, max_body_bytes=max_body_bytes,
                        max_client_errors=max_client_errors)
    app = RequestGuard(create_front_app(replicas, default_max_tokens), guard, Metrics("replicas"))
    config = server_config(app, host, port, log_level)  # a single server's connection settings
    server = draining_server(config, replicas.mark_stopping)
    try:
        server.run()
    finally:
        replicas.stop()  # where the lifespan's stop did not run (a forced stop, a failed start)
    if server.stop_signal == signal.SIGINT:
        raise KeyboardInterrupt  # Ctrl-C: "interrupted" and status 130, as after a single server


def _replica_gpus(gpus: list[str], index: int, gpus_per_replica: int) -> dict[str, str]:
    """Replica `index`'s share of this host's GPUs (none where the replicas run on the CPU)."""
    if gpus_per_replica == 0:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus[index * gpus_per_replica : (index + 1) * gpus_per_replica])}


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]
