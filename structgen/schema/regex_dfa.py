"""Regular expressions as automata: complement and intersection of JSON-Schema patterns.

The grammar backends enforce `pattern` but not `not: {pattern}`, and llguidance merges two
patterns that apply to one string (a listed property that a `patternProperties` regex also
matches, `allOf` parts) into an intersection it sometimes cannot analyse. A pattern is a
regular language, and regular languages are closed under complement and intersection, so
`Language` turns a pattern into a minimal DFA, combines DFAs, and writes the result back as an
anchored pattern made of literals, character classes, `|`, `*` and groups (state
elimination).

Semantics are Python's `re` (what `jsonschema` validates with): a pattern is searched,
`\\d`/`\\w`/`\\s` are Unicode classes, `.` is any character but `\\n`, `$` also matches before
a final `\\n`. The result is exact for a backend that reads `$` as "end of string" (llguidance,
xgrammar); Python would also let it match before a final newline. Anything else (lookaround,
backreferences, word boundaries, flags, possessive repeats) gives None, as does an automaton
past the size limits: callers then leave the schema as it is.
"""

from __future__ import annotations

import bisect
import re
import re._constants as sc  # the stdlib regex parser's opcodes
import re._parser as sre
from dataclasses import dataclass

from structgen.schema.charsets import (
    NEWLINE,
    TOP,
    Ranges,
    Unsupported,
    charset,
    clip,
    normalize,
)
from structgen.schema.regex_text import MAX_PATTERN_CHARS, NOTHING, eliminate

MAX_NFA_STATES = 4000
MAX_DFA_STATES = 2000


# -- NFA with Python's anchors ------------------------------------------------------------
class _NFA:
    """Thompson NFA: character edges and epsilon edges, some of them assertions ("^": only
    at the start; "$": the rest is "" or "\\n"; "Z": the rest is "")."""

    def __init__(self) -> None:
        self.chars: list[list[tuple[Ranges, int]]] = []
        self.eps: list[list[tuple[int, str]]] = []

    def state(self) -> int:
        if len(self.chars) >= MAX_NFA_STATES:
            raise Unsupported("too many states")
        self.chars.append([])
        self.eps.append([])
        return len(self.chars) - 1

    def build(self, seq: list, start: int) -> int:
        """Add `seq` (parsed) from `start`; return its end state."""
        for op, av in seq:
            if op in (sc.LITERAL, sc.NOT_LITERAL, sc.ANY, sc.IN):
                end = self.state()
                self.chars[start].append((charset((op, av)), end))
                start = end
            elif op is sc.SUBPATTERN:
                _group, add_flags, del_flags, sub = av
                if add_flags or del_flags:
                    raise Unsupported("inline flags")
                start = self.build(list(sub), start)
            elif op is sc.BRANCH:
                end = self.state()
                for alt in av[1]:
                    first = self.state()
                    self.eps[start].append((first, ""))
                    self.eps[self.build(list(alt), first)].append((end, ""))
                start = end
            elif op in (sc.MAX_REPEAT, sc.MIN_REPEAT):
                start = self.repeat(av, start)
            elif op is sc.AT and av in (sc.AT_BEGINNING, sc.AT_BEGINNING_STRING):
                end = self.state()
                self.eps[start].append((end, "^"))
                start = end
            elif op is sc.AT and av in (sc.AT_END, sc.AT_END_STRING):
                end = self.state()
                self.eps[start].append((end, "$" if av is sc.AT_END else "Z"))
                start = end
            else:
                raise Unsupported(op)
        return start

    def repeat(self, av: tuple, start: int) -> int:
        low, high, sub = av
        sub = list(sub)
        for _ in range(low):
            start = self.build(sub, start)
        if high is sc.MAXREPEAT:
            loop = self.state()
            self.eps[start].append((loop, ""))
            self.eps[self.build(sub, loop)].append((loop, ""))
            return loop
        end = self.state()
        for _ in range(high - low):
            self.eps[start].append((end, ""))
            start = self.build(sub, start)
        self.eps[start].append((end, ""))
        return end


