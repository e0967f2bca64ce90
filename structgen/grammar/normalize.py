"""Equivalent rewrites of a JSON schema into keywords the grammar backends enforce.

Every rewrite here keeps the set of valid instances exactly the same (outputs are still
validated against the user's original schema); it only moves the schema into the subset the
backends can compile:

- finite schemas: a subschema with `enum`/`const` (directly or in an `allOf` part) admits at
  most those values, so it becomes `{"enum": [the values that pass the whole subschema]}`.
  This removes whatever else stood there (`not`, `if`, `uniqueItems`, ...), and xgrammar's
  habit of checking an enum while ignoring its siblings becomes harmless.
- `dependentRequired` / `dependentSchemas` / `dependencies`: "if key k is present then ..."
  becomes `anyOf: [{k absent}, {k present and ...}]`, with "absent" as `properties: {k: false}`.
  (`dependencies` is applied under every draft: 2019-09 split it in two, but a schema that
  still uses it means it.)
- `not`: pushed inward (De Morgan) where the negation of each keyword is itself a keyword,
  e.g. `not {minimum: 3}` is `{type: number, exclusiveMaximum: 3}` and `not {enum: ["a"]}`
  is "another type, or a string matching an exclusion pattern"; left alone otherwise.
- `if`/`then`/`else`: `anyOf: [allOf [if, then], allOf [not if, else]]` when `not if` is.
- `oneOf` whose branches provably share no instance (`disjoint.py`) is `anyOf`.
- draft-4 boolean `exclusiveMinimum`/`exclusiveMaximum` become the numeric form, and in
  drafts 4-7 the keywords next to a `$ref` (which those drafts ignore) are dropped.
"""

from __future__ import annotations

from typing import Any

from structgen.grammar.disjoint import pairwise_disjoint
from structgen.grammar.keywords import ANNOTATIONS, finite_values

_TYPES = ("null", "boolean", "object", "array", "string", "number")
# keyword -> (its negation's keyword, offset, the type it constrains): not {minLength: n} is
# {type: string, maxLength: n - 1}.
_COUNT_BOUNDS = {
    "minLength": ("maxLength", -1, "string"),
    "maxLength": ("minLength", +1, "string"),
    "minItems": ("maxItems", -1, "array"),
    "maxItems": ("minItems", +1, "array"),
    "minProperties": ("maxProperties", -1, "object"),
    "maxProperties": ("minProperties", +1, "object"),
}
_NUMBER_BOUNDS = {
    "minimum": "exclusiveMaximum",
    "maximum": "exclusiveMinimum",
    "exclusiveMinimum": "maximum",
    "exclusiveMaximum": "minimum",
}
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = (
    "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
    "contains", "propertyNames", "not", "if", "then", "else",
)  # fmt: skip


