"""Sets of characters as sorted code point intervals, for `regex_dfa`: the classes of a
pattern (`[a-z]`, `\\d`, `.`) and the set operations on them. `\\d`, `\\w`, `\\s` are Python's
Unicode classes (what `jsonschema` matches with); lone surrogates are left out (JSON text
cannot carry them)."""

from __future__ import annotations

import functools
import re
import re._constants as sc  # the stdlib regex parser's opcodes

TOP = 0x10FFFF
UNIVERSE = ((0, 0xD7FF), (0xE000, TOP))
NEWLINE = ord("\n")
CATEGORY_REGEX = {
    sc.CATEGORY_DIGIT: r"\d", sc.CATEGORY_NOT_DIGIT: r"\D", sc.CATEGORY_WORD: r"\w",
    sc.CATEGORY_NOT_WORD: r"\W", sc.CATEGORY_SPACE: r"\s", sc.CATEGORY_NOT_SPACE: r"\S",
}  # fmt: skip

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code point intervals


class Unsupported(Exception):
    """A regex construct with no automaton here (lookbehind, backreferences, flags...)."""


def normalize(ranges: list[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return clip(tuple(out))


def clip(ranges: Ranges) -> Ranges:
    """Intersect with the universe (drop surrogates)."""
    out = []
    for lo, hi in ranges:
        for ulo, uhi in UNIVERSE:
            a, b = max(lo, ulo), min(hi, uhi)
            if a <= b:
                out.append((a, b))
    return tuple(out)


def complement(ranges: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= TOP:
        out.append((nxt, TOP))
    return clip(tuple(out))


@functools.cache
def category(regex: str) -> Ranges:
    """The code points Python's `re` puts in `\\d`, `\\w`, `\\s` (Unicode)."""
    text = _all_chars()
    return clip(tuple((m.start(), m.end() - 1) for m in re.finditer(regex + "+", text)))


def warm_up() -> None:
    """Compute the Unicode classes now (0.2 s; grammar.compiler's `warm_up`)."""
    for regex in ("\\d", "\\w", "\\s"):
        category(regex)


@functools.cache
def _all_chars() -> str:
    return "".join(map(chr, range(TOP + 1)))


def charset(item: tuple) -> Ranges:
    """The code points of a one-character regex item (parsed)."""
    op, av = item
    if op is sc.LITERAL:
        return ((av, av),)
    if op is sc.NOT_LITERAL:
        return complement(((av, av),))
    if op is sc.ANY:
        return complement(((NEWLINE, NEWLINE),))
    if op is sc.IN:
        negate = bool(av) and av[0][0] is sc.NEGATE
        parts: list[tuple[int, int]] = []
        for kind, value in av[1:] if negate else av:
            if kind is sc.LITERAL:
                parts.append((value, value))
            elif kind is sc.RANGE:
                parts.append(value)
            elif kind is sc.CATEGORY and value in CATEGORY_REGEX:
                name = CATEGORY_REGEX[value]
                base = category(name.lower())
                parts.extend(complement(base) if name[1].isupper() else base)
            else:
                raise Unsupported(kind)
        ranges = normalize(parts)
        return complement(ranges) if negate else ranges
    raise Unsupported(op)



def subset(a: Ranges, b: Ranges) -> bool:
    return minus(a, b) == ()


def minus(a: Ranges, b: Ranges) -> Ranges:
    return intersect(a, complement(b))


def intersect(a: Ranges, b: Ranges) -> Ranges:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)
