"""Continuous batching: requests join when the KV cache has pages for them and leave the
moment they finish.

Each step every running request gets its pending tokens scheduled: decode requests one token
(or their forced jump-forward tokens), prefilling requests a chunk of their prompt from what
is left of the step's token budget, so a long prompt never stalls everyone else's decoding.
A request decodes after the prompts that were waiting before its first token, though: a
burst's first requests to decode leave the steps to the burst's other prompts until those
have run (the burst's time to first token), while a prompt that arrives later takes only
the share of the step that decode rows leave it (`PROMPT_SHARE`), so a request is held up by
a bounded amount of prompt work, never by a stream of new arrivals.

Admission is by pages (page_table.py): a request joins when the pool has pages for all its
tokens plus `lookahead` positions, after taking the pages its prompt's start shares with the
prefix cache (those tokens are not prefilled again). A running request grows a page at a time;
where the pool runs out, the newest running request is preempted: its pages are freed and it
waits at the front of the queue, to be recomputed from its prompt and its output so far (its
grammar state and tokens are kept, so the stream continues where it was).

Requests that arrive together with a shared prompt start (agent turns with one tool catalogue)
compute it once: while a running request is still prefilling pages a waiting request's prompt
starts with, admission waits for them to be published (`_prefix_in_flight`).

Admission is fair across clients, then across one client's request groups (waiting.py).
"""

from __future__ import annotations

from structgen.engine.page_table import PageTable
from structgen.engine.request import Request, RequestStatus
from structgen.engine.waiting import WaitingRequests

# Pages of a prompt another request is computing that are worth waiting for.
MIN_SHARED_PAGES = 2
# The part of a step's token budget kept for prompts while decode rows alone would fill it.
PROMPT_SHARE = 0.5


class PrefillingPrefixes:
    """The running requests' prompt windows of `width` tokens still to be prefilled, by start
    position, collected once per start for one admission pass: a burst's admission looks a
    waiting prompt's next pages up, instead of comparing them with every running prompt."""

    def __init__(self, running: list[Request], width: int):
        self.running, self.width = running, width
        self._by_start: dict[int, set[tuple[int, ...]]] = {}

    def computing(self, req: Request, start: int) -> bool:
        """Whether a running prefilling request's prompt holds `req`'s prompt tokens
        [start, start + width)."""
        end = start + self.width
        if end > req.num_prompt:
            return False
        windows = self._by_start.get(start)
        if windows is None:
            windows = self._by_start[start] = set()
            for other in self.running:
                self._collect(other, start, windows)
        return tuple(req.token_ids[start:end]) in windows

    def add(self, req: Request) -> None:
        """`req` joined the running requests."""
        for start, windows in self._by_start.items():
            self._collect(req, start, windows)

    def _collect(self, req: Request, start: int, windows: set[tuple[int, ...]]) -> None:
        if req.num_cached < req.num_prompt and start + self.width <= req.num_prompt:
            windows.add(tuple(req.token_ids[start : start + self.width]))