def normalize_schema(schema: Any) -> Any:
    """An equivalent schema the backends can enforce more of (see module doc)."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    old_drafts = (
        jsonschema.Draft3Validator,
        jsonschema.Draft4Validator,
        jsonschema.Draft6Validator,
        jsonschema.Draft7Validator,
    )
    return _Normalizer(schema, cls(schema), ref_overrides=cls in old_drafts).node(schema, 0)


class _Normalizer:
    def __init__(self, root: Any, validator: Any, ref_overrides: bool):
        self.root = root
        self.validator = validator  # resolves $refs against the original document
        self.ref_overrides = ref_overrides  # drafts <= 7: "$ref" makes its siblings inert

    def node(self, schema: Any, depth: int) -> Any:
        if not isinstance(schema, dict) or depth > 200:
            return schema
        if self.ref_overrides and "$ref" in schema:
            schema = {k: v for k, v in schema.items() if k == "$ref" or k in ANNOTATIONS}
        values = finite_values(schema, self.root)
        if values is not None:
            return self._finite(schema, values)
        out: dict[str, Any] = {}
        for kw, value in schema.items():
            if kw in _SUBSCHEMA_MAPS and isinstance(value, dict):
                out[kw] = {k: self.node(v, depth + 1) for k, v in value.items()}
            elif kw in _SUBSCHEMA_LISTS and isinstance(value, list):
                out[kw] = [self.node(v, depth + 1) for v in value]
            elif kw == "items" and isinstance(value, list):
                out[kw] = [self.node(v, depth + 1) for v in value]
            elif kw in _SUBSCHEMA_ONE or kw == "items":
                out[kw] = self.node(value, depth + 1)
            elif kw == "dependencies" and isinstance(value, dict):
                out[kw] = {k: self.node(v, depth + 1) for k, v in value.items()}
            else:
                out[kw] = value
        branches = schema.get("oneOf")
        if isinstance(branches, list) and "anyOf" not in out and pairwise_disjoint(branches, self.root, self.ref_overrides):
            out["anyOf"] = out.pop("oneOf")  # no two branches share an instance: same set
        _draft4_exclusive_bounds(out)
        _dependencies_as_any_of(out)
        _if_then_else_as_any_of(out)
        negated = negate(out["not"]) if "not" in out else None
        if negated is not None:
            del out["not"]
            out["allOf"] = [*out.get("allOf", []), negated]
        return out

    def _finite(self, schema: dict[str, Any], values: list[Any]) -> Any:
        try:
            check = self.validator.evolve(schema=schema)
            kept = [v for v in values if check.is_valid(v)]
        except Exception:  # something jsonschema cannot evaluate: leave it to the backends
            return schema
        if not kept:
            return False
        keep = {
            k: v
            for k, v in schema.items()
            if k in ANNOTATIONS and k not in ("$defs", "definitions")
        }
        kept = _dedupe(kept)
        scalars = [v for v in kept if not _is_container(v)]
        # Objects and arrays become their structure, so they are written in our JSON format
        # (xgrammar writes enum objects compactly, as '{"a":1}').
        alternatives = [_literal_schema(v) for v in kept if _is_container(v)]
        if scalars:
            alternatives.insert(0, {"enum": scalars})
        if len(alternatives) == 1:
            return {**keep, **alternatives[0]}
        return {**keep, "anyOf": alternatives}


def negate(schema: Any) -> Any | None:
    """A schema valid exactly where `schema` is not, using only enforceable keywords; None if
    this module does not know one."""
    if schema is True:
        return False
    if schema is False:
        return {}
    if not isinstance(schema, dict):
        return None
    parts = {k: v for k, v in schema.items() if k not in ANNOTATIONS}
    if not parts:
        return False
    if "not" in parts and len(parts) == 1:
        return parts["not"]
    if set(parts) & {"additionalProperties", "patternProperties", "unevaluatedProperties"}:
        return None  # these depend on their neighbours; no per-keyword negation
    alternatives = []
    for kw, value in parts.items():
        alt = _negate_keyword(kw, value)
        if alt is None:
            return None
        alternatives.append(alt)
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


def _negate_keyword(kw: str, value: Any) -> Any | None:
    """not {kw: value}. Keywords that only constrain one type are vacuously true for other
    types, so their negation is of that type."""
    if kw == "type":
        types = (
            {value} if isinstance(value, str) else set(value) if isinstance(value, list) else None
        )
        if types is None or ("integer" in types and "number" not in types):
            return None  # "a number that is not an integer" has no keyword
        rest = [t for t in _TYPES if t not in types and not (t == "number" and "integer" in types)]
        return {"type": rest} if rest else False
    if kw == "required" and isinstance(value, list):
        if not value:
            return False
        absent = [{"properties": {k: False}} for k in value]
        return {"type": "object", **(absent[0] if len(absent) == 1 else {"anyOf": absent})}
    if kw in _NUMBER_BOUNDS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"type": "number", _NUMBER_BOUNDS[kw]: value}
    if kw in _COUNT_BOUNDS and isinstance(value, int) and not isinstance(value, bool):
        other, step, typ = _COUNT_BOUNDS[kw]
        if value + step < 0:
            return False
        return {"type": typ, other: value + step}
    if kw == "properties" and isinstance(value, dict):
        alts = []
        for k, sub in value.items():
            neg = negate(sub)
            if neg is None:
                return None
            if neg is not False:
                alts.append({"type": "object", "required": [k], "properties": {k: neg}})
        if not alts:
            return False
        return alts[0] if len(alts) == 1 else {"anyOf": alts}
    if kw == "anyOf" and isinstance(value, list):
        negs = [negate(v) for v in value]
        return None if any(n is None for n in negs) else {"allOf": negs}
    if kw == "allOf" and isinstance(value, list):
        negs = [negate(v) for v in value]
        return None if any(n is None for n in negs) else {"anyOf": negs}
    if kw == "not":
        return value
    if kw == "enum" and isinstance(value, list):
        return _negate_values(value)
    if kw == "const":
        return _negate_values([value])
    return None


def _negate_values(values: list[Any]) -> Any | None:
    """Any JSON value except `values` (scalars only): the other types whole, plus the
    complement within each type (strings by an exclusion pattern, numbers by intervals)."""
    if any(isinstance(v, (dict, list)) for v in values):
        return None
    strings = sorted({v for v in values if isinstance(v, str)})
    numbers = sorted({v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)})
    bools = {v for v in values if isinstance(v, bool)}
    if len(numbers) > 32 or any(ord(c) < 0x20 for v in strings for c in v):
        return None
    free = ["object", "array"] + [t for t, hit in (("null", None in values),) if not hit]
    alternatives: list[Any] = []
    if not bools:
        free.append("boolean")
    elif len(bools) == 1:
        alternatives.append({"const": not next(iter(bools))})
    if strings:
        alternatives.append({"type": "string", "pattern": f"^(?:{_exclusion_regex(strings)})$"})
    else:
        free.append("string")
    if numbers:
        bounds = [{"exclusiveMaximum": numbers[0]}]
        bounds += [
            {"exclusiveMinimum": a, "exclusiveMaximum": b}
            for a, b in zip(numbers, numbers[1:], strict=False)
        ]
        bounds.append({"exclusiveMinimum": numbers[-1]})
        alternatives += [{"type": "number", **b} for b in bounds]
    else:
        free.append("number")
    return {"anyOf": [{"type": free}, *alternatives]}


def _exclusion_regex(words: list[str]) -> str:
    """A regex (JSON Schema dialect, to be anchored) for every string except `words`: walk
    their trie; leave it early (a character no word has there), stop at a node that ends no
    word, or run on past a node that does."""
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}  # end of a word

    def regex(node: dict[str, Any]) -> str:
        children = sorted(k for k in node if k)
        alts = [] if "" in node else [""]
        if children:
            alts.append(f"[^{''.join(_class_escape(c) for c in children)}][\\s\\S]*")
        else:
            alts.append("[\\s\\S]+")
        alts += [_escape(c) + regex(node[c]) for c in children]
        return "(?:" + "|".join(alts) + ")"

    return regex(trie)


def _escape(ch: str) -> str:
    return "\\" + ch if ch in "\\.^$|?*+()[]{}/" else ch


def _class_escape(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-[" else ch


def _if_then_else_as_any_of(node: dict[str, Any]) -> None:
    """`if I then T else E` is `anyOf: [allOf [I, T], allOf [not I, E]]` when `not I` has
    keywords; `then`/`else` without `if` do nothing and are dropped."""
    if "if" not in node:
        node.pop("then", None)
        node.pop("else", None)
        return
    neg = negate(node["if"])
    if neg is None:
        return
    cond, then, other = node.pop("if"), node.pop("then", True), node.pop("else", True)
    branch = [_all_of(cond, then), _all_of(neg, other)]
    node["allOf"] = [*node.get("allOf", []), {"anyOf": branch}]


def _all_of(*schemas: Any) -> Any:
    parts = [s for s in schemas if s is not True and s != {}]
    if not parts:
        return {}
    return parts[0] if len(parts) == 1 else {"allOf": parts}


def _dependencies_as_any_of(node: dict[str, Any]) -> None:
    """`dependentRequired`/`dependentSchemas`/`dependencies` -> allOf of anyOf alternatives."""
    rules: list[tuple[str, Any]] = []
    for kw in ("dependentRequired", "dependentSchemas", "dependencies"):
        value = node.get(kw)
        if isinstance(value, dict):
            rules += list(value.items())
            del node[kw]
    alternatives = []
    for key, then in rules:
        if isinstance(then, list):
            present = {"required": [key, *then]}
        elif then is True or then == {}:
            continue
        else:
            present = {"required": [key], "allOf": [then]}
        alternatives.append({"anyOf": [{"properties": {key: False}}, present]})
    if alternatives:
        node["allOf"] = [*node.get("allOf", []), *alternatives]


def _draft4_exclusive_bounds(node: dict[str, Any]) -> None:
    """Draft 4: `"exclusiveMinimum": true` modifies `minimum`; later drafts take a number."""
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(flag), bool):
            if node[flag] and bound in node:
                node[flag] = node.pop(bound)
            else:
                del node[flag]


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list)) and len(value) > 0


def _literal_schema(value: Any) -> Any:
    """A schema that admits exactly `value` (JSON equality), built from keywords."""
    if isinstance(value, dict) and value:
        return {
            "type": "object",
            "properties": {k: _literal_schema(v) for k, v in value.items()},
            "required": list(value),
            "additionalProperties": False,
        }
    if isinstance(value, list) and value:
        return {
            "type": "array",
            "prefixItems": [_literal_schema(v) for v in value],
            "items": False,
            "minItems": len(value),
        }
    return {"const": value}


def _dedupe(values: list[Any]) -> list[Any]:
    import json

    seen, out = set(), []
    for v in values:
        key = json.dumps(v, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out
