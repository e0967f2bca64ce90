"""uvicorn's HTTP/1.1 protocol with a deadline and a size limit for each request head: a
connection that opens and sends nothing, or sends its headers a few bytes at a time, is closed
after `HEAD_TIMEOUT_S` instead of being held for ever (uvicorn's keep-alive timeout starts only
after a response, and any byte received cancels it), and one whose head grows past
`MAX_HEAD_BYTES` is closed too. A head the parser refuses is answered with a JSON error.

Between requests an idle kept-alive connection is closed by uvicorn's keep-alive timeout
alone, set longer than clients keep idle connections (`KEEP_ALIVE_S`): when the server closes
one first, a client that picks it for its next request at that moment gets no answer, and a
POST is not retried. The head deadline starts again with the first byte of the next request.

`http_protocol()` is the httptools-based protocol when httptools is installed (less work per
streamed chunk than h11), else the h11 one.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 64 * 1024  # request line + headers
KEEP_ALIVE_S = 20  # httpx (the openai client) keeps idle connections 5 s, aiohttp 15 s


_MALFORMED_BODY = json.dumps({"error": {
    "message": "malformed HTTP request: its request line or headers could not be parsed; send an HTTP/1.1 "
               "request (the method, path and version, then one 'Name: value' header a line)",
    "type": "invalid_request_error", "param": None, "code": "malformed_request"}}).encode()
MALFORMED_HEAD_RESPONSE = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\nconnection: close\r\n\r\n" % len(_MALFORMED_BODY) + _MALFORMED_BODY)


class HeadDeadline:
    """The deadline and size limit, over either of uvicorn's HTTP/1.1 protocols (a mixin
    before the protocol class, whose `cycle`, `loop` and `transport` it reads)."""

    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.head_deadline: asyncio.TimerHandle | None = None
        self.head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._disarm_head_deadline()  # idle now: the keep-alive timeout's business

    def data_received(self, data: bytes) -> None:
        if self.head_deadline is None:  # the first bytes of a request on a kept-alive connection
            self._arm_head_deadline()
        super().data_received(data)  # type: ignore[misc]
        if not self._waiting_for_head():
            self.head_bytes = 0
            return
        self.head_bytes += len(data)
        if self.head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)  # type: ignore[misc]

    def send_400_response(self, msg: str) -> None:
        """A request head the parser refuses gets the JSON error every other error is (uvicorn
        answers it in plain text), then the connection closes (its state is unknown)."""
        self.transport.write(MALFORMED_HEAD_RESPONSE)
        self.transport.close()

    def _waiting_for_head(self) -> bool:
        """A new request cycle starts once its head is complete."""
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self.head_deadline = self.loop.call_later(HEAD_TIMEOUT_S, self._close_if_no_request)

    def _disarm_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _close_if_no_request(self) -> None:
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()


class HeadDeadlineProtocol(HeadDeadline, H11Protocol):
    """`uvicorn.run(..., http=HeadDeadlineProtocol)`: the h11 protocol."""


def http_protocol() -> type[asyncio.Protocol]:
    """The protocol class `server_config` gives uvicorn: httptools' when installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return HeadDeadlineProtocol
    return type("HeadDeadlineHttpToolsProtocol", (HeadDeadline, HttpToolsProtocol), {})
