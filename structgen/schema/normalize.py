"""Equivalent rewrites of a JSON schema into keywords the grammar backends enforce.

Every rewrite here keeps the set of valid instances exactly the same (outputs are still
validated against the user's original schema); it only moves the schema into the subset the
backends can compile. The one exception is asked for: `tighten=True` (the compiler's fallback
when every backend refuses the exact rewrite) gives a `not` / `if` / overlapping `oneOf`
whose needed negation is unknown a subset of that negation instead, so the schema gets
stricter (never looser) rather than refused. The rewrites:

- finite schemas: a subschema with `enum`/`const` (directly or in an `allOf` part) admits at
  most those values, so it becomes `{"enum": [the values that pass the whole subschema]}`.
  This removes whatever else stood there (`not`, `if`, `uniqueItems`, ...), and xgrammar's
  habit of checking an enum while ignoring its siblings becomes harmless.
- `dependentRequired` / `dependentSchemas` / `dependencies`: "if key k is present then ..."
  becomes `anyOf: [{k absent}, {k present and ...}]`, with "absent" as `properties: {k: false}`.
  (`dependencies` is applied under every draft: 2019-09 split it in two, but a schema that
  still uses it means it.)
- `not`: replaced by its negation where `negate.py` knows one (De Morgan down to keywords
  whose negation is a keyword: `not {minimum: 3}` is `{type: number, exclusiveMaximum: 3}`);
  left alone otherwise.
- `if`/`then`/`else`: `anyOf: [allOf [if, then], allOf [not if, else]]` when `not if` is.
- `oneOf` is `anyOf` of its branches, each excluding the branches it may overlap
  (`disjoint.py`), where those exclusions are known.
- `minProperties`/`maxProperties` of a closed object: which of its keys are present.
- `propertyNames` as a `patternProperties` pattern or a list of properties.
- draft-4 boolean `exclusiveMinimum`/`exclusiveMaximum` become the numeric form, and in
  drafts 4-7 the keywords next to a `$ref` (which those drafts ignore) are dropped.
- more finite schemas: arrays with `uniqueItems` over a few values (`arrays.py`), bounded
  numbers on a grid (`numbers.py`); both listed, then filtered by the whole subschema.
- `uniqueItems` that always holds, and `contains` in short arrays (`arrays.py`).
- patterns (`patterns.py`, through automata in `regex_dfa.py`): lookahead and inner anchors
  rewritten away, a string schema's combined patterns as one, `not` of any pattern.
- no-op keywords (`"additionalProperties": {}`) and a `type` that its `anyOf`/`$ref` already
  implies are dropped; last, recursive `$ref`s with sibling keywords get merged definitions
  of their own (`refs.py`), which llguidance otherwise refuses.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import json
import logging
import math
import re
from collections.abc import Callable
from typing import Any

from structgen.errors import StructgenError
from structgen.schema.arrays import contains_as_positions, drop_trivial_unique, unique_arrays
from structgen.schema.budget import check_budget
from structgen.schema.disjoint import Disjointness, expand_types, one_of_as_any_of
from structgen.schema.keywords import (
    ANNOTATIONS,
    KEYWORDS,
    finite_values,
    map_subschemas,
    resolve_ref,
    walk,
)
from structgen.schema.negate import Proofs, json_key, negate
from structgen.schema.numbers import number_candidates
from structgen.schema.patterns import (
    merge_string_patterns,
    patterns_for_backends,
    string_schema,
)
from structgen.schema.refs import specialize_recursive_refs

log = logging.getLogger("structgen.grammar")


def normalize_schema(schema: Any, *, tighten: bool = False) -> Any:
    """An equivalent schema the backends can enforce more of (see module doc).

    With `tighten`, a `not` / `if` / overlapping `oneOf` whose exact rewrite is unknown gets
    a stricter one (a subset of the negation it needs, `negate(subset=True)`): every instance
    of the result is valid, some valid ones are lost. Callers use it only where the exact
    schema is refused (`normalize_exact` says whether it would change anything)."""
    return _normalize(schema, tighten)[0]


def normalize_exact(schema: Any) -> tuple[Any, bool]:
    """`normalize_schema(schema)`, and whether it met a negation it does not know (so that
    `normalize_schema(schema, tighten=True)` differs)."""
    normalized, unknown = _normalize(schema, False)
    return normalized, unknown > 0


def _normalize(schema: Any, tighten: bool) -> tuple[Any, int]:
    import jsonschema

    from structgen.schema.metaschema import validator_class

    cls = validator_class(schema) if isinstance(schema, dict) else jsonschema.Draft202012Validator
    old_drafts = (
        jsonschema.Draft3Validator,
        jsonschema.Draft4Validator,
        jsonschema.Draft6Validator,
        jsonschema.Draft7Validator,
    )
    normalizer = _Normalizer(schema, _enum_indexed(cls)(schema), cls in old_drafts, tighten)
    token = _ENUM_SETS.set({})
    try:
        normalized = normalizer.node(schema, 0)
        return specialize_recursive_refs(normalized), normalizer.unknown
    finally:
        _ENUM_SETS.reset(token)


@functools.cache
def _enum_indexed(cls: Any) -> Any:
    """The validator class `cls` with `EnumIndex` for `enum`, made once per draft (making a
    validator class costs as much as normalizing a small schema)."""
    import jsonschema

    return jsonschema.validators.extend(cls, {"enum": EnumIndex(cls.VALIDATORS["enum"])})


# The value sets of the enums met by the normalization running in this context (`EnumIndex`).
_ENUM_SETS: contextvars.ContextVar[dict[int, tuple[list[Any], set[str]]] | None] = contextvars.ContextVar(
    "structgen_enum_sets", default=None
)


class EnumIndex:
    """jsonschema's `enum` keyword with each enum's values in a set: every value of an enum is
    checked against it when a finite schema is listed, and jsonschema scans the enum for each
    (quadratic). A value the set misses goes to jsonschema's own check, which decides (and
    words the error). The sets live as long as one normalization (`_ENUM_SETS`)."""

    def __init__(self, scan: Any):
        self._scan = scan

    def __call__(self, validator: Any, enums: Any, instance: Any, schema: Any) -> Any:
        sets = _ENUM_SETS.get()
        if isinstance(enums, list) and sets is not None:
            entry = sets.get(id(enums))
            if entry is None or entry[0] is not enums:
                entry = sets[id(enums)] = (enums, {_equality_key(v) for v in enums})
            if _equality_key(instance) in entry[1]:
                return
        yield from self._scan(validator, enums, instance, schema)


def _equality_key(value: Any) -> str:
    """Equal for JSON values JSON Schema calls equal (1 and 1.0; not 1 and true)."""
    return json.dumps(_integral_floats(value), sort_keys=True)


def _integral_floats(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral_floats(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral_floats(v) for k, v in value.items()}
    return value


def surely_empty(schema: Any) -> bool:
    """Does `schema` obviously admit nothing (`false`, or an `allOf` part / every `anyOf`
    branch that does)? Tightening can come to that; a backend would then refuse it with an
    error that no longer names the keyword at fault."""
    if schema is False:
        return True
    if not isinstance(schema, dict):
        return False
    parts = schema.get("allOf")
    if isinstance(parts, list) and any(surely_empty(p) for p in parts):
        return True
    branches = schema.get("anyOf")
    return isinstance(branches, list) and all(surely_empty(b) for b in branches)


class _Normalizer:
    def __init__(self, root: Any, validator: Any, ref_overrides: bool, tighten: bool = False):
        self.root = root
        self.validator = validator  # resolves $refs against the original document
        self.ref_overrides = ref_overrides  # drafts <= 7: "$ref" makes its siblings inert
        self._resolved: dict[str, Any] = {}
        self._resolving: set[str] = set()
        self.proofs = Disjointness(root, ref_overrides)
        # top-level keys that "#/key/name" $refs point into, other than the known containers
        self.ref_containers = {
            n["$ref"].split("/")[1]
            for n, _ in walk(root)
            if isinstance(n.get("$ref"), str) and n["$ref"].count("/") == 2
        } - set(KEYWORDS) - {"$defs", "definitions"}
        self._negations: dict[str, Any] = {}  # json_key(rewritten `not X`) -> X
        self.tighten = tighten
        self.unknown = 0  # negations needed and not known exactly

    def resolve(self, ref: str) -> Any | None:
        """The normalized subschema a local `$ref` points to (for negating it); None when it
        points nowhere or back into a subschema being resolved (a cycle)."""
        if ref not in self._resolved:
            target = resolve_ref(self.root, ref)
            if target is None or ref in self._resolving:
                return None
            self._resolving.add(ref)
            try:
                self._resolved[ref] = self.node(target, 0)
            finally:
                self._resolving.discard(ref)
        return self._resolved[ref]

    def _target(self, ref: str) -> Any | None:
        """What a local `$ref` points to, as written (inert `$ref` siblings dropped)."""
        target = resolve_ref(self.root, ref)
        if self.ref_overrides and isinstance(target, dict) and "$ref" in target:
            target = {k: v for k, v in target.items() if k == "$ref" or k in ANNOTATIONS}
        return target

    def negate(self, schema: Any, within: Any = None, proofs: Proofs | None = None) -> Any | None:
        """`negate.negate` with this document's `$ref`s and the negations made so far."""
        return negate(schema, self.resolve, within, proofs, self._negations)

    def negate_subset(
        self, schema: Any, within: Any = None, proofs: Proofs | None = None
    ) -> Any | None:
        """Where `negate` has no answer: a subset of the negation when tightening (logged),
        None otherwise; either way the miss is counted."""
        self.unknown += 1
        if not self.tighten:
            return None
        log.info("tightened: no exact negation of %s", json.dumps(schema)[:200])
        return negate(schema, self.resolve, within, proofs, self._negations, subset=True)

    def node(self, schema: Any, depth: int) -> Any:
        if not isinstance(schema, dict) or depth > 200:
            return schema
        check_budget()
        if self.ref_overrides and "$ref" in schema:
            schema = {k: v for k, v in schema.items() if k == "$ref" or k in ANNOTATIONS}
        as_pattern = string_schema(schema, self._target)
        if as_pattern is not None:
            return as_pattern
        values = finite_values(schema, self.root)
        if values is None and schema.get("uniqueItems") is True:
            values = unique_arrays(schema, self.root)
        if values is None:
            values = number_candidates(schema, self.root)
        if values is not None:
            return self._finite(schema, values)
        # definitions, and at the root any other container "#/key/name" $refs point into
        containers = ("$defs", "definitions", *(self.ref_containers if schema is self.root else ()))
        out = map_subschemas(schema, lambda v: self.node(v, depth + 1), containers)
        _draft4_exclusive_bounds(out)
        patterns_for_backends(out)
        _drop_trivial_keywords(out)
        drop_trivial_unique(out, self.proofs.disjoint)
        contains_as_positions(out)
        self._drop_implied_type(out)
        if isinstance(out.get("oneOf"), list):
            self._one_of_as_any_of(out)
        _dependencies_as_any_of(out)
        _property_counts_as_keys(out)
        _property_names_as_keys(out)
        _if_then_else_as_any_of(out, self.negate, self.negate_subset)
        if "not" in out:
            negated = self.negate(out["not"])
            if negated is not None:
                self._negations[json_key(negated)] = out["not"]
            else:  # (a subset: a double negation of it must not give the original back)
                negated = self.negate_subset(out["not"])
            if negated is not None:
                del out["not"]
                out["allOf"] = [*out.get("allOf", []), negated]
        merge_string_patterns(out)
        return out

    def _drop_implied_type(self, node: dict[str, Any]) -> None:
        """Drop a `type` that the `anyOf` / `$ref` / ... next to it already implies:
        llguidance merges such siblings into every branch and target, which it cannot do
        for a recursive `$ref` ("circular references with sibling keys": WashingtonPost's
        `{"anyOf": [{"$ref": "#/definitions/content_json"}, ...], "type": "object"}`)."""
        declared = node.get("type")
        if not (set(node) & {"anyOf", "oneOf", "allOf", "$ref"}) or declared is None:
            return
        names = [declared] if isinstance(declared, str) else declared
        if not isinstance(names, list) or not all(isinstance(t, str) for t in names):
            return
        rest = {k: v for k, v in node.items() if k != "type"}
        if self.proofs.types(rest) <= expand_types(set(names)):
            del node["type"]

    def _one_of_as_any_of(self, node: dict[str, Any]) -> None:
        """`oneOf` as `anyOf` of branches that exclude each other (see `disjoint.py`)."""
        parent = {k: v for k, v in node.items() if k != "oneOf"}
        args = (node["oneOf"], parent, self.root, self.ref_overrides)
        branches = one_of_as_any_of(*args, self.negate)
        if branches is None:
            branches = one_of_as_any_of(*args, self.negate_subset)
        if branches is None:
            return
        for branch in branches:
            if isinstance(branch, dict):
                merge_string_patterns(branch)
        del node["oneOf"]
        if "anyOf" not in node:
            node["anyOf"] = branches
        else:
            node["allOf"] = [*node.get("allOf", []), {"anyOf": branches}]

    def _finite(self, schema: dict[str, Any], values: list[Any]) -> Any:
        try:
            check = self.validator.evolve(schema=schema)
            kept = []
            for i, v in enumerate(values):
                if not i % 1024:
                    check_budget()
                if check.is_valid(v):
                    kept.append(v)
        except StructgenError:
            raise
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


