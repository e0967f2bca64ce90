"""Automatic prefix caching: full KV pages of prompts, found again by the tokens they hold.

A page is keyed by the hash chain of its tokens: the key of page i is (hash of page i-1's key,
the page's tokens), so equal keys mean equal tokens from the start of the sequence (the tokens
are part of the key, compared on lookup; only the parent is a hash). A page enters the cache
once its K/V are computed and stays there while requests use it; when no request holds it
any more it waits in LRU order, still findable, until the pool needs a page and evicts it.

A burst of requests sharing a long prompt start (agent turns with one tool catalogue) would
hash the same hundreds of pages once per request: `match` remembers the chain it found last and
takes its pages for a new sequence whose tokens equal it page for page (a comparison of token
lists, not a hash per page), hashing only the pages past it. Equal tokens make equal keys, so
the pages are the ones a walk would find, as long as none was evicted since. The turns' ids
are mostly the same int objects (the prompt encoder splices one kept copy of a long message),
so the comparison looks at the lists' item pointers first (`_same_items`): a memcmp, where
slicing a list of thousands of ints to compare it writes every int's reference count.
"""

from __future__ import annotations

import ctypes
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from structgen.engine.garbage_collection import untracked_ints

PageKey = tuple[int, tuple[int, ...]]  # (hash of the previous page's key, this page's tokens)
ROOT_HASH = 0  # the parent hash of a sequence's first page


def page_keys(tokens: Sequence[int], page_size: int, num_pages: int, parent: int = ROOT_HASH,
              first: int = 0) -> list[PageKey]:
    """Keys of pages `first` .. `first + num_pages - 1` of `tokens`, chained from `parent`
    (the hash of page `first - 1`'s key)."""
    keys = []
    for i in range(first, first + num_pages):
        key = (parent, tuple(tokens[i * page_size : (i + 1) * page_size]))
        keys.append(key)
        parent = hash(key)
    return keys


@dataclass(frozen=True)
class Chain:
    """Cached pages a token sequence starts with: their tokens, pages (as a list and as the
    array the page table takes them in) and key hashes."""

    tokens: list[int]
    pages: list[int]
    hashes: list[int]
    page_array: np.ndarray

    @classmethod
    def of(cls, tokens: list[int], pages: list[int], hashes: list[int], head: np.ndarray | None = None) -> Chain:
        """`head`: the array of `pages`' first pages, if known (a burst's turn holds the last
        turn's catalogue pages and a few of its own: only those few are converted)."""
        n = 0 if head is None else len(head)
        array = np.array(pages[n:], dtype=np.int64)
        # (lists of ints only: out of the cyclic collector's sight, as requests' tokens are)
        return cls(untracked_ints(tokens), untracked_ints(pages), untracked_ints(hashes),
                   np.concatenate((head, array)) if n else array)


NO_CHAIN = Chain.of([], [], [])


