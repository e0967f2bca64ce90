"""How a server stops. SIGTERM or Ctrl-C drains it (`draining_server`): it keeps listening and
answers each new request with a JSON 503 `server_shutting_down` (`no_new_requests_error`),
`/health` says "stopping", and the running requests get `DRAIN_S` to finish; one still running
then is cancelled and answered with the same 503, a stream with that error event and `[DONE]`
(`shutting_down_error`). The process then returns from `run`: after SIGTERM it exits 0 with the
engine closed, after Ctrl-C the command prints "interrupted" and exits 130. The single server
and the data-parallel front end stop alike.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

from structgen_server.errors import APIError

# How long the running requests get to finish after a stop signal (a load balancer has
# usually stopped sending by then); uvicorn's own graceful timeout follows, and is short.
DRAIN_S = 5.0


def no_new_requests_error() -> APIError:
    """The answer to a request that arrives while the server drains before it stops."""
    return APIError(503, "the server is shutting down and takes no new requests; send this request again "
                         "once the server is back", type="server_error", code="server_shutting_down",
                    headers={"Connection": "close"})


def shutting_down_error() -> APIError:
    """The answer to a request still running when the drain ran out."""
    return APIError(503, "the server is shutting down and stopped this request before it finished; "
                    "send it again once the server is back", type="server_error", code="server_shutting_down")


def draining_server(config: Any, on_stop: Callable[[], None]) -> Any:
    """A `uvicorn.Server` that drains when SIGINT or SIGTERM arrives: `on_stop()` marks the
    app as stopping (it then refuses new requests), the listener stays open, and the running
    requests get `DRAIN_S` before uvicorn's own stop cuts what still runs. A second signal
    stops it without waiting. Unlike uvicorn's, it does not raise the signal again once stopped
    (SIGTERM's would kill the process before its engine or replicas are closed): `run` returns,
    and `stop_signal` says which came."""
    import uvicorn

    class Server(uvicorn.Server):
        stop_signal: int | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.stop_signal = self.stop_signal or sig
            self.force_exit = self.should_exit
            self.should_exit = True
            on_stop()

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            deadline = time.monotonic() + DRAIN_S
            while self.server_state.tasks and not self.force_exit and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await super().shutdown(sockets)

    return Server(config)
