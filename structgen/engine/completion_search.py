"""The shortest completion of a grammar from a matcher's state, in tokens, as far as a greedy
search finds it (engine/closing.py closes outputs with it).

Neither xgrammar nor llguidance can answer "the shortest completion": the search walks the
matcher itself (accept / rollback), one mask fill per step. Text the grammar forces (keys,
punctuation) is taken as the tokenizer spells it; elsewhere it prefers tokens that close (`"`,
then `]`, `}`), then a comma, then short values (`0`, `""`, `null`), then the longest other tokens, and at
each step takes a token that completes the grammar at once where one of the candidates does.
It is greedy, so its completion is short, not always the shortest. Where nothing that ends a
value may come next (inside a string with a format or a pattern, a number after its sign), the
greedy choice can run on forever (`[a-z]+` takes letters while an `@` is what ends it), so a
small breadth-first probe over a few characters, one of each kind, first finds the fewest after
which a quote, bracket or comma may come.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from structgen.grammar.backends.base import allocate_bitmask, count_allowed, would_accept

if TYPE_CHECKING:
    from structgen.grammar import GrammarMatcher

# The search: candidates tried per step, and the most mask fills one search may spend.
SEARCH_CANDIDATES = 16
SEARCH_MAX_FILLS = 256
# The probe: characters it tries (one of each kind the formats and patterns of JSON schemas
# need: letters, digits, separators, the letters of dates and durations), the most
# characters it appends, and the most paths one probe extends (each tries every character).
PROBE_ALPHABET = "a0A1.-:/@_T Z+PDS#"
PROBE_MAX_DEPTH = 32
PROBE_MAX_NODES = 160
SEARCH_MAX_PROBE_NODES = 480  # all the probes of one search together
# Characters of one kind: a path grows by the first of a kind the matcher accepts only (`1`
# where `0` may not come, `T` where no other letter may), so the probe does not branch on them.
# The coarse kinds come first (a pattern's `.` accepts any character: branching on every
# separator would spend the probe), the fine ones where those find nothing (`@` after a
# letter where `.` may come too).
_COARSE_KINDS = {c: "digit" if c.isdigit() else "letter" if c.isalpha() else "other" for c in PROBE_ALPHABET}
_FINE_KINDS = {c: "digit" if c.isdigit() else "letter" if c.isalpha() else c for c in PROBE_ALPHABET}
# The greedy choice taking one token this many times in a row is looping (a local part of an
# email that takes `}` as text, the fraction of a second): the probe then looks for a quote.
SEARCH_LOOP_RUN = 12
# A rank below this (a quote, bracket or comma) can end the value being written.
_ENDS_VALUE_RANK = 1600
# Candidates are looked for among this many best-ranked tokens first (inside a free string
# nearly every token is allowed, and these hold enough of them), and a mask that allows at
# most SPARSE_MASK_TOKENS tokens is read token by token instead of the whole ranking.
HEAD_CANDIDATES = 1024
SPARSE_MASK_TOKENS = 4096
# Texts whose token ids the search keeps (forced keys and punctuation recur in every search).
ENCODED_TEXTS_KEPT = 4096

_CLOSERS = frozenset(b'"]}')
_SHORT_VALUES = frozenset([b'""', b"[]", b"{}", b"null", b"true", b"false", *(bytes([c]) for c in b"0123456789")])


@dataclass(frozen=True)
class Completion:
    """What one search found from one state, valid for every limit: `tokens` complete the
    grammar there (None: the search found none), and a search with a limit below `needs`
    returns None (it stops at the limit, or the completion is longer), one with a limit of
    at least `needs` returns `tokens` (where `tokens` is None, it is not known what)."""

    tokens: tuple[int, ...] | None
    needs: int

    def answers(self, limit: int) -> bool:
        """Whether a search with `limit` from the same state would return `within(limit)`."""
        return self.tokens is not None or limit < self.needs

    def within(self, limit: int) -> list[int] | None:
        """What the search returns with `limit`: the completion where it fits, else None."""
        return list(self.tokens) if self.tokens is not None and limit >= self.needs else None


class CompletionSearch:
    """Finds a short sequence of tokens that completes a matcher's grammar from its state."""

    def __init__(self, tokens: Sequence[bytes], excluded: Iterable[int], vocab_size: int,
                 encode: Callable[[str], list[int]]):
        self.tokens = tokens
        self._encode_text = encode  # text -> token ids, as the tokenizer spells it
        self._encoded: dict[str, tuple[int, ...]] = {}
        self.vocab_size = vocab_size
        excluded = set(excluded)
        ranks = np.array([_rank(b) if i not in excluded else _EXCLUDED for i, b in enumerate(tokens)], dtype=np.int64)
        order = np.argsort(ranks, kind="stable")
        self.order = order[ranks[order] < _EXCLUDED]  # token ids, best candidates first
        self.ranks = ranks
        self._rank_of = np.full(len(tokens), len(self.order), dtype=np.int64)  # index in `order`
        self._rank_of[self.order] = np.arange(len(self.order))
        head = self.order[:HEAD_CANDIDATES]
        self._head_words, self._head_bits = head >> 5, (head & 31).astype(np.uint32)
        self._row = allocate_bitmask(1, vocab_size, host_only=True)
        self.probe_chars = [[(t, kinds[c]) for c in PROBE_ALPHABET
                             for t in _single_tokens(c, self.encode)] for kinds in (_COARSE_KINDS, _FINE_KINDS)]
        self.enders = _single_tokens('"]},', self.encode)  # a probe's goal: what ends a value
        self.quote = self.enders[:1]  # a looping string's goal
        self.probe_nodes_left = 0  # what the current search's probes may still spend
        self.searches = 0  # searches run, for the stats and the tests

    def encode(self, text: str) -> tuple[int, ...]:
        """`text`'s token ids as the tokenizer spells it (kept: the same texts recur)."""
        ids = self._encoded.get(text)
        if ids is None:
            if len(self._encoded) >= ENCODED_TEXTS_KEPT:
                self._encoded.clear()
            ids = self._encoded[text] = tuple(self._encode_text(text))
        return ids

    def shortest(self, m: GrammarMatcher, limit: int) -> list[int] | None:
        """Tokens after which `m` is complete, at most `limit` of them; None where the search
        found none. `m` is left as it was."""
        return self.search(m, limit).within(limit)

    def search(self, m: GrammarMatcher, limit: int) -> Completion:
        """The search from `m`'s state, stopped where its path reaches `limit` tokens; what it
        found, for this limit and any other (`Completion`). `m` is left as it was. The limit
        only stops the search: the path it takes is the same under any limit."""
        self.searches += 1
        path: list[int] = []
        longest = -1  # the longest path seen unfinished: a limit up to it stops the search
        self.probe_nodes_left = SEARCH_MAX_PROBE_NODES
        try:
            for _ in range(SEARCH_MAX_FILLS):
                if m.is_completed():  # forced text may have overrun the limit in one go
                    return Completion(tuple(path), max(longest + 1, len(path)))
                longest = max(longest, len(path))
                if len(path) >= limit:
                    return Completion(None, limit + 1)
                if not self._advance(m, path):
                    break
            return Completion(None, sys.maxsize)
        finally:
            m.rollback(len(path))

    def _advance(self, m: GrammarMatcher, path: list[int]) -> bool:
        """One step of the search: `m` takes forced text, a probe's characters or one
        token, and `path` gets them; False where no token can come."""
        forced = self._forced(m)
        if forced:
            path += forced
            return True
        candidates = self._candidates(m)
        looping = len(path) >= SEARCH_LOOP_RUN and len(set(path[-SEARCH_LOOP_RUN:])) == 1
        probing = self.probe_nodes_left > 0
        if probing and looping:
            m.rollback(SEARCH_LOOP_RUN - 1)
            del path[1 - SEARCH_LOOP_RUN :]
            candidates = self._candidates(m)
        if probing and (looping or not any(self.ranks[t] < _ENDS_VALUE_RANK for t in candidates)):
            mask = self._row[0].numpy().view(np.uint32)  # `m`'s mask, as `_candidates` filled it
            probed = self._probe(m, self.quote if looping else self.enders, mask)
            path += probed
            if probed:
                return True
        step = self._step(m, candidates)
        if step is None or not m.accept_token(step):  # `_step` checked it
            return False
        path.append(step)
        return True

    def _forced(self, m: GrammarMatcher) -> list[int]:
        """Take the text the grammar forces (keys, punctuation) as the tokenizer spells it,
        which is how jump-forward and the model write it: token by token it would take more
        tokens. Returns the tokens the matcher took."""
        try:
            text = m.jump_forward_string()
        except UnicodeDecodeError:
            return []
        if not text:
            return []
        ids = self.encode(text)
        return list(ids[: m.accept_tokens(ids)])

    def _step(self, m: GrammarMatcher, candidates: list[int]) -> int | None:
        """The next token of the search: a candidate that completes the grammar, else the
        first candidate the matcher accepts."""
        first = None
        for t in candidates:
            if not m.accept_token(t):  # llguidance's mask may allow more than it accepts
                continue
            done = m.is_completed()
            m.rollback(1)
            if done:
                return t
            if first is None:
                first = t
        return first

    def _probe(self, m: GrammarMatcher, enders: list[int], mask: np.ndarray) -> list[int]:
        """The fewest probe characters after which a value may end (one of `enders` may come,
        or the grammar is complete), breadth first over the coarse kinds, then the fine ones;
        the matcher takes them, respelt in fewer tokens where the tokenizer's spelling is
        accepted. [] where none is found. `mask`: `m`'s mask (its uint32 words), which rules
        out most first characters without asking the matcher."""
        for chars in self.probe_chars:
            first = [(c, kind) for c, kind in chars if mask[c >> 5] >> (c & 31) & 1]
            if found := self._breadth_first(m, enders, chars, first):
                return self._take(m, found)
        return []

    def _breadth_first(self, m: GrammarMatcher, enders: list[int], chars: list[tuple[int, str]],
                       first: list[tuple[int, str]]) -> list[int]:
        """The shortest path of `chars` (its first character one of `first`) after which one
        of `enders` may come; [] where the probe's nodes run out first."""
        frontier: list[list[int]] = [[]]
        nodes = 0
        most = min(PROBE_MAX_NODES, self.probe_nodes_left)
        while frontier and nodes < most:
            grown: list[list[int]] = []
            for path in frontier[: most - nodes]:
                nodes += 1
                self.probe_nodes_left -= 1
                taken = m.accept_tokens(path)
                found = taken == len(path) and self._extend(m, path, grown, enders, chars if path else first)
                m.rollback(taken)
                if found:
                    return grown[-1]
            frontier = [p for p in grown if len(p) <= PROBE_MAX_DEPTH]
        return []

    def _extend(self, m: GrammarMatcher, path: list[int], grown: list[list[int]], enders: list[int],
                chars: list[tuple[int, str]]) -> bool:
        """Append to `grown` each path one probe character longer that the matcher accepts;
        True (that path last) where one can end a value."""
        kinds: set[str] = set()
        for c, kind in chars:
            if kind in kinds or not m.accept_token(c):
                continue
            kinds.add(kind)
            ends = m.is_completed() or any(would_accept(m, t) for t in enders)
            m.rollback(1)
            grown.append([*path, c])
            if ends:
                return True
        return False

    def _take(self, m: GrammarMatcher, chars: list[int]) -> list[int]:
        """Accept the probe's characters, as the tokenizer spells their text where the
        matcher accepts that spelling."""
        ids = self.encode(b"".join(self.tokens[c] for c in chars).decode("utf-8"))
        taken = m.accept_tokens(ids)
        if taken == len(ids):
            return list(ids)
        m.rollback(taken)
        m.accept_tokens(chars)
        return chars

    def _candidates(self, m: GrammarMatcher) -> list[int]:
        """The best-ranked tokens the mask allows, SEARCH_CANDIDATES at most, best first."""
        m.fill_bitmask(self._row, 0)
        words = self._row[0].numpy().view(np.uint32)
        head = np.flatnonzero((words[self._head_words] >> self._head_bits) & 1)
        if len(head) >= SEARCH_CANDIDATES:
            return self.order[head[:SEARCH_CANDIDATES]].tolist()
        if count_allowed(words) > SPARSE_MASK_TOKENS:
            bits = np.unpackbits(words.view(np.uint8), bitorder="little")
            return self.order[bits[self.order].astype(bool)][:SEARCH_CANDIDATES].tolist()
        nonzero = np.flatnonzero(words)
        bits = np.unpackbits(words[nonzero].view(np.uint8), bitorder="little").reshape(-1, 32)
        rows, cols = np.nonzero(bits)
        ids = nonzero[rows] * 32 + cols
        ranked = self._rank_of[ids[ids < len(self._rank_of)]]
        ranked = ranked[ranked < len(self.order)]
        if len(ranked) > SEARCH_CANDIDATES:
            ranked = np.partition(ranked, SEARCH_CANDIDATES - 1)[:SEARCH_CANDIDATES]
        return self.order[np.sort(ranked)].tolist()


_EXCLUDED = 1 << 40


def _single_tokens(chars: str, encode: Callable[[str], Sequence[int]]) -> list[int]:
    """The token of each character that the tokenizer spells in one token."""
    return [ids[0] for c in chars if len(ids := encode(c)) == 1]


def _rank(text: bytes) -> int:
    """Lower first: a quote that may end a string and what closes after it (`"`, `"}`), then
    closing brackets (`]`, `}}`; inside a string these are text, so they come after the quote),
    then a comma (which ends a number where no bracket may close yet), then short whole
    values, then the other tokens, longer first."""
    if not text:
        return _EXCLUDED
    length = min(len(text), 999)
    if set(text) <= _CLOSERS:
        return -length if text[:1] == b'"' else 1000 - length
    if text.strip() == b",":  # ends a number (more digits would only lengthen it)
        return 1500
    if text in _SHORT_VALUES:
        return 2000
    if text.strip() in (b"-", b"+"):  # a sign only lengthens a number
        return 4000
    return 3000 - length if text.strip() else 5000 - length


__all__ = ["SEARCH_MAX_FILLS", "Completion", "CompletionSearch"]
