"""Generations -> OpenAI responses, whole (`chat.completion`, `text_completion`) or streamed as
server-sent events exactly as OpenAI sends them: a role delta first, content deltas, tool calls,
a last chunk carrying `finish_reason`, an optional usage chunk (`stream_options.include_usage`),
then `data: [DONE]`. With `stream_options.include_partial` (a structgen extension) a chunk's
choice also carries `partial`, the JSON output parsed so far, under a key OpenAI's clients
ignore.

Tool calls are read from the finished text (`tool_format.parse_tool_calls`). When streaming a
turn that may call tools, text is held back only while it could still be the start of
`<tool_call>`; plain answers stream as they are decoded.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from structgen import tool_format
from structgen.completion import ReasoningDelta
from structgen.partial import Partial, PartialTracker
from structgen_server.constraints import RequestConstraint
from structgen_server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    FunctionCall,
    PromptTokensDetails,
    TextChoice,
    TextCompletion,
    ToolCall,
    Usage,
    new_id,
    now,
)
from structgen_server.serving import Generation


def assistant_turn(rc: RequestConstraint, g: Generation) -> tuple[str | None, list[ToolCall] | None, str]:
    """`(content, tool_calls, finish_reason)` of one generation. A truncated turn is returned
    as text with finish_reason "length", as OpenAI does."""
    if rc.tool_choice is None or rc.tool_choice.mode == "none" or g.finish_reason == "length":
        return g.text, None, g.finish_reason
    parsed, content = tool_format.parse_tool_calls(g.text, rc.tools or [], rc.tool_choice)
    if not parsed:
        return content, None, g.finish_reason
    calls = [ToolCall(id=p.id, function=FunctionCall(name=p.name, arguments=json.dumps(p.arguments))) for p in parsed]
    return None, calls, "tool_calls"


def usage_of(gens: list[Generation], n: int = 1) -> Usage:
    """Usage of a request: each prompt counted once (choices come in groups of `n` per
    prompt), every choice's output tokens."""
    prompt = sum(g.prompt_tokens for g in gens[::n])
    completion = sum(g.completion_tokens for g in gens)
    cached = sum(getattr(g.stats, "cached_prompt_tokens", 0) for g in gens[::n])
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def chat_response(model: str, rc: RequestConstraint, gens: list[Generation]) -> ChatCompletion:
    choices = []
    for i, g in enumerate(gens):
        content, calls, finish = assistant_turn(rc, g)
        message = AssistantMessage(content=content, reasoning_content=g.reasoning, tool_calls=calls)
        choices.append(ChatChoice(index=i, message=message, finish_reason=finish))
    return ChatCompletion(id=new_id("chatcmpl"), model=model, choices=choices, usage=usage_of(gens, n=len(gens)))


def completion_response(model: str, gens: list[Generation], n: int) -> TextCompletion:
    """`n` choices per prompt, in prompt order (choice index = prompt index * n + j)."""
    choices = [TextChoice(index=i, text=g.text, finish_reason=g.finish_reason) for i, g in enumerate(gens)]
    return TextCompletion(id=new_id("cmpl"), model=model, choices=choices, usage=usage_of(gens, n))


# --------------------------------------------------------------------------- streaming


def partial_payload(snapshot: Partial[Any]) -> dict[str, Any]:
    """A snapshot as the `partial` key of a chunk's choice (its text is the chunk's content)."""
    path = None if snapshot.path is None else list(snapshot.path)
    finished = [list(p) for p in snapshot.finished]
    return {"value": snapshot.value, "finished": finished, "path": path, "done": snapshot.done}


def last_partial(tracker: PartialTracker[Any] | None, g: Generation) -> dict[str, Any] | None:
    """The `partial` of the last chunk: the whole value, when the output ended complete."""
    if tracker is None or g.finish_reason != "stop":
        return None
    try:
        value = json.loads(g.text)
    except ValueError:  # cut by a stop string
        return None
    return partial_payload(tracker.finish(value))


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def _snapshot(tracker: PartialTracker[Any] | None, text: str) -> dict[str, Any] | None:
    """The `partial` of a chunk of `text`: None without the extension or when nothing
    visible changed."""
    snapshot = tracker.feed(text) if tracker is not None else None
    return partial_payload(snapshot) if snapshot is not None else None


