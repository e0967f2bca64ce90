"""The next step's grammar masks, filled on worker threads while the engine does its
bookkeeping.

On the host a decode step's critical path is: read the sampled tokens, advance the matchers,
fill the next step's masks, copy them, launch the sampler. The rest of the engine's per-step
work (finishing and notifying requests, scheduling, building the next step's rows) need not
wait for the masks, and at batch 64 both cost about as much: with both on one thread the
host, not the GPU, can set the pace of a small model's step. `MaskPrefetcher.start` hands the
fill to worker threads right after the matchers have advanced; `take` collects it when the step
needs its masks.

Whether it pays depends on the host: the hand-off costs the main thread thread wake-ups and the
GIL's way back, and while workers run, every small native call the main thread makes (accept a
token, is the grammar complete) waits for the GIL. It won on some hosts and lost on others
(docs/performance.md, "Grammar overhead"). So by
default (`EngineTuning.mask_prefetch="auto"`) a `PrefetchTuner` times decode steps of the same
shape with and without it, keeps the faster, and asks again every so often.

Rules that keep it correct and deadlock-free:
- A prefetched row is used only where the same matcher, at the same `version` (bumped by every
  accept/rollback/reset), lands in a row of the buffer `take` is given; every other row is
  left to the caller to fill, so a wrong guess costs time, never correctness.
- Between `start` and `take`/`wait` no other thread touches those matchers: the engine starts a
  prefetch only after advancing them and every path that uses a matcher again goes through
  `take` first.
- The GIL: a thread that waits for it while another runs Python gets it only after the switch
  interval, so a worker woken while the main thread does bookkeeping would start late.
  `start` therefore waits until every worker holds the GIL, and the workers release it inside
  the backends' native fill (xgrammar and llguidance both compute masks without the GIL).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from structgen.grammar.backends.base import GrammarMatcher
from structgen.grammar.batch import FillJob, fill_jobs

if TYPE_CHECKING:
    import torch

# Handing the fill to a worker costs the main thread its thread wake-ups and the GIL's way back,
# and while workers run, every native call the main thread makes is slower (each one lets the
# GIL go). So a prefetch starts only for enough rows whose masks have lately been costly to
# fill (an average of the fill times seen, inline or on the workers): cheap rows lose to the
# hand-off, costly ones (escapes inside strings) win (docs/performance.md, "Grammar overhead").
MIN_ROWS = 32
MIN_ROWS_PER_THREAD = 16
MIN_FILL_S = 300e-6


@dataclass
class _Prefetch:
    target: torch.Tensor
    rows: dict[int, tuple[int, GrammarMatcher, int]]  # id(matcher) -> (row, matcher, version)
    futures: list[Future] = field(default_factory=list)
    chunks: list[list[int]] = field(default_factory=list)  # rows each future fills
    finishes: list[list[FillJob]] = field(default_factory=list)  # each chunk's jobs


class PrefetchTuner:
    """Turns the prefetch on or off by timing it on this host: decode steps alternate between
    the two modes in blocks of `block` steps until one shape has `samples` step times in each
    mode; the faster mode (on must win by `min_gain`) is kept for `hold` steps, then the two
    are timed again. A step time is the interval between two consecutive decode steps of the
    same shape (`key`: the rows' bucket and the constrained rows, which set the GPU's and the
    grammar's work); times are kept per shape, so a run of steps cut short by a new request
    still counts. The first interval after a switch of mode or shape is dropped (the step
    before it ran in the other mode or layout)."""

    # Short blocks and many samples: a host's jitter comes in phases of many steps, which
    # longer blocks with fewer samples let pick the slower mode (docs/performance.md, "Grammar
    # overhead"). The margin only breaks near-ties toward fewer threads: both modes' costs are
    # in the times, and a wider margin kept the prefetch off where it won.
    def __init__(self, block: int = 4, samples: int = 32, hold: int = 1024, min_gain: float = 0.01):
        self.block, self.samples, self.hold, self.min_gain = block, samples, hold, min_gain
        self.enabled = False
        self.decisions: list[bool] = []  # every choice made, for benchmarks and tests
        self._times: dict[object, dict[bool, list[float]]] = {}  # shape -> mode -> step times
        self._last: tuple[float, object] | None = None
        self._held = 0  # steps left before timing again (0: timing now)
        self._in_block = 0
        self._skip = False

    @property
    def holding(self) -> bool:
        """A mode is chosen and kept for now (False while the two are being timed)."""
        return self._held > 0

    def step(self, now: float, key: object) -> None:
        """Called as each engine step starts (`now`: perf_counter), with its shape (None: a
        step not to time)."""
        last, self._last = self._last, (now, key)
        if self._held > 0:
            self._held -= 1
            if self._held == 0:
                self._times.clear()
            return
        if key is None or last is None or last[1] != key:
            self._skip = True  # the interval that starts here follows another layout
            return
        if self._skip:
            self._skip = False
        else:
            self._times.setdefault(key, {False: [], True: []})[self.enabled].append(now - last[0])
        times = self._times.get(key)
        if times is not None and min(len(times[False]), len(times[True])) >= self.samples:
            self.enabled = statistics.median(times[True]) < (1.0 - self.min_gain) * statistics.median(times[False])
            self.decisions.append(self.enabled)
            self._held, self._skip = self.hold, True
            return
        self._in_block += 1
        if self._in_block >= self.block:
            self._in_block = 0
            self.enabled = not self.enabled
            self._skip = True


class MaskPrefetcher:
    """Fills grammar mask rows on `threads` worker threads, one prefetch in flight at a time.
    With a `tuner`, only while the tuner says it pays (`PrefetchTuner`)."""

    def __init__(self, threads: int = 1, min_rows: int = MIN_ROWS, min_fill_s: float = MIN_FILL_S,
                 tuner: PrefetchTuner | None = None):
        self.tuner = tuner
        self.threads = max(1, threads)
        self.min_rows = min_rows  # fewer rows are left to the caller (filled during the forward)
        self.min_fill_s = min_fill_s  # cheaper fills are left to the caller too
        self.fill_s = 0.0  # recent time to fill one step's masks (moving average, `observe`)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: _Prefetch | None = None
        self.started = self.served = 0  # rows prefetched / of those, used by `take`

    def start(self, target: torch.Tensor, rows: Sequence[tuple[int, GrammarMatcher]]) -> None:
        """Fill `target[row]` for each (row, matcher), in the background. Only non-terminated
        matchers should be passed (their masks are the ones worth the trip)."""
        self.wait()
        if self.tuner is not None and not self.tuner.enabled:
            return
        rows = [(r, m) for r, m in rows if 0 <= r < target.shape[0]]
        if len(rows) < max(1, self.min_rows) or self.fill_s < self.min_fill_s:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="structgen-mask")
        k = min(self.threads, math.ceil(len(rows) / MIN_ROWS_PER_THREAD))
        size = math.ceil(len(rows) / k)
        p = _Prefetch(target, {id(m): (r, m, m.version) for r, m in rows})
        ready = []
        for i in range(0, len(rows), size):
            chunk = rows[i : i + size]
            # Prepared here: the worker must make no call that lets the GIL go before its
            # native fill (a native call that releases and retakes it would hand the GIL to
            # this thread and leave the worker waiting until this thread blocks in `take`).
            try:
                jobs = fill_jobs([m for _, m in chunk], target, [r for r, _ in chunk], threads=1)
            except Exception:  # left to the caller, who reports the culprit
                for _, m in chunk:
                    del p.rows[id(m)]
                continue
            ev = threading.Event()
            p.futures.append(self._pool.submit(_run, jobs, ev))
            p.chunks.append([r for r, _ in chunk])
            p.finishes.append(jobs)
            ready.append(ev)
        for ev in ready:  # each worker now holds the GIL until its native fill lets it go
            ev.wait()
        self._pending = p
        self.started += len(rows)

    def take(
        self, bitmask: torch.Tensor, rows: Sequence[tuple[int, GrammarMatcher]]
    ) -> list[tuple[int, GrammarMatcher]]:
        """Put the prefetched masks of `rows` into `bitmask` (the prefetch's own buffer, or
        another: rows are then copied); return the (row, matcher) pairs it could not serve,
        for the caller to fill."""
        p = self._pending
        self._pending = None
        if p is None:
            return list(rows)
        failed: set[int] = set()
        spent = 0.0
        for fut, chunk, jobs in zip(p.futures, p.chunks, p.finishes, strict=True):
            try:
                if fut.exception() is None:
                    spent += fut.result()
                    for _, finish in jobs:
                        if finish is not None:
                            finish()
                    continue
            except Exception:
                pass
            failed.update(chunk)  # the caller's own fill finds and reports the culprit
        self.observe(spent)
        rest = serve_filled(p.target, p.rows, bitmask, rows, failed)
        self.served += len(rows) - len(rest)
        return rest

    def observe(self, seconds: float) -> None:
        """Count one step's mask fill time (the caller reports its inline fills of at least
        `min_rows` rows; prefetched ones are counted by `take`)."""
        self.fill_s += 0.2 * (seconds - self.fill_s)

    def wait(self) -> None:
        """Let a prefetch in flight finish (its matchers may be used again) and drop it."""
        p = self._pending
        self._pending = None
        if p is not None:
            for fut in p.futures:
                fut.exception()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def serve_filled(
    target: torch.Tensor, filled: dict[int, tuple[int, GrammarMatcher, int]], bitmask: torch.Tensor,
    rows: Sequence[tuple[int, GrammarMatcher]], failed: set[int] | frozenset[int] = frozenset(),
) -> list[tuple[int, GrammarMatcher]]:
    """Masks filled ahead of a step into `target`, `filled` saying which: id(matcher) ->
    (row, matcher, its version then). Put those of `rows` (row, matcher) into `bitmask` (the
    same buffer: nothing to do; another: rows are copied) where the matcher is the same object
    in the same state and its row is not in `failed`; return the pairs left to fill."""
    same = bitmask.data_ptr() == target.data_ptr() and bitmask.stride() == target.stride()
    rest, src, dst = [], [], []
    for row, m in rows:
        entry = filled.get(id(m))
        if entry is None or entry[1] is not m or entry[2] != m.version or entry[0] in failed:
            rest.append((row, m))
        elif not (same and entry[0] == row):
            src.append(entry[0])
            dst.append(row)
    if dst:  # fancy indexing reads the sources before writing: overlapping rows are fine
        bitmask.numpy()[dst] = target.numpy()[src]
    return rest


def _run(jobs: list[FillJob], ready: threading.Event) -> float:
    ready.set()
    t = time.perf_counter()
    for run, _ in jobs:
        if run is not None:
            run()
    return time.perf_counter() - t
