"""How many tokens each request drafts this step: only as many as pay for the rows they add,
judged against what the same step costs without drafts, as measured.

A verify step emits, for a request whose drafts are each accepted with probability a (given the
ones before), 1 + a + a^2 + ... + a^k tokens for k drafted: its j-th draft token is worth a^j
tokens. It also runs k more rows, and what a row costs depends on the step: at batch 1 a decode
step reads the weights once whatever its row count, so drafts are nearly free; at batch 64 a
step of 64 x (1 + k) rows can cost several plain steps, and the drafts lose (docs/performance.md,
"Speculative decoding"). Steps run in row buckets (the decode graphs' batch sizes, or powers of
two), so per step the policy ranks every request's draft tokens by worth and, for each verify
bucket the step could run in, fills it with the best ones. Speculation must be safe by
construction, so:

- Two cost tables, by bucket: `plain` (steps without drafts: what not drafting costs) and
  `verify` (steps with drafts). Each is the median of a bucket's newest measured wall times, its
  first step dropped as warm-up: one stalled step (a garbage collection, the host descheduled)
  priced into the best bucket would otherwise turn the policy away from it for good, since a
  bucket not chosen is not measured again. Until the plain step of this step's bucket is
  measured, nobody drafts; a plain step is priced at no more than any larger bucket's (more
  rows never cost less).
- A verify bucket pays when its expected tokens per second beat the plain step's measured rate
  by `ENTER_MARGIN`; once drafting at a plain bucket, by `STAY_MARGIN` (hysteresis, so it does
  not flap). A verify bucket not measured yet is priced pessimistically: as the next measured
  bucket above it, and above them all by the larger of proportional scaling and the slope of
  the two largest; plain steps count at `VERIFY_OVERHEAD` times their cost.
- Where nothing pays, a verify bucket may be *tried*: drafted to so that it gets measured, if
  it could pay at the cheapest cost its neighbours allow (the largest measured bucket below it,
  extended by the slope of the two largest). An unmeasured bucket is tried at most
  `EXPLORE_TRIES` steps; after that, and for a bucket measured as a loss, a try comes only
  `RETRY_STEPS` decisions later, the wait doubling with every try. Where drafting pays, a
  measured bucket that would beat the chosen one at that cheapest cost is retried the same
  way: its measurement may be stale (taken while the host was slow), and a retry measures it
  afresh.

Step costs are what the policy can time, and a model of what drafting earns; neither sees all
that a verify step adds to the engine's loop. So the policy also keeps, per plain bucket, the
*realized* rate of each mode: tokens a step emitted over the wall time from its decision to the
next decision (`RealizedRate`). Where drafting's realized rate, over `REALIZED_STEPS` steps or
more, does not beat plain steps' (realized, or until that is known, from their timed cost),
drafting stops at that bucket whatever the model says, and is measured again only
`RETRY_STEPS` decisions later, the wait doubling each time. The rates are compared every
`REALIZED_CHECK` weighed decisions: at batch 1 a decision is on the path from one step's tokens
to the next step's launch (speculator.py `_plan_next`), where every microsecond idles the device.

A choice of no drafts stands `HOLD_STEPS` decisions at its plain bucket (each bucket's choice
its own) unless acceptance or verify costs change, so a batch where nothing pays spends little
host time here: a held step weighs no drafts, whatever its requests (the batch shrinking, forced
text moving it between buckets, budgets running out), and the speculator then asks the drafter
about nobody. For the same reason a choice of every draft token that paid by `HOLD_MARGIN`
stands `HOLD_STEPS` decisions for steps of the same budgets while no request's acceptance
falls below the lowest it was weighed at (`FullHold`); where one request drafts, below the
lowest rate at which weighing, on the costs of the moment, would still give it every draft
token, and for `LONE_HOLD_STEPS` decisions: drafting at batch 1 then costs a few lookups a
step, also through the rejections that lower its rate a little (weighing is on the path from
one step's tokens to the next step's launch, and cost about 90 us there). Each request's
acceptance rate is a decayed count of its accepted and rejected drafts, starting from the
engine-wide one; a draft token the policy asked for and the drafter did not produce counts as
rejected, since the rows it was priced for emit nothing. A request that stopped drafting would
keep the rate that stopped it for good (text a prompt does not hold, then a long copied span,
is the usual shape of an extraction), so the speculator drafts for it unseen while it runs
plain steps and checks the draft against the tokens it emits (`record_shadow`). `decisions`
counts the steps by what was chosen (benchmarks print it).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

DECAY = 0.8  # weight of past verify steps in an acceptance rate, per step
COST_WINDOW = 8  # a bucket's cost: the median of its newest steps
PRIOR = (1.0, 1.0)  # (accepted, rejected) pseudo-counts a new engine starts from: a = 0.5
ENTER_MARGIN = 0.10  # drafting starts where it beats plain steps' tokens/s by this fraction
STAY_MARGIN = 0.02  # and goes on while it still beats them by this fraction
EXPLORE_TRIES = 3  # steps an unmeasured verify bucket is drafted to (the first is a warm-up)
RETRY_STEPS = 64  # decisions before a verify bucket that lost is tried again
VERIFY_OVERHEAD = 1.25  # a verify step priced from plain steps of its rows costs this much more
HOLD_STEPS = 8  # decisions a choice of no drafts stands for steps of its plain bucket, unless news comes
HOLD_MARGIN = 0.25  # a choice of every draft token stands where it beat plain steps by this fraction
LONE_HOLD_STEPS = 32  # decisions such a choice stands for one request, its floor exact (costs are kept)
FLOOR_HALVINGS = 10  # bisection steps of the lowest rate a lone request's choice of every draft holds at
REALIZED_STEPS = 8  # steps of each mode at a bucket before their realized rates are compared
REALIZED_CHECK = 4  # weighed decisions between two comparisons of realized rates (a window's median)
REALIZED_WINDOW = 32  # the newest steps a realized rate is taken over
OUTLIER = 3.0  # a step interval this many times above or below the window's median is left out


@dataclass
class Acceptance:
    """Decayed counts of drafts accepted and of verify steps that rejected one."""

    accepted: float
    rejected: float

    @property
    def rate(self) -> float:
        """The chance a draft token is accepted, given the ones before it were."""
        return self.accepted / (self.accepted + self.rejected)

    def update(self, drafted: int, accepted: int) -> None:
        """One verify step: `accepted` of `drafted` drafts kept (a rejection ends the run)."""
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (accepted < drafted)


@dataclass
class StepCosts:
    """Wall time of steps by row bucket: the median of each bucket's newest COST_WINDOW steps
    (`seconds`); each bucket's first step is dropped (it compiles and warms up)."""

    seconds: dict[int, float] = field(default_factory=dict)
    warmed: set[int] = field(default_factory=set)
    recent: dict[int, deque[float]] = field(default_factory=dict)
    stale: set[int] = field(default_factory=set)  # buckets whose next step replaces their window

    def record(self, bucket: int, seconds: float) -> None:
        if bucket not in self.warmed:
            self.warmed.add(bucket)
            return
        window = self.recent.get(bucket)
        if window is None:
            window = self.recent[bucket] = deque(maxlen=COST_WINDOW)
        if bucket in self.stale:
            self.stale.discard(bucket)
            window.clear()
        window.append(seconds)
        self.seconds[bucket] = statistics.median(window)

    def remeasure(self, bucket: int) -> None:
        """`bucket`'s next step replaces its measurements (its cost stands until then)."""
        self.stale.add(bucket)


