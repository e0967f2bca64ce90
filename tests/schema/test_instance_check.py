"""The compiled instance check agrees with jsonschema wherever it compiles a schema."""

from __future__ import annotations

import json
import math
import random
import warnings
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from structgen.errors import OutputValidationError
from structgen.schema.instance_check import instance_check
from structgen.types import JsonSchema, to_constraint

D4 = "http://json-schema.org/draft-04/schema#"
D7 = "http://json-schema.org/draft-07/schema#"


def _validator(schema: dict) -> type:
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


def _agree(schema: dict, instances: list[Any]) -> None:
    cls = _validator(schema)
    check = instance_check(schema, cls)
    assert check is not None, "expected the schema to compile"
    for x in instances:
        assert check(x) == cls(schema).is_valid(x), (schema, x)


# Each: a schema and instances on both sides of what its keywords decide (jsonschema is the
# oracle: the expected verdicts are its own).
EDGE_CASES = [
    ({"type": "integer"}, [1, 1.0, 1.5, True, "1", None, 10**30, float("inf")]),
    ({"$schema": D4, "type": "integer"}, [1, 1.0, True]),
    ({"type": "number"}, [1, 1.5, True, False, "2", float("nan")]),
    ({"type": ["string", "null"]}, ["a", None, 0, [], {}]),
    ({"enum": [1, "a", None, True]}, [1, 1.0, True, False, 0, "a", "A", None, [1], {"a": 1}]),
    ({"enum": [0, False]}, [0, 0.0, False, True, 1]),
    ({"const": 2}, [2, 2.0, True, "2"]),
    ({"const": False}, [False, 0, None]),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]},
     [{"a": "x", "b": 1}, {"a": 1, "b": 1}, {"a": "x"}, [], "s"]),
    ({"properties": {"a": {"type": "integer"}}, "patternProperties": {"^x_": {"type": "string"}},
      "additionalProperties": {"type": "boolean"}},
     [{"a": 1, "x_1": "s", "y": True}, {"x_1": 1}, {"y": 1}, {"a": 1.5}, {"xx": False}]),
    ({"additionalProperties": False, "properties": {"a": {}}, "patternProperties": {"b|c": {}}},
     [{"a": 1}, {"abc": 1}, {"d": 1}, {}]),
    ({"minProperties": 1, "maxProperties": 2}, [{}, {"a": 1}, {"a": 1, "b": 2, "c": 3}, []]),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
     [[], [1], [1, 2], [1, 2, 3], [1, "2"], "12"]),
    ({"items": False}, [[], [1], {}]),
    ({"uniqueItems": False, "items": True}, [[1, 1]]),
    ({"type": "string", "minLength": 2, "maxLength": 3, "pattern": "[0-9]"},
     ["1a", "a", "abcd", "ab", "\U0001f600\U0001f6001", 5]),
    ({"minimum": 1, "exclusiveMaximum": 3}, [1, 0.999, 2.9, 3, 3.0, "x", True]),
    ({"$schema": D4, "minimum": 1, "exclusiveMinimum": True, "maximum": 3}, [1, 1.5, 3, 3.5]),
    ({"$schema": D4, "const": 1, "type": "integer"}, [1, 2]),  # draft 4 has no const: ignored
    ({"anyOf": [{"type": "string"}, {"minimum": 5}]}, ["a", 6, 4, None]),
    ({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, [1, 3, 2.5, "x"]),
    ({"allOf": [{"type": "integer"}, {"minimum": 2}], "not": {"const": 3}}, [2, 3, 4, 1, 2.5]),
    # Drafts 4-7 ignore a $ref's siblings; 2019-09 and later apply both.
    ({"$schema": D7, "definitions": {"s": {"type": "string"}}, "$ref": "#/definitions/s", "maxLength": 1},
     ["a", "abc", 1]),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 1}, ["a", "abc", 1]),
    # A recursive tree through "#".
    ({"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
      "required": ["v"]},
     [{"v": 1}, {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}, {"v": 1, "kids": [{"v": "x"}]}, {"kids": []}]),
    ({"format": "email", "x-vendor": {"anything": 1}, "nullable": True}, ["not an email", 3]),
]


@pytest.mark.parametrize("schema,instances", EDGE_CASES)
def test_the_check_agrees_with_jsonschema_on_each_keywords_edges(schema: dict, instances: list[Any]):
    _agree(schema, instances)


