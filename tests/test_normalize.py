"""The normalizer's rewrites (grammar/normalize.py, negate.py, disjoint.py) on real schema
shapes from MaskBench: each rewritten schema is compiled by "auto" on the real tokenizer, and
every probe instance is accepted exactly when `jsonschema` says the original schema is valid.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from structgen.grammar import candidate_backends, dump_json
from structgen.grammar.negate import negate_pattern
from structgen.grammar.normalize import normalize_schema
from structgen.types import JsonSchema, to_constraint

CASES = [
    (  # Github_trivial 90: overlapping open objects; each branch must exclude the other
        "one_of_overlapping_objects",
        {
            "type": "object",
            "oneOf": [
                {"properties": {"login": {"type": "string"}}, "required": ["login"]},
                {"properties": {"password": {"type": "string"}}, "required": ["password"]},
            ],
        },
        [{"login": "a"}, {"password": "b"}, {"login": "a", "password": "b"}, {}, {"login": 1}],
    ),
    (  # Github_trivial 5: closed branches; {} matches both, extra keys match neither
        "one_of_closed_objects",
        {
            "type": "object",
            "oneOf": [
                {"additionalProperties": False, "properties": {"next": {"type": "string"}}},
                {"additionalProperties": False, "properties": {"previous": {"type": "string"}}},
            ],
        },
        [{}, {"next": "x"}, {"previous": "y"}, {"next": "x", "previous": "y"}, {"next": 1}],
    ),
    (  # Snowplow 191 shape: $ref branches, a discriminator required by one branch only
        "one_of_refs_with_a_discriminator",
        {
            "$defs": {
                "a": {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                "b": {"type": "object", "properties": {"k": {"const": "b"}, "n": {"type": "integer"}}},
            },
            "oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}, {"type": "null"}],
        },
        [{"k": "a"}, {"k": "b"}, {}, {"n": 1}, {"k": "a", "n": "x"}, {"k": "a", "n": 1}, None, 1],
    ),
    (  # Github_medium 162 shape: an enum of arrays becomes prefixItems, negated per item
        "one_of_with_an_array_literal",
        {
            "oneOf": [
                {"type": "object", "properties": {"c": {"enum": [["deleted"]]}}, "required": ["c"]},
                {"type": "object", "properties": {"c": {"type": "array", "items": {"enum": ["size", "deleted"]}}}},
            ]
        },
        [{"c": ["deleted"]}, {"c": ["size"]}, {"c": []}, {}, {"c": ["deleted", "size"]}, {"c": ["x"]}],
    ),
    (  # Github_ultra 54: `not` of a one-class pattern
        "not_pattern",
        {"type": "string", "not": {"pattern": "^[.,*\\-\\s{}()]+$"}},
        ["a", "", "..", " ,", ".a.", "-"],
    ),
    (  # Github_easy 63: `not` of a searched class: no such character anywhere
        "not_searched_class",
        {"type": "string", "not": {"pattern": "[^a-z ]"}},
        ["ab c", "", "aB", "a1"],
    ),
    (  # Github_hard 18: propertyNames (llguidance refuses it) as listed keys
        "property_names_enum",
        {
            "type": "object",
            "propertyNames": {"enum": ["p10", "p50"]},
            "patternProperties": {".*": {"type": "number"}},
            "additionalProperties": False,
        },
        [{}, {"p10": 1}, {"p10": 1, "p50": 2.5}, {"p20": 1}, {"p10": "x"}],
    ),
    (  # JsonSchemaStore 12: propertyNames as a pattern for every key
        "property_names_pattern",
        {"type": "object", "propertyNames": {"pattern": "^[A-Za-z_]+$"}, "additionalProperties": {"type": "integer"}},
        [{}, {"ab": 1}, {"a1": 1}, {"ab": "x"}],
    ),
    (  # Github_ultra 78: minProperties on a closed object
        "min_max_properties_closed_object",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {}},
            "additionalProperties": False,
            "minProperties": 1,
            "maxProperties": 2,
        },
        [{}, {"a": 1}, {"b": 1, "c": 2}, {"a": 1, "b": 2, "c": 3}, {"d": 1}],
    ),
]


@pytest.mark.parametrize("name, schema, probes", CASES, ids=[c[0] for c in CASES])
def test_rewrite_is_enforced_and_exact(grammar_compiler, name, schema, probes):
    constraint = to_constraint(JsonSchema(schema))  # strict: some backend enforces all of it
    rewritten = json.loads(constraint.source)
    grammar = grammar_compiler.compile(constraint)
    validator = jsonschema.Draft202012Validator(schema)
    for value in probes:
        expected = validator.is_valid(value)
        assert jsonschema.Draft202012Validator(rewritten).is_valid(value) == expected, value
        assert grammar.accepts(dump_json(value, rewritten)) == expected, (grammar.backend, value)


def test_unknown_negations_are_left_alone():
    # "an item that is not a string" has no keyword: the oneOf stays, and is refused
    schema = {
        "type": "object",
        "oneOf": [
            {"properties": {"a": {"type": "array", "items": {"type": "string"}}}},
            {"required": ["b"]},
        ],
    }
    assert "oneOf" in json.loads(to_constraint(JsonSchema(schema), strict=False).source)
    assert negate_pattern("a1") is None and negate_pattern("^.+$") is None
    # propertyNames other than a pattern or an enum stays, and so does what stood next to it
    names = {"type": "object", "propertyNames": {"maxLength": 2}, "patternProperties": {".*": {"type": "integer"}}}
    assert normalize_schema(names) == names


def test_xgrammar_is_not_used_for_searched_patterns(grammar_compiler):
    """xgrammar matches `pattern` against the whole string; JSON Schema searches it."""
    searched = to_constraint(JsonSchema({"type": "string", "pattern": "[a-z]+"}))
    assert candidate_backends(searched) == ["llguidance"]
    g = grammar_compiler.compile(searched)
    assert g.accepts('"ab1"') and not g.accepts('"12"')
    whole = to_constraint(JsonSchema({"type": "string", "pattern": "^$|^[a-z]+$"}))
    assert candidate_backends(whole)[0] == "xgrammar"
