"""How many tokens each request drafts this step: as many as pay for the rows they add.

A verify step emits, for a request whose drafts are each accepted with probability a (given the
ones before), 1 + a + a^2 + ... + a^k tokens for k drafted: its j-th draft token is worth a^j
tokens. It also runs k more rows, and what a row costs depends on the step: at batch 1 a decode
step reads the weights once whatever its row count, so drafts are nearly free; at batch 64 a
step of 64 x (1 + k) rows can cost several plain steps, and the drafts lose (docs/performance.md,
"Speculative decoding"). So per step the policy ranks every request's candidate draft tokens by
worth, and keeps the top D, the D (0 included) that maximises expected tokens per second:

    (sampling requests + sum of the D best worths) / cost(bucket(rows + D))

`cost` is the measured mean wall time of steps of that row bucket (the decode graphs' batch
sizes, or powers of two), and where a bucket has not been measured yet, a linear model
`(FIXED_ROWS + rows)` scaled to the nearest measured bucket. A step whose rows without drafts
fall in a bucket not measured yet drafts nothing: the comparison needs the plain step's cost.
Each request's acceptance rate is a decayed count of its accepted and rejected drafts,
starting from the engine-wide one.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

FIXED_ROWS = 64.0  # the prior: a step costs as much as FIXED_ROWS rows before it runs any
DECAY = 0.8  # weight of past verify steps in an acceptance rate, per step
STEP_EMA = 0.2  # weight of the newest step in a bucket's mean cost
PRIOR = (1.4, 0.6)  # (accepted, rejected) pseudo-counts a new engine starts from: a = 0.7


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


class DraftPolicy:
    """Per step, the draft length of every request (`draft_lengths`), from its acceptance rate
    (`record_verified`) and the measured cost of steps by row bucket (`record_step`)."""

    def __init__(self, buckets: tuple[int, ...] = ()):
        self.buckets = tuple(sorted(buckets))  # the decode graphs' row counts, if any
        self.engine_wide = Acceptance(*PRIOR)
        self.requests: dict[object, Acceptance] = {}
        self.step_seconds: dict[int, float] = {}  # bucket -> mean wall time of its steps
        self._seen: set[int] = set()  # buckets whose first (warm-up) step was dropped

    def bucket(self, rows: int) -> int:
        """The row count a step of `rows` rows runs as: its decode-graph bucket, else the next
        power of two."""
        i = bisect.bisect_left(self.buckets, rows)
        if i < len(self.buckets):
            return self.buckets[i]
        return 1 << max(0, rows - 1).bit_length()

    def cost(self, rows: int) -> float:
        """Seconds a step of `rows` rows is expected to take (relative, where nothing is
        measured yet)."""
        b = self.bucket(rows)
        if b in self.step_seconds:
            return self.step_seconds[b]
        if not self.step_seconds:
            return FIXED_ROWS + b
        near = min(self.step_seconds, key=lambda m: abs(m - b))
        return self.step_seconds[near] * (FIXED_ROWS + b) / (FIXED_ROWS + near)

    def acceptance(self, req: object) -> float:
        known = self.requests.get(req)
        return (known or self.engine_wide).rate

    def draft_lengths(self, reqs: list[object], budgets: list[int], rows: int) -> list[int]:
        """How many tokens each of `reqs` drafts, at most its budget (0: it does not sample
        this step); `rows`: the step's rows without drafts."""
        if self.bucket(rows) not in self.step_seconds:  # time the plain step first
            return [0] * len(reqs)
        worths = []  # (worth, request index): a request's j-th draft token is worth a^j
        for i, (req, k) in enumerate(zip(reqs, budgets, strict=True)):
            a = self.acceptance(req)
            worths += [(a**j, i) for j in range(1, k + 1)]
        worths.sort(key=lambda w: -w[0])  # stable: within a request, j ascending
        sampling = sum(k > 0 for k in budgets)
        best, best_rate, tokens = 0, sampling / self.cost(rows), float(sampling)
        for d, (worth, _) in enumerate(worths, start=1):
            tokens += worth
            rate = tokens / self.cost(rows + d)
            if rate > best_rate:
                best, best_rate = d, rate
        lengths = [0] * len(reqs)
        for _, i in worths[:best]:
            lengths[i] += 1
        return lengths

    def record_verified(self, req: object, drafted: int, accepted: int) -> None:
        """The target's verdict on `req`'s draft this step."""
        if drafted <= 0:
            return
        if req not in self.requests:
            self.requests[req] = Acceptance(self.engine_wide.accepted, self.engine_wide.rejected)
        self.requests[req].update(drafted, accepted)
        self.engine_wide.update(drafted, accepted)

    def record_step(self, rows: int, seconds: float) -> None:
        """A step of `rows` rows (drafts included) took `seconds`; each bucket's first step is
        dropped (it compiles and warms up)."""
        b = self.bucket(rows)
        if b not in self._seen:
            self._seen.add(b)
            return
        old = self.step_seconds.get(b)
        self.step_seconds[b] = seconds if old is None else (1 - STEP_EMA) * old + STEP_EMA * seconds

    def release(self, req: object) -> None:
        self.requests.pop(req, None)
