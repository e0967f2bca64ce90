"""Attention over the paged KV cache for a flat batch of new tokens.

`AttentionBatch` is built once per step by the runner and shared by every layer: whatever
does not depend on the layer (each token's cache row, the sequences' pages, the causal mask,
which cache rows are stale) is computed there, once, not in each of the model's layers. The
torch path gathers each sequence's pages (its row of the page table) into a contiguous
[batch, max_ctx] view of its keys, pads queries to [batch, max_new_tokens] and keys to the
longest context in the batch, so it reads only valid KV (up to padding), never the full
`max_seq_len`. CUDA decode uses the Triton kernel in `kernels/decode_attention.py`, which reads
the pages in place through the page table, and reads a prefix that every row shares once per
block of rows instead of once per row (its cascade; `cascade_prefix` picks the prefix).

Why it matters: an eager step (an extend, a CPU step) pays a host launch for every small
torch op, so for a small model's many layers the host, not the GPU, sets its time
(docs/performance.md, "Prefill and time to first token").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from structgen.engine.page_table import PageTable


# The decode kernel's cascade runs where it pays for its extra launch and partials: a common
# prefix of a whole prefix split at least (kernels/decode_attention.py, PREFIX_MIN_KEYS), read
# once instead of by each of 8 rows or more (below that, per-row reads cost about what the
# prefix programs' mostly empty query tiles and the merge of their partials do).
CASCADE_MIN_KEYS = 256
CASCADE_MIN_ROWS = 8


def cascade_prefix(pages: PageTable, slots: np.ndarray, positions: np.ndarray) -> int:
    """Keys of the step's common prefix for the decode kernel (`decode_attention`'s
    `prefix_len`), given each row's slot and position: the leading pages that every row's slot
    maps to the same pages, whole pages before every row's position (a row attends to its
    prefix with no causal mask); 0 where it is shorter than CASCADE_MIN_KEYS or the step has
    fewer than CASCADE_MIN_ROWS rows."""
    if len(slots) < CASCADE_MIN_ROWS:
        return 0
    limit = int(positions.min()) // pages.page_size
    if limit * pages.page_size < CASCADE_MIN_KEYS:
        return 0
    keys = pages.common_pages(slots, limit) * pages.page_size
    return keys if keys >= CASCADE_MIN_KEYS else 0


@dataclass
class AttentionBatch:
    positions: torch.Tensor  # [N] absolute position of each new token
    token_slots: torch.Tensor  # [N] cache row of each new token: page * page_size + offset
    slots: torch.Tensor  # [B] each sequence's row of the page table
    page_table: torch.Tensor  # [slots + 1, max pages a sequence] page of each slot's positions
    context_lens: torch.Tensor  # [B] tokens in cache after this step (prefix + new)
    pad_index: torch.Tensor  # [N] index of each new token in the padded [B * max_q] layout
    mask: torch.Tensor | None  # [B, 1, max_q, max_ctx] bool, True = may attend
    max_q: int  # most new tokens of any sequence this step
    max_ctx: int  # longest context this step
    decode_kernel: bool = False  # every sequence has one new token and the GPU kernel is usable
    stale: torch.Tensor | None = None  # [B, max_ctx, 1, 1] bool: cache rows past a sequence's length
    slot: int | None = None  # the slot, when the step has one sequence
    # [B, pages of max_ctx]: each sequence's pages, for the torch path (None in the graphs).
    block_table: torch.Tensor | None = None
    # One sequence whose pages are consecutive: the first, so its keys are a view of the pool.
    first_page: int | None = None
    # [1] the step's common prefix for the decode kernel (`cascade_prefix`); None: none.
    prefix_len: torch.Tensor | None = None
    # This batch seen through a sliding window, by window size: built on first use, shared by
    # every layer with that window.
    _windowed: dict[int, AttentionBatch] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, seqs: list[tuple[int, int, int]], pages: PageTable, decode_kernel: bool = False,
              cascade: bool = False) -> AttentionBatch:
        """`seqs`: (slot, start position, number of new tokens) per sequence, whose pages
        `pages` maps already. Brings the device copy of the page table up to date first.
        `cascade`: the decode kernel reads the rows' common prefix once (`cascade_prefix`)."""
        pages.sync()
        device = pages.table.device
        max_q = max(n for _, _, n in seqs)
        max_ctx = max(s + n for _, s, n in seqs)
        positions, pad_index = [], []
        for b, (_, start, n) in enumerate(seqs):
            positions.extend(range(start, start + n))
            pad_index.extend(range(b * max_q, b * max_q + n))
        token_slots = np.concatenate([pages.token_slots(slot, start, n) for slot, start, n in seqs])
        as_long = dict(dtype=torch.long, device=device)
        slot_list = [s for s, _, _ in seqs]
        slots = torch.tensor(slot_list, **as_long)
        starts = torch.tensor([s for _, s, _ in seqs], **as_long)
        lens = torch.tensor([s + n for _, s, n in seqs], **as_long)
        block_table = first_page = prefix_len = None
        if decode_kernel and cascade:
            prefix = cascade_prefix(pages, np.array(slot_list), np.array([s for _, s, _ in seqs]))
            prefix_len = torch.tensor([prefix], **as_long) if prefix else None
        if not decode_kernel:
            rows = pages.host.numpy()[slot_list, : pages.pages_for(max_ctx)]
            block_table = torch.from_numpy(rows).to(device)
            if len(seqs) == 1 and (rows[0, -1] - rows[0, 0] == rows.shape[1] - 1) and (np.diff(rows[0]) == 1).all():
                first_page = int(rows[0, 0])
        mask = stale = None
        one = len(seqs) == 1
        if not decode_kernel and not (one and seqs[0][1] == 0):  # a fresh prompt is plain causal
            q_pos = starts[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, max_q]
            k_pos = torch.arange(max_ctx, device=device)
            mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < lens[:, None, None])
            mask = mask.unsqueeze(1)
            if not one:  # one sequence's context is max_ctx: nothing stale
                stale = (k_pos[None, :] >= lens[:, None])[:, :, None, None]
        return cls(
            positions=torch.tensor(positions, **as_long),
            token_slots=torch.from_numpy(token_slots).to(device),
            slots=slots,
            page_table=pages.table,
            context_lens=lens,
            pad_index=torch.tensor(pad_index, **as_long),
            mask=mask,
            max_q=max_q,
            max_ctx=max_ctx,
            decode_kernel=decode_kernel,
            stale=stale,
            slot=seqs[0][0] if one else None,
            block_table=block_table,
            first_page=first_page,
            prefix_len=prefix_len,
        )

    def windowed(self, window: int) -> AttentionBatch:
        """This batch with each query seeing only the last `window` keys up to itself (keys at
        positions p with q - window < p <= q: transformers' sliding-window mask). Itself where
        no context is longer than the window."""
        if self.max_ctx <= window or self.decode_kernel:
            return self
        if window not in self._windowed:
            b, dev = self.slots.shape[0], self.positions.device
            q_pos = torch.zeros(b * self.max_q, dtype=torch.long, device=dev)
            q_pos[self.pad_index] = self.positions
            q_pos = q_pos.view(b, 1, self.max_q, 1)
            k_pos = torch.arange(self.max_ctx, device=dev).view(1, 1, 1, -1)
            seen = self.mask if self.mask is not None else k_pos <= q_pos
            self._windowed[window] = replace(self, mask=seen & (k_pos > q_pos - window), _windowed={})
        return self._windowed[window]


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
           window: int | None = None) -> torch.Tensor:
    """q: [N, heads, head_dim] -> [N, heads, head_dim], causal over each sequence's cache; with
    a `window`, over its last `window` keys only (sliding-window layers)."""
    if batch.decode_kernel:
        from structgen.engine.kernels.decode_attention import decode_attention

        prefix = batch.prefix_len if batch.prefix_len is not None else 0
        return decode_attention(q, k_cache, v_cache, batch.page_table, batch.slots, batch.context_lens,
                                window=window or 0, prefix_len=prefix)
    if window is not None:
        batch = batch.windowed(window)
    n, heads, dim = q.shape
    k, v = _gather_pages(k_cache, batch), _gather_pages(v_cache, batch)  # [B, ctx, kv_heads, D]
    if batch.slot is not None:  # one sequence: its new tokens are its queries
        out = _sdpa(q.unsqueeze(0).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), batch)
        return out.transpose(1, 2).reshape(n, heads, dim)
    b = batch.slots.shape[0]
    if batch.max_q == 1 and n == b:
        qp = q.unsqueeze(2)  # [B, H, 1, D]
    else:
        qp = q.new_zeros(b * batch.max_q, heads, dim)
        qp[batch.pad_index] = q
        qp = qp.view(b, batch.max_q, heads, dim).transpose(1, 2)
    # Past each sequence's length lies stale or never-written memory (the cache is torch.empty):
    # zero it, or a NaN there would leak through the masked-out scores (0 * NaN = NaN).
    k = k.masked_fill_(batch.stale, 0.0).transpose(1, 2)  # [B, kv_heads, ctx, D]
    v = v.masked_fill_(batch.stale, 0.0).transpose(1, 2)
    out = _sdpa(qp, k, v, batch)
    out = out.transpose(1, 2).reshape(b * batch.max_q, heads, dim)
    return out if batch.max_q == 1 and n == b else out[batch.pad_index]


