"""Output type -> Constraint: every supported type, the parse/validation path, error messages.
No tokenizer needed; grammar-level behaviour is in grammar/test_grammar.py."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import warnings
from typing import Annotated, Literal

import pydantic
import pytest
from pydantic import Field, conint, constr
from typing_extensions import TypedDict  # pydantic needs it on Python < 3.12

from structgen.errors import (
    InvalidConstraintError,
    OutputValidationError,
    StructgenWarning,
    UnsatisfiableConstraintError,
    UnsupportedSchemaError,
    UnsupportedTypeError,
)
from structgen.types import CFG, Choice, Constraint, JsonSchema, Regex, to_constraint


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Address(pydantic.BaseModel):
    street: str
    zip: constr(pattern=r"^[0-9]{5}$")  # type: ignore[valid-type]


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: conint(ge=0, le=9)  # type: ignore[valid-type]


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    good: bool


class Invoice(pydantic.BaseModel):
    id: str = Field(pattern=r"^INV-\d{4}$")
    total: float = Field(ge=0)
    items: list[str] = Field(max_length=3)
    color: Color
    address: Address | None = None
    pet: Cat | Dog
    counts: dict[str, int] = {}


INVOICE = {
    "id": "INV-0001",
    "total": 12.5,
    "items": ["a", "b"],
    "color": "red",
    "address": {"street": "Main", "zip": "12345"},
    "pet": {"kind": "cat", "lives": 7},
    "counts": {"x": 1},
}


def test_pydantic_model_schema_is_closed_and_ordered():
    c = to_constraint(Invoice)
    assert c.kind == "json_schema" and c.strict
    schema = json.loads(c.source)
    assert list(schema["properties"]) == [
        "id",
        "total",
        "items",
        "color",
        "address",
        "pet",
        "counts",
    ]
    assert schema["additionalProperties"] is False  # the model may not invent keys
    assert schema["$defs"]["Address"]["additionalProperties"] is False
    assert schema["properties"]["counts"]["additionalProperties"] == {"type": "integer"}
    assert "Invoice" in c.description


def test_pydantic_parse_returns_validated_instance():
    c = to_constraint(Invoice)
    value = c.parse(json.dumps(INVOICE))
    assert isinstance(value, Invoice)
    assert value.color is Color.RED and isinstance(value.pet, Cat) and value.address.zip == "12345"


@pytest.mark.parametrize(
    "change",
    [{"id": "INV-1"}, {"total": -1}, {"items": ["a"] * 4}, {"pet": {"kind": "cat", "lives": 10}}],
)
def test_pydantic_parse_rejects_invalid(change):
    c = to_constraint(Invoice)
    text = json.dumps({**INVOICE, **change})
    with pytest.raises(OutputValidationError) as e:
        c.parse(text)
    assert e.value.text == text
    assert "Invoice" in str(e.value)


def test_parse_rejects_non_json():
    with pytest.raises(OutputValidationError):
        to_constraint(Invoice).parse('{"id": ')


def test_field_constraints_reach_the_schema():
    c = to_constraint(Invoice)
    props = json.loads(c.source)["properties"]
    assert props["id"]["pattern"] == r"^INV-\d{4}$"
    assert props["total"]["minimum"] == 0
    assert props["items"]["maxItems"] == 3


def test_dataclass_and_typeddict():
    @dataclasses.dataclass
    class Point:
        x: int
        y: int = 0

    class Movie(TypedDict):
        title: str
        year: int

    p = to_constraint(Point).parse('{"x": 1, "y": 2}')
    assert p == Point(1, 2)
    m = to_constraint(Movie).parse('{"title": "Alien", "year": 1979}')
    assert m == {"title": "Alien", "year": 1979}
    with pytest.raises(OutputValidationError):
        to_constraint(Movie).parse('{"title": "Alien"}')


def test_containers_and_optional_at_top_level():
    assert to_constraint(list[int]).parse("[1, 2]") == [1, 2]
    assert to_constraint(int | None).parse("null") is None
    assert to_constraint(dict[str, float]).parse('{"a": 1.5}') == {"a": 1.5}
    assert to_constraint(Annotated[int, Field(ge=3)]).kind == "json_schema"


@pytest.mark.parametrize(
    "typ, text, value",
    [
        (int, "-12", -12),
        (int, "0", 0),
        (float, "1.5e3", 1500.0),
        (bool, "true", True),
        (bool, "false", False),
    ],
)
def test_scalars_are_regexes(typ, text, value):
    c = to_constraint(typ)
    assert c.kind == "regex" and re.fullmatch(c.source, text)
    assert c.parse(text) == value and type(c.parse(text)) is typ


@pytest.mark.parametrize(
    "typ, text", [(int, "01"), (int, "1_000"), (int, " 1"), (float, "1."), (bool, "True")]
)
def test_scalar_parse_is_strict(typ, text):
    with pytest.raises(OutputValidationError):
        to_constraint(typ).parse(text)


def test_plain_str_is_unconstrained_text():
    c = to_constraint(str)
    assert (c.kind, c.source) == ("text", "")
    assert c.parse("anything at all\n") == "anything at all\n"


def test_json_schema_dict_and_text():
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1}},
        "required": ["n"],
    }
    for spec in (schema, json.dumps(schema)):
        c = to_constraint(JsonSchema(spec))
        assert c.kind == "json_schema"
        assert c.parse('{"n": 2}') == {"n": 2}
        with pytest.raises(OutputValidationError, match="#/n"):
            c.parse('{"n": 0}')
    assert to_constraint(JsonSchema(True)).parse("[1]") == [1]


def test_json_schema_errors_name_the_problem():
    with pytest.raises(InvalidConstraintError, match="line 1 column"):
        to_constraint(JsonSchema('{"type": '))
    with pytest.raises(InvalidConstraintError, match="#/properties/a"):
        to_constraint(JsonSchema({"properties": {"a": {"type": "integr"}}}))
    with pytest.raises(InvalidConstraintError, match="#/definitions/nope"):
        to_constraint(JsonSchema({"properties": {"a": {"$ref": "#/definitions/nope"}}}))
    with pytest.raises(InvalidConstraintError, match="admits no value"):
        to_constraint(JsonSchema({"allOf": [{"const": 1}, {"const": 2}]}))
    with pytest.raises(InvalidConstraintError):
        to_constraint(JsonSchema(["not", "a", "schema"]))
    # a value listed twice in an enum is harmless (draft 4 forbids it; Github_ultra 3 does it)
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "enum": ["GB", "AF", "GB"]}
    assert json.loads(to_constraint(JsonSchema(draft4)).source)["enum"] == ["GB", "AF"]


def test_a_python_set_needs_no_unique_items_since_pydantic_merges_repeats():
    from typing import Annotated

    from pydantic import BaseModel, Field

    class Tagged(BaseModel):
        tags: set[str]

    for tp, text, value in ((set[str], '["a", "b", "a"]', {"a", "b"}), (frozenset[int], "[1, 1]", frozenset({1})),
                            (Tagged, '{"tags": ["x", "x"]}', Tagged(tags={"x"}))):
        c = to_constraint(tp)
        assert "uniqueItems" not in c.source and c.parse(text) == value
    with pytest.raises(UnsupportedSchemaError, match="uniqueItems"):  # repeats could leave it short of 2
        to_constraint(Annotated[set[str], Field(min_length=2)])


def test_unenforceable_schema_names_keyword_and_path():
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(UnsupportedSchemaError) as e:
        to_constraint(JsonSchema(schema))
    assert (e.value.keyword, e.value.path) == ("uniqueItems", "#/properties/tags")
    assert "strict=False" in str(e.value)
    loose = to_constraint(JsonSchema(schema), strict=False)  # best effort, validated afterwards
    assert not loose.strict and loose.key != to_constraint(JsonSchema({})).key
    with pytest.raises(OutputValidationError):
        loose.parse('{"tags": [1, 1]}')


def test_schemas_are_normalized_for_the_backends():
    # finite: allOf[enum, not] keeps only the values the whole schema admits
    c = to_constraint(JsonSchema({"allOf": [{"enum": [1, 2, 3]}, {"not": {"const": 2}}]}))
    assert json.loads(c.source) == {"enum": [1, 3]}
    assert c.parse("1") == 1
    with pytest.raises(OutputValidationError):
        c.parse("2")  # validated against the user's schema, not the rewritten one
    # dependentRequired becomes anyOf[key absent, key and its dependencies present]
    dep = {"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}}
    rewritten = json.loads(to_constraint(JsonSchema(dep)).source)
    assert "dependentRequired" not in rewritten
    assert rewritten["allOf"] == [
        {"anyOf": [{"properties": {"a": False}}, {"required": ["a", "b"]}]}
    ]
    # not {minimum} is a bound of the opposite kind
    neg = json.loads(to_constraint(JsonSchema({"type": "integer", "not": {"minimum": 3}})).source)
    assert neg == {"type": "integer", "allOf": [{"type": "number", "exclusiveMaximum": 3}]}
    # enum objects become their structure (so they are written in our JSON format)
    obj = json.loads(to_constraint(JsonSchema({"const": {"a": [1]}})).source)
    assert obj["properties"]["a"]["prefixItems"] == [{"const": 1}]
    # drafts 4-7 ignore keywords next to $ref, so the rewrite drops them
    d7 = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"s": {"type": "string"}},
        "properties": {"k": {"$ref": "#/definitions/s", "enum": ["a"]}},
    }
    assert json.loads(to_constraint(JsonSchema(d7)).source)["properties"]["k"] == {
        "$ref": "#/definitions/s"
    }


@pytest.mark.parametrize(
    "schema",
    [
        {"not": {"enum": ["ab", "a", "b-c", 1, True, None]}},
        {"not": {"const": 2.5}},
        {"type": "object", "not": {"required": ["a", "b"]}},
        {"not": {"type": ["array", "object", "null"]}},
        {
            "if": {"properties": {"k": {"const": "x"}}},
            "then": {"required": ["a"]},
            "else": {"required": ["b"]},
        },
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "dependencies": {"a": {"required": ["b"]}},
        },
        {"allOf": [{"enum": [1, "a", [1], {"k": 2}]}, {"not": {"type": "string"}}]},
    ],
)
def test_normalization_keeps_the_valid_instances(schema):
    """The rewritten schema accepts exactly what the original does (checked with jsonschema
    on probe values; test_maskbench does the same on real test instances)."""
    import jsonschema

    rewritten = json.loads(to_constraint(JsonSchema(schema)).source)
    probes = ["", "a", "ab", "abc", "b-c", "b", 0, 1, 2.5, 3, True, False, None, [], [1], {}]
    probes += [
        {"k": 2},
        {"a": 1},
        {"b": 1},
        {"a": 1, "b": 2},
        {"k": "x", "a": 1},
        {"k": "x"},
        {"k": "y"},
    ]
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    for value in probes:
        expected = validator(schema).is_valid(value)
        assert validator(rewritten).is_valid(value) == expected, value


def test_regex():
    c = to_constraint(Regex(r"[a-z]+-\d{2}"))
    assert (c.kind, c.source) == ("regex", r"[a-z]+-\d{2}")
    assert c.parse("ab-12") == "ab-12"
    with pytest.raises(OutputValidationError):
        c.parse("ab-12x")  # must match fully
    with pytest.raises(InvalidConstraintError, match="position 3"):
        to_constraint(Regex("abc(d"))
    with pytest.raises(InvalidConstraintError):
        to_constraint(Regex(""))


def test_cfg_syntax_detection():
    ebnf = to_constraint(CFG('root ::= "a" rest\nrest ::= [b-z]*'))
    lark = to_constraint(CFG('start: "a" REST\nREST: /[b-z]*/'))
    assert (ebnf.kind, ebnf.syntax) == ("grammar", "ebnf")
    assert (lark.kind, lark.syntax) == ("grammar", "lark")
    assert to_constraint(CFG("start: x", syntax="ebnf")).syntax == "ebnf"  # explicit wins
    assert ebnf.parse("abc") == "abc"
    with pytest.raises(InvalidConstraintError):
        to_constraint(CFG("root ::= x", syntax="bnf"))  # type: ignore[arg-type]


def test_choice_and_top_level_literal_and_enum():
    c = to_constraint(Choice(["a.b", "c|d", "e(f)"]))
    assert c.kind == "regex"
    for option in ("a.b", "c|d", "e(f)"):
        assert re.fullmatch(c.source, option) and c.parse(option) == option
    assert not re.fullmatch(c.source, "axb")  # metacharacters are escaped
    lit = to_constraint(Literal["yes", "no", 3, None])
    assert lit.parse("3") == 3 and lit.parse("null") is None and lit.parse("no") == "no"
    assert to_constraint(Color).parse("green") is Color.GREEN
    assert to_constraint(Priority).parse("2") is Priority.HIGH
    with pytest.raises(OutputValidationError):
        to_constraint(Color).parse("blue")


def test_choice_errors():
    with pytest.raises(InvalidConstraintError, match="at least one"):
        to_constraint(Choice([]))
    with pytest.raises(InvalidConstraintError, match="both written '1'"):
        to_constraint(Choice(["1", 1]))
    with pytest.raises(InvalidConstraintError):
        to_constraint(Choice([["nested"]]))


def test_unsupported_type():
    class Plain:
        pass

    with pytest.raises(UnsupportedTypeError, match="Plain"):
        to_constraint(Plain)


def test_constraint_key_identifies_the_grammar():
    class A(pydantic.BaseModel):
        x: int

    class B(pydantic.BaseModel):
        x: int

    a, b = to_constraint(A), to_constraint(B)
    assert hash(a.key) == hash(to_constraint(A).key)
    assert a.key != b.key  # titles differ, and so may generation
    assert to_constraint(a) is a  # a Constraint passes through
    assert isinstance(a, Constraint) and {a.key: 1}[to_constraint(A).key] == 1


D7 = "http://json-schema.org/draft-07/schema#"


@pytest.mark.parametrize(
    "schema,rewritten",
    [
        ({"oneOf": [{"type": "string"}, {"type": "array"}]}, True),  # types
        ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, False),  # 3 matches both
        ({"oneOf": [{"const": 1}, {"const": 1.0}]}, True),  # the same value: nothing is valid
        ({"oneOf": [{"const": True}, {"const": 1}]}, True),
        ({"$defs": {"a": {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                    "b": {"type": "object", "properties": {"k": {"enum": ["b", "c"]}}, "required": ["k"]}},
          "oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}]}, True),  # discriminator
        ({"oneOf": [{"type": "object", "required": ["a"]}, {"type": "object", "required": ["b"]}]},
         True),  # overlap: each branch excludes the other's key
        ({"oneOf": [{"type": "object", "required": ["a"], "additionalProperties": False, "properties": {"a": {}}},
                    {"type": "object", "required": ["b"], "additionalProperties": False, "properties": {"b": {}}}]},
         True),
        ({"oneOf": [{"required": ["a"]}, {"type": "string"}]}, True),  # "required" alone admits strings
        ({"$schema": D7, "definitions": {"x": {"type": ["integer", "string"]}},
          "oneOf": [{"$ref": "#/definitions/x", "type": "string"}, {"type": "integer"}]}, True),  # inert sibling
        ({"oneOf": [{"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}},
                    {"type": "object", "required": ["b"]}]}, False),  # "an item that is not a string"
    ],
)
def test_one_of_becomes_any_of(schema, rewritten):
    """oneOf is anyOf when the branches are disjoint, or made so by excluding each other
    (disjoint.one_of_as_any_of); never when a needed negation is unknown."""
    import jsonschema

    from structgen.schema.normalize import normalize_schema

    out = normalize_schema(schema)
    assert ("anyOf" in out and "oneOf" not in out) == rewritten
    probes = [None, True, 1, 1.0, 3, 2.5, "a", [], {}, {"k": "a"}, {"k": "b"}, {"a": 1}, {"b": 1}, {"a": 1, "b": 2},
              {"a": ["x"], "b": 1}, {"a": [1], "b": 1}]
    for v in probes:  # the same instances either way
        assert jsonschema.validators.validator_for(out)(out).is_valid(v) == jsonschema.validators.validator_for(schema)(
            schema).is_valid(v), v


def test_a_plain_dict_is_a_json_schema_and_cached():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    c = to_constraint(schema)
    assert c == to_constraint(JsonSchema(schema)) and c.parse('{"n": 1}') == {"n": 1}
    assert to_constraint(dict(schema)) is c  # equal dicts share one built constraint


@pytest.mark.parametrize(("output_type", "fix"), [
    ("Address", "strings are not read as types"),
    ("__import__('os').system('false')", "strings are not read as types"),
    (Address(street="s", zip="12345"), "pass the class itself: generate(Address, prompt)"),
    (Color.RED, "pass the class itself"),
    ([int], "write list[int]"),
    (3, "not a type"),
])  # fmt: skip
def test_strings_and_instances_are_refused_never_evaluated(output_type, fix):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UnsupportedTypeError, match=re.escape(fix)):
            to_constraint(output_type)


def test_an_unknown_keyword_near_a_known_one_warns():
    with pytest.warns(StructgenWarning) as caught:
        to_constraint({"tpye": "object", "properties": {"a": {"type": "string", "maxLenght": 3}}})
    assert [str(w.message) for w in caught] == [
        "unknown JSON Schema keyword 'tpye' (first at #) is ignored; did you mean 'type'?",
        "unknown JSON Schema keyword 'maxLenght' (first at #/properties/a) is ignored; did you mean 'maxLength'?",
    ]
    assert caught[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        to_constraint({"type": "object", "x-vendor": 1, "properties": {"tpye": {"type": "string"}}})
        to_constraint({"type": "object", "properties": {"n": {"type": "integer", "_format": "int32"}}})
    with pytest.warns(StructgenWarning) as repeated:  # one warning a keyword, however often it is used
        to_constraint({"type": "object", "properties": {k: {"type": "string", "maxLenght": 3} for k in "abc"}})
    assert len(repeated) == 1


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum 5 is greater than maximum 1"),
    ({"type": "string", "minLength": 5, "maxLength": 1}, "minLength 5"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems 3"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "exclusive"),
    ({"type": "integer", "enum": ["a", "b"]}, "admits no value"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 2, "maximum": 1}},
      "required": ["a"]}, "#/properties/a"),
])  # fmt: skip
def test_an_unsatisfiable_schema_has_its_own_error(schema, named):
    with pytest.raises(UnsatisfiableConstraintError, match=re.escape(named)):
        to_constraint(schema)


def test_contradictory_bounds_in_an_optional_part_are_left_to_the_backends():
    optional = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 2, "maximum": 1}}}
    assert to_constraint(optional).kind == "json_schema"


def test_strict_false_leaves_out_what_no_backend_enforces_and_validates_it_after():
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    loose = to_constraint(schema, strict=False)
    assert loose.relaxed == ("uniqueItems at #/properties/tags",)
    assert "uniqueItems" not in loose.source and not to_constraint(JsonSchema({})).relaxed
    assert loose.parse('{"tags": [1, 2]}') == {"tags": [1, 2]}
    with pytest.raises(OutputValidationError, match="non-unique"):
        loose.parse('{"tags": [1, 1]}')
    assert to_constraint(set[str], strict=False).parse('["a", "b"]') == {"a", "b"}


def test_annotated_list_of_typeddicts_builds_a_constraint():
    """`Annotated[list[TD], Field(...)]` with a `typing.TypedDict` (rebuilt for pydantic
    before Python 3.12) keeps both the item type and the annotation."""
    import typing as t

    class Item(t.TypedDict):
        name: str

    constraint = to_constraint(t.Annotated[list[Item], pydantic.Field(min_length=1)])
    schema = json.loads(constraint.source)
    assert schema["minItems"] == 1
    assert constraint.parse('[{"name": "a"}]') == [{"name": "a"}]
    with pytest.raises(OutputValidationError):
        constraint.parse("[]")
