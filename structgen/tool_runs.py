"""The agent loop, `run_tools`: the model calls tools, they run, their results (or errors) go back
to it as `tool` messages, until it answers in text or the rounds run out. One turn of calls is
`structgen.tools.call`."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic_core

from structgen.errors import IncompleteOutputError, InvalidParameterError, PromptTooLongError
from structgen.tools import (
    Tool,
    ToolCall,
    ainvoke_within,
    as_messages,
    as_tools,
    call,
    checked_timeout,
    invoke_on_thread,
    loop_running,
)

ToolRunFinish = Literal["stop", "length", "max_rounds", "context"]

# The most threads the sync calls of one turn run on at once; further calls wait for a free one.
_TOOL_THREADS = 8


@dataclass
class ToolError:
    """A call `run_tools` could not complete: its arguments did not validate against the
    tool's signature (`OutputValidationError`, for validators the schema cannot express), the
    tool raised, or it ran past `tool_timeout` (`TimeoutError`). The model read the error in
    the call's `tool` message and the run went on."""

    id: str
    name: str
    arguments: dict[str, Any]  # the JSON arguments the model wrote
    error: Exception


@dataclass
class ToolRun:
    """The outcome of `run_tools`: the final answer, every call with its result, and the
    conversation (OpenAI messages, every assistant turn included) that produced them, ready to
    send back to a model.

    `finish_reason` says how the run ended: "stop" (the model answered in text), "max_rounds"
    (the round limit was reached; `answer` is the reply to one last turn with tools off) or
    "length" (a turn hit max_tokens: `answer` is "", that turn's cut text is `partial_text`, and
    the calls made before it are kept) or "context" (only on the `run` of a `ToolRunTooLongError`:
    the next turn's prompt did not fit the context). `calls` holds the calls that returned;
    `errors` those that failed, whose error the model was shown instead of a result."""

    answer: str
    calls: list[tuple[ToolCall, Any]]
    messages: list[dict[str, Any]]
    finish_reason: ToolRunFinish = "stop"
    partial_text: str | None = None
    errors: list[ToolError] = field(default_factory=list)


class ToolRunTooLongError(PromptTooLongError):
    """`run_tools` stopped because a turn's prompt, the conversation so far, does not fit the
    model's context. `run` is the `ToolRun` up to that turn (finish_reason "context", `answer`
    ""): the calls made, their results and errors, and the messages."""

    def __init__(self, message: str, run: ToolRun):
        super().__init__(message)
        self.run = run


