"""The engine process's side of `--front-processes`: it owns the LLM and answers the front
processes' calls over the engine link (engine_link.py), so the HTTP work (parsing, checking,
formatting, streaming events) runs in processes of its own and never holds the GIL the engine
thread needs (docs/performance.md, "The HTTP front in processes of its own").

Each call runs as a task of its own, under the admission group and client the front gave it;
a front's `cancel` (its client went away) cancels the task, which aborts the engine request,
and a front that disconnects has all its calls cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from structgen.api import LLM
from structgen.types import Constraint
from structgen_server.engine_link import Admission, Outbox, StreamEnd, portable_error, read_batch
from structgen_server.errors import APIError
from structgen_server.metrics import Metrics, engine_load
from structgen_server.serving import stream_end

log = logging.getLogger("structgen.server")

# Prepared constraints kept for the fronts' requests that follow their `prepare`: a request
# submits within milliseconds of it, so only thousands of other schemas in between evict one.
MAX_PREPARED = 4096
COUNTED = frozenset({"started", "finished", "rejected", "record_generation", "request_planned", "first_text_sent"})


class EngineHost:
    """Serves the front processes' calls on one LLM; `metrics` are all fronts' together."""

    def __init__(self, llm: LLM, metrics: Metrics):
        self.llm = llm
        self.metrics = metrics
        self._prepared: OrderedDict[tuple[str, str, bool, str], Constraint] = OrderedDict()
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task[None]] = set()

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._serve_link, path=path)
        os.chmod(path, 0o600)

    async def close(self) -> None:
        """Stop listening and end every front's link (their calls are cancelled)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._links):
            task.cancel()
        await asyncio.gather(*self._links, return_exceptions=True)

    async def _serve_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        try:
            await FrontLink(self, reader, writer).run()
        finally:
            self._links.discard(task)

    # -- what the fronts' calls use ---------------------------------------------------------
    def keep(self, constraint: Constraint) -> Constraint:
        """Remember a prepared constraint; return what crosses the link: the same without its
        parser and fallback (closures the front never runs)."""
        self._prepared[constraint.key] = constraint
        self._prepared.move_to_end(constraint.key)
        while len(self._prepared) > MAX_PREPARED:
            self._prepared.popitem(last=False)
        return dataclasses.replace(constraint, parser=None, fallback=None)

    def resolve(self, output_type: Any) -> Any:
        """The output type a front's request names: a prepared constraint by its key."""
        if not isinstance(output_type, Constraint):
            return output_type
        prepared = self._prepared.get(output_type.key)
        if prepared is None:
            raise APIError(503, "the server forgot this request's compiled schema while it waited (thousands of "
                                "other schemas came in between); send it again", type="server_error",
                           code="constraint_evicted")
        return prepared


class FrontLink:
    """One front process's connection: its calls in flight, by the front's call id."""

    def __init__(self, host: EngineHost, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.host = host
        self.llm = host.llm
        self.reader = reader
        self.writer = writer
        self.outbox = Outbox(writer)
        self.calls: dict[int, asyncio.Task[None]] = {}

    async def run(self) -> None:
        try:
            while True:
                for message in await read_batch(self.reader):
                    self._dispatch(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front stopped
        finally:
            for task in list(self.calls.values()):
                task.cancel()
            self.writer.close()

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "cancel":
            if (task := self.calls.get(message[1])) is not None:
                task.cancel()
            return
        if kind == "count":
            if message[1] in COUNTED:
                getattr(self.host.metrics, message[1])(*message[2])
            return
        handlers: dict[str, Callable[..., Awaitable[Any]]] = {
            "prepare": self._prepare, "encode": self._encode, "complete": self._complete,
            "stream": self._stream, "load": self._load, "metrics": self._metrics,
        }  # fmt: skip
        rid = message[1]
        task = asyncio.create_task(self._answer(rid, handlers[kind], message[2:]))
        self.calls[rid] = task
        task.add_done_callback(lambda _: self.calls.pop(rid, None))

    async def _answer(self, rid: int, handler: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        try:
            value = await handler(rid, *args)
        except asyncio.CancelledError:
            return  # the front cancelled it, or it went away: nobody waits for an answer
        except Exception as exc:
            self.outbox.put(("error", rid, portable_error(exc)))
            return
        self.outbox.put(("ok", rid, value))

    async def _prepare(self, rid: int, admission: Admission, output_type: Any, strict: bool) -> Constraint:
        admission.enter()
        return self.host.keep(await self.llm.aprepare(output_type, strict=strict))

    async def _encode(self, rid: int, prompt: Any, chat: bool | None, tools: list[dict[str, Any]] | None) -> list[int]:
        return await self.llm.aencode_prompt(prompt, chat=chat, tools=tools)

    async def _complete(self, rid: int, admission: Admission, output_type: Any, prompt: Any,
                        options: dict[str, Any]) -> StreamEnd:
        admission.enter()
        c = await self.llm.acomplete(self.host.resolve(output_type), prompt, **options)
        return StreamEnd(c.text, c.finish_reason, c.reasoning, c.stats.output_tokens, c.stats)

    async def _stream(self, rid: int, admission: Admission, output_type: Any, prompt: Any,
                      options: dict[str, Any]) -> StreamEnd:
        """Each delta as it comes; how it ended goes before an error too (a truncated
        stream's token count and stats)."""
        admission.enter()
        stream = self.llm.astream(self.host.resolve(output_type), prompt, **options)
        try:
            async with contextlib.aclosing(stream.__aiter__()) as deltas:
                async for delta in deltas:
                    self.outbox.put(("delta", rid, delta))
        except Exception:
            self.outbox.put(("end", rid, stream_end(stream)))
            raise
        return stream_end(stream)

    async def _load(self, rid: int) -> dict[str, int]:
        return engine_load(self.llm)

    async def _metrics(self, rid: int) -> str:
        return self.host.metrics.render(engine=engine_load(self.llm))

