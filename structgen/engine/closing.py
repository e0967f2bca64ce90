"""Budget-aware closing: a constrained request that nears its `max_tokens` ends with a whole
value instead of being cut off.

Each request carries `close_at`, the output length at which the engine next asks this module
(`BudgetCloser.at_budget`); until then the only cost is one integer comparison per request and
step. At a check the closer searches the grammar for a short completion from
the request's state (`CompletionSearch`): while the budget is far it only schedules the next
check (halfway to where closing must start, so checks get denser as the end nears, and at most
`CHECK_EVERY` tokens on, so a stream's held-back text is released every few tokens); once the
tokens left are within that completion's length plus `CLOSING_MARGIN`, it appends the
completion without sampling it and finishes the request with `stop` (an open string ends, arrays
and objects close, optional fields are skipped). The request then needs no further forward, so
this works alike in eager steps, the decode graphs, jump-forward and speculative verify steps.
Where a check finds that no completion fits any more (the output opened an object with
required fields its budget cannot close), the tokens since the last check that found one that
fits are dropped and the output is closed there. `length` is left only where no check found a
completion that fits the budget.

The loop guard (`SamplingParams.loop_guards`) adds a check at every multiple of
`LOOP_CHECK_EVERY` output tokens: a tail that repeats one short token pattern (a digit, a
phrase, an array item) closes the request early the same way, and the stats say so. Forced text
runs over these checks; each then runs on the output up to its place (`after_forced_text`), so
where an output is closed depends on its tokens only, not on how many each step added.

The completion comes from `completion_search.CompletionSearch`; requests in the same grammar
state (every request of one schema at admission) share one search (`completion_cache`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from structgen.engine.completion_cache import CompletionCache
from structgen.engine.completion_search import SEARCH_MAX_FILLS, CompletionSearch
from structgen.errors import EngineError
from structgen.grammar.backends.base import control_token_ids, token_bytes

if TYPE_CHECKING:
    from structgen.engine.request import GenerationStats, Request
    from structgen.grammar.backends.base import GrammarMatcher
    from structgen.sampling import SamplingParams

log = logging.getLogger("structgen.engine")

# Tokens of budget beyond the completion's own length at which closing starts: a sampled token
# can lengthen the completion (a new optional field), so closing starts a little early.
CLOSING_MARGIN = 2
# The first check of a request comes this many tokens before its max_tokens (earlier would cost
# searches for requests that end on their own; completions longer than this are rare).
FIRST_CHECK_WINDOW = 64
# How often the loop guard looks at the tail, and what counts as a loop: a pattern of at most
# LOOP_MAX_PERIOD tokens repeated to fill at least max(LOOP_MIN_RUN, 3 periods) tokens after
# its first occurrence (four copies at least).
LOOP_CHECK_EVERY = 16
# Tokens before the safe point that a rollback may also drop: jump-forward respells sampled
# text with forced text after it (`true` + `},` as `true},`), so the token count of a safe
# point can end up past a token that opened what cannot close.
SAFE_POINT_SLACK = 3
LOOP_MAX_PERIOD = 32
LOOP_MIN_RUN = 16
# The most output tokens between two budget checks once a request has a safe point: a stream
# holds back the text after it until the next check (`retractable_from`), so this bounds that
# wait, for a search per this many tokens near the budget (alike streamed or not, so that
# where an output is closed does not depend on whether it is streamed).
CHECK_EVERY = 4


class BudgetCloser:
    """Decides, at each request's `close_at`, whether to close it now, and when to look next."""

    def __init__(self) -> None:
        self.search: CompletionSearch | None = None  # set by `use_tokenizer`
        self.completions = CompletionCache()

    def use_tokenizer(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        """Closing needs the tokens' text to rank its search; without it requests end at
        max_tokens as they come."""
        tokens = token_bytes(tokenizer, vocab_size)
        excluded = control_token_ids(tokenizer, vocab_size, stop_token_ids)
        self.search = CompletionSearch(tokens, excluded, vocab_size,
                                       lambda text: list(tokenizer.encode(text, add_special_tokens=False)))

    def admit(self, req: Request) -> None:
        """Set the request's first checks."""
        p = req.params
        req.close_at = req.budget_check_at = p.max_tokens
        req.safe_point = None
        if req.matcher is None or self.search is None:
            return
        if p.close_at_budget:
            req.budget_check_at = max(0, p.max_tokens - FIRST_CHECK_WINDOW)
            if req.budget_check_at <= req.num_output:  # a small budget: check the empty output now
                self._plan_from_here(req)
        self._schedule(req, req.num_output)

    def _plan_from_here(self, req: Request) -> None:
        """At admission: where a completion fits, the output as it is becomes a safe point
        (before forced text or the model open what the budget cannot close) and the next check
        is set from it; a completion that only just fits leaves the check due at once."""
        left = req.params.max_tokens - req.num_output
        plan = self.shortest(req, left)
        if plan is not None:
            req.safe_point = req.num_output
            if len(plan) + CLOSING_MARGIN < left:
                req.budget_check_at = self._next_check(req, left, plan)

    def shortest(self, req: Request, limit: int, dropped: int = 0) -> list[int] | None:
        """The search's completion from the state of the request's matcher (which has rolled
        back its last `dropped` output tokens), at most `limit` tokens; None where it found
        none. Requests in the same state share one search; a kept completion is used only
        where the matcher takes it and is complete after it."""
        m, history = req.matcher, req.answer_ids
        kept = len(history) - dropped
        known = req.matcher_from_start and kept >= 0  # else the matcher's tokens are not known
        key = self.completions.key(m.grammar, history[:kept]) if known else None
        found = self.completions.get(key, limit)
        if found is None or not _completes(m, found.within(limit)):
            found = self.search.search(m, limit)
            self.completions.put(key, found)
        return found.within(limit)

    @staticmethod
    def _next_check(req: Request, left: int, plan: list[int]) -> int:
        """The next budget check: halfway to where closing must start, so checks get denser
        as the end nears, and at most CHECK_EVERY tokens on, so that each check moves the safe
        point and a stream releases the text it held back since."""
        gap = max(1, (left - len(plan) - CLOSING_MARGIN) // 2)
        return req.num_output + min(gap, CHECK_EVERY)

    def at_budget(self, req: Request, completed: bool) -> None:
        """The request's output reached `req.close_at` (`completed`: its grammar may end
        here): finish it at max_tokens, close it, or set its next check. A grammar that fails
        meanwhile fails this request alone."""
        try:
            self._check(req, completed)
        except Exception as exc:
            log.exception("closing request %d failed", req.id)
            req.finish("error", exc if isinstance(exc, EngineError) else EngineError(f"closing the output failed: {exc}"))

    def _check(self, req: Request, completed: bool) -> None:
        p, m = req.params, req.matcher
        left = p.max_tokens - req.num_output
        if left <= 0:
            if completed or not self._close_at_safe_point(req):
                self._note_incomplete(req, completed)
                req.finish_if_done(completed, lambda: False)  # at max_tokens: stop or length
            return
        if m is None or self.search is None:
            req.close_at = p.max_tokens
            return
        looped = p.loop_guards and self._looped(req)
        if looped or (p.close_at_budget and req.num_output >= req.budget_check_at):
            plan = self.shortest(req, left)
            if plan is not None and (looped or len(plan) + CLOSING_MARGIN >= left):
                self._close(req, plan, "repetition" if looped else "budget_closing")
                return
            if plan is None and self._close_at_safe_point(req):
                return
            if plan is not None:
                req.safe_point = req.num_output
            req.budget_check_at = p.max_tokens if plan is None else self._next_check(req, left, plan)
        self._schedule(req, req.num_output)

    @staticmethod
    def _schedule(req: Request, now: int) -> None:
        """`close_at`: the sooner of the next budget check and the next loop check, at the next
        multiple of LOOP_CHECK_EVERY output tokens (a grid, so budget checks and forced text
        do not move it)."""
        p = req.params
        req.close_at = min(p.max_tokens, req.budget_check_at if p.close_at_budget else p.max_tokens,
                           (now // LOOP_CHECK_EVERY + 1) * LOOP_CHECK_EVERY if p.loop_guards else p.max_tokens)

    def after_forced_text(self, req: Request, forced: int) -> None:
        """Jump-forward appended `forced` tokens (after re-spelt ones), which may run over loop
        checks (it stops short of budget checks only, `forced_text_end`). Each check passed
        runs on the output up to its own place, as where sampled tokens bring the output to
        it, and one that finds a loop there drops the tokens after it and closes the output at
        that place: whether and where an output is closed is a function of its tokens, not of
        how many each step adds (so with and without speculation alike), and forced text is
        cut only where the output loops."""
        p = req.params
        end = min(p.max_tokens, req.budget_check_at if p.close_at_budget else p.max_tokens)
        while (p.loop_guards and not req.finished and req.num_output >= req.close_at and req.close_at < end
               and req.matcher is not None and self.search is not None):
            at = req.close_at
            start = req.num_prompt + at
            if find_loop(req.token_ids[max(req.num_prompt, start - 4 * LOOP_MAX_PERIOD) : start]) is None:
                self._schedule(req, at)
                continue
            back = req.num_output - at
            req.matcher.rollback(back)
            req.truncate(len(req.token_ids) - back)
            req.stats.forced_tokens -= min(back, forced)
            self._check(req, req.matcher.is_completed())  # as at a sampled token: closes there

    @staticmethod
    def forced_text_end(req: Request) -> int:
        """How many output tokens jump-forward's forced text may fill up to: the token before
        the next budget check ahead, where the closer must see the output before the budget is
        spent (forced text running past it to max_tokens left nothing to close with). So the
        token at the check is a sampled one and the check runs exactly there, as it does where
        a verify step's drafts or plain decoding bring the output to it: where checks fall, and
        so whether and where an output is closed, does not depend on how many tokens each step
        adds. A check already due runs at the next token, and a closer that finds the output
        too long drops back. Loop checks do not stop forced text: they run on the output up
        to their place after it (`after_forced_text`)."""
        p = req.params
        if not p.close_at_budget or req.budget_check_at <= req.num_output:
            return p.max_tokens
        return min(p.max_tokens, req.budget_check_at - 1)

    @staticmethod
    def room_for(req: Request, tokens: int) -> bool:
        """Whether `tokens` more output tokens can come in one step with the request's next
        check at the step's last token at the earliest: a check at max_tokens or a budget check
        (which may close the output) stays where it is; a loop check waits (it finds the same
        loop a few tokens later)."""
        end = req.num_output + tokens
        if end <= req.close_at:
            return True
        p = req.params
        if end > min(p.max_tokens, req.budget_check_at if p.close_at_budget else p.max_tokens):
            return False
        req.close_at = end
        return True

    @staticmethod
    def retractable_from(req: Request) -> int | None:
        """The output length past which closing may still drop the request's tokens (back to
        its safe point, or up to `SAFE_POINT_SLACK` tokens before it: `_close_at_safe_point`);
        None where it drops none. Safe points only move forward, so text before the length
        read here is not taken back; a reader that already sent text past it (sent while there
        was no safe point) keeps that, as the closer cannot know it."""
        if not req.params.close_at_budget or req.safe_point is None:
            return None
        return max(0, req.safe_point - SAFE_POINT_SLACK)

    def _close_at_safe_point(self, req: Request) -> bool:
        """No completion fits from here (since the last check the output opened more than its
        budget can close, e.g. a new object with required fields): drop the tokens since the
        last check that found one that fits (or up to SAFE_POINT_SLACK before it, where
        respelt tokens moved it), and close there. False (the request unchanged) where there
        is no such point or none fits."""
        if req.safe_point is None or not req.params.close_at_budget or self.search is None:
            return False
        m, p = req.matcher, req.params
        back = req.num_output - req.safe_point
        m.rollback(back)
        plan = self.shortest(req, p.max_tokens - req.safe_point, back)
        while plan is None and back < min(req.num_output, req.num_output - req.safe_point + SAFE_POINT_SLACK):
            back += 1
            m.rollback(1)
            plan = self.shortest(req, p.max_tokens - (req.num_output - back), back)
        if plan is None:
            m.accept_tokens(req.token_ids[len(req.token_ids) - back:])  # as it was: ends at max_tokens
            req.safe_point = None
            return False
        req.truncate(len(req.token_ids) - back)
        req.stats.dropped_tokens = back
        self._close(req, plan, "budget_closing")
        return True

    def _close(self, req: Request, plan: list[int], guard: str) -> None:
        m = req.matcher
        taken = m.accept_tokens(plan)
        if taken != len(plan):  # pragma: no cover - the search took these very tokens
            m.rollback(taken)
            raise EngineError("the grammar refused the completion it was searched for")
        req.append(plan)  # counted apart from jump-forward's forced tokens (`closed_tokens`)
        req.stats.closed_tokens = len(plan)
        req.stats.guards_fired.append(guard)
        req.finish("stop")

    def _looped(self, req: Request) -> bool:
        """Does the output end in a loop? Records what repeats in the stats."""
        tail = req.token_ids[max(req.num_prompt, len(req.token_ids) - 4 * LOOP_MAX_PERIOD):]
        loop = find_loop(tail)
        if loop is not None:
            req.stats.loop = b"".join(self.search.tokens[t] for t in tail[-loop:]).decode("utf-8", errors="replace")
        return loop is not None

    def _note_incomplete(self, req: Request, completed: bool) -> None:
        """Cut off at max_tokens: record what looped and the shortest completion from here,
        for the error's message."""
        if completed or req.matcher is None or self.search is None or req.matcher.is_terminated():
            return
        self._looped(req)
        plan = self.shortest(req, SEARCH_MAX_FILLS)
        req.stats.shortest_completion = len(plan) if plan is not None else None


def _completes(m: GrammarMatcher, plan: list[int] | None) -> bool:
    """Whether `m` takes `plan` and is complete after it (None: nothing to check); `m` is
    left as it was."""
    if plan is None:
        return True
    taken = m.accept_tokens(plan)
    done = taken == len(plan) and m.is_completed()
    m.rollback(taken)
    return done


def find_loop(ids: Sequence[int]) -> int | None:
    """The period of the pattern `ids` ends repeating (see LOOP_MIN_RUN), if any."""
    n = len(ids)
    for period in range(1, LOOP_MAX_PERIOD + 1):
        need = max(LOOP_MIN_RUN, 3 * period)
        if need + period > n:
            return None
        run = 0
        while run < need and ids[n - 1 - run] == ids[n - 1 - run - period]:
            run += 1
        if run >= need:
            return period
    return None


def incomplete_message(params: SamplingParams, stats: GenerationStats) -> str:
    """The message of an output cut off at max_tokens: how far the shortest completion was,
    what looped and the bound that stops it."""
    msg = f"generation hit max_tokens={params.max_tokens} before the output was complete"
    if stats.shortest_completion is not None:
        msg += f"; even the shortest completion from there needed {stats.shortest_completion} more token(s)"
    if not stats.loop:
        return msg + "; raise max_tokens"
    hint = _bound_hint(stats.loop)
    if not params.loop_guards:
        hint += ", or leave loop_guards on to close a looping output early"
    return msg + f"; the output looped, repeating {stats.loop!r}: {hint}"


def _bound_hint(unit: str) -> str:
    bare = unit.strip().strip(".-")
    if bare.isdigit():
        return "bound the number (le=/ge= on the field, maximum/minimum in a JSON schema, or {1,n} on the digits of a regex or grammar)"
    if any(c in unit for c in ",]}"):
        return "bound the array (max_length= on the list field, maxItems in a JSON schema, or {0,n} in a regex or grammar)"
    return "bound the text (max_length= on the str field, maxLength or a pattern in a JSON schema, or {1,n} in a regex or grammar)"


__all__ = ["BudgetCloser", "find_loop", "incomplete_message"]
