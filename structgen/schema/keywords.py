"""Which JSON-Schema keywords each grammar backend enforces, and a walker that finds the ones
a given schema uses that a backend would not.

A grammar that silently drops a keyword lets the model emit JSON that fails validation, so
`GrammarCompiler(backend="auto")` only uses a backend for a schema when this module finds no
issue for it; coverage is the union of the backends, not their intersection.

The tables were found empirically (xgrammar 0.2.8, llguidance 1.9.1): one small schema per
keyword with a valid and an invalid instance, then the MaskBench invalid instances that a
backend accepted (see tests/grammar/test_grammar.py and benchmarks/eval_grammar.py). Statuses:

- ENFORCED: the backend's grammar rejects every violating instance.
- IGNORED: the backend compiles the schema but accepts instances that violate the keyword.
- REJECTED: the backend refuses to compile the schema (a clean error; auto tries the next one).

llguidance is built to refuse what it cannot enforce, so its issues are mostly REJECTED;
xgrammar silently drops keywords, often depending on what stands next to them, so it also
has the value rules in `_xgrammar_rules`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from structgen.errors import UnsupportedSchemaError

ENFORCED, IGNORED, REJECTED = "enforced", "ignored", "rejected"
BACKENDS = ("xgrammar", "llguidance")  # preference order for "auto"

# Keywords that never make an instance invalid (plus containers of subschemas). Keywords in
# neither this set nor KEYWORDS are unknown to JSON Schema and are annotations too.
ANNOTATIONS = frozenset(
    {
        "$schema", "$id", "$comment", "$vocabulary", "$anchor", "$defs", "definitions",
        "title", "description", "default", "examples", "example", "deprecated", "readOnly",
        "writeOnly", "contentMediaType", "contentEncoding", "contentSchema", "discriminator",
        "nullable", "markdownDescription", "enumDescriptions", "errorMessage",
    }
)  # fmt: skip

#            keyword                 xgrammar   llguidance
KEYWORDS: dict[str, tuple[str, str]] = {
    "type":                  (ENFORCED, ENFORCED),
    "enum":                  (ENFORCED, ENFORCED),  # xgrammar: ignores siblings (rule)
    "const":                 (ENFORCED, ENFORCED),  # xgrammar: ignores siblings (rule)
    "minimum":               (ENFORCED, ENFORCED),
    "maximum":               (ENFORCED, ENFORCED),
    "exclusiveMinimum":      (ENFORCED, ENFORCED),  # xgrammar: rejects draft-4 booleans
    "exclusiveMaximum":      (ENFORCED, ENFORCED),
    "multipleOf":            (ENFORCED, ENFORCED),  # xgrammar: integers, no bounds (rule)
    "minLength":             (ENFORCED, ENFORCED),  # xgrammar: not next to pattern/format
    "maxLength":             (ENFORCED, ENFORCED),
    "pattern":               (ENFORCED, ENFORCED),  # xgrammar: no lookaround, not with format
    "format":                (ENFORCED, ENFORCED),  # per format: FORMATS below
    "items":                 (ENFORCED, ENFORCED),  # xgrammar: rejects the draft-4 array form
    "prefixItems":           (ENFORCED, ENFORCED),
    "additionalItems":       (ENFORCED, ENFORCED),
    "minItems":              (ENFORCED, ENFORCED),
    "maxItems":              (ENFORCED, ENFORCED),
    "uniqueItems":           (IGNORED, REJECTED),
    "contains":              (IGNORED, REJECTED),
    "minContains":           (IGNORED, REJECTED),
    "maxContains":           (IGNORED, REJECTED),
    "unevaluatedItems":      (ENFORCED, REJECTED),
    "properties":            (ENFORCED, ENFORCED),
    "required":              (ENFORCED, ENFORCED),  # xgrammar: only keys in properties (rule)
    "additionalProperties":  (ENFORCED, ENFORCED),
    "patternProperties":     (ENFORCED, ENFORCED),  # xgrammar: not next to properties (rule)
    "propertyNames":         (ENFORCED, REJECTED),  # xgrammar: not next to properties (rule)
    "minProperties":         (ENFORCED, ENFORCED),  # llguidance: rejects unless all required
    "maxProperties":         (ENFORCED, ENFORCED),
    "dependentRequired":     (IGNORED, REJECTED),
    "dependentSchemas":      (IGNORED, REJECTED),
    "dependencies":          (IGNORED, REJECTED),
    "unevaluatedProperties": (IGNORED, REJECTED),
    "allOf":                 (IGNORED, ENFORCED),
    "anyOf":                 (ENFORCED, ENFORCED),  # xgrammar: ignores siblings (rule)
    "oneOf":                 (IGNORED, ENFORCED),   # xgrammar: treated as anyOf; llguidance:
                                                    # rejects unless branches are disjoint
    "not":                   (IGNORED, REJECTED),
    "if":                    (IGNORED, REJECTED),
    "then":                  (IGNORED, REJECTED),
    "else":                  (IGNORED, REJECTED),
    "$ref":                  (ENFORCED, ENFORCED),  # xgrammar: local pointers, no siblings
    "$dynamicRef":           (IGNORED, REJECTED),
    "$dynamicAnchor":        (IGNORED, REJECTED),
    "$recursiveRef":         (IGNORED, REJECTED),
    "$recursiveAnchor":      (IGNORED, REJECTED),
}  # fmt: skip

# Keywords that constrain one JSON type only: every value of another type satisfies them.
KEYWORD_TYPE = {
    **{k: "string" for k in ("minLength", "maxLength", "pattern", "format")},
    **{k: "number" for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")},
    **{
        k: "array"
        for k in (
            "items", "prefixItems", "additionalItems", "contains", "minContains", "maxContains",
            "uniqueItems", "minItems", "maxItems", "unevaluatedItems",
        )
    },
    **{
        k: "object"
        for k in (
            "properties", "patternProperties", "additionalProperties", "required",
            "propertyNames", "minProperties", "maxProperties", "dependentRequired",
            "dependentSchemas", "dependencies", "unevaluatedProperties",
        )
    },
}  # fmt: skip

# `format` values. Formats outside SPEC_FORMATS are annotations (e.g. OpenAPI "int32"):
# xgrammar ignores them, llguidance refuses them, so they are stripped before llguidance.
SPEC_FORMATS = frozenset(
    {
        "date-time", "date", "time", "duration", "email", "idn-email", "hostname",
        "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference",
        "uri-template", "uuid", "json-pointer", "relative-json-pointer", "regex",
    }
)  # fmt: skip
FORMATS = {
    # xgrammar's "date" and "date-time" accept impossible days (2022-02-30, 1990-02-31:
    # MaskBench Glaiveai2K); llguidance's reject them, so those schemas go there.
    "xgrammar": frozenset(
        {
            "time",
            "duration",
            "email",
            "hostname",
            "ipv4",
            "ipv6",
            "uri",
            "uri-reference",
            "uri-template",
            "uuid",
            "json-pointer",
            "relative-json-pointer",
        }
    ),  # fmt: skip
    "llguidance": frozenset(
        {
            "date-time",
            "date",
            "time",
            "duration",
            "email",
            "hostname",
            "ipv4",
            "ipv6",
            "uri",
            "uuid",
        }
    ),
}

# Keywords xgrammar applies only when the subschema declares a `type` they belong to.
_TYPED_KEYWORDS = {
    "minimum": "number", "maximum": "number", "exclusiveMinimum": "number",
    "exclusiveMaximum": "number", "multipleOf": "number", "minLength": "string",
    "maxLength": "string", "pattern": "string", "format": "string", "minItems": "array",
    "maxItems": "array", "minProperties": "object", "maxProperties": "object",
}  # fmt: skip

# Subschema positions: keyword -> how its value holds subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = (
    "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
    "contains", "propertyNames", "not", "if", "then", "else",
)  # fmt: skip

_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def map_subschemas(
    schema: dict[str, Any], fn: Callable[[Any], Any], containers: Iterable[str] = ()
) -> dict[str, Any]:
    """A copy of `schema` with `fn` applied to each of its direct subschemas (at the schema
    positions above, `dependencies` values, and the schemas held in `containers`, e.g.
    "$defs"); other keywords are copied as they are."""
    holders = {"dependencies", *containers}
    out: dict[str, Any] = {}
    for kw, value in schema.items():
        if (kw in _SCHEMA_MAPS or kw in holders) and isinstance(value, dict):
            out[kw] = {k: fn(v) for k, v in value.items()}
        elif (kw in _SCHEMA_LISTS or kw == "items") and isinstance(value, list):
            out[kw] = [fn(v) for v in value]
        elif kw in _SCHEMA_ONE or kw == "items":
            out[kw] = fn(value)
        else:
            out[kw] = value
    return out


@dataclass(frozen=True)
class Issue:
    """A keyword at `path` (a JSON pointer to its subschema) that `backend` would not enforce."""

    keyword: str
    path: str
    backend: str
    status: str  # IGNORED or REJECTED
    reason: str = ""

    def __str__(self) -> str:
        how = "ignores" if self.status == IGNORED else "does not implement"
        detail = f" ({self.reason})" if self.reason else ""
        return f"{self.backend} {how} '{self.keyword}' at {self.path}{detail}"


def resolve_ref(root: Any, ref: str) -> Any | None:
    """Resolve a local `$ref` ("#", "#/$defs/x", ...) in `root`; None if it is not a local JSON
    pointer or points nowhere."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def finite_values(schema: Any, root: Any, depth: int = 0) -> list[Any] | None:
    """The enum/const values that bound `schema`, if any (found through local `$ref`s and in
    `allOf` parts too)."""
    if not isinstance(schema, dict) or depth > 16:
        return None
    if "const" in schema:
        return [schema["const"]]
    if isinstance(schema.get("enum"), list):
        return list(schema["enum"])
    ref = schema.get("$ref")
    if isinstance(ref, str):
        found = finite_values(resolve_ref(root, ref), root, depth + 1)
        if found is not None:
            return found
    for part in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        found = finite_values(part, root, depth + 1)
        if found is not None:
            return found
    return None


