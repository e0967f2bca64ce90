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
the first text holding a piece that others hold too teaches it: it is encoded whole, and each
of its pieces alone, in the same tokenizer call as the others' own pieces, and they are spliced
once its check holds. A batch costs one tokenizer call, and each text is cut at its added
tokens once.

A message's text is the user's, never the template's: a special token written in it
(`<|im_end|>\n<|im_start|>system`) would close its turn and open another, so `SpecialTexts`
marks such text before the template renders it and tokenizes it as plain text.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

from structgen.engine.garbage_collection import untracked_ints

log = logging.getLogger("structgen")

MIN_CACHED_CHARS = 2_000  # pieces shorter than this encode faster than a lookup pays for
CACHED_PIECES = 64  # pieces kept (least recently used out): a few agents' system messages
SEEN_PIECES = 4_096  # fingerprints of long pieces seen once, the candidates to learn


class Cut(NamedTuple):
    """A text cut at its added tokens: `parts` alternate text and added token (text, token,
    ..., text), `pieces` are the texts between them, each with whether it is the first, and
    `long` those worth keeping (`MIN_CACHED_CHARS` or more). All empty for a text not cut
    (short, or splitting turned off)."""

    parts: list[str]
    pieces: list[tuple[str, bool]]
    long: list[tuple[str, bool]]


