"""The tiled GEMM of int4 weights in the "words" layout (models/packed.py: int32
`[rows, ceil(cols / 8)]`, nibble i of word w holding column 8 w + i): `y = x @ W.T` for more
rows of x than the GEMV takes (a batch's decode step, a prompt).

Program (i, j, s) owns BLOCK_N output features and BLOCK_M rows of x and walks its share of the
columns in chunks of BLOCK_K contiguous columns. Per chunk it loads the `[BLOCK_N, BLOCK_K / 8]`
words in one contiguous load, turns each word's 8 nibbles into floats by bit operations (8
planes in the words' own layout, joined into `[BLOCK_N, BLOCK_K]` along axes that stay in each
thread's registers), scales them in float32 (one `[BLOCK_N]` scale, and offset, per run of
columns that share a group), converts the tile to x's dtype and feeds it to `tl.dot` with x's
`[BLOCK_M, BLOCK_K]` tile. The forms (`Block.form`):

- "x-by-w": `tl.dot(x, W.T)`, the rows of x the left side of the product;
- "w-by-x": `tl.dot(W, x.T)`, the de-quantized tile the left operand (which the tensor cores
  can take from registers) and the rows of x the narrow side, so 16 rows fill an instruction;
- "dequantize": W de-quantized once to x's dtype by the same tile code (`dequantize_words`),
  then cuBLAS: for a prompt's many rows, where the product is compute-bound.

Runs are the largest power of two that divides the group (whole chunks for a group of the whole
row), so any group layout reads right: a group of a multiple of BLOCK_K columns takes one scale
per row and chunk, one of a multiple of 8 one per word, any other one per column. Rows of W past N and of x past M re-read valid rows and are
never stored, so the loads need no row mask. Split-K (`Block.splits` > 1; 0: enough programs
for PROGRAMS_PER_SM on each multiprocessor) sums each program's slice of the chunks into
float32 partials that `packed_gemv.sum_splits` adds in a fixed order (no atomics: the same sum
every run).

Capturable in CUDA graphs: no host synchronisation, no allocation but the output and the
partials. The tests compare every form with `PackedWeight.dequantize` followed by a matmul.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from structgen.engine.kernels import packed_gemv

if TYPE_CHECKING:
    from structgen.engine.kernels.packed_gemm import Block, PackedWeight

FORMS = ("x-by-w", "w-by-x", "dequantize")
MIN_DOT = 16  # tl.dot's smallest side
DEQUANTIZE_TILE = (64, 128)  # (output features, columns) per program of the de-quantizing copy
# the split-K target of splits=0: a tile keeps its stages of loads in flight, so fewer programs
# per multiprocessor than the GEMV's (packed_gemv.PROGRAMS_PER_SM) keep the memory busy
PROGRAMS_PER_SM = 2


def run_cols(weight: PackedWeight, block_k: int) -> int:
    """Columns per scale run in chunks of `block_k` (a power of two): the chunk for a group of
    the whole row, else the largest power of two dividing the group, at most the chunk."""
    g = weight.group_cols
    return block_k if g >= weight.cols else min(block_k, g & -g)


def chunk_cols(weight: PackedWeight, block: Block) -> int:
    """BLOCK_K: `block.j` columns, no more than the row (rounded up to a power of two), at
    least tl.dot's smallest side."""
    return max(MIN_DOT, min(block.j, triton.next_power_of_2(weight.cols)))


def words_gemm(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, y: torch.Tensor,
               block: Block) -> None:
    """`y = x @ W.T (+ bias)` by the "x-by-w" or "w-by-x" form with launch shape `block` (`m`, `n`
    rows and features per program, `j` columns per chunk, `splits` as the module says)."""
    rows, n, cols = x.shape[0], weight.shape[0], weight.cols
    block_k = chunk_cols(weight, block)
    chunks_total = triton.cdiv(cols, block_k)
    programs = triton.cdiv(n, block.n) * triton.cdiv(rows, block.m)
    splits, chunks, target = packed_gemv.split_k(block.splits, programs, PROGRAMS_PER_SM, chunks_total, y, rows, n)
    scales = weight.scales
    row_scale = weight.offsets is None and weight.group_rows == 1 and weight.group_cols >= cols
    _words_gemm_kernel[(triton.cdiv(n, block.n), triton.cdiv(rows, block.m), splits)](
        x, weight.codes, scales, weight.offsets if weight.offsets is not None else scales,
        bias if bias is not None else scales, target, rows, n, cols, weight.codes.shape[1], chunks,
        x.stride(0), weight.codes.stride(0), scales.stride(0), target.stride(0) if splits > 1 else 0,
        target.stride(-2), GROUP_N=weight.group_rows, GROUP_K=weight.group_cols,
        HAS_OFFSET=weight.offsets is not None, ROW_SCALE=row_scale, HAS_BIAS=bias is not None and splits == 1,
        W_LEFT=block.form == "w-by-x", EVEN_K=cols % block_k == 0,
        # float32 products stay float32 (tl.dot would round them to TF32 on the GPU)
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block.m, BLOCK_N=block.n, BLOCK_K=block_k, RUN=run_cols(weight, block_k),
        num_warps=block.warps, num_stages=block.stages)
    if splits > 1:
        packed_gemv.sum_splits(target, bias, y)


