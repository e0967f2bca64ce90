"""A whole batch's grammar work at once: filling bitmask rows, taking sampled tokens.

Each backend has a native thread pool that computes masks outside the GIL (xgrammar's
`BatchGrammarMatcher`, llguidance's `LLExecutor`); this groups a batch's matchers by backend
and hands each group to its pool, so one decode step costs about max(mask time) rather than
their sum. Where grammar.native's pool runs xgrammar's matchers, a step's sampled tokens go
through it too, fused with the next step's fills.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from structgen.grammar import native
from structgen.grammar.backends.base import (
    ACCEPTED,
    COMPLETED,
    FAILED,
    JUMPS,
    TERMINATED,
    GrammarMatcher,
)

if TYPE_CHECKING:
    import torch


def fill_bitmasks(
    matchers: Sequence[GrammarMatcher],
    bitmask: torch.Tensor,
    rows: Sequence[int] | None = None,
    *,
    threads: int | GrammarThreads = 0,
) -> None:
    """Fill `bitmask[rows[i]]` from `matchers[i]` for every i (rows default to 0..n-1).

    `threads` sizes the backends' pools (0: auto, `GrammarThreads.resolve`; a caller that
    fills every step passes its resolved sizes, which are not looked up again). Rows of
    other requests are left untouched. Matchers must not be used by another thread meanwhile.
    """
    for run, finish in fill_jobs(matchers, bitmask, rows, threads=threads):
        if run is not None:
            run()
        if finish is not None:
            finish()


NATIVE_MIN_ROWS = 16  # smaller batches take their tokens from Python unless fills join them
FillJob = tuple[Callable[[], None] | None, Callable[[], None] | None]  # (run, finish)


def fill_jobs(
    matchers: Sequence[GrammarMatcher],
    bitmask: torch.Tensor,
    rows: Sequence[int] | None = None,
    *,
    threads: int | GrammarThreads = 0,
) -> list[FillJob]:
    """`fill_bitmasks` split in parts, one (run, finish) per backend in the batch: `run` is
    the backend's native batch fill (it releases the GIL, so it may run on a worker thread
    while this one runs Python), `finish` what must follow on the calling thread. Either may
    be None. Everything else (grouping, terminated rows) happens here, now."""
    rows = list(range(len(matchers))) if rows is None else list(rows)
    groups: dict[str, tuple[list, list[int]]] = {}
    for m, r in zip(matchers, rows, strict=True):
        ms, rs = groups.setdefault(m.backend, ([], []))
        ms.append(m)
        rs.append(r)
    jobs: list[FillJob] = []
    sizes = threads if isinstance(threads, GrammarThreads) else GrammarThreads.resolve(threads)
    for backend, (ms, rs) in groups.items():
        n = sizes.for_backend(backend)
        if backend == "xgrammar":
            from structgen.grammar.backends import xgrammar

            jobs.append(xgrammar.fill_job(ms, rs, bitmask, n))
        elif backend == "llguidance":
            from structgen.grammar.backends import llguidance

            jobs.append(llguidance.fill_job(ms, rs, bitmask, n))
        else:  # a backend without a batch call: row by row

            def one_by_one(ms: list = ms, rs: list[int] = rs) -> None:
                for m, r in zip(ms, rs, strict=True):
                    m.fill_bitmask(bitmask, r)

            jobs.append((one_by_one, None))
    return jobs


def accept_tokens(
    matchers: Sequence[GrammarMatcher],
    tokens: Sequence[int],
    *,
    check_jump: bool = False,
    bitmask: torch.Tensor | None = None,
    rows: Sequence[int] | None = None,
) -> tuple[list[int], dict[int, BaseException]]:
    """Matcher i takes `tokens[i]`. Returns what became of each, `backends.base.ACCEPTED`...
    bits (as `accept_one`), and the exceptions of those that raised (FAILED; the others are
    unaffected). `bitmask`: where grammar.native's pool (2+ threads) takes the tokens, the next
    mask of every matcher that accepted is filled into `bitmask[rows[i]]` in the same call
    (FILLED); elsewhere it is not, and callers fill as usual. Matchers must not be used by
    another thread meanwhile.

    Why: the engine's decode step asked each row's matcher three or four small questions from
    Python, then filled the masks in a second pass. Natively (grammar.native, xgrammar's
    matchers) the questions cost less from about 16 rows on (docs/performance.md, "Grammar
    overhead"), so batches of
    `NATIVE_MIN_ROWS` or more go there, and any batch whose fills can join them on a pool of
    2+ threads."""
    small = len(matchers) < NATIVE_MIN_ROWS
    if small and bitmask is None:  # the batch-1 path: on the critical path of jump-forward steps
        return _accept_each(matchers, tokens, check_jump)
    pool = native.load()
    fill = bitmask is not None and pool is not None and pool.threads > 1
    if small and not fill:
        pool = None
    pooled: list[int] = []
    if pool is not None:
        from structgen.grammar.backends.xgrammar import XGrammarMatcher

        # (the pool asks xgrammar's unbounded jump-forward: only where the grammar bounds it)
        pooled = [i for i, m in enumerate(matchers) if type(m) is XGrammarMatcher and not m._terminated
                  and (m.forced_text_bounded or not check_jump)]
    if not pooled:
        return _accept_each(matchers, tokens, check_jump)
    from structgen.grammar.backends.xgrammar import accept_natively

    every = len(pooled) == len(matchers)
    ms = matchers if every else [matchers[i] for i in pooled]
    toks = tokens if every else [tokens[i] for i in pooled]
    rs = (rows if every else [rows[i] for i in pooled]) if fill else None
    got = accept_natively(ms, toks, check_jump, bitmask if fill else None, rs)
    errors: dict[int, BaseException] = {}
    if any(st & FAILED for st in got):
        exc = native.NativeGrammarError(pool.take_error())
        errors.update((pooled[j], exc) for j, st in enumerate(got) if st & FAILED)
    if every:
        return got, errors
    # Other backends' matchers (or terminated ones) in the same batch: row by row.
    done = set(pooled)
    rest = [i for i in range(len(matchers)) if i not in done]
    rest_status, rest_errors = _accept_each([matchers[i] for i in rest], [tokens[i] for i in rest], check_jump)
    status = [0] * len(matchers)
    for i, st in zip(pooled, got, strict=True):
        status[i] = st
    for i, st in zip(rest, rest_status, strict=True):
        status[i] = st
    errors.update((rest[j], exc) for j, exc in rest_errors.items())
    return status, errors


def _accept_each(
    matchers: Sequence[GrammarMatcher], tokens: Sequence[int], check_jump: bool
) -> tuple[list[int], dict[int, BaseException]]:
    status, errors = [], {}
    for m, tok in zip(matchers, tokens, strict=True):
        try:
            status.append(accept_one(m, tok, check_jump))
        except Exception as exc:
            errors[len(status)] = exc
            status.append(FAILED)
    return status, errors


def accept_one(m: GrammarMatcher, tok: int, check_jump: bool = False) -> int:
    """One matcher takes one token; returns the bits `accept_tokens` does (JUMPS only with
    `check_jump`: the grammar forces text next, forced bytes that end inside a character
    included) and raises what the matcher raises."""
    if not m.accept_token(tok):
        return 0
    if m.is_terminated():
        return ACCEPTED | TERMINATED
    status = ACCEPTED | (COMPLETED if m.is_completed() else 0)
    if check_jump:
        try:
            status |= JUMPS if m.jump_forward_string() else 0
        except UnicodeDecodeError:
            status |= JUMPS
    return status


@dataclass(frozen=True)
class GrammarThreads:
    """The threads each part of a batch's grammar work gets, from one setting
    (`EngineTuning.grammar_threads`): a number sizes every part alike; 0 (auto) sizes each
    part for its work (docs/performance.md, "Grammar overhead")."""

    pool: int  # grammar.native's pool, which fills xgrammar rows where it has 2+ threads
    xgrammar: int  # xgrammar's own batch call, where the pool does not run
    llguidance: int  # llguidance's executor
    prefetch: int  # workers of the mask prefetch (grammar/prefetch.py)

    @classmethod
    def resolve(cls, configured: int = 0) -> GrammarThreads:
        """`configured` threads for every part, or with 0 the auto sizes: the pool
        `native.default_threads()` (half the cores, at most 8, or $STRUCTGEN_GRAMMAR_THREADS);
        xgrammar's own call one, since its rows cost less than its pool's hand-off; llguidance
        up to 4 of the pool's, its rows cost more; the prefetch two workers."""
        if configured > 0:
            return cls(pool=configured, xgrammar=configured, llguidance=configured, prefetch=configured)
        pool = native.default_threads()
        return cls(pool=pool, xgrammar=1, llguidance=min(4, pool), prefetch=2)

    def for_backend(self, backend: str) -> int:
        """Threads of `backend`'s own batch fill."""
        return self.xgrammar if backend == "xgrammar" else self.llguidance
