"""N-gram (prompt lookup) drafting: find the context's last n tokens earlier in the context
and propose what followed them there.

Structured extraction is its best case: the output copies spans of the prompt (names, dates,
numbers from the source text; keys from the schema). Nothing runs on the device. Each request
keeps its tokens' class ids in an index that follows its growth (`NgramIndex`), searched from
the latest occurrence back. With `shared=True`, the outputs of finished requests go to a small
pool that later requests also search (same schema, same keys and phrasing).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from structgen.engine.request import Request


RECHECK = 16  # an update re-maps this many tokens before the last one seen: a rollback's reach
BULK = 64  # token lists at least this long are mapped to classes in numpy


@dataclass(frozen=True)
class TokenClasses:
    """Token id -> class id (`space_classes`): a list for a few tokens at a time, an array for
    a whole prompt at once."""

    ids: list[int]
    array: np.ndarray

    @classmethod
    def of(cls, ids: list[int]) -> TokenClasses:
        return cls(list(ids), np.asarray(ids, dtype=np.int32))


class NgramIndex:
    """The class ids of one token list that grows (and is sometimes cut back), searched for the
    positions right after each occurrence of an n-gram (n_min..n_max tokens). With `classes`,
    n-grams match by token class (see `space_classes`) instead of token id.

    The ids are kept as 4-byte integers in a bytearray: taking in a 1,000-token prompt is one
    vectorized map (a dict of every n-gram cost ~2 us a token, and a speculative step's first
    look at eight long prompts stalled the device for ~10 ms), and a lookup is `rfind` of the
    n-gram's bytes, latest occurrence first (one C loop; a match not on a 4-byte boundary is
    skipped). An update re-maps the last RECHECK tokens it saw, so a rollback and regrowth
    between updates is followed; a candidate is checked against the tokens it is taken from
    all the same.

    Lookups are lazy (`continuations` is a generator): grammar-aware drafting stops at the
    first candidate the grammar takes whole, usually the first one, so a step rarely pays
    for more than a few searches. A common short n-gram (`", "`) occurs hundreds of times in
    a long prompt; only its latest `max_scan` occurrences are looked at."""

    def __init__(self, n_min: int, n_max: int, classes: TokenClasses | list[int] | None = None, max_scan: int = 32):
        self.n_min, self.n_max = n_min, n_max
        self.classes = TokenClasses.of(classes) if isinstance(classes, list) else classes
        self.max_scan = max_scan
        self.ids = bytearray()  # the class id of every token seen, 4 bytes each

    def key(self, tokens: list[int]) -> tuple[int, ...]:
        if self.classes is None:
            return tuple(tokens)
        c = self.classes.ids
        try:
            return tuple(map(c.__getitem__, tokens))
        except IndexError:  # an id past the tokenizer's vocabulary is its own class
            return tuple(c[t] if t < len(c) else t for t in tokens)

    def _bytes(self, tokens: list[int]) -> bytes:
        if len(tokens) < BULK or self.classes is None:
            return array("i", self.key(tokens)).tobytes()
        ids, c = np.asarray(tokens, dtype=np.int64), self.classes.array
        inside = ids < len(c)
        return np.where(inside, c[np.where(inside, ids, 0)], ids).astype(np.int32).tobytes()

    def update(self, tokens: list[int]) -> None:
        """Take in `tokens`: the ones past the last update, and the last RECHECK before them."""
        start = max(min(len(self.ids) // 4, len(tokens)) - RECHECK, 0)
        self.ids[4 * start :] = self._bytes(tokens[start:])

    def continuations(self, tokens: list[int], context: list[int], k: int) -> Iterator[list[int]]:
        """Distinct continuations (of up to k tokens, taken from `tokens`) of the longest
        suffixes of `context` found in the tokens seen; longer matches and later occurrences
        first."""
        seen: set[tuple[int, ...]] = set()
        tail = self.key(context[-self.n_max :])
        tail_bytes, ids, last = array("i", tail).tobytes(), self.ids, len(self.ids) - 4
        for n in range(len(tail), self.n_min - 1, -1):
            key, pattern = tail[len(tail) - n :], tail_bytes[4 * (len(tail) - n) :]
            end = last  # an occurrence has a token after it
            for _ in range(self.max_scan):
                pos = ids.rfind(pattern, 0, end)
                while pos > 0 and pos % 4:  # inside a token: search on before it
                    pos = ids.rfind(pattern, 0, pos + 4 * n - 1)
                if pos < 0:
                    break
                end = pos + 4 * n - 1
                p = pos // 4 + n
                if p >= len(tokens) or self.key(tokens[p - n : p]) != key:
                    continue  # the tokens changed since the last update
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
        self.token_classes = None if token_classes is None else TokenClasses.of(token_classes)
        self.indexes: dict[int, NgramIndex] = {}
        self.pool: deque[tuple[list[int], NgramIndex]] = deque(maxlen=pool_size)

    def use_tokenizer(self, tokenizer: Any) -> None:
        """Match n-grams modulo leading spaces (see `space_classes`)."""
        self.token_classes = TokenClasses.of(space_classes(tokenizer))

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
