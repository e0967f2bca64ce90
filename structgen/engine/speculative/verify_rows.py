"""How a verify step lays out its tokens, and the grammar masks of its draft positions.

A verify step runs, for each request, its pending tokens and its drafts in one forward, and
samples at the last pending token and after every draft token. These helpers name the rows:
`sampling_spans` where each request's sampling positions sit, `token_rows` one one-token row
per token (so a verify step is a decode step over rows and fits the decode CUDA graphs), and
`fill_draft_masks` the grammar mask of every sampling position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from structgen.engine.model_runner import ExtendSeq

if TYPE_CHECKING:
    import torch

    from structgen.engine.request import Request


def sampling_spans(batch: list[tuple[Request, int]], drafts: list[list[int]]) -> list[tuple[int, int] | None]:
    """Per request, (first row, first row in the flat token order) of its sampling
    positions, or None when it does not sample this step. Rows count sampling positions
    only; the flat order counts every token the forward runs."""
    spans: list[tuple[int, int] | None] = []
    row = flat = 0
    for (req, n), draft in zip(batch, drafts, strict=True):
        if req.num_cached + n == len(req.token_ids):
            spans.append((row, flat + n - 1))
            row += 1 + len(draft)
        else:
            spans.append(None)
        flat += n + len(draft)
    return spans


def step_tokens(batch: list[tuple[Request, int]], drafts: list[list[int]]) -> int:
    """Tokens a verify step's forward runs: every request's pending tokens and its draft."""
    return sum(n + len(d) for (_, n), d in zip(batch, drafts, strict=True))


def token_rows(batch: list[tuple[Request, int]], drafts: list[list[int]],
               spans: list[tuple[int, int] | None]) -> tuple[list[ExtendSeq], dict[int, int]]:
    """One one-token row per pending and draft token (its own position and context), and
    `at`: flat index -> sampling row."""
    rows, at = [], {}
    for (req, n), d, s in zip(batch, drafts, spans, strict=True):
        toks = req.token_ids[req.num_cached : req.num_cached + n] + d
        if s is not None:
            at.update({s[1] + j: s[0] + j for j in range(1 + len(d))})
        for j, t in enumerate(toks):
            rows.append(ExtendSeq(req.slot, req.num_cached + j, [t]))
    return rows, at


@dataclass
class GraphRows:
    """A verify step laid out for the decode graphs: a one-token row per token, the flat
    indices of its sampling rows in row order, and each row's sampling temperature, noise
    seed and has-mask flag; `masks` are the (request, first flat row, draft) spans whose
    rows `fill_draft_masks` fills."""

    rows: list[ExtendSeq]
    order: list[int]
    temperatures: list[float]
    seeds: list[int]
    has_mask: list[bool]
    masks: list[tuple[Request, int, list[int]]]


def graph_rows(batch: list[tuple[Request, int]], drafts: list[list[int]], spans: list[tuple[int, int] | None],
               temperatures: list[float], seeds: list[int]) -> GraphRows:
    """Lay a verify step out as decode-graph rows; `temperatures` and `seeds` are per
    sampling row (row order)."""
    rows, at = token_rows(batch, drafts, spans)
    order = sorted(at)
    temps, flat_seeds, has_mask = [0.0] * len(rows), [0] * len(rows), [False] * len(rows)
    for f in order:
        temps[f], flat_seeds[f] = temperatures[at[f]], seeds[at[f]]
    masks = []
    for (req, _), d, s in zip(batch, drafts, spans, strict=True):
        if s is not None and req.matcher is not None:
            has_mask[s[1] : s[1] + 1 + len(d)] = [True] * (1 + len(d))
            masks.append((req, s[1], d))
    return GraphRows(rows, order, temps, flat_seeds, has_mask, masks)


def fill_draft_masks(bitmask: torch.Tensor, spans: list[tuple[Request, int, list[int]]]) -> dict[Request, BaseException]:
    """Rows r0..r0+m of `bitmask` get the grammar's mask after the pending tokens and after
    each draft prefix (the matcher walks the draft, then rolls back). Rows after a draft
    token the grammar forbids are set all-allowed: acceptance stops before them."""
    errors: dict[Request, BaseException] = {}
    for req, r0, draft in spans:
        m, walked = req.matcher, 0
        try:
            m.fill_bitmask(bitmask, r0)
            for d in draft:
                if not m.accept_token(d):
                    break
                walked += 1
                if m.is_terminated():  # a drafted stop token: nothing follows it
                    break
                m.fill_bitmask(bitmask, r0 + walked)
        except Exception as exc:
            errors[req] = exc
        finally:
            if walked:
                m.rollback(walked)
        bitmask[r0 + walked + 1 : r0 + len(draft) + 1] = -1
    return errors
