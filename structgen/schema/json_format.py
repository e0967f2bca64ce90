"""The one JSON text format our JSON-schema grammars generate.

Small models loop forever on whitespace when a grammar allows unbounded whitespace, so every
backend is configured for the same fixed, compact-but-readable format: no newlines or
indentation, `", "` between items, `": "` between key and value, non-ASCII characters as
themselves, and object properties in the order the schema lists them (both backends enforce
that order). `dump_json` writes a value in exactly that format, for tests, evaluation and
few-shot examples.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from structgen.schema.keywords import resolve_ref

JSON_SEPARATORS = (", ", ": ")


def dump_json(value: Any, schema: Any = None) -> str:
    """`value` as the JSON grammars would generate it for `schema` (keys in schema order;
    without a schema, in their current order)."""
    if schema is not None:
        value = _ordered(value, schema, schema, 0)
    return json.dumps(value, separators=JSON_SEPARATORS, ensure_ascii=False)


def _ordered(value: Any, schema: Any, root: Any, depth: int) -> Any:
    """Reorder the keys of every object in `value` the way the grammar for `schema` emits them
    (see `_key_order`); keys the schema does not place keep their order at the end."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        # both backends write an enum / const number 0.0 as 0 (the same JSON value)
        if any("const" in p or "enum" in p for p in _parts(schema, value, root, 0)):
            return int(value)
    if depth > 64 or not isinstance(value, (dict, list)):
        return value
    parts = list(_parts(schema, value, root, 0))
    if isinstance(value, dict):
        order = _key_order(schema, value, root)
        keys = [k for k in order if k in value] + [k for k in value if k not in order]
        return {k: _ordered(value[k], _property_schema(parts, k), root, depth + 1) for k in keys}
    return [_ordered(v, _item_schema(parts, i), root, depth + 1) for i, v in enumerate(value)]


def _key_order(schema: Any, value: Any, root: Any) -> list[str]:
    """The order the grammar emits an object's keys in. llguidance merges a subschema with its
    `allOf` parts, `$ref` target and matching `anyOf`/`oneOf` branch in the order those
    keywords appear in it, its own `properties` counting from the first of `properties` /
    `additionalProperties` (`{"allOf": [B], "properties": {a}}` emits B's keys before a,
    `{"additionalProperties": X, "allOf": [B], "properties": {a}}` a first); then come the
    required keys no `properties` lists, in `required` order; then the rest. (Measured on
    llguidance 1.9, whose docs call this order unstable; xgrammar is only used for schemas
    without such combinations, see `keywords._xgrammar_rules`.)"""
    listed: list[str] = []
    required: list[str] = []

    def visit(node: Any, depth: int) -> None:
        if not isinstance(node, dict) or depth > 32:
            return
        own = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        for kw, sub in node.items():
            if kw in ("properties", "additionalProperties"):
                listed.extend(k for k in own if k not in listed)
            elif kw == "required" and isinstance(sub, list):
                required.extend(k for k in sub if isinstance(k, str) and k not in required)
            elif kw == "allOf" and isinstance(sub, list):
                for part in sub:
                    visit(part, depth + 1)
            elif kw in ("anyOf", "oneOf") and isinstance(sub, list):
                branch = next((b for b in sub if _matches(b, value, root)), None)
                visit(branch, depth + 1)
            elif kw == "$ref" and isinstance(sub, str):
                visit(resolve_ref(root, sub), depth + 1)

    visit(schema, 0)
    return listed + [k for k in required if k not in listed]


def _parts(schema: Any, value: Any, root: Any, depth: int) -> Iterator[dict]:
    """The object subschemas that apply to `value` (for the subschemas of its members)."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < 32:
        yield schema  # its siblings apply too
        schema = resolve_ref(root, schema["$ref"])
        depth += 1
    if not isinstance(schema, dict) or depth >= 32:
        return
    yield schema
    for part in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        yield from _parts(part, value, root, depth + 1)
    for kw in ("anyOf", "oneOf"):
        branches = schema.get(kw)
        if isinstance(branches, list):
            for branch in branches:
                if _matches(branch, value, root):
                    yield from _parts(branch, value, root, depth + 1)
                    break


def _property_schema(parts: list[dict], key: str) -> Any:
    for part in parts:
        props = part.get("properties")
        if isinstance(props, dict) and key in props:
            return props[key]
    for part in parts:
        for pattern, sub in (part.get("patternProperties") or {}).items():
            try:
                if re.search(pattern, key):
                    return sub
            except re.error:
                continue
    for part in parts:
        if isinstance(part.get("additionalProperties"), dict):
            return part["additionalProperties"]
    return None


def _item_schema(parts: list[dict], index: int) -> Any:
    for part in parts:
        prefix = part.get("prefixItems")
        if prefix is None and isinstance(part.get("items"), list):
            prefix = part["items"]  # draft-4 tuple form
        if isinstance(prefix, list) and index < len(prefix):
            return prefix[index]
    for part in parts:
        if isinstance(part.get("items"), dict):
            return part["items"]
    return None


def _matches(schema: Any, value: Any, root: Any) -> bool:
    import jsonschema

    try:
        cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
        return cls(root).evolve(schema=schema).is_valid(value)
    except Exception:  # an unresolvable or malformed branch cannot be the one that matched
        return False
