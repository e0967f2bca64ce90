"""Typed partial snapshots (`stream(..., partial=True)`): on hand-written outputs of every kind
of output type fed a few characters at a time, and on the real default model's outputs for
nested models and MaskBench JME schemas. At every step the snapshot holds only finished values
(each valid for its place) and the open string field's text so far; finished paths come in
the final value's order; the last snapshot is the final value."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import time
from typing import Any, Literal, TypedDict

import jsonschema
import pydantic
import pytest

import structgen
from structgen.errors import InvalidParameterError
from structgen.partial import Partial, partial_tracker


class Colour(enum.Enum):
    red = "red"
    dark_blue = "dark blue"


class Address(pydantic.BaseModel):
    city: str
    zip_code: int = pydantic.Field(alias="zip")


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    breed: str


class Person(pydantic.BaseModel):
    name: str
    age: int
    colour: Colour
    mood: Literal["happy", "sad"]
    address: Address
    pets: list[Cat | Dog]
    scores: list[float]


@dataclasses.dataclass(frozen=True)
class City:
    name: str
    population: int


class Point(TypedDict):
    x: int
    label: str


PERSON_TEXT = json.dumps({
    "name": "Ada \"the\" Lovelace \u00e9", "age": 36, "colour": "dark blue", "mood": "happy",
    "address": {"city": "London", "zip": 12345},
    "pets": [{"kind": "cat", "lives": 9}, {"kind": "dog", "breed": "collie"}], "scores": [1.5, -2e3],
})  # fmt: skip


def snapshots_of(output_type: Any, text: str, step: int = 3) -> list[Partial[Any]]:
    """The snapshots of `text` fed `step` characters at a time, then the final value."""
    tracker = partial_tracker(output_type)
    out = [s for i in range(0, len(text), step) if (s := tracker.feed(text[i : i + step])) is not None]
    final = structgen.types.to_constraint(output_type).parse(text)
    return [*out, tracker.finish(final)]


def plain(value: Any) -> Any:
    """A snapshot's value as JSON data: models and dataclasses by their fields set so far."""
    if isinstance(value, pydantic.RootModel):
        return plain(value.root)
    if isinstance(value, pydantic.BaseModel):
        return {type(value).model_fields[n].alias or n: plain(getattr(value, n)) for n in value.model_fields_set}
    if dataclasses.is_dataclass(value):
        return {k: plain(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value.value if isinstance(value, enum.Enum) else value


def relaxed(schema: Any) -> Any:
    """`schema` less what a value still being written cannot meet yet: `required`,
    `minItems`, `minProperties`."""
    if isinstance(schema, dict):
        return {k: relaxed(v) for k, v in schema.items() if k not in ("required", "minItems", "minProperties")}
    if isinstance(schema, list):
        return [relaxed(v) for v in schema]
    return schema


def at(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value


def check_snapshots(snapshots: list[Partial[Any]], text: str, schema: dict[str, Any]) -> None:
    """What every stream of snapshots must hold (see the module docstring)."""
    final = json.loads(text)
    validator = jsonschema.Draft202012Validator(relaxed(schema))
    finished: list[tuple] = []
    for snapshot in snapshots[:-1]:
        assert not snapshot.done
        value = plain(snapshot.value)
        finished += snapshot.finished
        for path in snapshot.finished:  # a finished value is the final one, and stays
            assert at(value, path) == at(final, path) if path else value == final
        path = snapshot.path
        if path and isinstance(at(final, path), str):
            try:
                parent = at(value, path[:-1])
            except (IndexError, KeyError):  # inside a list item not finished: not shown
                parent = None
            if isinstance(parent, dict) and path[-1] in parent:  # the open string: a prefix
                assert at(final, path).startswith(parent.pop(path[-1]))
        if value is not None:
            errors = [e.message for e in validator.iter_errors(value)]
            assert not errors, (snapshot.delta, value, errors)
    last = snapshots[-1]
    assert last.done and last.path is None
    assert plain(last.value) == final
    top = [p[0] for p in finished if len(p) == 1]
    assert top == list(final) if isinstance(final, dict) else top == list(range(len(final)))


@pytest.mark.parametrize("step", [1, 4])
def test_nested_model_snapshots_hold_finished_typed_fields_and_the_open_string(step: int) -> None:
    snapshots = snapshots_of(Person, PERSON_TEXT, step)
    check_snapshots(snapshots, PERSON_TEXT, Person.model_json_schema(by_alias=True))
    names = [s.value.name for s in snapshots if "name" in s.value.model_fields_set]
    assert names[0] != names[-1] and all(names[-1].startswith(n) for n in names)  # grows as written
    for s in snapshots:
        fields = s.value.model_fields_set
        assert isinstance(s.value, Person)
        assert "colour" not in fields or s.value.colour is Colour.dark_blue  # never half an enum
        assert "mood" not in fields or s.value.mood == "happy"
        assert "age" not in fields or s.value.age == 36  # never a number cut short
        if "address" in fields:
            assert isinstance(s.value.address, Address)
        if "pets" in fields:
            assert all(isinstance(p, (Cat, Dog)) for p in s.value.pets)
    assert snapshots[-1].value == Person.model_validate_json(PERSON_TEXT)


def test_dataclass_typeddict_list_and_dict_outputs() -> None:
    cases = [
        (City, '{"name": "Oslo", "population": 709000}'),
        (Point, '{"x": -3, "label": "a\\u00e9b"}'),
        (list[City], '[{"name": "A", "population": 1}, {"name": "B", "population": 2}]'),
        (dict[str, list[int]], '{"a": [1, 2], "b": []}'),
    ]
    for output_type, text in cases:
        snapshots = snapshots_of(output_type, text, 2)
        schema = json.loads(structgen.types.to_constraint(output_type).source)
        check_snapshots(snapshots, text, schema)
    city = snapshots_of(City, cases[0][1])[2].value
    assert isinstance(city, City) and city.name.startswith("O") and not hasattr(city, "population")


class Optionals(pydantic.BaseModel):
    note: str | None
    home: Address | None
    tags: pydantic.RootModel[list[int]]


def test_optional_fields_and_root_models_are_typed_as_their_inner_type() -> None:
    text = '{"note": "hi there", "home": {"city": "Rome", "zip": 1}, "tags": [1, 2]}'
    snapshots = snapshots_of(Optionals, text, 2)
    check_snapshots(snapshots, text, Optionals.model_json_schema(by_alias=True))
    assert any(s.value.model_dump(exclude_unset=True) == {"note": "hi t"} for s in snapshots)
    homes = [s.value.home for s in snapshots if "home" in s.value.model_fields_set]
    assert all(isinstance(h, Address) for h in homes) and homes[0].model_fields_set == set()
    assert snapshots[-1].value.tags.root == [1, 2]


def test_json_schema_output_gives_dict_snapshots() -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "number"}, "l": {"type": "array"}}}
    text = '{"s": "hello", "n": 2.5, "l": [1, "x", {"k": null}]}'
    snapshots = snapshots_of(schema, text, 1)
    check_snapshots(snapshots, text, schema)
    assert {"s": "hel"} in [s.value for s in snapshots]


