"""Running one choice of one request on the shared engine: the glue between an HTTP request and
`LLM.acomplete` / `LLM.astream`.

It adds what the wire protocol needs and the in-process API does not: `stop` strings (applied
to the text stream, with a look-behind so a stop string split across deltas is never sent; one
that cuts a constrained output before it is complete fails the choice, naming it),
truncation reported as `finish_reason="length"` with the partial text (as OpenAI does) rather
than an exception, token counts for `usage`, and cancellation when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request as HTTPRequest
from starlette.types import Receive

from structgen.api import CompletionStream
from structgen.arguments import EncodedPrompt
from structgen.completion import ReasoningDelta
from structgen.errors import IncompleteOutputError, OutputValidationError, StructgenError
from structgen.types import Constraint
from structgen_server.engine_link import StreamEnd

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away; its generation was cancelled."""


@dataclass
class Job:
    """Everything needed to run one choice: the output type, the prompt's token ids (tokenized
    once, while planning), the sampling settings for `LLM.acomplete`, and the request's stop
    strings."""

    output_type: Any
    prompt: EncodedPrompt
    sampling: dict[str, Any]
    stop: list[str] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)

    def kwargs(self) -> dict[str, Any]:
        return self.sampling


@dataclass
class Generation:
    """The outcome of one choice."""

    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    stats: Any = None  # GenerationStats when the engine finished the request
    reasoning: str | None = None  # a reasoning model's thinking, apart from `text`
    stopped_by: str | None = None  # the stop string that ended `text`, if one did


async def generate(llm: Any, job: Job) -> Generation:
    """Run a job to the end. Without stop strings this is one `acomplete`; with them the text
    is streamed so generation can end at the first stop string."""
    if job.stop:
        stream = GenerationStream(llm, job)
        async with contextlib.aclosing(stream.deltas()) as deltas:
            async for _ in deltas:
                pass
        assert stream.result is not None
        return stream.result
    try:
        c = await llm.acomplete(job.output_type, job.prompt, **job.kwargs())
    except IncompleteOutputError as e:
        return _truncated(job, e)
    return Generation(c.text, c.finish_reason, c.stats.prompt_tokens or job.prompt_tokens, c.stats.output_tokens, c.stats,
                      c.reasoning)


def _truncated(job: Job, e: IncompleteOutputError) -> Generation:
    return Generation(e.partial_text, "length", job.prompt_tokens, len(e.token_ids), getattr(e, "stats", None))


class GenerationStream:
    """Text deltas of one job with stop strings applied; `.result` is set once it ends. A
    reasoning model's thinking comes first as `ReasoningDelta`s, which stop strings do not cut.

    Closing the `deltas()` iterator early (client gone, stop string found) closes the engine
    stream, which aborts the request and frees its KV slot."""

    def __init__(self, llm: Any, job: Job):
        self.llm = llm
        self.job = job
        self.result: Generation | None = None

    async def deltas(self) -> AsyncIterator[str]:
        job = self.job
        inner = self.llm.astream(job.output_type, job.prompt, **job.kwargs())
        hold = max((len(s) for s in job.stop), default=1) - 1  # chars that may start a stop string
        text, sent = "", 0
        finish, stopped_by = "stop", None
        thinking: list[str] = []
        async with contextlib.aclosing(inner.__aiter__()) as pieces:
            try:
                async for piece in pieces:
                    if isinstance(piece, ReasoningDelta):
                        thinking.append(piece)
                        yield piece
                        continue
                    text += piece
                    cut = _find_stop(text, job.stop, start=max(sent - hold, 0))
                    if cut is not None:
                        stopped_by = next(s for s in job.stop if text.startswith(s, cut))
                        _check_cut(job, text[:cut], stopped_by)
                        text = text[:cut]
                        break
                    safe = len(text) - hold if job.stop else len(text)
                    if safe > sent:
                        yield text[sent:safe]
                        sent = safe
            except IncompleteOutputError:
                finish = "length"
        if len(text) > sent:
            yield text[sent:]
        end = stream_end(inner)
        reasoning = "".join(thinking) or None
        if end.text is not None and end.finish_reason is not None:  # finished without a stop string: trust the engine
            text, finish, reasoning = end.text, end.finish_reason, end.reasoning
        self.result = Generation(text, finish, job.prompt_tokens, end.output_tokens, end.stats, reasoning, stopped_by)


def stream_end(stream: Any) -> StreamEnd:
    """How a stream of `LLM.astream` (or the engine link's `RemoteStream`) ended, so far."""
    if not isinstance(stream, CompletionStream):
        return getattr(stream, "end", None) or StreamEnd(None, None, None, 0, None)
    completion, request = stream.completion, stream.request
    n_out = len(request.output_ids) if request is not None else 0
    if completion is None:
        return StreamEnd(None, None, None, n_out, getattr(request, "stats", None))
    return StreamEnd(completion.text, completion.finish_reason, completion.reasoning, n_out, completion.stats)


def _check_cut(job: Job, text: str, stop: str) -> None:
    """A stop string may end free text anywhere, but a constrained output only where it is a
    whole value: else the choice fails, naming the string, rather than returning a value that
    does not parse as finished. (A tool call's grammar parses nothing: `cut_error` names the
    string where the call's text then fails to parse.)"""
    constraint = job.output_type
    if not isinstance(constraint, Constraint) or constraint.kind == "text":
        return
    try:
        constraint.parse(text)
    except StructgenError as e:
        raise cut_error(stop, text, f"a whole value of {constraint.description}", e) from e


def cut_error(stop: str, text: str, what: str, error: Exception) -> OutputValidationError:
    """The error of an output that stop string `stop` cut before it was `what`."""
    return OutputValidationError(
        f"stop string {stop!r} ended the output after {len(text)} characters, before it was {what} ({error}); "
        "the grammar ends a constrained output: leave such strings out of `stop`", text=text)


def _find_stop(text: str, stops: list[str], start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops) if i != -1]
    return min(hits) if hits else None


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client closes the connection (the body has been read already, so the
    next ASGI message is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(work: Awaitable[T], request: HTTPRequest) -> T:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client
    disconnects first; then raise `ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected()
