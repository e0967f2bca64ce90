"""The draft policy (speculative/policy.py): drafts only where the rows they add pay for
themselves, judged by measured step costs and each request's acceptance rate."""

from __future__ import annotations

from structgen.engine.speculative.policy import DraftPolicy

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def measured(costs: dict[int, float]) -> DraftPolicy:
    """A policy that has seen steps of these buckets take these seconds (each bucket's first,
    warm-up step is dropped, so every one is recorded twice)."""
    policy = DraftPolicy(BUCKETS)
    for rows, seconds in costs.items():
        policy.record_step(rows, 100.0)  # the warm-up step: dropped
        policy.record_step(rows, seconds)
    return policy


def test_batch_one_drafts_its_whole_budget_where_rows_are_nearly_free():
    policy = measured({1: 1.0, 2: 1.01, 4: 1.03, 64: 1.5})
    assert policy.draft_lengths(["r"], [3], rows=1) == [3]
    assert policy.draft_lengths(["r", "prefill"], [3, 0], rows=40) == [3, 0]  # a prompt chunk rides along


def test_a_step_of_a_size_not_timed_yet_runs_without_drafts_first():
    policy = DraftPolicy(BUCKETS)
    assert policy.draft_lengths(["r"], [3], rows=1) == [0]
    policy.record_step(1, 100.0)  # warm-up: dropped
    assert policy.draft_lengths(["r"], [3], rows=1) == [0]
    policy.record_step(1, 1.0)
    assert policy.draft_lengths(["r"], [3], rows=1) == [3]  # bucket 4 priced from bucket 1


def test_a_large_batch_stops_drafting_where_its_rows_cost_what_they_emit():
    reqs = list(range(64))
    costly = measured({64: 1.0, 128: 2.0, 256: 4.0})  # a step's cost follows its rows
    assert costly.draft_lengths(reqs, [3] * 64, rows=64) == [0] * 64
    cheap = measured({64: 1.0, 128: 1.05, 256: 1.1})  # still reading the weights once
    assert cheap.draft_lengths(reqs, [3] * 64, rows=64) == [3] * 64


def test_drafts_of_requests_that_are_rarely_accepted_go_first():
    policy = measured({2: 1.25, 4: 1.5, 8: 2.0})
    for _ in range(20):
        policy.record_verified("copying", 3, 3)
        policy.record_verified("guessing", 3, 0)
    assert policy.acceptance("copying") > 0.9 and policy.acceptance("guessing") < 0.1
    assert policy.draft_lengths(["copying", "guessing"], [3, 3], rows=2) == [2, 0]


def test_a_new_request_starts_from_the_engine_wide_acceptance_and_forgets_old_steps():
    policy = DraftPolicy(BUCKETS)
    start = policy.acceptance("new")
    for _ in range(10):
        policy.record_verified("old", 3, 0)
    assert policy.acceptance("new") < start  # the engine-wide rate fell
    for _ in range(10):
        policy.record_verified("old", 3, 3)
    assert policy.acceptance("old") > 0.8  # recent steps outweigh the early rejections
    policy.release("old")
    assert "old" not in policy.requests


def test_unmeasured_buckets_are_priced_from_the_nearest_measured_one():
    policy = measured({4: 2.0})
    assert policy.cost(3) == 2.0  # bucket 4
    assert 2.0 < policy.cost(8) < policy.cost(64)
    assert DraftPolicy().bucket(33) == 64  # no graphs: powers of two
