"""Data-parallel replicas behind one HTTP front end (`structgen serve --data-parallel N`).

Each replica is a whole `structgen serve` process (its own engine, one GPU each where there
are GPUs: `CUDA_VISIBLE_DEVICES`) on a loopback port. The front end checks Host, key and body
size as a single server does (guard.py), then relays each request to the replica with the
fewest outstanding tokens (prompt bytes / 4 + max_tokens of the requests it is running) and
streams its answer back unchanged. A replica that exits is restarted; the requests it was
running end with a 503 (or, mid-stream, an error event) that names it, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from structgen_server.errors import APIError
from structgen_server.guard import GuardConfig, RequestGuard
from structgen_server.metrics import Metrics
from structgen_server.process import ServerProcess

log = logging.getLogger("structgen.server")

WATCH_INTERVAL_S = 0.5
BYTES_PER_PROMPT_TOKEN = 4  # a rough count: the front end does not tokenize
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
        """Start the process and wait until it is healthy (blocking)."""
        self.process = ServerProcess(self.args, env=self.env).start()
        self.up = True

    def exited(self) -> bool:
        return self.process is not None and self.process.proc is not None and self.process.proc.poll() is not None


class ReplicaSet:
    """The replicas, the routing rule, and the watch that restarts a replica that exited."""

    def __init__(self, replicas: list[Replica]):
        self.replicas = replicas

    def start(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.replicas)) as pool:
            list(pool.map(Replica.start, self.replicas))

    def pick(self, cost: int, refused: frozenset[int] = frozenset()) -> Replica:
        """The live replica with the fewest outstanding tokens (but those in `refused`); it
        takes `cost` more."""
        live = [r for r in self.replicas if r.up and not r.exited() and r.index not in refused]
        if not live:
            raise APIError(503, "no engine replica is running (one is restarting); retry in a few seconds",
                           type="server_error", code="replica_unavailable")
        replica = min(live, key=lambda r: (r.outstanding, r.index))
        replica.outstanding += cost
        replica.requests += 1
        return replica

    async def watch(self) -> None:
        """Restart every replica that exits. Its requests in flight fail on their own: the
        kernel closes its connections, and the relay turns that into an error naming it."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
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
            log.info("replica %d is back on port %d", replica.index, replica.process.port)
        except RuntimeError as e:
            log.error("replica %d did not restart: %s", replica.index, e)

    def stop(self) -> None:
        for replica in self.replicas:
            replica.up = False
            if replica.process is not None:
                replica.process.stop()

    def health(self) -> dict:
        return {"status": "ok" if any(r.up for r in self.replicas) else "unavailable",
                "replicas": [{"index": r.index, "up": r.up, "pid": r.process.proc.pid if r.process and r.process.proc else None,
                              "outstanding_tokens": r.outstanding, "requests": r.requests, "restarts": r.restarts}
                             for r in self.replicas]}


def request_cost(body: bytes, default_max_tokens: int) -> int:
    """Outstanding tokens a request adds: its prompt (estimated from its size) and its
    max_tokens for each of its `n` generations."""
    try:
        parsed = json.loads(body) if body else {}
    except ValueError:
        parsed = {}
    parsed = parsed if isinstance(parsed, dict) else {}
    max_tokens = parsed.get("max_completion_tokens") or parsed.get("max_tokens") or default_max_tokens
    n = parsed.get("n") or 1
    try:
        return len(body) // BYTES_PER_PROMPT_TOKEN + int(max_tokens) * int(n)
    except (TypeError, ValueError):
        return len(body) // BYTES_PER_PROMPT_TOKEN + default_max_tokens


class Relay:
    """One request relayed to one replica: the answer streamed back, the replica's
    outstanding tokens given back at the end, and a replica failure turned into an error
    that names it."""

    def __init__(self, replica: Replica, cost: int, response: httpx.Response):
        self.replica, self.cost, self.response = replica, cost, response

    async def body(self) -> AsyncIterator[bytes]:
        streaming = self.response.headers.get("content-type", "").startswith("text/event-stream")
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            if not streaming:
                raise
            error = _replica_failed(self.replica)
            event = {"error": {"message": error.message, "type": error.type, "code": error.code}}
            yield f"data: {json.dumps(event)}\n\n".encode()
        finally:
            self.release()
            await self.response.aclose()

    def release(self) -> None:
        self.replica.outstanding = max(0, self.replica.outstanding - self.cost)


def _replica_failed(replica: Replica) -> APIError:
    return APIError(503, f"engine replica {replica.index} failed while serving this request (it is being "
                         "restarted); retry the request", type="server_error", code="replica_failed")


def create_front_app(replicas: ReplicaSet, default_max_tokens: int) -> FastAPI:
    """The front end: /health of its own, every other path relayed to a replica."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watch = asyncio.create_task(replicas.watch())
        yield
        watch.cancel()
        await client.aclose()

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.get("/health")
    async def health() -> JSONResponse:
        body = replicas.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def relay(path: str, request: Request) -> Response:
        body = await request.body()
        cost = request_cost(body, default_max_tokens) if request.method == "POST" else 0
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        refused: set[int] = set()
        for _ in replicas.replicas:  # a replica that refuses the connection never saw the request
            replica = replicas.pick(cost, frozenset(refused))
            upstream = client.build_request(request.method, f"{replica.process.root}/{path}", headers=headers,
                                            params=request.query_params, content=body)
            try:
                response = await client.send(upstream, stream=True)
                break
            except httpx.HTTPError as e:
                replica.outstanding = max(0, replica.outstanding - cost)
                if not isinstance(e, httpx.ConnectError):
                    raise _replica_failed(replica) from e
                refused.add(replica.index)
        else:
            raise _replica_failed(replica)
        relay = Relay(replica, cost, response)
        kept = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(relay.body(), status_code=response.status_code, headers=kept)

    return app


def run_replicated_server(replica_args: list[str], count: int, *, host: str, port: int, api_key: str | None,
                          allowed_hosts: frozenset[str] | None, max_body_bytes: int, max_client_errors: int,
                          default_max_tokens: int, gpus_per_replica: int, log_level: str = "info") -> None:
    """Start `count` replicas (GPUs split among them where there are any), then serve the
    front end on host:port until interrupted; the replicas stop with it."""
    import uvicorn

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
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        replicas.stop()


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
