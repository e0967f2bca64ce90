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
from json.encoder import encode_basestring_ascii
from typing import Any

from structgen import tool_format
from structgen.completion import ReasoningDelta
from structgen.errors import OutputValidationError
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
from structgen_server.serving import Generation, cut_error


def assistant_turn(rc: RequestConstraint, g: Generation) -> tuple[str | None, list[ToolCall] | None, str]:
    """`(content, tool_calls, finish_reason)` of one generation. A truncated turn is returned
    as text with finish_reason "length", as OpenAI does."""
    if rc.tool_choice is None or rc.tool_choice.mode == "none" or g.finish_reason == "length":
        return g.text, None, g.finish_reason
    try:
        parsed, content = tool_format.parse_tool_calls(g.text, rc.tools or [], rc.tool_choice)
    except OutputValidationError as e:
        if g.stopped_by is None:
            raise
        raise cut_error(g.stopped_by, g.text, "a whole tool call", e) from e
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


SEPARATORS = (",", ":")


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=SEPARATORS)
    return f"data: {data}\n\n"


DONE = sse("[DONE]")


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


class ChunkEncoder:
    """The SSE events of one streamed response. The fields every chunk repeats are serialized
    once, so a plain text delta, the event sent for nearly every engine step, costs one
    encoding of its text as a JSON string; any other chunk is serialized whole."""

    CHAT_TEXT = ('{"index":0,"delta":{"content":', '},"logprobs":null,"finish_reason":null}')
    COMPLETION_TEXT = ('{"index":0,"text":', ',"logprobs":null,"finish_reason":null}')

    def __init__(self, obj: str, cid: str, model: str, include_usage: bool, text_choice: tuple[str, str]):
        self.fields = {"id": cid, "object": obj, "created": now(), "model": model}
        self.head = "data: " + json.dumps(self.fields, separators=SEPARATORS)[:-1] + ',"choices":['
        self.tail = "]" + (',"usage":null' if include_usage else "") + "}\n\n"
        self.text_head = self.head + text_choice[0]
        self.text_tail = text_choice[1] + self.tail

    def text(self, text: str) -> str:
        """A chunk whose one choice carries `text` and nothing else (`json.dumps(text)`
        without the encoder object around the C function it ends in)."""
        return self.text_head + encode_basestring_ascii(text) + self.text_tail

    def choice(self, choice: dict[str, Any]) -> str:
        return self.head + json.dumps(choice, separators=SEPARATORS) + self.tail

    def usage(self, g: Generation) -> str:
        """The last chunk of `stream_options.include_usage`: no choices, the usage."""
        return sse({**self.fields, "choices": [], "usage": usage_of([g]).model_dump()})


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
    snapshots each chunk carries. What is ready at once leaves in one write: the role chunk
    with the first delta, the last chunks with `[DONE]`."""
    enc = ChunkEncoder("chat.completion.chunk", new_id("chatcmpl"), model, include_usage, ChunkEncoder.CHAT_TEXT)

    def chunk(delta: dict[str, Any], finish: str | None = None, partial: dict[str, Any] | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if partial is not None:
            choice["partial"] = partial
        return enc.choice(choice)

    opening = chunk({"role": "assistant", "content": ""})
    splitter = _ToolCallSplitter(rc)
    async for piece in pieces:
        event = ""
        if isinstance(piece, ReasoningDelta):  # a reasoning model's thinking, before the answer
            event = chunk({"reasoning_content": str(piece)})
        elif content := splitter.feed(piece):
            partial = _snapshot(tracker, content)
            event = enc.text(content) if partial is None else chunk({"content": content}, partial=partial)
        if opening:
            event, opening = opening + event, ""
        if event:
            yield event
    g: Generation = result()
    content, calls, finish = assistant_turn(rc, g)
    closing = [opening]
    if calls:
        for i, call in enumerate(calls):
            delta = {"index": i, "id": call.id, "type": "function",
                     "function": {"name": call.function.name, "arguments": call.function.arguments}}
            closing.append(chunk({"tool_calls": [delta]}))
    elif splitter.held:  # held back as a possible tool call, but it was text after all
        closing.append(enc.text(splitter.held))
    closing.append(chunk({}, finish, last_partial(tracker, g)))
    if include_usage:
        closing.append(enc.usage(g))
    closing.append(DONE)
    yield "".join(closing)


async def completion_stream(
    model: str, pieces: AsyncIterator[str], result: Any, include_usage: bool,
    tracker: PartialTracker[Any] | None = None,
) -> AsyncIterator[str]:  # fmt: skip
    """SSE events of a streamed text completion (`tracker`: as in `chat_stream`); the last
    chunks leave with `[DONE]` in one write."""
    enc = ChunkEncoder("text_completion", new_id("cmpl"), model, include_usage, ChunkEncoder.COMPLETION_TEXT)

    def chunk(text: str, finish: str | None = None, partial: dict[str, Any] | None = None) -> str:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if partial is not None:
            choice["partial"] = partial
        return enc.choice(choice)

    async for piece in pieces:
        if isinstance(piece, ReasoningDelta):  # text completions carry the answer only
            continue
        partial = _snapshot(tracker, piece)
        yield enc.text(piece) if partial is None else chunk(piece, partial=partial)
    g: Generation = result()
    closing = [chunk("", g.finish_reason, last_partial(tracker, g))]
    if include_usage:
        closing.append(enc.usage(g))
    closing.append(DONE)
    yield "".join(closing)


def error_event(error: dict[str, Any]) -> str:
    """An error after the stream started (headers are sent; the status can no longer change)."""
    return sse({"error": error})
