"""Tools for in-process agents: `@structgen.tool` turns a typed Python function into a tool,
`call(llm, prompt, tools)` returns validated, typed tool calls, and a call's `invoke` runs it
(with a timeout where asked). The agent loop, `run_tools`, is structgen/tool_runs.py.

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
import concurrent.futures
import functools
import inspect
import json
import re
import threading
import typing
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pydantic
from pydantic.json_schema import GenerateJsonSchema

from structgen import tool_format
from structgen.arguments import with_text_content
from structgen.docstrings import parse_docstring
from structgen.errors import (
    InvalidConstraintError,
    InvalidParameterError,
    OutputValidationError,
    PromptTooLongError,
    ToolTimeoutError,
    UnsupportedTypeError,
)

_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MODES = ("none", "auto", "required")


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
                "chat templates and clients assume); rename it, e.g. 'get_weather' (for a function or "
                "lambda: structgen.tool(fn, name='get_weather'))")
        self.name = name
        self.description = description
        self.parameters = parameters or {"type": "object", "properties": {}}
        self.fn = fn
        self.arguments_model = arguments_model

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> Tool:
        """Build a tool from a type-hinted callable (a function, a bound or static method, a
        `functools.partial`, an object with `__call__`): the arguments model has one field per
        parameter, defaults kept, keywords a `partial` binds hidden from the model. Refused with
        `UnsupportedTypeError`: `*args`/`**kwargs` (a schema cannot express them), generators,
        methods taken from their class (`self` would be an argument), types with no JSON schema."""
        if isinstance(fn, Tool) and fn.fn is not None:  # @tool applied twice
            fn = fn.fn
        tool_name = name or _default_name(fn)
        summary, arg_docs = parse_docstring(inspect.getdoc(_unwrapped(fn)) or "")
        model = _arguments_model(tool_name, _parameters(fn, tool_name), _hints(fn, tool_name), arg_docs)
        try:
            schema = model.model_json_schema(schema_generator=_ToolSchema)
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
        """JSON arguments -> the pydantic arguments model (or the dict for schema-only tools);
        `OutputValidationError` names the tool and each field that failed."""
        if self.arguments_model is None:
            return arguments
        try:
            return self.arguments_model.model_validate(arguments)
        except pydantic.ValidationError as e:
            raise OutputValidationError(f"arguments of {self.name!r} do not validate: {_field_errors(e)}",
                                        text=json.dumps(arguments, default=str)) from e

    def _bind(self, values: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Arguments by parameter name -> `(args, kwargs)` for the function: positional-only
        parameters by position, the others by keyword."""
        if self.fn is None:
            return [], dict(values)
        kwargs = dict(values)
        params = inspect.signature(self.fn).parameters.values()
        return [kwargs.pop(p.name) for p in params if p.kind is p.POSITIONAL_ONLY and p.name in kwargs], kwargs

    @property
    def is_async(self) -> bool:
        """Whether the function is an `async def` (or an object whose `__call__` is one)."""
        return self.fn is not None and inspect.iscoroutinefunction(_hinted(self.fn))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fn is None:
            raise TypeError(f"tool {self.name!r} has no Python function to call")
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


