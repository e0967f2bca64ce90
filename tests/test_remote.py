"""`RemoteLLM` against the real structgen server (the `server_url` fixture): the same
`generate` / `complete` / `generate_batch` / `call` API as in-process, over HTTP."""

from __future__ import annotations

import asyncio
import re
from enum import Enum
from typing import Annotated, Literal

import pydantic
import pytest

from structgen.errors import (
    IncompleteOutputError,
    InvalidConstraintError,
    InvalidParameterError,
    ModelNotFoundError,
    PromptTooLongError,
    StructgenError,
    UnsupportedSchemaError,
)
from structgen.remote import RemoteLLM
from structgen.tool_runs import run_tools
from structgen.tools import tool
from structgen.types import CFG, Choice, JsonSchema, Regex

MODEL = "SmolLM2-135M-Instruct"


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def remote(server_url: str):
    with RemoteLLM(server_url, MODEL) as llm:
        yield llm


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), 1e39])
def test_sampling_values_are_checked_before_anything_is_sent(temperature: float) -> None:
    client = RemoteLLM("http://127.0.0.1:9", "m")  # nothing listens there: a send would fail otherwise
    with pytest.raises(InvalidParameterError, match="temperature must be"):
        client.generate(int, "p", temperature=temperature)


def test_strict_false_and_the_in_process_keywords_work_or_are_named(remote: RemoteLLM) -> None:
    two_or_more = Annotated[set[str], pydantic.Field(min_length=2)]  # uniqueItems stays: repeats could leave it short
    with pytest.raises(UnsupportedSchemaError, match="strict=False"):
        remote.generate(two_or_more, "List three fruits as a JSON array.", max_tokens=30)
    done = remote.complete(two_or_more, "List three fruits as a JSON array.", max_tokens=30, strict=False)
    assert isinstance(done.value, set) and done.relaxed == ("uniqueItems at #",)
    assert isinstance(remote.generate(set[str], "List three fruits as a JSON array.", max_tokens=30), set)
    with pytest.raises(InvalidParameterError, match="repair .* runs in process only"):
        remote.complete(int, "p", repair=1)
    with pytest.raises(InvalidParameterError, match="did you mean max_tokens"):
        remote.complete(int, "p", max_new_tokens=5)


def test_a_closed_client_says_so(server_url: str) -> None:
    client = RemoteLLM(server_url, MODEL)
    client.close()
    for use in (lambda: client.generate(int, "p"), lambda: list(client.stream(int, "p"))):
        with pytest.raises(StructgenError, match="this RemoteLLM is closed"):
            use()


def test_generate_pydantic(remote: RemoteLLM) -> None:
    person = remote.generate(Person, "Alice is 30 years old. Extract the person as JSON.", max_tokens=48)
    assert isinstance(person, Person)
    c = remote.complete(Person, "Bob is 41.", max_tokens=48)
    assert c.finish_reason == "stop" and c.stats.prompt_tokens > 0 and c.stats.output_tokens > 0
    assert Person.model_validate_json(c.text) == c.value


@pytest.mark.parametrize(
    "output_type, check",
    [
        (Literal[1, 2, 3], lambda v: v in (1, 2, 3)),
        (bool, lambda v: isinstance(v, bool)),
        (Literal["yes", "no"], lambda v: v in ("yes", "no")),
        (Regex(r"[0-9]{2}:[0-9]{2}"), lambda v: re.fullmatch(r"[0-9]{2}:[0-9]{2}", v)),
        (Choice(["north", "south"]), lambda v: v in ("north", "south")),
        (CFG('root ::= "x" [0-9] [0-9]'), lambda v: re.fullmatch(r"x[0-9]{2}", v)),
        (JsonSchema({"type": "array", "items": {"type": "integer"}, "maxItems": 3}), lambda v: isinstance(v, list)),
    ],
)
def test_output_types(remote: RemoteLLM, output_type, check) -> None:
    assert check(remote.generate(output_type, "Answer briefly.", max_tokens=24))


