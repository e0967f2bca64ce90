"""Tools for in-process agents: `@structgen.tool` turns a typed Python function into a tool,
`call(llm, prompt, tools)` returns validated, typed tool calls, and `run_tools` runs the
call -> invoke -> feed back loop.

    @structgen.tool
    def get_weather(city: str, unit: Literal["C", "F"] = "C") -> str:
        '''Current weather in a city.'''

    calls = llm.call("Weather in Paris?", tools=[get_weather])
    calls[0].arguments.city   # "Paris", from a pydantic model built from the type hints
    calls[0].invoke()         # get_weather(city="Paris", unit="C")

The calls are valid by construction: the turn is decoded under one constraint built from every
tool's parameter schema (see `structgen.tool_format`); the pydantic check here is the last step
of turning JSON into Python values, not a retry loop.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic

from structgen import tool_format
from structgen.arguments import with_text_content
from structgen.errors import (
    IncompleteOutputError,
    InvalidParameterError,
    OutputValidationError,
    UnsupportedTypeError,
)

_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class Tool:
    """A function the model may call: its name, description and JSON-schema parameters, and
    (for Python tools) the function itself and a pydantic model of its arguments."""

    def __init__(
        self,
        name: str,
        description: str = "",
        parameters: dict[str, Any] | None = None,
        fn: Callable[..., Any] | None = None,
        arguments_model: type[pydantic.BaseModel] | None = None,
    ):
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise InvalidParameterError(
                f"tool name {name!r} is not 1-64 letters, digits, '_', '-' or '.' (OpenAI's rule, which "
                "chat templates and clients assume); rename it, e.g. {'get_weather'!r}")
        self.name = name
        self.description = description
        self.parameters = parameters or {"type": "object", "properties": {}}
        self.fn = fn
        self.arguments_model = arguments_model

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> Tool:
        """Build a tool from a type-hinted function: the arguments model has one field per
        parameter (defaults kept, `*args`/`**kwargs` refused: a schema cannot express them)."""
        doc = inspect.getdoc(fn) or ""
        summary, arg_docs = _parse_docstring(doc)
        hints = typing.get_type_hints(fn, include_extras=True)
        fields: dict[str, Any] = {}
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise UnsupportedTypeError(f"tool {fn.__name__!r}: *args/**kwargs cannot be described by a schema")
            default = ... if p.default is p.empty else p.default
            fields[p.name] = (hints.get(p.name, Any), pydantic.Field(default, description=arg_docs.get(p.name)))
        tool_name = name or fn.__name__
        model = pydantic.create_model(  # type: ignore[call-overload]
            f"{tool_name}_arguments", __config__=pydantic.ConfigDict(extra="forbid"), **fields
        )
        try:
            schema = model.model_json_schema()
        except pydantic.PydanticUserError as e:  # e.g. a parameter type pydantic cannot describe
            raise UnsupportedTypeError(f"tool {tool_name!r}: {e}") from e
        schema.pop("title", None)
        return cls(tool_name, description or summary, schema, fn, model)

    @classmethod
    def from_openai(cls, spec: dict[str, Any]) -> Tool:
        """A tool from an OpenAI tool dict; its calls carry plain dict arguments."""
        fn = tool_format.function_of(spec)
        if not isinstance(fn, dict) or "name" not in fn:
            raise InvalidParameterError(
                "an OpenAI tool needs a name: {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
        return cls(fn["name"], fn.get("description") or "", tool_format.parameters_of(spec))

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `tools` entry for this tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validate(self, arguments: dict[str, Any]) -> Any:
        """JSON arguments -> the pydantic arguments model (or the dict for schema-only tools)."""
        if self.arguments_model is None:
            return arguments
        try:
            return self.arguments_model.model_validate(arguments)
        except pydantic.ValidationError as e:
            raise OutputValidationError(f"arguments of {self.name!r} do not validate: {e}", text=json.dumps(arguments)) from e

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fn is None:
            raise TypeError(f"tool {self.name!r} has no Python function to call")
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


@typing.overload
def tool(fn: Callable[..., Any], *, name: str | None = None, description: str | None = None) -> Tool: ...
@typing.overload
def tool(fn: None = None, *, name: str | None = None, description: str | None = None) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         description: str | None = None) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Decorator: `@tool` or `@tool(name=..., description=...)` makes a `Tool` of a function.
    The description defaults to the docstring's first paragraph; `Args:` lines in the
    docstring become parameter descriptions."""
    if fn is None:
        return lambda f: Tool.from_function(f, name=name, description=description)
    return Tool.from_function(fn, name=name, description=description)