def dequantize_words(weight: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """W `[rows, cols]` in `dtype`, scaled in float32 as the GEMM's tiles are."""
    n, cols = weight.shape
    block_n, block_k = DEQUANTIZE_TILE
    block_k = max(MIN_DOT, min(block_k, triton.next_power_of_2(cols)))
    out = torch.empty(n, cols, dtype=dtype, device=weight.codes.device)
    scales = weight.scales
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(cols, block_k))](
        weight.codes, scales, weight.offsets if weight.offsets is not None else scales, out, n, cols,
        weight.codes.shape[1], weight.codes.stride(0), scales.stride(0), out.stride(0),
        GROUP_N=weight.group_rows, GROUP_K=weight.group_cols, HAS_OFFSET=weight.offsets is not None,
        EVEN_K=cols % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, RUN=run_cols(weight, block_k))
    return out


@triton.jit
def _plane(half, i: tl.constexpr):
    """Nibble i of every word as float32, from `half`: the word's half holding it (shifted to
    the low 16 bits) OR-ed with the bits of 2^23. A nibble kept in place among the mantissa
    bits of 2^23 is the float `2^23 + q * 16^p` (p its place in the half), which one
    multiply-add by powers of two turns into q exactly: no int-to-float conversion.
    `(w | C) & (M | C)` is `(w & M) | C` with one constant per logic op."""
    place: tl.constexpr = (i % 4) * 4
    f = (half & ((0xF << place) | 0x4B000000)).to(tl.float32, bitcast=True)
    return f * (1.0 / (1 << place)) - 8388608.0 / (1 << place)


