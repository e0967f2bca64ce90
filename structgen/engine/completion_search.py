"""The shortest completion of a grammar from a matcher's state, in tokens, as far as a greedy
search finds it (engine/closing.py closes outputs with it).

Neither xgrammar nor llguidance can answer "the shortest completion": the search walks the
matcher itself (accept / rollback), one mask fill per step. Text the grammar forces (keys,
punctuation) is taken as the tokenizer spells it; elsewhere it prefers tokens that close (`"`,
then `]`, `}`), then a comma, then short values (`0`, `""`, `null`), then the longest other tokens, and at
each step takes a token that completes the grammar at once where one of the candidates does.
It is greedy, so its completion is short, not always the shortest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from structgen.grammar.backends.base import allocate_bitmask

if TYPE_CHECKING:
    from structgen.grammar import GrammarMatcher

# The search: candidates tried per step, and the most mask fills one search may spend.
SEARCH_CANDIDATES = 16
SEARCH_MAX_FILLS = 256

_CLOSERS = frozenset(b'"]}')
_SHORT_VALUES = frozenset([b'""', b"[]", b"{}", b"null", b"true", b"false", *(bytes([c]) for c in b"0123456789")])


class CompletionSearch:
    """Finds a short sequence of tokens that completes a matcher's grammar from its state."""

    def __init__(self, tokens: Sequence[bytes], excluded: Iterable[int], vocab_size: int,
                 encode: Callable[[str], list[int]]):
        self.tokens = tokens
        self.encode = encode  # text -> token ids, as the tokenizer spells it
        self.vocab_size = vocab_size
        excluded = set(excluded)
        ranks = np.array([_rank(b) if i not in excluded else _EXCLUDED for i, b in enumerate(tokens)], dtype=np.int64)
        order = np.argsort(ranks, kind="stable")
        self.order = order[ranks[order] < _EXCLUDED]  # token ids, best candidates first
        self._row = allocate_bitmask(1, vocab_size, host_only=True)

    def shortest(self, m: GrammarMatcher, limit: int) -> list[int] | None:
        """Tokens after which `m` is complete, at most `limit` of them; None where the search
        found none. `m` is left as it was."""
        path: list[int] = []
        try:
            for _ in range(SEARCH_MAX_FILLS):
                if m.is_completed():  # forced text may have overrun the limit in one go
                    return path if len(path) <= limit else None
                if len(path) >= limit:
                    return None
                forced = self._forced(m)
                if forced:
                    path += forced
                    continue
                step = self._step(m)
                if step is None:
                    return None
                path.append(step)
                if not m.accept_token(step):  # pragma: no cover - `_step` checked it
                    path.pop()
                    return None
            return None
        finally:
            m.rollback(len(path))

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
        return ids[: m.accept_tokens(ids)]

    def _step(self, m: GrammarMatcher) -> int | None:
        """The next token of the search: a candidate that completes the grammar, else the
        first candidate the matcher accepts."""
        first = None
        for t in self._candidates(m):
            if not m.accept_token(t):  # llguidance's mask may allow more than it accepts
                continue
            done = m.is_completed()
            m.rollback(1)
            if done:
                return t
            if first is None:
                first = t
        return first

    def _candidates(self, m: GrammarMatcher) -> list[int]:
        m.fill_bitmask(self._row, 0)
        bits = np.unpackbits(self._row[0].numpy().view(np.uint8), bitorder="little")
        allowed = self.order[bits[self.order].astype(bool)]
        return allowed[:SEARCH_CANDIDATES].tolist()


_EXCLUDED = 1 << 40


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


__all__ = ["SEARCH_MAX_FILLS", "CompletionSearch"]