def _if_then_else_as_any_of(
    node: dict[str, Any], negate: Callable[[Any], Any], negate_subset: Callable[[Any], Any]
) -> None:
    """`if I then T else E` is `anyOf: [allOf [I, T], allOf [not I, E]]`; `then`/`else`
    without `if` do nothing and are dropped. Where `not I` is unknown, a subset of it, plus
    `allOf [T, E]` (valid whichever way I goes), which keeps most of what is lost."""
    if "if" not in node:
        node.pop("then", None)
        node.pop("else", None)
        return
    neg = negate(node["if"])
    exact = neg is not None
    if not exact:
        neg = negate_subset(node["if"])
        if neg is None:
            return
    cond, then, other = node.pop("if"), node.pop("then", True), node.pop("else", True)
    branch = [_all_of(cond, then)] + ([] if neg is False else [_all_of(neg, other)])
    if not exact:
        branch.append(_all_of(then, other))
    node["allOf"] = [*node.get("allOf", []), {"anyOf": _dedupe(branch)}]


_TRIVIAL_WHEN_EMPTY = (
    "additionalProperties", "items", "additionalItems", "unevaluatedItems",
    "unevaluatedProperties", "propertyNames",
)  # fmt: skip


def _drop_trivial_keywords(node: dict[str, Any]) -> None:
    """Keywords whose subschema is `true` / `{}` constrain nothing (`"additionalProperties":
    {}`); dropping them leaves fewer siblings for the backends to merge."""
    for kw in _TRIVIAL_WHEN_EMPTY:
        if kw in node and (node[kw] is True or node[kw] == {}):
            del node[kw]


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