class BatchPlan(NamedTuple):
    """How `encode_batch` gets each text's ids, by index: `teachers` encoded whole and each of
    their pieces alone (the check that teaches their long pieces), `spliced` from long pieces
    kept or taught and their other pieces encoded alone, `whole` encoded whole; `alone` the
    distinct pieces encoded on their own."""

    teachers: list[int]
    spliced: list[int]
    whole: list[int]
    alone: list[str]


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
        """`encode` of each text, in one batched tokenizer call (a fast tokenizer encodes a
        batch on its own threads, the GIL released; a second call only to learn a piece seen
        in an earlier batch, or after a failed check). A text whose long pieces are all kept
        is spliced from their ids and its other pieces' (each distinct piece encoded once: a
        burst's turns share most of them). A long piece not kept that two or more texts hold
        (a cold burst of agent turns) is taught by the first of them, encoded whole beside its
        pieces alone, and the others are spliced once that check holds. The rest are encoded
        whole, and their long pieces learnt where seen before."""
        cuts = [self._cut(text) for text in texts]  # (each text cut once: they are long)
        kept = self._kept(cuts)
        plan = self._plan(cuts, kept)
        wholes = [texts[i] for i in (*plan.teachers, *plan.whole)]
        ids = encode_texts(self.tokenizer, wholes + plan.alone, False)
        found: list[list[int] | None] = [None] * len(texts)
        for i, got in zip((*plan.teachers, *plan.whole), ids, strict=False):
            found[i] = got
        alone = dict(zip(plan.alone, ids[len(wholes):], strict=True))
        taught = [self._learn(cuts[i], found[i], alone) for i in plan.teachers]  # type: ignore[arg-type]
        if all(learnt is not None for learnt in taught):
            for learnt in taught:
                kept.update(learnt)  # type: ignore[arg-type]
            for i in plan.spliced:
                found[i] = self._splice(cuts[i], kept, alone)
            self.hits += len(plan.spliced)
        else:  # a piece did not encode on its own as in place: no text of the batch is spliced
            self._encode_whole(texts, cuts, plan.spliced, found)
        for i in plan.whole:
            self._note(cuts[i], found[i])  # type: ignore[arg-type]
        # Lists of ints only: out of the cyclic collector's sight while the requests are made.
        return [untracked_ints(ids) for ids in found]  # type: ignore[arg-type]

    def _plan(self, cuts: list[Cut], kept: dict[tuple[str, bool], tuple[int, ...]]) -> BatchPlan:
        """`encode_batch`'s plan: one teacher (the first holder) per long piece not kept that
        two or more texts hold; spliced, the other texts whose long pieces are all kept or
        taught; the rest whole."""
        holders: dict[tuple[str, bool], list[int]] = {}
        for i, cut in enumerate(cuts):
            for piece in cut.long:
                if piece not in kept:
                    holders.setdefault(piece, []).append(i)
        teachers = sorted({held[0] for held in holders.values() if len(held) > 1})
        taught = {piece for i in teachers for piece in cuts[i].long}
        is_teacher = set(teachers)
        spliced = [i for i, cut in enumerate(cuts) if cut.long and i not in is_teacher
                   and all(piece in kept or piece in taught for piece in cut.long)]
        done = is_teacher.union(spliced)
        whole = [i for i in range(len(cuts)) if i not in done]
        alone = {text for i in teachers for text, _ in cuts[i].pieces if text}  # (the check's)
        alone.update(text for i in spliced for text, _ in cuts[i].pieces if text and len(text) < MIN_CACHED_CHARS)
        return BatchPlan(teachers, spliced, whole, sorted(alone))

    def _cut(self, text: str) -> Cut:
        """The text cut at its added tokens, where it is long enough to hold a long piece."""
        if not self.enabled or len(text) < MIN_CACHED_CHARS:
            return Cut([], [], [])
        parts = self._split.split(text)  # text, special, text, special, ..., text
        pieces = [(p, i == 0) for i, p in enumerate(parts[0::2])]
        return Cut(parts, pieces, [piece for piece in pieces if len(piece[0]) >= MIN_CACHED_CHARS])

    def _kept(self, cuts: list[Cut]) -> dict[tuple[str, bool], tuple[int, ...]]:
        """The kept ids of the long pieces of `cuts` that are kept (now the most recently used)."""
        kept: dict[tuple[str, bool], tuple[int, ...]] = {}
        with self._lock:
            for cut in cuts:
                for piece in cut.long:
                    ids = self._pieces.get(piece)
                    if ids is not None and piece not in kept:
                        kept[piece] = ids
                        self._pieces.move_to_end(piece)
        return kept

    def _splice(self, cut: Cut, kept: dict[tuple[str, bool], tuple[int, ...]], alone: dict[str, list[int]]) -> list[int]:
        """A text's ids from its pieces' (long ones kept, the others encoded alone) and its
        added tokens between them."""
        out: list[int] = []
        parts = cut.parts
        for j, piece in enumerate(cut.pieces):
            if len(piece[0]) >= MIN_CACHED_CHARS:
                out += kept[piece]
            elif piece[0]:
                out += alone[piece[0]]
            if 2 * j + 1 < len(parts):
                out.append(self.special_ids[parts[2 * j + 1]])
        return out

    def _encode_whole(self, texts: list[str], cuts: list[Cut], indices: list[int], found: list[list[int] | None]) -> None:
        """Encode `texts[indices]` whole in one batched call into `found`, then learn their long
        pieces seen before."""
        for i, ids in zip(indices, encode_texts(self.tokenizer, [texts[i] for i in indices], False), strict=True):
            found[i] = ids
            self._note(cuts[i], ids)

    def _note(self, cut: Cut, ids: list[int]) -> None:
        """After a text was encoded whole: learn its long pieces not kept, where seen before."""
        if not cut.long or not self.enabled:
            return
        with self._lock:
            missing = [piece for piece in cut.long if piece not in self._pieces]
        if missing and self._seen_before(missing):
            texts = sorted({text for text, _ in cut.pieces if text})
            self._learn(cut, ids, dict(zip(texts, encode_texts(self.tokenizer, texts, False), strict=True)))

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

    def _learn(self, cut: Cut, ids: list[int], alone: dict[str, list[int]]) -> dict[tuple[str, bool], tuple[int, ...]] | None:
        """Keep the long pieces of a text encoded whole (`ids`), where every piece encodes on its
        own (`alone`, by text) to the ids between its added tokens, and return them; else stop
        splitting for this tokenizer (None)."""
        found = _cut_ids(ids, [self.special_ids[p] for p in cut.parts[1::2]])
        same = found is not None and all(
            alone.get(text, []) == got for (text, _), got in zip(cut.pieces, found, strict=True))
        if not same:
            self.enabled = False
            log.info("prompt pieces between added tokens do not encode on their own with this tokenizer; "
                     "prompts are encoded whole")
            return None
        learnt = {piece: tuple(got) for piece, got in zip(cut.pieces, found, strict=True)  # type: ignore[arg-type]
                  if len(piece[0]) >= MIN_CACHED_CHARS}
        with self._lock:
            for piece, got in learnt.items():
                self._pieces[piece] = got
                self._pieces.move_to_end(piece)
            while len(self._pieces) > CACHED_PIECES:
                self._pieces.popitem(last=False)
        return learnt