def walk(root: Any) -> Iterator[tuple[dict, str]]:
    """Every object subschema reachable from `root`, once, in document order, with its JSON
    pointer. Local `$ref`s are followed; `$defs`/`definitions` are entered only through them,
    so unused definitions do not count."""
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node, path
        children: list[tuple[Any, str]] = []
        for kw, value in node.items():
            if kw in _SCHEMA_MAPS and isinstance(value, dict):
                children += [(v, f"{path}/{kw}/{_escape(k)}") for k, v in value.items()]
            elif kw in _SCHEMA_LISTS and isinstance(value, list):
                children += [(v, f"{path}/{kw}/{i}") for i, v in enumerate(value)]
            elif kw == "items" and isinstance(value, list):
                children += [(v, f"{path}/items/{i}") for i, v in enumerate(value)]
            elif kw == "items" or kw in _SCHEMA_ONE:
                children.append((value, f"{path}/{kw}"))
            elif kw == "dependencies" and isinstance(value, dict):
                children += [(v, f"{path}/{kw}/{_escape(k)}") for k, v in value.items()]
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = resolve_ref(root, ref)
            if target is not None:
                children.append((target, ref))
        stack.extend(reversed(children))


def unresolved_refs(root: Any) -> list[tuple[str, str]]:
    """(ref, path) of local `#/...` references that point nowhere: the schema is broken."""
    return [
        (node["$ref"], path)
        for node, path in walk(root)
        if isinstance(node.get("$ref"), str)
        and node["$ref"].startswith("#/")
        and resolve_ref(root, node["$ref"]) is None
    ]