def as_tool(obj: Any) -> Tool:
    """A `Tool`, a plain function or an OpenAI tool dict, as a `Tool`."""
    if isinstance(obj, Tool):
        return obj
    if isinstance(obj, dict):
        return Tool.from_openai(obj)
    if callable(obj):
        return Tool.from_function(obj)
    raise UnsupportedTypeError(f"{obj!r} is not a tool: pass a @structgen.tool function, a function or a dict")


@dataclass
class ToolCall:
    """One validated call: `.arguments` is the tool's pydantic arguments model (a dict for
    tools given as OpenAI dicts)."""

    name: str
    arguments: Any
    tool: Tool = field(repr=False)
    id: str = field(default_factory=tool_format.new_call_id)

    def invoke(self) -> Any:
        """Run the tool's function with these arguments (typed values, not their JSON); an
        `async def` tool runs to completion on an event loop of its own (inside a running loop,
        `await ainvoke()` instead)."""
        result = self.tool(**self._kwargs())
        if not inspect.isawaitable(result):
            return result
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: run the coroutine on one of its own
            return asyncio.run(_awaited(result))
        if inspect.iscoroutine(result):
            result.close()  # never awaited otherwise: no "was never awaited" warning later
        raise InvalidParameterError(
            f"tool {self.name!r} is async and this thread runs an event loop: `await call.ainvoke()` "
            "instead of call.invoke()")

    async def ainvoke(self) -> Any:
        """`invoke` for async callers: an `async def` tool is awaited, a plain one called."""
        result = self.tool(**self._kwargs())
        return await result if inspect.isawaitable(result) else result

    def _kwargs(self) -> dict[str, Any]:
        if isinstance(self.arguments, pydantic.BaseModel):
            return {k: getattr(self.arguments, k) for k in type(self.arguments).model_fields}
        return dict(self.arguments)

    def arguments_json(self) -> str:
        if isinstance(self.arguments, pydantic.BaseModel):
            return self.arguments.model_dump_json()
        return json.dumps(self.arguments)

    def to_openai(self) -> dict[str, Any]:
        """The entry of an assistant message's `tool_calls` for this call."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json()}}


class ToolCalls(list):
    """The calls of one assistant turn (a list of `ToolCall`). Empty when the model answered
    in text instead (`tool_choice="auto"`); that answer is in `.text`."""

    def __init__(
        self,
        calls: Sequence[ToolCall] = (),
        text: str | None = None,
        completion: Any = None,
        finish_reason: str | None = None,
    ):
        super().__init__(calls)
        self.text = text
        self.completion = completion
        # "tool_calls" when the turn made calls, else "stop" or "length" (a text answer cut
        # at max_tokens), as in an OpenAI choice.
        self.finish_reason = finish_reason or ("tool_calls" if calls else "stop")

    def to_message(self) -> dict[str, Any]:
        """This turn as an OpenAI assistant message (calls in `tool_calls`, or the text)."""
        if self:
            return {"role": "assistant", "content": None, "tool_calls": [c.to_openai() for c in self]}
        return {"role": "assistant", "content": self.text or ""}

    def __repr__(self) -> str:
        # An empty list would print as `[]` and hide the model's text answer.
        return f"ToolCalls({list.__repr__(self)}, text={self.text!r})"

    __str__ = __repr__


def call(
    llm: Any,
    prompt: str | Sequence[dict[str, Any]],
    tools: Sequence[Any],
    *,
    tool_choice: Any = "required",
    parallel_tool_calls: bool = True,
    max_tokens: int = 512,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
) -> ToolCalls:
    """Ask the model for tool calls: `tool_choice` is "required" (at least one call, the
    default), "auto" (a call or a text answer), "none", a tool name, or OpenAI's
    `{"type": "function", "function": {"name": ...}}`. Works on `LLM` and `RemoteLLM`."""
    specs = [as_tool(t) for t in tools]
    messages = _as_messages(prompt)
    if isinstance(tool_choice, str) and tool_choice in {t.name for t in specs}:
        tool_choice = {"type": "function", "function": {"name": tool_choice}}
    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    if hasattr(llm, "chat_tools"):  # a RemoteLLM: the server applies the tool format
        return llm.chat_tools(messages, specs, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, **sampling)
    openai_tools = [t.to_openai() for t in specs]
    choice = tool_format.resolve_tool_choice(tool_choice, openai_tools)
    output_type = tool_format.tool_output_type(openai_tools, choice, parallel_tool_calls) or str
    rendered, template_tools = tool_format.render_messages(llm.tokenizer, messages, openai_tools)
    completion = llm.complete(output_type, rendered, tools=template_tools, **sampling)
    return to_tool_calls(completion.text, specs, choice, completion)


def to_tool_calls(text: str, specs: Sequence[Tool], choice: tool_format.ToolChoice, completion: Any = None) -> ToolCalls:
    """Parse generated text into typed `ToolCalls` (the model's text answer when it made none)."""
    by_name = {t.name: t for t in specs}
    parsed, content = tool_format.parse_tool_calls(text, [t.to_openai() for t in specs], choice)
    calls = [ToolCall(p.name, by_name[p.name].validate(p.arguments), by_name[p.name], p.id) for p in parsed]
    finish_reason = None if calls else getattr(completion, "finish_reason", None)
    return ToolCalls(calls, content, completion, finish_reason)


ToolRunFinish = Literal["stop", "length", "max_rounds"]


@dataclass
class ToolRun:
    """The outcome of `run_tools`: the final answer, every call with its result, and the
    conversation (OpenAI messages, every assistant turn included) that produced them, ready to
    send back to a model.

    `finish_reason` says how the run ended: "stop" (the model answered in text), "max_rounds"
    (the round limit was reached; `answer` is the reply to one last turn with tools off) or
    "length" (a turn hit max_tokens: `answer` is "", that turn's cut text is `partial_text`, and
    the calls made before it are kept)."""

    answer: str
    calls: list[tuple[ToolCall, Any]]
    messages: list[dict[str, Any]]
    finish_reason: ToolRunFinish = "stop"
    partial_text: str | None = None


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
) -> ToolRun:
    """The agent loop: let the model call tools, run them, append their results as `tool`
    messages, and repeat until it answers in text or `max_rounds` rounds of calls were made
    (then one last turn with tool_choice="none" asks for the answer). `tool_choice` applies
    to the first round (e.g. "required" to force a lookup first); later rounds are "auto".
    A turn that hits `max_tokens` ends the run with what was done so far (no exception)."""
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 0:
        raise InvalidParameterError(
            f"max_rounds must be an integer >= 0 (0: answer without calling tools), got {max_rounds!r}")
    specs = [as_tool(t) for t in tools]
    run = ToolRun("", [], _as_messages(prompt))
    for round_ in range(max_rounds + 1):
        last = round_ == max_rounds
        choice = "none" if last else tool_choice if round_ == 0 else "auto"
        try:
            turn = call(llm, run.messages, specs, tool_choice=choice, max_tokens=max_tokens, temperature=temperature, seed=seed)
        except IncompleteOutputError as e:
            run.finish_reason, run.partial_text = "length", e.partial_text
            return run
        if turn.finish_reason == "length":  # a text turn cut at max_tokens
            run.finish_reason, run.partial_text = "length", turn.text or ""
            return run
        run.messages.append(turn.to_message())
        if not turn:
            run.answer, run.finish_reason = turn.text or "", "max_rounds" if last else "stop"
            return run
        for c in turn:
            result = c.invoke()
            run.calls.append((c, result))
            run.messages.append({"role": "tool", "tool_call_id": c.id, "content": _result_text(result)})
    raise AssertionError("unreachable: the last round has tool_choice='none', so it makes no calls")


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _as_messages(prompt: str | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else with_text_content(prompt)


def _result_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, pydantic.BaseModel):
        return result.model_dump_json()
    try:
        return json.dumps(result)
    except TypeError:
        return str(result)


_ARG_LINE = re.compile(r"^\s{0,8}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The summary paragraph and Google-style `Args:` descriptions of a docstring."""
    summary = doc.split("\n\n", 1)[0].strip()
    args: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args:
            if line.strip() and not line.startswith((" ", "\t")):
                break  # the next section
            m = _ARG_LINE.match(line)
            if m:
                args[m.group(1)] = m.group(2).strip()
    return summary, args
