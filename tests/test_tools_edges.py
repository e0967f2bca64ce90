"""Function calling at its edges: the callables `@tool` takes or refuses, docstrings, argument
validation, tool choice, and the `run_tools` loop with tools that fail, hang or return too much
(real model on CPU, one or two rounds of a few tokens each)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import json
import re
import threading
import time
from typing import Annotated, Literal

import pydantic
import pytest

import structgen
from structgen import tool_format
from structgen.errors import (
    InvalidConstraintError,
    InvalidParameterError,
    OutputValidationError,
    PromptTooLongError,
    UnsupportedSchemaError,
    UnsupportedTypeError,
)
from structgen.tool_runs import ToolError, ToolRunTooLongError, run_tools
from structgen.tools import Tool, ToolCall, call, tool
from structgen.types import JsonSchema, to_constraint


@pytest.fixture(scope="module")
def llm():
    with structgen.LLM(config={"max_batch_size": 4, "max_seq_len": 1024}) as model:
        yield model


def invoke(t: Tool, arguments: dict, timeout: float | None = None):
    c = ToolCall(t.name, t.validate(arguments), t)
    return c.invoke() if timeout is None else c.invoke(timeout)


# --------------------------------------------------------------------------- which callables


def test_positional_only_parameters_are_passed_by_position() -> None:
    def power(base: int, /, exp: int = 2) -> int:
        return base**exp

    assert invoke(tool(power), {"base": 3}) == 9
    assert invoke(tool(len), {"obj": [1, 2]}) == 2  # a builtin: `len(obj, /)`


def test_a_partial_hides_the_keywords_it_binds_and_keeps_the_function_name() -> None:
    def send(to: str, api_key: str) -> str:
        """Send a message."""
        return f"{to}:{api_key}"

    t = tool(functools.partial(send, api_key="secret"))
    assert t.name == "send" and t.description == "Send a message."
    assert list(t.parameters["properties"]) == ["to"]  # the model never sees the key
    assert invoke(t, {"to": "bob"}) == "bob:secret"
    with pytest.raises(OutputValidationError, match="api_key"):
        t.validate({"to": "bob", "api_key": "mine"})


def test_callable_objects_and_methods_of_instances_are_tools() -> None:
    class Counter:
        """Count up."""

        def __init__(self) -> None:
            self.n = 0

        def __call__(self, by: int) -> int:
            self.n += by
            return self.n

        def reset(self, to: int = 0) -> int:
            """Reset the count."""
            self.n = to
            return to

        @staticmethod
        def double(x: int) -> int:
            return 2 * x

    counter = Counter()
    t = tool(counter)
    assert t.name == "Counter" and t.description == "Count up." and invoke(t, {"by": 2}) == 2
    assert list(tool(counter.reset).parameters["properties"]) == ["to"]
    assert invoke(tool(Counter.double), {"x": 4}) == 8


def test_a_method_taken_from_its_class_is_refused_rather_than_asking_the_model_for_self() -> None:
    with pytest.raises(UnsupportedTypeError, match=r"'self'.*structgen\.tool\(obj\.area\)"):

        class Square:
            @tool
            def area(self, side: int) -> int:
                return side * side


def test_generators_are_refused_naming_the_fix() -> None:
    def numbers(n: int):
        yield from range(n)

    async def stream(n: int):
        yield n

    for fn in (numbers, stream):
        with pytest.raises(UnsupportedTypeError, match="generator function.*return a list"):
            tool(fn)


def test_a_classmethod_object_is_refused_with_the_fix() -> None:
    with pytest.raises(UnsupportedTypeError, match=r"not callable.*structgen\.tool\(MyClass\.method\)"):
        tool(classmethod(lambda cls, x: x))


def test_a_lambda_needs_a_name_and_the_error_says_how() -> None:
    with pytest.raises(InvalidParameterError, match=r"'<lambda>'.*structgen\.tool\(fn, name='get_weather'\)"):
        tool(lambda x: x)
    assert tool(lambda x: x, name="echo").name == "echo"


def test_tool_applied_twice_is_the_same_tool() -> None:
    def ping(host: str) -> str:
        return host

    assert tool(tool(ping)).parameters == tool(ping).parameters


class Socket:
    """A type pydantic has no schema for."""


def test_types_without_a_schema_and_unresolved_hints_raise_unsupported_type_naming_the_tool() -> None:
    def connect(sock: Socket) -> None: ...

    def later(x: Undefined) -> None: ...  # noqa: F821

    with pytest.raises(UnsupportedTypeError, match="tool 'connect'.*no JSON schema"):
        tool(connect)
    with pytest.raises(UnsupportedTypeError, match="tool 'later'.*do not resolve.*Undefined"):
        tool(later)


def test_parameters_named_like_pydantic_internals_reach_the_function() -> None:
    def configure(model_config: str, _token: int = 0, schema: str = "s") -> tuple:
        return model_config, _token, schema

    t = tool(configure)
    assert set(t.parameters["properties"]) == {"model_config", "_token", "schema"}
    assert t.parameters["required"] == ["model_config"]
    args = t.validate({"model_config": "fast", "_token": 7})
    assert ToolCall("configure", args, t).invoke() == ("fast", 7, "s")
    assert json.loads(ToolCall("configure", args, t).arguments_json()) == {"model_config": "fast", "_token": 7, "schema": "s"}


# --------------------------------------------------------------------------- docstrings


def test_numpy_and_sphinx_docstrings_describe_the_parameters() -> None:
    def numpy_style(city: str, days: int = 1) -> str:
        """Forecast for a city.

        Parameters
        ----------
        city : str
            The city name,
            e.g. Paris.
        days : int, optional
            Number of days.

        Returns
        -------
        str
        """
        return city

    def sphinx_style(city: str) -> str:
        """Forecast for a city.

        :param city: The city name.
        :type city: str
        :returns: the forecast.
        """
        return city

    props = tool(numpy_style).parameters["properties"]
    assert props["city"]["description"] == "The city name, e.g. Paris."
    assert props["days"]["description"] == "Number of days."
    assert tool(sphinx_style).parameters["properties"]["city"]["description"] == "The city name."
    assert tool(numpy_style).description == tool(sphinx_style).description == "Forecast for a city."


def test_google_docstrings_keep_continued_lines_and_every_paragraph_before_the_sections() -> None:
    def search(query: str) -> list:
        """Search the docs.

        Use it for questions about the product, never for the news.

        Args:
            query (str): Words to look for,
                in any order.

        Returns:
            The matching pages.
        """
        return []

    t = tool(search)
    assert t.description == "Search the docs.\n\nUse it for questions about the product, never for the news."
    assert t.parameters["properties"]["query"]["description"] == "Words to look for, in any order."


def test_parameter_schemas_carry_no_generated_titles() -> None:
    def create(title: str, body: str) -> None: ...

    props = tool(create).parameters["properties"]
    assert props == {"title": {"type": "string"}, "body": {"type": "string"}}  # the property named title stays


# --------------------------------------------------------------------------- validation and choice


def test_argument_errors_name_the_tool_and_each_field_without_pydantic_urls() -> None:
    @tool
    def book(when: datetime.date, seats: Annotated[int, pydantic.Field(ge=1)]) -> str:
        return "ok"

    with pytest.raises(OutputValidationError) as e:
        book.validate({"when": "someday", "seats": 0})
    message = str(e.value)
    assert message.startswith("arguments of 'book' do not validate: when: ")
    assert "seats: Input should be greater than or equal to 1 (got 0)" in message
    assert "pydantic.dev" not in message


def test_tools_must_be_a_list_with_distinct_names() -> None:
    def f(x: int) -> int:
        return x

    with pytest.raises(InvalidParameterError, match=r"tools 0 and 1 are both named 'f'.*name='f_2'"):
        call(object(), "hi", [Tool.from_function(f), Tool.from_function(f)])
    with pytest.raises(InvalidParameterError, match=r"tools must be a list.*tools=\[get_weather\]"):
        call(object(), "hi", tool(f))


def test_a_tool_choice_naming_no_tool_lists_the_tools() -> None:
    def get_weather(city: str) -> str:
        return city

    with pytest.raises(InvalidConstraintError, match=r"'get_wether' is not .* the name of a tool \(get_weather\)"):
        call(object(), "hi", [tool(get_weather)], tool_choice="get_wether")


def test_tool_choice_modes_win_over_a_tool_of_that_name_and_a_tool_object_names_itself(llm) -> None:
    def echo(x: int) -> int:
        """Echo x."""
        return x

    named_none, other = tool(echo, name="none"), tool(echo, name="other")
    answer = call(llm, "Say hi to me.", [named_none, other], tool_choice="none", max_tokens=8)
    assert answer == [] and answer.text  # "none" is the mode: no call of the tool named "none"
    forced = call(llm, "Say hi to me.", [named_none, other], tool_choice=other, max_tokens=30)
    assert [c.name for c in forced] == ["other"]
    by_dict = call(llm, "Say hi to me.", [named_none, other], tool_choice={"type": "function", "function": {"name": "none"}},
                   max_tokens=30)
    assert [c.name for c in by_dict] == ["none"]


def test_a_catalogue_too_large_for_the_context_says_how_large(llm) -> None:
    def f(x: int, y: str = "a") -> int:
        """Does something with x and y; a description long enough to take a few tokens."""
        return x

    tools = [Tool.from_function(f, name=f"tool_{i}") for i in range(200)]
    with pytest.raises(PromptTooLongError, match=r"catalogue of 200 tools is \d+ characters.*pass only the tools"):
        call(llm, "Call tool_7 with x=3.", tools, max_tokens=16)


def test_non_ascii_tool_text_is_shown_to_the_model_verbatim(tokenizer) -> None:
    def meteo(ville: str) -> str:
        """Météo à Zürich ou ailleurs."""
        return ville

    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "meteo", "arguments": '{"ville": "Zürich"}'}}]}]
    rendered, _ = tool_format.render_messages(tokenizer, history, [tool(meteo).to_openai()])
    assert "Météo à Zürich" in rendered[0]["content"] and '"Zürich"' in rendered[1]["content"]


# --------------------------------------------------------------------------- invoking


def test_invoke_with_a_timeout_gives_up_on_a_hung_tool_and_cancels_an_async_one() -> None:
    release = threading.Event()

    @tool
    def hang(x: int) -> int:
        release.wait(10)
        return x

    cancelled = threading.Event()

    @tool
    async def ahang(x: int) -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return x

    start = time.monotonic()
    with pytest.raises(structgen.ToolTimeoutError, match="tool 'hang' did not return within 0.2 s"):
        invoke(hang, {"x": 1}, timeout=0.2)
    with pytest.raises(TimeoutError, match="tool 'ahang' did not return within 0.2 s"):
        invoke(ahang, {"x": 1}, timeout=0.2)
    assert time.monotonic() - start < 3 and cancelled.wait(2)
    release.set()
    assert invoke(hang, {"x": 5}, timeout=5) == 5


def test_a_tool_that_raises_timeout_error_itself_is_not_reported_as_timed_out() -> None:
    @tool
    def flaky(x: int) -> int:
        raise TimeoutError("upstream timed out")

    with pytest.raises(TimeoutError, match="upstream timed out"):
        invoke(flaky, {"x": 1}, timeout=5)


@pytest.mark.parametrize(("options", "message"), [
    ({"tool_timeout": 0}, "timeout is a number of seconds > 0"),
    ({"tool_timeout": "5"}, "timeout is a number of seconds > 0"),
    ({"max_result_chars": 0}, "max_result_chars must be an integer >= 1"),
    ({"on_tool_error": "ignore"}, "on_tool_error must be 'feed'"),
])  # fmt: skip
def test_run_tools_refuses_bad_options_naming_them(options, message) -> None:
    def f(x: int) -> int:
        return x

    with pytest.raises(InvalidParameterError, match=message):
        run_tools(object(), "hi", [f], **options)


def test_run_tools_needs_tools_it_can_run() -> None:
    with pytest.raises(InvalidParameterError, match="at least one tool"):
        run_tools(object(), "hi", [])
    spec = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    with pytest.raises(InvalidParameterError, match="'lookup' .* has no function"):
        run_tools(object(), "hi", [spec])


# --------------------------------------------------------------------------- the loop on the model


def odd(n: int) -> int:
    if n % 2 == 0:
        raise ValueError("must be odd")
    return n


@tool
def pick(n: Annotated[int, pydantic.AfterValidator(odd)]) -> int:
    """Pick a number."""
    return n


def test_run_tools_feeds_invalid_arguments_back_to_the_model(llm) -> None:
    run = run_tools(llm, "Pick the number 4.", [pick], tool_choice="required", max_rounds=1, max_tokens=30)
    assert run.finish_reason in ("max_rounds", "length") and run.calls == []
    [error] = run.errors
    assert isinstance(error, ToolError) and error.name == "pick" and isinstance(error.error, OutputValidationError)
    fed = run.messages[2]
    assert fed["role"] == "tool" and fed["tool_call_id"] == error.id == run.messages[1]["tool_calls"][0]["id"]
    assert fed["content"].startswith("error: OutputValidationError: arguments of 'pick' do not validate: n: ")
    with pytest.raises(OutputValidationError, match="must be odd"):
        run_tools(llm, "Pick the number 4.", [pick], tool_choice="required", max_rounds=1, max_tokens=30,
                  on_tool_error="raise")


def test_run_tools_feeds_a_raising_or_hung_tool_back_and_goes_on(llm) -> None:
    @tool
    def lookup(city: str) -> str:
        """Look a city up."""
        raise RuntimeError("database down")

    @tool
    def slow(city: str) -> str:
        """Look a city up, slowly."""
        time.sleep(5)
        return city

    run = run_tools(llm, "Look up Paris.", [lookup], tool_choice="required", max_rounds=1, max_tokens=30)
    assert [e.name for e in run.errors] == ["lookup"] and run.messages[2]["content"] == "error: RuntimeError: database down"
    start = time.monotonic()
    run = run_tools(llm, "Look up Paris.", [slow], tool_choice="required", max_rounds=1, max_tokens=30, tool_timeout=0.3)
    assert time.monotonic() - start < 4.5
    assert run.messages[2]["content"] == "error: ToolTimeoutError: tool 'slow' did not return within 0.3 s"
    with pytest.raises(RuntimeError, match="database down"):
        run_tools(llm, "Look up Paris.", [lookup], tool_choice="required", max_rounds=1, max_tokens=30,
                  on_tool_error="raise")


@dataclasses.dataclass
class Visit:
    city: str
    at: datetime.datetime


class Page(pydantic.BaseModel):
    title: str


def test_run_tools_feeds_results_back_as_json_and_cuts_huge_ones(llm) -> None:
    @tool
    def history(city: str) -> dict:
        """Past visits to a city."""
        return {"visits": [Visit(city, datetime.datetime(2024, 5, 1, 12))], "pages": [Page(title="Louvre")], "tags": {"art"}}

    @tool
    def document(city: str) -> str:
        """The full guide to a city."""
        return "x" * 50_000

    run = run_tools(llm, "History of Paris?", [history], tool_choice="required", max_rounds=1, max_tokens=30)
    fed = json.loads(run.messages[2]["content"])
    assert fed["visits"][0]["at"] == "2024-05-01T12:00:00" and fed["pages"] == [{"title": "Louvre"}] and fed["tags"] == ["art"]
    run = run_tools(llm, "Guide to Paris?", [document], tool_choice="required", max_rounds=1, max_tokens=30,
                    max_result_chars=500)
    content = run.messages[2]["content"]
    assert content.startswith("x" * 500) and content.endswith("[... 49500 more characters cut: 50000 in all, max_result_chars=500]")
    assert len(run.calls[0][1]) == 50_000  # the caller keeps the whole result


def test_run_tools_runs_async_tools_from_inside_a_running_event_loop(llm) -> None:
    @tool
    async def double(x: int) -> int:
        """Double x."""
        await asyncio.sleep(0)
        return 2 * x

    async def agent() -> structgen.ToolRun:
        return run_tools(llm, "Double 21.", [double], tool_choice="required", max_rounds=1, max_tokens=30)

    run = asyncio.run(agent())
    assert run.errors == [] and [c.name for c, _ in run.calls] == ["double"]
    assert run.calls[0][1] == 2 * run.calls[0][0].arguments.x


def test_run_tools_that_outgrows_the_context_raises_with_the_run_so_far(llm) -> None:
    @tool
    def document(city: str) -> str:
        """The full guide to a city."""
        return "Paris has many long streets. " * 300  # about 1,800 tokens, fed back whole

    with pytest.raises(PromptTooLongError) as caught:
        run_tools(llm, "Guide to Paris?", [document], tool_choice="required", max_rounds=1, max_tokens=30,
                  max_result_chars=None)
    run = caught.value.run
    assert isinstance(caught.value, ToolRunTooLongError) and isinstance(run, structgen.ToolRun)
    assert [c.name for c, _ in run.calls] == ["document"] and run.calls[0][1].startswith("Paris has many")
    assert [m["role"] for m in run.messages] == ["user", "assistant", "tool"] and run.errors == []
    assert run.finish_reason == "context" and run.answer == ""
    assert "max_result_chars" in str(caught.value)  # call()'s advice is kept


# --------------------------------------------------------------------------- a turn of several calls

TWO_CALLS = "Look up Paris, then look up Rome."  # the model calls `lookup` twice in one turn, Paris first


def test_run_tools_runs_the_calls_of_a_turn_at_once_keeping_their_order(llm) -> None:
    spans: dict[str, tuple[float, float]] = {}

    @tool
    def lookup(city: Literal["Paris", "Rome"]) -> str:
        """Population of a city."""
        start = time.monotonic()
        time.sleep(1.0 if city == "Paris" else 0.9)  # the first call ends last
        spans[city] = (start, time.monotonic())
        return f"{city}: {len(spans)}"

    run = run_tools(llm, TWO_CALLS, [lookup], tool_choice="required", max_rounds=1, max_tokens=40)
    assert [(c.arguments.city, result) for c, result in run.calls] == [("Paris", "Paris: 2"), ("Rome", "Rome: 1")]
    assert max(end for _, end in spans.values()) - min(start for start, _ in spans.values()) < 1.8  # one after the other: 1.9
    asked = [c["id"] for c in run.messages[1]["tool_calls"]]
    assert [(m["tool_call_id"], m["content"]) for m in run.messages[2:4]] == list(zip(asked, ["Paris: 2", "Rome: 1"], strict=True))


@pytest.mark.parametrize("in_loop", [False, True], ids=["no-loop", "in-a-running-loop"])
def test_run_tools_gathers_the_async_calls_of_a_turn(llm, in_loop: bool) -> None:
    spans: dict[str, tuple[float, float]] = {}

    @tool
    async def lookup(city: Literal["Paris", "Rome"]) -> str:
        """Population of a city."""
        start = time.monotonic()
        await asyncio.sleep(1.0 if city == "Paris" else 0.9)
        spans[city] = (start, time.monotonic())
        return city

    def agent() -> structgen.ToolRun:
        return run_tools(llm, TWO_CALLS, [lookup], tool_choice="required", max_rounds=1, max_tokens=40)

    async def in_a_loop() -> structgen.ToolRun:
        return agent()

    run = asyncio.run(in_a_loop()) if in_loop else agent()
    assert [result for _, result in run.calls] == ["Paris", "Rome"] and run.errors == []
    assert max(end for _, end in spans.values()) - min(start for start, _ in spans.values()) < 1.8


def test_run_tools_feeds_errors_timeouts_and_cut_results_of_a_turn_in_call_order(llm) -> None:
    @tool
    def lookup(city: Literal["Paris", "Rome"]) -> str:
        """Population of a city."""
        if city == "Paris":
            time.sleep(0.3)  # fails after Rome returned
            raise RuntimeError("database down")
        return "R" * 500

    run = run_tools(llm, TWO_CALLS, [lookup], tool_choice="required", max_rounds=1, max_tokens=40, max_result_chars=100)
    assert [(e.name, e.arguments, str(e.error)) for e in run.errors] == [("lookup", {"city": "Paris"}, "database down")]
    assert [(c.arguments.city, r) for c, r in run.calls] == [("Rome", "R" * 500)]
    assert run.messages[2]["content"] == "error: RuntimeError: database down"
    assert run.messages[3]["content"].startswith("R" * 100 + "\n[... 400 more characters cut")
    with pytest.raises(RuntimeError, match="database down"):
        run_tools(llm, TWO_CALLS, [lookup], tool_choice="required", max_rounds=1, max_tokens=40, on_tool_error="raise")

    @tool(name="lookup")
    def hang_on_paris(city: Literal["Paris", "Rome"]) -> str:
        """Population of a city."""
        time.sleep(5 if city == "Paris" else 0.6)
        return city

    start = time.monotonic()
    run = run_tools(llm, TWO_CALLS, [hang_on_paris], tool_choice="required", max_rounds=1, max_tokens=40, tool_timeout=0.8)
    assert time.monotonic() - start < 4.5
    assert [m["content"] for m in run.messages[2:4]] == ["error: ToolTimeoutError: tool 'lookup' did not return within 0.8 s",
                                                         "Rome"]


# --------------------------------------------------------------------------- parameter schemas


def _function(name: str, params: object) -> dict[str, object]:
    return {"type": "function", "function": {"name": name, "parameters": params}}


@pytest.mark.parametrize(("params", "says"), [
    ({"type": "object", "properties": {"a": {"type": "nope"}}}, "'nope' is not valid under any of the given schemas"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}},
     "pattern '(' at #/properties/a/pattern is not a regex Python's re can read"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "\\p{Lu}"}}},
     "pattern '\\\\p{Lu}' at #/properties/a/pattern is not a regex Python's re can read"),
    ({"type": "object", "properties": {"a": {"minLength": -1}}}, "-1 is less than the minimum of 0"),
    ({"$schema": True, "type": "object"}, "$schema must be the URI of a JSON Schema draft"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "properties": {"a": {"required": "b"}}},
     "'b' is not of type 'array'"),
])
def test_a_tools_bad_parameters_schema_is_refused_naming_the_tool(params: dict, says: str) -> None:
    for _ in range(2):  # the second answer comes from the check's cache: the same refusal
        with pytest.raises(InvalidConstraintError, match=r"tool 'lookup': invalid parameters schema: ") as info:
            tool_format.check_tools([_function("ok", {"type": "object"}), _function("lookup", params)])
        assert says in str(info.value)


_D4 = "http://json-schema.org/draft-04/schema#"


@pytest.mark.parametrize("params", [
    {"type": "object", "properties": {"a": {"type": "nope"}}},
    {"type": "object", "properties": {"a": {"type": "string", "minLength": -1}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "[\\p{L}]+"}}},
    {"type": "object", "patternProperties": {"^x(": {"type": "string"}}},
    {"type": "object", "$defs": {"w": {"type": "string", "pattern": "\\p{Lu}"}}},
    {"$schema": 7, "type": "object"},
    {"$schema": _D4, "type": "object", "properties": {"a": {"enum": ["x", "x"]}}},
    {"$schema": _D4, "type": "object", "properties": {"a": {"type": "integer", "exclusiveMinimum": 3}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?<y>[0-9]{4})$"}}},
    {"type": "object", "properties": {"a": {"type": "integer", "maximum": "5"}}},
    {"$ref": "#"},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/r"}}, "$defs": {"r": {"$ref": "#/$defs/r"}}},
])
def test_a_schema_gets_the_same_verdict_as_parameters_and_as_a_response_format(params: dict) -> None:
    """One check for both: a schema refused as a response format is refused as a tool's
    parameters, naming the same place, and one accepted there is accepted here."""
    try:
        to_constraint(JsonSchema(params))
        refusal = None
    except (InvalidConstraintError, UnsupportedSchemaError) as e:
        refusal = str(e)
    try:
        tool_format.check_tools([_function("f", params)])
        assert refusal is None, f"accepted as parameters, refused as a response format: {refusal}"
    except InvalidConstraintError as e:
        assert refusal is not None, f"refused as parameters, accepted as a response format: {e}"
        where = re.search(r"#/[^ :)]*|(?<=at )#(?=[ :])", refusal)
        assert where is None or where.group(0) in str(e), (refusal, str(e))


def test_tools_parameters_that_are_not_json_text_are_still_checked() -> None:
    bad = {"type": "object", "properties": {"a": {"type": "nope"}}, "default": {1, 2}}  # a set: no JSON text
    with pytest.raises(InvalidConstraintError, match="'nope' is not valid"):
        tool_format.check_tools([_function("f", bad)])
    tool_format.check_tools([_function("f", {"type": "object", "examples": [{1, 2}]})])


def test_the_parameters_check_keeps_only_digests_of_valid_schemas_and_at_most_its_size() -> None:
    known = tool_format._KnownValid(size=2)
    valid = [{"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 10_000}}}
             for i in range(3)]
    for schema in valid:
        assert known.error(schema) is None
    assert known.error({"type": "nope"}) is not None
    assert len(known._digests) == 2 and all(len(k) == 16 for k in known._digests)  # the last two, digests only
    assert known.error(valid[2]) is None and known.error({"type": "nope"}) is not None
