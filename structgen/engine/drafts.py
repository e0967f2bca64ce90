"""Jump-forward's guess (`Request.guess`; speculative decoding's proposals are its drafts):
one token run as the row after its sampled row and sampled too, so that where the model picks
it, the step yields two tokens.

Jump-forward proposes the token it held back at the end of forced text
(engine/jump_forward.py); the engine lays the row out (`Engine._decode_rows`, or a second
logits row in an eager extend) and, with the two helpers here, fills the guess row's grammar
mask while the device computes and takes the guess in where the model picked it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from structgen.errors import EngineError, InvalidConstraintError, StructgenError

if TYPE_CHECKING:
    import torch

    from structgen.engine.request import Request


def fill_guess_rows(bitmask: torch.Tensor, rows: list[tuple[int, Request, int]]) -> tuple[set[int], dict[int, StructgenError]]:
    """Fill `bitmask[row]` with request i's grammar mask after its guess (the matcher takes
    the guess, then rolls back), for each (i, request, row). Returns the i where that failed
    (their guesses are dropped: the row's token is not used) and, among them, those whose
    matcher could not roll the guess back: that request fails alone, never its batch."""
    bad: set[int] = set()
    broken: dict[int, StructgenError] = {}
    for i, req, row in rows:
        m = req.matcher
        try:
            if not m.accept_token(req.guess):
                bad.add(i)
                continue
        except Exception:
            bad.add(i)
            continue
        try:
            m.fill_bitmask(bitmask, row)
        except Exception:
            bad.add(i)
        try:
            m.rollback(1)
        except Exception as exc:
            bad.add(i)
            broken[i] = exc if isinstance(exc, (EngineError, InvalidConstraintError)) else EngineError(
                f"grammar rollback failed: {exc}")
    return bad, broken


def take_guesses(reqs: list[Request], tokens: list[int], after: dict[int, int], bad: set[int],
                errors: dict[int, BaseException], advance: Callable[..., None]) -> list[int]:
    """Request i ran its guess this step: `tokens[i]` was sampled where the guess stands,
    `after[i]` after the guess. Where the model picked the guess, `advance(req, guess,
    jump_forward=False)` takes it in (its K/V is cached) and `after[i]` becomes the token to
    advance by; elsewhere the guess is dropped (its K/V is overwritten later). Returns the
    tokens to advance by; a guess that fails to go in fails its request through `errors`."""
    tokens = list(tokens)
    for i, token in after.items():
        req = reqs[i]
        guess, req.guess = req.guess, None
        req.stats.drafted_tokens += 1
        if i in errors or i in bad or guess is None or tokens[i] != guess:
            continue
        try:
            advance(req, guess, jump_forward=False)
            if req.finished:  # pragma: no cover - a guess is proposed only where it cannot end the output
                raise EngineError("a guess token ended the output")
        except Exception as exc:
            errors[i] = exc
            continue
        req.num_cached = len(req.token_ids)
        req.stats.accepted_tokens += 1
        tokens[i] = token
    return tokens
