"""A JSON schema compiled into a predicate with jsonschema's verdict, for the common keywords.

Every output of a JSON-schema constraint is validated before it is returned, and jsonschema
walks the schema anew for each instance (a validator object per subschema): most of the host
work of finishing a request, run on the event loop when a batch of requests finishes
together. `instance_check` compiles the schema once into nested closures that answer `valid?`
several times faster (docs/performance.md, "Serving under load", has the figures).

Exact by construction, not by approximation: a keyword jsonschema asserts is either compiled to
the same test jsonschema runs (the same type checks, comparisons, `re.search` and equality,
draft by draft), or the whole schema gets no check (None) and jsonschema alone decides, as
before. Keywords jsonschema does not assert (annotations, unknown ones, `format` without a
format checker) are ignored by both. The caller asks jsonschema whenever the check says
invalid, for its error message: so only "valid" is ever taken from here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import jsonschema

from structgen.schema.keywords import resolve_ref

Check = Callable[[Any], bool]

_DRAFTS = {
    jsonschema.Draft4Validator: 4,
    jsonschema.Draft6Validator: 6,
    jsonschema.Draft7Validator: 7,
    jsonschema.Draft201909Validator: 2019,
    jsonschema.Draft202012Validator: 2020,
}
_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
# Keywords that move the base URI a `$ref` resolves against: anywhere but the root, no check.
_SCOPE_KEYWORDS = ("$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor")
# Keywords compiled here; any other keyword jsonschema asserts means no check.
_COMPILED = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
    "minProperties", "maxProperties", "items", "minItems", "maxItems", "minLength", "maxLength",
    "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "anyOf", "oneOf",
    "allOf", "not", "$ref", "format", "uniqueItems",
})  # fmt: skip


class _NotCompiled(Exception):
    """The schema uses something compiled checks do not cover: jsonschema alone validates."""


def instance_check(schema: Any, validator_cls: type) -> Check | None:
    """A predicate equal to `validator_cls(schema).is_valid` (no format checker) on JSON
    values (what `json.loads` returns), or None where the schema's draft or one of its
    keywords is not covered. A `$ref` cycle that consumes nothing raises RecursionError when
    called, as jsonschema does."""
    draft = _DRAFTS.get(validator_cls)
    if draft is None:
        return None
    try:
        if _moves_scope(schema, top=True):
            return None
        return _Compiler(schema, draft, validator_cls.VALIDATORS).compile(schema)
    except Exception:  # _NotCompiled, a pattern Python's re refuses, a schema nested too deeply
        return None


def _moves_scope(node: Any, top: bool = False) -> bool:
    """Whether a dict below the root has a keyword that changes how `$ref`s resolve
    (conservatively: any dict, property maps included)."""
    if isinstance(node, dict):
        if not top and any(isinstance(node.get(k), str) for k in _SCOPE_KEYWORDS):
            return True
        return any(_moves_scope(v) for v in node.values())
    if isinstance(node, list):
        return any(_moves_scope(v) for v in node)
    return False


class _Compiler:
    """Compiles the subschemas of `root` (one JSON-schema `draft`), each into a `Check`."""

    def __init__(self, root: Any, draft: int, asserted: Mapping[str, Any]):
        self.root, self.draft = root, draft
        self.asserted = asserted  # the keywords this draft's validator asserts
        self.refs: dict[str, Check] = {}  # compiled `$ref` targets by ref, looked up when called (recursion)

    def compile(self, schema: Any) -> Check:
        if schema is True or schema == {}:
            return _always
        if schema is False:
            return _never
        if not isinstance(schema, dict):
            raise _NotCompiled
        if "$ref" in schema and self.draft <= 7:  # drafts 4-7 ignore a $ref's siblings
            return self._ref(schema["$ref"])
        if any(key in self.asserted and key not in _COMPILED for key in schema):
            raise _NotCompiled
        parts = [build(self, schema) for group, build in _GROUPS.items()
                 if any(key in schema and key in self.asserted for key in _GROUP_KEYWORDS.get(group, (group,)))]
        return _all_of([part for part in parts if part is not None])

    def _ref(self, ref: Any) -> Check:
        if not isinstance(ref, str):
            raise _NotCompiled
        if ref not in self.refs:
            target = resolve_ref(self.root, ref)
            if target is None:
                raise _NotCompiled
            self.refs[ref] = _never  # placeholder while compiling a recursive target
            compiled = self.compile(target)
            self.refs[ref] = compiled
        refs = self.refs
        return lambda v: refs[ref](v)

    # -- keywords -------------------------------------------------------------------------------
    def type_(self, schema: dict) -> Check | None:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not all(isinstance(n, str) and n in _TYPES for n in names):
            raise _NotCompiled
        tests = [_integer_draft4 if n == "integer" and self.draft == 4 else _TYPE_TESTS[n] for n in names]
        if len(tests) == 1:
            return tests[0]
        return lambda v: any(test(v) for test in tests)

    def enum(self, schema: dict) -> Check | None:
        values = schema["enum"]
        if not isinstance(values, list) or not all(_is_scalar(x) for x in values):
            raise _NotCompiled
        keys = frozenset(_scalar_key(x) for x in values)
        return lambda v: _is_scalar(v) and _scalar_key(v) in keys

    def const(self, schema: dict) -> Check | None:
        value = schema["const"]
        if not _is_scalar(value):
            raise _NotCompiled
        key = _scalar_key(value)
        return lambda v: _is_scalar(v) and _scalar_key(v) == key

    def object_(self, schema: dict) -> Check | None:
        props = schema.get("properties", {})
        patterns = schema.get("patternProperties", {})
        extra = schema.get("additionalProperties", True)
        required = schema.get("required", [])
        if not (isinstance(props, dict) and isinstance(patterns, dict) and isinstance(required, list)):
            raise _NotCompiled
        prop_checks = [(name, self.compile(sub)) for name, sub in props.items() if sub is not True and sub != {}]
        pattern_checks = [(re.compile(p).search, self.compile(sub)) for p, sub in patterns.items()]
        joined = re.compile("|".join(patterns)).search if patterns else None  # as jsonschema finds extras
        extra_check = None if extra is True or extra == {} else self.compile(extra)
        lo, hi = schema.get("minProperties", 0), schema.get("maxProperties")

        def check(v: Any) -> bool:
            if not isinstance(v, dict):
                return True
            for name in required:
                if name not in v:
                    return False
            if len(v) < lo or (hi is not None and len(v) > hi):
                return False
            for name, c in prop_checks:
                if name in v and not c(v[name]):
                    return False
            for search, c in pattern_checks:
                for key, item in v.items():
                    if search(key) and not c(item):
                        return False
            if extra_check is not None:
                for key, item in v.items():
                    if key not in props and not (joined is not None and joined(key)) and not extra_check(item):
                        return False
            return True

        return check

    def array(self, schema: dict) -> Check | None:
        items = schema.get("items", True)
        if isinstance(items, list) or (self.draft == 4 and not isinstance(items, dict)):
            raise _NotCompiled  # tuple forms
        if schema.get("uniqueItems", False) is not False:
            raise _NotCompiled
        item_check = None if items is True or items == {} else self.compile(items)
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")

        def check(v: Any) -> bool:
            if not isinstance(v, list):
                return True
            if len(v) < lo or (hi is not None and len(v) > hi):
                return False
            return item_check is None or all(item_check(x) for x in v)

        return check

    def string(self, schema: dict) -> Check | None:
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        search = re.compile(schema["pattern"]).search if "pattern" in schema else None

        def check(v: Any) -> bool:
            if not isinstance(v, str):
                return True
            if len(v) < lo or (hi is not None and len(v) > hi):
                return False
            return search is None or search(v) is not None

        return check

    def number(self, schema: dict) -> Check | None:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if self.draft == 4:  # booleans that make minimum / maximum exclusive
            if not all(x is None or isinstance(x, bool) for x in (xlo, xhi)):
                raise _NotCompiled
            if xlo:
                lo, xlo = None, lo
            else:
                xlo = None
            if xhi:
                hi, xhi = None, hi
            else:
                xhi = None
        is_number = _TYPE_TESTS["number"]
        if not all(b is None or is_number(b) for b in (lo, hi, xlo, xhi)):
            raise _NotCompiled

        def check(v: Any) -> bool:
            if not is_number(v):
                return True
            return not ((lo is not None and v < lo) or (hi is not None and v > hi)
                        or (xlo is not None and v <= xlo) or (xhi is not None and v >= xhi))

        return check

    def any_of(self, schema: dict) -> Check | None:
        parts = [self.compile(s) for s in _subschemas(schema["anyOf"])]
        return lambda v: any(c(v) for c in parts)

    def one_of(self, schema: dict) -> Check | None:
        parts = [self.compile(s) for s in _subschemas(schema["oneOf"])]
        return lambda v: sum(1 for c in parts if c(v)) == 1

    def all_of(self, schema: dict) -> Check | None:
        return _all_of([self.compile(s) for s in _subschemas(schema["allOf"])])

    def not_(self, schema: dict) -> Check | None:
        inner = self.compile(schema["not"])
        return lambda v: not inner(v)

    def ref(self, schema: dict) -> Check | None:
        return self._ref(schema["$ref"])


# A check per group of keywords present in a schema (a group: the keyword itself, or those
# `_GROUP_KEYWORDS` lists, which apply to one type of instance and are tested together).
_GROUPS: dict[str, Callable[[_Compiler, dict], Check | None]] = {
    "type": _Compiler.type_, "enum": _Compiler.enum, "const": _Compiler.const,
    "object": _Compiler.object_, "array": _Compiler.array, "string": _Compiler.string,
    "number": _Compiler.number, "anyOf": _Compiler.any_of, "oneOf": _Compiler.one_of,
    "allOf": _Compiler.all_of, "not": _Compiler.not_, "$ref": _Compiler.ref,
}  # fmt: skip
_GROUP_KEYWORDS = {
    "object": ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
               "maxProperties"),
    "array": ("items", "minItems", "maxItems", "uniqueItems"),
    "string": ("minLength", "maxLength", "pattern"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
}


def _subschemas(value: Any) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise _NotCompiled
    return value


def _all_of(parts: list[Check]) -> Check:
    if not parts:
        return _always
    if len(parts) == 1:
        return parts[0]
    return lambda v: all(c(v) for c in parts)


def _always(v: Any) -> bool:
    return True


def _never(v: Any) -> bool:
    return False


# jsonschema's type checks (drafts 6+; draft 4's "integer" takes no floats).
_TYPE_TESTS: dict[str, Check] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
}


def _integer_draft4(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float))


def _scalar_key(v: Any) -> tuple:
    """A key equal for two scalars exactly where jsonschema's `equal` holds: True is not 1,
    1 is 1.0, NaN equals nothing (not even itself)."""
    if isinstance(v, bool):
        return ("bool", v)
    if isinstance(v, str):
        return ("str", v)
    if v is None:
        return ("null",)
    return ("number", v)


__all__ = ["instance_check"]