def run_tools(
    llm: Any,
    prompt: str | Sequence[dict[str, Any]],
    tools: Sequence[Any],
    *,
    tool_choice: Any = "auto",
    max_rounds: int = 4,
    max_tokens: int = 512,
    temperature: float = 0.0,
    seed: int | None = None,
    parallel_tool_calls: bool = True,
    tool_timeout: float | None = None,
    max_result_chars: int | None = 20_000,
    on_tool_error: Literal["feed", "raise"] = "feed",
) -> ToolRun:
    """The agent loop: let the model call tools, run them, append their results as `tool`
    messages, and repeat until it answers in text or `max_rounds` rounds of calls were made
    (then one last turn with tool_choice="none" asks for the answer). `tool_choice` applies
    to the first round (e.g. "required" to force a lookup first); later rounds are "auto".
    A turn that hits `max_tokens` ends the run with what was done so far (no exception). A turn
    whose prompt no longer fits the context raises `ToolRunTooLongError` (a `PromptTooLongError`)
    whose `run` holds what was done so far.

    The calls of one turn run at once: sync tools on up to 8 threads, async ones gathered on one
    event loop; their results (or errors) are recorded and fed back in the calls' order. A lone
    call runs on this thread (a worker thread where it has a timeout or this thread runs an
    event loop). A call whose arguments fail the function's validation, that raises, or that
    runs past `tool_timeout` seconds from its start (see `ToolCall.invoke`) shows the model its
    error, so it can try again, and is kept in `ToolRun.errors`; `on_tool_error="raise"` raises
    the turn's first such error, in the calls' order, once its calls are done. A result is fed
    back as JSON (str as is), cut at `max_result_chars` with a note saying so (`calls` keeps it
    whole)."""
    _check_run_options(max_rounds, tool_timeout, max_result_chars, on_tool_error)
    specs = _runnable(tools)
    invoker = _Invoker({t.name: t for t in specs}, tool_timeout, max_result_chars, on_tool_error)
    shapes = [Tool(t.name, t.description, t.parameters) for t in specs]  # JSON arguments: validated one by one
    run = ToolRun("", [], as_messages(prompt))
    for round_ in range(max_rounds + 1):
        last = round_ == max_rounds
        choice = "none" if last else tool_choice if round_ == 0 else "auto"
        try:
            turn = call(llm, run.messages, shapes, tool_choice=choice, parallel_tool_calls=parallel_tool_calls,
                        max_tokens=max_tokens, temperature=temperature, seed=seed)
        except IncompleteOutputError as e:
            run.finish_reason, run.partial_text = "length", e.partial_text
            return run
        except PromptTooLongError as e:
            run.finish_reason = "context"
            raise ToolRunTooLongError(f"{e}; this error's .run holds the run so far (its calls, results and "
                                      "messages)", run) from e
        if turn.finish_reason == "length":  # a text turn cut at max_tokens
            run.finish_reason, run.partial_text = "length", turn.text or ""
            return run
        run.messages.append(turn.to_message())
        if not turn:
            run.answer, run.finish_reason = turn.text or "", "max_rounds" if last else "stop"
            return run
        run.messages.extend(invoker.messages(turn, run))
    raise AssertionError("unreachable: the last round has tool_choice='none', so it makes no calls")


@dataclass
class _Invoker:
    """Runs the calls of a `run_tools` loop: validation, the call itself, the `tool` message."""

    tools: dict[str, Tool]
    timeout: float | None
    max_result_chars: int | None
    on_error: str

    def messages(self, turn: Sequence[ToolCall], run: ToolRun) -> list[dict[str, Any]]:
        """Validate and run the calls of one turn (JSON arguments), record them in `run`, and
        return the `tool` messages that carry their results or errors to the model, both in the
        calls' order."""
        typed = [self._typed(raw) for raw in turn]
        ran = iter(self._run([t for t in typed if isinstance(t, ToolCall)]))
        outcomes = [next(ran) if isinstance(t, ToolCall) else _Outcome(error=t) for t in typed]
        return [self._record(raw, outcome, run) for raw, outcome in zip(turn, outcomes, strict=True)]

    def _typed(self, raw: ToolCall) -> ToolCall | Exception:
        """The call with its arguments validated into the tool's model, or why they are not valid."""
        tool = self.tools[raw.name]
        try:
            return ToolCall(raw.name, tool.validate(raw.arguments), tool, raw.id)
        except Exception as e:
            return e

    def _run(self, calls: list[ToolCall]) -> list[_Outcome]:
        if len(calls) > 1:
            return _at_once(calls, self.timeout)
        return [_Outcome.of(typed, self._alone) for typed in calls]

    def _alone(self, typed: ToolCall) -> Any:
        """A turn's only call: on this thread, where a tool may keep what only this thread can
        use, unless it needs a timeout or this thread runs an event loop."""
        if self.timeout is not None or loop_running():
            return invoke_on_thread(typed, self.timeout)
        return typed.invoke()

    def _record(self, raw: ToolCall, outcome: _Outcome, run: ToolRun) -> dict[str, Any]:
        """Record one call's outcome in `run` (or raise its error) and return its `tool` message."""
        if outcome.error is not None:
            if self.on_error == "raise":
                raise outcome.error
            run.errors.append(ToolError(raw.id, raw.name, raw.arguments, outcome.error))
            return self._reply(raw, f"error: {type(outcome.error).__name__}: {outcome.error}")
        assert outcome.call is not None
        run.calls.append((outcome.call, outcome.result))
        return self._reply(raw, _result_text(outcome.result))

    def _reply(self, raw: ToolCall, text: str) -> dict[str, Any]:
        limit = self.max_result_chars
        if limit is not None and len(text) > limit:
            text = f"{text[:limit]}\n[... {len(text) - limit} more characters cut: {len(text)} in all, max_result_chars={limit}]"
        return {"role": "tool", "tool_call_id": raw.id, "content": text}


