"""Proofs that two JSON subschemas share no instance.

`oneOf` means "exactly one branch matches". Neither backend enforces that in general
(xgrammar reads it as `anyOf`; llguidance refuses it), but when no two branches can match the
same instance, `oneOf` and `anyOf` admit exactly the same instances, and the normalizer may
rewrite one into the other; branches that may overlap are made disjoint by excluding each
other (`one_of_as_any_of`). The proof here is conservative (False = "could not prove"):

- the branches admit disjoint JSON types (from `type`, `const`/`enum` values, `$ref`,
  `allOf` / `anyOf` / `oneOf` parts; "integer" overlaps "number");
- both are finite (`const`/`enum`) with no common value;
- both admit only objects, and some property is required by one (so present in any common
  instance) and has disjoint subschemas in the two (the usual discriminator,
  `"kind": {"const": "a"}`), or is required by one and forbidden by the other
  (`properties: {p: false}`, or `additionalProperties: false` without `p`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from structgen.grammar.keywords import finite_values, resolve_ref

_ALL = frozenset({"null", "boolean", "object", "array", "string", "number", "integer"})
_MAX_DEPTH = 12


def one_of_as_any_of(
    branches: list[Any],
    parent: dict[str, Any],
    root: Any,
    ref_overrides: bool,
    negate: Callable[[Any, Any, Any], Any | None],
) -> list[Any] | None:
    """`anyOf` branches admitting exactly what `oneOf: branches` admits next to the keywords
    `parent` (the rest of the subschema), or None.

    oneOf [B1..Bn] is anyOf [Bi and not Bj, for every j != i]: an instance is valid when it
    matches some Bi and no other. "not Bj" is needed only where Bi and Bj may overlap (the
    proofs of this module), and only its alternatives that may overlap Bi (and the parent)
    are kept; a branch left with no alternative is contained in Bj, so it never matches
    alone and is dropped. `negate(schema, within, proofs)` (`negate.negate` with the
    document's refs) may answer for "within Bi" only, since the result is used next to Bi.
    None when some needed negation is unknown.
    """
    proof = _Disjointness(root, ref_overrides)
    scopes = [proof.in_context(b, parent) for b in branches]
    out = []
    for i, branch in enumerate(branches):
        parts = [branch]
        for j, other in enumerate(branches):
            if j == i or proof.disjoint(scopes[i], scopes[j]):
                continue
            neg = negate(other, scopes[i], proof)
            if neg is None:
                return None
            alternatives = [a for a in _alternatives(neg) if not proof.disjoint(a, scopes[i])]
            if not alternatives:
                parts = []  # every instance of branch i also matches branch j
                break
            parts.append(alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives})
        if parts:
            out.append(parts[0] if len(parts) == 1 else {"allOf": parts})
    return out


def _alternatives(schema: Any) -> list[Any]:
    """The branches of a (possibly nested) `anyOf`-only schema; [schema] otherwise."""
    if schema is False:
        return []
    if isinstance(schema, dict) and set(schema) == {"anyOf"} and isinstance(schema["anyOf"], list):
        return [a for part in schema["anyOf"] for a in _alternatives(part)]
    return [schema]


class _Disjointness:
    def __init__(self, root: Any, ref_overrides: bool):
        self.root = root
        self.ref_overrides = ref_overrides

    def follow(self, schema: Any) -> Any:
        """A `$ref` alone (or, under drafts 4-7, with inert siblings) is its target; a `$ref`
        with live siblings is left as is (its target is read where needed)."""
        for _ in range(_MAX_DEPTH):
            if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
                return schema
            if not self.ref_overrides and set(schema) - {"$ref", "description", "title", "$comment"}:
                return schema
            schema = resolve_ref(self.root, schema["$ref"])
        return None

    def in_context(self, branch: Any, parent: dict[str, Any]) -> Any:
        """A schema admitting at least every instance of `branch` that also satisfies
        `parent` (the keywords next to the `oneOf`), for the proofs: the branch (its `$ref`
        followed) with the parent's type, required keys, and properties it does not list.
        Weaker than the true conjunction where both list a property, which only makes the
        proofs more conservative."""
        branch = self.follow(branch)
        if not isinstance(branch, dict):
            return branch
        out = dict(branch)
        if "type" in parent and "type" not in out:
            out["type"] = parent["type"]
        required = set(_list(out, "required")) | set(_list(parent, "required"))
        if required:
            out["required"] = sorted(required)
        props = {**_props(parent), **_props(out)}
        if props:
            out["properties"] = props
        if parent.get("additionalProperties") is False and not (
            parent.get("patternProperties") or out.get("patternProperties")
        ):
            out["additionalProperties"] = False
        return out

    def disjoint(self, a: Any, b: Any, depth: int = 0) -> bool:
        a, b = self.follow(a), self.follow(b)
        if depth > _MAX_DEPTH or a is None or b is None:
            return False
        if a is False or b is False:
            return True
        ta, tb = self.types(a), self.types(b)
        if not ta & tb:
            return True
        va, vb = finite_values(a, self.root), finite_values(b, self.root)
        if va is not None and vb is not None and not ({_key(v) for v in va} & {_key(v) for v in vb}):
            return True
        if ta == tb == {"object"} and isinstance(a, dict) and isinstance(b, dict):
            return self._objects_disjoint(a, b, depth)
        return False

    def types(self, schema: Any, depth: int = 0) -> frozenset[str]:
        """The JSON types `schema` may admit (all of them when it says nothing)."""
        schema = self.follow(schema)
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
        values = finite_values(schema, self.root)
        if values is not None:
            types &= frozenset(_type_of(v) for v in values)
        if isinstance(schema.get("$ref"), str):  # a $ref with live siblings
            types &= self.types(resolve_ref(self.root, schema["$ref"]), depth + 1)
        for part in _list(schema, "allOf"):
            types &= self.types(part, depth + 1)
        for kw in ("anyOf", "oneOf"):
            parts = _list(schema, kw)
            if parts:
                types &= frozenset().union(*(self.types(p, depth + 1) for p in parts))
        return types

    def _objects_disjoint(self, a: dict, b: dict, depth: int) -> bool:
        req_a, req_b = set(_list(a, "required")), set(_list(b, "required"))
        props_a, props_b = _props(a), _props(b)
        for p in req_a | req_b:  # present in every common instance, valid against both
            if p in props_a and p in props_b and self.disjoint(props_a[p], props_b[p], depth + 1):
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