def ref_loop_error(root: Any) -> str | None:
    """What is wrong with the first chain of local `$ref`s that leads back to itself through
    nodes that are only a `$ref` (and annotations): no schema lies anywhere on the loop, so no
    value can take it and evaluating it never ends. None where there is none."""
    for node, path in walk(root):
        chain: list[str] = []
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and set(node) - ANNOTATIONS == {"$ref"}:
            ref = node["$ref"]
            if ref in chain:
                return (f"$ref chain at {path} ({' -> '.join([*chain, ref])}) leads back to itself with no "
                        "schema on the way: no value can take that path and no validator can evaluate it; "
                        "give one of them content (a type, properties) or drop the loop")
            chain.append(ref)
            node = resolve_ref(root, ref)
    return None


def find_issues(schema: Any, backend: str) -> list[Issue]:
    """Keywords of `schema` that `backend` would ignore or refuse, in document order."""
    column = BACKENDS.index(backend)
    issues: list[Issue] = []
    for node, path in walk(schema):
        for kw in node:
            status = KEYWORDS.get(kw, (ENFORCED, ENFORCED))[column]
            if status != ENFORCED:
                issues.append(Issue(kw, path, backend, status))
        fmt = node.get("format")
        if fmt in SPEC_FORMATS and fmt not in FORMATS[backend]:
            status = IGNORED if backend == "xgrammar" else REJECTED
            issues.append(Issue("format", path, backend, status, f"format {fmt!r}"))
        if backend == "xgrammar":
            # property names are strings whatever the subschema says
            implied = "string" if path.endswith("/propertyNames") else None
            rules = _xgrammar_rules(node, implied)
            issues += [Issue(kw, path, backend, IGNORED, why) for kw, why in rules]
        else:
            issues += [
                Issue(kw, path, backend, REJECTED, why) for kw, why in _llguidance_rules(node)
            ]
    if backend == "llguidance":
        issues += llguidance_crash_issues(schema)
    return issues