def upper_bound(points: dict[int, float], bucket: int) -> float:
    """What a step of `bucket` rows costs at most, given measured `points` (non-empty) and
    that more rows never cost less: the next measured bucket up; above them all, the larger of
    proportional scaling and the slope of the two largest."""
    if bucket in points:
        return points[bucket]
    above = [b for b in points if b > bucket]
    if above:
        return points[min(above)]
    ordered = sorted(points)
    top = ordered[-1]
    cost = points[top] * bucket / top
    if len(ordered) > 1:
        prev = ordered[-2]
        cost = max(cost, points[top] + (points[top] - points[prev]) / (top - prev) * (bucket - top))
    return cost


def best_option(tokens: list[float], options: list[tuple[int, int]], costs: list[float]) -> tuple[tuple[int, int], float]:
    """The (verify bucket, drafts) of `options` that emits the most tokens per second, the first
    of equals, and that rate; `tokens[d]`: tokens expected with d drafts, `costs`: each
    option's seconds. `choose` and a full hold's floor weigh by it alike."""
    rates = [tokens[drafts] / cost for (_, drafts), cost in zip(options, costs, strict=True)]
    best = max(range(len(options)), key=rates.__getitem__)
    return options[best], rates[best]


def lower_bound(points: dict[int, float], bucket: int) -> float:
    """What a step of `bucket` rows costs at least, given measured `points` (non-empty), that
    more rows never cost less, and that a row never costs less than the rows before it: the
    largest measured bucket below, extended by the slope of the two largest below."""
    below = sorted(b for b in points if b <= bucket)
    if not below:  # nothing measured below: the nearest measured bucket
        return points[min(points)]
    top = below[-1]
    if len(below) == 1 or top == bucket:
        return points[top]
    prev = below[-2]
    slope = max(0.0, (points[top] - points[prev]) / (top - prev))
    return points[top] + slope * (bucket - top)


