"""A decode step as one object: its rows, how each row is sampled, and its phases.

`DecodeStep` is what `ModelRunner.decode` and the decode graphs run: one-token rows (a
request's sampled token, or forced, prompt and guessed tokens as extra rows), a temperature,
noise seed and has-mask flag per row, and the hooks the runner calls at each phase:

    fill_masks(host_bitmask)   while the forward runs
    before_wait(done)          on CUDA, before the host waits for the sampled tokens
    plan_next(tokens)          once the tokens are on the host (where `plans_next`): the next
                               step's rows, whose forward is launched before returning

`EngineDecodeStep` is the engine's step: its fields are the step's state (row errors, the
tokens each request takes, what the matchers made of them, the finished requests) and its
methods the phases, with `take_tokens` taking the sampled tokens in. The speculator and the
draft model run their own `DecodeStep`s (speculative/)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from structgen.engine.drafts import fill_guess_rows, take_guesses
from structgen.engine.model_runner import ExtendSeq
from structgen.errors import EngineError, InvalidConstraintError, StructgenError

if TYPE_CHECKING:
    from structgen.engine.engine import Engine
    from structgen.engine.request import Request

log = logging.getLogger("structgen.engine")


@dataclass
class DecodeStep:
    """Rows of one token each (an `ExtendSeq` of n tokens is n rows), row i sampled at
    `temperatures[i]` (0: greedy) with noise seed
    `seeds[i]`, under its grammar mask where `has_mask[i]`. `predict_next`: every request's
    rows are adjacent with consecutive positions and it will likely decode again, so the
    graphs may launch the next step's forward early (cuda_graphs.py). `plans_next`: ask
    `plan_next` for that forward instead of predicting it. `guess`: (row, token) where the
    last row is a guess run after that row (the token gate runs the next forward only where
    the model picked the guess). `gate_next`: the next step is likely one row a sequence, so
    the token gate may run that forward before the host has planned it (cuda_graphs.py)."""

    rows: list[ExtendSeq]
    temperatures: list[float]
    seeds: list[int]
    has_mask: list[bool]
    predict_next: bool = False
    plans_next: bool = False
    guess: tuple[int, int] | None = None
    gate_next: bool = True

    def __post_init__(self) -> None:
        self.num_rows = len(self.temperatures)  # a row per token of `rows` (`cuda_graphs.step_rows`)

    def fill_masks(self, bitmask: torch.Tensor) -> None:
        """Fill row i of the int32 [len(rows), W] host tensor for every i with `has_mask[i]`;
        called after the forward is launched, so on CUDA it overlaps the device."""

    def before_wait(self, done: Callable[[], bool]) -> None:
        """Host work for while the device still computes; `done()` says whether the sampler
        has finished. Called on the graphs' path only."""

    def plan_next(self, tokens: list[int]) -> list[ExtendSeq] | None:
        """Given every row's sampled token: the next step's rows (None: launch
        nothing). Called only where `plans_next` and the graphs pre-launch; callers must not
        count on it."""
        return None


