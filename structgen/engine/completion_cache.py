"""Completions shared between requests: what the completion search found from one grammar
state, kept for the next request that reaches the same state (engine/closing.py asks).

A matcher's state is a function of the compiled grammar that made it and the tokens it took
since, so (grammar, those tokens) names the state exactly: requests of one schema are all in
the same state at admission, where a small `max_tokens` makes each search, and outputs that
agree so far pass through the same states. An entry holds what the search found for every
limit (`Completion`), so a hit answers exactly as a fresh search would.

Bounded: at most CACHE_MAX_ENTRIES entries, the least recently used dropped first; a state
reached after more than CACHE_MAX_HISTORY tokens, or a completion longer than that, is not
kept. A key holds 4 bytes a token, a completion a tuple of ids: about 10 MB at the worst,
a few hundred KB for short JSON outputs.
"""

from __future__ import annotations

import itertools
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from structgen.engine.completion_search import Completion
    from structgen.grammar.backends.base import CompiledGrammar

CACHE_MAX_ENTRIES = 1024
CACHE_MAX_HISTORY = 256

StateKey = tuple[int, bytes]


class CompletionCache:
    """The search's `Completion` per grammar state, least recently used dropped first."""

    def __init__(self, max_entries: int = CACHE_MAX_ENTRIES, max_history: int = CACHE_MAX_HISTORY):
        self.max_entries, self.max_history = max_entries, max_history
        self._entries: OrderedDict[StateKey, Completion] = OrderedDict()
        # A number per grammar, never reused: an entry of a grammar gone can match no other.
        self._grammar_ids: weakref.WeakKeyDictionary[CompiledGrammar, int]
        self._grammar_ids = weakref.WeakKeyDictionary()
        self._next_id = itertools.count()
        self.hits = 0
        self.misses = 0

    def key(self, grammar: CompiledGrammar | None, history: Sequence[int]) -> StateKey | None:
        """The key of the state `grammar`'s matchers reach after taking `history` from their
        start; None where it is not kept (no grammar known, a long history)."""
        if grammar is None or len(history) > self.max_history:
            return None
        gid = self._grammar_ids.get(grammar)
        if gid is None:
            gid = self._grammar_ids[grammar] = next(self._next_id)
        return gid, array("I", history).tobytes()

    def get(self, key: StateKey | None, limit: int) -> Completion | None:
        """The kept search of state `key` where it answers for `limit`, else None."""
        if key is None:
            return None
        found = self._entries.get(key)
        if found is None or not found.answers(limit):
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return found

    def put(self, key: StateKey | None, found: Completion) -> None:
        if key is None or (found.tokens is not None and len(found.tokens) > self.max_history):
            return
        self._entries[key] = found
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


__all__ = ["CACHE_MAX_ENTRIES", "CACHE_MAX_HISTORY", "CompletionCache"]