# -- DFA ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Language:
    """A set of strings as a complete minimal DFA over character classes: `classes[c]` are
    the code points of class c (the classes partition the universe), `delta[s][c]` the
    next state, state 0 the start."""

    classes: tuple[Ranges, ...]
    delta: tuple[tuple[int, ...], ...]
    accepting: frozenset[int]

    @staticmethod
    def of_pattern(pattern: str) -> Language | None:
        """The strings in which JSON Schema finds `pattern`; None if unsupported. A
        lookahead is supported right after a leading `^` (`^(?!X)R`: `^R` and not `^X`)
        and at the very end (`R(?=X)` is found where `RX` is)."""
        try:
            parsed = sre.parse(pattern)
            if parsed.state.flags & ~(sc.SRE_FLAG_UNICODE):
                return None
            return _of_sequence(list(parsed))
        except (Unsupported, re.error, RecursionError, OverflowError, TypeError):
            return None

    @staticmethod
    def of_strings(words: list[str]) -> Language | None:
        """Exactly the strings `words`."""
        if not words:
            return Language.of_pattern("[^\\s\\S]")
        return Language.of_pattern("\\A(?:" + "|".join(re.escape(w) for w in words) + ")\\Z")

    def complement(self) -> Language:
        return Language(self.classes, self.delta, frozenset(range(len(self.delta))) - self.accepting)

    def intersect(self, other: Language) -> Language | None:
        classes, left, right = _refine(self.classes, other.classes)
        states = _Numbering((0, 0))
        delta = []
        try:
            for a, b in states.order:
                delta.append(tuple(
                    states.number((self.delta[a][left[c]], other.delta[b][right[c]]))
                    for c in range(len(classes))
                ))  # fmt: skip
        except Unsupported:
            return None
        accepting = frozenset(
            i
            for i, (a, b) in enumerate(states.order)
            if a in self.accepting and b in other.accepting
        )
        return _minimal(tuple(classes), delta, accepting)

    def is_empty(self) -> bool:
        return not (self._reachable() & self.accepting)

    def is_everything(self) -> bool:
        return self.complement().is_empty()

    def _reachable(self) -> set[int]:
        seen, todo = {0}, [0]
        while todo:
            for t in self.delta[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return seen

    def to_pattern(self) -> str | None:
        """An anchored pattern for exactly this language (see the module doc on `$`); None
        when it would be longer than MAX_PATTERN_CHARS."""
        body = eliminate(self)
        if body is None:
            return None
        text = "^(?:" + body + ")$" if body != NOTHING else "[^\\s\\S]"
        return text if len(text) <= MAX_PATTERN_CHARS else None


def has_inner_anchor(pattern: str) -> bool:
    """Does `pattern` have a `^` or `$` away from its edges (`/^a$/`, `(a(,|$))+`)? The
    backends read those as lookaround (llguidance) or ignore them (xgrammar)."""
    try:
        return _inner_anchor(list(sre.parse(pattern)), True, True)
    except (re.error, RecursionError, OverflowError):
        return False


def _inner_anchor(seq: list, first: bool, last: bool) -> bool:
    for i, (op, av) in enumerate(seq):
        at_start, at_end = first and i == 0, last and i == len(seq) - 1
        if op is sc.AT and av in (sc.AT_BEGINNING, sc.AT_BEGINNING_STRING) and not at_start:
            return True
        if op is sc.AT and av in (sc.AT_END, sc.AT_END_STRING) and not at_end:
            return True
        if op is sc.SUBPATTERN and _inner_anchor(list(av[-1]), at_start, at_end):
            return True
        if op is sc.BRANCH and any(_inner_anchor(list(alt), at_start, at_end) for alt in av[1]):
            return True
        if op in (sc.MAX_REPEAT, sc.MIN_REPEAT) and _inner_anchor(list(av[2]), False, False):
            return True
    return False


def _of_sequence(seq: list) -> Language | None:
    begin = (sc.AT, sc.AT_BEGINNING)
    if len(seq) >= 2 and seq[0] == begin and seq[1][0] in (sc.ASSERT, sc.ASSERT_NOT):
        direction, ahead = seq[1][1]
        if direction != 1:
            raise Unsupported("lookbehind")
        rest, cond = _of_sequence([begin, *seq[2:]]), _of_sequence([begin, *ahead])
        if rest is None or cond is None:
            return None
        return rest.intersect(cond if seq[1][0] is sc.ASSERT else cond.complement())
    if seq and seq[-1][0] is sc.ASSERT and seq[-1][1][0] == 1:
        return _of_sequence([*seq[:-1], *seq[-1][1][1]])
    nfa = _NFA()
    start = nfa.state()
    final = nfa.build(seq, start)
    return _searched(nfa, start, final)


def _searched(nfa: _NFA, start: int, final: int) -> Language | None:
    """Subset construction for "the pattern matches somewhere in the string". A
    configuration is (NFA state, mode): mode 0 free, 1 after `$` (only a final "\\n" may
    follow), 2 at the end. `final` loops on every character, and the start state joins
    every subset (a match may begin anywhere), but "^" only holds before the first one."""
    every = clip(((0, TOP),))
    nfa.chars[final].append((every, final))
    bounds = {0, NEWLINE, NEWLINE + 1}
    for edges in nfa.chars:
        for ranges, _ in edges:
            for lo, hi in ranges:
                bounds.update((lo, hi + 1))
    atoms = _atoms(bounds)
    # classes: atoms that every character edge treats alike
    signature: dict[tuple, int] = {}
    atom_class = []
    edge_sets = [ranges for edges in nfa.chars for ranges, _ in edges]
    for lo, _hi in atoms:
        key = (lo == NEWLINE, tuple(_contains(r, lo) for r in edge_sets))
        atom_class.append(signature.setdefault(key, len(signature)))
    classes = [[] for _ in signature]
    for (lo, hi), c in zip(atoms, atom_class, strict=True):
        classes[c].append((lo, hi))
    reps = [ranges[0][0] for ranges in classes]

    def closure(configs: set[tuple[int, int]], at_start: bool) -> frozenset[tuple[int, int]]:
        todo, seen = list(configs), set(configs)
        while todo:
            s, mode = todo.pop()
            for t, kind in nfa.eps[s]:
                if kind == "^" and not at_start:
                    continue
                nxt = (t, max(mode, {"": 0, "^": 0, "$": 1, "Z": 2}[kind]))
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)

    def step(subset: frozenset[tuple[int, int]], rep: int) -> frozenset[tuple[int, int]]:
        moved = {(start, 0)}
        for s, mode in subset:
            if mode == 2 or (mode == 1 and rep != NEWLINE):
                continue
            for ranges, t in nfa.chars[s]:
                if _contains(ranges, rep):
                    moved.add((t, 2 if mode == 1 else 0))
        return closure(moved, False)

    states = _Numbering(closure({(start, 0)}, True))
    delta = []
    try:
        for subset in states.order:
            delta.append(tuple(states.number(step(subset, rep)) for rep in reps))
    except Unsupported:
        return None
    accepting = frozenset(
        i for i, sub in enumerate(states.order) if any(s == final for s, _ in sub)
    )
    return _minimal(tuple(tuple(c) for c in classes), delta, accepting)


