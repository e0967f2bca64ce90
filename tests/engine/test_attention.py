"""The torch attention path over the paged cache against a naive reference on each sequence's
contiguous keys, for each way a step can be laid out: one fresh prompt (plain causal), one
sequence with a cached prefix (chunked prefill, forced text), and several sequences of
different lengths (gathered, padded, stale rows zeroed). Pages are small and handed out
interleaved between the sequences, so no sequence's pages are contiguous; the pool's unused
rows hold NaN, as uninitialised memory may."""

from __future__ import annotations

import math

import pytest
import torch

from structgen.engine.attention import AttentionBatch, attend
from structgen.engine.page_table import PageTable

HEADS, KV_HEADS, DIM, SLOTS, MAX_LEN, PAGE = 4, 2, 16, 5, 48, 4


def paged_cache(seqs: list[tuple[int, int, int]], g: torch.Generator
                ) -> tuple[PageTable, torch.Tensor, torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """A page table whose sequences' pages interleave, a NaN pool with each sequence's
    prefix and new tokens written through it, and those K/V per slot, contiguous."""
    pages = PageTable((SLOTS + 1) * MAX_LEN // PAGE + 1, PAGE, SLOTS + 1, MAX_LEN, torch.device("cpu"))
    for end in range(PAGE, MAX_LEN + 1, PAGE):  # one page per sequence in turn, and one for a spare slot
        for slot, start, n in seqs:
            assert pages.cover(slot, min(end, start + n))
        assert pages.cover(SLOTS, end)
    k_cache = torch.full((pages.num_pages, PAGE, KV_HEADS, DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    contiguous = {}
    for slot, start, n in seqs:
        k, v = torch.randn(2, start + n, KV_HEADS, DIM, generator=g)
        rows = torch.from_numpy(pages.token_slots(slot, 0, start + n))
        k_cache.view(-1, KV_HEADS, DIM)[rows], v_cache.view(-1, KV_HEADS, DIM)[rows] = k, v
        contiguous[slot] = (k, v)
    return pages, k_cache, v_cache, contiguous


def reference(q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """q_rows [n, H, D] at `positions`; k, v [ctx, KV, D] of one sequence: causal softmax."""
    group = HEADS // KV_HEADS
    out = []
    for i, pos in enumerate(positions):
        kk, vv = k[: pos + 1].repeat_interleave(group, 1), v[: pos + 1].repeat_interleave(group, 1)
        scores = torch.einsum("hd,chd->hc", q_rows[i], kk) / math.sqrt(DIM)
        out.append(torch.einsum("hc,chd->hd", scores.softmax(-1), vv))
    return torch.stack(out)


@pytest.mark.parametrize(
    "seqs",
    [
        [(1, 0, 9)],  # one fresh prompt
        [(2, 0, 3)],  # one prompt within a page (a view of the pool, not a gather)
        [(3, 12, 5)],  # one sequence after a cached prefix of 12
        [(0, 0, 6), (2, 20, 1), (4, 7, 3)],  # three sequences, ragged
    ],
)
def test_paged_attend_matches_naive_causal_attention_on_contiguous_keys(seqs):
    g = torch.Generator().manual_seed(0)
    pages, k_cache, v_cache, contiguous = paged_cache(seqs, g)
    total = sum(n for _, _, n in seqs)
    q = torch.randn(total, HEADS, DIM, generator=g)
    batch = AttentionBatch.build(seqs, pages)
    assert (batch.slot is not None) == (len(seqs) == 1)
    assert (batch.mask is None) == (len(seqs) == 1 and seqs[0][1] == 0)

    out = attend(q, k_cache, v_cache, batch)
    assert out.shape == q.shape and not out.isnan().any()
    row = 0
    for slot, start, n in seqs:
        want = reference(q[row : row + n], *contiguous[slot], list(range(start, start + n)))
        torch.testing.assert_close(out[row : row + n], want, atol=1e-5, rtol=1e-4)
        row += n
