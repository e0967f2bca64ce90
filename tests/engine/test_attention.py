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


def test_common_pages_kept_between_steps_equal_a_fresh_comparison_whatever_changes():
    """`common_pages` keeps its last answer for the same slots until a column it compared
    changes: along random admissions, growth, rollbacks and releases of turns sharing a
    prefix (one of them computing a copy of a shared page of its own), every answer equals
    comparing the table afresh."""
    rng = np.random.default_rng(0)
    pages = PageTable(400, 16, 12, 1024, torch.device("cpu"))
    running: dict[int, list[int]] = {}  # slot -> its tokens

    def fresh(slots: np.ndarray, limit: int) -> int:
        rows = pages._host_np[np.unique(slots), :limit]
        parted = (rows != rows[0]).any(axis=0)
        return int(parted.argmax()) if parted.any() else limit

    for _ in range(2000):
        op = rng.integers(5)
        if op == 0 and pages.free_slots:  # admit a turn over SYSTEM, or its own prompt
            tokens = (SYSTEM if rng.random() < 0.8 else list(range(5000, 5100))) + [int(t) for t in rng.integers(0, 9, 20)]
            slot = pages.allocate_slot()
            if rng.random() < 0.2:  # computed whole beside the cached copy: pages of its own
                pages.match_prefix(slot, [], 0)
            else:
                pages.match_prefix(slot, tokens, len(tokens))
            if pages.cover(slot, len(tokens)):
                pages.publish(slot, tokens, len(tokens), len(tokens))
                running[slot] = tokens
            else:
                pages.release_slot(slot)
        elif op == 1 and running:  # a turn grows
            slot = int(rng.choice(list(running)))
            running[slot] += [int(t) for t in rng.integers(0, 9, int(rng.integers(1, 160)))]
            if not pages.cover(slot, len(running[slot])):
                pages.release_slot(slot)
                del running[slot]
        elif op == 2 and running:  # a rollback
            slot = int(rng.choice(list(running)))
            keep = int(rng.integers(1, len(running[slot]) + 1))
            running[slot] = running[slot][:keep]
            pages.shrink(slot, keep)
        elif op == 3 and running:  # a turn leaves
            slot = int(rng.choice(list(running)))
            pages.release_slot(slot)
            del running[slot]
        elif running:  # a step over some of them
            chosen = [int(s) for s in rng.choice(list(running), int(rng.integers(1, len(running) + 1)), replace=False)]
            slots = np.array(sorted(chosen * 2))
            limit = min(len(running[s]) for s in chosen) // 16
            assert pages.common_pages(slots, limit) == fresh(slots, limit)
        if running:  # and a step over all of them after every change, two rows each
            slots = np.array(sorted(list(running) * 2))
            limit = min(len(t) for t in running.values()) // 16
            assert pages.common_pages(slots, limit) == fresh(slots, limit)


def test_common_pages_see_a_shared_page_replaced_by_a_rollback_and_regrowth():
    """Three turns share SYSTEM's 18 pages; one rolls back into them and grows again into
    pages of its own: the same slots' next answer parts there, at page 7, not the 18 kept."""
    turns = [SYSTEM + [7, i, 8] for i in range(3)]
    pages, slots = agent_turns(turns)
    rows = np.array(sorted(slots * 2))
    assert pages.common_pages(rows, 18) == 18
    pages.shrink(slots[1], 112)  # keeps pages 0-6
    assert pages.common_pages(rows, 7) == 7
    assert pages.cover(slots[1], 320)  # its own pages from page 7 on
    assert pages.common_pages(rows, 19) == 7


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