def _gather_pages(cache: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """Each sequence's first `max_ctx` cached positions, contiguous: [B, max_ctx, kv_heads, D]
    (gathered page by page through the batch's block table, or a view where one sequence's
    pages are consecutive)."""
    if batch.first_page is not None:
        n = batch.block_table.shape[1]
        return cache[batch.first_page : batch.first_page + n].view(1, -1, *cache.shape[2:])[:, : batch.max_ctx]
    pages = cache[batch.block_table]  # [B, pages, page_size, kv_heads, D]
    b, p, size = pages.shape[:3]
    return pages.view(b, p * size, *cache.shape[2:])[:, : batch.max_ctx]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """SDPA over [B, H, q, D] queries and [B, kv_heads, ctx, D] keys/values.

    On CUDA, never its cuDNN backend (the one torch picks for a masked prefill): cuDNN builds
    a graph for every new query/key length, a large host cost paid on nearly every new prompt
    (docs/performance.md, "Prefill and time to first token"). Instead: one sequence with no
    cached prefix is plain causal attention (flash); anything else takes the efficient kernel
    with the mask, on key/value heads repeated for GQA (it has no GQA of its own, and the math
    fallback is several times slower)."""
    group = q.shape[1] // k.shape[1]
    causal = batch.mask is None  # one sequence with no cached prefix
    if not q.is_cuda and q.shape[2] == 1:
        return _one_query_attention(q, k, v, batch.mask)
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, is_causal=causal, enable_gqa=group > 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if causal:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=group > 1)
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask)


def _one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one query a sequence ([B, H, 1, D]) on the CPU in three small products:
    SDPA's CPU kernel has a fixed cost per call that dominates a decode step's attention."""
    b, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    scores = torch.matmul(q.reshape(b, kv_heads, heads // kv_heads, dim), k.transpose(-1, -2)) * dim**-0.5
    if mask is not None:
        scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).reshape(b, heads, 1, dim)
