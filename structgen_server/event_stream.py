"""`EventStream`: the ASGI response of a streamed completion, server-sent events written as
they come with the least work per event (one `send` of bytes, no task of its own beside the
one serving the request), and a client that hangs up cancels the stream, which aborts its
engine request, instead of letting it decode for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from structgen_server.serving import wait_for_disconnect

HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class EventStream(Response):
    """`return EventStream(events)` from a handler; `events` yields whole SSE events (str).
    A `Response` so that FastAPI passes it through as it is."""

    def __init__(self, events: AsyncGenerator[str, None]):  # no body, headers built once above
        self.events = events
        self.background = None
        self.task: asyncio.Task | None = None
        self.open = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.task, self.open = asyncio.current_task(), True
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        watcher.add_done_callback(self._on_disconnect)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not (watcher.done() and not watcher.cancelled()):
                raise  # cancelled from elsewhere (shutdown): not ours to swallow
            if hasattr(self.task, "uncancel"):  # Python 3.11+; 3.10 keeps no cancel count
                self.task.uncancel()  # the client went away: the response just ends
        except OSError:  # the connection broke while writing
            pass
        finally:
            self.open = False
            watcher.cancel()
            await self.events.aclose()

    def _on_disconnect(self, watcher: asyncio.Future) -> None:
        if self.open and not watcher.cancelled() and self.task is not None:
            self.task.cancel()
