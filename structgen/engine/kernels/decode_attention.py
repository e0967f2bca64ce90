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
def _split_kernel(
    Q, K, V, table_ptr, slots_ptr, lens_ptr, Out, PartO, PartML,
    stride_qn, stride_qh, stride_table,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_on, stride_oh,
    num_splits, sm_scale, window, min_keys, wide_min,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, WIDE_BLOCK: tl.constexpr, PAGE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    lo, per_split, used = _share(ctx, window, num_splits, min_keys, BLOCK)
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

    if SINGLE_SPLIT:
        out = acc / l_i[:, None]
        tl.store(Out + b * stride_on + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=hmask[:, None])
    else:
        # PartO [B, H, splits, D], PartML [B, H, splits, 2]
        row = (b * NUM_HEADS + heads) * num_splits + split
        # A split with no keys writes nothing (the merge skips it); the test as a vector, which
        # Triton's interpreter needs to combine it with a vector mask.
        wmask = hmask & (tl.zeros_like(g) + split < used)
        tl.store(PartO + row[:, None] * HEAD_DIM + d[None, :], acc, mask=wmask[:, None])
        tl.store(PartML + row * 2, m_i, mask=wmask)
        tl.store(PartML + row * 2 + 1, l_i, mask=wmask)


@triton.jit
def _merge_kernel(
    PartO, PartML, Out, lens_ptr, stride_on, stride_oh, num_splits, window, min_keys,
    NUM_HEADS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    used = _share(tl.load(lens_ptr + b).to(tl.int32), window, num_splits, min_keys, BLOCK)[2]
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
    _split_kernel[(batch, kv_heads, splits)](
        q, k_rows, v_rows, page_table, slots, context_lens, out, part_o, part_ml,
        q.stride(0), q.stride(1), page_table.stride(0),
        k_rows.stride(0), k_rows.stride(1),
        v_rows.stride(0), v_rows.stride(1),
        out.stride(0), out.stride(1),
        splits, dim**-0.5, window, min_keys,
        WIDE_MIN_KEYS if not batch_invariant() else 1 << 30,  # the invariant mode's order of sums is fixed
        NUM_HEADS=heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=dim, BLOCK=BLOCK_N, WIDE_BLOCK=WIDE_BLOCK_N, PAGE=page_size, SINGLE_SPLIT=splits == 1,
        num_warps=4, num_stages=2, **launch_args(q.device, batch),
    )
    if splits > 1:
        _merge_kernel[(batch, heads)](
            part_o, part_ml, out, context_lens, out.stride(0), out.stride(1), splits, window, min_keys,
            NUM_HEADS=heads, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=dim, BLOCK=BLOCK_N,
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
