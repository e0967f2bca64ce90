"""The draft policy (speculative/policy.py): drafts only where the rows they add pay for
themselves against the plain step's measured cost, with exploration bounded, judged by step
costs of a realistic shape fed to it as a clock would."""

from __future__ import annotations

import random

from structgen.engine.speculative.policy import (
    ENTER_MARGIN,
    EXPLORE_TRIES,
    HOLD_STEPS,
    RETRY_STEPS,
    DraftPolicy,
    lower_bound,
    upper_bound,
)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Seconds of a plain step by row bucket: flat while the weights' read dominates, then
# proportional to rows (a 4-row step ~1.05x a 1-row step; a 64 x 4 step ~3x a 64-row step).
STEP = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2, 32: 1.4, 64: 1.8, 128: 3.0, 256: 5.4}
VERIFY = 1.02  # a verify step costs a little more than a plain step of its rows


def measured(plain: dict[int, float], verify: dict[int, float] | None = None) -> DraftPolicy:
    """A policy that has seen steps of these buckets take these seconds (each bucket's first,
    warm-up step is dropped, so every one is recorded twice)."""
    policy = DraftPolicy(BUCKETS)
    for table, drafts in ((plain, 0), (verify or {}, 1)):
        for rows, seconds in table.items():
            policy.record_step(rows, 100.0, drafts)  # the warm-up step: dropped
            policy.record_step(rows, seconds, drafts)
    return policy


class Simulation:
    """`batch` requests decoding on the clock of STEP: each step asks the policy for drafts,
    accepts each draft token with probability `accept` (a run ends at the first rejection),
    and reports the step's cost and verdicts back."""

    def __init__(self, policy: DraftPolicy, batch: int, accept: float, budget: int = 3):
        self.policy, self.batch, self.accept, self.budget = policy, batch, accept, budget
        policy.clock = lambda: self.seconds  # the simulated wall clock: steps take their cost
        self.rng = random.Random(0)
        self.hidden = 0.0  # wall seconds a drafting step adds that its timed step does not show
        self.shadow = False  # a request given no drafts has its unseen draft scored (the speculator's)
        self.seconds = self.tokens = 0.0
        self.kinds: list[str] = []  # each step's decision
        self.violations: list[int] = []  # steps that drafted to a bucket whose costs say it loses

    def step(self) -> list[int]:
        reqs = list(range(self.batch))
        before = self.policy.decisions.copy()
        rates = [self.policy.acceptance(r) for r in reqs]
        lengths = self.policy.draft_lengths(reqs, [self.budget] * self.batch, rows=self.batch)
        kind = next(iter((self.policy.decisions - before).elements()))
        self.kinds.append(kind)
        drafts = sum(lengths)
        bucket = self.policy.bucket(self.batch + drafts)
        cost = STEP[bucket] * (VERIFY if drafts else 1.0)
        if kind == "pays":  # expected tokens at the true cost beat the plain step's
            expected = self.batch + sum(a**j for a, k in zip(rates, lengths, strict=True) for j in range(1, k + 1))
            if expected / cost <= self.batch / STEP[self.policy.bucket(self.batch)]:
                self.violations.append(len(self.kinds))
        self.policy.record_step(self.batch + drafts, cost, drafts)
        for req, k in zip(reqs, lengths, strict=True):
            accepted = 0
            while accepted < (k or self.budget) and self.rng.random() < self.accept:
                accepted += 1
            if k:
                self.policy.record_verified(req, k, accepted)
                self.tokens += 1 + accepted
            else:
                if self.shadow:
                    self.policy.record_shadow(req, self.budget, accepted)
                self.tokens += 1
        self.seconds += cost + (self.hidden if drafts else 0.0)
        return lengths

    def run(self, steps: int) -> Simulation:
        for _ in range(steps):
            self.step()
        return self

    @property
    def speedup(self) -> float:
        """Tokens/s over plain decoding's at this batch."""
        return (self.tokens / self.seconds) / (self.batch / STEP[self.policy.bucket(self.batch)])


def test_batch_one_drafts_its_whole_budget_where_rows_are_nearly_free():
    sim = Simulation(DraftPolicy(BUCKETS), batch=1, accept=0.7).run(200)
    assert sim.kinds[:2] == ["untimed", "untimed"]  # the plain step is timed first
    assert sim.kinds[2] == "trial" and sim.kinds[-150:] == ["pays"] * 150
    assert sim.step() == [3]
    assert sim.speedup > 1.5 and not sim.violations


