"""The admission order of waiting requests (engine/waiting.py): the heaps of one admission pass
pick exactly what the rule says, checked against the rule written out plainly on random queues
(clients, groups, preempted requests at the front, requests already running); and the queue's
own bookkeeping (counts by client, the request a full queue drops)."""

from __future__ import annotations

import random

import pytest

from structgen.engine.request import Request
from structgen.engine.waiting import WaitingRequests
from structgen.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=4)


def request(client: str | None, group: str | None) -> Request:
    return Request([1, 2, 3], PARAMS, group=group, client=client)


def by_the_rule(waiting: WaitingRequests, running: list[Request]) -> Request:
    """The client with the fewest running (ties: its next request the oldest), then its group
    with the fewest running (ties: the oldest head), that group's first request."""

    def next_of(client):
        groups = waiting.groups[client]
        return min(groups.values(), key=lambda q: (sum(r.client == client and r.group == q[0].group
                                                         for r in running), q[0].id))[0]

    client = min(waiting.groups, key=lambda c: (sum(r.client == c for r in running), next_of(c).id))
    return next_of(client)


@pytest.mark.parametrize("seed", range(40))
def test_a_pass_admits_in_the_rules_order(seed: int) -> None:
    rng = random.Random(seed)
    clients = [None, *(f"10.0.0.{i}" for i in range(rng.randint(1, 5)))]
    groups = [f"http-{i}" for i in range(rng.randint(1, 8))]
    waiting, running = WaitingRequests(), []
    for _ in range(rng.randint(1, 60)):
        r = request(rng.choice(clients), rng.choice(groups))
        if rng.random() < 0.2:
            running.append(r)
        elif rng.random() < 0.15:
            r.stats.preemptions = 1
            waiting.appendleft(r)
        else:
            waiting.append(r)
    order = waiting.admission_order(running)
    while waiting:
        expected = by_the_rule(waiting, running)
        got = order.next()
        assert got is expected
        waiting.remove(got)
        order.admitted(got)
        running.append(got)
    assert order.next() is None and not waiting.by_client and not waiting.groups


def test_counts_and_the_request_a_full_queue_drops() -> None:
    waiting = WaitingRequests()
    flood = [request("a", f"g{i}") for i in range(3)]
    other = request("b", "h")
    started = request("a", "g9")
    started.stats.preemptions = 1
    for r in (*flood, other):
        waiting.append(r)
    waiting.appendleft(started)
    assert waiting.by_client == {"a": 4, "b": 1} and len(waiting) == 5 and list(waiting)[0] is started
    assert waiting.newest_of_largest_client() is flood[-1]  # the newest never started of the largest
    waiting.remove(flood[-1])
    assert waiting.newest_of_largest_client() is flood[-2]
    for r in flood[:2]:
        waiting.remove(r)
    assert waiting.newest_of_largest_client() is None  # only a preempted one left: never dropped
    assert waiting.by_client == {"a": 1, "b": 1} and other in waiting and flood[0] not in waiting
