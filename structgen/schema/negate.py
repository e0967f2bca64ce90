"""The complement of a JSON subschema, written with keywords the grammar backends enforce.

Neither backend implements `not`, but many negations are themselves plain keywords:
`not {minimum: 3}` is `{type: number, exclusiveMaximum: 3}`, `not {required: [a]}` is
`{type: object, properties: {a: false}}`, `not {enum: ["a"]}` is "another type, or a string
matching an exclusion pattern". A subschema is the conjunction of its keywords, so its
negation is the `anyOf` of theirs (De Morgan); a keyword this module cannot negate makes the
whole negation unknown (None), never an approximation. The normalizer uses it for `not`,
for `if` (the `else` branch) and for overlapping `oneOf` branches (`disjoint.py`).
"""

from __future__ import annotations

import json
import re
import re._parser as sre  # the stdlib's regex parser: the structure of a pattern
from collections.abc import Callable
from typing import Any, Protocol

from structgen.schema.keywords import ANNOTATIONS, KEYWORD_TYPE, KEYWORDS
from structgen.schema.regex_dfa import Language

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
_MAX_DEPTH = 8  # $refs followed (and subschemas entered) before giving up
_ALL = frozenset(_TYPES) | {"integer"}
_CATEGORIES = {
    sre.CATEGORY_DIGIT: r"\d", sre.CATEGORY_NOT_DIGIT: r"\D", sre.CATEGORY_WORD: r"\w",
    sre.CATEGORY_NOT_WORD: r"\W", sre.CATEGORY_SPACE: r"\s", sre.CATEGORY_NOT_SPACE: r"\S",
}  # fmt: skip
_NEIGHBOURLY = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def negate(
    schema: Any,
    resolve: Callable[[str], Any] | None = None,
    within: Any = None,
    proofs: Proofs | None = None,
    known: dict[str, Any] | None = None,
    subset: bool = False,
) -> Any | None:
    """A schema valid exactly where `schema` is not, using only enforceable keywords; None if
    this module does not know one.

    `known` maps (the `json_key` of) schemas that are themselves rewritten negations to the
    schema they negate, so a double negation gives the original back instead of negating
    the rewrite (whose patterns would be complements of complements).

    `resolve(ref)` returns the (normalized) subschema a local `$ref` points to, or None (e.g.
    a cycle); without it a `$ref` cannot be negated. With `within` (a schema every instance
    of interest satisfies) and `proofs` (what `disjoint.py` can prove), the result is exact
    only inside `within`, which lets more schemas be negated: `within` itself has an empty
    negation there; a keyword that constrains a type `within` excludes is true there, so its
    negation is empty there; an object `within` closes (additionalProperties false) bounds
    which extra keys can appear; and where `within`'s items are disjoint from `items`, "some
    item is not valid" is "some item".

    With `subset`, a part whose negation is unknown is left out instead of failing the whole:
    the result is then a subset of the negation (`false` at worst), never None. Used next to
    a branch, a subset of "not B" makes a stricter schema, not a looser one: generation
    stays valid, at the price of some valid instances (the normalizer uses it only where the
    exact rewrite is unknown, which would otherwise refuse the schema).
    """
    negation = _Negation(resolve, proofs, {} if known is None else known, subset)
    return negation.of(schema, 0, within)


def json_key(schema: Any) -> str:
    """A schema's identity for `negate`'s `known`."""
    return json.dumps(schema, sort_keys=True)


class Proofs(Protocol):
    """What `disjoint.Disjointness` proves about subschemas."""

    def types(self, schema: Any) -> frozenset[str]: ...

    def disjoint(self, a: Any, b: Any) -> bool: ...

    def closed_keys(self, schema: Any) -> list[str] | None: ...