def _cut_ids(ids: list[int], specials: list[int]) -> list[list[int]] | None:
    """`ids` cut at the first occurrence of each of `specials` in turn: the ids between a
    text's added tokens; None where one is missing."""
    out, start = [], 0
    for special in specials:
        try:
            at = ids.index(special, start)
        except ValueError:
            return None
        out.append(ids[start:at])
        start = at + 1
    out.append(ids[start:])
    return out


# Where transformers' fast tokenizers define the encoding they hand to the Rust tokenizer
# (`_encode_plus`, 5.x; `_batch_encode_plus`, 4.x): a tokenizer whose class overrides it may
# change the input or the ids in Python, and is encoded through its own call.
_PLAIN_ENCODERS = ("transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast")


def encode_texts(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """`tokenizer.encode(text, add_special_tokens=...)` of each text, in one call of the
    tokenizer's batch path (the one its `encode` takes for a batch of one): the Rust
    tokenizer's offset-free batch call where that is all the call does (`_plain_backend`),
    a third less time for a burst of short prompts."""
    if not texts:
        return []
    backend = _plain_backend(tokenizer)
    if backend is not None:
        return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]
    if len(texts) == 1:
        return [list(tokenizer.encode(texts[0], add_special_tokens=add_special_tokens))]
    batch = tokenizer(texts, add_special_tokens=add_special_tokens, return_attention_mask=False)
    return [list(ids) for ids in batch["input_ids"]]


def _plain_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind `tokenizer`, where its own batch call would only pass the
    texts to it: the encoding is transformers' own (not a subclass's), and the Rust side is in
    the state that call sets (no truncation or padding, added tokens matched as the tokenizer
    says). None otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    for name in ("_encode_plus", "_batch_encode_plus"):
        owner = next((c for c in type(tokenizer).__mro__ if name in c.__dict__), None)
        if owner is not None and owner.__module__ not in _PLAIN_ENCODERS:
            return None
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens != split:
        return None
    return backend


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


class Literals(NamedTuple):
    """The special-token texts a conversation's messages held, each replaced by a marker
    (`\\ue000{nonce}:{i}\\ue001`, private-use characters and a random nonce that no message
    holds) until its rendered text is tokenized."""

    nonce: str
    texts: tuple[str, ...]

    def pieces(self, rendered: str) -> list[str | int]:
        """`rendered` cut at the markers: its own text, and the index of each literal."""
        marker = re.compile(re.escape(f"\ue000{self.nonce}:") + r"(\d+)\ue001")
        out: list[str | int] = []
        for i, piece in enumerate(marker.split(rendered)):
            out.append(int(piece) if i % 2 else piece)
        return out


class SpecialTexts:
    """The text of a tokenizer's special tokens inside chat messages, kept as text."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        texts = sorted({t.content for t in added.values() if getattr(t, "special", False) and getattr(t, "content", "")},
                       key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, texts))) if texts else None

    def guard(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Literals | None]:
        """`messages` with each special token's text in their content replaced by a marker,
        and what the markers stand for; the messages themselves (and None) where none holds one."""
        if self.pattern is None or not any(isinstance(m.get("content"), str) and self.pattern.search(m["content"])
                                           for m in messages):
            return messages, None
        nonce, texts = secrets.token_hex(8), []

        def mark(match: re.Match[str]) -> str:
            texts.append(match.group(0))
            return f"\ue000{nonce}:{len(texts) - 1}\ue001"

        out = [{**m, "content": self.pattern.sub(mark, m["content"])} if isinstance(m.get("content"), str) else m
               for m in messages]
        return out, Literals(nonce, tuple(texts))

    def encode(self, rendered: str, literals: Literals, encode_text: Any) -> list[int]:
        """Ids of `rendered`: its own text by `encode_text` (a list of texts -> their ids, as the
        template's text is tokenized), each literal as plain text (no special token matched)."""
        pieces = literals.pieces(rendered)
        texts = [p for p in pieces if isinstance(p, str)]
        text_ids = iter(encode_text(texts))
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, str):
                ids += next(text_ids)
            else:
                ids += self.tokenizer(literals.texts[piece], add_special_tokens=False,
                                      split_special_tokens=True)["input_ids"]
        return ids
