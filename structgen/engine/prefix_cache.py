"""Automatic prefix caching: full KV pages of prompts, found again by the tokens they hold.

A page is keyed by the hash chain of its tokens: the key of page i is (hash of page i-1's key,
the page's tokens), so equal keys mean equal tokens from the start of the sequence (the tokens
are part of the key, compared on lookup; only the parent is a hash). A page enters the cache
once its K/V are computed and stays there while requests use it; when no request holds it
any more it waits in LRU order, still findable, until the pool needs a page and evicts it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

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


class PrefixCache:
    """Which page holds which key, and the LRU order of cached pages no request holds."""

    def __init__(self) -> None:
        self._page_of: dict[PageKey, int] = {}
        self._key_of: dict[int, PageKey] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first

    def __len__(self) -> int:
        return len(self._page_of)

    @property
    def num_idle(self) -> int:
        """Cached pages no request holds: evictable."""
        return len(self._idle)

    def find(self, key: PageKey) -> int | None:
        return self._page_of.get(key)

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
        return page