class _Negation:
    def __init__(
        self,
        resolve: Callable[[str], Any] | None,
        proofs: Proofs | None,
        known: dict[str, Any],
        subset: bool = False,
    ):
        self.resolve = resolve
        self.proofs = proofs
        self.known = known
        self.subset = subset

    def unknown(self) -> Any | None:
        """What an unknown negation stands for: None (exact mode), or its empty subset."""
        return False if self.subset else None

    def types(self, within: Any) -> frozenset[str]:
        return _ALL if within is None or self.proofs is None else self.proofs.types(within)

    def of(self, schema: Any, depth: int, within: Any = None) -> Any | None:
        if schema is True:
            return False
        if schema is False:
            return {}
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return self.unknown()
        if self.known and json_key(schema) in self.known:
            return self.known[json_key(schema)]
        if within is not None and schema == within:
            return False  # every instance in scope is valid against it
        types = self.types(within)
        # Keywords JSON Schema does not define are annotations: they never fail an instance;
        # nor does a keyword of a type the instances in scope do not have.
        parts = {
            k: v
            for k, v in schema.items()
            if k in KEYWORDS and k not in ANNOTATIONS and _may_apply(k, types)
        }
        if not parts:
            return False
        if "not" in parts and len(parts) == 1:
            return parts["not"]
        alternatives = []
        if set(parts) & set(_NEIGHBOURLY):
            extra = self.extra_keys(parts, depth, within)
            if extra is None and not self.subset:
                return None  # these depend on their neighbours; no per-keyword negation
            alternatives += extra or []
        if isinstance(parts.get("prefixItems"), list) and "items" in parts:
            # `items` then counts from the end of prefixItems: false is "no more items"
            tail = parts.pop("items")
            if tail is False:
                alternatives.append({"type": "array", "minItems": len(parts["prefixItems"]) + 1})
            elif tail is not True and tail != {} and not self.subset:
                return None
        for kw, value in parts.items():
            if kw in _NEIGHBOURLY:
                continue
            alt = self.keyword(kw, value, depth, within)
            if alt is None:
                if self.subset:
                    continue
                return None
            if alt == {}:
                return {}
            if alt is not False:
                alternatives.append(alt)
        if not alternatives:
            return False
        return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}

    def keyword(self, kw: str, value: Any, depth: int, within: Any = None) -> Any | None:
        """not {kw: value}. Keywords that only constrain one type are vacuously true for other
        types, so their negation is of that type."""
        if kw == "type":
            neg = _negate_type(value, self.types(within))
            if neg is None and self.subset:  # all but "a number that is not an integer"
                neg = _negate_type(value, self.types(within) - {"number"})
            return neg
        if kw == "required" and isinstance(value, list):
            if not value:
                return False
            absent = [{"type": "object", "properties": {k: False}} for k in value]
            return absent[0] if len(absent) == 1 else {"anyOf": absent}
        if kw in _NUMBER_BOUNDS and isinstance(value, (int, float)) and not isinstance(value, bool):
            return {"type": "number", _NUMBER_BOUNDS[kw]: value}
        if kw in _COUNT_BOUNDS and isinstance(value, int) and not isinstance(value, bool):
            other, step, typ = _COUNT_BOUNDS[kw]
            if value + step < 0:
                return False
            return {"type": typ, other: value + step}
        if kw == "properties" and isinstance(value, dict):
            alts = []
            inner = _props(within)
            keys = self.proofs.closed_keys(within) if self.proofs and within is not None else None
            for k, sub in value.items():
                if keys is not None and k not in keys:
                    continue  # no instance in scope has this key
                neg = self.of(sub, depth + 1, inner.get(k))
                if neg is None:
                    return None
                if neg is not False:
                    alts.append({"type": "object", "required": [k], "properties": {k: neg}})
            if not alts:
                return False
            return alts[0] if len(alts) == 1 else {"anyOf": alts}
        if kw in ("anyOf", "allOf") and isinstance(value, list):
            negs = [self.of(v, depth + 1, within) for v in value]
            if any(n is None for n in negs):
                return None
            if kw == "anyOf" and False in negs:
                return False
            negs = [n for n in negs if n is not False]
            if not negs:
                return False
            return negs[0] if len(negs) == 1 else {"allOf" if kw == "anyOf" else "anyOf": negs}
        if kw == "not":
            return value
        if kw == "enum" and isinstance(value, list):
            return _negate_values(value)
        if kw == "const":
            return _negate_values([value])
        if kw == "pattern" and isinstance(value, str):
            other = negate_pattern(value) or _complement_pattern(value)
            return None if other is None else {"type": "string", "pattern": other}
        if kw == "propertyNames":
            if isinstance(value, dict) and list(value) == ["allOf"] and len(value["allOf"]) == 1:
                value = value["allOf"][0]  # the normalizer's form of a rewritten `not`
            if isinstance(value, dict) and json_key(value) in self.known:
                value = {"not": self.known[json_key(value)]}
            return _negate_property_names(value)
        if kw == "prefixItems" and isinstance(value, list):
            return self.prefix_items(value, depth, within)
        if kw == "items" and isinstance(value, (dict, bool)):
            return self.items(value, depth, within)
        if kw == "$ref" and isinstance(value, str) and self.resolve is not None:
            target = self.resolve(value)
            return None if target is None else self.of(target, depth + 1, within)
        return None


    def extra_keys(self, parts: dict[str, Any], depth: int, within: Any) -> list[Any] | None:
        """not {additionalProperties: S} (next to `properties`): some key the schema does
        not list has a value outside S. Only known when the objects in scope are closed
        (`within`, or each of its branches, has additionalProperties false): the candidate
        keys are then the ones they list."""
        if "additionalProperties" not in parts or set(parts) & {
            "patternProperties",
            "unevaluatedProperties",
        }:
            return None
        extra = parts["additionalProperties"]
        if extra is True or extra == {}:
            return []
        keys = self.proofs.closed_keys(within) if self.proofs and within is not None else None
        if keys is None:
            return None
        alts = []
        for k in [k for k in keys if k not in _props(parts)]:
            neg = self.of(extra, depth + 1, _props(within).get(k))
            if neg is None:
                return None
            if neg is not False:
                alts.append({"type": "object", "required": [k], "properties": {k: neg}})
        return alts

    def prefix_items(self, prefix: list[Any], depth: int, within: Any) -> Any | None:
        """not {prefixItems: [S0, ...]}: some item i exists and is outside Si."""
        inner = within.get("prefixItems") if isinstance(within, dict) else None
        alts = []
        for i, sub in enumerate(prefix):
            scope = inner[i] if isinstance(inner, list) and i < len(inner) else None
            neg = self.of(sub, depth + 1, scope)
            if neg is None:
                return None
            if neg is not False:
                alts.append({"type": "array", "minItems": i + 1, "prefixItems": [*[{}] * i, neg]})
        if not alts:
            return False
        return alts[0] if len(alts) == 1 else {"anyOf": alts}

    def items(self, items: Any, depth: int, within: Any) -> Any | None:
        """not {items: S}: some item is outside S. At a position `within` fixes
        (prefixItems) that is the negation of S there; for the rest of the items it is known
        only at the extremes: no item in scope can be outside S (False), or none can be
        inside it (then any item there will do)."""
        if not isinstance(within, dict) or self.proofs is None:
            return None
        prefix = within.get("prefixItems", [])
        tail = within.get("items", True)
        if not isinstance(prefix, list) or not isinstance(tail, (dict, bool)):
            return None
        alts = []
        for i, scope in enumerate(prefix):
            neg = self.of(items, depth + 1, scope)
            if neg is None:
                return None
            if neg is not False:
                alts.append({"type": "array", "minItems": i + 1, "prefixItems": [*[{}] * i, neg]})
        if tail is not False and self.of(items, depth + 1, tail) is not False:
            if not self.proofs.disjoint(tail, items):
                return None
            alts.append({"type": "array", "minItems": len(prefix) + 1})
        if not alts:
            return False
        return alts[0] if len(alts) == 1 else {"anyOf": alts}


