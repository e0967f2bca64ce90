"""Typed use of the public API, checked by mypy (tests/test_typing.py), never run: each
`assert_type` states what an editor should infer for one kind of output type."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal, TypedDict

from pydantic import BaseModel
from typing_extensions import assert_type

import structgen


class Customer(BaseModel):
    name: str


@dataclasses.dataclass
class City:
    name: str


class Point(TypedDict):
    x: int


class Colour(enum.Enum):
    red = "red"


async def typed_calls(llm: structgen.LLM) -> None:
    assert_type(llm.generate(Customer, "p"), Customer)
    assert_type(llm.generate(City, "p", max_tokens=10), City)
    assert_type(llm.generate(Point, "p"), Point)
    assert_type(llm.generate(int, "p"), int)
    assert_type(llm.generate(float, "p"), float)
    assert_type(llm.generate(bool, "p"), bool)
    assert_type(llm.generate(str, "p", temperature=0.5, seed=1), str)
    assert_type(llm.generate(Colour, "p"), Colour)
    assert_type(llm.generate(list[int], "p"), list[int])
    assert_type(llm.generate(list[Customer], "p"), list[Customer])
    # mypy has no type for `Literal[...]` used as a value yet (PEP 747); pyright infers it
    assert_type(llm.generate(Literal["yes", "no"], "p"), Any)
    assert_type(llm.generate(structgen.Regex(r"\d+"), "p"), str)
    assert_type(llm.generate(structgen.CFG('root ::= "a"'), "p"), str)
    assert_type(llm.generate(structgen.JsonSchema({"type": "object"}), "p"), Any)
    assert_type(llm.generate({"type": "object"}, "p"), Any)
    assert_type(llm.generate(structgen.Choice(["a", "b"]), "p"), Any)
    assert_type(llm.generate(Customer, [{"role": "user", "content": "p"}], chat=True), Customer)

    assert_type(llm.complete(Customer, "p"), structgen.Completion[Customer])
    assert_type(llm.complete(Customer, "p").value, Customer)
    assert_type(llm.complete(structgen.Regex("a"), "p"), structgen.Completion[str])
    assert_type(llm.complete({"type": "object"}, "p", strict=False).relaxed, tuple[str, ...])
    assert_type(llm.complete(Customer, "p", reasoning=True, max_reasoning_tokens=64).reasoning, str | None)
    assert_type(llm.complete_batch(City, ["p"]), list[structgen.Completion[City]])
    assert_type(llm.generate_batch(Customer, ["p", "q"], max_tokens=5), list[Customer])
    assert_type(await llm.agenerate(Customer, "p"), Customer)
    assert_type(await llm.acomplete(int, "p", top_k=3), structgen.Completion[int])
    for delta in llm.stream(Customer, "p", top_p=0.9):
        assert_type(delta, str)
    async for piece in llm.astream(Customer, "p"):
        assert_type(piece, str)
    for snapshot in llm.stream(Customer, "p", partial=True, max_tokens=50):
        assert_type(snapshot, structgen.Partial[Customer])
        assert_type(snapshot.value, Customer)
        assert_type(snapshot.finished, tuple[tuple[str | int, ...], ...])
    for point in llm.stream(Point, "p", partial=True):
        assert_type(point.value, Point)
    for schema_snapshot in llm.stream({"type": "object"}, "p", partial=True):
        assert_type(schema_snapshot.value, Any)
    for text in llm.stream(Customer, "p", partial=False):
        assert_type(text, str)
    partial_stream = llm.astream(City, "p", partial=True)
    async for city in partial_stream:
        assert_type(city.value, City)
    assert_type(partial_stream.completion, structgen.Completion[City] | None)
    text_stream = llm.astream(Customer, "p")
    async for delta in text_stream:
        assert_type(delta, str)
    assert_type(text_stream.completion, structgen.Completion[Customer] | None)
    assert_type(llm.astream(structgen.Regex("a"), "p").completion, structgen.Completion[str] | None)

    stats = llm.complete(Customer, "p").stats
    assert_type(stats.ttft_s * 1000, float)
    assert_type(stats.guards_fired, list[str])
    assert_type(llm.call("p", [tools_of_mine]), structgen.ToolCalls)
    assert_type(tools_of_mine, structgen.Tool)

    assert_type(structgen.generate(Customer, "p"), Customer)
    assert_type(structgen.generate(structgen.Regex("a"), "p"), str)
    with structgen.LLM() as local:
        assert_type(local, structgen.LLM)


def errors_are_exported() -> tuple[type[structgen.StructgenError], ...]:
    return (
        structgen.EngineError, structgen.ModelLoadError, structgen.RequestCancelledError,
        structgen.UnsatisfiableConstraintError, structgen.ConstraintTooLargeError,
    )  # fmt: skip


@structgen.tool
def tools_of_mine(city: str) -> str:
    return city


@structgen.tool(name="lookup")
def named_tool(city: str) -> str:
    return city


async def remote_and_speculative(remote: structgen.RemoteLLM) -> structgen.SpeculativeConfig | None:
    for snapshot in remote.stream(Customer, "p", partial=True):
        assert_type(snapshot.value, Customer)
    assert_type(remote.generate(Customer, "p"), Customer)
    assert_type(remote.generate(structgen.Regex("a"), "p"), str)
    assert_type(await remote.agenerate(int, "p"), int)
    assert_type(remote.generate_batch(City, ["p"]), list[City])
    completion = remote.complete(Customer, "p")
    assert_type(completion.value, Customer)
    assert_type(completion.stats.ttft_s, float | None)  # unknown where the server does not say
    assert_type((await remote.acomplete(Customer, "p")).stats, structgen.RemoteStats)
    assert_type(remote.call("p", [named_tool]), structgen.ToolCalls)
    assert_type(named_tool, structgen.Tool)
    return None


def rejected_keyword(llm: structgen.LLM) -> None:
    llm.generate(Customer, "p", max_new_tokens=5)  # type: ignore[call-overload]
