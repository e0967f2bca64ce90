"""The merged 2020-12 metaschema (schema/metaschema.py) refuses what the original refuses, at
the same path with the same message, and accepts what it accepts."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from structgen.errors import InvalidConstraintError
from structgen.schema.metaschema import metaschema
from structgen.types import to_constraint

V = jsonschema.Draft202012Validator


def best_error(meta: dict[str, Any], schema: Any) -> tuple[tuple[Any, ...], str] | None:
    error = jsonschema.exceptions.best_match(V(meta).iter_errors(schema))
    return None if error is None else (tuple(error.path), error.message)


def objects(node: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object in `node`, itself first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from objects(value)
    elif isinstance(node, list):
        for value in node:
            yield from objects(value)


def same_verdict(schema: Any) -> tuple[tuple[Any, ...], str] | None:
    original, merged = best_error(V.META_SCHEMA, schema), best_error(metaschema(V), schema)
    assert merged == original, json.dumps(schema)[:300]
    return merged


INVALID = [
    {"type": "nope"},
    {"type": ["string", 3]},
    {"properties": {"a": {"minLength": -1}}},
    {"properties": {"a": {"items": {"maxItems": "3"}}}},
    {"$defs": {"x": {"type": 3}}, "$ref": "#/$defs/x"},
    {"definitions": {"x": {"enum": "a"}}},
    {"dependencies": {"a": 5}},
    {"dependentRequired": {"a": [1]}},
    {"dependentSchemas": {"a": {"required": "b"}}},
    {"prefixItems": [{"type": "string"}, {"multipleOf": 0}]},
    {"anyOf": []},
    {"oneOf": [{"not": {"pattern": 5}}]},
    {"if": {"const": 1}, "then": {"minimum": "0"}},
    {"patternProperties": {"^a": {"format": 7}}},
    {"additionalProperties": {"unevaluatedProperties": 3}},
    {"contentSchema": {"required": [1, 2]}},
    {"$anchor": "1bad"},
    {"required": ["a", "a"]},
    {"propertyNames": {"maxLength": 1.5}},
    {"contains": {"type": "string"}, "minContains": -2},
    [],
    "schema",
]

VALID = [
    {},
    True,
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]},
    {"$defs": {"n": {"type": ["null", "number"]}}, "items": {"$ref": "#/$defs/n"}, "prefixItems": [True]},
    {"dependencies": {"a": ["b"], "c": {"required": ["d"]}}, "title": "t", "examples": [1]},
    {"anyOf": [{"const": None}, {"enum": [1, "a", [2]]}], "x-custom": {"type": 5}},
]


@pytest.mark.parametrize("schema", INVALID, ids=lambda s: json.dumps(s)[:40])
def test_an_invalid_schema_is_refused_alike(schema: Any) -> None:
    assert same_verdict(schema) is not None


@pytest.mark.parametrize("schema", VALID, ids=lambda s: json.dumps(s)[:40])
def test_a_valid_schema_is_accepted_alike(schema: Any) -> None:
    assert same_verdict(schema) is None


def test_the_merged_metaschema_has_no_dynamic_references() -> None:
    merged = metaschema(V)
    nodes = list(objects(merged))
    assert all(node.get("$dynamicRef") != "#meta" for node in nodes)
    refs = [node.get("$ref", "#") for node in nodes]
    assert "allOf" not in merged and all(isinstance(r, dict) or r.startswith("#") for r in refs)
    assert "#" in refs and "#/$defs/schemaArray" in refs  # every reference local, to one document
    assert metaschema(jsonschema.Draft7Validator) is jsonschema.Draft7Validator.META_SCHEMA


def test_to_constraint_names_the_bad_keyword() -> None:
    with pytest.raises(InvalidConstraintError, match=r"#/properties/a/minLength: -1 is less than the minimum of 0"):
        to_constraint({"type": "object", "properties": {"a": {"type": "string", "minLength": -1}}})


def _mutated(schema: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """`schema` with one keyword of one of its objects set to a value of another type."""
    schema = copy.deepcopy(schema)
    node = rng.choice(list(objects(schema)))
    if node:
        node[rng.choice(list(node))] = rng.choice([123, "x", [], {}, -1, 1.5, None, True, [1], {"a": 1}])
    return schema


def test_maskbench_schemas_get_the_same_verdicts(maskbench_dir: Path) -> None:
    rng = random.Random(0)
    schemas = []
    for path in sorted(maskbench_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines()[::4]:  # a quarter keeps the test to seconds
            schema = json.loads(line)["schema"]
            schema = json.loads(schema) if isinstance(schema, str) else schema
            if isinstance(schema, dict) and jsonschema.validators.validator_for(schema, default=V) is V:
                schemas.append(schema)
    assert len(schemas) > 300
    refused = sum(same_verdict(s) is not None for s in schemas + [_mutated(s, rng) for s in schemas])
    assert refused > len(schemas) // 4  # the mutations are mostly refused: both sides were exercised


@pytest.mark.parametrize("declared", [True, 5, ["https://json-schema.org/draft/2020-12/schema"], {"a": 1}])
def test_a_schema_whose_schema_keyword_is_not_text_is_refused_by_name(declared: Any) -> None:
    with pytest.raises(InvalidConstraintError, match=r"\$schema must be the URI of a JSON Schema draft, as a string"):
        to_constraint({"$schema": declared, "type": "object"})
