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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structgen.engine.request import Request


class NgramIndex:
    """n-gram (a tuple of n_min..n_max tokens) -> positions just after each of its occurrences,
    over one token list that grows (and is sometimes cut back). Entries made stale by a cut
    are re-checked against the tokens at lookup time, never trusted. With `classes`, n-grams
    are keyed by token class (see `space_classes`) instead of token id.

    Lookups are lazy (`continuations` is a generator): grammar-aware drafting stops at the
    first candidate the grammar takes whole, usually the first one, so a step rarely pays
    for more than a few probes. A common short n-gram (`", "`) occurs hundreds of times in
    a long prompt; only its latest `max_scan` occurrences are looked at."""

    def __init__(self, n_min: int, n_max: int, classes: list[int] | None = None, max_scan: int = 32):
        self.n_min, self.n_max = n_min, n_max
        self.classes = classes
        self.max_scan = max_scan
        self.table: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 1  # continuation positions below this are in the table

    def key(self, tokens: list[int]) -> tuple[int, ...]:
        c = self.classes
        if c is None:
            return tuple(tokens)
        try:
            return tuple(map(c.__getitem__, tokens))
        except IndexError:  # an id past the tokenizer's vocabulary is its own class
            return tuple(c[t] if t < len(c) else t for t in tokens)

    def update(self, tokens: list[int]) -> None:
        """Index every continuation position p < len(tokens) not indexed yet."""
        self.indexed = min(self.indexed, max(len(tokens), 1))  # after a truncation
        if self.indexed >= len(tokens):
            return
        lo = max(self.indexed - self.n_max, 0)
        keys = self.key(tokens[lo:])  # class ids of tokens[lo:], mapped once
        table = self.table
        for p in range(self.indexed, len(tokens)):
            for n in range(self.n_min, min(self.n_max, p) + 1):
                table.setdefault(keys[p - n - lo : p - lo], []).append(p)
        self.indexed = len(tokens)

    def continuations(self, tokens: list[int], context: list[int], k: int) -> Iterator[list[int]]:
        """Distinct continuations (of up to k tokens, taken from `tokens`) of the longest
        suffixes of `context` found in the table; longer matches and later occurrences first."""
        seen: set[tuple[int, ...]] = set()
        tail = self.key(context[-self.n_max :])
        for n in range(min(self.n_max, len(context)), self.n_min - 1, -1):
            key = tail[len(tail) - n :]
            hits = self.table.get(key)
            if not hits:
                continue
            for p in reversed(hits[-self.max_scan :]):
                if p >= len(tokens) or self.key(tokens[p - n : p]) != key:
                    continue  # stale: the tokens were cut back since
                cont = tuple(tokens[p : p + k])
                if cont and cont not in seen:
                    seen.add(cont)
                    yield list(cont)


def space_classes(tokenizer: Any) -> list[int]:
    """Token id -> the id of the same token without its leading space, where the vocabulary
    has one. Text copied into JSON loses the space before it ("is Office" -> `"Office`), so
    matching on these classes finds spans that exact ids miss."""
    vocab = tokenizer.get_vocab()
    classes = list(range(max(vocab.values()) + 1))
    for piece, tid in vocab.items():
        for space in ("\u0120", "\u2581", " "):  # byte-level BPE, SentencePiece, plain
            if piece.startswith(space) and len(piece) > 1 and piece[1:] in vocab:
                classes[tid] = vocab[piece[1:]]
    return classes


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
    token_classes:
        Optional id -> class map (`space_classes`): n-grams are matched on classes, the
        continuation is still the source's own tokens.
    """

    host_only = True  # lookups on the host: the next step can be drafted while the device waits

    def __init__(self, n_min: int = 1, n_max: int = 4, shared: bool = False, max_candidates: int = 8,
                 pool_size: int = 32, token_classes: list[int] | None = None):
        self.n_min, self.n_max = n_min, n_max
        self.shared = shared
        self.max_candidates = max_candidates
        self.token_classes = token_classes
        self.indexes: dict[int, NgramIndex] = {}
        self.pool: deque[tuple[list[int], NgramIndex]] = deque(maxlen=pool_size)

    def use_tokenizer(self, tokenizer: Any) -> None:
        """Match n-grams modulo leading spaces (see `space_classes`)."""
        self.token_classes = space_classes(tokenizer)

    def candidates(self, req: Request, k: int) -> Iterator[list[int]]:
        """Alternative drafts of up to k tokens, best first, produced lazily (the grammar-aware
        picker usually takes the first)."""
        if k <= 0:
            return
        index = self.indexes.get(req.id)
        if index is None:
            index = self.indexes[req.id] = NgramIndex(self.n_min, self.n_max, self.token_classes)
        tokens = req.token_ids
        index.update(tokens)
        found: list[list[int]] = []
        sources = [(tokens, index)] + [(seq, seq_index) for seq, seq_index in reversed(self.pool)]
        for seq, seq_index in sources:
            for c in seq_index.continuations(seq, tokens, k):
                if c not in found:
                    found.append(c)
                    yield c
                    if len(found) >= self.max_candidates:
                        return

    def propose(self, req: Request, k: int) -> list[int]:
        return next(iter(self.candidates(req, k)), [])

    def release(self, req: Request) -> None:
        self.indexes.pop(req.id, None)
        if self.shared and req.finish_reason == "stop" and req.num_output > 0:
            out = list(req.output_ids)
            index = NgramIndex(self.n_min, self.n_max, self.token_classes)
            index.update(out)
            self.pool.append((out, index))
