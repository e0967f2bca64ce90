"""A front process's stand-in for the LLM (`--front-processes`): the calls the HTTP server makes
(`aprepare`, `aencode_prompt`, `acomplete`, `astream`), each sent over the engine link
(engine_link.py) to the engine process and answered there by the one LLM.

One connection carries all of the front's calls, told apart by a call id. A call cancelled
here (its HTTP client went away) is cancelled there, which aborts its engine request. When the
engine process stops, every call in flight ends with a 503 `engine_unavailable` and `on_lost`
runs (the front then stops itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from structgen_server.engine_link import Admission, Outbox, StreamEnd, engine_gone_error, read_batch


@dataclass(frozen=True)
class EngineFacts:
    """What the server reads of the model itself, sent to each front when it starts."""

    model_name: str
    chat_template: str | None  # the tool format's check (`tool_format.template_supports_tools`)
    max_seq_len: int
    template_thinks: bool

    @classmethod
    def of(cls, llm: Any) -> EngineFacts:
        return cls(llm.model_name, getattr(llm.tokenizer, "chat_template", None), int(llm.engine.max_seq_len),
                   bool(llm.engine.reasoner.template_thinks))


class _Call:
    """One call waiting for its answer."""

    def __init__(self) -> None:
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def deliver(self, kind: str, value: Any) -> None:
        if self.future.done():
            return
        if kind == "ok":
            self.future.set_result(value)
        elif kind == "error":
            self.future.set_exception(value)


class EngineClient:
    """The engine process's LLM, as the server uses it, over one Unix socket at `path`."""

    def __init__(self, path: str, facts: EngineFacts, on_lost: Callable[[], None] = lambda: None):
        self.path = path
        self.facts = facts
        self.model_name = facts.model_name
        self.tokenizer = facts  # the tool format reads only its `chat_template`
        self.on_lost = on_lost
        self._ids = itertools.count()
        self._pending: dict[int, _Call | RemoteStream] = {}
        self._outbox: Outbox | None = None
        self._connecting: asyncio.Lock | None = None
        self._reader: asyncio.Task[None] | None = None
        self.closed = False

    # -- the LLM's calls -------------------------------------------------------------------
    async def aprepare(self, output_type: Any, *, strict: bool = True) -> Any:
        return await self.call("prepare", Admission.current(), output_type, strict)

    async def aencode_prompt(self, prompt: Any, *, chat: bool | None = None,
                             tools: list[dict[str, Any]] | None = None) -> list[int]:
        ids: list[int] = await self.call("encode", prompt, chat, tools)
        return ids

    async def acomplete(self, output_type: Any, prompt: Any, **options: Any) -> StreamEnd:
        end: StreamEnd = await self.call("complete", Admission.current(), output_type, prompt, options)
        return end

    def astream(self, output_type: Any, prompt: Any, **options: Any) -> RemoteStream:
        return RemoteStream(self, (Admission.current(), output_type, prompt, options))

    async def engine_load(self) -> dict[str, int]:
        load: dict[str, int] = await self.call("load")
        return load

    async def metrics_text(self) -> str:
        text: str = await self.call("metrics")
        return text

    def count(self, method: str, *args: Any) -> None:
        """Record a metric in the engine process, where all fronts' metrics are kept."""
        if self._outbox is not None:
            self._outbox.put(("count", method, args))
        elif not self.closed:
            asyncio.ensure_future(self._count_once_linked(method, args))

    def close(self) -> None:
        self.closed = True
        if self._outbox is not None:
            self._outbox.writer.close()
        if self._reader is not None:
            self._reader.cancel()

    # -- the link ------------------------------------------------------------------------
    async def call(self, kind: str, *args: Any) -> Any:
        """Send one call and wait for its answer; cancelled here, cancelled there."""
        waiter = _Call()
        rid = await self.send(kind, waiter, args)
        try:
            return await waiter.future
        finally:
            self.forget(rid, cancel=not waiter.future.done())

    async def send(self, kind: str, target: _Call | RemoteStream, args: tuple[Any, ...]) -> int:
        """Send a call whose answers go to `target`; its id."""
        outbox = await self._link()
        rid = next(self._ids)
        self._pending[rid] = target
        outbox.put((kind, rid, *args))
        return rid

    def forget(self, rid: int, cancel: bool) -> None:
        """Stop delivering call `rid`'s answers; with `cancel`, cancel it in the engine process."""
        self._pending.pop(rid, None)
        if cancel and self._outbox is not None:
            self._outbox.put(("cancel", rid))

    async def _link(self) -> Outbox:
        if self._outbox is not None:
            return self._outbox
        if self.closed:
            raise engine_gone_error()
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._outbox is None:
                try:
                    reader, writer = await asyncio.open_unix_connection(self.path)
                except OSError as e:
                    raise engine_gone_error() from e
                self._outbox = Outbox(writer)
                self._reader = asyncio.ensure_future(self._read(reader))
        return self._outbox

    async def _count_once_linked(self, method: str, args: tuple[Any, ...]) -> None:
        with contextlib.suppress(Exception):
            (await self._link()).put(("count", method, args))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                for kind, rid, value in await read_batch(reader):
                    if (target := self._pending.get(rid)) is not None:
                        target.deliver(kind, value)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self._lost()

    def _lost(self) -> None:
        """The engine process went away: fail what waits on it, and tell the front."""
        self.closed = True
        self._outbox = None
        for target in list(self._pending.values()):
            target.deliver("error", engine_gone_error())
        self._pending.clear()
        self.on_lost()


class RemoteStream:
    """`async for delta in client.astream(...)`, like `LLM.astream`; `.end` says how it ended.
    Leaving the loop early cancels the generation in the engine process."""

    def __init__(self, client: EngineClient, args: tuple[Any, ...]):
        self.client = client
        self.args = args
        self.end: StreamEnd | None = None
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def deliver(self, kind: str, value: Any) -> None:
        self._queue.put_nowait((kind, value))

    def __aiter__(self) -> AsyncIterator[str]:
        return self._run()

    async def _run(self) -> AsyncIterator[str]:
        rid = await self.client.send("stream", self, self.args)
        finished = False
        try:
            while True:
                kind, value = await self._queue.get()
                if kind == "delta":
                    yield value
                elif kind == "end":
                    self.end = value
                elif kind == "ok":
                    self.end, finished = value, True
                    return
                else:
                    finished = True
                    raise value
        finally:
            self.client.forget(rid, cancel=not finished)


class MetricsRelay:
    """The server's `Metrics` calls of a front, kept in the engine process with every other
    front's (a scrape of `/metrics` reaches one front, and must see them all)."""

    def __init__(self, client: EngineClient):
        self.client = client

    def started(self) -> None:
        self.client.count("started")

    def finished(self, endpoint: str, status: int, latency_s: float, error_type: str | None = None) -> None:
        self.client.count("finished", endpoint, status, latency_s, error_type)

    def rejected(self, endpoint: str, status: int, error_type: str) -> None:
        self.client.count("rejected", endpoint, status, error_type)

    def record_generation(self, prompt_tokens: int, output_tokens: int, stats: Any = None) -> None:
        self.client.count("record_generation", prompt_tokens, output_tokens, stats)

    def request_planned(self, seconds: float) -> None:
        self.client.count("request_planned", seconds)

    def first_text_sent(self, seconds: float) -> None:
        self.client.count("first_text_sent", seconds)
