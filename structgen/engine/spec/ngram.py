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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structgen.engine.request import Request


class NgramIndex:
    """n-gram (a tuple of n_min..n_max tokens) -> positions just after each of its occurrences,
    over one token list that grows (and is sometimes cut back). Entries made stale by a cut
    are re-checked against the tokens at lookup time, never trusted. With `classes`, n-grams
    are keyed by token class (see `space_classes`) instead of token id."""

    def __init__(self, n_min: int, n_max: int, classes: list[int] | None = None):
        self.n_min, self.n_max = n_min, n_max
        self.classes = classes
        self.table: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 1  # continuation positions below this are in the table

    def key(self, tokens: list[int]) -> tuple[int, ...]:
        c = self.classes
        return tuple(tokens) if c is None else tuple(c[t] if t < len(c) else t for t in tokens)

    def update(self, tokens: list[int]) -> None:
        """Index every continuation position p < len(tokens) not indexed yet."""
        self.indexed = min(self.indexed, max(len(tokens), 1))  # after a truncation
        for p in range(self.indexed, len(tokens)):
            for n in range(self.n_min, min(self.n_max, p) + 1):
                self.table.setdefault(self.key(tokens[p - n : p]), []).append(p)
        self.indexed = max(self.indexed, len(tokens))

    def continuations(self, tokens: list[int], context: list[int], k: int, limit: int) -> list[list[int]]:
        """Up to `limit` continuations (of up to k tokens, taken from `tokens`) of the longest
        suffixes of `context` found in the table; longer matches and later occurrences first."""
        out: list[list[int]] = []
        for n in range(min(self.n_max, len(context)), self.n_min - 1, -1):
            key = self.key(context[len(context) - n :])
            for p in reversed(self.table.get(key, ())):
                if p >= len(tokens) or self.key(tokens[p - n : p]) != key:
                    continue  # stale: the tokens were cut back since
                cont = tokens[p : p + k]
                if cont and cont not in out:
                    out.append(cont)
                    if len(out) >= limit:
                        return out
        return out


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

    def candidates(self, req: Request, k: int) -> list[list[int]]:
        """Alternative drafts of up to k tokens, best first."""
        if k <= 0:
            return []
        index = self.indexes.get(req.id)
        if index is None:
            index = self.indexes[req.id] = NgramIndex(self.n_min, self.n_max, self.token_classes)
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
            index = NgramIndex(self.n_min, self.n_max, self.token_classes)
            index.update(out)
            self.pool.append((out, index))