class PrefixCache:
    """Which page holds which key, and the LRU order of cached pages no request holds."""

    def __init__(self) -> None:
        self._page_of: dict[PageKey, int] = {}
        self._key_of: dict[int, PageKey] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._last = NO_CHAIN  # what `match` found last, while none of it may be evicted
        # Pages the last two matched sequences shared: where the next one likely parts from the
        # last (a burst's turns part where their shared system message ends).
        self._parted: int | None = None

    def __len__(self) -> int:
        return len(self._page_of)

    @property
    def num_idle(self) -> int:
        """Cached pages no request holds: evictable."""
        return len(self._idle)

    def find(self, key: PageKey) -> int | None:
        return self._page_of.get(key)

    def match(self, tokens: list[int], page_size: int, num_pages: int) -> Chain:
        """The longest run of cached pages that `tokens`' first `num_pages` pages are: the
        pages of the last chain found that `tokens` start with, then a walk of the hash chain
        from there until a page is missing."""
        last = self._last
        known = common_pages(tokens, last.tokens, page_size, min(num_pages, len(last.pages)), self._parted)
        self._parted = known
        pages, hashes = last.pages[:known], last.hashes[:known]
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(known, num_pages):
            page = self._page_of.get(key := (parent, tuple(tokens[i * page_size : (i + 1) * page_size])))
            if page is None:
                break
            parent = hash(key)
            pages.append(page)
            hashes.append(parent)
        if len(pages) == known == len(last.pages):
            return last  # the chain found last, whole (a burst's turns): no copy of its tokens
        self._last = Chain.of(tokens[: len(pages) * page_size], pages, hashes, last.page_array[:known])
        return self._last

    def holds(self, page: int) -> bool:
        return page in self._key_of

    def insert(self, key: PageKey, page: int) -> bool:
        """Cache `page` under `key`; False (nothing changes) where another page has that key."""
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def use(self, page: int) -> None:
        """A request takes the cached `page`: it is no longer evictable."""
        self._idle.pop(page, None)

    def idle(self, page: int) -> None:
        """The last request holding cached `page` let go of it: evictable, newest last."""
        self._idle[page] = None

    def evict(self) -> int | None:
        """Drop the least recently used idle page from the cache and return it (None: none)."""
        if not self._idle:
            return None
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        self._last = NO_CHAIN
        return page


def _item_pointers() -> tuple[int, Callable[[int, int, int], int]] | None:
    """(offset of a list's item-array address in the list object, libc's memcmp called with
    the GIL held), checked on a list; None where CPython's list layout or memcmp is not there."""
    if sys.implementation.name != "cpython":
        return None
    try:
        memcmp = ctypes.PyDLL(None).memcmp
    except (OSError, AttributeError, TypeError):  # (no process-wide symbols to load: Windows)
        return None
    memcmp.argtypes, memcmp.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
    offset = 3 * ctypes.sizeof(ctypes.c_ssize_t)  # after the reference count, type and size
    probe = [object()]
    items = ctypes.c_void_p.from_address(id(probe) + offset).value
    return (offset, memcmp) if items and ctypes.c_void_p.from_address(items).value == id(probe[0]) else None


_ITEM_POINTERS = _item_pointers()
_POINTER = ctypes.sizeof(ctypes.c_void_p)


def _same_items(a: list[int], b: list[int], lo: int, hi: int) -> bool:
    """Whether `a[lo:hi]` and `b[lo:hi]` (both in range) are the same objects, hence equal:
    their item pointers compared, nothing copied. False says nothing (equal ints may be
    distinct objects), and always False where `_ITEM_POINTERS` is None."""
    if _ITEM_POINTERS is None:
        return False
    offset, memcmp = _ITEM_POINTERS
    pa = ctypes.c_void_p.from_address(id(a) + offset).value
    pb = ctypes.c_void_p.from_address(id(b) + offset).value
    return bool(pa and pb) and memcmp(pa + _POINTER * lo, pb + _POINTER * lo, _POINTER * (hi - lo)) == 0


def common_pages(a: list[int], b: list[int], page_size: int, limit: int, guess: int | None = None) -> int:
    """How many leading pages, up to `limit`, of token lists `a` and `b` are equal: list
    comparisons (the item pointers first, then the values), bisecting where the lists part;
    each comparison covers only the pages not yet known equal, so the whole search reads
    about twice the lists' length. `guess`: the likely answer, tried first (two comparisons
    where it is right, instead of a bisection's several over a long prompt)."""
    equal, differ = 0, limit + 1  # pages [0, equal) are equal; [0, differ) are not
    # The usual answer first: the guess, else the whole of `limit` (a burst's turns share their start).
    probes = [guess, guess + 1] if guess is not None and 0 < guess < limit else [limit]
    while True:
        while probes and not equal < probes[0] < differ:
            probes.pop(0)
        mid = probes.pop(0) if probes else (equal + differ) // 2
        if not equal < mid < differ:
            return equal
        lo, hi = equal * page_size, mid * page_size
        if _same_items(a, b, lo, hi) or a[lo:hi] == (b if lo == 0 and hi == len(b) else b[lo:hi]):
            equal = mid
        else:
            differ = mid