def test_int(remote: RemoteLLM) -> None:
    assert isinstance(remote.generate(int, "What is 2+3? Reply with just the number.", max_tokens=8), int)


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_other_dialects_accepted_by_our_server(server_url: str, dialect: str) -> None:
    with RemoteLLM(server_url, MODEL, dialect=dialect) as llm:
        assert re.fullmatch("[a-c]{3}", llm.generate(Regex("[a-c]{3}"), "Letters?", max_tokens=8))
        assert llm.generate(Choice(["on", "off"]), "Switch?", max_tokens=8) in ("on", "off")


class Direction(Enum):
    NORTH = "north"
    SOUTH = "south"


@pytest.mark.parametrize(
    "output_type, expected",
    [
        (Choice(["north", "south"]), {"north", "south"}),
        (Literal[1, 2, 3], {1, 2, 3}),
        (Direction, set(Direction)),
        (bool, {True, False}),
    ],
)
def test_openai_dialect_carries_choices_and_scalars_as_wrapped_json(server_url: str, output_type, expected) -> None:
    with RemoteLLM(server_url, MODEL, dialect="openai") as llm:
        c = llm.complete(output_type, "Pick one.", max_tokens=16)
        assert c.value in expected and type(c.value) is type(next(iter(expected)))
        schema = llm._wire_request(output_type, "x", None, None).body["response_format"]["json_schema"]["schema"]
        assert schema["type"] == "object" and schema["required"] == ["value"] and schema["additionalProperties"] is False


def test_openai_dialect_sends_a_choice_as_an_enum(server_url: str) -> None:
    with RemoteLLM(server_url, MODEL, dialect="openai") as llm:
        fmt = llm._wire_request(Choice(["on", "off", 3]), "x", None, None).body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["schema"] == {
        "type": "object",
        "properties": {"value": {"enum": ["on", "off", 3]}},
        "required": ["value"],
        "additionalProperties": False,
    }


def test_openai_dialect_wraps_non_object_json_and_refuses_regex(server_url: str) -> None:
    with RemoteLLM(server_url, MODEL, dialect="openai") as llm:
        assert isinstance(llm.generate(JsonSchema({"type": "boolean"}), "True or false?", max_tokens=16), bool)
        one_person = Annotated[list[Person], pydantic.Field(max_length=1)]  # an array root with $defs
        people = llm.generate(one_person, "Alice is 30. List the people.", max_tokens=60)
        assert isinstance(people, list) and all(isinstance(p, Person) for p in people)
        with pytest.raises(UnsupportedSchemaError, match="dialect='structgen'"):
            llm.generate(Regex("a+"), "a", max_tokens=4)


def test_stream_deltas_make_the_completion(remote: RemoteLLM) -> None:
    # A budget far from the output's length: near it, closing holds text back until it is safe.
    stream = remote.stream(Person, "Alice is 30 years old. Extract the person as JSON.", max_tokens=160)
    deltas = list(stream)
    assert len(deltas) > 1 and stream.completion is not None
    assert "".join(deltas) == stream.completion.text
    assert isinstance(stream.completion.value, Person)
    stats = stream.completion.stats
    assert stats.prompt_tokens > 0 and stats.output_tokens > 0
    assert 0 < stats.ttft_s <= stats.wall_s and stats.decode_s > 0
    assert stats.forward_passes is None  # the server does not say: unknown, not zero


def test_astream_deltas_make_the_completion(remote: RemoteLLM) -> None:
    async def consume() -> tuple[list[str], object]:
        stream = remote.astream(list[int], "Three small numbers as a JSON list:", max_tokens=24)
        return [d async for d in stream], stream.completion

    deltas, completion = asyncio.run(consume())
    assert "".join(deltas) == completion.text and isinstance(completion.value, list)
    assert all(isinstance(v, int) for v in completion.value)


def test_stream_raises_like_complete(remote: RemoteLLM) -> None:
    with pytest.raises(InvalidConstraintError):
        list(remote.stream(CFG("root ::= ("), "x", max_tokens=4))
    stream = remote.stream(Person, "Describe someone.", max_tokens=3)
    with pytest.raises(IncompleteOutputError) as e:
        list(stream)
    assert e.value.partial_text.startswith("{") and e.value.stats.output_tokens == 3