class _ToolSchema(GenerateJsonSchema):
    """Parameter schemas without pydantic's per-field titles ("city" -> "City"): they repeat
    the name and cost prompt tokens for every tool in the catalogue."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def _unwrapped(fn: Any) -> Any:
    return fn.func if isinstance(fn, functools.partial) else fn


def _default_name(fn: Any) -> str:
    target = _unwrapped(fn)
    return getattr(target, "__name__", None) or type(target).__name__


def _parameters(fn: Any, tool_name: str) -> list[inspect.Parameter]:
    """The parameters the model fills, refusing what a tool cannot be."""
    if not callable(fn):
        raise UnsupportedTypeError(
            f"tool {tool_name!r}: {fn!r} is not callable; pass a function (a classmethod: make the tool once "
            "the class exists, structgen.tool(MyClass.method))")
    target = _hinted(fn)
    if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target):
        raise UnsupportedTypeError(
            f"tool {tool_name!r} is a generator function: the model needs one result; return a list instead")
    try:
        signature = inspect.signature(fn)
    except ValueError as e:  # a builtin that publishes no signature
        raise UnsupportedTypeError(f"tool {tool_name!r}: its signature cannot be read ({e}); wrap it in a "
                                   "typed function") from e
    bound = fn.keywords if isinstance(fn, functools.partial) else {}
    params = [p for p in signature.parameters.values() if p.name not in bound]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise UnsupportedTypeError(
                f"tool {tool_name!r}: *args/**kwargs cannot be described by a schema; name the parameters")
    if params and params[0].name in ("self", "cls"):
        raise UnsupportedTypeError(
            f"tool {tool_name!r}: its first parameter is {params[0].name!r}, so it is a method taken from its "
            f"class and the model would have to fill {params[0].name!r}; pass the method of an instance "
            f"(structgen.tool(obj.{_default_name(fn)})) or make it a @staticmethod")
    return params


def _hinted(fn: Any) -> Any:
    """What carries the type hints: the function itself, a partial's function, or the
    `__call__` of a callable object."""
    target = _unwrapped(fn)
    return target if inspect.isroutine(target) or inspect.isclass(target) else type(target).__call__


def _hints(fn: Any, tool_name: str) -> dict[str, Any]:
    try:
        return typing.get_type_hints(_hinted(fn), include_extras=True)
    except Exception as e:  # NameError for a name the annotations use that is not importable
        raise UnsupportedTypeError(
            f"tool {tool_name!r}: its type hints do not resolve ({type(e).__name__}: {e}); define the types "
            "they name at module level") from e


def _arguments_model(tool_name: str, params: list[inspect.Parameter], hints: dict[str, Any],
                     docs: dict[str, str]) -> type[pydantic.BaseModel]:
    """One field per parameter; a name pydantic reserves (`_x`, `model_config`) becomes the
    field `arg_<name>` whose alias, the name the model sees, is the parameter's."""
    names = _field_names([p.name for p in params])
    fields = {
        names[p.name]: (hints.get(p.name, Any), pydantic.Field(
            ... if p.default is p.empty else p.default, description=docs.get(p.name),
            alias=p.name if names[p.name] != p.name else None))
        for p in params
    }
    try:
        with warnings.catch_warnings():  # a parameter named `schema` or `json` works; pydantic warns
            warnings.filterwarnings("ignore", message="Field name .* shadows an attribute", category=UserWarning)
            return pydantic.create_model(  # type: ignore[call-overload]
                f"{tool_name}_arguments", __config__=pydantic.ConfigDict(extra="forbid"), **fields)
    except pydantic.PydanticUserError as e:
        raise UnsupportedTypeError(
            f"tool {tool_name!r}: a parameter type has no JSON schema ({str(e).splitlines()[0]}); use JSON "
            "types, pydantic models, dataclasses or typing_extensions.TypedDict") from e


def _field_names(names: list[str]) -> dict[str, str]:
    taken = set(names)
    out = {}
    for name in names:
        field_name = name
        if name.startswith("_") or (name.startswith("model_") and hasattr(pydantic.BaseModel, name)):
            field_name = "arg_" + name.lstrip("_")
            while field_name in taken:
                field_name += "_"
            taken.add(field_name)
        out[name] = field_name
    return out


