"""`uniqueItems` and `contains` rewritten where a grammar can enforce them.

No backend enforces `uniqueItems` (a grammar cannot remember which items it has seen), but
two cases need no memory:

- it is trivially true: `uniqueItems: false`, at most one item (`maxItems <= 1`), or a tuple
  (`prefixItems`, no further items) whose positions admit pairwise disjoint values;
- the items come from a small finite set (`enum`/`const` items, booleans, null): then the
  valid arrays can be listed, a few hundred at most, and the array becomes their `enum`
  (which the normalizer writes out as literal `prefixItems` tuples).

Neither enforces `contains` ("some item matches C"), but in an array of at most n items it is
"item 0 matches C, or item 1 does, ...": n `prefixItems` alternatives.

Anything else is left alone, and the schema is refused naming the keyword.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from structgen.schema.keywords import ANNOTATIONS, finite_values

MAX_ARRAYS = 256  # listed valid arrays, at most
MAX_CONTAINS_POSITIONS = 32  # `contains` as one alternative per position, up to this many


def drop_trivial_unique(node: dict[str, Any], disjoint: Callable[[Any, Any], bool]) -> None:
    """Remove `uniqueItems` from `node` when no array it admits can repeat an item."""
    if "uniqueItems" not in node:
        return
    if node["uniqueItems"] is not True:
        del node["uniqueItems"]
        return
    max_items = node.get("maxItems")
    if isinstance(max_items, int) and not isinstance(max_items, bool) and max_items <= 1:
        del node["uniqueItems"]
        return
    prefix = node.get("prefixItems")
    if isinstance(prefix, list) and node.get("items") is False:
        if all(disjoint(a, b) for a, b in itertools.combinations(prefix, 2)):
            del node["uniqueItems"]


def unique_arrays(schema: dict[str, Any], root: Any) -> list[list[Any]] | None:
    """Every array of distinct items `schema` (with `uniqueItems: true`) could admit, when its
    items come from small finite sets; None otherwise. Callers still check each candidate
    against the schema (its other keywords: `minItems`, `contains`, ...)."""
    prefix = schema.get("prefixItems", [])
    tail = schema.get("items", True)
    if not isinstance(prefix, list) or isinstance(tail, list):
        return None
    domains = [item_values(s, root) for s in prefix]
    tail_values = item_values(tail, root) if tail is not False else []
    if any(d is None for d in domains) or tail_values is None:
        return None
    longest = len(prefix) + len(tail_values)
    max_items = schema.get("maxItems")
    if isinstance(max_items, int) and not isinstance(max_items, bool):
        longest = min(longest, max_items)
    out: list[list[Any]] = [[]]
    arrays: list[list[Any]] = []
    while out:
        array = out.pop()
        arrays.append(array)
        if len(arrays) > MAX_ARRAYS:
            return None
        if len(array) == longest:
            continue
        position = len(array)
        choices = domains[position] if position < len(prefix) else tail_values
        for value in choices:
            if not any(_same(value, v) for v in array):
                out.append([*array, value])
    return sorted(arrays, key=len)


def contains_as_positions(node: dict[str, Any]) -> None:
    """Replace `contains: C` (at least one item matches C) in an array of at most n items by
    `anyOf` "item i matches C", i < n. Only without `maxContains` and with `minContains`
    at most 1 (`minContains: 0` makes `contains` always true)."""
    if "contains" not in node or "maxContains" in node:
        return
    least = node.get("minContains", 1)
    if not isinstance(least, int) or isinstance(least, bool) or least > 1:
        return
    if least == 0:
        del node["contains"], node["minContains"]
        return
    longest = node.get("maxItems")
    prefix = node.get("prefixItems")
    if isinstance(prefix, list) and node.get("items") is False:
        longest = len(prefix) if longest is None else min(longest, len(prefix))
    if not isinstance(longest, int) or isinstance(longest, bool) or longest > MAX_CONTAINS_POSITIONS:
        return
    found = node.pop("contains")
    node.pop("minContains", None)
    # like `contains`, these constrain arrays only
    positions = [
        {"prefixItems": [*[True] * i, found], "minItems": i + 1} for i in range(longest)
    ] or [{"minItems": 1}]  # no position: no array can contain anything
    node["allOf"] = [*node.get("allOf", []), {"anyOf": positions}]


def item_values(schema: Any, root: Any) -> list[Any] | None:
    """The values an item subschema admits at most, when few: its `enum`/`const`, or a type
    with few values (`boolean`, `null`); None when unbounded."""
    if schema is False:
        return []
    values = finite_values(schema, root)
    if values is not None:
        return values
    if not isinstance(schema, dict):
        return None
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else declared
    if not isinstance(types, list) or set(types) - {"boolean", "null"}:
        return None
    if set(schema) - ANNOTATIONS - {"type"}:
        return None
    return [*([True, False] if "boolean" in types else []), *([None] if "null" in types else [])]


def _same(a: Any, b: Any) -> bool:
    """JSON equality (1 == 1.0, but True != 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b
