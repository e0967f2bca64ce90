"""ECMA-262 patterns that Python's `re` spells otherwise (a named group) check outputs as the
grammar enforces them; those it cannot read at all are refused when the schema is built."""

from __future__ import annotations

import pytest

from structgen import tool_format
from structgen.errors import OutputValidationError, UnsupportedSchemaError
from structgen.schema.python_patterns import python_pattern, python_patterns
from structgen.types import to_constraint


def _string(pattern: str) -> dict:
    return {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}, "required": ["a"]}


def test_a_named_group_checks_outputs_and_reaches_the_backends_as_written():
    c = to_constraint(_string("^(?<year>[0-9]{4})-(?<month>[0-9]{2})$"))
    assert "(?<year>" in c.source  # the backends read ECMA's form
    assert c.parse('{"a": "2024-05"}') == {"a": "2024-05"}
    with pytest.raises(OutputValidationError, match="#/a"):
        c.parse('{"a": "2024-5"}')


def test_named_groups_in_pattern_properties_decide_what_is_additional():
    schema = {"type": "object", "patternProperties": {"^(?<k>x)[0-9]$": {"type": "integer"}},
              "additionalProperties": False}
    c = to_constraint(schema)
    assert c.parse('{"x1": 3}') == {"x1": 3}
    for bad in ('{"y1": 3}', '{"x1": "3"}'):
        with pytest.raises(OutputValidationError):
            c.parse(bad)


def test_a_pattern_re_cannot_read_is_refused_where_it_is():
    with pytest.raises(UnsupportedSchemaError, match=r"\\\\p\{Lu\}.*#/properties/a/pattern") as e:
        to_constraint(_string(r"^\p{Lu}[a-z]+$"))
    assert (e.value.keyword, e.value.path) == ("pattern", "#/properties/a/pattern")
    used = {"type": "object", "properties": {"a": {"$ref": "#/$defs/word"}}, "$defs": {"word": {"pattern": r"\u{1F600}"}}}
    with pytest.raises(UnsupportedSchemaError, match="#/\\$defs/word/pattern"):
        to_constraint(used)


def test_what_is_not_a_used_pattern_is_left_alone():
    unused = {"type": "object", "$defs": {"w": {"pattern": r"\p{L}"}}}
    assert python_patterns(unused) is unused
    data = {"const": {"pattern": r"\p{L}", "patternProperties": {"(?<x>a)": 1}}}
    assert python_patterns(data) is data
    plain = _string("^[a-z]+$")
    assert python_patterns(plain) is plain


@pytest.mark.parametrize("pattern", [r"(?<=a)b", r"(?<!a)b", r"[(?<]+", r"\(?<x"])
def test_lookbehinds_classes_and_escapes_are_not_named_groups(pattern):
    assert python_pattern(pattern) == pattern


def test_tool_parameters_take_the_named_group_and_refuse_what_re_cannot_read():
    assert tool_format._schema_error(_string("^(?<y>[0-9]+)$")) is None
    assert "regex" in tool_format._schema_error(_string(r"\p{Lu}"))


def test_a_tool_call_is_checked_with_the_named_group_read_as_python_reads_it():
    tools = [{"type": "function", "function": {"name": "f", "parameters": _string("^(?<y>[0-9]{4})$")}}]
    tool_format.check_tools(tools)
    assert tool_format._to_call({"name": "f", "arguments": {"a": "2024"}}, tools).arguments == {"a": "2024"}
    with pytest.raises(OutputValidationError, match="arguments of 'f' do not validate"):
        tool_format._to_call({"name": "f", "arguments": {"a": "20x"}}, tools)