class _ToolCallSplitter:
    """Decides, as text arrives, whether it is content (stream it) or a tool-call payload (hold
    it until the turn ends and send parsed calls)."""

    def __init__(self, rc: RequestConstraint):
        mode = rc.tool_choice.mode if rc.tool_choice else "none"
        self.state = {"none": "text", "auto": "undecided"}.get(mode, "calls")
        self.held = ""

    def feed(self, piece: str) -> str:
        if self.state == "text":
            return piece
        self.held += piece
        if self.state == "undecided":
            head = self.held.lstrip()
            if head.startswith(tool_format.TOOL_CALL_OPEN):
                self.state = "calls"
            elif not tool_format.TOOL_CALL_OPEN.startswith(head):
                self.state, out, self.held = "text", self.held, ""
                return out
        return ""


async def chat_stream(
    model: str,
    rc: RequestConstraint,
    pieces: AsyncIterator[str],
    result: Any,
    include_usage: bool,
    tracker: PartialTracker[Any] | None = None,
) -> AsyncIterator[str]:
    """SSE events of a streamed chat completion. `pieces` yields text deltas; `result()`
    returns the `Generation` once they are exhausted; `tracker` (include_partial) makes the
    snapshots each chunk carries."""
    cid, created = new_id("chatcmpl"), now()

    def chunk(delta: dict[str, Any], finish: str | None = None, partial: dict[str, Any] | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if partial is not None:
            choice["partial"] = partial
        body: dict[str, Any] = {
            "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice],
        }
        if include_usage:
            body["usage"] = None
        return sse(body)

    yield chunk({"role": "assistant", "content": ""})
    splitter = _ToolCallSplitter(rc)
    async for piece in pieces:
        if isinstance(piece, ReasoningDelta):  # a reasoning model's thinking, before the answer
            yield chunk({"reasoning_content": str(piece)})
            continue
        content = splitter.feed(piece)
        if content:
            yield chunk({"content": content}, partial=_snapshot(tracker, content))
    g: Generation = result()
    content, calls, finish = assistant_turn(rc, g)
    if calls:
        for i, call in enumerate(calls):
            delta = {"index": i, "id": call.id, "type": "function",
                     "function": {"name": call.function.name, "arguments": call.function.arguments}}
            yield chunk({"tool_calls": [delta]})
    elif splitter.held:  # held back as a possible tool call, but it was text after all
        yield chunk({"content": splitter.held})
    yield chunk({}, finish, last_partial(tracker, g))
    if include_usage:
        yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": usage_of([g]).model_dump()})
    yield sse("[DONE]")


async def completion_stream(
    model: str, pieces: AsyncIterator[str], result: Any, include_usage: bool,
    tracker: PartialTracker[Any] | None = None,
) -> AsyncIterator[str]:  # fmt: skip
    """SSE events of a streamed text completion (`tracker`: as in `chat_stream`)."""
    cid, created = new_id("cmpl"), now()

    def chunk(text: str, finish: str | None = None, partial: dict[str, Any] | None = None) -> str:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if partial is not None:
            choice["partial"] = partial
        body: dict[str, Any] = {
            "id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
        }
        if include_usage:
            body["usage"] = None
        return sse(body)

    async for piece in pieces:
        if isinstance(piece, ReasoningDelta):  # text completions carry the answer only
            continue
        yield chunk(piece, partial=_snapshot(tracker, piece))
    g: Generation = result()
    yield chunk("", g.finish_reason, last_partial(tracker, g))
    if include_usage:
        yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": usage_of([g]).model_dump()})
    yield sse("[DONE]")


def error_event(error: dict[str, Any]) -> str:
    """An error after the stream started (headers are sent; the status can no longer change)."""
    return sse({"error": error})
