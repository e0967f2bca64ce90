"""The requests waiting for a KV slot, and the order in which they get one.

Admission is fair across clients (`Request.client`, the server's client address), then across
one client's request groups (`Request.group`, one per HTTP request): a free place goes to the
client with the fewest requests running, and of its groups to the one with the fewest running,
its oldest request first; ties go to the client whose next request is the oldest. So one
client's flood of requests, or one request's fan-out of thousands of generations, cannot starve
another's single request. Requests that share a group and client (all in-process callers by
default) are admitted first come, first served.

A burst of a thousand requests is admitted in one pass, so the pass keeps a heap of each
client's groups and one of the clients (`AdmissionOrder`): a request costs a few heap
operations, not a comparison of every group (docs/performance.md, "Fair shares between
clients").
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Hashable, Iterator

from structgen.engine.request import Request


class WaitingRequests:
    """The waiting requests in queue order (preempted ones first), and by client and group,
    each group oldest first (`groups`); `by_client` counts them (read off the loop thread by
    loop.py: an estimate there)."""

    def __init__(self) -> None:
        self.queue: deque[Request] = deque()
        self.groups: dict[Hashable, dict[Hashable, deque[Request]]] = {}
        self.by_client: Counter[Hashable] = Counter()

    def __len__(self) -> int:
        return len(self.queue)

    def __bool__(self) -> bool:
        return bool(self.queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.queue)

    def __contains__(self, request: object) -> bool:
        return request in self.queue

    def append(self, request: Request) -> None:
        self.queue.append(request)
        self._group(request).append(request)
        self.by_client[request.client] += 1

    def appendleft(self, request: Request) -> None:
        """A preempted request: first in the queue and in its group."""
        self.queue.appendleft(request)
        self._group(request).appendleft(request)
        self.by_client[request.client] += 1

    def remove(self, request: Request) -> None:
        self.queue.remove(request)
        groups = self.groups[request.client]
        group = groups[request.group]
        group.remove(request)
        if not group:
            del groups[request.group]
            if not groups:
                del self.groups[request.client]
        self.by_client[request.client] -= 1
        if not self.by_client[request.client]:
            del self.by_client[request.client]

    def newest_of_largest_client(self) -> Request | None:
        """The newest waiting request, never started, of the client with the most requests
        waiting: the one a full queue drops to make room for another client (loop.py)."""
        if not self.by_client:
            return None
        client = max(self.by_client, key=self.by_client.__getitem__)
        fresh = [group[-1] for group in self.groups[client].values() if not group[-1].stats.preemptions]
        return max(fresh, key=lambda r: r.id, default=None)

    def admission_order(self, running: list[Request]) -> AdmissionOrder:
        return AdmissionOrder(self, running)

    def _group(self, request: Request) -> deque[Request]:
        return self.groups.setdefault(request.client, {}).setdefault(request.group, deque())


class AdmissionOrder:
    """One admission pass: `next()` is the request the module docstring's rule admits next,
    `admitted(request)` records that it joined the running ones (and left the waiting ones).

    Heap entries are (running, head request id, key): an entry is stale once its group's or
    client's running count or head changed, and is then replaced where it surfaces."""

    def __init__(self, waiting: WaitingRequests, running: list[Request]):
        self.waiting = waiting
        self.client_running: Counter[Hashable] = Counter(r.client for r in running)
        self.group_running: Counter[tuple[Hashable, Hashable]] = Counter((r.client, r.group) for r in running)
        self.group_heaps: dict[Hashable, list[tuple[int, int, Hashable]]] = {}
        for client, groups in waiting.groups.items():
            heap = [(self.group_running[client, g], queue[0].id, g) for g, queue in groups.items()]
            heapq.heapify(heap)
            self.group_heaps[client] = heap
        self.client_heap = [(self.client_running[c], heap[0][1], c) for c, heap in self.group_heaps.items()]
        heapq.heapify(self.client_heap)

    def next(self) -> Request | None:
        heap = self.client_heap
        while heap:
            running, head, client = heap[0]
            top = self._group_top(client)
            if top is not None and (running, head) == (self.client_running[client], top[1]):
                return self.waiting.groups[client][top[2]][0]
            heapq.heappop(heap)
            if top is not None:
                heapq.heappush(heap, (self.client_running[client], top[1], client))
        return None

    def admitted(self, request: Request) -> None:
        self.client_running[request.client] += 1
        self.group_running[request.client, request.group] += 1

    def _group_top(self, client: Hashable) -> tuple[int, int, Hashable] | None:
        """The current entry of `client`'s next group, stale ones replaced; None where none waits."""
        heap = self.group_heaps.get(client, [])
        groups = self.waiting.groups.get(client, {})
        while heap:
            running, head, group = heap[0]
            queue = groups.get(group)
            if queue and (running, head) == (self.group_running[client, group], queue[0].id):
                return heap[0]
            heapq.heappop(heap)
            if queue:
                heapq.heappush(heap, (self.group_running[client, group], queue[0].id, group))
        return None
