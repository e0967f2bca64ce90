"""Filling the bitmask rows of a whole batch at once.

Each backend has a native thread pool that computes masks outside the GIL (xgrammar's
`BatchGrammarMatcher`, llguidance's `LLExecutor`); this groups a batch's matchers by backend
and hands each group to its pool, so one decode step costs about max(mask time) rather than
their sum.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from structgen.grammar.backends.base import GrammarMatcher

if TYPE_CHECKING:
    import torch


def fill_bitmasks(
    matchers: Sequence[GrammarMatcher],
    bitmask: torch.Tensor,
    rows: Sequence[int] | None = None,
    *,
    threads: int = 0,
) -> None:
    """Fill `bitmask[rows[i]]` from `matchers[i]` for every i (rows default to 0..n-1).

    `threads` sizes the backends' pools (0: `default_threads(backend)`). Rows of
    other requests are left untouched. Matchers must not be used by another thread meanwhile.
    """
    rows = list(range(len(matchers))) if rows is None else list(rows)
    groups: dict[str, tuple[list, list[int]]] = {}
    for m, r in zip(matchers, rows, strict=True):
        ms, rs = groups.setdefault(m.backend, ([], []))
        ms.append(m)
        rs.append(r)
    for backend, (ms, rs) in groups.items():
        if len(ms) == 1:
            ms[0].fill_bitmask(bitmask, rs[0])
        elif backend == "xgrammar":
            from structgen.grammar.backends import xgrammar

            xgrammar.fill_bitmasks(ms, rs, bitmask, threads or default_threads(backend))
        elif backend == "llguidance":
            from structgen.grammar.backends import llguidance

            llguidance.fill_bitmasks(ms, rs, bitmask, threads or default_threads(backend))
        else:
            for m, r in zip(ms, rs, strict=True):
                m.fill_bitmask(bitmask, r)


def default_threads(backend: str = "llguidance") -> int:
    """Mask-filling threads when none are configured. xgrammar: one. Its rows cost 1-16 us
    (numbers vs strings), less than its pool's hand-off: on the 16-core H100 host, 64 JSON
    rows took 0.40 ms on 1 thread, 0.94 on 2, 0.51 on 4 and 1.69 on 8 (the library's default
    is half the cores). llguidance: up to 4 (its rows cost more; not measured per thread)."""
    if backend == "xgrammar":
        return 1
    return max(1, min(4, (os.cpu_count() or 2) // 2))