@triton.jit
def _group_values(S, srow, k0, K, i: tl.constexpr, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr,
                  BLOCK_K: tl.constexpr, RUN: tl.constexpr):
    """The scales (or offsets) `S` of nibble plane i of the chunk at column k0: one per row
    (`[BLOCK_N, 1]`) where a run spans the chunk, else one per word (`[BLOCK_N, BLOCK_K / 8]`)."""
    if RUN >= BLOCK_K:
        values = tl.load(S + srow + k0 // GROUP_K).to(tl.float32)[:, None]
    else:
        col = k0 + tl.arange(0, BLOCK_K // 8) * 8 + (0 if RUN >= 8 else i)
        idx = srow[:, None] + (col // GROUP_K)[None, :]
        if EVEN_K:
            values = tl.load(S + idx).to(tl.float32)
        else:
            values = tl.load(S + idx, mask=(col < K)[None, :], other=0.0).to(tl.float32)
    return values


@triton.jit
def _weight_plane(half, i: tl.constexpr, S, OFF, srow, k0, K, GROUP_K: tl.constexpr, HAS_OFFSET: tl.constexpr,
                  ROW_SCALE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, RUN: tl.constexpr):
    """Column 8 w + i of every word w: the code times its group's scale (+ offset), or the code
    alone with ROW_SCALE."""
    values = _plane(half, i)
    if not ROW_SCALE:
        values *= _group_values(S, srow, k0, K, i, GROUP_K, EVEN_K, BLOCK_K, RUN)
        if HAS_OFFSET:
            values += _group_values(OFF, srow, k0, K, i, GROUP_K, EVEN_K, BLOCK_K, RUN)
    return values


@triton.jit
def _weight_pair(low, high, i: tl.constexpr, S, OFF, srow, k0, K, GROUP_K: tl.constexpr,
                 HAS_OFFSET: tl.constexpr, ROW_SCALE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
                 RUN: tl.constexpr):
    """Columns 8 w + i and 8 w + i + 4 of every word w, joined along a new last axis."""
    lo = _weight_plane(low, i, S, OFF, srow, k0, K, GROUP_K, HAS_OFFSET, ROW_SCALE, EVEN_K, BLOCK_K, RUN)
    hi = _weight_plane(high, i + 4, S, OFF, srow, k0, K, GROUP_K, HAS_OFFSET, ROW_SCALE, EVEN_K, BLOCK_K, RUN)
    return tl.join(lo, hi)


@triton.jit
def _weight_tile(crow, srow, S, OFF, k0, K, WORDS, GROUP_K: tl.constexpr, HAS_OFFSET: tl.constexpr,
                 ROW_SCALE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, RUN: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of the W rows at `crow` (`[BLOCK_N, 1]` pointers to their
    words) as float32 `[BLOCK_N, BLOCK_K]`. Each word's 8 columns are computed as planes in
    the words' own layout and joined along new axes that stay in each thread's registers, so
    a thread scales whole words with one scale per row it holds."""
    block_n: tl.constexpr = crow.shape[0]
    word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    if EVEN_K:
        words = tl.load(crow + word[None, :])
    else:
        words = tl.load(crow + word[None, :], mask=(word < WORDS)[None, :], other=0)
    low = words | 0x4B000000
    high = (words >> 16) | 0x4B000000
    p0 = _weight_pair(low, high, 0, S, OFF, srow, k0, K, GROUP_K, HAS_OFFSET, ROW_SCALE, EVEN_K, BLOCK_K, RUN)
    p1 = _weight_pair(low, high, 1, S, OFF, srow, k0, K, GROUP_K, HAS_OFFSET, ROW_SCALE, EVEN_K, BLOCK_K, RUN)
    p2 = _weight_pair(low, high, 2, S, OFF, srow, k0, K, GROUP_K, HAS_OFFSET, ROW_SCALE, EVEN_K, BLOCK_K, RUN)
    p3 = _weight_pair(low, high, 3, S, OFF, srow, k0, K, GROUP_K, HAS_OFFSET, ROW_SCALE, EVEN_K, BLOCK_K, RUN)
    # each tl.join adds a last axis: the pairs' (c), then a, then b, so that column
    # 8 w + 4 c + 2 a + b lands at [w, c, a, b], which the reshape reads in that order
    tile = tl.join(tl.join(p0, p2), tl.join(p1, p3))
    return tl.reshape(tile, [block_n, BLOCK_K])


@triton.jit
def _words_gemm_kernel(X, C, S, OFF, B, Y, M, N, K, WORDS, CHUNKS, stride_xm, stride_cn, stride_sn,
                       stride_ys, stride_ym, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                       HAS_OFFSET: tl.constexpr, ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       W_LEFT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RUN: tl.constexpr):
    """Program (i, j, s): features [i * BLOCK_N, ...) of rows [j * BLOCK_M, ...) over chunks
    [s * CHUNKS, (s + 1) * CHUNKS), into Y's slice s. With ROW_SCALE (one scale per output
    feature, no offsets) the tiles are the codes alone and the output is scaled once."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    crow = C + (n % N)[:, None].to(tl.int64) * stride_cn
    srow = ((n % N) // GROUP_N) * stride_sn
    x_row = X + (m % M)[:, None].to(tl.int64) * stride_xm
    if W_LEFT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = tl.program_id(2) * CHUNKS * BLOCK_K
    for k0 in range(first, tl.minimum(first + CHUNKS * BLOCK_K, K), BLOCK_K):
        w = _weight_tile(crow, srow, S, OFF, k0, K, WORDS, GROUP_K, HAS_OFFSET, ROW_SCALE, EVEN_K,
                         BLOCK_K, RUN).to(X.dtype.element_ty)
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_row + k[None, :])
        else:
            x = tl.load(x_row + k[None, :], mask=(k < K)[None, :], other=0.0)
        if W_LEFT:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if W_LEFT:
        acc = tl.trans(acc)
    nmask = n < N
    if ROW_SCALE:
        acc *= tl.load(S + n * stride_sn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y = Y + tl.program_id(2) * stride_ys + m[:, None] * stride_ym + n[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=(m < M)[:, None] & nmask[None, :])


@triton.jit
def _dequantize_kernel(C, S, OFF, W, N, K, WORDS, stride_cn, stride_sn, stride_wn, GROUP_N: tl.constexpr,
                       GROUP_K: tl.constexpr, HAS_OFFSET: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RUN: tl.constexpr):
    """W's tile (i, j) de-quantized into `W` (`[N, K]`, x's dtype) by the GEMM's tile code."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    crow = C + (n % N)[:, None].to(tl.int64) * stride_cn
    srow = ((n % N) // GROUP_N) * stride_sn
    w = _weight_tile(crow, srow, S, OFF, k0, K, WORDS, GROUP_K, HAS_OFFSET, False, EVEN_K, BLOCK_K, RUN)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(W + n[:, None].to(tl.int64) * stride_wn + k[None, :], w.to(W.dtype.element_ty),
             mask=(n < N)[:, None] & (k < K)[None, :])
