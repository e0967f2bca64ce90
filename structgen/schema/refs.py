"""Recursive `$ref`s next to other keywords, rewritten into definitions of their own.

llguidance compiles `{"$ref": R, "type": "object"}` by merging R's target with the sibling
keywords, which it refuses when R is recursive ("circular references with sibling keys are
not supported"). It merges the same way when the siblings stand next to an `anyOf`/`oneOf`
one of whose branches is such a `$ref` (it distributes them into every branch), and for the
parts of an `allOf`. WashingtonPost's schemas do this throughout:
`{"anyOf": [{"$ref": "#/definitions/content_json"}, ...], "type": "object"}`.

`specialize_recursive_refs` does the merge itself and gives each (target, siblings) pair a
definition of its own, so the recursion goes through plain `$ref`s: the siblings `S` of a
recursive `$ref: R` become `$ref: R∧S` with `R∧S` defined as R's target merged with `S`
(wherever R∧S recurs inside, it is the same definition). Every step is an equivalence:
`S ∧ anyOf[B1..Bn]` is `anyOf[S ∧ B1, .., S ∧ Bn]` (and the same for `oneOf`, since an
instance outside S matches none of either), and `allOf` is the merge of its parts; merged
schemas that share keywords stay an `allOf` of both, and a `$ref` never gets siblings
(drafts 4-7 would ignore them).
"""

from __future__ import annotations

import json
import re
from typing import Any

from structgen.schema.disjoint import Disjointness
from structgen.schema.keywords import ANNOTATIONS, map_subschemas, resolve_ref, walk
from structgen.schema.regex_dfa import Language

_COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
_STAYS = ANNOTATIONS | {"id"}  # kept where they are (draft 4's "id" sets the base URI)
_OBJECT = frozenset({"properties", "patternProperties", "additionalProperties"})
_GROUPS = (
    _OBJECT,
    frozenset({"prefixItems", "items", "additionalItems"}),
    frozenset({"if", "then", "else"}),
    frozenset({"contains", "minContains", "maxContains"}),
)
_MAX_DEFINITIONS = 256  # more specialized copies than this: leave the schema as it is
_MAX_WORK = 20000  # merges: a bound that keeps the rewrite a small part of a compile


def specialize_recursive_refs(root: Any) -> Any:
    """`root` with every recursive `$ref` that has sibling keywords (directly, or through an
    `anyOf`/`oneOf`/`allOf` it is part of) replaced by a `$ref` to a merged definition; the
    same document when there is none, or when it would take too many definitions."""
    if not isinstance(root, dict):
        return root
    recursive = recursive_refs(root)
    if not recursive or any(_has_id(n) for n, path in walk(root) if path != "#"):
        return root  # a nested id changes what "#/..." means below it: leave such documents
    rewriter = _Specializer(root, recursive)
    try:
        out = rewriter.node(root, 0)
    except _TooLarge:
        return root
    if not rewriter.definitions:
        return root
    key = rewriter.defs_key
    out = dict(out)
    out[key] = {**(out.get(key) or {}), **rewriter.definitions}
    return out


def recursive_refs(root: Any) -> set[str]:
    """Local `$ref` values whose target reaches the same `$ref` again."""
    edges: dict[str, set[str]] = {}
    todo = [n["$ref"] for n, _ in walk(root) if isinstance(n.get("$ref"), str)]
    while todo:
        ref = todo.pop()
        if ref not in edges:
            edges[ref] = _refs_within(resolve_ref(root, ref), 0)
            todo.extend(edges[ref])
    found = set()
    for start in edges:
        seen, stack = set(), list(edges[start])
        while stack:
            ref = stack.pop()
            if ref == start:
                found.add(start)
                break
            if ref not in seen:
                seen.add(ref)
                stack.extend(edges.get(ref, ()))
    return found


def _refs_within(schema: Any, depth: int) -> set[str]:
    """The `$ref` values in `schema`'s subschemas, without following them."""
    if depth > 200:
        return set()
    if isinstance(schema, list):
        return set().union(*(_refs_within(v, depth + 1) for v in schema))
    if not isinstance(schema, dict):
        return set()
    found = {schema["$ref"]} if isinstance(schema.get("$ref"), str) else set()
    for kw, value in schema.items():
        if kw in ("enum", "const", "default", "examples", "example", "$defs", "definitions"):
            continue  # values, or definitions entered only through a $ref
        if isinstance(value, (dict, list)):
            found |= _refs_within(value, depth + 1)
    return found


class _TooLarge(Exception):
    pass


