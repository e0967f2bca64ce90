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
  (`properties: {p: false}`, or `additionalProperties: false` without `p`); `required` and
  `properties` count from `allOf` parts (and their `$ref`s) too;
- both admit only objects and one needs more keys than the other allows (`required` of two
  keys against `maxProperties: 1`).
Where branches overlap only on types one of them says nothing about (open object branches
told apart by a discriminator both accept every string), `apart_by_type` gives the exclusion
as a `type` instead of a negation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from structgen.schema.budget import check_budget
from structgen.schema.keywords import (
    ANNOTATIONS,
    KEYWORD_TYPE,
    KEYWORDS,
    finite_values,
    resolve_ref,
)

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
    proof = Disjointness(root, ref_overrides)
    scopes = [proof.in_context(b, parent) for b in branches]
    out = []
    for i, branch in enumerate(branches):
        check_budget()  # pairwise proofs: quadratic in the branches
        parts = [branch]
        for j, other in enumerate(branches):
            if j == i or proof.disjoint(scopes[i], scopes[j]):
                continue
            apart = proof.apart_by_type(scopes[i], scopes[j])
            if apart is not None:  # branch i is outside branch j exactly for these types
                if not apart:
                    parts = []
                    break
                parts.append({"type": sorted(apart)})
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


class Disjointness:
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
            types &= expand_types({declared})
        elif isinstance(declared, list) and all(isinstance(t, str) for t in declared):
            types &= expand_types(set(declared))
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
        if self.min_keys(a, 0) > self.max_keys(b) or self.min_keys(b, 0) > self.max_keys(a):
            return True
        views_a, views_b = self.views(a, 0), self.views(b, 0)
        req_a = {p for v in views_a for p in _list(v, "required")}
        req_b = {p for v in views_b for p in _list(v, "required")}
        for p in req_a | req_b:  # present in every common instance, valid against both
            subs_a = [_props(v)[p] for v in views_a if p in _props(v)]
            subs_b = [_props(v)[p] for v in views_b if p in _props(v)]
            if any(self.disjoint(x, y, depth + 1) for x in subs_a for y in subs_b):
                return True
        return any(_forbids(v, p) for v in views_b for p in req_a) or any(
            _forbids(v, p) for v in views_a for p in req_b
        )

    def apart_by_type(self, a: Any, b: Any) -> frozenset[str] | None:
        """The JSON types (number covering integer) for which no instance of `a` is in `b`,
        when for each other type every instance is in `b` (`b` says nothing about that
        type); None when some type is neither. Then "a and not b" is "a of those types":
        two open object branches told apart by a discriminator overlap only on the values
        that are not objects, where both are vacuously true."""
        types_a, types_b = self.types(a), self.types(b)
        out = set()
        for t in ("null", "boolean", "object", "array", "string", "number"):
            family = {"number", "integer"} if t == "number" else {t}
            if not types_a & family:
                continue
            if not types_b & family:
                out.add(t)
            elif self._says_nothing_of(b, family):
                continue
            elif self.disjoint({"allOf": [a, {"type": t}]}, {"allOf": [b, {"type": t}]}):
                out.add(t)
            else:
                return None
        return frozenset(out)

    def _says_nothing_of(self, schema: Any, family: set[str]) -> bool:
        """Does every value of these types satisfy `schema` (its keywords are all about
        other types)?"""
        schema = self.follow(schema)
        if schema is True or schema == {}:
            return True
        if not isinstance(schema, dict):
            return False
        live = [k for k in schema if k in KEYWORDS and k not in ANNOTATIONS]
        return all(KEYWORD_TYPE.get(k) not in (None, *family) for k in live)

    def closed_keys(self, schema: Any, depth: int = 0) -> list[str] | None:
        """The only keys an object of `schema` can have, when it is closed
        (additionalProperties false, no patternProperties; for `anyOf`/`oneOf`, every
        branch closed); None otherwise."""
        schema = self.follow(schema)
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return None
        if schema.get("additionalProperties") is False and not schema.get("patternProperties"):
            return [k for k, v in _props(schema).items() if v is not False]
        for part in _list(schema, "allOf"):
            keys = self.closed_keys(part, depth + 1)
            if keys is not None:
                return keys
        for kw in ("anyOf", "oneOf"):
            branches = _list(schema, kw)
            if branches:
                found = [self.closed_keys(b, depth + 1) for b in branches]
                if any(keys is None for keys in found):
                    return None
                return list(dict.fromkeys(k for keys in found for k in keys))
        return None

    def min_keys(self, schema: Any, depth: int) -> int:
        """A lower bound on the number of keys of an object `schema` admits (from
        `required`, `minProperties`, and the least of its `anyOf`/`oneOf` branches)."""
        schema = self.follow(schema)
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return 0
        low = max(len(set(_list(schema, "required"))), _count(schema, "minProperties", 0))
        if isinstance(schema.get("$ref"), str):
            low = max(low, self.min_keys(resolve_ref(self.root, schema["$ref"]), depth + 1))
        for part in _list(schema, "allOf"):
            low = max(low, self.min_keys(part, depth + 1))
        for kw in ("anyOf", "oneOf"):
            if _list(schema, kw):
                low = max(low, min(self.min_keys(b, depth + 1) for b in _list(schema, kw)))
        return low

    def max_keys(self, schema: Any) -> float:
        """An upper bound on the number of keys (`maxProperties` of it and its `allOf`)."""
        counts = [_count(v, "maxProperties", float("inf")) for v in self.views(schema, 0)]
        return min(counts, default=float("inf"))

    def views(self, schema: Any, depth: int) -> list[dict]:
        """`schema` and the `allOf` parts (their `$ref`s followed) that all apply with it."""
        schema = self.follow(schema)
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return []
        out = [schema]
        if isinstance(schema.get("$ref"), str):  # a $ref with live siblings
            out += self.views(resolve_ref(self.root, schema["$ref"]), depth + 1)
        for part in _list(schema, "allOf"):
            out += self.views(part, depth + 1)
        return out


def _count(schema: dict, kw: str, default: float) -> float:
    value = schema.get(kw)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


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


def expand_types(types: set[str]) -> frozenset[str]:
    """"number" admits integers too."""
    return frozenset(types | {"integer"}) if "number" in types else frozenset(types)


def _list(schema: dict, kw: str) -> list[Any]:
    value = schema.get(kw)
    return value if isinstance(value, list) else []
