"""N-gram (prompt lookup) drafting: find the context's last n tokens earlier in the context
and propose what followed them there.

Structured extraction is its best case: the output copies spans of the prompt (names, dates,
numbers from the source text; keys from the schema). Nothing runs on the device. Each request
has an incremental index (n-gram -> positions right after each occurrence), so a lookup costs
a dict probe however long the prompt is. With `shared=True`, the outputs of finished requests
go to a small pool that later requests also search (same schema, same keys and phrasing).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from structgen.engine.request import Request


class NgramIndex:
    """n-gram (a tuple of n_min..n_max tokens) -> positions just after each of its occurrences,
    over one token list that grows (and is sometimes cut back). Entries made stale by a cut
    are re-checked against the tokens at lookup time, never trusted."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.table: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 1  # continuation positions below this are in the table

    def update(self, tokens: list[int]) -> None:
        """Index every continuation position p < len(tokens) not indexed yet."""
        self.indexed = min(self.indexed, max(len(tokens), 1))  # after a truncation
        for p in range(self.indexed, len(tokens)):
            for n in range(self.n_min, min(self.n_max, p) + 1):
                self.table.setdefault(tuple(tokens[p - n : p]), []).append(p)
        self.indexed = max(self.indexed, len(tokens))

    def continuations(self, tokens: list[int], context: list[int], k: int, limit: int) -> list[list[int]]:
        """Up to `limit` continuations (of up to k tokens, taken from `tokens`) of the longest
        suffixes of `context` found in the table; longer matches and later occurrences first."""
        out: list[list[int]] = []
        for n in range(min(self.n_max, len(context)), self.n_min - 1, -1):
            key = tuple(context[len(context) - n :])
            for p in reversed(self.table.get(key, ())):
                if p >= len(tokens) or tuple(tokens[p - n : p]) != key:
                    continue  # stale: the tokens were cut back since
                cont = tokens[p : p + k]
                if cont and cont not in out:
                    out.append(cont)
                    if len(out) >= limit:
                        return out
        return out


class NgramDrafter:
    """Prompt-lookup drafter.

    Parameters
    ----------
    n_min, n_max:
        Suffix lengths tried, longest first: a longer match is a better predictor.
    shared:
        Also search the outputs of recently finished requests.
    max_candidates:
        Alternatives offered to grammar-aware drafting (it keeps the one the grammar
        allows furthest, e.g. skipping a schema's `{"type": ...` where a value must follow).
    """

    def __init__(self, n_min: int = 1, n_max: int = 4, shared: bool = False, max_candidates: int = 8, pool_size: int = 32):
        self.n_min, self.n_max = n_min, n_max
        self.shared = shared
        self.max_candidates = max_candidates
        self.indexes: dict[int, NgramIndex] = {}
        self.pool: deque[tuple[list[int], NgramIndex]] = deque(maxlen=pool_size)

    def candidates(self, req: Request, k: int) -> list[list[int]]:
        """Alternative drafts of up to k tokens, best first."""
        if k <= 0:
            return []
        index = self.indexes.get(req.id)
        if index is None:
            index = self.indexes[req.id] = NgramIndex(self.n_min, self.n_max)
        tokens = req.token_ids
        index.update(tokens)
        found = index.continuations(tokens, tokens, k, self.max_candidates)
        for seq, seq_index in reversed(self.pool):
            if len(found) >= self.max_candidates:
                break
            for c in seq_index.continuations(seq, tokens, k, self.max_candidates - len(found)):
                if c not in found:
                    found.append(c)
        return found

    def propose(self, req: Request, k: int) -> list[int]:
        found = self.candidates(req, k)
        return found[0] if found else []

    def release(self, req: Request) -> None:
        self.indexes.pop(req.id, None)
        if self.shared and req.finish_reason == "stop" and req.num_output > 0:
            out = list(req.output_ids)
            index = NgramIndex(self.n_min, self.n_max)
            index.update(out)
            self.pool.append((out, index))
