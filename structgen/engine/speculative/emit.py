"""Taking a verify step's emitted tokens into a request: what the engine's `_advance` does for
each token, with the tokens after which nothing can happen appended in one go.

A verify step emits a run of tokens (accepted drafts and the target's own token) on the path
from the sampled tokens to the next step's launch (speculator.py `_plan_next`), so its
per-token work idles the device. Most tokens of a run need nothing but appending: the grammar
takes them, the output is not complete there, no budget or loop check falls due and no text
is forced after them (`Engine._takes_plainly`'s test, for a whole run). Those are collected
and appended once; any other token goes through `_advance` with what its matcher said, after
the ones before it were appended, so finishing, closing and jump-forward see exactly the
state they saw token by token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from structgen.grammar import accept_one
from structgen.grammar.backends.base import ACCEPTED, COMPLETED, FAILED, JUMPS, TERMINATED

if TYPE_CHECKING:
    from structgen.engine.engine import Engine
    from structgen.engine.request import Request

_NOT_PLAIN = ACCEPTED | TERMINATED | COMPLETED | FAILED | JUMPS  # a plain token's status: ACCEPTED alone


def emit(engine: Engine, req: Request, emitted: list[int]) -> None:
    """Advance `req` by `emitted` (in order) as `engine._advance` would token by token, with
    jump-forward after the last one only; stops where the request finishes."""
    if req.thinking:  # its think section may close mid-run: token by token (`_emit_thinking`)
        _emit_thinking(engine, req, emitted)
        return
    m, last = req.matcher, len(emitted) - 1
    plain: list[int] = []  # taken by the matcher, not appended yet
    room = _plain_room(req)
    try:
        for j, tok in enumerate(emitted):
            if m is None:
                status = None
                if len(plain) < room and tok not in req.stop_token_ids:
                    plain.append(tok)
                    continue
            else:
                # JUMPS asked after the last token only: jump-forward runs there alone.
                status = accept_one(m, tok, check_jump=j == last and req.jump_forward)
                if len(plain) < room and status & _NOT_PLAIN == ACCEPTED:
                    plain.append(tok)
                    continue
            if plain:
                req.append(plain)
                plain = []
            engine._advance(req, tok, jump_forward=j == last, status=status, jump_checked=True)
            if req.finished:
                return
            room = _plain_room(req)  # (a budget or loop check may have moved `close_at`)
    finally:
        if plain:  # also where a matcher raised: the tokens it took before stay appended
            req.append(plain)


def _plain_room(req: Request) -> int:
    """How many more tokens may be appended plainly: each leaves the output short of
    `close_at` (where the closer looks) and of the last token `max_tokens` allows."""
    return min(req.close_at, req.params.max_tokens) - req.num_output - 1


def _emit_thinking(engine: Engine, req: Request, emitted: list[int]) -> None:
    """`emit` for a request in its think section: where the section closes (a stop token, the
    closing tag), the rest of the run is dropped (its K/V too): the grammar takes the answer
    from there."""
    base = len(req.token_ids)
    for j, tok in enumerate(emitted):
        engine._advance(req, tok, jump_forward=j == len(emitted) - 1)
        if req.finished:
            return
        if not req.thinking:
            req.num_cached = min(req.num_cached, base + j + 1, len(req.token_ids))
            return
