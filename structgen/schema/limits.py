"""Size limits a constraint must meet before any recursive or superlinear work starts on it.

Normalizing a schema, checking it against its metaschema and building a grammar all recurse
over its nesting and some work grows with the square of an enum's length; a small request can
ask for any amount of both. These checks are iterative and linear in the text, so they run
first: `check_source` on any constraint text, `check_schema` on a parsed JSON schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from structgen.errors import ConstraintTooLargeError

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_ESCAPE = re.compile(r"\\.", re.DOTALL)


@dataclass(frozen=True)
class ConstraintLimits:
    """The largest constraint a compiler takes; each can be raised through
    `LLM(..., limits=ConstraintLimits(...))` (or `GrammarCompiler(limits=...)`).

    max_source_bytes: the schema / regex / grammar text, UTF-8.
    max_depth: bracket nesting of the text (JSON `{`/`[`, regex and grammar parentheses); a
        schema level nested through `properties` counts two. At most the default: deeper would
        overflow Python's recursion (`BUILD_LIMITS`, what `to_constraint` refuses whatever a
        compiler allows, and at most 64 MiB of text).
    max_enum_values: `enum` and `const` values in a whole JSON schema.
    """

    max_source_bytes: int = 1_000_000
    max_depth: int = 64
    max_enum_values: int = 10_000


DEFAULT_LIMITS = ConstraintLimits()


def check_source(kind: str, source: str, description: str, limits: ConstraintLimits = DEFAULT_LIMITS) -> None:
    """Refuse constraint text over the byte or nesting limit (`kind`: "json_schema", "regex",
    "grammar" or "text"), then, for JSON schemas, over the enum limit."""
    size = len(source.encode("utf-8", errors="surrogatepass"))
    if size > limits.max_source_bytes:
        raise _too_large(description, "max_source_bytes", f"is {size:,} bytes", limits)
    if kind == "json_schema":
        depth = nesting_depth(_JSON_STRING.sub('""', source), "{[", "}]")
    elif kind in ("regex", "grammar"):
        depth = nesting_depth(_ESCAPE.sub("", source), "(", ")")
    else:
        return
    if depth > limits.max_depth:
        raise _too_large(description, "max_depth", f"nests {depth} levels deep", limits)
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except ValueError:
            return  # not JSON: the caller's parse says where
        check_schema(schema, description, limits)


# What `to_constraint` refuses before its recursive work (metaschema check, normalization),
# whatever a compiler allows: the deepest nesting Python's recursion takes, and a text size no
# compiler's limit may pass; not enum values (linear there; a compiler's limit counts them).
BUILD_LIMITS = ConstraintLimits(max_source_bytes=64 << 20, max_enum_values=1 << 62)


def check_json_schema(schema: Any) -> None:
    """`check_source` for JSON-schema text, `check_schema` for a parsed schema, with
    `BUILD_LIMITS`: what `to_constraint` runs first."""
    if isinstance(schema, str):
        check_source("json_schema", schema, "JSON schema", BUILD_LIMITS)
    else:
        check_schema(schema, "JSON schema", BUILD_LIMITS)


def check_schema(schema: Any, description: str = "JSON schema", limits: ConstraintLimits = DEFAULT_LIMITS) -> None:
    """Refuse a parsed JSON schema nested deeper than `max_depth` or with more than
    `max_enum_values` enum/const values, by one iterative walk that stops at the first limit."""
    values = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_depth and isinstance(node, (dict, list)):
            raise _too_large(description, "max_depth", f"nests more than {depth - 1} levels deep", limits)
        if isinstance(node, dict):
            enum = node.get("enum")
            values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
            if values > limits.max_enum_values:
                raise _too_large(description, "max_enum_values", f"has {values:,} enum/const values (or more)", limits)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def nesting_depth(text: str, opening: str, closing: str) -> int:
    """The deepest bracket nesting in `text` (brackets inside strings removed beforehand)."""
    codes = np.frombuffer(text.encode("utf-8", errors="surrogatepass"), dtype=np.uint8)
    steps = np.zeros(len(codes), dtype=np.int32)
    for c in opening:
        steps[codes == ord(c)] = 1
    for c in closing:
        steps[codes == ord(c)] = -1
    return int(np.cumsum(steps).max(initial=0))


def _too_large(description: str, limit: str, what: str, limits: ConstraintLimits) -> ConstraintTooLargeError:
    value = getattr(limits, limit)
    problem = f"{description} {what}, over the limit {limit}={value:,}"
    if limit == "max_depth" and value >= BUILD_LIMITS.max_depth:
        return ConstraintTooLargeError(f"{problem}; make it smaller (deeper constraints would overflow Python's "
                                       "recursion limit)")
    if limits is BUILD_LIMITS:
        return ConstraintTooLargeError(f"{problem}; make it smaller (no constraint may be larger)")
    return ConstraintTooLargeError(problem, limit=limit)