def test_batch_64_stops_drafting_within_a_few_steps_and_never_falls_below_plain():
    sim = Simulation(DraftPolicy(BUCKETS), batch=64, accept=0.6).run(400)
    drafting = [i for i, kind in enumerate(sim.kinds) if kind in ("pays", "trial")]
    assert "pays" not in sim.kinds and not sim.violations
    assert len([i for i in drafting if i < 20]) <= 2 * EXPLORE_TRIES  # each verify bucket measured
    assert len([i for i in drafting if i >= 20]) <= 4  # then only rare retries
    assert sim.speedup > 0.97


def test_drafting_stops_where_its_realized_rate_loses_though_its_timed_steps_say_it_pays():
    # accepted 9 in 10: the timed verify step pays at batch 64, but each drafting step also
    # costs the loop host work no step timing sees, which makes it a loss in wall time
    sim = Simulation(DraftPolicy(BUCKETS), batch=64, accept=0.9)
    sim.hidden = 1.5
    sim.run(600)
    assert sim.speedup > 0.95
    drafting = [i for i, kind in enumerate(sim.kinds) if kind in ("pays", "trial")]
    assert len(drafting) < 60  # measured, stopped, retried ever more rarely
    assert sim.policy.blocks[64] >= 1
    # at batch 1 the same host work is small beside what drafting earns: it goes on
    one = Simulation(DraftPolicy(BUCKETS), batch=1, accept=0.9)
    one.hidden = 0.1
    one.run(200)
    assert one.kinds[-100:] == ["pays"] * 100 and one.speedup > 1.5


def test_one_stalled_verify_step_does_not_turn_batch_one_away_from_its_whole_budget():
    """A step the host stalled in (a garbage collection, the process descheduled) takes 20x its
    cost. Priced into the verify bucket that drafts the whole budget, it must not make the
    policy settle for a smaller bucket: that one pays too, so the big bucket would never be
    measured again (on an H200 a run drafted one token on 141 of 648 steps this way, 1.57x
    against 1.99x for drafting every token)."""
    sim = Simulation(DraftPolicy(BUCKETS), batch=1, accept=0.7).run(100)
    sim.policy.record_step(4, 20 * STEP[4] * VERIFY, drafts=3)
    lengths = [sim.step() for _ in range(300)]
    assert lengths.count([3]) == 300 and sim.speedup > 2.2