@dataclass
class RealizedRate:
    """Tokens emitted over wall seconds of a mode's newest steps at one plain bucket, each step
    from its decision to the next; intervals far from the median (a kernel's first compile, the
    engine idling between requests; a decision taken again for a step whose plan was dropped)
    are left out."""

    steps: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=REALIZED_WINDOW))

    def add(self, tokens: float, seconds: float) -> None:
        self.steps.append((tokens, seconds))

    @property
    def rate(self) -> float:
        median = statistics.median(s for _, s in self.steps)
        kept = [(t, s) for t, s in self.steps if median / OUTLIER <= s <= median * OUTLIER]
        return sum(t for t, _ in kept) / max(sum(s for _, s in kept), 1e-12)


@dataclass
class OpenStep:
    """The step decided last, until the next decision closes it: its plain bucket, whether it
    drafted, the tokens it emitted so far (sampled, then accepted drafts) and when it began."""

    bucket: int
    drafted: bool
    tokens: float
    started: float


@dataclass(frozen=True)
class Choice:
    """One step's decision: `drafts` tokens in all, and `kind`: untimed (the plain bucket is
    not measured yet), plain, pays (by measured or pessimistic costs) or trial (drafted to
    measure a verify bucket); `wide`: it pays by HOLD_MARGIN or more."""

    drafts: int
    kind: str
    wide: bool = False


@dataclass(frozen=True)
class FullHold:
    """A choice of every draft token that stands at its plain bucket until decision `until`,
    for steps with these `budgets` whose requests' acceptance rates are all `floor` or more."""

    until: int
    budgets: tuple[int, ...]
    floor: float


