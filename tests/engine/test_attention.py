"""The torch attention path over the paged cache against a naive reference on each sequence's
contiguous keys, for each way a step can be laid out: one fresh prompt (plain causal), one
sequence with a cached prefix (chunked prefill, forced text), and several sequences of
different lengths (gathered, padded, stale rows zeroed). Pages are small and handed out
interleaved between the sequences, so no sequence's pages are contiguous; the pool's unused
rows hold NaN, as uninitialised memory may."""

from __future__ import annotations

import math

import numpy as np
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


# ----------------------------------------------------------------------------- the cascade's prefix


def agent_turns(prompts: list[list[int]]) -> tuple[PageTable, list[int]]:
    """A prefix-caching page table (16-token pages) holding each prompt in a slot of its own, as
    the engine admits them one after another: each maps the cached pages its prompt starts with,
    covers the rest and publishes its full pages. Returns the table and the slots."""
    pages = PageTable(200, 16, 12, 1024, torch.device("cpu"))
    slots = []
    for prompt in prompts:
        slot = pages.allocate_slot()
        pages.match_prefix(slot, prompt, len(prompt))
        assert pages.cover(slot, len(prompt))
        pages.publish(slot, prompt, len(prompt), len(prompt))
        slots.append(slot)
    return pages, slots


SYSTEM = list(range(1000, 1300))  # 300 tokens: 18 whole pages


def test_common_pages_are_the_leading_pages_every_slot_maps_alike():
    """Prompts sharing a 300-token system prompt share its 18 whole pages; with another system
    prompt nothing; the same prompt all of its pages but the last (which match_prefix never
    maps, so its last token is run again); `limit` caps the count."""
    turns = [SYSTEM + [7, i, 8] for i in range(4)]
    pages, slots = agent_turns(turns + [list(range(2000, 2300)), turns[0]])
    four = np.array(slots[:4])
    assert pages.common_pages(four, 100) == 18
    assert pages.common_pages(four, 5) == 5
    assert pages.common_pages(np.append(four, slots[4]), 100) == 0
    assert pages.common_pages(np.array([slots[0], slots[5]]), 100) == 18
    assert pages.common_pages(np.array([slots[1]] * 3), 19) == 19  # one slot shares all its pages with itself


def test_cascade_prefix_is_the_shared_pages_before_every_rows_position():
    """A step's rows over prompts sharing SYSTEM get its whole pages (288 keys); a row whose
    position lies inside those pages caps the prefix at its own page (then too short to pay);
    a step of few rows, or whose prompts share nothing, gets none."""
    from structgen.engine.attention import CASCADE_MIN_ROWS, cascade_prefix

    pages, slots = agent_turns([SYSTEM + [7, i, 8] for i in range(10)] + [list(range(2000, 2310))])

    def prefix(rows: list[tuple[int, int]]) -> int:  # (slot, position) per row
        return cascade_prefix(pages, np.array([s for s, _ in rows]), np.array([p for _, p in rows]))

    decode = [(s, 303 + i) for i, s in enumerate(slots[:10])]
    assert prefix(decode) == 288
    assert prefix([(s, p) for s in slots[:9] for p in (300, 301, 302)]) == 288  # prompt tails
    assert prefix(decode[:9] + [(slots[9], 280)]) == 272  # 17 whole pages before 280
    assert prefix(decode[:9] + [(slots[9], 100)]) == 0  # 96 keys: below CASCADE_MIN_KEYS
    assert prefix(decode[: CASCADE_MIN_ROWS - 1]) == 0
    assert prefix(decode[:9] + [(slots[10], 303)]) == 0
    assert prefix([(slots[0], p) for p in range(290, 302)]) == 288  # one sequence's tail
