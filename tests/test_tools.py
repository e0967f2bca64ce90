"""Function calling in-process: `@structgen.tool`, the Hermes tool format (prompt, ONE
constraint, parser) and `call` / `run_tools` on the real default model."""

from __future__ import annotations

import asyncio
import json
from enum import Enum
from pathlib import Path
from typing import Literal

import jsonschema
import pydantic
import pytest

import structgen
from structgen import tool_format
from structgen.errors import InvalidConstraintError, UnsupportedTypeError
from structgen.tool_runs import run_tools
from structgen.tools import Tool, ToolCall, ToolCalls, as_tool, call, tool
from structgen.types import CFG, JsonSchema

DATA = Path(__file__).parent / "data" / "maskbench"  # a few records of the corpus


class Unit(str, Enum):
    C = "C"
    F = "F"


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)
    country: Literal["FR", "UK", "JP"]


@tool
def get_weather(city: str, unit: Unit = Unit.C) -> str:
    """Current weather in a city.

    Args:
        city: The city name, e.g. Paris.
        unit: Temperature unit.
    """
    return f"21 degrees {unit.value} in {city}"


@tool(name="distance_km")
def distance(origin: Place, destination: Place) -> float:
    """Great-circle distance between two places."""
    return 343.5


@pytest.fixture(scope="module")
def llm():
    import structgen

    return structgen.LLM()


# --------------------------------------------------------------------------- tool definitions


def test_tool_from_function() -> None:
    assert isinstance(get_weather, Tool)
    assert get_weather.name == "get_weather"
    assert get_weather.description == "Current weather in a city."
    params = get_weather.parameters
    assert params["required"] == ["city"]
    assert params["properties"]["city"]["description"] == "The city name, e.g. Paris."
    assert params["additionalProperties"] is False
    assert get_weather("Rome") == "21 degrees C in Rome"  # still callable
    spec = distance.to_openai()
    assert spec["function"]["name"] == "distance_km" and "$defs" in spec["function"]["parameters"]


def test_tool_rejects_untypable_functions() -> None:
    def f(*args: int) -> None: ...

    with pytest.raises(UnsupportedTypeError, match=r"\*args"):
        tool(f)
    with pytest.raises(UnsupportedTypeError):
        as_tool(42)


def test_validate_and_invoke() -> None:
    args = distance.validate({"origin": {"city": "Paris", "country": "FR"}, "destination": {"city": "London", "country": "UK"}})
    assert isinstance(args.origin, Place)
    assert ToolCall("distance_km", args, distance).invoke() == 343.5
    assert ToolCall("get_weather", get_weather.validate({"city": "Oslo", "unit": "F"}), get_weather).invoke() == "21 degrees F in Oslo"


@tool
async def slow_double(x: int) -> int:
    """Double x, as an async service would."""
    await asyncio.sleep(0)
    return 2 * x


def test_an_async_tool_is_awaited_by_invoke_and_ainvoke() -> None:
    call = ToolCall("slow_double", slow_double.validate({"x": 21}), slow_double)
    assert call.invoke() == 42
    assert asyncio.run(call.ainvoke()) == 42
    assert ToolCall("get_weather", get_weather.validate({"city": "Oslo"}), get_weather).invoke() == "21 degrees C in Oslo"

    async def inside_a_loop() -> None:
        with pytest.raises(structgen.InvalidParameterError, match="await call.ainvoke"):
            call.invoke()

    asyncio.run(inside_a_loop())