def _negate_property_names(names: Any) -> Any | None:
    """not {propertyNames: S}: some key is outside S. Known when that leaves any key (S is
    false) or a few named keys (S is `not` of an enum/const of strings)."""
    if names is False:
        return {"type": "object", "minProperties": 1}
    inner = names.get("not") if isinstance(names, dict) and len(names) == 1 else None
    if not isinstance(inner, dict) or not set(inner) <= {"enum", "const", "type"}:
        return None
    keys = inner["enum"] if "enum" in inner else [inner["const"]] if "const" in inner else None
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
        return None
    if inner.get("type", "string") not in ("string", ["string"]):
        return None
    some = [{"type": "object", "required": [k]} for k in dict.fromkeys(keys)]
    return some[0] if len(some) == 1 else {"anyOf": some}


def _may_apply(kw: str, types: frozenset[str]) -> bool:
    typ = KEYWORD_TYPE.get(kw)
    if typ is None:
        return True
    return bool(types & ({"number", "integer"} if typ == "number" else {typ}))


def _props(schema: Any) -> dict[str, Any]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def _negate_type(value: Any, scope: frozenset[str]) -> Any | None:
    """not {type: value}, among the types in `scope`."""
    types = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else None
    if types is None:
        return None
    left = scope - (types | {"integer"} if "number" in types else types)
    if not left:
        return False
    if "number" in left and "integer" in types:
        return None  # "a number that is not an integer" has no keyword
    rest = [t for t in _TYPES if t in left] + (["integer"] if left & {"integer", "number"} == {"integer"} else [])
    return {"type": rest}


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
        alternatives.append({"type": "string", "pattern": f"^(?:{exclusion_regex(strings)})$"})
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


