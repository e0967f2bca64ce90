"""Continuous batching: requests join when a KV slot is free and leave the moment they finish.

Each step every running request gets its pending tokens scheduled: decode requests one token
(or their forced jump-forward tokens), prefilling requests a chunk of their prompt from what
is left of the step's token budget, so a long prompt never stalls everyone else's decoding.

Admission is fair across request groups (`Request.group`, e.g. one per HTTP request): a free
slot goes to the oldest waiting request of the group with the fewest requests running, so one
caller's fan-out of thousands of generations cannot starve another's single request. Requests
that share a group (all in-process callers by default) are admitted first come, first served.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable

from structgen.engine.kv_cache import KVCache
from structgen.engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, kv_cache: KVCache, max_batch_size: int, chunk_tokens: int):
        self.kv = kv_cache
        self.max_batch_size = max_batch_size
        self.chunk_tokens = chunk_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # The waiting requests again, by group, each oldest first: admission looks at the
        # groups' heads only, not at every waiting request.
        self._waiting_by_group: dict[Hashable, deque[Request]] = {}

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self._waiting_by_group.setdefault(request.group, deque()).append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, token_budget: int | None = None) -> list[tuple[Request, int]]:
        """Admit what fits, then return (request, tokens to run) for this step; prefill chunks
        stop at `chunk_tokens`, or at `token_budget` tokens for the whole step when smaller."""
        while self.waiting and len(self.running) < self.max_batch_size:
            slot = self.kv.allocate()
            if slot is None:
                break
            req = self._next_waiting()
            req.slot, req.status = slot, RequestStatus.RUNNING
            self.running.append(req)
        budget = self.chunk_tokens if token_budget is None else min(self.chunk_tokens, token_budget)
        batch: list[tuple[Request, int]] = []
        decoding = [r for r in self.running if r.num_cached >= r.num_prompt]
        prefilling = [r for r in self.running if r.num_cached < r.num_prompt]
        for req in decoding:  # short, latency-critical work first
            n = req.num_pending
            if n > 0:
                batch.append((req, n))
                budget -= n
        for req in prefilling:
            if budget <= 0 and batch:
                break
            n = min(req.num_pending, max(budget, 1))
            batch.append((req, n))
            budget -= n
        return batch

    def _next_waiting(self) -> Request:
        """Remove and return the oldest waiting request of the group with the fewest running."""
        groups = self._waiting_by_group
        if len(groups) == 1:
            group = next(iter(groups))
        else:
            running = Counter(r.group for r in self.running)
            group = min(groups, key=lambda g: (running[g], groups[g][0].id))
        chosen = groups[group].popleft()
        if not groups[group]:
            del groups[group]
        self.waiting.remove(chosen)  # the oldest of its group: near the front
        return chosen

    def peek(self) -> list[tuple[Request, int]] | None:
        """What `schedule` will return, where that is certain now: nobody is waiting to be
        admitted and nobody is prefilling. None otherwise."""
        if self.waiting or any(r.num_cached < r.num_prompt for r in self.running):
            return None
        return [(r, r.num_pending) for r in self.running if r.num_pending > 0]

    def remove(self, request: Request) -> None:
        """Free a finished/aborted request's slot; safe to call for waiting requests too."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
            queue = self._waiting_by_group[request.group]
            queue.remove(request)
            if not queue:
                del self._waiting_by_group[request.group]
        if request.slot is not None:
            self.kv.release(request.slot)
            request.slot = None