@pytest.mark.parametrize("spec", [
    {"type": "function", "function": {"name": "get weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "x" * 65}},
    {"type": "function", "function": {"parameters": {"type": "object"}}},
], ids=["space", "empty", "too-long", "no-name"])  # fmt: skip
def test_a_tool_whose_name_openai_would_refuse_is_refused_naming_the_rule(spec) -> None:
    with pytest.raises(structgen.InvalidParameterError, match="name"):
        as_tool(spec)


@pytest.mark.parametrize("rounds", [-1, 1.5, True])
def test_run_tools_refuses_a_bad_round_limit(rounds) -> None:
    with pytest.raises(structgen.InvalidParameterError, match="max_rounds must be an integer >= 0"):
        run_tools(object(), "hi", [get_weather], max_rounds=rounds)


# --------------------------------------------------------------------------- the tool format


def test_resolve_tool_choice() -> None:
    tools = [get_weather.to_openai()]
    assert tool_format.resolve_tool_choice(None, tools).mode == "auto"
    assert tool_format.resolve_tool_choice(None, []).mode == "none"
    named = tool_format.resolve_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools)
    assert named == tool_format.ToolChoice("named", "get_weather")
    with pytest.raises(InvalidConstraintError, match="nope"):
        tool_format.resolve_tool_choice({"type": "function", "function": {"name": "nope"}}, tools)
    with pytest.raises(InvalidConstraintError):
        tool_format.resolve_tool_choice("always", tools)
    with pytest.raises(InvalidConstraintError):
        tool_format.resolve_tool_choice("required", [])


def test_required_schema_hoists_defs() -> None:
    tools = [get_weather.to_openai(), distance.to_openai()]
    schema = tool_format.required_schema(tools, tool_format.ToolChoice("required"), parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    calls = [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "distance_km", "arguments": {"origin": {"city": "a", "country": "FR"}, "destination": {"city": "b", "country": "JP"}}},
    ]
    jsonschema.validate(calls, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Paris", "extra": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "distance_km", "arguments": {"origin": {"city": "a", "country": "XX"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)  # required: at least one call


@pytest.mark.parametrize("params", [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}}, "required": ["a", "b"]},
    {"$id": "https://example.com/p", "type": "object", "properties": {"a": {"$ref": "https://example.com/p#/$defs/A"}},
     "required": ["a"], "$defs": {"A": {"type": "integer"}}},
    {"type": "object", "properties": {"a": {"type": "integer"}, "next": {"$ref": "#"}}, "required": ["a"]},
])
def test_a_tools_references_into_its_own_parameters_resolve_as_in_a_response_format(llm, params: dict) -> None:
    """Pointers other than `#/$defs/...` (into `properties`, through the schema's `$id`, to
    itself) pointed into the call's wrapper schema and were refused ("points nowhere"); they
    resolve inside the parameters, the same values valid and invalid as the schema alone."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    schema = tool_format.required_schema(tools, tool_format.ToolChoice("required"), parallel=True)
    good, bad = {"a": 1, "b": 2}, {"a": 1, "b": "x"}
    if "b" not in params["properties"]:
        good, bad = {"a": 1, "next": {"a": 2}}, {"a": "x"}
    jsonschema.validate(good, params)
    jsonschema.validate([{"name": "f", "arguments": good}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "arguments": bad}], schema)
    for choice in ("required", "auto"):
        output_type = tool_format.tool_output_type(tools, tool_format.resolve_tool_choice(choice, tools), True)
        grammar = llm.compile(output_type)
        call = json.dumps({"name": "f", "arguments": good}, separators=(", ", ": "))
        text = f"[{call}]" if choice == "required" else f"<tool_call>\n{call}\n</tool_call>"
        assert grammar.accepts(text) or grammar.accepts(text.replace(", ", ",").replace(": ", ":")), (choice, text)


def test_auto_grammar_compiles_and_constrains(llm) -> None:
    tools = [get_weather.to_openai(), distance.to_openai()]
    grammar = llm.compile(CFG(tool_format.auto_grammar(tools, parallel=True), syntax="lark"))
    ok = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert grammar.accepts(ok)
    assert grammar.accepts(ok + "\n" + ok)  # parallel calls
    assert grammar.accepts("Hello! I can answer that without a tool.")
    assert not grammar.accepts('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')
    assert not grammar.accepts('<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>')
    assert not grammar.accepts("<tool_call> not json")
    single = llm.compile(CFG(tool_format.auto_grammar(tools, parallel=False), syntax="lark"))
    assert not single.accepts(ok + "\n" + ok)


def test_parse_tool_calls() -> None:
    tools = [get_weather.to_openai()]
    auto = tool_format.ToolChoice("auto")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}\n</tool_call>'
    calls, content = tool_format.parse_tool_calls(text, tools, auto)
    assert content is None and calls[0].arguments == {"city": "a</tool_call>b"}
    calls, content = tool_format.parse_tool_calls("Just text.", tools, auto)
    assert calls == [] and content == "Just text."
    calls, _ = tool_format.parse_tool_calls('[{"name": "get_weather", "arguments": {"city": "x"}}]', tools, tool_format.ToolChoice("required"))
    assert calls[0].name == "get_weather" and calls[0].id.startswith("call_")


def test_render_messages_without_native_tool_template(tokenizer) -> None:
    tools = [get_weather.to_openai()]
    assert not tool_format.template_supports_tools(tokenizer)  # SmolLM2's template
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    rendered, template_tools = tool_format.render_messages(tokenizer, messages, tools)
    assert template_tools is None
    assert rendered[0]["role"] == "system" and "<tools>" in rendered[0]["content"] and "get_weather" in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}
    text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    assert "<tool_call>" in text and "<tool_response>" in text


# --------------------------------------------------------------------------- on the model


def test_generate_takes_tools_for_the_template_as_call_does(llm) -> None:
    as_dicts = llm.encode_prompt("Weather in Oslo?", tools=[get_weather.to_openai(), distance.to_openai()])
    assert llm.encode_prompt("Weather in Oslo?", tools=[get_weather, distance]) == as_dicts


def test_call_required_returns_typed_calls(llm) -> None:
    calls = call(llm, "What's the weather in Paris?", [get_weather, distance], max_tokens=120)
    assert isinstance(calls, ToolCalls) and len(calls) >= 1
    for c in calls:
        assert c.name in ("get_weather", "distance_km")
        assert isinstance(c.arguments, pydantic.BaseModel)
        assert isinstance(c.invoke(), str | float)


def test_call_named_single(llm) -> None:
    calls = llm.call("How far is Paris from London?", [get_weather, distance], tool_choice="distance_km", max_tokens=120)
    assert [c.name for c in calls] == ["distance_km"]
    assert isinstance(calls[0].arguments.origin, Place)
    assert calls[0].invoke() == 343.5


def test_call_auto(llm) -> None:
    calls = call(llm, "Say hi to me.", [get_weather], tool_choice="auto", max_tokens=40)
    if calls:
        assert all(c.name == "get_weather" for c in calls)
    else:
        assert isinstance(calls.text, str)


def test_call_with_dict_tools_from_glaive(llm) -> None:
    """Function-calling schemas from Glaive (MaskBench): arguments validate against each."""
    simple = [json.loads(line) for line in (DATA / "Glaiveai2K.jsonl").read_text().splitlines()]
    assert len(simple) == 3  # three small schemas (tests/data/README.md)
    tools = [
        {"type": "function", "function": {"name": r["id"].split("---")[1].rsplit("_", 1)[0], "parameters": r["schema"]}}
        for r in simple
    ]
    for t in tools:
        calls = call(llm, "Please help me with this.", tools, tool_choice=t["function"]["name"], max_tokens=200)
        assert calls[0].name == t["function"]["name"]
        jsonschema.validate(calls[0].arguments, t["function"]["parameters"])


def test_run_tools_loop(llm) -> None:
    seen = []

    @tool
    def lookup(city: Literal["Paris", "Rome"]) -> dict:
        """Population of a city."""
        seen.append(city)
        return {"city": city, "population": 2_100_000}

    result = run_tools(llm, "Population of Paris?", [lookup], tool_choice="required", max_rounds=1, max_tokens=60)
    assert result.finish_reason == "max_rounds" and result.partial_text is None
    assert [c.name for c, _ in result.calls] == ["lookup"] and len(seen) == 1
    assert result.calls[0][1] == {"city": seen[0], "population": 2_100_000}
    roles = [m["role"] for m in result.messages]
    assert roles == ["user", "assistant", "tool", "assistant"]  # the final answer turn included
    assert result.messages[1]["tool_calls"][0]["id"] == result.messages[2]["tool_call_id"]
    assert result.messages[3] == {"role": "assistant", "content": result.answer}
    # The conversation goes back to a model as is.
    again = call(llm, result.messages + [{"role": "user", "content": "And Rome?"}], [lookup], max_tokens=60)
    assert again[0].name == "lookup"


def test_run_tools_keeps_executed_calls_when_a_later_turn_hits_max_tokens(llm) -> None:
    @tool
    def history(city: Literal["Paris", "Rome"]) -> str:
        """The history of a city."""
        return f"{city} was founded long ago. " + " ".join(f"In year {1000 + 50 * i} the city grew." for i in range(20))

    # The call fits in 40 tokens (most of it forced by the grammar); the answer, which echoes
    # the long tool result, does not.
    run = run_tools(llm, "Tell me the history of Paris.", [history], tool_choice="required", max_rounds=1, max_tokens=40)
    assert run.finish_reason == "length" and run.answer == ""
    assert [c.name for c, _ in run.calls] == ["history"] and run.calls[0][1].startswith("Paris was founded")
    assert run.partial_text  # the cut turn's text is kept
    assert [m["role"] for m in run.messages] == ["user", "assistant", "tool"]


def test_tool_calls_show_their_calls_and_text(llm) -> None:
    calls = ToolCalls([ToolCall("get_weather", get_weather.validate({"city": "Oslo"}), get_weather, "call_1")])
    assert "get_weather" in repr(calls) and "Oslo" in str(calls) and calls.finish_reason == "tool_calls"
    assert calls.to_message()["tool_calls"][0]["function"]["name"] == "get_weather"
    answer = call(llm, "Say hi to me.", [get_weather], tool_choice="none", max_tokens=40)
    assert answer == [] and answer.text and answer.finish_reason == "stop"
    assert repr(answer) == f"ToolCalls([], text={answer.text!r})" == str(answer)
    assert answer.to_message() == {"role": "assistant", "content": answer.text}


def test_json_schema_of_required_compiles(llm) -> None:
    schema = tool_format.required_schema(
        [get_weather.to_openai(), distance.to_openai()], tool_format.ToolChoice("required"), parallel=True
    )
    g = llm.compile(JsonSchema(schema))
    assert g.accepts('[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert not g.accepts('[{"name": "get_weather", "arguments": {"town": "Paris"}}]')