def test_stats_say_none_for_what_is_not_measured(remote: RemoteLLM) -> None:
    stats = remote.complete(int, "What is 2+3?", max_tokens=8).stats
    assert stats.prompt_tokens > 0 and stats.output_tokens > 0 and stats.wall_s > 0
    assert stats.ttft_s is None and stats.decode_s is None and stats.mean_acceptance_length is None


def test_text_at_max_tokens_comes_back_cut(remote: RemoteLLM) -> None:
    c = remote.complete(str, "Write a long story about a dragon.", max_tokens=5)
    assert c.finish_reason == "length" and c.value == c.text and c.text and c.stats.output_tokens == 5


def test_generate_batch_and_async(remote: RemoteLLM) -> None:
    prompts = [f"{name} is {age}. Extract the person." for name, age in [("Ann", 20), ("Ben", 31), ("Cy", 42), ("Di", 53)]]
    people = remote.generate_batch(Person, prompts, max_tokens=48)
    assert len(people) == 4 and all(isinstance(p, Person) for p in people)

    async def both() -> list:
        return await asyncio.gather(*(remote.agenerate(Regex("[0-9]{1,2}"), f"{i} + 1 =", max_tokens=6) for i in range(3)))

    assert all(re.fullmatch("[0-9]{1,2}", v) for v in asyncio.run(both()))


def test_raw_completion(remote: RemoteLLM) -> None:
    c = remote.complete(Regex(r" [0-9]{1,2}"), "1 2 3 4", chat=False, max_tokens=6)
    assert re.fullmatch(r" [0-9]{1,2}", c.value) and c.stats.prompt_tokens > 0


def test_errors_map_to_structgen_exceptions(server_url: str, remote: RemoteLLM) -> None:
    with pytest.raises(IncompleteOutputError) as e:
        remote.generate(Person, "Describe someone.", max_tokens=2)
    assert e.value.partial_text.startswith("{")
    with pytest.raises(InvalidConstraintError):
        remote.generate(CFG("root ::= ("), "x", max_tokens=4)
    with pytest.raises(PromptTooLongError):
        remote.generate(int, "word " * 5000, max_tokens=4)
    with RemoteLLM(server_url, "no-such-model") as other, pytest.raises(ModelNotFoundError, match="no-such-model"):
        other.generate(int, "1", max_tokens=4)
    assert remote.models() == [MODEL]


def test_remote_tool_calls(remote: RemoteLLM) -> None:
    @tool
    def book_table(restaurant: str, people: int) -> str:
        """Book a table.

        Args:
            restaurant: Restaurant name.
            people: Number of guests.
        """
        return f"booked {people} at {restaurant}"

    calls = remote.call("Book a table for 2 at Chez Marie.", tools=[book_table], max_tokens=80)
    assert calls and calls[0].name == "book_table"
    assert isinstance(calls[0].arguments.people, int)
    assert calls[0].invoke().startswith("booked")


def test_llm_remote_constructor(server_url: str) -> None:
    import structgen

    llm = structgen.LLM.remote(server_url, MODEL)
    assert isinstance(llm, RemoteLLM)
    assert llm.generate(Choice(["a", "b"]), "a or b?", max_tokens=4) in ("a", "b")


def test_remote_run_tools_keeps_calls_when_the_answer_hits_max_tokens(remote: RemoteLLM) -> None:
    @tool
    def history(city: Literal["Paris", "Rome"]) -> str:
        """The history of a city."""
        return f"{city} was founded long ago. " + " ".join(f"In year {1000 + 50 * i} the city grew." for i in range(20))

    # The call fits in 40 tokens; the answer, which echoes the long tool result, does not.
    run = run_tools(remote, "Tell me the history of Paris.", [history], tool_choice="required", max_rounds=1, max_tokens=40)
    assert [c.name for c, _ in run.calls] == ["history"] and run.calls[0][1].startswith("Paris was")
    assert run.finish_reason == "length" and run.answer == "" and run.partial_text
    assert [m["role"] for m in run.messages] == ["user", "assistant", "tool"]
