"""Which KV pages each running request's positions live in.

The KV cache is a pool of fixed-size pages per layer (kv_cache.py). A running request holds a
slot: a row of the page table, `table[slot, i]` = the page of its positions [i * page_size,
(i + 1) * page_size). The table has a fixed shape, [slots + 1, max_seq_len / page_size], so
the CUDA graphs read it as a static input; the extra row is the scratch slot of the graphs'
padding rows. Unmapped entries point at page 0, the scratch page, which no request owns: a
write there (a padding row, a forward launched ahead and discarded) is harmless.

Pages are reference-counted: a prompt page in the prefix cache (prefix_cache.py) may be held by
several requests at once, read-only; a page goes back to the free list (or, when cached, to
the cache's LRU) when nobody holds it. Only full pages are cached, and only once their K/V are
computed: a running request's prompt pages, and as it leaves its slot (finished or preempted)
its output's too, so a chat's next turn finds its history; a request writes only at positions
past its cached ones, so a shared page is never written.

The host copy (`host`) is the truth; `table` is the device copy, brought up to date by `sync`
before a forward reads it (on the CPU they are one tensor). On CUDA the host copy is pinned, so
`sync` copies just the rows that changed without blocking the host (a copy from pageable
memory goes through a driver staging buffer), and a write to it waits until the last copy has
read it (by then, nearly always).
"""

from __future__ import annotations

import numpy as np
import torch

from structgen.engine.garbage_collection import untracked_ints
from structgen.engine.prefix_cache import ROOT_HASH, PrefixCache, page_keys

SCRATCH_PAGE = 0
UNSETTLED = (1, 0)  # no request length lies in it