def test_nan_equals_nothing_in_an_enum_as_in_jsonschema():
    nan = float("nan")
    _agree({"enum": [nan, 1]}, [float("nan"), 1, math.inf])


@pytest.mark.parametrize("schema", [
    {"multipleOf": 3},
    {"if": {"type": "string"}, "then": {"minLength": 2}},
    {"prefixItems": [{"type": "string"}]},
    {"uniqueItems": True},
    {"$schema": D7, "items": [{"type": "string"}]},
    {"properties": {"a": {"$id": "http://example.com/a", "type": "string"}}},
    {"$ref": "http://example.com/schema.json"},
    {"$ref": "#/$defs/missing"},
    {"enum": [[1, 2], {"a": 1}]},
    {"type": "integer", "dependentRequired": {"a": ["b"]}},
    {"$schema": "http://json-schema.org/draft-03/schema#", "type": "string"},
])
def test_schemas_outside_the_covered_keywords_get_no_check(schema: dict):
    assert instance_check(schema, _validator(schema)) is None


def test_outputs_are_still_validated_where_the_schema_is_not_covered():
    constraint = to_constraint(JsonSchema({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}},
                                           "required": ["n"]}), strict=False)
    assert constraint.parse('{"n": 6}') == {"n": 6}
    with pytest.raises(OutputValidationError, match="multiple of 3"):
        constraint.parse('{"n": 7}')


def test_an_invalid_output_gets_jsonschemas_message_where_the_check_compiles():
    constraint = to_constraint({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}},
                                "required": ["age"]})
    assert constraint.parse('{"age": 3}') == {"age": 3}
    with pytest.raises(OutputValidationError, match=r"at #/age: -1 is less than the minimum of 0"):
        constraint.parse('{"age": -1}')


def test_a_ref_cycle_that_consumes_nothing_falls_to_jsonschema():
    schema = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    check = instance_check(schema, jsonschema.Draft202012Validator)
    assert check is not None
    with pytest.raises(RecursionError):
        check(1)


# -- MaskBench: every schema the check compiles, on its own test instances and mutations ---------
_LEAVES = [None, True, False, 0, 1, -1, 1.0, 2.5, "", "a", "1", 10**20, float("nan"), [], {}]


def _mutation(x: Any, rng: random.Random) -> Any:
    """`x` with one change somewhere: a key dropped or added, an item dropped or added, a
    number or string nudged, or a value replaced by a leaf of another type."""
    if isinstance(x, dict) and x and rng.random() < 0.6:
        key, y = rng.choice(list(x)), dict(x)
        op = rng.random()
        if op < 0.3:
            del y[key]
        elif op < 0.5:
            y[f"extra_{rng.randint(0, 3)}"] = rng.choice(_LEAVES)
        else:
            y[key] = _mutation(x[key], rng)
        return y
    if isinstance(x, list) and x and rng.random() < 0.6:
        y, i = list(x), rng.randrange(len(x))
        op = rng.random()
        if op < 0.3:
            del y[i]
        elif op < 0.5:
            y.append(rng.choice(y + _LEAVES))
        else:
            y[i] = _mutation(y[i], rng)
        return y
    if isinstance(x, (int, float)) and not isinstance(x, bool) and rng.random() < 0.7:
        return rng.choice([x + 1, x - 1, float(x), -x, x + 0.5, True])
    if isinstance(x, str) and rng.random() < 0.7:
        return rng.choice([x + "z", x[:-1], x.upper(), "", x * 3])
    return rng.choice(_LEAVES)


def test_the_check_agrees_with_jsonschema_on_maskbench(maskbench_dir: Path):
    rng = random.Random(0)
    compiled = cases = 0
    for path in sorted(maskbench_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            schema = record["schema"]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # unknown $schema URIs
                cls = _validator(schema)
                try:
                    cls.check_schema(schema)
                except jsonschema.SchemaError:
                    continue
            check = instance_check(schema, cls)
            if check is None:
                continue
            compiled += 1
            validator = cls(schema)
            for test in record.get("tests", []):
                for x in [test["data"]] + [_mutation(test["data"], rng) for _ in range(4)]:
                    cases += 1
                    assert check(x) == validator.is_valid(x), (record["id"], json.dumps(x)[:300])
    assert compiled > 2000 and cases > 20000  # most of the corpus is covered
