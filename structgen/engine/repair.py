"""Field-level repair, the engine's half: a request whose finished output a validator rejects
is sent back to the start of the rejected field instead of finishing, and decoded on from
there under its grammar, never writing the rejected text again.

Where the request finishes (`Engine._advance_all`, before its KV slot is released), its
`validator` (structgen/repair.py: parse, validate, find the field) may answer a `Rewind`:
keep the first `keep` answer tokens (after any think section). `reopen_if_rejected` then rolls the matcher back, truncates
the request (its KV cache follows, as for rejected drafts) and records the text that followed
as a `RejectedText`. While a later step's output still spells a prefix of that text,
`ban_rejected` clears, in the row's grammar mask, every token that keeps it on that text
(spelling more of it, or all of it and beyond), unless that clears the whole mask (the
grammar forces the text). So the retry leaves the rejected text at its first free choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from structgen.engine.engine import Engine
    from structgen.engine.jump_forward import VocabBytes
    from structgen.engine.request import Request

log = logging.getLogger("structgen.engine")


@dataclass(frozen=True)
class Rewind:
    """Take the output back to its first `keep` tokens and decode on from there; `rejected`
    is the text (UTF-8) the rejected output had after them, up to the end of the bad value."""

    keep: int
    rejected: bytes


@dataclass(frozen=True)
class RejectedText:
    """Text a validator rejected, as it followed output token `start`."""

    start: int
    text: bytes


# Called on a request whose output is complete: None lets it finish.
OutputValidator = Callable[["Request"], "Rewind | None"]


def reopen_if_rejected(engine: Engine, req: Request) -> bool:
    """At a constrained request's finish: where its validator asks for a rewind, roll it back
    and keep it running (True); else leave it finished (False). A validator that raises lets
    the request finish as it is (the caller's own validation then reports it)."""
    if req.validator is None or req.finish_reason != "stop" or req.matcher is None:
        return False
    try:
        rewind = req.validator(req)
        if rewind is None:
            return False
        dropped = len(req.answer_ids) - rewind.keep
        m = req.matcher
        m.rollback(dropped + int(m.is_terminated()))  # the stop token was accepted, not appended
    except Exception:
        log.exception("validating the output of request %d failed", req.id)
        return False
    req.rejected.append(RejectedText(rewind.keep, rewind.rejected))
    req.stats.repairs += 1
    req.stats.repair_tokens += dropped
    req.reopen(req.grammar_start + rewind.keep)
    engine.closer.admit(req)  # its budget and loop checks start over from the shorter output
    return True


def ban_rejected(bitmask: torch.Tensor, rows: Iterable[tuple[int, Request, int | None]], vocab: VocabBytes) -> None:
    """Clear, in each (row, request, draft) whose request has rejected text, the tokens that
    would keep its output on that text at the row's position (after `draft`, where the row
    samples after a draft token). A row the ban would empty is left as the grammar filled it."""
    words = bitmask.numpy().view(np.uint32)
    for row, req, draft in rows:
        if not req.rejected:
            continue
        ids = req.answer_ids if draft is None else [*req.answer_ids, draft]
        banned = [_continuations(r, ids, vocab) for r in req.rejected]
        banned = [b for b in banned if len(b)]
        if not banned:
            continue
        ban = np.concatenate(banned)
        ban = ban[ban < words.shape[1] * 32]
        kept = words[row].copy()
        np.bitwise_and.at(kept, ban >> 5, ~(np.uint32(1) << (ban & 31).astype(np.uint32)))
        if kept.any():
            words[row] = kept


def _continuations(rejected: RejectedText, ids: list[int], vocab: VocabBytes) -> np.ndarray:
    """The tokens that keep output `ids` on `rejected` at its next position: none once it has
    left that text (or has not reached its start)."""
    if len(ids) < rejected.start:
        return vocab.consistent_with(b"")
    written = vocab.join(ids[rejected.start:])
    if len(written) >= len(rejected.text) or not rejected.text.startswith(written):
        return vocab.consistent_with(b"")
    return vocab.consistent_with(rejected.text[len(written):])


__all__ = ["OutputValidator", "RejectedText", "Rewind", "ban_rejected", "reopen_if_rejected"]