class _Specializer:
    def __init__(self, root: dict[str, Any], recursive: set[str]):
        self.root = root
        self.recursive = recursive
        self.defs_key = "definitions" if "definitions" in root and "$defs" not in root else "$defs"
        self.definitions: dict[str, Any] = {}
        self._names: dict[tuple[str, str], str] = {}
        self.proofs = Disjointness(root, ref_overrides=False)
        self.work = 0

    def node(self, schema: Any, depth: int) -> Any:
        """`schema` with its subschemas rewritten, then its own shape."""
        if not isinstance(schema, dict) or depth > 200:
            return schema
        out = map_subschemas(schema, lambda v: self.node(v, depth + 1), ("$defs", "definitions"))
        return self.shape(self.separate_patterns(out))

    def separate_patterns(self, node: dict[str, Any]) -> dict[str, Any]:
        """A listed property whose name a `patternProperties` regex also matches must
        satisfy both subschemas, which llguidance merges (and cannot, around a recursive
        `$ref`): merge them here, and take the listed names out of the regex."""
        props, patterns = node.get("properties"), node.get("patternProperties")
        if not (isinstance(props, dict) and isinstance(patterns, dict) and props and patterns):
            return node
        if not _refs_within({"p": props, "q": patterns}, 0) & self.recursive:
            return node
        new_props = dict(props)
        new_patterns = {}
        for pattern, sub in patterns.items():
            try:
                hits = [k for k in props if re.search(pattern, k)]
            except re.error:
                return node
            if not hits:
                new_patterns[pattern] = sub
                continue
            language = Language.of_pattern(pattern)
            others = Language.of_strings(hits)
            rest = language.intersect(others.complement()) if language and others else None
            rest_pattern = rest.to_pattern() if rest is not None else None
            if rest_pattern is None:
                return node
            for k in hits:
                new_props[k] = self.merge(new_props[k], sub)
            if not rest.is_empty():
                new_patterns[rest_pattern] = sub
        out = {**node, "properties": new_props, "patternProperties": new_patterns}
        if not new_patterns:
            del out["patternProperties"]
        return out

    def shape(self, node: dict[str, Any]) -> Any:
        """Merge a node's keywords into its `$ref` / `anyOf` / `oneOf` / `allOf` where that
        would merge something into a recursive `$ref`; the node as it is otherwise."""
        notes = {k: v for k, v in node.items() if k in _STAYS}
        live = {k: v for k, v in node.items() if k not in _STAYS}
        if len(live) < 2 or not set(live) & set(_COMBINATORS):
            return node
        if not _refs_within(live, 0) & self.recursive:
            return node
        merged = self.join(_conjuncts(live))
        if isinstance(merged, dict) and not set(notes) & set(merged):
            return {**notes, **merged}
        return merged

    def merge(self, a: Any, b: Any) -> Any:
        """A schema admitting exactly what both `a` and `b` admit."""
        return self.join([*_conjuncts(a), *_conjuncts(b)])

    def join(self, parts: list[Any]) -> Any:
        """A schema admitting exactly what all of `parts` (no `allOf` among them) admit:
        a recursive `$ref` takes the others into a definition, an `anyOf`/`oneOf` takes
        them into each branch, and the rest merge pairwise (`merge_plain`)."""
        self.work += 1
        if self.work > _MAX_WORK:
            raise _TooLarge  # distributing anyOfs multiplies them out
        if any(p is False for p in parts):
            return False
        unique: dict[str, Any] = {}
        for p in parts:
            if p is not True and p != {}:
                unique.setdefault(json.dumps(p, sort_keys=True), p)
        parts = list(unique.values())
        if not parts:
            return {}
        for i, part in enumerate(parts):
            ref = part.get("$ref") if isinstance(part, dict) else None
            if ref in self.recursive and set(part) - ANNOTATIONS == {"$ref"}:
                rest = [*parts[:i], *parts[i + 1 :]]
                return {"$ref": self.define(ref, self.join(rest)) if rest else ref}
        for i, part in enumerate(parts):
            for kw in ("anyOf", "oneOf"):
                if isinstance(part, dict) and isinstance(part.get(kw), list):
                    own = {k: v for k, v in part.items() if k != kw}
                    rest = [*parts[:i], *_conjuncts(own), *parts[i + 1 :]]
                    # branches that cannot meet the rest are dropped, not merged: llguidance
                    # refuses a definition that admits nothing
                    branches = [
                        self.join([*_conjuncts(b), *rest])
                        for b in part[kw]
                        if not any(self.proofs.disjoint(b, r) for r in rest)
                    ]
                    branches = [b for b in branches if b is not False]
                    return {kw: branches} if branches else False
        out: list[Any] = [parts[0]]
        for part in parts[1:]:
            out = [*self.merge_plain(out[0], part), *out[1:]]
            if out[0] is False:
                return False
        return out[0] if len(out) == 1 else {"allOf": out}

    def merge_plain(self, a: Any, b: Any) -> list[Any]:
        """Two schemas without combinators as one (or, where they cannot merge, several)
        conjuncts. Keywords that read each other (`additionalProperties` and the
        `properties` next to it, `items` and `prefixItems`, ...) move as a group; object
        groups in both merge key by key (so a recursive `$ref` under a property both list
        is merged too), `type` by intersection, `required` by union; any other keyword in
        both stays apart."""
        if not isinstance(a, dict) or not isinstance(b, dict):
            return [a, b]
        if "$ref" in a or "$ref" in b or any(k.startswith("unevaluated") for k in (*a, *b)):
            return [a, b]
        out: dict[str, Any] = {}
        left: dict[str, Any] = {}  # keywords of a and b that stay apart
        right: dict[str, Any] = {}
        grouped = set().union(*_GROUPS)
        for group in _GROUPS:
            ga = {k: v for k, v in a.items() if k in group}
            gb = {k: v for k, v in b.items() if k in group}
            if not (ga and gb) or ga == gb:
                out.update(ga or gb)
            elif group is _OBJECT and not (ga.get("patternProperties") or gb.get("patternProperties")):
                out.update(self.merge_properties(ga, gb))
            elif set(ga) == set(gb) == {"items"} and isinstance(ga["items"], (dict, bool)):
                out["items"] = self.merge(ga["items"], gb["items"])
            else:
                left.update(ga)
                right.update(gb)
        for k in [*a, *(k for k in b if k not in a)]:
            if k in grouped:
                continue
            if k not in a or k not in b or k in ANNOTATIONS:
                out[k] = a.get(k, b.get(k))
            elif k == "type" and (types := _intersect_types(a[k], b[k])) is not None:
                if not types:
                    return [False]
                out[k] = types[0] if len(types) == 1 else types
            elif k == "required" and isinstance(a[k], list) and isinstance(b[k], list):
                out[k] = [*a[k], *(r for r in b[k] if r not in a[k])]
            elif a[k] == b[k]:
                out[k] = a[k]
            else:
                left[k], right[k] = a[k], b[k]
        return [out, left, right] if left or right else [out]

    def merge_properties(self, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        """`properties` + `additionalProperties` of both (no `patternProperties`): a key one
        side does not list meets that side's `additionalProperties`."""
        pa, pb = _props(a), _props(b)
        extra_a, extra_b = a.get("additionalProperties", True), b.get("additionalProperties", True)
        out: dict[str, Any] = {
            "properties": {
                k: self.merge(pa.get(k, extra_a), pb.get(k, extra_b))
                for k in [*pa, *(k for k in pb if k not in pa)]
            }
        }
        if "additionalProperties" in a or "additionalProperties" in b:
            out["additionalProperties"] = self.merge(extra_a, extra_b)
        return out

    def define(self, ref: str, siblings: Any) -> str:
        """The pointer to a definition of `ref`'s target merged with `siblings`."""
        key = (ref, json.dumps(siblings, sort_keys=True))
        if key not in self._names:
            if len(self.definitions) >= _MAX_DEFINITIONS:
                raise _TooLarge
            stem = re.sub(r"[^A-Za-z0-9_]", "_", ref.rsplit("/", 1)[-1]) if ref != "#" else "root"
            name = f"{stem}__merged{len(self.definitions)}"
            self._names[key] = f"#/{self.defs_key}/{name}"
            self.definitions[name] = {}  # reserved: the merge below may point back at it
            target = resolve_ref(self.root, ref)
            self.definitions[name] = self.node(self.merge(target, siblings), 0)
        return self._names[key]


def _has_id(node: dict[str, Any]) -> bool:
    return isinstance(node.get("$id"), str) or isinstance(node.get("id"), str)


def _conjuncts(schema: Any) -> list[Any]:
    """`schema` as parts that all apply: its `allOf` parts (flattened), its `$ref`, `anyOf`
    and `oneOf` each on their own, and the rest of its keywords together, in key order."""
    if not isinstance(schema, dict):
        return [schema]
    out: list[Any] = []
    plain: dict[str, Any] = {}
    at = None  # where the plain keywords go: at the first of them
    for kw, value in schema.items():
        if kw == "allOf" and isinstance(value, list):
            out += [c for part in value for c in _conjuncts(part)]
        elif kw in _COMBINATORS:
            out.append({kw: value})
        else:
            at = len(out) if at is None else at
            plain[kw] = value
    if plain:
        out.insert(at or 0, plain)
    return out or [{}]


def _props(schema: dict[str, Any]) -> dict[str, Any]:
    props = schema.get("properties")
    return props if isinstance(props, dict) else {}


def _intersect_types(a: Any, b: Any) -> list[str] | None:
    """The JSON types both `type` values allow ("integer" within "number"); None if either
    is malformed."""
    sets = []
    for t in (a, b):
        names = [t] if isinstance(t, str) else t
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return None
        sets.append(set(names))
    both = sets[0] & sets[1]
    if ("number" in sets[0] and "integer" in sets[1]) or ("integer" in sets[0] and "number" in sets[1]):
        both.add("integer")
    if "number" in both:
        both.discard("integer")
    return sorted(both)