class DraftPolicy:
    """Per step, the draft length of every request (`draft_lengths`), from its acceptance rate
    (`record_verified`) and the measured cost of steps with and without drafts by row bucket
    (`record_step`)."""

    def __init__(self, buckets: tuple[int, ...] = (), clock: Callable[[], float] = time.perf_counter):
        self.buckets = tuple(sorted(buckets))  # the decode graphs' row counts, if any
        self.clock = clock
        self.realized: dict[tuple[int, bool], RealizedRate] = {}  # (plain bucket, drafted) -> rate
        self.open: OpenStep | None = None
        self.blocked_until: dict[int, int] = {}  # plain bucket -> the decision drafting may resume
        self.blocks: Counter[int] = Counter()  # plain bucket -> times drafting was stopped there
        self.engine_wide = Acceptance(*PRIOR)
        self.requests: dict[object, Acceptance] = {}
        self.plain = StepCosts()  # steps without drafts
        self.verify = StepCosts()  # steps with drafts
        self.drafting: dict[int, bool] = {}  # plain bucket -> whether its last decision drafted
        self.tries: Counter[int] = Counter()  # verify bucket -> steps drafted to it on trial
        self.retry_at: dict[int, int] = {}  # verify bucket -> the decision it may be tried again
        self.decisions: Counter[str] = Counter()  # Choice.kind -> steps
        self.weighed = 0  # decisions that weighed every request's drafts (not held)
        self.shadowed = 0  # unseen drafts scored (`record_shadow`)
        self.steps = 0  # decisions made: the clock of retries
        # plain bucket -> the decision its choice of no drafts stands until; emptied by any news
        # on acceptance or verify costs
        self.held: dict[int, int] = {}
        self.full_held: dict[int, FullHold] = {}  # plain bucket -> a standing choice of every draft
        self.asked: dict[object, int] = {}  # request -> draft tokens the last decision gave it

    def bucket(self, rows: int) -> int:
        """The row count a step of `rows` rows runs as: its decode-graph bucket, else the next
        power of two."""
        i = bisect.bisect_left(self.buckets, rows)
        if i < len(self.buckets):
            return self.buckets[i]
        return 1 << max(0, rows - 1).bit_length()

    def acceptance(self, req: object) -> float:
        known = self.requests.get(req)
        return (known or self.engine_wide).rate

    @property
    def chose_drafts(self) -> bool:
        """Whether the last decision gave anyone drafts (whether the drafter produced them
        or not)."""
        return self.open is not None and self.open.drafted

    def draft_lengths(self, reqs: list[object], budgets: list[int], rows: int) -> list[int]:
        """How many tokens each of `reqs` drafts, at most its budget (0: it does not sample
        this step); `rows`: the step's rows without drafts. A choice of no drafts stands
        HOLD_STEPS steps at its plain bucket until news on acceptance or verify costs comes
        (`holds`), which saves weighing every draft at a batch where none pays."""
        lengths = [0] * len(reqs)
        self.asked = {}
        plain_bucket, sampling = self.bucket(rows), sum(k > 0 for k in budgets)
        now = self.clock()
        self._close_step(now)
        if not sampling:
            return lengths
        self.open = OpenStep(plain_bucket, False, float(sampling), now)
        if self.holds(rows):
            self.steps += 1
            self.decisions["plain"] += 1
            return lengths
        if self._holds_full(plain_bucket, reqs, budgets):
            self.steps += 1
            self.decisions["pays"] += 1
            self.open.drafted = True
            self.asked = {req: k for req, k in zip(reqs, budgets, strict=True) if k}
            return list(budgets)
        self.weighed += 1
        worths = []  # (worth, request index): a request's j-th draft token is worth a^j
        for i, (req, k) in enumerate(zip(reqs, budgets, strict=True)):
            a = self.acceptance(req)
            worths += [(a**j, i) for j in range(1, k + 1)]
        worths.sort(key=lambda w: -w[0])  # stable: within a request, j ascending
        choice = self.choose([w for w, _ in worths], sampling, rows)
        self.decisions[choice.kind] += 1
        if choice.kind == "plain":
            self.held[plain_bucket] = self.steps + HOLD_STEPS
        else:
            self.held.pop(plain_bucket, None)
        self.full_held.pop(plain_bucket, None)
        if choice.wide and choice.drafts == sum(budgets):
            rates = [self.acceptance(req) for req, k in zip(reqs, budgets, strict=True) if k]
            if len(rates) > 1:
                hold = FullHold(self.steps + HOLD_STEPS, tuple(budgets), min(rates))
            else:
                floor = self._lowest_full_rate(rows, sampling, choice.drafts, rates[0])
                hold = FullHold(self.steps + LONE_HOLD_STEPS, tuple(budgets), floor)
            self.full_held[plain_bucket] = hold
        self.open.drafted = choice.drafts > 0
        for _, i in worths[: choice.drafts]:
            lengths[i] += 1
        self.asked = {req: k for req, k in zip(reqs, lengths, strict=True) if k}
        return lengths

    def holds(self, rows: int) -> bool:
        """Whether a choice of no drafts stands for a step of `rows` rows without drafts."""
        return self.steps < self.held.get(self.bucket(rows), 0)

    def _holds_full(self, plain_bucket: int, reqs: list[object], budgets: list[int]) -> bool:
        """Whether a choice of every draft token stands for this step: made at its plain
        bucket within HOLD_STEPS decisions (LONE_HOLD_STEPS for one request), for the same
        budgets, and no request's acceptance rate below its floor (more accepted drafts only
        pay more)."""
        hold = self.full_held.get(plain_bucket)
        if hold is None or self.steps >= hold.until or tuple(budgets) != hold.budgets:
            return False
        return all(self.acceptance(req) >= hold.floor for req, k in zip(reqs, budgets, strict=True) if k)

    def _lowest_full_rate(self, rows: int, sampling: int, drafts: int, rate: float) -> float:
        """For one request drafting `drafts` tokens (`sampling` requests, `rows` rows without
        drafts): about the lowest acceptance rate, `rate` at most, at which `choose` would still
        give it every draft token and call that paying (the choice is monotone in the rate:
        more drafts gain more from it). On today's costs, which a hold keeps."""
        options = self._options(rows, drafts)
        costs = [self._verify_cost(bucket) for bucket, _ in options]
        plain_rate = sampling / self._plain_cost(self.bucket(rows))

        def full(a: float) -> bool:
            tokens = list(itertools.accumulate((a**j for j in range(1, drafts + 1)), initial=float(sampling)))
            (_, chosen), rate = best_option(tokens, options, costs)  # as `choose` weighs
            return chosen == drafts and rate > plain_rate * (1 + STAY_MARGIN)

        low, high = 0.0, rate
        for _ in range(FLOOR_HALVINGS):
            mid = (low + high) / 2
            low, high = (low, mid) if full(mid) else (mid, high)
        return high

    def choose(self, worths: list[float], sampling: int, rows: int) -> Choice:
        """The step's drafts (the first of `worths`, best first) and why; `sampling`: requests
        that sample this step, `rows`: its rows without drafts."""
        self.steps += 1
        plain_bucket = self.bucket(rows)
        plain = self._plain_cost(plain_bucket)
        if plain is None:  # time the plain step first
            return Choice(0, "untimed")
        plain_rate = sampling / plain
        if self._realized_loss(plain_bucket, plain_rate):  # stopped: no drafts to weigh
            return Choice(0, "plain")
        tokens = list(itertools.accumulate(worths, initial=float(sampling)))  # by drafts kept
        options = self._options(rows, len(worths))
        margin = STAY_MARGIN if self.drafting.get(plain_bucket) else ENTER_MARGIN
        (bucket, drafts), rate = best_option(tokens, options, [self._verify_cost(b) for b, _ in options])
        pays = rate > plain_rate * (1 + margin)
        self.drafting[plain_bucket] = pays
        best = rate if pays else plain_rate  # what a trial must beat, by the entry margin
        # where drafting pays, only measured buckets are retried: a measurement may be stale
        tryable = [o for o in options if not (pays and (o[0] == bucket or o[0] not in self.verify.seconds))
                   and self._may_try(o[0])]  # (which starts a bucket's retry wait: asked last)
        if tryable:
            (tried, tried_drafts), trial_rate = best_option(tokens, tryable, [self._trial_cost(b) for b, _ in tryable])
            if trial_rate > best * (1 + ENTER_MARGIN):
                self._tried(tried)
                return Choice(tried_drafts, "trial")
        if pays:
            return Choice(drafts, "pays", wide=rate > plain_rate * (1 + HOLD_MARGIN))
        return Choice(0, "plain")

    def _realized_loss(self, plain_bucket: int, timed_plain_rate: float) -> bool:
        """Whether drafting at `plain_bucket` is stopped: while a stop lasts, and where
        drafting's realized rate is known and does not beat plain steps' (realized where known,
        else from their timed cost: a bound, since the realized rate counts more time)."""
        if self.steps < self.blocked_until.get(plain_bucket, 0):
            return True
        if self.weighed % REALIZED_CHECK:  # a window's rate moves little a step; its median costs
            return False
        drafting, plain = self.realized.get((plain_bucket, True)), self.realized.get((plain_bucket, False))
        if drafting is None or len(drafting.steps) < REALIZED_STEPS:
            return False
        known = plain is not None and len(plain.steps) >= REALIZED_STEPS
        if drafting.rate > (plain.rate if known else timed_plain_rate):
            return False
        del self.realized[(plain_bucket, True)]  # measured afresh once the stop ends
        self.blocked_until[plain_bucket] = self.steps + (RETRY_STEPS << min(self.blocks[plain_bucket], 16))
        self.blocks[plain_bucket] += 1
        self.drafting[plain_bucket] = False
        return True

    def _plain_cost(self, bucket: int) -> float | None:
        """The plain step's cost at `bucket` once timed: its mean, or less where a larger
        bucket measured less (more rows never cost less; a few slow steps, e.g. the first after
        a prefill, would otherwise make drafting look like it pays)."""
        own = self.plain.seconds.get(bucket)
        if own is None:
            return None
        return min(s for b, s in self.plain.seconds.items() if b >= bucket)

    def _close_step(self, now: float) -> None:
        """The step decided last ends where the next decision begins: its realized rate."""
        step, self.open = self.open, None
        if step is not None and now > step.started:
            key = (step.bucket, step.drafted)
            rate = self.realized.get(key)
            if rate is None:  # (not setdefault: that would build one every step)
                rate = self.realized[key] = RealizedRate()
            rate.add(step.tokens, now - step.started)

    def _options(self, rows: int, most: int) -> list[tuple[int, int]]:
        """(verify bucket, drafts) for every bucket `rows` plus 1..`most` drafts reach, each
        filled with as many drafts as it holds (within a bucket a step costs the same)."""
        options, bucket = [], self.bucket(rows + 1)
        while True:
            drafts = min(bucket - rows, most)
            options.append((bucket, drafts))
            if drafts == most:
                return options
            bucket = self.bucket(bucket + 1)

    def _verify_cost(self, bucket: int) -> float:
        """A verify step's measured cost, else its pessimistic price (the module docstring)."""
        measured = self.verify.seconds.get(bucket)
        if measured is not None:
            return measured
        points = {b: VERIFY_OVERHEAD * s for b, s in self.plain.seconds.items()}
        for b, s in self.verify.seconds.items():
            points[b] = max(s, points.get(b, s))
        return upper_bound(points, bucket)

    def _trial_cost(self, bucket: int) -> float:
        """The least a verify step of `bucket` could cost, judged from every other measurement
        (its own, if any, is what a retry re-checks)."""
        points = dict(self.plain.seconds)
        for b, s in self.verify.seconds.items():
            if b != bucket:
                points[b] = min(s, points.get(b, s))
        return lower_bound(points, bucket)

    def _may_try(self, bucket: int) -> bool:
        """An unmeasured bucket for its first EXPLORE_TRIES steps; after that, or once
        measured as a loss, when its retry is due (the first wait starts now)."""
        if bucket not in self.verify.seconds and self.tries[bucket] < EXPLORE_TRIES:
            return True
        return self.steps >= self.retry_at.setdefault(bucket, self.steps + RETRY_STEPS)

    def _tried(self, bucket: int) -> None:
        """A step drafts to `bucket` on trial: a measured bucket is measured afresh (its old
        steps may be what the host was doing then), and its next retry waits twice as long as
        the last."""
        if bucket in self.verify.seconds:
            self.verify.remeasure(bucket)
        self.tries[bucket] += 1
        self.retry_at[bucket] = self.steps + (RETRY_STEPS << min(self.tries[bucket], 16))

    def record_verified(self, req: object, drafted: int, accepted: int) -> None:
        """The target's verdict on `req`'s draft this step, counted against the draft tokens
        the policy asked for if the drafter produced fewer."""
        drafted = max(drafted, self.asked.pop(req, 0))
        if drafted <= 0:
            return
        if self.open is not None and self.open.drafted:
            # a drafting step's bonus tokens; where the verdict comes after the next step was
            # planned, they count for that one, and are lost where it is plain (the safe side)
            self.open.tokens += accepted
        self._update_acceptance(req, drafted, accepted)

    def could_pay(self, budgets: list[int], rows: int) -> bool:
        """Whether drafting would pay at a step of `rows` rows (without drafts) if every draft
        token of `budgets` were accepted: where it would not, acceptance is not what stops it,
        and unseen drafts (`record_shadow`) are not worth their host time."""
        plain_bucket, sampling = self.bucket(rows), sum(k > 0 for k in budgets)
        plain = self._plain_cost(plain_bucket)
        if plain is None or not sampling or self.steps < self.blocked_until.get(plain_bucket, 0):
            return False
        best = max((sampling + drafts) / self._verify_cost(bucket) for bucket, drafts in self._options(rows, sum(budgets)))
        return best > sampling / plain * (1 + ENTER_MARGIN)

    def record_shadow(self, req: object, drafted: int, accepted: int) -> None:
        """A draft `req` was not given, checked against the tokens it went on to emit: news on
        its acceptance rate (and the engine's), not on any step's cost or tokens."""
        if drafted <= 0:
            return
        self.shadowed += 1
        self._update_acceptance(req, drafted, accepted)

    def _update_acceptance(self, req: object, drafted: int, accepted: int) -> None:
        """`req`'s and the engine's acceptance rates take a verdict (news: no choice of no
        drafts stands past it)."""
        if req not in self.requests:
            self.requests[req] = Acceptance(self.engine_wide.accepted, self.engine_wide.rejected)
        self.requests[req].update(drafted, accepted)
        self.engine_wide.update(drafted, accepted)
        self.held.clear()

    def record_step(self, rows: int, seconds: float, drafts: int = 0) -> None:
        """A step of `rows` rows, `drafts` of them draft tokens, took `seconds`."""
        (self.verify if drafts > 0 else self.plain).record(self.bucket(rows), seconds)
        if drafts > 0:
            self.held.clear()

    def release(self, req: object) -> None:
        self.requests.pop(req, None)
        self.asked.pop(req, None)