def negate_pattern(pattern: str) -> str | None:
    """A pattern (searched, as JSON Schema does) found in exactly the strings where `pattern`
    is not, for four shapes around one character class C (a literal, `[...]`, `\\d`, ...):
    `C` (no C anywhere: `^[^C]*$`), `^C*$` / `^C+$` (some other character: `[^C]`, or
    empty: `^$`), `^C` and `C$` (empty, or another first / last character). None otherwise."""
    try:
        seq = list(sre.parse(pattern))
    except (re.error, RecursionError, OverflowError):
        return None
    begin, end = (sre.AT, sre.AT_BEGINNING), (sre.AT, sre.AT_END)
    if len(seq) == 1 and (other := _other_chars(seq[0])):
        return f"^{other}*$"
    if len(seq) == 3 and seq[0] == begin and seq[2] == end and seq[1][0] is sre.MAX_REPEAT:
        low, high, sub = seq[1][1]
        other = _other_chars(sub[0]) if len(sub) == 1 else None
        if other and high is sre.MAXREPEAT and low in (0, 1):
            return other if low == 0 else f"{other}|^$"
    if len(seq) == 2 and seq[0] == begin and (other := _other_chars(seq[1])):
        return f"^$|^{other}"
    if len(seq) == 2 and seq[1] == end and (other := _other_chars(seq[0])):
        return f"^$|{other}$"
    return None


def _complement_pattern(pattern: str) -> str | None:
    """The general case of `negate_pattern`, through an automaton (`regex_dfa`)."""
    language = Language.of_pattern(pattern)
    return None if language is None else language.complement().to_pattern()


def _other_chars(item: tuple) -> str | None:
    """A class of the characters the one-character regex `item` (parsed) does not match."""
    op, av = item
    if op is sre.LITERAL:
        return f"[^{_class_char(av)}]"
    if op is not sre.IN:
        return None
    negated = av[0] == (sre.NEGATE, None)
    parts = []
    for kind, value in av[1:] if negated else av:
        if kind is sre.LITERAL:
            parts.append(_class_char(value))
        elif kind is sre.RANGE:
            parts.append(f"{_class_char(value[0])}-{_class_char(value[1])}")
        elif kind is sre.CATEGORY and value in _CATEGORIES:
            parts.append(_CATEGORIES[value])
        else:
            return None
    return f"[{'' if negated else '^'}{''.join(parts)}]"


def _class_char(code: int) -> str:
    ch = chr(code)
    if ch in "\\]^-[":
        return "\\" + ch
    return f"\\u{code:04x}" if code < 0x20 or code == 0x7F else ch


def exclusion_regex(words: list[str]) -> str:
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