def _field_errors(e: pydantic.ValidationError) -> str:
    """`field: message (got value)` for each error, without pydantic's URLs."""
    parts = []
    for err in e.errors(include_url=False):
        where = ".".join(str(x) for x in err["loc"]) or "arguments"
        got = "" if err["type"] == "missing" else f" (got {_short(repr(err['input']), 80)})"
        parts.append(f"{where}: {err['msg']}{got}")
    return "; ".join(parts)


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@typing.overload
def tool(fn: Callable[..., Any], *, name: str | None = None, description: str | None = None) -> Tool: ...
@typing.overload
def tool(fn: None = None, *, name: str | None = None, description: str | None = None) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         description: str | None = None) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Decorator: `@tool` or `@tool(name=..., description=...)` makes a `Tool` of a function.
    The description defaults to the docstring's text before its first section; its parameter
    section (Google `Args:`, NumPy `Parameters`, Sphinx `:param x:`) describes the parameters."""
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

    def invoke(self, timeout: float | None = None) -> Any:
        """Run the tool's function with these arguments (typed values, not their JSON); an
        `async def` tool runs to completion on an event loop of its own (inside a running loop,
        `await ainvoke()` instead). With `timeout` (seconds) the call runs on a worker thread and
        `TimeoutError` is raised when it has not returned by then: an async tool is cancelled, a
        sync one cannot be stopped and finishes on its (daemon) thread."""
        if timeout is not None:
            return invoke_on_thread(self, checked_timeout(timeout))
        result = self._start()
        if not inspect.isawaitable(result):
            return result
        if not loop_running():
            return asyncio.run(_awaited(result, None))
        if inspect.iscoroutine(result):
            result.close()  # never awaited otherwise: no "was never awaited" warning later
        raise InvalidParameterError(
            f"tool {self.name!r} is async and this thread runs an event loop: `await call.ainvoke()` "
            "instead of call.invoke()")

    async def ainvoke(self) -> Any:
        """`invoke` for async callers: an `async def` tool is awaited, a plain one called."""
        result = self._start()
        return await result if inspect.isawaitable(result) else result

    def _start(self) -> Any:
        args, kwargs = self.tool._bind(self._values())
        return self.tool(*args, **kwargs)

    def _values(self) -> dict[str, Any]:
        """The arguments by parameter name (a field's alias where pydantic reserves the name)."""
        if isinstance(self.arguments, pydantic.BaseModel):
            fields = type(self.arguments).model_fields
            return {f.alias or k: getattr(self.arguments, k) for k, f in fields.items()}
        return dict(self.arguments)

    def arguments_json(self) -> str:
        if isinstance(self.arguments, pydantic.BaseModel):
            return self.arguments.model_dump_json(by_alias=True)
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
    default), "auto" (a call or a text answer), "none", a tool's name or `Tool`, or OpenAI's
    `{"type": "function", "function": {"name": ...}}` (the only way to force a tool named
    "none", "auto" or "required": those strings are modes). Works on `LLM` and `RemoteLLM`;
    a catalogue that does not fit the context raises `PromptTooLongError` with its size."""
    specs = as_tools(tools)
    messages = as_messages(prompt)
    tool_choice = _named_choice(tool_choice, specs)
    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    try:
        if hasattr(llm, "chat_tools"):  # a RemoteLLM: the server applies the tool format
            return llm.chat_tools(messages, specs, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                                  **sampling)
        openai_tools = [t.to_openai() for t in specs]
        choice = tool_format.resolve_tool_choice(tool_choice, openai_tools)
        output_type = tool_format.tool_output_type(openai_tools, choice, parallel_tool_calls) or str
        rendered, template_tools = tool_format.render_messages(llm.tokenizer, messages, openai_tools)
        completion = llm.complete(output_type, rendered, tools=template_tools, **sampling)
    except PromptTooLongError as e:
        if not specs or not messages:
            raise
        raise PromptTooLongError(f"{e}; {_prompt_sizes(specs, messages)}") from e
    return to_tool_calls(completion.text, specs, choice, completion)


def to_tool_calls(text: str, specs: Sequence[Tool], choice: tool_format.ToolChoice, completion: Any = None) -> ToolCalls:
    """Parse generated text into typed `ToolCalls` (the model's text answer when it made none)."""
    by_name = {t.name: t for t in specs}
    parsed, content = tool_format.parse_tool_calls(text, [t.to_openai() for t in specs], choice)
    calls = [ToolCall(p.name, by_name[p.name].validate(p.arguments), by_name[p.name], p.id) for p in parsed]
    finish_reason = None if calls else getattr(completion, "finish_reason", None)
    return ToolCalls(calls, content, completion, finish_reason)


def as_tools(tools: Sequence[Any]) -> list[Tool]:
    """`tools` as `Tool`s with distinct names (a later one would shadow an earlier one)."""
    if tools is None or isinstance(tools, (str, dict, Tool)) or callable(tools):
        raise InvalidParameterError(f"tools must be a list of tools, e.g. tools=[get_weather]; got {_short(repr(tools), 80)}")
    specs = [as_tool(t) for t in tools]
    first: dict[str, int] = {}
    for i, t in enumerate(specs):
        if t.name in first:
            raise InvalidParameterError(
                f"tools {first[t.name]} and {i} are both named {t.name!r}; tool names must be unique: name one "
                f"otherwise, e.g. structgen.tool(fn, name='{t.name}_2')")
        first[t.name] = i
    return specs


def _named_choice(tool_choice: Any, specs: Sequence[Tool]) -> Any:
    """A tool's name or `Tool` as OpenAI's named `tool_choice`; the modes stay modes."""
    name = tool_choice.name if isinstance(tool_choice, Tool) else tool_choice
    if not isinstance(name, str) or name in _MODES:
        return tool_choice
    names = [t.name for t in specs]
    if name not in names:
        raise InvalidConstraintError(
            f"tool_choice {name!r} is not 'none', 'auto', 'required' or the name of a tool "
            f"({', '.join(names) or 'no tools given'})")
    return {"type": "function", "function": {"name": name}}


def _prompt_sizes(specs: Sequence[Tool], messages: list[dict[str, Any]]) -> str:
    """Where a prompt that does not fit the context spends its characters."""
    tools = sorted(((len(json.dumps(t.to_openai(), ensure_ascii=False)), t.name) for t in specs), reverse=True)
    texts = [len(json.dumps(m, ensure_ascii=False, default=str)) for m in messages]
    longest = max(range(len(texts)), key=texts.__getitem__)
    return (f"of it, the catalogue of {len(specs)} tools is {sum(n for n, _ in tools)} characters (largest: "
            f"{', '.join(f'{name} {n}' for n, name in tools[:3])}) and the {len(messages)} messages {sum(texts)} "
            f"(longest: #{longest}, {messages[longest].get('role')}, {texts[longest]}): pass only the tools a turn "
            "needs, or shorten descriptions or messages (run_tools: lower max_result_chars)")


def checked_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidParameterError(f"a tool timeout is a number of seconds > 0 (or None: no limit), got {timeout!r}")
    return float(timeout)


class _TimedOut(Exception):
    """An async tool cancelled at its timeout on the worker thread."""


def invoke_on_thread(call: ToolCall, timeout: float | None) -> Any:
    """Run `call` on a daemon thread and wait for it up to `timeout` seconds."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    worker = threading.Thread(target=_settle, args=(call, done, timeout), name=f"structgen-tool-{call.name}", daemon=True)
    worker.start()
    concurrent.futures.wait([done], timeout)
    if not done.done() or isinstance(done.exception(), _TimedOut):
        raise _timeout_error(call, timeout)
    return done.result()


async def ainvoke_within(call: ToolCall, timeout: float | None) -> Any:
    """`await call.ainvoke()` on the running loop, cancelled with `ToolTimeoutError` where it
    has not returned within `timeout` seconds; for async tools (a sync one would block the loop)."""
    try:
        return await _awaited(call.ainvoke(), timeout)
    except _TimedOut:
        raise _timeout_error(call, timeout) from None


def _timeout_error(call: ToolCall, timeout: float | None) -> ToolTimeoutError:
    return ToolTimeoutError(f"tool {call.name!r} did not return within {timeout:g} s")


def _settle(call: ToolCall, done: concurrent.futures.Future[Any], timeout: float | None) -> None:
    try:
        result = call._start()
        done.set_result(asyncio.run(_awaited(result, timeout)) if inspect.isawaitable(result) else result)
    except BaseException as e:  # the waiting thread re-raises it
        done.set_exception(e)


async def _awaited(awaitable: Awaitable[Any], timeout: float | None) -> Any:
    task = asyncio.ensure_future(awaitable)
    await asyncio.wait({task}, timeout=timeout)
    if not task.done():
        task.cancel()
        raise _TimedOut
    return task.result()


def loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def as_messages(prompt: str | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else with_text_content(prompt)


