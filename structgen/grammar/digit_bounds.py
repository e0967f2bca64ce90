"""The loop guard on numbers: an integer a JSON schema leaves unbounded gets a sane digit count.

A small model asked for an unbounded integer can fall into a digit loop (`1000000000000…`)
that only max_tokens stops. With `SamplingParams.loop_guards` on, the schema the grammar is
compiled from gets `minimum` / `maximum` of +-(10**INTEGER_DIGITS - 1) on every integer
subschema missing them (one without a `multipleOf`, which xgrammar ignores next to a bound);
bounded integers and all other subschemas are left as they are. The output is still validated
against the caller's own type, which every bounded value satisfies. `int` itself is a regex
with the same bound already (`types.INT_REGEX`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any

from structgen.types import Constraint

INTEGER_DIGITS = 18  # 64-bit identifiers still fit
INTEGER_BOUND = 10**INTEGER_DIGITS - 1
_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")
# An integer of the bound's full digit count in the output text: where the guard stopped one.
_AT_BOUND = re.compile(rf"(?<![0-9.eE+-])-?[0-9]{{{INTEGER_DIGITS}}}(?![0-9.eE])")
_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples", "required", "title", "description"})


def bound_integers(constraint: Constraint) -> Constraint:
    """`constraint` with every unbounded integer of its JSON schema bounded; any other
    constraint (and a schema without one) as it is."""
    if constraint.kind != "json_schema":
        return constraint
    source = _bounded_source(constraint.source)
    fallback = bound_integers(constraint.fallback) if constraint.fallback is not None else None
    if source == constraint.source and fallback is constraint.fallback:
        return constraint
    return dataclasses.replace(constraint, source=source, fallback=fallback)


def reached_bound(text: str) -> bool:
    """Does the JSON `text` hold an integer as long as the guard allows (a sign it stopped a
    longer one)?"""
    return _AT_BOUND.search(text) is not None


@functools.lru_cache(maxsize=256)
def _bounded_source(source: str) -> str:
    schema = json.loads(source)
    if not _bound(schema, 0):
        return source
    return json.dumps(schema, ensure_ascii=False)


def _bound(node: Any, depth: int) -> bool:
    """Bound the integers in `node` and its subschemas in place; whether any was."""
    if depth > 64:
        return False
    if isinstance(node, list):
        return any([_bound(item, depth + 1) for item in node])  # a list: every item is visited
    if not isinstance(node, dict):
        return False
    changed = False
    declared = node.get("type")
    integer = declared == "integer" or (isinstance(declared, list) and "integer" in declared and "number" not in declared)
    if integer and "multipleOf" not in node:
        if not any(k in node for k in _LOWER):
            node["minimum"], changed = -INTEGER_BOUND, True
        if not any(k in node for k in _UPPER):
            node["maximum"], changed = INTEGER_BOUND, True
    for key, value in node.items():
        if key not in _NOT_SCHEMAS and isinstance(value, (dict, list)):
            changed = _bound(value, depth + 1) or changed
    return changed


__all__ = ["INTEGER_BOUND", "INTEGER_DIGITS", "bound_integers", "reached_bound"]