def test_a_value_that_fails_its_type_stays_out_of_the_snapshots() -> None:
    class Bounded(pydantic.BaseModel):
        small: int = pydantic.Field(le=5)
        name: str

    tracker = partial_tracker(Bounded)
    snapshot = tracker.feed('{"small": 9, "name": "x')
    assert snapshot is not None and snapshot.finished == () and snapshot.value.model_fields_set == {"name"}


def test_partial_refuses_outputs_that_are_not_json(llm: structgen.LLM) -> None:
    for output_type in (int, structgen.Regex("[a-z]+"), Literal["a", "b"], str):
        with pytest.raises(InvalidParameterError, match="needs a JSON output type"):
            llm.stream(output_type, "p", partial=True)


# -- the real model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(model_dir) -> structgen.LLM:
    from structgen.api import default_llm

    return default_llm()


class Book(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=40)
    year: int = pydantic.Field(ge=1000, le=2100)
    genre: Literal["novel", "poetry", "essay"]
    author: Address
    chapters: list[Address] = pydantic.Field(max_length=1)


def test_real_stream_of_a_nested_model_and_its_async_twin(llm: structgen.LLM) -> None:
    prompt = "Pride and Prejudice (1813), a novel; its author lives in Bath, zip 12345. Give JSON."
    stream = llm.stream(Book, prompt, max_tokens=100, partial=True)
    snapshots = list(stream)
    assert stream.completion is not None
    check_snapshots(snapshots, stream.completion.text, Book.model_json_schema(by_alias=True))
    assert snapshots[-1].value == stream.completion.value
    assert len(snapshots) > 5  # fields arrive one by one, not all at the end


def test_real_async_stream_gives_the_same_snapshots(llm: structgen.LLM) -> None:
    prompt = "Bath, zip 12345. Give JSON."
    snapshots = list(llm.stream(Address, prompt, max_tokens=30, partial=True))

    async def collect() -> tuple[list[Partial[Address]], Any]:
        astream = llm.astream(Address, prompt, max_tokens=30, partial=True)
        return [s async for s in astream], astream.completion

    async_snapshots, completion = asyncio.run(collect())
    assert [plain(s.value) for s in async_snapshots] == [plain(s.value) for s in snapshots]
    assert completion.value == snapshots[-1].value


def jme_rows(maskbench_dir: Any, ids: list[str]) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (maskbench_dir / "JME.jsonl").read_text().splitlines()]
    picked = [r for r in rows if r["id"] in ids]
    assert len(picked) == len(ids)
    return picked


@pytest.mark.parametrize(
    "ids", [["JME_11"], pytest.param(["JME_0", "JME_10", "JME_12", "JME_13", "JME_14"], marks=pytest.mark.slow)]
)
def test_real_streams_of_maskbench_jme_schemas(llm: structgen.LLM, maskbench_dir, ids: list[str]) -> None:
    for row in jme_rows(maskbench_dir, ids):
        prompt = f"Fill in this JSON example: {json.dumps(row['tests'][0]['data'])}"
        stream = llm.stream(row["schema"], prompt, max_tokens=250, partial=True)
        snapshots = list(stream)
        check_snapshots(snapshots, stream.completion.text, row["schema"])


def test_leaving_a_partial_stream_early_frees_the_request(llm: structgen.LLM) -> None:
    stream = llm.stream(Book, "A book as JSON.", max_tokens=120, partial=True)
    for snapshot in stream:
        if snapshot.finished:
            break
    del snapshot
    deadline = time.monotonic() + 10
    while llm.engine.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not llm.engine.scheduler.running