class _Numbering:
    """DFA states numbered in the order they are found (state 0 first), at most
    MAX_DFA_STATES of them (then `number` raises `Unsupported`)."""

    def __init__(self, first: object):
        self.index = {first: 0}
        self.order = [first]

    def number(self, state: object) -> int:
        if state not in self.index:
            if len(self.order) >= MAX_DFA_STATES:
                raise Unsupported("too many states")
            self.index[state] = len(self.order)
            self.order.append(state)
        return self.index[state]


def _atoms(bounds: set[int]) -> list[tuple[int, int]]:
    cuts = sorted(b for b in bounds if 0 <= b <= TOP)
    out = []
    for lo, hi in zip(cuts, [*cuts[1:], TOP + 1], strict=True):
        out.extend(clip(((lo, hi - 1),)))
    return out


def _contains(ranges: Ranges, cp: int) -> bool:
    i = bisect.bisect_right(ranges, (cp, TOP + 1)) - 1
    return i >= 0 and ranges[i][0] <= cp <= ranges[i][1]


def _refine(a: tuple[Ranges, ...], b: tuple[Ranges, ...]) -> tuple[list[Ranges], list, list]:
    """The common refinement of two class partitions, with each new class's old ones."""
    bounds = {lo for ranges in (*a, *b) for lo, _ in ranges}
    owner_a = sorted((lo, hi, c) for c, ranges in enumerate(a) for lo, hi in ranges)
    owner_b = sorted((lo, hi, c) for c, ranges in enumerate(b) for lo, hi in ranges)

    def find(owner: list, cp: int) -> int:
        i = bisect.bisect_right(owner, (cp, TOP + 1, 1 << 30)) - 1
        return owner[i][2]

    pairs: dict[tuple[int, int], int] = {}
    classes: list[list[tuple[int, int]]] = []
    for lo, hi in _atoms(bounds | {hi + 1 for ranges in (*a, *b) for _, hi in ranges}):
        key = (find(owner_a, lo), find(owner_b, lo))
        if key not in pairs:
            pairs[key] = len(classes)
            classes.append([])
        classes[pairs[key]].append((lo, hi))
    left = [k[0] for k in pairs]
    right = [k[1] for k in pairs]
    return [normalize(c) for c in classes], left, right


def _minimal(classes: tuple[Ranges, ...], delta: list, accepting: frozenset[int]) -> Language:
    """Moore's partition refinement, then merge classes every state treats alike."""
    block = [int(s in accepting) for s in range(len(delta))]
    while True:
        keys: dict[tuple, int] = {}
        new = [keys.setdefault((block[s], tuple(block[t] for t in row)), len(keys))
               for s, row in enumerate(delta)]  # fmt: skip
        if len(keys) == len(set(block)):
            break
        block = new
    # renumber so the start state is 0
    order: dict[int, int] = {}
    for s in [0, *range(len(delta))]:
        order.setdefault(block[s], len(order))
    rows: dict[int, tuple[int, ...]] = {}
    for s, row in enumerate(delta):
        rows.setdefault(order[block[s]], tuple(order[block[t]] for t in row))
    columns: dict[tuple[int, ...], int] = {}
    merged: list[list[tuple[int, int]]] = []
    for c in range(len(classes)):
        col = tuple(rows[s][c] for s in range(len(rows)))
        if col not in columns:
            columns[col] = len(merged)
            merged.append([])
        merged[columns[col]].extend(classes[c])
    new_delta = tuple(tuple(col[s] for col in columns) for s in range(len(rows)))
    acc = frozenset(order[block[s]] for s in accepting)
    return Language(tuple(normalize(m) for m in merged), new_delta, acc)