def _property_counts_as_keys(node: dict[str, Any]) -> None:
    """`minProperties`/`maxProperties` as which keys are present. Dropped when the required
    keys alone reach the minimum; in a closed object (additionalProperties false, no
    patternProperties) with required keys R and optional keys O, "at least n keys" is "some
    n - |R| keys of O are present" and "at most m" is "some |O| - (m - |R|) keys of O are
    absent", an `anyOf` over those subsets of O (when there are few)."""
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = set(node["required"]) if isinstance(node.get("required"), list) else set()
    closed = node.get("additionalProperties") is False and not node.get("patternProperties")
    optional = [k for k, v in props.items() if k not in required and v is not False]
    lo, hi = node.get("minProperties"), node.get("maxProperties")
    if isinstance(lo, int) and not isinstance(lo, bool):
        if lo <= len(required):
            del node["minProperties"]
        elif closed and required <= set(props) and 0 < lo - len(required) <= len(optional):
            alternatives = _subsets(optional, lo - len(required), lambda ks: {"required": ks})
            if alternatives is not None:
                del node["minProperties"]
                node["allOf"] = [*node.get("allOf", []), {"anyOf": alternatives}]
    if isinstance(hi, int) and not isinstance(hi, bool) and closed and required <= set(props):
        absent = len(optional) - (hi - len(required))
        if absent <= 0:
            del node["maxProperties"]
        elif absent <= len(optional) and hi >= len(required):
            alternatives = _subsets(
                optional, absent, lambda ks: {"properties": {k: False for k in ks}}
            )
            if alternatives is not None:
                del node["maxProperties"]
                node["allOf"] = [*node.get("allOf", []), {"anyOf": alternatives}]


