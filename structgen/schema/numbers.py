"""Bounded numbers on a grid are finite: list them.

Neither backend implements `not: {multipleOf: 6}` (nor most combinations of `multipleOf`), but
a number schema with both bounds whose values all lie on a grid (an `integer` type, a
`multipleOf`, or an `anyOf` whose every branch has one) admits finitely many values: the
multiples in range. `number_candidates` lists them (when few) and the normalizer keeps those
the whole subschema accepts, as an `enum` (MaskBench Handwritten 9: negative multiples of 4,
12, 16, 33 or 77 above -300 that are neither multiples of 6 nor 7, ...).

Only grids whose step is exact in binary floating point (integers, 13.5, 2.125) are listed,
so every multiple is written exactly; `multipleOf: 0.1` is left alone.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from structgen.schema.keywords import resolve_ref

MAX_NUMBERS = 1024


def number_candidates(schema: Any, root: Any) -> list[Any] | None:
    """Numbers that include every number `schema` admits, when it admits numbers only and
    they are few; None otherwise. Callers check each against the schema."""
    if not isinstance(schema, dict) or schema.get("type") not in ("number", "integer"):
        return None
    if not _mentions(schema, root, _UNENFORCED, 0):
        return None  # the backends enforce it as it is: no need for a list
    low, high = _bounds(schema, root, 0)
    if low is None or high is None or low > high:
        return None
    grids = _grids(schema, root, 0)
    if grids is None:
        return None
    values: set[Fraction] = set()
    for step in grids:
        first, last = math.ceil(low / step), math.floor(high / step)
        if last - first + 1 + len(values) > MAX_NUMBERS:
            return None
        values.update(step * k for k in range(first, last + 1))
    return [int(v) if v.denominator == 1 else float(v) for v in sorted(values)]


def _bounds(schema: Any, root: Any, depth: int) -> tuple[Fraction | None, Fraction | None]:
    """The tightest bounds of `schema` and its `allOf` parts / `$ref` (exclusive bounds
    count as inclusive: the candidates only need to cover the values)."""
    low: Fraction | None = None
    high: Fraction | None = None
    for part in _parts(schema, root, depth):
        for kw in ("minimum", "exclusiveMinimum"):
            if _number(part.get(kw)):
                value = Fraction(part[kw])
                low = value if low is None else max(low, value)
        for kw in ("maximum", "exclusiveMaximum"):
            if _number(part.get(kw)):
                value = Fraction(part[kw])
                high = value if high is None else min(high, value)
    return low, high


def _grids(schema: Any, root: Any, depth: int) -> list[Fraction] | None:
    """Steps such that every value of `schema` is a multiple of one of them: the `type:
    integer` or a `multipleOf` of it or an `allOf` part, or one per `anyOf` branch."""
    if depth > 16:
        return None
    for part in _parts(schema, root, depth):
        step = part.get("multipleOf")
        if _number(step) and step > 0 and _exact(step):
            return [Fraction(step)]
        if part.get("type") == "integer":
            return [Fraction(1)]
    for part in _parts(schema, root, depth):
        branches = part.get("anyOf")
        if isinstance(branches, list) and branches:
            found = [_grids(b, root, depth + 1) for b in branches]
            if all(g is not None for g in found):
                return [step for g in found for step in g]
    return None


def _parts(schema: Any, root: Any, depth: int) -> list[dict[str, Any]]:
    """`schema` with its `allOf` parts and `$ref` targets: all of them apply."""
    if not isinstance(schema, dict) or depth > 16:
        return []
    out = [schema]
    if isinstance(schema.get("$ref"), str):
        out += _parts(resolve_ref(root, schema["$ref"]), root, depth + 1)
    for part in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        out += _parts(part, root, depth + 1)
    return out


_UNENFORCED = frozenset({"not", "oneOf", "if", "allOf"})


def _mentions(schema: Any, root: Any, names: frozenset[str], depth: int) -> bool:
    """Does `schema` (through its subschemas and `$ref`s) use one of `names`?"""
    if depth > 16:
        return False
    if isinstance(schema, list):
        return any(_mentions(v, root, names, depth + 1) for v in schema)
    if not isinstance(schema, dict):
        return False
    if names & set(schema):
        return True
    if isinstance(schema.get("$ref"), str):
        if _mentions(resolve_ref(root, schema["$ref"]), root, names, depth + 1):
            return True
    return any(
        _mentions(v, root, names, depth + 1)
        for k, v in schema.items()
        if k not in ("enum", "const", "default", "examples", "$defs", "definitions")
    )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _exact(step: float) -> bool:
    """Is `step` a short binary fraction (so its multiples are exact floats)?"""
    return Fraction(step).denominator <= 1024
