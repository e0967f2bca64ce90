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

Cascade over a shared prefix (`prefix_len`): where every row's first `prefix_len` keys are the
same pages (prefix caching gives agent turns one copy of a long system prompt), reading those
pages once per row wastes the bandwidth and leaves the tensor cores idle (a program's query
tile is one row's GROUP heads). A third kernel, grid (block of rows, kv head, prefix split),
takes ROWS consecutive rows x GROUP heads as the M side of its dot products and walks its
share of the prefix once for all of them; the split kernel then walks each row's keys from
`prefix_len` on, and folds the prefix's partials into its output where a row has one split
(no merge launch), or leaves both kinds of partial to the merge. The length is a device scalar,
so a captured graph stays valid whatever the next step's prefix is, 0 included (the prefix
programs then read nothing, and the output is the plain kernel's). A row whose context does not
reach past the prefix (a graph's padding row) ignores it.

`decode_attention_reference` is the torch definition the kernel is tested against.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from structgen.engine.kernels import batch_invariant
from structgen.engine.kernels.dependent_launch import launch_args, wait_for_inputs

BLOCK_N = 32  # keys per inner iteration
# A program whose share of a context is at least WIDE_MIN_KEYS keys walks it WIDE_BLOCK_N keys
# an iteration: its walk is a chain of dependent page-and-key loads, bound by their latency
# (many rows over long contexts: an agent turn's tail; docs/performance.md, "Serving under load").
WIDE_BLOCK_N = 64
WIDE_MIN_KEYS = 8 * BLOCK_N
# Keys per split at least, in the batch-invariant mode: there the split count is the cap at
# every batch size, and a large batch of short sequences would otherwise write and merge a
# partial for every few keys.
INVARIANT_SPLIT_KEYS = 2 * BLOCK_N
# A prefix program's query tile: rows x GROUP heads up to this many (the M side of its dots).
PREFIX_TILE = 64
PREFIX_MIN_KEYS = 4 * WIDE_BLOCK_N  # keys per prefix split at least: a split's partials cost a write and a read


@triton.jit
def _share(ctx, pre, window, num_splits, min_keys, BLOCK: tl.constexpr):
    """(first key read, keys per split, splits holding keys) of a row of `ctx` keys whose first
    `pre` the prefix programs read: an equal, block-aligned share of the keys read, at least
    `min_keys` of them; the kernels compute it alike, so splits past the last one that holds
    keys write nothing and are never read."""
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), pre)  # a sliding-window layer's first key
    per_split = tl.maximum(tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK) * BLOCK, min_keys)
    return lo, per_split, tl.cdiv(ctx - lo, per_split)


@triton.jit
def _row_prefix(prefix_ptr, ctx, CASCADE: tl.constexpr):
    """The keys of a row the prefix programs read: the step's prefix, where the row's context
    reaches past it (every real row's does; a padding row's does not)."""
    pre = ctx * 0
    if CASCADE:
        prefix = tl.load(prefix_ptr).to(tl.int32)
        pre = tl.where(ctx > prefix, prefix, 0)
    return pre