_EVERY_STRING = frozenset({"", ".*", "^.*", "(.*)", "^(.*)", ".*?"})  # searched patterns


def _property_names_as_keys(node: dict[str, Any]) -> None:
    """`propertyNames` (which llguidance does not implement) as which keys may appear:
    `{pattern: P}` is `patternProperties: {P: <additionalProperties>}` with no other
    additional keys, and `{enum: names}` lists the names in `properties`. Listed properties
    whose names fail it are forbidden. Only where the rewrite is exact: no patternProperties
    already, and, for a pattern, no listed property that additionalProperties would now
    constrain."""
    names = node.get("propertyNames")
    if not isinstance(names, dict) or "unevaluatedProperties" in node:
        return
    rule = {k: v for k, v in names.items() if k not in ANNOTATIONS}
    if rule.pop("type", "string") != "string":
        return
    if not rule:  # keys are strings
        del node["propertyNames"]
        return
    props = node.get("properties", {})
    extra = node.get("additionalProperties", True)
    patterns = node.get("patternProperties", {})
    if not isinstance(props, dict) or not isinstance(patterns, dict):
        return
    if patterns:
        # only patterns every key matches (".*"): their subschemas then apply to every key
        if props or not set(patterns) <= _EVERY_STRING:
            return
        extra = _all_of(*patterns.values())
    if set(rule) == {"pattern"} and isinstance(rule["pattern"], str):
        if props and extra is not True and extra != {}:
            return
        try:
            keep = {k: v if re.search(rule["pattern"], k) else False for k, v in props.items()}
        except re.error:
            return
        new_patterns = {rule["pattern"]: extra}
    elif set(rule) == {"enum"} and all(isinstance(k, str) for k in rule["enum"]):
        keep = {k: v if k in rule["enum"] else False for k, v in props.items()}
        keep.update({k: extra for k in rule["enum"] if k not in props})
        new_patterns = {}
    else:
        return
    if keep:
        node["properties"] = keep
    node["additionalProperties"] = False
    del node["propertyNames"]
    node.pop("patternProperties", None)
    if new_patterns:
        node["patternProperties"] = new_patterns


def _subsets(keys: list[str], n: int, schema: Callable[[list[str]], Any]) -> list[Any] | None:
    """`schema(subset)` for every n-subset of `keys`; None when there are more than 64."""
    if math.comb(len(keys), n) > 64:
        return None
    return [schema(list(ks)) for ks in itertools.combinations(keys, n)]


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
    seen, out = set(), []
    for v in values:
        key = json.dumps(v, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out
