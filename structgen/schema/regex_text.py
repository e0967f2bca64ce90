"""A DFA (`regex_dfa.Language`) written back as a pattern, by state elimination: literals,
character classes (with `\\d`, `\\w`, `\\s` where they fit), `|`, `*` and groups, in a syntax
Python, llguidance and xgrammar all read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from structgen.schema.charsets import (
    TOP,
    Ranges,
    category,
    clip,
    complement,
    minus,
    normalize,
    subset,
)

if TYPE_CHECKING:
    from structgen.schema.regex_dfa import Language

MAX_PATTERN_CHARS = 20000
NOTHING = "\x00nothing"  # marker: the empty language


def eliminate(lang: Language) -> str | None:
    """State elimination: a regex for the paths from the start to an accepting state."""
    live = _live_states(lang)
    if 0 not in live:
        return NOTHING
    n = len(lang.delta)
    start, end = n, n + 1
    edges: dict[tuple[int, int], str] = {}

    def add(a: int, b: int, rx: str) -> None:
        edges[(a, b)] = _alt(edges[(a, b)], rx) if (a, b) in edges else rx

    for s in live:
        targets: dict[int, list[int]] = {}
        for c, t in enumerate(lang.delta[s]):
            if t in live:
                targets.setdefault(t, []).append(c)
        for t, cs in targets.items():
            add(s, t, _class_regex(normalize([r for c in cs for r in lang.classes[c]])))
        if s in lang.accepting:
            add(s, end, "")
    add(start, 0, "")
    remaining = set(live)
    while remaining:
        # the state whose elimination adds the least text goes first (Delgado and Morais)
        def cost(q: int) -> int:
            ins = [len(rx) for (a, b), rx in edges.items() if b == q and a != q]
            outs = [len(rx) for (a, b), rx in edges.items() if a == q and b != q]
            loop = len(edges.get((q, q), ""))
            return (
                sum(ins) * (len(outs) - 1)
                + sum(outs) * (len(ins) - 1)
                + loop * (len(ins) * len(outs) - 1)
            )

        q = min(remaining, key=cost)
        remaining.discard(q)
        loop = edges.pop((q, q), None)
        star = _star(loop) if loop else ""
        ins = [(a, rx) for (a, b), rx in edges.items() if b == q]
        outs = [(b, rx) for (a, b), rx in edges.items() if a == q]
        for a, _ in ins:
            del edges[(a, q)]
        for b, _ in outs:
            del edges[(q, b)]
        for a, rx_in in ins:
            for b, rx_out in outs:
                add(a, b, _concat(rx_in, star, rx_out))
        if sum(len(rx) for rx in edges.values()) > MAX_PATTERN_CHARS:
            return None
    return edges.get((start, end), NOTHING)


def _live_states(lang: Language) -> set[int]:
    """Reachable states from which an accepting state is reachable."""
    reach = lang._reachable()
    back: dict[int, set[int]] = {}
    for s in reach:
        for t in lang.delta[s]:
            back.setdefault(t, set()).add(s)
    live, todo = set(lang.accepting & reach), list(lang.accepting & reach)
    while todo:
        for s in back.get(todo.pop(), ()):
            if s not in live:
                live.add(s)
                todo.append(s)
    return live


def _alt(a: str, b: str) -> str:
    return f"{a}|{b}"


def _concat(*parts: str) -> str:
    return "".join(p if "|" not in _top_level(p) else f"(?:{p})" for p in parts)


def _star(rx: str) -> str:
    return rx + "*" if _is_atom(rx) else f"(?:{rx})*"


def _skip_atom(rx: str, i: int) -> int:
    """The index after the atom (character, escape, class or group) starting at `i`."""
    ch = rx[i]
    if ch == "\\":
        return i + {"x": 4, "u": 6, "U": 10}.get(rx[i + 1], 2)
    if ch == "[":
        j = i + 1
        if j < len(rx) and rx[j] == "^":
            j += 1
        while rx[j] != "]":
            j += 2 if rx[j] == "\\" else 1
        return j + 1
    if ch == "(":
        depth, j = 0, i
        while True:
            if rx[j] == "\\":
                j += 2
                continue
            if rx[j] == "[":
                j = _skip_atom(rx, j)
                continue
            depth += {"(": 1, ")": -1}.get(rx[j], 0)
            j += 1
            if depth == 0:
                return j
    return i + 1


def _top_level(rx: str) -> str:
    """The characters of `rx` outside classes and groups (to see a top-level `|`)."""
    out, i = [], 0
    while i < len(rx):
        j = _skip_atom(rx, i)
        if j == i + 1 and rx[i] not in "\\[(":
            out.append(rx[i])
        i = j
    return "".join(out)


def _is_atom(rx: str) -> bool:
    """One character, escape, class or group: safe to follow with `*`."""
    return bool(rx) and _skip_atom(rx, 0) == len(rx)


_SPECIAL = set("\\.^$|?*+()[]{}")


def _class_regex(ranges: Ranges) -> str:
    """A regex for one character of `ranges`."""
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        ch = chr(ranges[0][0])
        return "\\" + ch if ch in _SPECIAL else _char(ranges[0][0], in_class=False)
    if ranges == clip(((0, TOP),)):
        return "[\\s\\S]"
    inside = _class_body(ranges)
    outside = _class_body(complement(ranges))
    if inside in ("\\d", "\\w", "\\s"):
        return inside
    return f"[{inside}]" if len(inside) <= len(outside) + 1 else f"[^{outside}]"


def _class_body(ranges: Ranges) -> str:
    """The inside of a bracket class for `ranges`, using \\d \\w \\s where they fit."""
    if not ranges:
        return "\\s\\S"
    parts = []
    rest = ranges
    for name in ("\\w", "\\d", "\\s"):
        cat = category(name)
        if cat and subset(cat, rest):
            parts.append(name)
            rest = minus(rest, cat)
    for lo, hi in rest:
        if lo == hi:
            parts.append(_char(lo, in_class=True))
        elif hi == lo + 1:
            parts.append(_char(lo, in_class=True) + _char(hi, in_class=True))
        else:
            parts.append(f"{_char(lo, in_class=True)}-{_char(hi, in_class=True)}")
    return "".join(parts)


def _char(cp: int, in_class: bool) -> str:
    ch = chr(cp)
    if in_class and ch in "\\]^-[&~":
        return "\\" + ch
    if cp < 0x20 or cp == 0x7F or 0x80 <= cp < 0xA0:
        return f"\\x{cp:02x}"
    if cp > 0xFFFF and not ch.isprintable():
        return f"\\U{cp:08x}"
    if not ch.isprintable() or ch.isspace() and ch != " ":
        return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"
    return ch
