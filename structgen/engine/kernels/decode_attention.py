"""Decode attention over the paged KV cache: one new query token per sequence, GQA.

Flash-decoding: the grid is (sequence, kv head, split). Each program takes every query head
of one KV group (so K/V are read once per group, not once per query head), walks its share
of `[0, context_len)` in blocks, and writes an unnormalised partial (acc, max, sum); a second
kernel merges the splits. Keys are read in place through the page table: key position p of
a sequence is row p % page_size of page `page_table[slot, p // page_size]`. The split count
depends only on the batch size and the table's shape, and each program reads its sequence's
slot, pages and length from device tensors, so the launch is graph-safe: no host sync, and
replaying a captured graph with new lengths and pages is correct. Short contexts simply leave
most splits empty: they read no keys, write no partial, and the merge reads only the splits
that hold keys (both compute them from the sequence's length, `_share`).

A step's rows are not all different sequences: a prompt runs as a row per token, and a draft
to verify as a row per draft token, each attending up to its own position. Where an aligned
block of `block_rows` rows belongs to one sequence, the block's first program reads each key
block once for all its rows (a tile of rows x query heads), its splits cut at the block's
longest length, and the block's other programs exit; otherwise every row reads for itself. So
an agent turn's 30-token tail over a 3,000-token cached tool catalogue reads the catalogue
about 4 times a layer, not 30.

`decode_attention_reference` is the torch definition the kernel is tested against.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from structgen.engine.kernels import batch_invariant

BLOCK_N = 32  # keys per inner iteration
# Keys per split at least, in the batch-invariant mode: there the split count is the cap at
# every batch size, and a large batch of short sequences would otherwise write and merge a
# partial for every few keys.
INVARIANT_SPLIT_KEYS = 2 * BLOCK_N
BLOCK_TILE = 32  # query heads (rows x heads of a KV group) a program of consecutive rows takes


@triton.jit
def _share(ctx, window, num_splits, min_keys, BLOCK: tl.constexpr):
    """(first key read, keys per split, splits holding keys) of a sequence of `ctx` keys: an
    equal, block-aligned share of the keys read, at least `min_keys` of them; the split kernel
    and the merge compute it alike, so splits past the last one that holds keys write nothing
    and are never read."""
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # a sliding-window layer's first key
    per_split = tl.maximum(tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK) * BLOCK, min_keys)
    return lo, per_split, tl.cdiv(ctx - lo, per_split)


@triton.jit
def _block_of(b, slots_ptr, lens_ptr, batch, ROWS: tl.constexpr):
    """(first row, whether rows [first, first + ROWS) all attend over one sequence's cache,
    their longest context) of row `b`'s aligned block of ROWS rows."""
    first = (b // ROWS) * ROWS
    r = first + tl.arange(0, ROWS)
    inside = r < batch
    slots = tl.load(slots_ptr + r, mask=inside, other=-1)
    lens = tl.load(lens_ptr + r, mask=inside, other=0)
    same = tl.sum((slots == tl.load(slots_ptr + first)).to(tl.int32), 0) == ROWS
    return first, same, tl.max(lens, 0).to(tl.int32)


@triton.jit
def _attend(
    Q, K, V, pages, lens_ptr, Out, PartO, PartML,
    stride_qn, stride_qh, stride_kt, stride_vt, stride_on, stride_oh,
    first, kvh, split, start, end, used, num_splits, qk_scale,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_POW2: tl.constexpr, ROWS: tl.constexpr,
    TILE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
):
    """Keys [start, end) of one sequence's cache for the query heads of KV head `kvh` of rows
    [first, first + ROWS) (its consecutive tokens, each attending up to its own length): each
    key block is read once for them all. A tile row is (row, head) = divmod(i, GROUP_POW2)."""
    i = tl.arange(0, TILE)
    rows_q = first + i // GROUP_POW2
    heads = kvh * GROUP + i % GROUP_POW2
    valid = (i // GROUP_POW2 < ROWS) & (i % GROUP_POW2 < GROUP)
    ctx = tl.load(lens_ptr + rows_q, mask=valid, other=0)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows_q[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=valid[:, None], other=0.0)

    m_i = tl.full([TILE], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE], tl.float32)
    acc = tl.zeros([TILE, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        nmask = offs < end
        page = tl.load(pages + offs // PAGE, mask=nmask, other=0).to(tl.int64)
        key_rows = page * PAGE + offs % PAGE  # each key's row of the flattened pool
        k = tl.load(K + key_rows[:, None] * stride_kt + d[None, :], mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [TILE, BLOCK] fp32
        s = tl.where(nmask[None, :] & (offs[None, :] < ctx[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row none of whose keys came yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + key_rows[:, None] * stride_vt + d[None, :], mask=nmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if SINGLE_SPLIT:
        out = acc / l_i[:, None]
        tl.store(Out + rows_q[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=valid[:, None])
    else:
        # PartO [B, H, splits, D], PartML [B, H, splits, 2]
        part = (rows_q * NUM_HEADS + heads) * num_splits + split
        # A split with no keys writes nothing (the merge skips it); the test as a vector, which
        # Triton's interpreter needs to combine it with a vector mask.
        wmask = valid & (tl.zeros_like(i) + split < used)
        tl.store(PartO + part[:, None] * HEAD_DIM + d[None, :], acc, mask=wmask[:, None])
        tl.store(PartML + part * 2, m_i, mask=wmask)
        tl.store(PartML + part * 2 + 1, l_i, mask=wmask)


@triton.jit
def _split_kernel(
    Q, K, V, table_ptr, slots_ptr, lens_ptr, Out, PartO, PartML,
    stride_qn, stride_qh, stride_table,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_on, stride_oh,
    batch, num_splits, sm_scale, window, min_keys,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_POW2: tl.constexpr, GROUP_PAD: tl.constexpr,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    qk_scale = sm_scale * 1.4426950408889634  # softmax in the exp2 domain
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    shared = False
    if ROWS > 1:  # a block of one sequence's rows: its first row's program reads for them all
        first, shared, longest = _block_of(b, slots_ptr, lens_ptr, batch, ROWS)
        if shared & (b == first):
            lo, per_split, used = _share(longest, 0, num_splits, min_keys, BLOCK)
            start = split * per_split
            pages = table_ptr + tl.load(slots_ptr + b).to(tl.int64) * stride_table
            _attend(Q, k_base, v_base, pages, lens_ptr, Out, PartO, PartML,
                    stride_qn, stride_qh, stride_kt, stride_vt, stride_on, stride_oh,
                    first, kvh, split, start, tl.minimum(start + per_split, longest), used, num_splits, qk_scale,
                    NUM_HEADS, GROUP, GROUP_POW2, ROWS, ROWS * GROUP_POW2, HEAD_DIM, BLOCK, PAGE, SINGLE_SPLIT)
    if not shared:
        ctx = tl.load(lens_ptr + b).to(tl.int32)
        lo, per_split, used = _share(ctx, window, num_splits, min_keys, BLOCK)
        start = lo + split * per_split
        pages = table_ptr + tl.load(slots_ptr + b).to(tl.int64) * stride_table
        _attend(Q, k_base, v_base, pages, lens_ptr, Out, PartO, PartML,
                stride_qn, stride_qh, stride_kt, stride_vt, stride_on, stride_oh,
                b, kvh, split, start, tl.minimum(start + per_split, ctx), used, num_splits, qk_scale,
                NUM_HEADS, GROUP, GROUP_POW2, 1, GROUP_PAD, HEAD_DIM, BLOCK, PAGE, SINGLE_SPLIT)


@triton.jit
def _merge_kernel(
    PartO, PartML, Out, slots_ptr, lens_ptr, stride_on, stride_oh, batch, num_splits, window, min_keys,
    NUM_HEADS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    if ROWS > 1:  # a row of a one-sequence block was cut as the block's longest row
        first, shared, longest = _block_of(b, slots_ptr, lens_ptr, batch, ROWS)
        ctx = tl.where(shared, longest, ctx)
    used = _share(ctx, window, num_splits, min_keys, BLOCK)[2]
    s = tl.arange(0, SPLITS_PAD)
    smask = s < used
    d = tl.arange(0, HEAD_DIM)
    row = (b * NUM_HEADS + h) * num_splits + s
    m = tl.load(PartML + row * 2, mask=smask, other=float("-inf"))
    lsum = tl.load(PartML + row * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(smask & (lsum > 0), tl.exp2(m - m_max), 0.0)  # empty splits weigh nothing
    acc = tl.load(PartO + row[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
    tl.store(Out + b * stride_on + h * stride_oh + d, out.to(Out.dtype.element_ty))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits_for(batch: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per sequence: enough programs to cover every SM about twice, never more than
    the cache has key blocks. A function of shapes only, so a captured graph stays valid. In
    the batch-invariant mode, the cap whatever the batch: where a sequence's keys are cut, and
    so the order its softmax sums in, then depends on its own length only."""
    cap = max(1, min(32, triton.cdiv(max_seq_len, 4 * BLOCK_N)))
    if batch_invariant():
        return cap
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    want = triton.cdiv(2 * sms, batch * kv_heads)
    return max(1, min(want, cap))


def block_rows(batch: int, group: int, window: int) -> int:
    """Rows a program reads a sequence's keys for at once where they are that many of its
    consecutive tokens (a prompt's or a draft's rows): a tile of BLOCK_TILE query heads; 1
    (every row on its own) in the batch-invariant mode, where a row's sums must not depend on
    its neighbours, on sliding-window layers and in batches of fewer rows."""
    rows = BLOCK_TILE // triton.next_power_of_2(group)
    if batch_invariant() or window > 0 or rows < 2 or batch < rows:
        return 1
    return rows


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, slots: torch.Tensor,
    context_lens: torch.Tensor, window: int = 0,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached keys.

    Parameters
    ----------
    q: [B, heads, head_dim], the new tokens' queries (already rotated).
    k_cache, v_cache: [num_pages, page_size, kv_heads, head_dim], one layer of the paged cache
        (the new token's K/V already written).
    page_table: [rows, max_pages] int64, the page of each slot's positions (page_table.py).
    slots: [B] int, each sequence's row of the table. context_lens: [B] int, tokens to attend
        to (prefix + the new token); positions at and past it are never read.
    window: > 0 for a sliding-window layer: only the last `window` of those keys are read.

    Returns
    -------
    [B, heads, head_dim] in q's dtype.
    """
    batch, heads, dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert heads % kv_heads == 0 and dim & (dim - 1) == 0, "GQA group must divide heads; head_dim a power of 2"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1 and page_table.stride(-1) == 1
    k_rows, v_rows = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    group = heads // kv_heads
    splits = num_splits_for(batch, kv_heads, page_table.shape[1] * page_size, q.device)
    min_keys = INVARIANT_SPLIT_KEYS if batch_invariant() else BLOCK_N  # a share is a block at least
    out = torch.empty_like(q)
    if splits == 1:
        part_o = part_ml = out  # unused
    else:
        part_o = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch, heads, splits, 2, dtype=torch.float32, device=q.device)
    rows = block_rows(batch, group, window)
    _split_kernel[(batch, kv_heads, splits)](
        q, k_rows, v_rows, page_table, slots, context_lens, out, part_o, part_ml,
        q.stride(0), q.stride(1), page_table.stride(0),
        k_rows.stride(0), k_rows.stride(1),
        v_rows.stride(0), v_rows.stride(1),
        out.stride(0), out.stride(1),
        batch, splits, dim**-0.5, window, min_keys,
        NUM_HEADS=heads, GROUP=group, GROUP_POW2=triton.next_power_of_2(group),
        GROUP_PAD=max(16, triton.next_power_of_2(group)), ROWS=rows,
        HEAD_DIM=dim, BLOCK=BLOCK_N, PAGE=page_size, SINGLE_SPLIT=splits == 1,
        num_warps=4, num_stages=2,
    )
    if splits > 1:
        _merge_kernel[(batch, heads)](
            part_o, part_ml, out, slots, context_lens, out.stride(0), out.stride(1), batch, splits, window, min_keys,
            NUM_HEADS=heads, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=dim, BLOCK=BLOCK_N, ROWS=rows,
            num_warps=1,
        )
    return out


def decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, slots: torch.Tensor,
    context_lens: torch.Tensor, window: int = 0,
) -> torch.Tensor:
    """The definition, in float64 on the host: softmax(q k^T / sqrt(d)) v per sequence over
    positions `[0, context_len)` of its pages (the last `window` of them where window > 0),
    query head h reading KV head h // (heads / kv_heads)."""
    heads, dim = q.shape[1], q.shape[2]
    page_size, group = k_cache.shape[1], heads // k_cache.shape[2]
    outs = []
    for i, (slot, n) in enumerate(zip(slots.tolist(), context_lens.tolist(), strict=True)):
        lo = max(0, n - window) if window > 0 else 0
        pages = page_table[slot, : -(-n // page_size)].cpu()
        keys = k_cache.cpu()[pages].flatten(0, 1)[lo:n]  # [n - lo, kv_heads, D]
        values = v_cache.cpu()[pages].flatten(0, 1)[lo:n]
        k = keys.double().repeat_interleave(group, dim=1)  # [n, heads, D]
        v = values.double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double().cpu(), k) * dim**-0.5
        outs.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v))
    return torch.stack(outs).to(q.dtype)
