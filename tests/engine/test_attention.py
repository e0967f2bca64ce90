"""The torch attention path against a naive reference, for each way a step can be laid out:
one fresh prompt (plain causal over a view of its slot), one sequence with a cached prefix
(chunked prefill, forced text), and several sequences of different lengths (gathered, padded,
stale rows zeroed). The cache's unused rows hold NaN, as uninitialised memory may."""

from __future__ import annotations

import math

import pytest
import torch

from structgen.engine.attention import AttentionBatch, attend

HEADS, KV_HEADS, DIM, SLOTS, MAX_LEN = 4, 2, 16, 5, 48


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
        [(3, 12, 5)],  # one sequence after a cached prefix of 12
        [(0, 0, 6), (2, 20, 1), (4, 7, 3)],  # three sequences, ragged
    ],
)
def test_attend_matches_naive_causal_attention(seqs):
    g = torch.Generator().manual_seed(0)
    k_cache = torch.full((SLOTS, MAX_LEN, KV_HEADS, DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for slot, start, n in seqs:  # the prefix and this step's tokens are written, the rest NaN
        k_cache[slot, : start + n] = torch.randn(start + n, KV_HEADS, DIM, generator=g)
        v_cache[slot, : start + n] = torch.randn(start + n, KV_HEADS, DIM, generator=g)
    total = sum(n for _, _, n in seqs)
    q = torch.randn(total, HEADS, DIM, generator=g)
    batch = AttentionBatch.build(seqs, torch.device("cpu"))
    assert (batch.slot is not None) == (len(seqs) == 1)
    assert (batch.mask is None) == (len(seqs) == 1 and seqs[0][1] == 0)

    out = attend(q, k_cache, v_cache, batch)
    assert out.shape == q.shape and not out.isnan().any()
    row = 0
    for slot, start, n in seqs:
        want = reference(q[row : row + n], k_cache[slot], v_cache[slot], list(range(start, start + n)))
        torch.testing.assert_close(out[row : row + n], want, atol=1e-5, rtol=1e-4)
        row += n