def unsupported_schema_error(issues: dict[str, list[Issue]]) -> UnsupportedSchemaError:
    """Name the keyword and JSON path that stops each backend, preferring one that stops all."""
    firsts = {b: found[0] for b, found in issues.items()}
    shared = [
        i for i in next(iter(issues.values()))
        if all(any((j.keyword, j.path) == (i.keyword, i.path) for j in found) for found in issues.values())
    ]  # fmt: skip
    lead = shared[0] if shared else next(iter(firsts.values()))
    if shared:
        detail = "; ".join(
            str(next(j for j in found if (j.keyword, j.path) == (lead.keyword, lead.path)))
            for found in issues.values()
        )
    else:
        detail = "; ".join(str(i) for i in firsts.values())
    return UnsupportedSchemaError(
        f"JSON schema keyword '{lead.keyword}' at {lead.path} cannot be enforced by "
        f"{' or '.join(issues)} ({detail}). Remove or rewrite it, or pass strict=False to "
        "generate best-effort output that is validated afterwards.",
        keyword=lead.keyword,
        path=lead.path,
    )


def xgrammar_compile_cost(schema: Any) -> str | None:
    """Why xgrammar's ahead-of-time compile would take seconds to minutes for `schema`, if it
    would; llguidance builds its lexer lazily and compiles the same schemas in milliseconds.

    xgrammar precomputes token masks for every grammar state, and three shapes multiply the
    states: an open object that lists optional properties (every optional property may be
    followed by any other key; compile time grows steeply with their number), long bounded
    repetitions (`maxLength: 100` is 100 states) and many characters of property names (a
    state per character: one 10,000-character key kept a compile worker busy past the time
    budget, which cannot stop native work; docs/performance.md, "Property names cost
    xgrammar's compile"); `benchmarks/eval_grammar.py` reports compile times.
    """
    key_chars = 0
    for node, path in walk(schema):
        props = node.get("properties")
        key_chars += sum(len(k) for k in props) if isinstance(props, dict) else 0
        if key_chars >= _MANY_KEY_CHARS:
            return f"{key_chars}+ characters of property names up to {path}"
        required = node.get("required") if isinstance(node.get("required"), list) else []
        optional = isinstance(props, dict) and any(k not in required for k in props)
        if optional and node.get("additionalProperties") is not False:
            # All-required open objects stay cheap to compile: the state blow-up
            # comes from optional keys, each of which may be followed by any other.
            return f"open object with optional properties at {path}"
        for kw in ("maxLength", "minLength", "maxItems", "minItems"):
            if isinstance(node.get(kw), int) and node[kw] >= _LONG_REPEAT and "pattern" not in node:
                return f"{kw} {node[kw]} at {path}"
        for pattern, _ in _patterns(node):
            pairs = re.findall(r"\{(\d+)(?:,(\d*))?\}", pattern)
            counts = [int(x) for pair in pairs for x in pair if x]
            if counts and max(counts) >= _LONG_REPEAT:
                return f"repetition {{{max(counts)}}} in a pattern at {path}"
    return None


