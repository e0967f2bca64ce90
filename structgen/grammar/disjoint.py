"""Proofs that two JSON subschemas share no instance.

`oneOf` means "exactly one branch matches". Neither backend enforces that in general
(xgrammar reads it as `anyOf`; llguidance refuses it), but when no two branches can match the
same instance, `oneOf` and `anyOf` admit exactly the same instances, and the normalizer may
rewrite one into the other. The proof here is conservative (False = "could not prove"):

- the branches admit disjoint JSON types (from `type`, `const`/`enum` values, `$ref`,
  `allOf` / `anyOf` / `oneOf` parts; "integer" overlaps "number");
- both are finite (`const`/`enum`) with no common value;
- both admit only objects, and some property is required by both with disjoint subschemas
  (the usual discriminator, `"kind": {"const": "a"}`), or required by one and forbidden by the
  other (`properties: {p: false}`, or `additionalProperties: false` without `p`).
"""

from __future__ import annotations

import json
from typing import Any

from structgen.grammar.keywords import resolve_ref

_ALL = frozenset({"null", "boolean", "object", "array", "string", "number", "integer"})
_MAX_DEPTH = 12


def pairwise_disjoint(branches: list[Any], root: Any, ref_overrides: bool = False) -> bool:
    """No instance matches two of `branches` (refs resolve in `root`; `ref_overrides`: drafts
    4-7, where a `$ref` makes the keywords next to it inert)."""
    if ref_overrides:
        root = _RefOverrides(root)
    return all(
        disjoint(a, b, root) for i, a in enumerate(branches) for b in branches[i + 1 :]
    )


class _RefOverrides:
    """A root marker: follow `$ref` alone, ignoring its siblings (drafts 4-7)."""

    def __init__(self, root: Any):
        self.root = root


def _follow(schema: Any, root: Any) -> tuple[Any, Any]:
    """(the schema to read, the document its refs resolve in): under drafts 4-7 a node with a
    `$ref` is its target."""
    if isinstance(root, _RefOverrides):
        for _ in range(_MAX_DEPTH):
            if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
                break
            schema = resolve_ref(root.root, schema["$ref"])
        return schema, root
    return schema, root


def _doc(root: Any) -> Any:
    return root.root if isinstance(root, _RefOverrides) else root


def disjoint(a: Any, b: Any, root: Any, depth: int = 0) -> bool:
    if depth > _MAX_DEPTH:
        return False
    a, _ = _follow(a, root)
    b, _ = _follow(b, root)
    if a is None or b is None:
        return False
    if a is False or b is False:
        return True
    ta, tb = json_types(a, root), json_types(b, root)
    if not ta & tb:
        return True
    va, vb = _values(a, root), _values(b, root)
    if va is not None and vb is not None and not ({_key(v) for v in va} & {_key(v) for v in vb}):
        return True
    if ta == {"object"} and tb == {"object"}:
        oa, ob = _resolved(a, root), _resolved(b, root)
        if isinstance(oa, dict) and isinstance(ob, dict):
            return _objects_disjoint(oa, ob, root, depth)
    return False


def json_types(schema: Any, root: Any, depth: int = 0) -> frozenset[str]:
    """The JSON types `schema` may admit (all of them when it says nothing)."""
    schema, _ = _follow(schema, root)
    if schema is False:
        return frozenset()
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return _ALL
    types = _ALL
    declared = schema.get("type")
    if isinstance(declared, str):
        types &= _expand({declared})
    elif isinstance(declared, list) and all(isinstance(t, str) for t in declared):
        types &= _expand(set(declared))
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    if "const" in schema:
        values = [schema["const"]]
    if values is not None:
        types &= frozenset(_type_of(v) for v in values)
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = resolve_ref(_doc(root), ref)
        if target is not None:
            types &= json_types(target, root, depth + 1)
    for part in _list(schema, "allOf"):
        types &= json_types(part, root, depth + 1)
    for kw in ("anyOf", "oneOf"):
        parts = _list(schema, kw)
        if parts:
            union: frozenset[str] = frozenset()
            for part in parts:
                union |= json_types(part, root, depth + 1)
            types &= union
    return types


# -- helpers ------------------------------------------------------------------------------------
def _objects_disjoint(a: dict, b: dict, root: Any, depth: int) -> bool:
    req_a, req_b = set(_list(a, "required")), set(_list(b, "required"))
    props_a, props_b = _props(a), _props(b)
    for p in req_a & req_b:
        if p in props_a and p in props_b and disjoint(props_a[p], props_b[p], root, depth + 1):
            return True
    return any(_forbids(b, p) for p in req_a) or any(_forbids(a, p) for p in req_b)


def _forbids(schema: dict, prop: str) -> bool:
    props = _props(schema)
    if prop in props:
        return props[prop] is False
    if schema.get("patternProperties"):
        return False
    return schema.get("additionalProperties") is False


def _props(schema: dict) -> dict[str, Any]:
    props = schema.get("properties")
    return props if isinstance(props, dict) else {}


def _resolved(schema: Any, root: Any) -> Any:
    """Follow a bare `$ref` chain; a `$ref` with siblings is left alone (no merge here)."""
    for _ in range(_MAX_DEPTH):
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
            return schema
        if set(schema) - {"$ref", "description", "title", "$comment"}:
            return schema
        schema = resolve_ref(_doc(root), schema["$ref"])
    return None


def _values(schema: Any, root: Any, depth: int = 0) -> list[Any] | None:
    schema, _ = _follow(schema, root)
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None
    if "const" in schema:
        return [schema["const"]]
    if isinstance(schema.get("enum"), list):
        return list(schema["enum"])
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return _values(resolve_ref(_doc(root), ref), root, depth + 1)
    return None


def _key(value: Any) -> str:
    """JSON identity: 1 and 1.0 are the same instance, True and 1 are not."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value, sort_keys=True)


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _expand(types: set[str]) -> frozenset[str]:
    """"number" admits integers too."""
    return frozenset(types | {"integer"}) if "number" in types else frozenset(types)


def _list(schema: dict, kw: str) -> list[Any]:
    value = schema.get(kw)
    return value if isinstance(value, list) else []
