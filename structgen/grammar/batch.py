"""Filling the bitmask rows of a whole batch at once.

Each backend has a native thread pool that computes masks outside the GIL (xgrammar's
`BatchGrammarMatcher`, llguidance's `LLExecutor`); this groups a batch's matchers by backend
and hands each group to its pool, so one decode step costs about max(mask time) rather than
their sum.
"""

from __future__ import annotations

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

    `threads` sizes the backends' pools (0: their default, about half the CPU cores). Rows of
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

            xgrammar.fill_bitmasks(ms, rs, bitmask, threads)
        elif backend == "llguidance":
            from structgen.grammar.backends import llguidance

            llguidance.fill_bitmasks(ms, rs, bitmask, threads)
        else:
            for m, r in zip(ms, rs, strict=True):
                m.fill_bitmask(bitmask, r)
