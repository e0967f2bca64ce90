"""Tokenizing rendered chat prompts without encoding their long messages again.

An agent's turns repeat the same long system message (a tool catalogue of thousands of
tokens) and differ only in the last messages; the prefix cache spares the forward of the
shared part, but the tokenizer still encodes all of it on every turn, a few milliseconds of
each time to the first token. A fast tokenizer splits its input at added tokens (the chat
template's `<|im_start|>`, `<|im_end|>` ...) before anything else, so the text between two of
them is encoded on its own: `SegmentEncoder` keeps the ids of long pieces and encodes only the
rest.

It is exact by check, not by assumption: a piece is kept only after an encoding of the whole
text showed every piece of it encoding on its own to the same ids in place, and a tokenizer
where that fails once (added tokens that strip the spaces beside them, a prefix space added
to the input's first piece only) is encoded whole from then on. A long piece is learnt the
second time it is seen, so prompts that never repeat pay for no checks; in a burst (one batch)
the first text holding a piece that others hold too is encoded before them and teaches it.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("structgen")

MIN_CACHED_CHARS = 2_000  # pieces shorter than this encode faster than a lookup pays for
CACHED_PIECES = 64  # pieces kept (least recently used out): a few agents' system messages
SEEN_PIECES = 4_096  # fingerprints of long pieces seen once, the candidates to learn


class SegmentEncoder:
    """`encode(text)` equals `tokenizer.encode(text, add_special_tokens=False)`, with the ids
    of long pieces between added tokens kept from earlier texts. Thread-safe (prompts are
    tokenized on worker threads)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.special_ids = _splitting_tokens(tokenizer)
        self.enabled = bool(self.special_ids)
        pattern = "|".join(re.escape(t) for t in sorted(self.special_ids, key=len, reverse=True))
        self._split = re.compile(f"({pattern})") if self.enabled else None
        self._pieces: OrderedDict[tuple[str, bool], tuple[int, ...]] = OrderedDict()
        self._seen: OrderedDict[int, None] = OrderedDict()  # hash of a long piece seen once
        self._lock = threading.Lock()
        self.hits = 0  # texts encoded from kept pieces

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text: from kept pieces where every long piece is kept; where a long
        piece not kept recurs within the batch (a burst of agent turns), one text with it is
        encoded whole first and the piece learnt from it, so that the others reuse it; the rest
        whole in one batched tokenizer call (a fast tokenizer encodes a batch on its own threads,
        the GIL released), then their long pieces learnt where seen before."""
        found: list[list[int] | None] = [None] * len(texts)
        self._from_pieces(texts, range(len(texts)), found)
        whole = [i for i, ids in enumerate(found) if ids is None]
        teachers = self._teachers(texts, whole)
        if teachers:
            self._encode_whole(texts, teachers, found, repeated=True)
            self._from_pieces(texts, [i for i in whole if found[i] is None], found)
            whole = [i for i in whole if found[i] is None]
        self._encode_whole(texts, whole, found)
        out = [ids for ids in found if ids is not None]
        assert len(out) == len(texts)
        return out

    def _teachers(self, texts: list[str], indices: list[int]) -> list[int]:
        """Of `texts[indices]`, one text for each long piece not kept that two or more of them
        hold: encoding it whole teaches the piece to the others."""
        holders: dict[tuple[str, bool], list[int]] = {}
        for i in indices:
            for piece in self._split_long(texts[i])[2]:
                holders.setdefault(piece, []).append(i)
        with self._lock:
            repeated = [held[0] for piece, held in holders.items() if len(held) > 1 and piece not in self._pieces]
        return sorted(set(repeated))

    def _encode_whole(self, texts: list[str], indices: list[int], found: list[list[int] | None],
                      repeated: bool = False) -> None:
        """Encode `texts[indices]` whole in one batched call into `found`, then learn their long
        pieces: seen before, or (`repeated`) known to recur in this batch."""
        for i, ids in zip(indices, encode_texts(self.tokenizer, [texts[i] for i in indices], False), strict=True):
            found[i] = ids
            self._note(texts[i], ids, repeated)

    def _split_long(self, text: str) -> tuple[list[str], list[tuple[str, bool]], list[tuple[str, bool]]]:
        """The text's parts (text, special, ..., text), its pieces between added tokens (with
        whether each is the first) and the long ones of them; none where nothing is kept."""
        if not self.enabled or len(text) < MIN_CACHED_CHARS:
            return [], [], []
        parts = self._split.split(text)  # text, special, text, special, ..., text
        pieces = [(p, i == 0) for i, p in enumerate(parts[0::2])]
        return parts, pieces, [piece for piece in pieces if len(piece[0]) >= MIN_CACHED_CHARS]

    def _from_pieces(self, texts: list[str], indices: Iterable[int], found: list[list[int] | None]) -> None:
        """Into `found`, the ids of each of `texts[indices]` whose long pieces are all kept: its
        other pieces encoded in one batched call with the other texts' (each distinct one once,
        a burst's turns share most of them), spliced between the kept ids and added tokens."""
        plans = [(i, plan) for i in indices if (plan := self._kept_pieces(texts[i])) is not None]
        short = sorted({text for _, (_, pieces, kept) in plans for text, first in pieces
                        if text and (text, first) not in kept})
        encoded = dict(zip(short, encode_texts(self.tokenizer, short, False), strict=True))
        for i, (parts, pieces, kept) in plans:
            out: list[int] = []
            for j, piece in enumerate(pieces):
                ids = kept.get(piece)
                out += ids if ids is not None else encoded.get(piece[0], [])
                if 2 * j + 1 < len(parts):
                    out.append(self.special_ids[parts[2 * j + 1]])
            found[i] = out
        self.hits += len(plans)

    def _kept_pieces(self, text: str) -> tuple[list[str], list[tuple[str, bool]],
                                               dict[tuple[str, bool], tuple[int, ...]]] | None:
        """A text's parts, pieces and the kept ids of its long pieces, where every long piece is
        kept; None where it is encoded whole."""
        parts, pieces, long = self._split_long(text)
        if not long:
            return None
        kept: dict[tuple[str, bool], tuple[int, ...]] = {}
        with self._lock:
            for piece in long:
                ids = self._pieces.get(piece)
                if ids is None:
                    return None
                kept[piece] = ids
            for piece in kept:
                self._pieces.move_to_end(piece)
        return parts, pieces, kept

    def _note(self, text: str, ids: list[int], repeated: bool = False) -> None:
        """After a text was encoded whole: learn its long pieces not kept, where seen before
        (or `repeated`: recurring in the batch at hand)."""
        parts, pieces, long = self._split_long(text)
        with self._lock:
            missing = [piece for piece in long if piece not in self._pieces]
        if missing and (self._seen_before(missing) or repeated):
            self._learn(parts, pieces, ids)

    def _seen_before(self, pieces: list[tuple[str, bool]]) -> bool:
        """Whether any of these long pieces was seen before (each is remembered now)."""
        with self._lock:
            before = False
            for piece in pieces:
                key = hash(piece)
                before = before or key in self._seen
                self._seen[key] = None
                self._seen.move_to_end(key)
            while len(self._seen) > SEEN_PIECES:
                self._seen.popitem(last=False)
            return before

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _learn(self, parts: list[str], pieces: list[tuple[str, bool]], ids: list[int]) -> None:
        """Keep the long pieces of a text encoded whole, where every piece encodes on its own to
        the ids between its added tokens; else stop splitting for this tokenizer."""
        specials = [self.special_ids[p] for p in parts[1::2]]
        found: list[list[int]] = [[]]
        for t in ids:
            if len(found) <= len(specials) and t == specials[len(found) - 1]:
                found.append([])
            else:
                found[-1].append(t)
        same = len(found) == len(pieces) and all(
            self._encode(text) == got for (text, _), got in zip(pieces, found, strict=True))
        if not same:
            self.enabled = False
            log.info("prompt pieces between added tokens do not encode on their own with this tokenizer; "
                     "prompts are encoded whole")
            return
        with self._lock:
            for piece, got in zip(pieces, found, strict=True):
                if len(piece[0]) >= MIN_CACHED_CHARS:
                    self._pieces[piece] = tuple(got)
                    self._pieces.move_to_end(piece)
            while len(self._pieces) > CACHED_PIECES:
                self._pieces.popitem(last=False)


def encode_texts(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """`tokenizer.encode(text, add_special_tokens=...)` of each text, in one call of the
    tokenizer's batch path (the one its `encode` takes for a batch of one)."""
    if not texts:
        return []
    if len(texts) == 1:
        return [list(tokenizer.encode(texts[0], add_special_tokens=add_special_tokens))]
    batch = tokenizer(texts, add_special_tokens=add_special_tokens, return_attention_mask=False)
    return [list(ids) for ids in batch["input_ids"]]


def _splitting_tokens(tokenizer: Any) -> dict[str, int]:
    """The added tokens a fast tokenizer splits its input at, by text; empty (no splitting)
    where one of them strips the spaces beside it, matches single words only or is matched
    after normalization: the text between them then depends on its neighbours."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not added:
        return {}
    out: dict[str, int] = {}
    for token_id, token in added.items():
        content = getattr(token, "content", None)
        if not content:
            continue
        if any(getattr(token, flag, False) for flag in ("lstrip", "rstrip", "single_word", "normalized")):
            return {}
        out[content] = int(token_id)
    return out
