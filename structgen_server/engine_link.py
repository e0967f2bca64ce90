"""The wire between the HTTP front processes and the engine process (`--front-processes`): a
Unix socket in a private folder, carrying frames of a 4-byte length and a pickled list of
messages. Each side sends what one turn of its event loop produced as one frame (`Outbox`), so
256 streams' deltas of one engine step cost one write, not 256.

Messages are tuples, their first item the kind. Front -> engine: `("prepare", rid, admission,
output_type, strict)`, `("encode", rid, prompt, chat, tools)`, `("complete" | "stream", rid,
admission, output_type, prompt, options)` (`Admission`: whom the call is for), `("cancel",
rid)`, `("load", rid)`, `("metrics", rid)` and
`("count", method, args)` (a metric, no answer). Engine -> front: `("ok", rid, value)`,
`("error", rid, exception)`, `("delta", rid, text)` and `("end", rid, StreamEnd)`.

Pickle is safe here because both ends are this server's own processes: the socket's folder is
readable by its user alone (`private_socket_path`).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
import tempfile
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

from structgen.engine.request import request_client, request_group
from structgen_server.errors import APIError, to_api_error

# A frame larger than this is a broken peer, not a message (request bodies are capped far lower).
MAX_FRAME_BYTES = 1 << 30
# A front that reads nothing while this much waits for it is hung: the engine drops it.
MAX_UNSENT_BYTES = 256 << 20
_LENGTH = struct.Struct("!I")


class Admission(NamedTuple):
    """The admission group and client (engine/request.py) of a front's call: the engine
    process runs the call under them, so its compile and its slot are shared fairly."""

    group: Hashable
    client: Hashable

    @classmethod
    def current(cls) -> Admission:
        return cls(request_group.get(), request_client.get())

    def enter(self) -> None:
        """Run this task's compiles and engine requests under them."""
        request_group.set(self.group)
        request_client.set(self.client)


@dataclass
class StreamEnd:
    """How a streamed generation ended, for the front's `usage` and metrics: the finished
    completion's fields where it finished (None when cut short), its output token count and
    the engine's stats."""

    text: str | None
    finish_reason: str | None
    reasoning: str | None
    output_tokens: int
    stats: Any


def private_socket_path() -> str:
    """A socket path in a new folder only this user can enter."""
    folder = tempfile.mkdtemp(prefix="structgen-engine-")  # mode 0700
    return os.path.join(folder, "engine.sock")


async def read_batch(reader: asyncio.StreamReader) -> list[tuple[Any, ...]]:
    """The next frame's messages; `asyncio.IncompleteReadError` at the end of the stream."""
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"a frame of {size} bytes on the engine link: the peer is broken")
    messages: list[tuple[Any, ...]] = pickle.loads(await reader.readexactly(size))
    return messages


class Outbox:
    """Messages to one peer, written as one frame once the event loop's current turn ends."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self._messages: list[tuple[Any, ...]] = []

    def put(self, message: tuple[Any, ...]) -> None:
        if self.writer.is_closing():
            return
        if not self._messages:
            asyncio.get_running_loop().call_soon(self._flush)
        self._messages.append(message)

    def _flush(self) -> None:
        messages, self._messages = self._messages, []
        if self.writer.is_closing():
            return
        data = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer.write(_LENGTH.pack(len(data)) + data)
        if self.writer.transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
            self.writer.close()  # the peer stopped reading: its requests end with the link


def portable_error(exc: BaseException) -> BaseException:
    """`exc` as it can cross the link: itself where it pickles back to its own class with its
    message, else the API error the front would have answered with."""
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc) and str(back) == str(exc):
            return exc
    except Exception:
        pass
    return to_api_error(exc)


def engine_gone_error() -> APIError:
    """The answer to requests in flight when the engine process stopped."""
    return APIError(503, "the engine process stopped; send the request again once the server is back",
                    type="server_error", code="engine_unavailable")