class EngineDecodeStep(DecodeStep):
    """The engine's decode step over `batch` (requests and the tokens each runs): request i
    samples at row `sampled_rows[i]`, and where it runs a guess, at `guessed[i]` after it.
    Prompt chunks (`chunks`) run their tokens and sample nothing."""

    def __init__(self, engine: Engine, batch: list[tuple[Request, int]]):
        rows, rows_of = engine._decode_rows(batch)
        self.engine = engine
        self.batch = batch
        self.chunks = [(r, n) for (r, n), row in zip(batch, rows_of, strict=True) if row is None]
        self.reqs = [r for (r, _), row in zip(batch, rows_of, strict=True) if row is not None]  # they sample
        self.sampled_rows = [row for row in rows_of if row is not None]
        # Request i's guess row follows its sampled row (`Engine._decode_rows`); sampled under
        # the grammar state after the guess, with the noise of the position after.
        self.guessed = {i: row + 1 for i, (row, r) in enumerate(zip(self.sampled_rows, self.reqs, strict=True))
                        if r.guess is not None}
        # Rows without a matcher (free text, a request still thinking: engine/reasoning.py)
        # sample unmasked beside the constrained ones (`has_mask`).
        self.constrained = [(row, r.matcher) for row, r in zip(self.sampled_rows, self.reqs, strict=True)
                            if r.matcher is not None]
        # After a sampled `"` the grammar may force `, "age": `: the next step is that text, not
        # the predicted token, so jump-forward steps plan the next step themselves.
        plans = not self.chunks and any(r.jump_forward for r in self.reqs)
        # Behind a guess, the token gate runs the next forward (after the guess's row) only
        # where the model picked the guess.
        check = (self.sampled_rows[0], self.reqs[0].guess) if self.guessed and len(self.reqs) == 1 else None
        num_rows = sum(n for _, n in batch) + len(self.guessed)
        super().__init__(rows, *self._sampling(num_rows), predict_next=not self.chunks, plans_next=plans,
                         guess=check)
        self.rehearses = plans and self._rehearses()
        self.rehearsed_guess = self.reqs[0].guess if self.rehearses and self.guessed else None
        self.row_errors: dict[int, BaseException] = {}  # by row: its mask could not be filled
        self.bad_guesses: set[int] = set()  # requests whose guess row's mask could not be filled
        self.filled: torch.Tensor | None = None  # the host bitmask the masks went into
        self.tokens: list[int] | None = None  # each request's token, once guesses are in
        self.failed: dict[int, StructgenError] = {}  # by request: its matcher raised on the token
        self.taken: list | None = None  # what each matcher made of its token, once it has it
        self.plain = False  # `Engine._plain_next_step` checked every request: only appending is left
        self.finished: list[Request] | None = None  # once the tokens are taken in

    def _sampling(self, num_rows: int) -> tuple[list[float], list[int], list[bool]]:
        """Every row's temperature, noise seed and has-mask flag (rows that sample nothing:
        greedy, seed 0, no mask)."""
        temperatures, seeds, has_mask = [0.0] * num_rows, [0] * num_rows, [False] * num_rows
        for row, r in zip(self.sampled_rows, self.reqs, strict=True):
            t = r.params.temperature
            temperatures[row], has_mask[row] = t, r.matcher is not None
            if t != 0.0:  # greedy rows draw no noise (seed 0)
                seeds[row] = self.engine._noise_seed(r)
        for i, row in self.guessed.items():  # as its sampled row, with the next position's noise
            r = self.reqs[i]
            temperatures[row], has_mask[row], seeds[row] = r.params.temperature, True, self.engine._noise_seed(r, 1)
        return temperatures, seeds, has_mask

    def _rehearses(self) -> bool:
        """Batch 1 with jump-forward: the host has nothing else to do until the device has
        sampled the token, so it works out the jump each likely token would make. Not in
        batches: there the rehearsals rarely matched the sampled token and delayed reading it
        (docs/performance.md, "Jump-forward")."""
        req, hook = self.reqs[0], self.engine.jump_forward_hook
        return (len(self.reqs) == 1 and req.jump_forward
                and req.matcher is not None and getattr(hook, "rehearses", False))

    # -- the phases ---------------------------------------------------------------------------
    def fill_masks(self, bitmask: torch.Tensor) -> None:
        eng = self.engine
        self.filled = bitmask
        self.row_errors.update(eng._fill_masks(bitmask, eng._not_prefilled(bitmask, self.constrained)))
        if self.guessed:
            bad, broken = fill_guess_rows(bitmask, [(i, self.reqs[i], row) for i, row in self.guessed.items()])
            self.bad_guesses |= bad
            self.failed.update(broken)
        if any(r.rejected for r in self.reqs):  # HOOK(repair)
            eng.ban_rejected(bitmask, [(row, r, None) for row, r in zip(self.sampled_rows, self.reqs, strict=True)]
                             + [(row, self.reqs[i], self.reqs[i].guess) for i, row in self.guessed.items()])

    def before_wait(self, done: Callable[[], bool]) -> None:
        """Rehearse the jumps of the sampled row's likely tokens (with a guess: the tokens after
        it, sampled at its row, which the step gives where the model picks it)."""
        if not self.rehearses or self.filled is None or not self.sampled_rows:
            return
        first = self.sampled_rows[0]
        if first in self.row_errors or 0 in self.bad_guesses:
            return
        row = self.guessed.get(0, first)
        try:
            self.engine.jump_forward_hook.rehearse(self.reqs[0], self.filled[row].numpy().view(np.uint32), done,
                                                   self.rehearsed_guess)
        except Exception as exc:  # its matcher may be left mid-rehearsal: fail the request
            log.exception("rehearsing jump-forward failed")
            self.row_errors[first] = EngineError(f"jump-forward rehearsal failed: {exc}")

    def plan_next(self, tokens: list[int]) -> list[ExtendSeq] | None:
        """The device waits while the host decides, so the common case (nothing forced, nobody
        finishes) is decided by the grammar alone and its forward launched before the rest of
        taking the tokens in; otherwise the tokens are taken in (jump-forward included) and the
        next step planned from that."""
        toks = self.request_tokens(tokens)  # guesses the model picked are in: the next token is the guess row's
        if not self.row_errors and not self.failed:
            rows, self.taken, raised = self.engine._plain_next_step(self.reqs, toks)
            self.failed.update(raised)
            if rows is not None:
                self.plain = True
                return rows  # `take_tokens` runs once this forward is launched
        self.take_tokens(tokens, fill_next=False)  # the device waits: no fills before the launch
        return self.engine._plan_decode_step()

    def request_tokens(self, tokens: list[int]) -> list[int]:
        """Each request's token, given every row's: its sampled row's, or, where the model
        picked its guess (taken in here, once), the guess row's."""
        if self.tokens is None:
            toks = [tokens[row] for row in self.sampled_rows]
            if self.guessed:  # a request whose row failed keeps its guess out (`take_tokens` fails it)
                skip = self.bad_guesses | {i for i, row in enumerate(self.sampled_rows) if row in self.row_errors}
                errors: dict[int, BaseException] = {}
                toks = take_guesses(self.reqs, toks, {i: tokens[row] for i, row in self.guessed.items()}, skip, errors,
                                   self.engine._advance)
                self.failed.update({i: exc if isinstance(exc, (EngineError, InvalidConstraintError)) else EngineError(str(exc))
                                    for i, exc in errors.items()})
            self.tokens = toks
        return self.tokens

    def take_tokens(self, tokens: list[int], fill_next: bool) -> None:
        """Take every row's sampled token in: the KV cache counts this step's rows and each
        request advances by its token (`Engine._advance_all`); `fill_next`: the next step's
        masks are filled on the way where the grammar's pool can."""
        toks = self.request_tokens(tokens)
        errors = {i: self.row_errors[row] for i, row in enumerate(self.sampled_rows)
                  if row in self.row_errors} if self.row_errors else {}
        errors |= self.failed
        for req, n in self.chunks:
            req.num_cached += n
            req.stats.forward_passes += 1
        for req in self.reqs:
            req.num_cached = len(req.token_ids)
            req.stats.forward_passes += 1
        self.finished = self.engine._advance_all(self.reqs, toks, errors, prefetch=True, taken=self.taken,
                                                 plain=self.plain, fill_next=fill_next)


__all__ = ["DecodeStep", "EngineDecodeStep"]
