"""Does every rule of a grammar end? The classic "generating symbols" fixpoint over the grammar
xgrammar builds (from EBNF, Lark, a regex or a JSON schema), computed as each rule's shortest
output in bytes.

A rule no finite text derives (`root ::= "ab" root`, `root ::= root "a"`, a JSON object whose
required property refers back to it) has an empty language: a matcher that enters it can never
finish, and xgrammar's jump-forward follows its forced text without end. `check_terminates`
refuses such grammars at compile time. The same lengths bound jump-forward: the text a grammar
forces is a prefix of every way to finish, so of the shortest one, which the longest shortest
alternative (`GrammarLengths.longest_alternative`) bounds for each open rule.

The fixpoint runs in C++ (csrc/grammar_lengths.cpp) without the GIL, which a burst of new
schemas' compiles otherwise queue on; the Python one here is its reference and fallback.
"""

from __future__ import annotations

import ctypes
import functools
import heapq
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from structgen.csrc import build_library
from structgen.errors import EngineError, UnsatisfiableConstraintError
from structgen.grammar.backends.base import FORCED_TEXT_MAX_BYTES, allocate_bitmask, count_allowed
from structgen.schema.budget import check_budget
from structgen.schema.keywords import resolve_ref

if TYPE_CHECKING:
    from structgen.grammar.backends.base import CompiledGrammar
    from structgen.types import Constraint

log = logging.getLogger("structgen.grammar")

NEVER = 1 << 40  # "no finite output": lengths saturate here, so no big integers are built
_MAX_CODEPOINT = 0x10FFFF
# xgrammar's expression types (`Grammar::Impl::GrammarExprType`, serialized as the first int).
# Those after these (tokens, a token dispatch, a regex or substring rule body: xgrammar 0.2.9
# compiles a JSON schema's `pattern` to a regex body) are read as "may end at once": a lower
# bound, so they never get a grammar refused, and the forced-text bound counts them as empty.
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE_REF, _SEQUENCE, _CHOICES, _TAG_DISPATCH, _REPEAT = range(9)


@dataclass(frozen=True)
class GrammarLengths:
    """Per rule, the length in bytes of its shortest output (`NEVER`: it has none)."""

    names: list[str]  # empty where computed natively (no rule is stuck there)
    shortest: list[int]
    reachable: list[int]  # rule ids reachable from the root, root first
    longest_alternative: int  # the most bytes any alternative of a reachable rule needs at least

    def forced_text_bounded(self) -> bool:
        """Is forced text short wherever the matcher is? It is at most the shortest way to
        finish, which each open rule adds at most `longest_alternative` to; past
        `FORCED_TEXT_MAX_BYTES` per rule it is taken as unbounded (a long `const`, or rules
        that double their text)."""
        return not self.stuck() and self.longest_alternative <= FORCED_TEXT_MAX_BYTES

    def stuck(self) -> list[str]:
        """Reachable rules that can never finish, root first."""
        return [self.names[r] for r in self.reachable if self.shortest[r] >= NEVER]


class _Exprs:
    """xgrammar's serialized grammar (`Grammar.serialize_json`): rules and expressions."""

    def __init__(self, serialized: str):
        data = json.loads(serialized)
        self.rules: list[list[Any]] = data["rules"]
        self.root: int = data["root_rule_id"]
        flat, starts = data["grammar_expr_data"], data["grammar_expr_indptr"]
        ends = [*starts[1:], len(flat)]
        self.exprs = [flat[a:b] for a, b in zip(starts, ends, strict=True)]

    def body(self, rule: int) -> int:
        return self.rules[rule][1]

    def refs(self, expr_id: int) -> list[int]:
        """Rule ids an expression refers to, directly or through its parts."""
        found, stack = [], [expr_id]
        while stack:
            kind, _, *args = self.exprs[stack.pop()]
            if kind == _RULE_REF:
                found.append(args[0])
            elif kind == _REPEAT:
                found.append(args[0])
            elif kind in (_SEQUENCE, _CHOICES):
                stack.extend(args)
        return found


def grammar_lengths(grammar: Any) -> GrammarLengths:
    """The shortest output of every rule of an `xgrammar.Grammar`, by fixpoint iteration (a rule
    is finite once one alternative has only finite parts; lengths only shrink): natively where
    the library builds (`_native_lengths`), else (and to name the rules that never end) here."""
    serialized = grammar.serialize_json()
    lengths = _native_lengths(serialized)
    return lengths if lengths is not None else _python_lengths(serialized)


def _python_lengths(serialized: str) -> GrammarLengths:
    g = _Exprs(serialized)
    shortest = _shortest_lengths(g)
    reachable = _reachable(g)
    longest = max((_longest_alternative(g, g.body(r), shortest) for r in reachable), default=0)
    names = [rule[0] for rule in g.rules]
    return GrammarLengths(names, shortest, reachable, longest)