class PageTable:
    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_seq_len: int, device: torch.device,
                 prefix_caching: bool = True):
        self.page_size, self.num_pages, self.num_slots = page_size, num_pages, num_slots
        self.scratch_slot, self.max_seq_len = num_slots, max_seq_len
        self.max_pages_per_seq = -(-max_seq_len // page_size)
        cuda = device.type == "cuda"
        self.host = torch.full((num_slots + 1, self.max_pages_per_seq), SCRATCH_PAGE, dtype=torch.long,
                               pin_memory=cuda)
        self._host_np = self.host.numpy()
        self.table = self.host if device.type == "cpu" else self.host.to(device)
        # Changes of the table: `sync` copies it to the device, and tensor parallelism sends it
        # to the workers, where it moved since they last did.
        self.version = 0
        self._changed_rows: set[int] = set()  # rows of `host` written since the last sync
        self._copied = torch.cuda.Event() if cuda else None  # recorded behind the last copy
        self._copy_pending = False
        # Tens of thousands of ids: out of the cyclic collector's sight, or every full collection
        # walks them (engine/garbage_collection.py).
        self._free_pages = untracked_ints(list(range(num_pages - 1, SCRATCH_PAGE, -1)))
        # Holds of each page; an array, so a matched prefix's hundreds of pages are counted in
        # one operation, not a Python loop per page (256 agent turns a burst each take ~190).
        self._refs = np.zeros(num_pages, dtype=np.int32)
        self._mapped = [0] * (num_slots + 1)  # pages of each slot: its row's first entries
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.cache = PrefixCache() if prefix_caching else None
        # Per slot, the key hashes of its leading pages that are keyed (found in the cache or
        # put there): those pages may be shared, so the slot never writes them.
        self._keyed: list[list[int]] = [[] for _ in range(num_slots + 1)]
        # Per slot, whether its whole prompt is computed and its full pages published, and then
        # the request lengths (tokens + lookahead) its pages fit as they are, (first, last):
        # the scheduler leaves such a request alone, as most are most steps.
        self._published = [False] * (num_slots + 1)
        self.settled: list[tuple[int, int]] = [UNSETTLED] * (num_slots + 1)
        # `common_pages`' last answer, while no slot's columns below those it compared change:
        # (its slots, sorted, as bytes; columns compared; common pages among them)
        self._common: tuple[bytes, int, int] | None = None

    # -- slots ------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def allocate_slot(self) -> int | None:
        return self._free_slots.pop() if self._free_slots else None

    def release_slot(self, slot: int) -> None:
        """Give back the slot and every page it holds."""
        assert slot not in self._free_slots, f"slot {slot} released twice"
        self.shrink(slot, 0)
        self._published[slot] = False
        self.settled[slot] = UNSETTLED
        self._free_slots.append(slot)

    # -- pages ------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        """Pages a request could take now: free ones and cached ones nobody holds."""
        return len(self._free_pages) + (self.cache.num_idle if self.cache is not None else 0)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def num_mapped(self, slot: int) -> int:
        """Positions of `slot` that have a page."""
        return self._mapped[slot] * self.page_size

    def slot_pages(self, slot: int) -> list[int]:
        """The pages `slot` maps, in order."""
        return self._host_np[slot, : self._mapped[slot]].tolist()

    def cover(self, slot: int, end: int) -> bool:
        """Map pages for positions [0, end) of `slot`; False where the pool ran out (the pages
        taken so far stay)."""
        missing = min(self.pages_for(end), self.max_pages_per_seq) - self._mapped[slot]
        if missing > 0:
            free = self._free_pages
            first = max(len(free) - missing, 0)
            taken = free[first:][::-1]  # popped from the free list's end, as one at a time would
            del free[first:]
            while len(taken) < missing and (page := self._take_page()) is not None:
                taken.append(page)  # (evicted from the prefix cache)
            self._map_fresh(slot, taken)
            missing -= len(taken)
        self._settle(slot)
        return missing <= 0

    def _settle(self, slot: int) -> None:
        n = self._mapped[slot]
        if not self._published[slot] or n == 0:
            self.settled[slot] = UNSETTLED
        else:
            last = 1 << 62 if n == self.max_pages_per_seq else n * self.page_size  # (no end needs more)
            self.settled[slot] = ((n - 1) * self.page_size + 1, last)

    def shrink(self, slot: int, end: int) -> None:
        """Let go of `slot`'s pages past those positions [0, end) need."""
        mapped = self._mapped[slot]
        keep = self.pages_for(end)
        if mapped <= keep:
            return
        if keep < len(self._keyed[slot]):
            self._published[slot] = False
        self._let_go(self._host_np[slot, keep:mapped][::-1])  # a chain's tail becomes idle, so is evicted, first
        self._mapped[slot] = keep
        del self._keyed[slot][keep:]
        self._changing(slot, column=keep)
        self._host_np[slot, keep:] = SCRATCH_PAGE
        self._settle(slot)

    def writable_from(self, slot: int, start: int) -> int:
        """The first position at or below `start` from which `slot` may write: `start`, unless
        a rollback went into its keyed (possibly shared) pages; those from there on are let
        go, to be recomputed into fresh pages."""
        keyed = len(self._keyed[slot])
        if start >= keyed * self.page_size:
            return start
        keep = start // self.page_size
        self.shrink(slot, keep * self.page_size)
        return keep * self.page_size

    def _take_page(self) -> int | None:
        if self._free_pages:
            return self._free_pages.pop()
        return self.cache.evict() if self.cache is not None else None

    def _map_fresh(self, slot: int, new: list[int]) -> None:
        """Map `new` pages, which nobody holds and the cache does not keep (free or just
        evicted), after `slot`'s last one."""
        if not new:
            return
        n = self._mapped[slot]
        self._changing(slot, column=n)
        for i, page in enumerate(new):  # (mostly a page or a few: scalar writes beat an array's conversion)
            self._refs[page] = 1
            self._host_np[slot, n + i] = page
        self._mapped[slot] = n + len(new)

    def _hold(self, slot: int, new: np.ndarray) -> None:
        """Map `new` pages (distinct) after `slot`'s last one: a matched prefix's hundreds."""
        refs = self._refs
        refs[new] += 1
        if self.cache is not None:
            for page in new[refs[new] == 1].tolist():  # (held by no other request: not evictable now)
                self.cache.use(page)
        n = self._mapped[slot]
        self._changing(slot, column=n)
        self._host_np[slot, n : n + len(new)] = new
        self._mapped[slot] = n + len(new)

    def _let_go(self, pages: np.ndarray) -> None:
        """Drop one hold of each of `pages` (distinct), in order: a page nobody holds goes to
        the prefix cache's LRU where cached, else back to the free list."""
        refs, cache, free = self._refs, self.cache, self._free_pages
        refs[pages] -= 1
        for page in pages[refs[pages] == 0].tolist():
            if cache is not None and cache.holds(page):
                cache.idle(page)
            else:
                free.append(page)

    # -- the prefix cache -------------------------------------------------------------------
    def match_prefix(self, slot: int, token_ids: list[int], num_prompt: int) -> int:
        """Map the cached pages that `token_ids`' prompt starts with into the empty `slot`;
        returns how many tokens they hold. The page of the prompt's last token is never taken:
        that token is run again, so the request has logits to sample from."""
        if self.cache is None:
            return 0
        chain = self.cache.match(token_ids, self.page_size, (num_prompt - 1) // self.page_size)
        self._hold(slot, chain.page_array)
        self._keyed[slot] += chain.hashes
        return len(chain.pages) * self.page_size

    def publish(self, slot: int, token_ids: list[int], num_computed: int, num_prompt: int) -> None:
        """Put `slot`'s full pages whose K/V are computed (the first `num_computed` tokens) and
        that lie within its first `num_prompt` tokens into the prefix cache: the prompt's while
        the request runs, every computed token's as it leaves its slot (the scheduler passes
        `num_computed` as both; the slot is released right after, so `_published` no longer
        matters there)."""
        keyed = self._keyed[slot]
        full = min(num_computed, num_prompt, self._mapped[slot] * self.page_size) // self.page_size
        if self.cache is not None and full > len(keyed):
            parent = keyed[-1] if keyed else ROOT_HASH
            first = len(keyed)
            for i, key in enumerate(page_keys(token_ids, self.page_size, full - first, parent, first)):
                self.cache.insert(key, int(self._host_np[slot, first + i]))  # a page another request cached first stays ours
                keyed.append(hash(key))
        if num_computed >= num_prompt and not self._published[slot]:
            self._published[slot] = True
            self._settle(slot)

    # -- the table the kernels read ---------------------------------------------------------
    def token_slots(self, slot: int, start: int, n: int) -> np.ndarray:
        """The cache rows (page * page_size + offset) of positions [start, start + n) of `slot`."""
        pos = np.arange(start, start + n)
        return self._host_np[slot, pos // self.page_size] * self.page_size + pos % self.page_size

    def maps(self, slots: np.ndarray, positions: np.ndarray) -> bool:
        """Whether every position lies in a page its slot holds: a row outside them would
        write, and its request then read, the scratch page."""
        cols = positions // self.page_size
        if cols.size and cols.max() >= self.max_pages_per_seq:
            return False
        return bool((self._host_np[slots, cols] != SCRATCH_PAGE).all())

    def common_pages(self, slots: np.ndarray, limit: int) -> int:
        """How many leading pages, up to `limit`, every one of `slots` maps to the same pages
        (prefix caching maps a shared prompt's pages into each request that starts with it).
        A step's rows of one slot are adjacent: each run of them is compared once. The
        answer for the same slots is kept until a column it compared changes, so a decode
        step compares only the columns its rows grew into (256 agent turns over a 3,000-token
        catalogue, two calls a step: 94 -> 12 us on the 2-core VM)."""
        if limit <= 0:
            return 0
        first_of_run = np.empty(len(slots), dtype=bool)
        first_of_run[0] = True
        np.not_equal(slots[1:], slots[:-1], out=first_of_run[1:])
        heads = slots[first_of_run]
        key, start = np.sort(heads).tobytes(), 0
        if self._common is not None and self._common[0] == key:
            _, compared, common = self._common
            if common < compared or limit <= compared:  # where they part, or equal up to limit
                return min(common, limit)
            start = compared  # equal up to there: only the columns since to compare
        rows = self._host_np[heads, start:limit]
        parted = (rows != rows[0]).any(axis=0)
        common = start + int(parted.argmax()) if parted.any() else limit
        self._common = (key, limit, common)
        return common

    def host_to_replace(self) -> torch.Tensor:
        """The host copy, for another rank's table to be written into it in place (a
        tensor-parallel worker follows rank 0's pages), once the last copy to the device has
        read it; the device copy follows at the next `sync`."""
        self._changing(*range(self.num_slots + 1), column=0)
        return self.host

    def _changing(self, *rows: int, column: int) -> None:
        """`rows` of the host copy are about to change from `column` on: wait until the last
        copy to the device has read them, and copy them at the next `sync`."""
        if self._common is not None and column < self._common[1]:
            self._common = None  # a column `common_pages` compared
        if self._copy_pending:
            self._copied.synchronize()
            self._copy_pending = False
        self._changed_rows.update(rows)
        self.version += 1

    def changed_runs(self) -> list[tuple[int, int]]:
        """The rows changed since the last sync, as runs [start, stop) of consecutive rows."""
        runs: list[tuple[int, int]] = []
        for row in sorted(self._changed_rows):
            if runs and runs[-1][1] == row:
                runs[-1] = (runs[-1][0], row + 1)
            else:
                runs.append((row, row + 1))
        return runs

    def sync(self) -> None:
        """Bring the device copy up to date: the changed rows, queued on the current stream."""
        if self._changed_rows and self.table is not self.host:
            for start, stop in self.changed_runs():
                self.table[start:stop].copy_(self.host[start:stop], non_blocking=True)
            if self._copied is not None:
                self._copied.record()
                self._copy_pending = True
        self._changed_rows.clear()
