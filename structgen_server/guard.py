"""The checks every HTTP request passes before a handler sees it, as one ASGI middleware:

1. the Host header, against an allow-list (by default the loopback names of a loopback-bound
   server), so a web page that rebinds its DNS name to 127.0.0.1 cannot reach the server;
2. the API key, before a byte of the body is read, on every path but `/health`; the scheme is
   case-insensitive and the key compared in constant time;
3. the body size: Content-Length first, then the bytes as they arrive, within a deadline for
   the whole body, so no client can make the server hold a huge or endless body;
4. before all of these, the client's recent failures (`throttle.ClientThrottle`): a client
   whose requests keep failing is refused before its body is read.

A refusal is an OpenAI-format error (429, 421, 401, 413, 408) and is counted in `/metrics`.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from structgen_server.engine_client import MetricsRelay
from structgen_server.errors import APIError
from structgen_server.metrics import Metrics, endpoint_label
from structgen_server.throttle import ClientThrottle, client_key

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_CLIENT_ERRORS = 64


def default_allowed_hosts(host: str, port: int) -> frozenset[str] | None:
    """The Host headers a server bound to `host`:`port` answers by default: its loopback names
    with the port when bound to loopback (a browser sends the port), None (any) otherwise."""
    if host not in LOOPBACK_HOSTS:
        return None
    names = ("127.0.0.1", "localhost", "[::1]")
    return frozenset(f"{name}:{port}" for name in names)


def host_allowed(host_header: str, allowed: frozenset[str]) -> bool:
    """Whether `host_header` is in `allowed`; an entry without a port allows any port."""
    host = host_header.strip().lower()
    name = host[: host.index("]") + 1] if host.startswith("[") and "]" in host else host.split(":")[0]
    return host in allowed or name in allowed


@dataclass(frozen=True)
class GuardConfig:
    """What the guard enforces. `allowed_hosts` None: any Host header; `api_key` None: open."""

    api_key: str | None = None
    allowed_hosts: frozenset[str] | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = 30.0
    open_paths: frozenset[str] = frozenset({"/health"})
    max_client_errors: int = DEFAULT_MAX_CLIENT_ERRORS  # 4xx answers a client may get within client_error_window_s
    client_error_window_s: float = 10.0


class RequestGuard:
    """ASGI middleware applying a `GuardConfig` to every HTTP request; the body it has read
    (and bounded) is handed to the app unchanged."""

    def __init__(self, app: ASGIApp, config: GuardConfig, metrics: Metrics | MetricsRelay):
        self.app = app
        self.config = config
        self.metrics = metrics
        self.throttle = ClientThrottle(config.max_client_errors, config.client_error_window_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = client_key(scope["client"][0]) if scope.get("client") else ""
        if self.throttle.enabled and scope["path"] not in self.config.open_paths:
            send = CountedSend(send, self.throttle, client)
            error = self.throttle.refusal(client)
            if error is not None:  # refused before any other work, and not counted again
                self.metrics.rejected(endpoint_label(scope["path"]), error.status, error.code or error.type)
                await error.response()(scope, receive, send)
                return
        headers = Headers(scope=scope)
        error = self._check_host(headers) or self._check_key(scope["path"], headers)
        if error is None:
            body, error = await self._read_body(headers, receive)
            if error is None:
                if body is not None:  # None: the client went away while sending it
                    await self.app(scope, ReplayedBody(body, receive), send)
                return
        self.metrics.rejected(endpoint_label(scope["path"]), error.status, error.code or error.type)
        await error.response()(scope, receive, send)

    def _check_host(self, headers: Headers) -> APIError | None:
        allowed = self.config.allowed_hosts
        host = headers.get("host", "")
        if allowed is None or host_allowed(host, allowed):
            return None
        return APIError(
            421,
            f"Host header {host[:100]!r} is not one this server answers ({', '.join(sorted(allowed))}); "
            "connect by one of those names or start the server with --allowed-hosts",
            code="host_not_allowed",
        )

    def _check_key(self, path: str, headers: Headers) -> APIError | None:
        key = self.config.api_key
        if key is None or path in self.config.open_paths:
            return None
        scheme, _, token = headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return None
        return APIError(401, "missing or wrong API key; send the header Authorization: Bearer <key>", code="invalid_api_key")

    async def _read_body(self, headers: Headers, receive: Receive) -> tuple[bytes | None, APIError | None]:
        """The whole body, or the error that ends the request: over `max_body_bytes` (by
        Content-Length or by count) or not all there within `body_timeout_s`; (None, None)
        when the client disconnected."""
        limit = self.config.max_body_bytes
        too_large = APIError(
            413,
            f"request body is larger than this server's limit of {limit} bytes; send a smaller "
            "request (or start the server with a larger --max-body-bytes)",
            code="request_too_large", headers=_CLOSE,
        )
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return b"", too_large
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.config.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                return b"", APIError(
                    408, f"request body not received within {self.config.body_timeout_s:.0f} s; send it at once",
                    code="request_timeout", headers=_CLOSE,
                )
            if message["type"] != "http.request":
                return None, None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return b"", too_large
            if not message.get("more_body", False):
                return b"".join(chunks), None


# The rest of a refused body may still be on its way: the connection cannot carry another request.
_CLOSE = {"connection": "close"}


class ReplayedBody:
    """An ASGI `receive` that returns an already read body as one message, then passes
    through to the connection's own (for the disconnect a handler waits for)."""

    def __init__(self, body: bytes, receive: Receive):
        self.body: bytes | None = body
        self.receive = receive

    async def __call__(self) -> Message:
        if self.body is None:
            return await self.receive()
        message: dict[str, Any] = {"type": "http.request", "body": self.body, "more_body": False}
        self.body = None
        return message


class CountedSend:
    """An ASGI `send` that tells the throttle the status of the response it starts."""

    def __init__(self, send: Send, throttle: ClientThrottle, client: str):
        self.send = send
        self.throttle = throttle
        self.client = client

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.throttle.record(self.client, message["status"])
        await self.send(message)
