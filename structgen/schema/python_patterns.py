"""A schema's patterns in the dialect of Python's `re`, with which jsonschema checks outputs.

JSON Schema's patterns are ECMA-262 regexes, and so the grammar backends read them. Python's
`re` spells one common construct otherwise, a named group: `(?<year>...)` is `(?P<year>...)`
there, and is rewritten so for the check; ECMA's `\\d` and `\\w` are ASCII classes, which
Python's are not (`\\W` refuses "é", which both backends let through), and are written out. A
pattern `re` cannot read at all (`\\p{Lu}`, `\\u{1F600}`) is refused when the schema is built,
naming where, rather than failing every output that reaches it.
"""

from __future__ import annotations

import re
from typing import Any

from structgen.errors import UnsupportedSchemaError
from structgen.schema.keywords import map_subschemas, walk

_CONTAINERS = ("$defs", "definitions")


def python_pattern(pattern: str) -> str:
    """`pattern` as Python's `re` reads it; raises `re.error` where it cannot."""
    translated = _python_dialect(pattern) if "\\" in pattern or "(?<" in pattern else pattern
    re.compile(translated)
    return translated


def python_patterns(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with its patterns (`pattern`, `patternProperties`' names) as `python_pattern`
    writes them: the same object where none needs it. Raises `UnsupportedSchemaError` naming
    the first pattern, in document order, that Python's `re` cannot read."""
    rewrite = False
    for node, path in walk(schema):
        for where, pattern in _patterns(node, path):
            try:
                rewrite |= python_pattern(pattern) != pattern
            except re.error as e:
                raise UnsupportedSchemaError(
                    f"the JSON schema's pattern {pattern!r} at {where} is not a regex Python's re can read "
                    f"({e}), and every output is checked against the schema with it; write it in syntax "
                    "both ECMA-262 and Python read (e.g. [A-Z] for \\p{Lu})", keyword="pattern", path=where) from e
    return _rewritten(schema) if rewrite else schema


def _patterns(node: dict[str, Any], path: str) -> list[tuple[str, str]]:
    found = [(f"{path}/pattern", node["pattern"])] if isinstance(node.get("pattern"), str) else []
    names = node.get("patternProperties")
    if isinstance(names, dict):
        found += [(f"{path}/patternProperties", name) for name in names]
    return found


def _rewritten(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = map_subschemas(node, _rewritten, containers=_CONTAINERS)
    if isinstance(out.get("pattern"), str):
        out["pattern"] = _readable(out["pattern"])
    if isinstance(out.get("patternProperties"), dict):
        out["patternProperties"] = {_readable(name): sub for name, sub in out["patternProperties"].items()}
    return out


def _readable(pattern: str) -> str:
    """`python_pattern`, or the pattern as it is where there is none (an unused definition)."""
    try:
        return python_pattern(pattern)
    except re.error:
        return pattern


# ECMA-262's classes (JSON Schema's patterns; no `u` flag), written out for Python's Unicode ones.
_OUTSIDE = {"d": "[0-9]", "D": "[^0-9]", "w": "[A-Za-z0-9_]", "W": "[^A-Za-z0-9_]"}
_INSIDE = {"d": "0-9", "w": "A-Za-z0-9_"}  # `\\D`, `\\W` inside a class stay Python's


def _python_dialect(pattern: str) -> str:
    """`pattern` with ECMA's spellings in Python's, in one walk that tracks escapes and
    character classes: `(?<name>` written `(?P<name>` (lookbehinds kept), `\\d \\w \\D \\W` as
    ECMA's ASCII classes."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            letter = pattern[i + 1]
            out.append((_INSIDE if in_class else _OUTSIDE).get(letter, pattern[i : i + 2]))
            i += 2
            if in_class and letter in _INSIDE and pattern.startswith("-", i) and not pattern.startswith("-]", i):
                out.append("\\-")  # `[\\w-a]`: no range starts at a class escape; kept a literal
                i += 1
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":  # a leading `]` (after any `^`) is a literal
            in_class, lead = True, i + 1 + pattern.startswith("^", i + 1)
            lead += pattern.startswith("]", lead)
            out.append(pattern[i:lead])
            i = lead
            continue
        elif pattern.startswith("(?<", i) and pattern[i + 3 : i + 4] not in ("=", "!"):
            out.append("(?P<")
            i += 3
            continue
        out.append(c)
        i += 1
    return "".join(out)
