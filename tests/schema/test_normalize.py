"""The normalizer's rewrites (structgen/schema/normalize.py and the modules it calls: negate, disjoint,
refs, patterns, regex_dfa, arrays, numbers) on real schema shapes from MaskBench (each case
names the schema it comes from): each rewritten schema is compiled by "auto" on the real
tokenizer, and every probe instance is accepted exactly when `jsonschema` says the original
schema is valid. Also: what stays refused, and the key order `dump_json` writes.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from structgen.errors import InvalidConstraintError, UnsupportedSchemaError
from structgen.grammar import candidate_backends, dump_json
from structgen.schema.negate import negate_pattern
from structgen.schema.normalize import normalize_schema
from structgen.types import JsonSchema, to_constraint

NODE = {  # a recursive definition without a `type` of its own
    "properties": {
        "n": {"type": "integer"},
        "child": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}], "type": ["object", "null"]},
    },
    "additionalProperties": False,
}
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
    (  # WashingtonPost 0: llguidance refuses a recursive $ref it must merge "type" into
        "recursive_ref_with_sibling_type",
        {"$defs": {"node": NODE}, "anyOf": [{"$ref": "#/$defs/node"}], "type": "object"},
        [{}, {"n": 1}, {"child": {"n": 2}}, {"child": None}, {"child": {"child": {"n": 3}}},
         {"child": 5}, {"child": {"m": 1}}, None, "x"],
    ),
    (  # WashingtonPost 0 (credits): a listed key that a patternProperties regex also matches
        "pattern_properties_over_a_listed_key",
        {
            "$defs": {"node": NODE},
            "type": "object",
            "properties": {"by": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "patternProperties": {"^[a-z_]*": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        },
        [{}, {"by": []}, {"by": [{"n": 1}, {"n": 2}]}, {"by": [{}, {}, {}]}, {"photos_by": [{"n": 1}]},
         {"photos_by": [1]}, {"by": [{"child": {"n": 1}}]}, {"B": 1}],
    ),
    (  # WashingtonPost 0 (taxonomy): branches told apart by a key required in an allOf part
        "one_of_discriminator_in_all_of",
        {
            "$defs": {
                "section": {"type": "object", "properties": {"type": {"enum": ["section"]}}, "required": ["type"]},
                "reference": {"type": "object", "properties": {"type": {"enum": ["reference"]}, "id": {"type": "string"}}, "required": ["type", "id"]},
            },
            "oneOf": [
                {"$ref": "#/$defs/section"},
                {"allOf": [{"$ref": "#/$defs/reference"}, {"properties": {"id": {"minLength": 2}}}]},
            ],
        },
        [{"type": "section"}, {"type": "reference", "id": "ab"}, {"type": "reference", "id": "a"},
         {"type": "other"}, {}],
    ),
    (  # Github_ultra 32: an object with two required keys never has at most one key
        "one_of_disjoint_by_key_count",
        {
            "type": "object",
            "oneOf": [
                {"required": ["type", "url"], "properties": {"type": {"type": "string"}}},
                {"additionalProperties": {"enum": [False]}, "minProperties": 1, "maxProperties": 1},
            ],
        },
        [{"type": "vcs", "url": "u"}, {"x": False}, {"x": True}, {}, {"type": "a"}, {"type": 1, "url": 2}],
    ),
    (  # JsonSchemaStore 152: not a pattern negate_pattern's shapes do not cover
        "not_any_pattern",
        {"type": "string", "minLength": 1, "not": {"pattern": "//"}},
        ["a", "a/b", "a//b", "//", "", "/x/"],
    ),
    (  # Github_medium 124: oneOf two patterns that overlap (digit-only uuids match both)
        "one_of_overlapping_patterns",
        {
            "type": "string",
            "oneOf": [
                {"pattern": "^[0-9a-f]{4}-[0-9a-f]{2}$"},
                {"pattern": "^[0-9A-F]{4}-[0-9A-F]{2}$"},
            ],
        },
        ["abcd-ef", "ABCD-EF", "1234-56", "abCD-ef", "x"],
    ),
    (  # Github_medium 172: open object branches told apart by a discriminator overlap only
        # on non-objects (where both are vacuously true)
        "one_of_open_objects_with_a_discriminator",
        {
            "$defs": {
                "stage": {"properties": {"type": {"enum": ["stage"]}}, "required": ["type"]},
                "teaser": {"properties": {"type": {"enum": ["teaser"]}}, "required": ["type"], "additionalProperties": False},
            },
            "oneOf": [{"$ref": "#/$defs/stage"}, {"$ref": "#/$defs/teaser"}],
        },
        [{"type": "stage"}, {"type": "stage", "x": 1}, {"type": "teaser"}, {"type": "teaser", "x": 1}, "s", 1, {}],
    ),
    (  # JsonSchemaStore 30: a key that none of the (closed) branches in scope lists
        "one_of_with_closed_branches_in_scope",
        {
            "$defs": {
                "item": {"oneOf": [
                    {"type": "object", "properties": {"step": {"type": "string"}}, "additionalProperties": False},
                    {"type": "object", "properties": {"stage": {"type": "string"}}, "additionalProperties": False},
                ]},
            },
            "oneOf": [
                {"type": "object", "properties": {"variables": {"type": "array", "items": {"type": "string"}}}, "additionalProperties": False},
                {"$ref": "#/$defs/item"},
            ],
        },
        [{"variables": ["a"]}, {"step": "s"}, {"stage": "t"}, {}, {"step": "s", "stage": "t"}, {"variables": [1]}],
    ),
    (  # Handwritten 17: `not` of a `not` gives the original patterns back
        "double_negation",
        {
            "type": "string",
            "$defs": {"n": {"not": {"anyOf": [{"pattern": "ab1"}, {"pattern": "b12"}]}}},
            "not": {"$ref": "#/$defs/n"},
            "maxLength": 8,
        },
        ["ab1", "xb12", "abc", "", "ab"],
    ),
    (  # JsonSchemaStore 45, 49: a leading negative lookahead, `$` inside a pattern
        "lookahead_and_inner_anchor",
        {
            "type": "object",
            "properties": {
                "main": {"type": "string", "pattern": "^(?!org\\.bukkit\\.)[a-z.]+$"},
                "list": {"type": "string", "pattern": "^([^,]+(,|$)){2,}$"},
            },
        },
        [{"main": "org.x"}, {"main": "org.bukkit.x"}, {"list": "a,b"}, {"list": "a"}, {"list": "a,b,"}],
    ),
    (  # Handwritten 10: a string schema combining patterns with anyOf / not / $ref
        "string_patterns_combined",
        {
            "type": "string",
            "$defs": {"start": {"anyOf": [{"pattern": "^a"}, {"pattern": "^b"}]}},
            "allOf": [{"$ref": "#/$defs/start"}, {"not": {"pattern": "x$"}}],
        },
        ["ab", "ax", "cb", "b", "bx", ""],
    ),
    (  # Handwritten 9: bounded numbers on a grid are listed, then filtered (here by a `not`)
        "bounded_numbers_on_a_grid",
        {
            "type": "number",
            "exclusiveMinimum": -30,
            "exclusiveMaximum": 0,
            "anyOf": [{"multipleOf": 4}, {"multipleOf": 6}],
            "not": {"multipleOf": 12},
        },
        [-4, -6, -12, -24, -8, -18, 5, -3, 0, -32, -4.5, "x"],
    ),
    (  # brief of issue #2: unique arrays of a small enum are listed
        "unique_items_of_an_enum",
        {"type": "array", "items": {"enum": ["GET", "PUT", "POST"]}, "uniqueItems": True, "minItems": 1},
        [["GET"], ["GET", "PUT"], ["POST", "PUT", "GET"], ["GET", "GET"], [], ["HEAD"]],
    ),
    (  # JsonSchemaStore 245 (availabilities): at most one item is always unique
        "unique_items_of_at_most_one",
        {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 1},
        [[], ["a"], ["a", "a"]],
    ),
    (  # contains, in an array of at most three items
        "contains_in_a_bounded_array",
        {"type": "array", "items": {"type": ["string", "integer"]}, "contains": {"type": "integer"}, "maxItems": 3},
        [[1], ["a", 2], ["a", "b", 3], ["a"], [], ["a", "b"], [1, 2, 3, 4]],
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
    # "an item that is not a string" has no keyword: the oneOf stays in the exact rewrite
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


TIGHTENED = [
    (  # Snowplow 191 (auth): open objects that may overlap; "not an integer" has no keyword
        {
            "type": "object",
            "properties": {"auth": {"oneOf": [
                {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
                {"type": "object", "properties": {"secs": {"type": "integer", "minimum": 900}},
                 "required": ["secs"]},
                {"type": "null"},
            ]}},
            "required": ["auth"],
        },
        [{"auth": None}, {"auth": {"key": "k"}}, {"auth": {"secs": 900}}],  # kept
        [{"auth": {"key": "k", "secs": 1000.5}}],  # valid, lost: secs is a non-integer number
        [{"auth": {"key": "k", "secs": 900}}, {"auth": {}}, {"auth": 1}],  # invalid
    ),
    (  # an item that is not a string has no keyword; "a is not an array" is kept
        {
            "type": "object",
            "oneOf": [
                {"properties": {"a": {"type": "array", "items": {"type": "string"}}}},
                {"required": ["b"]},
            ],
        },
        [{"a": ["x"]}, {}, {"b": 1, "a": "s"}],
        [{"b": 1, "a": [1]}],
        [{"b": 1}, {"a": ["x"], "b": 1}, {"a": [1]}],
    ),
    (  # if/then/else with an unknown "not if": then-and-else instances are kept too
        {
            "type": "object",
            "if": {"properties": {"n": {"type": "integer"}}, "required": ["n"]},
            "then": {"required": ["i"]},
            "else": {"required": ["e"]},
        },
        [{"n": 1, "i": 0}, {"i": 0, "e": 0}, {"e": 0}, {"n": "x", "e": 0}],
        [{"n": 1.5, "e": 0}],
        [{"n": 1}, {"n": 1, "e": 0}, {}],
    ),
]


@pytest.mark.parametrize("schema, kept, lost, invalid", TIGHTENED)
def test_unknown_negations_fall_back_to_a_stricter_schema(
    grammar_compiler, schema, kept, lost, invalid
):
    """Where an exact rewrite needs a negation `negate` does not know, the constraint carries
    a stricter fallback (a subset of the needed negation) that the compiler uses when every
    backend refuses the exact one: every output stays valid, some valid ones are lost."""
    constraint = to_constraint(JsonSchema(schema))
    assert constraint.fallback is not None
    grammar = grammar_compiler.compile(constraint)
    assert grammar.constraint.source == constraint.fallback.source
    validator = jsonschema.Draft202012Validator(schema)
    rewritten = json.loads(grammar.constraint.source)
    for values, accepted in ((kept, True), (lost, False), (invalid, False)):
        for value in values:
            assert validator.is_valid(value) == (values is not invalid), value
            assert grammar.accepts(dump_json(value, rewritten)) == accepted, value


def test_exact_rewrite_is_tried_before_the_fallback(grammar_compiler):
    """llguidance proves some `oneOf` disjoint where `disjoint.py` cannot (Github_ultra 25:
    tightening it instead grew the schema past llguidance's size limit)."""
    from structgen.types import Constraint

    stricter = Constraint("json_schema", json.dumps({"type": "string"}))
    exact = json.dumps({"oneOf": [{"type": "string"}, {"type": "integer"}]})  # left as is
    grammar = grammar_compiler.compile(Constraint("json_schema", exact, fallback=stricter))
    assert grammar.backend == "llguidance" and grammar.accepts("5") and grammar.accepts('"s"')


def test_not_property_names_is_some_named_key(grammar_compiler):
    """Handwritten 32 / 86: `not {propertyNames: not {enum}}` is "one of these keys is there"."""
    schema = {"type": "object", "not": {"propertyNames": {"not": {"enum": ["1", "3"]}}}}
    constraint = to_constraint(JsonSchema(schema))
    assert constraint.fallback is None  # exact
    grammar = grammar_compiler.compile(constraint)
    for value in ({"1": 0}, {"3": 0, "x": 1}, {"x": 1}, {}):
        expected = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert grammar.accepts(dump_json(value, json.loads(constraint.source))) == expected


def test_xgrammar_is_kept_from_strings_it_would_write_as_invalid_json(grammar_compiler):
    """xgrammar lets a length-bounded string hold raw control characters (and allows no escape
    there: Github_hard 242, an HTML snippet in a `minLength: 1` string), and writes a literal
    quote or backslash of a pattern unescaped (`^"a"$` accepted `""a""`)."""
    bounded = {"type": "object", "properties": {"html": {"type": "string", "minLength": 1}}}
    for schema in (bounded, {"type": "string", "pattern": '^"a"$'}, {"type": "string", "pattern": r"^a\\b$"}):
        constraint = to_constraint(JsonSchema(schema))
        assert candidate_backends(constraint) == ["llguidance"], schema
        with pytest.raises(UnsupportedSchemaError, match="invalid JSON"):
            grammar_compiler.compile(constraint, backend="xgrammar")
    grammar = grammar_compiler.compile(to_constraint(JsonSchema(bounded)))
    assert grammar.accepts(dump_json({"html": '<a href="x">\n</a>'}, bounded))
    assert not grammar.accepts('{"html": "a\x01b"}')  # a raw control character: not JSON
    quoted = grammar_compiler.compile(to_constraint(JsonSchema({"type": "string", "pattern": '^"a"$'})))
    assert quoted.accepts(r'"\"a\""') and not quoted.accepts('""a""')
    classes = to_constraint(JsonSchema({"type": "array", "items": {"type": "string", "pattern": '^[^"]+$'}}))
    assert candidate_backends(classes)[0] == "xgrammar"  # a class leaves the quote out: sound


def test_xgrammar_is_not_used_for_searched_patterns(grammar_compiler):
    """xgrammar matches `pattern` against the whole string; JSON Schema searches it."""
    searched = to_constraint(JsonSchema({"type": "string", "pattern": "[a-z]+"}))
    assert candidate_backends(searched) == ["llguidance"]
    g = grammar_compiler.compile(searched)
    assert g.accepts('"ab1"') and not g.accepts('"12"')
    whole = to_constraint(JsonSchema({"type": "string", "pattern": "^$|^[a-z]+$"}))
    assert candidate_backends(whole)[0] == "xgrammar"


def test_what_stays_refused():
    # uniqueItems over strings, and contains in an unbounded array: no grammar can
    for schema in (
        {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        {"type": "array", "contains": {"type": "integer"}},
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3},
        {"type": "integer", "minimum": 0, "not": {"multipleOf": 3}},  # unbounded: not finite
    ):
        with pytest.raises(UnsupportedSchemaError) as e:
            to_constraint(JsonSchema(schema))
        assert e.value.keyword in ("uniqueItems", "contains", "not")
    # too many unique arrays to list (6 values: 1,957 arrays) stays uniqueItems
    many = {"type": "array", "items": {"enum": list("abcdef")}, "uniqueItems": True}
    assert normalize_schema(many)["uniqueItems"] is True


@pytest.mark.parametrize(
    "schema",
    [
        {"additionalProperties": False, "allOf": [{"properties": {"s": {}}}], "properties": {"a": {}, "s": {}}},
        {"allOf": [{"properties": {"s": {}}}], "properties": {"a": {}, "s": {}}},
        {"properties": {"a": {}}, "patternProperties": {"^r": {}}, "required": ["r1", "r2"]},
    ],
    ids=["own_properties_first", "all_of_first", "required_after_properties"],
)
def test_dump_json_writes_keys_in_llguidance_order(grammar_compiler, schema):
    """JsonSchemaStore 60 / 158, Github_hard 14: the order llguidance merges keys in."""
    schema = {"type": "object", **schema}
    grammar = grammar_compiler.compile(to_constraint(JsonSchema(schema)), backend="llguidance")
    value = {"x": 1, "r2": 2, "s": 3, "a": 4, "r1": 5} if "required" in schema else {"s": 1, "a": 2}
    if schema.get("additionalProperties") is False:
        value = {"s": 1, "a": 2}
    assert grammar.accepts(dump_json(value, schema)), dump_json(value, schema)


def test_a_20000_value_enum_normalizes_in_linear_time():
    values = [f"value-{i}" for i in range(20_000)]
    start = time.perf_counter()
    normalized = normalize_schema({"type": "string", "enum": values})
    assert time.perf_counter() - start < 3.0
    assert normalized["enum"] == values


def test_enum_values_are_still_filtered_by_their_sibling_keywords():
    assert normalize_schema({"type": "string", "maxLength": 2, "enum": ["ab", "abc", 3]}) == {"enum": ["ab"]}


@pytest.mark.parametrize(("schema", "chain", "where"), [
    ({"$ref": "#"}, "# -> #", "#"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/r"}}, "$defs": {"r": {"$ref": "#/$defs/r"}}},
     "#/$defs/r -> #/$defs/r", "#/properties/a"),
    ({"type": "array", "items": {"$ref": "#/$defs/r"}, "$defs": {"r": {"$ref": "#/$defs/s", "title": "R"},
                                                               "s": {"description": "S", "$ref": "#/$defs/r"}}},
     "#/$defs/r -> #/$defs/s -> #/$defs/r", "#/items"),
])
def test_a_ref_loop_with_no_schema_on_it_is_refused_naming_it(schema: dict, chain: str, where: str) -> None:
    """Nothing on the loop constrains anything, so no value takes it and a validator never
    finishes evaluating it: refused before any compile (llguidance compiled such a loop under
    a property, and the matcher found no token mid-output: an engine failure, a 500)."""
    with pytest.raises(InvalidConstraintError, match=re.escape(f"$ref chain at {where} ({chain})")):
        to_constraint(JsonSchema(schema))


def test_a_ref_loop_through_a_schema_is_a_recursive_type_not_a_refusal() -> None:
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    through = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/a"}]}}}
    for schema in (tree, through):
        assert to_constraint(JsonSchema(schema)).kind == "json_schema"


def test_a_tools_parameters_ref_loop_is_refused_when_the_request_is_built() -> None:
    from structgen import tool_format

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}]
    for choice in ("required", "auto"):
        resolved = tool_format.resolve_tool_choice(choice, tools)
        with pytest.raises(InvalidConstraintError, match=r"\$ref chain"):
            to_constraint(tool_format.tool_output_type(tools, resolved, True))