def test_a_bucket_measured_while_the_host_was_slow_is_measured_again_and_taken():
    """Bucket 4 (three drafts) was measured at 3x its cost for a whole window of steps; one
    draft in bucket 2 pays, so bucket 4 would not be chosen again. It is retried RETRY_STEPS
    decisions on, measured afresh, and drafts the whole budget from then on."""
    policy = measured({1: 1.0, 2: STEP[2]}, {2: STEP[2] * VERIFY})
    for _ in range(8):
        policy.record_step(4, 3 * STEP[4] * VERIFY, drafts=3)
    sim = Simulation(policy, batch=1, accept=0.7)
    lengths = [sim.step() for _ in range(2 * RETRY_STEPS)]
    assert lengths[:RETRY_STEPS - HOLD_STEPS] == [[1]] * (RETRY_STEPS - HOLD_STEPS)  # bucket 4 priced at 3x
    assert sim.kinds.count("trial") == 1
    assert lengths[-RETRY_STEPS // 2:] == [[3]] * (RETRY_STEPS // 2)


def test_a_request_that_stopped_drafting_resumes_when_its_unseen_drafts_would_be_accepted():
    """An extraction writes text its prompt does not hold (drafts rejected: drafting stops),
    then copies a span (drafts would be accepted). Drafts scored unseen on its plain steps
    bring drafting back within a few steps; without them the rate that stopped it stays."""
    ends = {}
    for shadow in (False, True):
        sim = Simulation(DraftPolicy(BUCKETS), batch=1, accept=0.9)
        sim.shadow = shadow
        for accept, steps in ((0.9, 40), (0.0, 20), (0.9, 60)):
            sim.accept = accept
            sim.run(steps)
        ends[shadow] = sim.kinds[-60:]
        assert "plain" in sim.kinds[-70:-60]  # the rejected stretch stopped drafting
    assert ends[False] == ["plain"] * 60  # stuck: no draft, no news
    assert ends[True][5:] == ["pays"] * 55


def test_a_choice_of_every_draft_stands_without_changing_any_decision(monkeypatch):
    """Where drafting every token pays by far, that choice stands a few decisions (no weighing
    on the path to the next launch) while acceptance holds: over stretches of high and zero
    acceptance the decisions are the ones weighing every step makes, also where a few
    rejections change them (a verify step priced at twice a plain one), and at batch 1 with
    drafts mostly accepted most steps are not weighed."""
    import structgen.engine.speculative.policy as policy_module

    def run(verify_cost: float) -> Simulation:
        monkeypatch.setitem(STEP, 4, verify_cost)
        sim = Simulation(DraftPolicy(BUCKETS), batch=1, accept=0.9)
        sim.shadow = True
        for accept, steps in ((0.9, 60), (0.0, 30), (0.95, 60), (0.5, 40)):
            sim.accept = accept
            sim.run(steps)
        return sim

    cheap, costly = run(1.05), run(2.0)
    monkeypatch.setattr(policy_module, "HOLD_MARGIN", float("inf"))  # no choice of drafts stands
    assert costly.kinds == run(2.0).kinds
    assert "plain" in costly.kinds[60:90] and costly.kinds[-30:].count("pays") > 10
    every_step = run(1.05)
    assert cheap.kinds == every_step.kinds
    assert cheap.policy.weighed < every_step.policy.weighed / 2


def test_a_lone_request_drafting_everything_is_weighed_once_a_hold_through_its_rejections(monkeypatch):
    """At batch 1 with 3 drafts in 10 rejected, a rejection lowers the request's rate a little
    and every draft still pays by far: the choice stands through it (weighing costs about 90 us
    on the path to the next launch), so about one decision in LONE_HOLD_STEPS is weighed, and
    every decision is the one weighing would have made."""
    import structgen.engine.speculative.policy as policy_module

    sim = Simulation(DraftPolicy(BUCKETS), batch=1, accept=0.7).run(400)
    assert sim.policy.weighed <= 400 // policy_module.LONE_HOLD_STEPS + 8
    monkeypatch.setattr(policy_module, "HOLD_MARGIN", float("inf"))  # no choice of drafts stands
    every_step = Simulation(DraftPolicy(BUCKETS), batch=1, accept=0.7).run(400)
    assert every_step.policy.weighed == 400 and sim.kinds == every_step.kinds


def test_a_plain_step_timed_slower_than_a_larger_ones_is_priced_at_the_larger_cost():
    # 32 requests, one draft each: 48 tokens expected from a 64-row verify step of 2.6 s. Against
    # a 32-row plain step timed at 3.0 s drafting pays; but a 64-row plain step took 1.8 s, so
    # the 32-row one costs at most that, and drafting loses (48 / 2.6 < 32 / 1.8 * 1.1).
    reqs, budgets = list(range(32)), [1] * 32
    alone = measured({32: 3.0}, {64: 2.6})
    assert sum(alone.draft_lengths(reqs, budgets, rows=32)) == 32
    bounded = measured({32: 3.0, 64: 1.8}, {64: 2.6})
    assert sum(bounded.draft_lengths(reqs, budgets, rows=32)) == 0
    assert bounded.decisions["plain"] == 1


def test_batch_64_resumes_drafting_when_acceptance_rises():
    sim = Simulation(DraftPolicy(BUCKETS), batch=64, accept=0.6).run(100)
    assert sim.step() == [0] * 64
    sim.accept = 1.0
    for _ in range(10):  # drafts now always accepted (seen on other steps)
        for req in range(64):
            sim.policy.record_verified(req, 3, 3)
    assert sim.step() == [3] * 64 and sim.kinds[-1] == "pays"  # 4 tokens for ~3x the cost
    sim.run(50)
    assert sim.kinds[-50:] == ["pays"] * 50 and not sim.violations


def test_a_choice_of_no_drafts_stands_for_its_plain_bucket_until_acceptance_news():
    """Held steps weigh nobody's drafts, whatever the batch within the bucket (fewer requests,
    smaller budgets); another bucket is weighed, and acceptance news ends the hold."""
    sim = Simulation(DraftPolicy(BUCKETS), batch=64, accept=0.6).run(30)
    policy = sim.policy
    assert list(policy.held) == [64] and policy.held[64] > policy.steps
    weighed = policy.weighed
    assert policy.draft_lengths(list(range(40)), [1] * 40, rows=40) == [0] * 40  # bucket 64: held
    assert policy.weighed == weighed
    assert policy.draft_lengths(list(range(32)), [3] * 32, rows=32) == [0] * 32  # bucket 32: weighed
    assert policy.weighed == weighed + 1
    policy.record_verified(0, 3, 3)
    assert not policy.held


def test_batch_16_drafts_where_its_measured_cost_pays():
    sim = Simulation(DraftPolicy(BUCKETS), batch=16, accept=0.8).run(200)
    assert sim.kinds[-100:] == ["pays"] * 100 and not sim.violations
    assert sim.speedup > 1.5


def test_a_verify_bucket_measured_as_a_loss_is_drafted_to_only_on_rare_retries():
    """At batch 64 (acceptance 0.5) bucket 128 emits 96 tokens for 2.0 and bucket 256 112 for
    3.0, against 64 for 1.0 without drafts: both lose. Bucket 128 is retried once RETRY_STEPS
    decisions have passed (bucket 256 never: even at bucket 128's slope it would lose), then
    only after twice as long."""
    policy = measured({64: 1.0}, {128: 2.0, 256: 3.0})
    reqs, tried = list(range(64)), []
    for step in range(4 * RETRY_STEPS + HOLD_STEPS):
        if sum(policy.draft_lengths(reqs, [3] * 64, rows=64)):
            tried.append(step)
    assert policy.decisions["pays"] == 0 and len(tried) == 2
    assert RETRY_STEPS <= tried[0] <= RETRY_STEPS + HOLD_STEPS
    assert tried[1] - tried[0] >= 2 * RETRY_STEPS


def test_a_step_of_a_size_not_timed_yet_runs_without_drafts_first():
    policy = DraftPolicy(BUCKETS)
    assert policy.draft_lengths(["r"], [3], rows=1) == [0]
    policy.record_step(1, 100.0)  # warm-up: dropped
    assert policy.draft_lengths(["r"], [3], rows=1) == [0]
    policy.record_step(1, 1.0)
    assert policy.draft_lengths(["r"], [3], rows=1) == [3]  # a trial: bucket 4 is not measured
    assert policy.decisions == {"untimed": 2, "trial": 1}


def test_drafting_starts_past_a_margin_and_stops_only_below_a_smaller_one():
    """At batch 16 (the prior acceptance, 0.5), 48 drafts emit 30 tokens for the verify
    bucket 64's cost; a plain step emits 16 for 1.0 (and 16 drafts lose in bucket 32)."""
    reqs = list(range(16))

    def drafts(verify_64: float, policy: DraftPolicy | None = None) -> int:
        policy = policy or measured({16: 1.0})
        policy.verify.seconds.update({32: 10.0, 64: verify_64})
        return sum(policy.draft_lengths(reqs, [3] * 16, rows=16))

    between = 30 / (16 * (1 + ENTER_MARGIN / 2))  # beats plain by half the entry margin
    assert drafts(between) == 0
    started = measured({16: 1.0})
    assert drafts(30 / (16 * 1.2), started) == 48
    assert drafts(between, started) == 48  # already drafting: kept
    assert drafts(30 / 16, started) == 0  # no gain: stopped


def test_drafts_of_requests_that_are_rarely_accepted_go_first():
    policy = measured({2: 1.25}, {4: 1.5, 8: 2.0})
    for _ in range(20):
        policy.record_verified("copying", 3, 3)
        policy.record_verified("guessing", 3, 0)
    assert policy.acceptance("copying") > 0.9 and policy.acceptance("guessing") < 0.1
    assert policy.draft_lengths(["copying", "guessing"], [3, 3], rows=2) == [2, 0]


def test_draft_tokens_asked_for_and_not_produced_count_as_rejected():
    """The drafter found one token where the policy asked for three: the step emitted two
    tokens for four rows, not the whole run a fully accepted one-token draft would suggest."""
    rates = []
    for produced in (3, 1):
        policy = measured({1: 1.0}, {4: 1.05})
        assert policy.draft_lengths(["r"], [3], rows=1) == [3]
        policy.record_verified("r", produced, produced)
        rates.append(policy.acceptance("r"))
    assert rates[1] < 0.7 * rates[0]


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


def test_unmeasured_buckets_are_priced_high_for_drafting_and_low_for_trying():
    points = {16: 1.2, 64: 1.8}
    assert upper_bound(points, 32) == 1.8  # the next measured bucket up
    assert upper_bound(points, 256) == 1.8 * 4  # proportional: above the slope's 1.8 + 0.6
    assert upper_bound({64: 1.0, 128: 3.0}, 256) == 7.0  # the slope: above proportional's 6.0
    assert lower_bound(points, 32) == 1.2  # the next measured bucket down
    assert lower_bound(points, 256) == 1.8 + 0.6 / 48 * 192  # extended by the slope
    assert DraftPolicy().bucket(33) == 64  # no graphs: powers of two