_LONG_REPEAT = 32
_MANY_KEY_CHARS = 400  # property-name characters in a whole schema: seconds of xgrammar compile


def strip_annotation_formats(schema: Any) -> Any:
    """A copy of `schema` without `format` values outside the JSON-Schema spec (annotations
    such as "int32" that llguidance would refuse). Walks every position, $defs included."""
    if isinstance(schema, list):
        return [strip_annotation_formats(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "format" and isinstance(v, str) and v not in SPEC_FORMATS:
            continue
        if k in ("enum", "const", "default", "examples", "example"):
            out[k] = v  # instances, not schemas: a property named "format" is data here
        else:
            out[k] = strip_annotation_formats(v)
    return out


def regex_issue(pattern: str) -> str | None:
    """Why xgrammar would not enforce `pattern` exactly (it drops lookahead silently)."""
    if _LOOKAROUND.search(pattern):
        return "lookaround in pattern"
    return None


# xgrammar reads \D and \W as the complements of ASCII classes, so they admit the Unicode
# digits and letters that Python's re, which checks outputs, counts as \d and \w ("\u0663", "é").
_NEGATED_UNICODE_CLASS = re.compile(r"(?<!\\)(?:\\\\)*\\[DW]")


def ascii_class_issue(pattern: str) -> str | None:
    """Why xgrammar would admit text the output check refuses: `\\D` or `\\W` in `pattern`."""
    if _NEGATED_UNICODE_CLASS.search(pattern):
        return "\\D or \\W, which xgrammar reads as ASCII classes (wider than Python's Unicode ones)"
    return None


def _xgrammar_rules(node: dict, implied_type: str | None = None) -> Iterator[tuple[str, str]]:
    """xgrammar's value- and sibling-dependent gaps, each found by a probe schema."""
    declared = node.get("type", implied_type)
    types = set(declared) if isinstance(declared, list) else {declared} if declared else set()
    siblings = {k for k in node if k not in ANNOTATIONS}

    for kw in ("enum", "const"):
        if kw in node and siblings - {"enum", "const"} and not _values_fit(node, kw):
            yield kw, f"'{kw}' replaces the keywords next to it, and some values violate them"
    if "enum" in node or "const" in node:
        return  # xgrammar checks only the values here, which were just checked
    for kw in ("anyOf", "oneOf"):
        if kw in node and siblings - {kw}:
            yield kw, f"keywords next to '{kw}' are ignored: {', '.join(sorted(siblings - {kw}))}"
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref != "#" and not ref.startswith("#/"):
            yield "$ref", f"non-local reference {ref!r}"
        elif siblings - {"$ref"}:
            yield (
                "$ref",
                f"keywords next to '$ref' are ignored: {', '.join(sorted(siblings - {'$ref'}))}",
            )
    if not types:
        for kw, needs in _TYPED_KEYWORDS.items():
            if kw in node:
                yield kw, f'applied only when the subschema declares "type": "{needs}"'
    fmt = node.get("format")
    if "string" in types and fmt in FORMATS["xgrammar"]:
        for kw in ("pattern", "minLength", "maxLength"):
            if kw in node:
                yield kw, f"ignored next to format {fmt!r}"
    elif "string" in types and "pattern" in node:
        for kw in ("minLength", "maxLength"):
            if kw in node:
                yield kw, "ignored next to 'pattern'"
    elif "string" in types:
        for kw in ("minLength", "maxLength"):
            if kw in node:
                yield kw, "a length-bounded string admits raw control characters (invalid JSON)"
    for pattern, where in _patterns(node):
        why = regex_issue(pattern) or (
            None if _anchored(pattern) else "matched against the whole string, not searched"
        ) or _raw_quote_or_backslash(pattern)
        if why:
            yield where, why
    if "multipleOf" in node and types & {"number", "integer"}:
        if "number" in types or not isinstance(node["multipleOf"], int):
            yield "multipleOf", "enforced only for integer types and integer divisors"
        elif set(node) & {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}:
            yield "multipleOf", "ignored next to a minimum or maximum"
    required = node.get("required")
    if isinstance(required, list):
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [k for k in required if k not in props]
        if missing:
            yield "required", f"required keys not listed in 'properties': {missing}"
    if "patternProperties" in node and ("properties" in node or not types):
        yield "patternProperties", 'applied only with "type": "object" and no \'properties\''
    if "propertyNames" in node and "properties" in node:
        yield "propertyNames", "not applied to the keys listed in 'properties'"
    elif "propertyNames" in node and not types:
        yield "propertyNames", 'applied only with "type": "object" or \'properties\''


def _anchored(pattern: str) -> bool:
    """Does `pattern` match only whole strings (every alternative starts with `^` and ends
    with `$`)? Then matching it whole, as xgrammar does, is the same as JSON Schema's
    search; for "[a-z]+" it is not ("ab1" is valid)."""
    import re._parser as sre  # the stdlib's regex parser, for the structure

    def edge(seq: list, at: Any, i: int) -> bool:
        if not seq:
            return False
        op, av = seq[i]
        if op is sre.BRANCH:
            return all(edge(list(b), at, i) for b in av[1])
        if op is sre.SUBPATTERN:
            return edge(list(av[-1]), at, i)
        return (op, av) == (sre.AT, at)

    try:
        parsed = list(sre.parse(pattern))
    except (re.error, RecursionError, OverflowError):
        return False
    return edge(parsed, sre.AT_BEGINNING, 0) and edge(parsed, sre.AT_END, -1)


def _raw_quote_or_backslash(pattern: str) -> str | None:
    """Why xgrammar would write invalid JSON for `pattern`: a `"` or `\\` it matches outside a
    character class goes into the JSON string unescaped (`^"a"$` accepts `""a""`; in a class
    xgrammar leaves them out, which is stricter but sound)."""
    import re._parser as sre  # the stdlib's regex parser, for the structure

    repeats = {sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", sre.MAX_REPEAT)}

    def raw(items: Iterable) -> bool:
        for op, av in items:
            if op is sre.LITERAL and av in (0x22, 0x5C):
                return True
            if (op is sre.SUBPATTERN and raw(av[-1])) or (op in repeats and raw(av[2])):
                return True
            if op is sre.BRANCH and any(raw(branch) for branch in av[1]):
                return True
        return False

    try:
        found = raw(sre.parse(pattern))
    except (re.error, RecursionError, OverflowError):
        return None
    return "a literal '\"' or '\\' in the pattern, which xgrammar writes unescaped (invalid JSON)" if found else None


def _llguidance_rules(node: dict) -> Iterator[tuple[str, str]]:
    """llguidance refuses these with an error, or builds something else; listing them saves a
    compile and names them."""
    for pattern, where in _patterns(node):
        if _LOOKAROUND.search(pattern):
            yield where, "lookaround in pattern"
    if _declares_integer(node):
        for kw in ("minimum", "exclusiveMinimum"):
            if _is_number(node.get(kw)) and node[kw] >= 2**63 - 1:
                yield kw, ("an integer's lower bound past 2**63 - 1, which llguidance reads as 2**63 - 1, so "
                           "it would write 9223372036854775807, below the bound; keep integers within 9.2e18")


# llguidance turns integer ranges into regexes with 64-bit bounds (saturating), writing a
# negative range as the negation of a positive one: a range whose ends both saturate to -2**63
# negates to itself and recurses until the native stack overflows, killing the process. It
# makes such a range from an integer literal in a const or enum (read as a 64-bit integer) and,
# since allOf merges a number from one subschema with "type": "integer" from another, from any
# number in a schema that declares an integer type.
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "const", "enum")
_INT64_MIN = -(2.0**63)


def llguidance_crash_issues(schema: Any) -> list[Issue]:
    """What would crash llguidance's native compiler (a stack overflow, not an error) in
    `schema`: numbers at or below -2**63 that it reads as 64-bit integers. The llguidance
    adapter refuses these itself too, so best-effort (strict=False) compiles never reach it."""
    nodes = list(walk(schema))
    integers = any(_declares_integer(node) for node, _ in nodes)
    return [
        Issue(
            kw, path, "llguidance", REJECTED,
            "a number at or below -2**63 read as a 64-bit integer, whose range llguidance "
            "cannot build; keep integers within -9.2e18..9.2e18",
        )
        for node, path in nodes
        for kw in _NUMBER_BOUNDS
        if kw in node and _has_int64_underflow(node[kw], integers)
    ]  # fmt: skip


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _declares_integer(node: dict) -> bool:
    declared = node.get("type")
    return declared == "integer" or (isinstance(declared, list) and "integer" in declared)


def _has_int64_underflow(value: Any, integers: bool) -> bool:
    """Is there, at any depth of `value`, a number at or below -2**63 (rounded to a double, as
    llguidance reads it) that llguidance takes for an integer: an integer literal, or any
    number when `integers` (the schema declares an integer type)?"""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        if not (integers or isinstance(value, int)):
            return False
        try:
            return float(value) <= _INT64_MIN
        except OverflowError:  # an integer literal beyond the double range
            return value < 0
    if isinstance(value, list):
        return any(_has_int64_underflow(v, integers) for v in value)
    if isinstance(value, dict):
        return any(_has_int64_underflow(v, integers) for v in value.values())
    return False


def _patterns(node: dict) -> Iterator[tuple[str, str]]:
    if isinstance(node.get("pattern"), str):
        yield node["pattern"], "pattern"
    if isinstance(node.get("patternProperties"), dict):
        for p in node["patternProperties"]:
            yield p, "patternProperties"


def _values_fit(node: dict, kw: str) -> bool:
    """Do all enum/const values satisfy the keywords next to them? (Then xgrammar's habit of
    checking only the values is harmless.)"""
    import jsonschema

    rest = {k: v for k, v in node.items() if k not in ("enum", "const")}
    if any(k in rest for k in ("$ref", "allOf", "anyOf", "oneOf", "not", "if")):
        return False  # cannot check without the rest of the document
    values = node[kw] if kw == "enum" and isinstance(node[kw], list) else [node[kw]]
    try:
        validator = jsonschema.Draft202012Validator(rest)
        return all(validator.is_valid(v) for v in values)
    except Exception:  # a malformed sibling: let the backend decide
        return False


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")