def build_lengths_library() -> Path:
    """grammar_lengths.cpp's shared library, compiled once per machine (csrc.build_library)."""

    def commands(compiler: str, source: Path, output: Path) -> list[list[str]]:
        return [[compiler, "-O2", "-std=c++17", "-shared", "-fPIC", str(source), "-o", str(output)]]

    return build_library("grammar_lengths.cpp", commands)


@functools.cache
def native_library() -> Any:
    """`sg_grammar_lengths` of structgen/csrc/grammar_lengths.cpp, built on first use; None
    (logged once) where it cannot be built or `STRUCTGEN_DISABLE_NATIVE=1`."""
    if os.environ.get("STRUCTGEN_DISABLE_NATIVE") == "1":
        return None
    try:
        function = ctypes.CDLL(str(build_lengths_library())).sg_grammar_lengths
    except Exception as exc:  # no compiler: the Python fixpoint, which holds the GIL
        log.warning("native grammar lengths unavailable (%s); computing them in Python", exc)
        return None
    int64_p = ctypes.POINTER(ctypes.c_int64)
    function.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, int64_p, int64_p,
                         int64_p, int64_p]
    function.restype = ctypes.c_int64
    return function


def _native_lengths(serialized: str) -> GrammarLengths | None:
    """`_python_lengths` without the GIL, for a grammar whose reachable rules all end (names left
    out: they only say which rules never end, and the Python path answers then); None where one
    does not, the library is not built, it reads no grammar in `serialized`, or it would run past
    its work limit (the Python path runs under the compile budget)."""
    function = native_library()
    if function is None:
        return None
    text = serialized.encode()
    cap = len(text) // 16 + 16  # a rule takes more than 16 bytes of the text
    shortest, reachable = (ctypes.c_int64 * cap)(), (ctypes.c_int64 * cap)()
    n_reachable, longest = ctypes.c_int64(), ctypes.c_int64()
    # evaluations allowed: a grammar's fixpoint reads each expression a few times, and this many
    # take tens of milliseconds (the call cannot be stopped by the compile budget)
    max_visits = 4 * len(text) + 1_000_000
    rules = function(text, len(text), cap, max_visits, shortest, reachable, ctypes.byref(n_reachable),
                     ctypes.byref(longest))
    if rules < 0 or any(shortest[r] >= NEVER for r in reachable[: n_reachable.value]):
        return None
    return GrammarLengths([], shortest[:rules], reachable[: n_reachable.value], longest.value)


def _shortest_lengths(g: _Exprs) -> list[int]:
    """Each rule's shortest output. xgrammar lists a rule before those it uses, so taking the
    last pending rule first reads most rules once; a rule is read again only when one it uses
    got shorter afterwards (recursion)."""
    users: list[list[int]] = [[] for _ in g.rules]
    for r in range(len(g.rules)):
        for used in set(g.refs(g.body(r))):
            users[used].append(r)
    shortest = [NEVER] * len(g.rules)
    pending = [-r for r in range(len(g.rules))]  # a heap of negated ids: the last rule first
    heapq.heapify(pending)
    queued = [True] * len(g.rules)
    while pending:
        check_budget()
        r = -heapq.heappop(pending)
        queued[r] = False
        n = _shortest(g, g.body(r), shortest)
        if n < shortest[r]:
            shortest[r] = n
            for user in users[r]:
                if not queued[user]:
                    queued[user] = True
                    heapq.heappush(pending, -user)
    return shortest


def _shortest(g: _Exprs, expr_id: int, rules: list[int]) -> int:
    kind, _, *args = g.exprs[expr_id]
    if kind == _BYTES:
        return len(args)
    if kind == _CLASS:
        return NEVER if _class_is_empty(args) else 1
    if kind == _RULE_REF:
        return rules[args[0]]
    if kind == _SEQUENCE:
        return min(NEVER, sum(_shortest(g, e, rules) for e in args))
    if kind == _CHOICES:
        return min((_shortest(g, e, rules) for e in args), default=NEVER)
    if kind == _REPEAT:
        rule, low = args[0], args[1]
        return 0 if low <= 0 else min(NEVER, low * rules[rule])
    return 0  # empty string, a class star, a tag dispatch (free text), the kinds after _REPEAT: may end at once


def _longest_alternative(g: _Exprs, expr_id: int, rules: list[int]) -> int:
    """The largest shortest length among the choices of a rule body (one, if not a choice)."""
    kind, _, *args = g.exprs[expr_id]
    if kind != _CHOICES:
        return _shortest(g, expr_id, rules)
    return max((_shortest(g, e, rules) for e in args), default=0)


def _class_is_empty(args: list[int]) -> bool:
    """Does a character class ([negated, lo, hi, lo, hi, ...]) match no code point?"""
    negated, ranges = args[0], sorted(zip(args[1::2], args[2::2], strict=True))
    if not negated:
        return not any(lo <= hi for lo, hi in ranges)
    covered = 0  # code points below this are all in the ranges
    for lo, hi in ranges:
        if lo > covered:
            return False
        covered = max(covered, hi + 1)
    return covered > _MAX_CODEPOINT