class Scheduler:
    def __init__(self, pages: PageTable, max_batch_size: int, chunk_tokens: int, lookahead: int = 2):
        """`lookahead`: positions past a request's tokens that a step may write before the
        next `schedule` (a draft token, a forward launched ahead); their pages are reserved."""
        self.pages = pages
        self.max_batch_size = max_batch_size
        self.chunk_tokens = chunk_tokens
        self.lookahead = lookahead
        self.waiting = WaitingRequests()
        self.running: list[Request] = []
        # Where decode rows did not all fit last step (prompts took their share), the first
        # that did not: it goes first this step.
        self._next_turn = 0
        # Per slot of a prefilling request, its (num_cached, end, mapped positions) after its
        # last fit: while those stay, fitting it again would change nothing (`_fit_running`).
        self._fitted: dict[int, tuple[int, int, int]] = {}

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, token_budget: int | None = None) -> list[tuple[Request, int]]:
        """Fit the running requests' pages, admit what fits, then return (request, tokens to
        run) for this step; prefill chunks stop at `chunk_tokens`, or at `token_budget` tokens
        for the whole step when smaller. A `token_budget` (the largest decode graph) also caps
        the decode rows: a request whose forced tokens would overflow it takes its turn first
        next step, so the step stays in the graphs instead of running eagerly."""
        self._fit_running()
        self._admit()
        budget = self.chunk_tokens if token_budget is None else min(self.chunk_tokens, token_budget)
        batch: list[tuple[Request, int]] = []
        decoding = [r for r in self.running if r.num_cached >= r.num_prompt]
        prefilling = [r for r in self.running if r.num_cached < r.num_prompt]
        # (the module docstring: decoding after the prompts older than its first token; a
        # preempted request recomputing its tokens has had its first token and holds nobody up)
        first_prompts = [r.arrival for r in prefilling if r.first_token_at is None]
        if first_prompts:
            oldest = min(first_prompts)
            decoding = [r for r in decoding if r.first_token_at is None or r.first_token_at < oldest]
        # Decode rows first (short, latency-critical), but where prompts wait they leave them a
        # share of the budget, taking turns for the rest, so a burst's prompts are not starved
        # by the requests already decoding; with no prompt waiting they take turns within the
        # step's token budget (forced tokens add rows).
        decode_budget = budget - int(budget * PROMPT_SHARE) if prefilling else token_budget
        start = self._next_turn % len(decoding) if decoding and decode_budget is not None else 0
        ran = 0
        for req in decoding[start:] + decoding[:start]:
            n = req.num_pending
            if decode_budget is not None and ran and n > decode_budget:
                break  # the rest take their turn first next step
            ran += 1
            if n > 0:
                batch.append((req, n))
                budget -= n
                if decode_budget is not None:
                    decode_budget -= n
        self._next_turn = start + ran if ran < len(decoding) else 0
        for req in prefilling:
            if budget <= 0 and batch:
                break
            n = min(req.num_pending, max(budget, 1))
            batch.append((req, n))
            budget -= n
        return batch

    def _fit_running(self) -> None:
        """Publish each running request's computed prompt pages to the prefix cache, give its
        page table its present length (a rollback lets go of pages, growth takes them), and
        preempt the newest requests where the pool has no page left."""
        pages, lookahead, settled = self.pages, self.lookahead, self.pages.settled
        for req in list(self.running):  # oldest first: the newest are preempted first
            if req.slot is None:  # preempted in this loop
                continue
            end = len(req.token_ids) + lookahead
            first, last = settled[req.slot]
            if first <= end <= last and req.num_cached >= req.num_prompt:
                continue  # nothing to publish, to give back or to take; a rollback stays in its output
            if self._fitted.get(req.slot) == (req.num_cached, end, pages.num_mapped(req.slot)):
                continue  # a prompt waiting for its turn, fitted already: no new page computed or needed
            pages.publish(req.slot, req.token_ids, req.num_cached, req.num_prompt)
            req.num_cached = pages.writable_from(req.slot, req.num_cached)
            pages.shrink(req.slot, end)
            while not pages.cover(req.slot, end):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
            if req.slot is not None and req.num_cached < req.num_prompt:
                self._fitted[req.slot] = (req.num_cached, end, pages.num_mapped(req.slot))

    def _admit(self) -> None:
        if not self.waiting or len(self.running) >= self.max_batch_size:
            return
        in_flight = PrefillingPrefixes(self.running, MIN_SHARED_PAGES * self.pages.page_size)
        order = self.waiting.admission_order(self.running)
        while len(self.running) < self.max_batch_size and (req := order.next()) is not None:
            if not self._place(req, in_flight):
                break
            self.waiting.remove(req)
            order.admitted(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            in_flight.add(req)

    def _place(self, req: Request, in_flight: PrefillingPrefixes) -> bool:
        """Give `req` a slot, the cached pages its prompt starts with and pages for the rest of
        its tokens; False (nothing taken) where the pool cannot hold them now."""
        pages = self.pages
        slot = pages.allocate_slot()
        if slot is None:
            return False
        self._fitted.pop(slot, None)  # (a slot another request had)
        cached = pages.match_prefix(slot, req.token_ids, len(req.token_ids))  # (a preempted one's output too)
        if self._prefix_in_flight(req, cached, in_flight):
            pages.release_slot(slot)  # (the cached pages it took go back with the slot)
            return False
        end = len(req.token_ids) + self.lookahead
        need = min(pages.pages_for(end), pages.max_pages_per_seq) - pages.pages_for(cached)
        if need > pages.free_pages:
            pages.release_slot(slot)
            return False
        pages.cover(slot, end)
        req.slot, req.num_cached = slot, cached
        if not req.stats.preemptions:
            req.stats.cached_prompt_tokens = min(cached, req.num_prompt)  # (forced tokens may follow the prompt)
        return True

    def _prefix_in_flight(self, req: Request, cached: int, in_flight: PrefillingPrefixes) -> bool:
        """Whether a running request is still prefilling at least MIN_SHARED_PAGES pages of
        the prompt `req` starts with (beyond the `cached` tokens it found): `req` then waits
        for them to be computed once and published, instead of computing them again beside
        it (agent turns sharing a tool catalogue arrive together)."""
        return self.pages.cache is not None and in_flight.computing(req, cached)

    def preempt(self, req: Request) -> None:
        """Free a running request's pages and queue it first, to be recomputed from its tokens."""
        self.running.remove(req)
        self._publish_all(req)
        self.pages.release_slot(req.slot)
        req.slot, req.num_cached, req.guess = None, 0, None
        req.status = RequestStatus.WAITING
        req.stats.preemptions += 1
        self.waiting.appendleft(req)

    def _publish_all(self, req: Request) -> None:
        """Put the full pages of every token of `req` whose K/V are computed, output included,
        into the prefix cache as it leaves its slot: a preempted request finds them when it
        comes back, and a chat's next turn (this turn's prompt, its answer, a new message)
        finds its history."""
        self.pages.publish(req.slot, req.token_ids, req.num_cached, req.num_cached)

    def peek(self) -> list[tuple[Request, int]] | None:
        """What `schedule` will return, where that is certain now: nobody is waiting to be
        admitted and nobody is prefilling. None otherwise."""
        if self.waiting or any(r.num_cached < r.num_prompt for r in self.running):
            return None
        return [(r, r.num_pending) for r in self.running if r.num_pending > 0]

    def remove(self, request: Request) -> None:
        """Free a finished/aborted request's pages; safe to call for waiting requests too.
        Its computed prompt pages stay in the prefix cache unless it failed."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.slot is not None:
            if request.finish_reason != "error":
                self._publish_all(request)
            self.pages.release_slot(request.slot)
            request.slot = None