@dataclass
class _Outcome:
    """What became of one call: the typed call and its result, or the error it ended in."""

    call: ToolCall | None = None
    result: Any = None
    error: Exception | None = None

    @classmethod
    def of(cls, typed: ToolCall, invoke: Callable[[ToolCall], Any]) -> _Outcome:
        try:
            return cls(typed, invoke(typed))
        except Exception as e:
            return cls(typed, error=e)


def _at_once(calls: list[ToolCall], timeout: float | None) -> list[_Outcome]:
    """The outcomes of several calls run at once, in the calls' order: the sync ones on up to
    `_TOOL_THREADS` threads (each with a worker thread of its own where there is a timeout), the
    async ones gathered on one event loop, on a thread of its own."""
    is_async = [c.tool.is_async for c in calls]
    sync = [c for c, a in zip(calls, is_async, strict=True) if not a]
    coroutines = [c for c, a in zip(calls, is_async, strict=True) if a]
    with ThreadPoolExecutor(min(_TOOL_THREADS, len(calls)), thread_name_prefix="structgen-tools") as pool:
        gathered = pool.submit(asyncio.run, _gathered(coroutines, timeout)) if coroutines else None
        invoke = functools.partial(_invoke_sync, timeout=timeout)
        threaded = pool.map(lambda c: _Outcome.of(c, invoke), sync)
        async_outcomes, sync_outcomes = iter(gathered.result() if gathered else []), iter(list(threaded))
    return [next(async_outcomes) if a else next(sync_outcomes) for a in is_async]


def _invoke_sync(typed: ToolCall, timeout: float | None) -> Any:
    return typed.invoke() if timeout is None else invoke_on_thread(typed, timeout)


async def _gathered(calls: list[ToolCall], timeout: float | None) -> list[_Outcome]:
    return list(await asyncio.gather(*(_aoutcome(c, timeout) for c in calls)))


async def _aoutcome(typed: ToolCall, timeout: float | None) -> _Outcome:
    try:
        return _Outcome(typed, await ainvoke_within(typed, timeout))
    except Exception as e:
        return _Outcome(typed, error=e)


def _runnable(tools: Sequence[Any]) -> list[Tool]:
    specs = as_tools(tools)
    if not specs:
        raise InvalidParameterError("run_tools needs at least one tool; for a plain answer use llm.generate(str, prompt)")
    for t in specs:
        if t.fn is None:
            raise InvalidParameterError(
                f"run_tools runs the tools, and tool {t.name!r} (an OpenAI dict) has no function: pass the Python "
                "function (structgen.tool(fn)), or use llm.call for one turn of calls")
    return specs


def _check_run_options(max_rounds: Any, tool_timeout: Any, max_result_chars: Any, on_tool_error: Any) -> None:
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 0:
        raise InvalidParameterError(
            f"max_rounds must be an integer >= 0 (0: answer without calling tools), got {max_rounds!r}")
    if tool_timeout is not None:
        checked_timeout(tool_timeout)
    if max_result_chars is not None and (
            isinstance(max_result_chars, bool) or not isinstance(max_result_chars, int) or max_result_chars < 1):
        raise InvalidParameterError(
            f"max_result_chars must be an integer >= 1 (or None: results whole), got {max_result_chars!r}")
    if on_tool_error not in ("feed", "raise"):
        raise InvalidParameterError(
            f"on_tool_error must be 'feed' (show the model the error) or 'raise', got {on_tool_error!r}")




def _result_text(result: Any) -> str:
    """A tool's result as the model reads it: a str as is, anything else as JSON (datetimes,
    models, dataclasses, sets...; `str()` of what has no JSON form)."""
    if isinstance(result, str):
        return result
    try:
        return pydantic_core.to_json(result, fallback=str).decode()
    except pydantic_core.PydanticSerializationError:  # e.g. bytes that are not UTF-8
        return repr(result)