@triton.jit
def _walk(q, m_i, l_i, acc, pages, k_base, v_base, start, end, stride_kt, stride_vt, qk_scale,
          HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr):
    """The online softmax of `q` over keys [start, end) of one sequence, BLOCK keys at a time:
    (max, sum, unnormalised output) updated from the given ones."""
    d = tl.arange(0, HEAD_DIM)
    for n0 in range(start, end, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        nmask = offs < end
        page = tl.load(pages + offs // PAGE, mask=nmask, other=0).to(tl.int64)
        rows = page * PAGE + offs % PAGE  # each key's row of the flattened pool
        k = tl.load(k_base + rows[:, None] * stride_kt + d[None, :], mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [GROUP_PAD, BLOCK] fp32
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + rows[:, None] * stride_vt + d[None, :], mask=nmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _prefix_share(prefix, prefix_splits, BLOCK: tl.constexpr, MIN_KEYS: tl.constexpr):
    """(keys per prefix split, prefix splits holding keys): equal shares of whole blocks,
    MIN_KEYS at least; the prefix kernel and the ones that read its partials compute it alike."""
    per_split = tl.maximum(tl.cdiv(tl.cdiv(prefix, prefix_splits), BLOCK) * BLOCK, MIN_KEYS)
    return per_split, tl.cdiv(prefix, per_split)


@triton.jit
def _fold_partials(m_i, l_i, acc, PartO, PartML, first, count, hmask, HEAD_DIM: tl.constexpr):
    """An online softmax state (max, sum, unnormalised output per head) combined with `count`
    partials, at rows first, first + 1, ... of PartO / PartML (per head)."""
    d = tl.arange(0, HEAD_DIM)
    for i in range(0, count):
        row = first + i
        m_p = tl.load(PartML + row * 2, mask=hmask, other=float("-inf"))
        l_p = tl.load(PartML + row * 2 + 1, mask=hmask, other=0.0)
        acc_p = tl.load(PartO + row[:, None] * HEAD_DIM + d[None, :], mask=hmask[:, None], other=0.0)
        m_new = tl.maximum(m_i, m_p)
        alpha, beta = tl.exp2(m_i - m_new), tl.exp2(m_p - m_new)
        l_i = l_i * alpha + l_p * beta
        acc = acc * alpha[:, None] + acc_p * beta[:, None]
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _split_kernel(
    Q, K, V, table_ptr, slots_ptr, lens_ptr, prefix_ptr, Out, PartO, PartML,
    stride_qn, stride_qh, stride_table,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_on, stride_oh,
    num_splits, total_splits, prefix_splits, sm_scale, window, min_keys, wide_min,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, WIDE_BLOCK: tl.constexpr, PAGE: tl.constexpr,
    PREFIX_BLOCK: tl.constexpr, PREFIX_MIN: tl.constexpr, CASCADE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    pre = _row_prefix(prefix_ptr, ctx, CASCADE)
    lo, per_split, used = _share(ctx, pre, window, num_splits, min_keys, BLOCK)
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g
    hmask = g < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    pages = table_ptr + slot * stride_table
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    qk_scale = sm_scale * 1.4426950408889634  # softmax in the exp2 domain
    wide_end = tl.where(end - start >= wide_min, end, start)  # a long share walks wide blocks
    m_i, l_i, acc = _walk(q, m_i, l_i, acc, pages, k_base, v_base, start, wide_end, stride_kt, stride_vt,
                          qk_scale, HEAD_DIM, WIDE_BLOCK, PAGE)
    m_i, l_i, acc = _walk(q, m_i, l_i, acc, pages, k_base, v_base, wide_end, end, stride_kt, stride_vt,
                          qk_scale, HEAD_DIM, BLOCK, PAGE)

    if num_splits == 1:  # the row's only split writes its output: no merge kernel
        if CASCADE:  # with the prefix programs' partials folded in
            first = (b * NUM_HEADS + heads) * total_splits + num_splits
            count = tl.where(pre > 0, _prefix_share(pre, prefix_splits, PREFIX_BLOCK, PREFIX_MIN)[1], 0)
            m_i, l_i, acc = _fold_partials(m_i, l_i, acc, PartO, PartML, first, count, hmask, HEAD_DIM)
        out = acc / l_i[:, None]
        tl.store(Out + b * stride_on + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=hmask[:, None])
    else:
        # PartO [B, H, total_splits, D], PartML [B, H, total_splits, 2]: the row's own splits
        # first, the prefix programs' after them.
        row = (b * NUM_HEADS + heads) * total_splits + split
        # A split with no keys writes nothing (the merge skips it); the test as a vector, which
        # Triton's interpreter needs to combine it with a vector mask.
        wmask = hmask & (tl.zeros_like(g) + split < used)
        tl.store(PartO + row[:, None] * HEAD_DIM + d[None, :], acc, mask=wmask[:, None])
        tl.store(PartML + row * 2, m_i, mask=wmask)
        tl.store(PartML + row * 2 + 1, l_i, mask=wmask)


@triton.jit
def _prefix_kernel(
    Q, K, V, table_ptr, slots_ptr, lens_ptr, prefix_ptr, PartO, PartML,
    batch, stride_qn, stride_qh, stride_table,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    num_splits, total_splits, prefix_splits, sm_scale,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, MIN_KEYS: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr,
):
    """ROWS rows x GROUP heads of one KV head over one share of the prefix's keys, read once
    through row 0's pages (the prefix's pages are every row's), into partials after the rows'
    own splits. Rows whose context ends within the prefix write partials the merge ignores."""
    wait_for_inputs(PDL)
    block = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    prefix = tl.load(prefix_ptr).to(tl.int32)
    per_split, _ = _prefix_share(prefix, prefix_splits, BLOCK, MIN_KEYS)
    start = split * per_split
    end = tl.minimum(start + per_split, prefix)
    if start < end:
        t = tl.arange(0, TILE)  # tile row t: row `block * ROWS + t // GROUP`, head `t % GROUP` of the group
        rows = block * ROWS + t // GROUP
        heads = kvh * GROUP + t % GROUP
        tmask = (t < ROWS * GROUP) & (rows < batch)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + rows[:, None].to(tl.int64) * stride_qn + heads[:, None] * stride_qh + d[None, :],
                    mask=tmask[:, None], other=0.0)
        m_i = tl.full([TILE], float("-inf"), tl.float32)
        l_i = tl.zeros([TILE], tl.float32)
        acc = tl.zeros([TILE, HEAD_DIM], tl.float32)
        pages = table_ptr + tl.load(slots_ptr).to(tl.int64) * stride_table
        qk_scale = sm_scale * 1.4426950408889634
        m_i, l_i, acc = _walk(q, m_i, l_i, acc, pages, K + kvh * stride_kh, V + kvh * stride_vh, start, end,
                              stride_kt, stride_vt, qk_scale, HEAD_DIM, BLOCK, PAGE)
        part = (rows.to(tl.int64) * NUM_HEADS + heads) * total_splits + num_splits + split
        tl.store(PartO + part[:, None] * HEAD_DIM + d[None, :], acc, mask=tmask[:, None])
        tl.store(PartML + part * 2, m_i, mask=tmask)
        tl.store(PartML + part * 2 + 1, l_i, mask=tmask)


@triton.jit
def _merge_kernel(
    PartO, PartML, Out, lens_ptr, prefix_ptr, stride_on, stride_oh, num_splits, total_splits, prefix_splits,
    window, min_keys,
    NUM_HEADS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    PREFIX_BLOCK: tl.constexpr, PREFIX_MIN: tl.constexpr, CASCADE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    pre = _row_prefix(prefix_ptr, ctx, CASCADE)
    used = _share(ctx, pre, window, num_splits, min_keys, BLOCK)[2]
    s = tl.arange(0, SPLITS_PAD)
    smask = s < used
    if CASCADE:  # and the prefix programs' partials, after the row's own
        prefix_used = tl.where(pre > 0, _prefix_share(pre, prefix_splits, PREFIX_BLOCK, PREFIX_MIN)[1], 0)
        smask = smask | ((s >= num_splits) & (s < num_splits + prefix_used))
    d = tl.arange(0, HEAD_DIM)
    row = (b * NUM_HEADS + h) * total_splits + s
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


def prefix_splits_for(batch: int, kv_heads: int, max_seq_len: int, device: torch.device, group: int) -> int:
    """Splits of the shared prefix: with the row blocks and KV heads, enough programs to cover
    every SM about twice, never more than the cache holds prefix shares. Shapes only."""
    cap = max(1, min(32, triton.cdiv(max_seq_len, PREFIX_MIN_KEYS)))
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    want = triton.cdiv(2 * sms, triton.cdiv(batch, _prefix_rows(group)) * kv_heads)
    return max(1, min(want, cap))


def _prefix_rows(group: int) -> int:
    """Rows a prefix program takes: as many whole GQA groups as fill its query tile."""
    return max(1, PREFIX_TILE // group)


def _read_prefix(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, page_table: torch.Tensor,
                 slots: torch.Tensor, context_lens: torch.Tensor, prefix_len: torch.Tensor, part_o: torch.Tensor,
                 part_ml: torch.Tensor, splits: int, prefix_splits: int, page_size: int) -> None:
    """Launch the prefix programs: partials of every row over the shared prefix, in PartO /
    PartML after the rows' own `splits`."""
    batch, heads, dim = q.shape
    kv_heads = k_rows.shape[1]
    group = heads // kv_heads
    rows = _prefix_rows(group)
    _prefix_kernel[(triton.cdiv(batch, rows), kv_heads, prefix_splits)](
        q, k_rows, v_rows, page_table, slots, context_lens, prefix_len, part_o, part_ml,
        batch, q.stride(0), q.stride(1), page_table.stride(0),
        k_rows.stride(0), k_rows.stride(1), v_rows.stride(0), v_rows.stride(1),
        splits, splits + prefix_splits, prefix_splits, dim**-0.5,
        NUM_HEADS=heads, GROUP=group, ROWS=rows, TILE=max(16, triton.next_power_of_2(rows * group)),
        HEAD_DIM=dim, BLOCK=WIDE_BLOCK_N, MIN_KEYS=PREFIX_MIN_KEYS, PAGE=page_size,
        num_warps=4 if dim <= 64 else 8, num_stages=2, **launch_args(q.device, batch),
    )


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, slots: torch.Tensor,
    context_lens: torch.Tensor, window: int = 0, prefix_len: torch.Tensor | int = 0,
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
    prefix_len: keys [0, prefix_len) that are the same pages for every row whose context is
        longer than it (row 0's context must be): a device int tensor of one element (read
        by the kernels, so a graph replays with any value), or an int. Those keys are read
        once per block of rows (the cascade, above). 0: none. Ignored with a window and in
        the batch-invariant mode, where a row's result must not depend on its neighbours.

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
    max_seq_len = page_table.shape[1] * page_size
    splits = num_splits_for(batch, kv_heads, max_seq_len, q.device)
    cascade = window == 0 and not batch_invariant() and not (isinstance(prefix_len, int) and prefix_len == 0)
    prefix_splits = prefix_splits_for(batch, kv_heads, max_seq_len, q.device, group) if cascade else 0
    total = splits + prefix_splits
    if cascade and isinstance(prefix_len, int):
        prefix_len = torch.tensor([prefix_len], dtype=torch.int64, device=q.device)
    prefix_ptr = prefix_len if cascade else context_lens  # (unread without the cascade)
    min_keys = INVARIANT_SPLIT_KEYS if batch_invariant() else BLOCK_N  # a share is a block at least
    out = torch.empty_like(q)
    if total == 1:
        part_o = part_ml = out  # unused
    else:
        part_o = torch.empty(batch, heads, total, dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch, heads, total, 2, dtype=torch.float32, device=q.device)
    if cascade:
        _read_prefix(q, k_rows, v_rows, page_table, slots, context_lens, prefix_len, part_o, part_ml, splits,
                     prefix_splits, page_size)
    _split_kernel[(batch, kv_heads, splits)](
        q, k_rows, v_rows, page_table, slots, context_lens, prefix_ptr, out, part_o, part_ml,
        q.stride(0), q.stride(1), page_table.stride(0),
        k_rows.stride(0), k_rows.stride(1),
        v_rows.stride(0), v_rows.stride(1),
        out.stride(0), out.stride(1),
        splits, total, prefix_splits, dim**-0.5, window, min_keys,
        WIDE_MIN_KEYS if not batch_invariant() else 1 << 30,  # the invariant mode's order of sums is fixed
        NUM_HEADS=heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=dim, BLOCK=BLOCK_N, WIDE_BLOCK=WIDE_BLOCK_N, PAGE=page_size,
        PREFIX_BLOCK=WIDE_BLOCK_N, PREFIX_MIN=PREFIX_MIN_KEYS, CASCADE=cascade,
        num_warps=4, num_stages=2, **launch_args(q.device, batch),
    )
    if splits > 1:
        _merge_kernel[(batch, heads)](
            part_o, part_ml, out, context_lens, prefix_ptr, out.stride(0), out.stride(1), splits, total,
            prefix_splits, window, min_keys,
            NUM_HEADS=heads, SPLITS_PAD=triton.next_power_of_2(total), HEAD_DIM=dim, BLOCK=BLOCK_N,
            PREFIX_BLOCK=WIDE_BLOCK_N, PREFIX_MIN=PREFIX_MIN_KEYS, CASCADE=cascade,
            num_warps=1, **launch_args(q.device, batch),
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
