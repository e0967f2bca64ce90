"""Patterns rewritten into forms the backends handle, through automata (`regex_dfa`).

- Lookaround and `^`/`$` inside a pattern: neither backend implements them (llguidance
  refuses, xgrammar ignores the anchor); where `regex_dfa` reads the pattern, it is written
  back as the same language without them.
- An optional group that ends in a repetition: xgrammar lets a string skip what precedes the
  repetition (`a(xb+)?` accepts "ab", `\\d{1,3}(\\.\\d{1,2})?` "1234"). Every `(...)?` is written
  `(...|)`, the same language, which xgrammar matches exactly.
- A regex output's `.`: xgrammar reads it as any character, Python's `re` (which checks the
  output) as any but a newline; `dot_without_newline` writes it so for xgrammar.
- Several patterns on one string (a `pattern` and `allOf` parts that only add patterns, as
  `oneOf` branches made exclusive get; or a string schema that combines patterns with
  `anyOf`/`oneOf`/`not`/`$ref`): llguidance must decide whether their combination is empty
  and sometimes cannot, xgrammar and llguidance implement no `not`; they become one pattern.
Each rewrite keeps the schema as it is when an automaton is unsupported or too large.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from structgen.schema.keywords import ANNOTATIONS, KEYWORD_TYPE, KEYWORDS, regex_issue
from structgen.schema.regex_dfa import Language, has_inner_anchor


def patterns_for_backends(node: dict[str, Any]) -> None:
    """Neither backend implements lookaround, nor `^`/`$` inside a pattern (`(a(,|$))+`);
    where `regex_dfa` handles one (a leading `^(?!...)`, a trailing `(?=...)`, any anchor),
    the pattern is rewritten as the same language without it."""
    if isinstance(node.get("pattern"), str):
        node["pattern"] = backend_pattern(node["pattern"])
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict):
        node["patternProperties"] = {backend_pattern(p): sub for p, sub in patterns.items()}


def backend_pattern(pattern: str) -> str:
    if regex_issue(pattern) or has_inner_anchor(pattern):
        language = Language.of_pattern(pattern)
        rewritten = language.to_pattern() if language is not None else None
        pattern = pattern if rewritten is None else rewritten
    return optional_groups_as_alternatives(pattern)


_LOOKAROUND_OPENERS = ("(?=", "(?!", "(?<=", "(?<!")


def optional_groups_as_alternatives(pattern: str) -> str:
    """Every `(...)?` (and lazy `(...)??`) of `pattern` written `(...|)`, the same language
    (a quantified lookaround is left alone)."""
    out: list[str] = []
    openers: list[str] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        end = i + 1
        if ch == "\\":
            end = i + 2
        elif ch == "[":
            end = _class_end(pattern, i)
        elif ch == "(":
            openers.append(pattern[i : i + 4])
        elif ch == ")" and openers:
            lookaround = openers.pop().startswith(_LOOKAROUND_OPENERS)
            if pattern.startswith("?", end) and not lookaround:
                out.append("|)")
                i = end + 2 if pattern.startswith("??", end) else end + 1
                continue
        out.append(pattern[i:end])
        i = end
    return "".join(out)


def dot_without_newline(pattern: str) -> str:
    """`pattern` with each `.` outside a character class written `[^\\n]`: Python's `re`, which
    checks a regex output, reads `.` so; xgrammar's regexes read it as any character, newline
    included."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        end = i + 2 if ch == "\\" else _class_end(pattern, i) if ch == "[" else i + 1
        out.append("[^\\n]" if ch == "." else pattern[i:end])
        i = end
    return "".join(out)


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class that opens at `start` (a `]` first is literal)."""
    i = start + 1
    i += pattern.startswith("^", i)
    i += pattern.startswith("]", i)
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def merge_string_patterns(node: dict[str, Any]) -> None:
    """A node's `pattern` and the `allOf` parts that only add a pattern (`{"pattern": p}`,
    `{"type": "string", "pattern": p}`) become one pattern, their intersection."""
    parts = node.get("allOf")
    if not isinstance(parts, list):
        return
    only_pattern = [i for i, part in enumerate(parts) if _pattern_only(part)]
    own = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if len(only_pattern) + len(own) < 2:
        return
    language: Language | None = None
    for pattern in [*own, *(parts[i]["pattern"] for i in only_pattern)]:
        other = Language.of_pattern(pattern)
        if other is None:
            return
        language = other if language is None else language.intersect(other)
        if language is None:
            return
    pattern = language.to_pattern() if language is not None else None
    if pattern is None:
        return
    typed = any(parts[i].get("type") == "string" for i in only_pattern)
    rest = [part for i, part in enumerate(parts) if i not in only_pattern]
    if typed and node.get("type") != "string":
        rest.append({"type": "string"})  # the parts also required a string
    node["pattern"] = pattern
    if rest:
        node["allOf"] = rest
    else:
        del node["allOf"]


def _pattern_only(part: Any) -> bool:
    if not isinstance(part, dict) or not isinstance(part.get("pattern"), str):
        return False
    live = _live(part)
    return live == {"pattern"} or (live == {"pattern", "type"} and part["type"] == "string")


def _live(schema: dict[str, Any]) -> set[str]:
    """The keywords of `schema` that can fail an instance (unknown ones are annotations)."""
    return {k for k in schema if k in KEYWORDS and k not in ANNOTATIONS}


_STRING_KEYWORDS = frozenset(
    {"type", "pattern", "enum", "const", "allOf", "anyOf", "oneOf", "not", "$ref", "minLength", "maxLength"}
)
_MAX_LENGTH_AS_PATTERN = 64


def string_schema(schema: dict[str, Any], resolve: Callable[[str], Any]) -> dict[str, Any] | None:
    """A string schema whose patterns are combined by `allOf`/`anyOf`/`oneOf`/`not`/`$ref`
    as one `pattern` (the language of the combination); None when it is not such a schema
    or an automaton is unsupported. `type: string` is required at the top: below it, a
    `not` only has to be exact among strings. Lengths at the top stay keywords (llguidance
    counts them better than a regex could)."""
    if schema.get("type") != "string" or not set(schema) & {"allOf", "anyOf", "oneOf", "not", "$ref"}:
        return None
    if _live(schema) - _STRING_KEYWORDS:
        return None
    top = {k: schema[k] for k in ("minLength", "maxLength") if k in schema}
    inner = {k: v for k, v in schema.items() if k not in top}
    language = _string_language(inner, resolve, 0)
    pattern = language.to_pattern() if language is not None else None
    if pattern is None:
        return None
    notes = {k: v for k, v in schema.items() if k not in KEYWORDS or k in ANNOTATIONS}
    return {**notes, "type": "string", "pattern": pattern, **top}


def _string_language(schema: Any, resolve: Callable[[str], Any], depth: int) -> Language | None:
    """The strings `schema` admits, as an automaton; None if unknown."""
    if schema is True or schema == {}:
        return Language.of_pattern("")
    if schema is False:
        return Language.of_strings([])
    if not isinstance(schema, dict) or depth > 16:
        return None
    if {k for k in _live(schema) if KEYWORD_TYPE.get(k, "string") == "string"} - _STRING_KEYWORDS:
        return None  # (keywords of other types are true for every string)
    parts: list[Language | None] = []
    declared = schema.get("type")
    if declared is not None and declared != "string" and not (
        isinstance(declared, list) and "string" in declared
    ):
        return Language.of_strings([])
    if isinstance(schema.get("pattern"), str):
        parts.append(Language.of_pattern(schema["pattern"]))
    if "minLength" in schema or "maxLength" in schema:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        bounds = [low] if high is None else [low, high]
        if not all(_count(b) for b in bounds) or max(bounds) > _MAX_LENGTH_AS_PATTERN:
            return None
        parts.append(Language.of_pattern(f"\\A[\\s\\S]{{{low},{'' if high is None else high}}}\\Z"))
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        if not isinstance(values, list):
            return None
        parts.append(Language.of_strings([v for v in values if isinstance(v, str)]))
    if isinstance(schema.get("$ref"), str):
        parts.append(_string_language(resolve(schema["$ref"]), resolve, depth + 1))
    for part in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        parts.append(_string_language(part, resolve, depth + 1))
    for kw in ("anyOf", "oneOf"):
        if isinstance(schema.get(kw), list):
            branches = [_string_language(b, resolve, depth + 1) for b in schema[kw]]
            parts.append(_union(branches) if kw == "anyOf" else _exactly_one(branches))
    if "not" in schema:
        negated = _string_language(schema["not"], resolve, depth + 1)
        parts.append(negated.complement() if negated is not None else None)
    language: Language | None = Language.of_pattern("")
    for part in parts:
        if part is None or language is None:
            return None
        language = language.intersect(part)
    return language


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _union(languages: list[Language | None]) -> Language | None:
    out: Language | None = Language.of_strings([])
    for language in languages:
        if language is None or out is None:
            return None
        both_out = out.complement().intersect(language.complement())
        out = both_out.complement() if both_out is not None else None
    return out


def _exactly_one(languages: list[Language | None]) -> Language | None:
    """Strings in exactly one of `languages`."""
    if any(language is None for language in languages):
        return None
    pieces = []
    for i, language in enumerate(languages):
        others = _union([x for j, x in enumerate(languages) if j != i])
        if others is None:
            return None
        pieces.append(language.intersect(others.complement()))
    return _union(pieces)


REGEX_META = set("\\.^$|?*+()[]{}/")


def escape_regex(text: str) -> str:
    """Escape only true metacharacters: both backends' dialects (ECMAScript-like and Rust)
    reject some escapes Python's `re.escape` writes."""
    out = []
    for ch in text:
        if ch in REGEX_META:
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        else:
            out.append(ch)
    return "".join(out)