def _reachable(g: _Exprs) -> list[int]:
    seen, order, stack = {g.root}, [], [g.root]
    while stack:
        r = stack.pop()
        order.append(r)
        for ref in g.refs(g.body(r)):
            if ref not in seen:
                seen.add(ref)
                stack.append(ref)
    return order


def check_terminates(lengths: GrammarLengths, constraint: Constraint) -> None:
    """Raise `UnsatisfiableConstraintError` where a reachable rule can never finish, naming
    the rule (for JSON schemas, the `$ref` and property)."""
    stuck = lengths.stuck()
    if not stuck:
        return
    what = constraint.description
    if constraint.kind == "regex":
        raise UnsatisfiableConstraintError(
            f"{what} matches no string at all (a part of it admits no character), so nothing "
            "can be generated; fix the pattern so that at least one string matches it"
        )
    if constraint.kind == "json_schema":
        schema = json.loads(constraint.source)
        raise UnsatisfiableConstraintError(
            f"{what} has no finite instance: {_json_culprit(stuck, schema)} refers back to itself "
            "through required properties or items with no way to stop, so any output would be "
            "infinite. Make the self-referring property optional, or allow null or an empty array "
            f"there{_untyped_note(schema)}"
        )
    root = lengths.names[lengths.reachable[0]]
    where = f"its start rule {root!r}" if stuck[0] == root else f"rule {stuck[0]!r} (reachable from {root!r})"
    raise UnsatisfiableConstraintError(
        f"{what} has no finite output: {where} never finishes, since every alternative of "
        f"{', '.join(map(repr, stuck[:5]))} refers back to a rule that never ends. Give the "
        'recursion a base case, e.g. `root ::= "ab" root | "ab"` instead of `root ::= "ab" root`'
    )


def _json_culprit(stuck: list[str], schema: Any) -> str:
    """The `$ref` (and property) behind xgrammar's rules for a JSON schema that never end:
    xgrammar names a `$ref`'s rule after its path (`#/$defs/n` -> `defs_n`) and a property's
    rule after its position (`defs_n_prop_0`)."""
    refs = {ref.lstrip("#/").replace("$", "").replace("/", "_"): ref for ref in _refs(schema)}
    refs["root"] = "#"
    for name in stuck:  # a property first: it says most
        base, _, index = name.partition("_prop_")
        target = resolve_ref(schema, refs[base]) if base in refs and base != "root" else schema
        props = list(target.get("properties", {})) if isinstance(target, dict) else []
        if base in refs and index.isdigit() and int(index) < len(props):
            return f"required property {props[int(index)]!r} of the schema at {refs[base]!r}"
    ref = next((refs[name] for name in stuck if name in refs and name != "root"), None)
    return f"the schema at $ref {ref!r}" if ref else f"the part of the schema compiled as {stuck[0]!r}"


def _untyped_note(schema: Any) -> str:
    """Where an object schema on the way has `required` but no `type`: JSON Schema would take
    any non-object there (`5` is an instance), the grammar reads it as an object; say so."""
    nodes = [schema]
    for ref in _refs(schema):
        try:
            nodes.append(resolve_ref(schema, ref))
        except Exception:  # a remote or broken $ref: the note is only a hint
            continue
    if any(isinstance(n, dict) and "required" in n and "type" not in n for n in nodes):
        return ('. The grammar reads a schema with "required" and no "type" as an object (JSON '
                'Schema alone would also take any non-object there); if other values are meant, '
                'list their types in "type"')
    return ""


def _refs(schema: Any) -> list[str]:
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                found.append(node["$ref"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def analyse(constraint: Constraint) -> GrammarLengths | None:
    """The rule lengths of `constraint`'s grammar as xgrammar reads it, after refusing it
    (`check_terminates`) where a rule never ends; None where xgrammar cannot read it (Lark
    only llguidance knows, a schema keyword xgrammar refuses)."""
    from structgen.grammar.backends.xgrammar import build_grammar

    try:
        grammar = build_grammar(constraint)
    except (RuntimeError, ValueError, TypeError):
        return None
    lengths = grammar_lengths(grammar)
    check_terminates(lengths, constraint)
    return lengths


def check_not_empty(compiled: CompiledGrammar, vocab_size: int) -> None:
    """Refuse a grammar whose fresh matcher allows no token and cannot end: nothing at all
    matches it (a regex like `[^\\s\\S]`, or a grammar `analyse` could not read)."""
    m = compiled.matcher()
    if m.is_completed():
        return
    mask = allocate_bitmask(1, vocab_size, host_only=True)
    try:
        m.fill_bitmask(mask, 0)
    except (EngineError, UnsatisfiableConstraintError) as e:  # llguidance: no way forward (NoExtensionBias)
        why = f"{compiled.backend} found no first token: {str(e).splitlines()[0]}"
    else:
        if count_allowed(mask[0].numpy().view("uint32")) > 0:
            return
        why = m.error() or "no token can start an output and the empty output is not allowed"
    raise UnsatisfiableConstraintError(
        f"{compiled.constraint.description} matches nothing, so nothing can be generated "
        f"({why}); fix the constraint so that at least one output matches it"
    )
