"""`y = x @ W.T` for W kept as int4 / int8 / FP8 codes with group scales (models/packed.py),
de-quantized in registers (Triton), so a decode step reads the packed bytes only.

This module is the entry (`matmul`) and holds the kernels of the "halves" layout. Their
programs loop over the column pairs `(j, j + cols / 2)`: an int4 byte holds both, the byte
formats read them from the two halves of a row, and x's two halves are read alike, so every
load is contiguous whatever the code (an int4 weight repacked to "words" is gathered from its
words instead). The kinds of kernel:

- the GEMV (1-4 rows, W read once for every row), in the forms of `GEMV_FORMS`: by default the
  "stream" GEMV of kernels/packed_gemv.py (int4 "words", FP8 / int8 codes: 16-byte loads, built
  for bandwidth), or for int4 words and bf16 x on a GPU the CUDA GEMV of kernels/int4_gemv.py
  (half the stream GEMV's instructions a weight); the grouped forms here load one scale (and
  offset) per run of columns that share it and reduce their float32 products once after the
  loop, optionally split along the columns (split-K) where a projection has too few output
  blocks to keep every multiprocessor reading;
- FP8 codes with a scale per output channel: the "late" form, the bf16 GEMV of kernels/gemv.py
  reading FP8 codes (a few output features per program, products summed once after the loop)
  with the scale applied to each output;
- PyTorch's int4 kernel for a `tinygemm.TinyGemmWeight` (a candidate the benchmark times);
- the tiled GEMMs (more rows): int4 "words" by kernels/packed_words_gemm.py (contiguous chunks
  of words expanded to tiles, launch shapes in `WORDS_GEMM_BLOCKS`, W de-quantized once then
  cuBLAS from `DEQUANTIZE_ROWS` rows); other layouts by the "tiles" form here, each W tile
  de-quantized to x's dtype and fed to `tl.dot`, rows in blocks of 16 to 64.

FP8 weights with one scale per output channel take `torch._scaled_mm` from
`SCALED_MM_ROWS` rows on CUDA (a prompt's rows are compute-bound): x is scaled to FP8 per row
and the FP8 tensor cores run the product. All forms are capturable in CUDA graphs (no host
synchronisation, no allocation but the output). The reference is `PackedWeight.dequantize`
followed by a matmul, which the tests compare each form to.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import triton
import triton.language as tl

from structgen.engine.kernels import gemv, int4_gemv, packed_gemv, packed_words_gemm, tinygemm
from structgen.errors import InvalidParameterError

GEMV_ROWS = 4  # the GEMV keeps a [rows, BLOCK_N, BLOCK_J] product in registers: few rows only
SCALED_MM_ROWS = 128  # from here FP8 per-channel products run on the FP8 tensor cores
_CODE_IDS = {"int4": 0, "int8": 1, "fp8": 1}  # int8 and FP8 codes both load and convert to float
WORDS_CODE_ID = 2  # int4 codes in the "words" layout
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


class PackedWeight(Protocol):
    """What the kernels read of a weight (models/packed.py's `PackedWeight`, which imports this
    module, not the other way round)."""

    code: str
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    cols: int
    group_cols: int
    group_rows: int
    layout: str

    @property
    def shape(self) -> tuple[int, int]: ...


class Block(NamedTuple):
    """A launch shape: rows, output features and column pairs per program (the "stream" GEMV
    and the words GEMM: columns per chunk); warps; stages (the "stream" GEMV: > 1 prefetches
    the next chunk); its form (`GEMV_FORMS`, `GEMM_FORMS`) and the programs that split each
    row's columns (the "stream" GEMV and the words GEMM: 0 picks them from the multiprocessor
    count)."""

    m: int
    n: int
    j: int
    warps: int
    stages: int
    form: str = "magic"
    splits: int = 1


# "stream": kernels/packed_gemv.py, 16-byte loads of int4 words or byte codes, `j` columns per
# chunk ("words" int4 layout, groups of a power of two); "reduce": products summed across the
# chunk every iteration, scales gathered per weight (any group layout); "cvt" / "magic": a
# [rows, n, j] float32 product reduced once after the loop, scales loaded once per group,
# "magic" turning int4 nibbles into floats by bit operations ("halves" int4 layout only)
# "late" (FP8 per output channel only): kernels/gemv.py's GEMV, `n` features and `j` columns per
# chunk, scaled per feature at the end; "cuda": kernels/int4_gemv.py (int4 words, bf16 x; its
# launch is fixed), which the default launch of 1-8 rows takes wherever it fits
GEMV_FORMS = ("stream", "reduce", "cvt", "magic", "late", "cuda")
# The GEMV's default launch per code and row count (1, 2, 4: rows rounded up to a power of two),
# the table benchmarks/tune_packed.py's summary prints; splits=0: the stream GEMV picks its
# split-K from the multiprocessor count
GEMV_BLOCKS = {
    "int4": {1: Block(1, 16, 512, 4, 3, "stream", 0), 2: Block(2, 16, 512, 4, 3, "stream", 0),
             4: Block(4, 16, 512, 4, 3, "stream", 1)},
    "int8": {1: Block(1, 16, 256, 4, 3, "stream", 0), 2: Block(2, 16, 256, 4, 3, "stream", 0),
             4: Block(4, 16, 256, 4, 3, "stream", 0)},
    "fp8": {1: Block(1, 8, 512, 4, 3, "stream", 0), 2: Block(2, 16, 256, 4, 3, "stream", 0),
            4: Block(4, 16, 256, 4, 3, "stream", 0)},
}
# Codes with one scale per output channel (`row_scaled`) take the "late" GEMV at these row counts
# (it streamed the 8B shape's FP8 matrices faster at one row; the stream GEMV won at 2 and 4)
ROW_SCALED_BLOCKS = {1: Block(1, 4, 1024, 4, 4, "late")}
FALLBACK_BLOCKS = {"int4": Block(1, 16, 256, 4, 2, "magic"), "int8": Block(1, 16, 256, 4, 2, "magic"),
                   "fp8": Block(1, 16, 512, 4, 3, "reduce")}  # for weights the stream GEMV cannot read


# "tiles": the GEMM here (any layout; int4 "words" gathered per column pair); the forms of
# kernels/packed_words_gemm.py ("words" int4 only)
GEMM_FORMS = ("tiles", *packed_words_gemm.FORMS)
# The words GEMM's default launch per row count (rows rounded up to a power of two, at most 128),
# the table benchmarks/tune_packed.py's summary prints
WORDS_GEMM_BLOCKS = {16: Block(16, 128, 128, 4, 3, "w-by-x", 0), 32: Block(32, 128, 128, 4, 3, "w-by-x", 0),
                     64: Block(64, 128, 128, 4, 3, "x-by-w", 0), 128: Block(128, 128, 64, 8, 3, "x-by-w", 0)}
DEQUANTIZE_ROWS = 256  # from here W is de-quantized once and cuBLAS runs the compute-bound product
# The "tiles" GEMM's launch per code where timing chose other than `dot_block` (rows rounded up to
# 16, 32 or 64; more rows take the 64 entry), the table benchmarks/tune_packed.py's summary prints
TILES_BLOCKS: dict[str, dict[int, Block]] = {
    "fp8": {16: Block(16, 64, 128, 4, 3, "tiles", 0), 32: Block(32, 128, 128, 8, 3, "tiles", 0),
            64: Block(64, 128, 64, 4, 3, "tiles", 0)},
}
TILE_PROGRAMS_PER_SM = 2  # the split-K target of splits=0, as the words GEMM's


def gemv_block(weight: PackedWeight, rows: int) -> Block:
    """The GEMV's default launch for `weight` (its form where the group layout allows it)."""
    m = triton.next_power_of_2(rows)
    if m in ROW_SCALED_BLOCKS and row_scaled(weight):
        return ROW_SCALED_BLOCKS[m]
    if packed_gemv.stream_fits(weight):
        return GEMV_BLOCKS[weight.code][m]
    block = FALLBACK_BLOCKS[weight.code]
    # every form holds a float32 product per row and weight: fewer columns per chunk as rows grow
    block = block._replace(m=m, j=max(64, block.j // m))
    fits = weight.layout == "halves" and grouped_fits(weight, block.j)
    return block if block.form == "reduce" or fits else block._replace(form="reduce")


def gemm_block(weight: PackedWeight, rows: int, dtype: torch.dtype = torch.bfloat16) -> Block:
    """The GEMM's default launch for `rows` (more than GEMV_ROWS) rows of `weight`."""
    if weight.layout != "words":
        tuned = TILES_BLOCKS.get(weight.code, {}).get(dot_block(rows).m)
        if tuned is None:
            return dot_block(rows, dtype)
        return tuned._replace(stages=1) if dtype == torch.float32 else tuned
    if rows >= DEQUANTIZE_ROWS:
        return Block(rows, 0, 0, 0, 0, "dequantize")
    block = WORDS_GEMM_BLOCKS[min(128, max(16, triton.next_power_of_2(rows)))]
    # float32 tiles (tests, CPU-sized models) are not pipelined: their stages overflow shared memory
    return block._replace(stages=1) if dtype == torch.float32 else block


def dot_block(rows: int, dtype: torch.dtype = torch.bfloat16) -> Block:
    """The "tiles" GEMM's tile for `rows` rows: 16 rows (tl.dot's smallest) up to 64 per
    program; narrower in N while the rows fit one tile, so a decode step still has programs
    enough to keep every multiprocessor reading W. float32 tiles are not pipelined."""
    m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    return Block(m, 32 if rows <= 64 else 64, 64, 4, 1 if dtype == torch.float32 else 3, "tiles")


def grouped_fits(weight: PackedWeight, block_j: int) -> bool:
    """Whether the grouped GEMV forms can read `weight` in chunks of `block_j` column pairs:
    every run of min(group, chunk) columns, in either half of a row, lies in one group."""
    half = weight.cols // 2
    if weight.group_cols >= weight.cols:
        return True
    g = weight.group_cols
    run = min(g, triton.next_power_of_2(block_j))
    return g & (g - 1) == 0 and half % run == 0


@triton.jit
def _weights(C, S, OFF, n, nmask, j, jmask, HALF, stride_cn, stride_sn, GROUP_N: tl.constexpr,
             GROUP_K: tl.constexpr, CODE: tl.constexpr, HAS_OFFSET: tl.constexpr, ROW_SCALE: tl.constexpr):
    """The float32 weights of columns j and j + HALF for rows n: two [BLOCK_N, BLOCK_J] tiles
    (with ROW_SCALE, the codes only: the kernel scales its output instead)."""
    mask = nmask[:, None] & jmask[None, :]
    row = C + n[:, None].to(tl.int64) * stride_cn
    if CODE == 0:  # int4: one byte, low nibble column j, high nibble column j + HALF
        b = tl.load(row + j[None, :], mask=mask, other=0)
        lo = (b & 0xF).to(tl.float32)
        hi = (b >> 4).to(tl.float32)
    elif CODE == 2:  # int4 "words": column c is nibble c % 8 of int32 word c // 8
        lo = ((tl.load(row + (j >> 3)[None, :], mask=mask, other=0) >> ((j & 7) * 4)[None, :]) & 0xF).to(tl.float32)
        jh = j + HALF
        hi = ((tl.load(row + (jh >> 3)[None, :], mask=mask, other=0) >> ((jh & 7) * 4)[None, :]) & 0xF).to(tl.float32)
    else:  # a byte per code, the halves of the row
        lo = tl.load(row + j[None, :], mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(row + HALF + j[None, :], mask=mask, other=0.0).to(tl.float32)
    if not ROW_SCALE:
        srow = (n // GROUP_N)[:, None] * stride_sn
        s_lo = srow + (j // GROUP_K)[None, :]
        s_hi = srow + ((j + HALF) // GROUP_K)[None, :]
        lo = lo * tl.load(S + s_lo, mask=mask, other=0.0).to(tl.float32)
        hi = hi * tl.load(S + s_hi, mask=mask, other=0.0).to(tl.float32)
        if HAS_OFFSET:
            lo += tl.load(OFF + s_lo, mask=mask, other=0.0).to(tl.float32)
            hi += tl.load(OFF + s_hi, mask=mask, other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def _packed_kernel(X, C, S, OFF, B, Y, M, N, HALF, CHUNKS, stride_xm, stride_cn, stride_sn, stride_ys, stride_ym,
                   GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                   CODE: tl.constexpr, HAS_OFFSET: tl.constexpr, ROW_SCALE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    """Both forms: DOT feeds W's tiles (in x's dtype) to `tl.dot`, else float32 products are
    summed per chunk (the GEMV: one program for all rows, W read once). Program (i, r, s) sums
    chunks [s * CHUNKS, (s + 1) * CHUNKS) into Y's slice s (split-K; one slice: the output)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < M
    x_row = X + m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = tl.program_id(2) * CHUNKS * BLOCK_J
    for j0 in range(first, tl.minimum(first + CHUNKS * BLOCK_J, HALF), BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        jmask = j < HALF
        w_lo, w_hi = _weights(C, S, OFF, n, nmask, j, jmask, HALF, stride_cn, stride_sn, GROUP_N, GROUP_K,
                              CODE, HAS_OFFSET, ROW_SCALE)
        xmask = mmask[:, None] & jmask[None, :]
        x_lo = tl.load(x_row + j[None, :], mask=xmask, other=0.0)
        x_hi = tl.load(x_row + HALF + j[None, :], mask=xmask, other=0.0)
        if DOT:
            acc = tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), acc, input_precision=PRECISION)
            acc = tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), acc, input_precision=PRECISION)
        else:
            products = x_lo.to(tl.float32)[:, None, :] * w_lo[None, :, :] + x_hi.to(tl.float32)[:, None, :] * w_hi[None, :, :]
            acc += tl.sum(products, axis=2)
    if ROW_SCALE:
        acc *= tl.load(S + n * stride_sn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y = Y + tl.program_id(2) * stride_ys + m[:, None] * stride_ym + n[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _code_values(C, n, nmask, j, jmask, HALF, stride_cn, CODE: tl.constexpr, MAGIC: tl.constexpr):
    """Columns j and j + HALF of rows n ([BLOCK_N, runs, run] each) as float32 values v with
    code = 16 v - 16 for MAGIC int4 (`1 + q / 16` built from the bits), else code = v."""
    mask = nmask[:, None, None] & jmask[None, :, :]
    row = C + n[:, None, None].to(tl.int64) * stride_cn + j[None, :, :]
    if CODE == 0:
        b = tl.load(row, mask=mask, other=0).to(tl.int32)
        if MAGIC:  # the nibble as the top mantissa bits of 1.0
            lo = (((b & 0xF) << 19) | 0x3F800000).to(tl.float32, bitcast=True)
            hi = (((b & 0xF0) << 15) | 0x3F800000).to(tl.float32, bitcast=True)
        else:
            lo = (b & 0xF).to(tl.float32)
            hi = (b >> 4).to(tl.float32)
    else:
        lo = tl.load(row, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(row + HALF, mask=mask, other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def _group_weights(v, S, OFF, srow, col, gmask, GROUP_K: tl.constexpr, HAS_OFFSET: tl.constexpr,
                   MAGIC_INT4: tl.constexpr):
    """`v` ([BLOCK_N, runs, run]) as weights: one scale (and offset) per run of columns from
    `col` ([runs]), folded with the code's own affine map into one multiply-add per weight."""
    idx = srow + (col // GROUP_K)[None, :]
    s = tl.load(S + idx, mask=gmask, other=0.0).to(tl.float32)
    if MAGIC_INT4:  # code = 16 v - 16
        a = s * 16.0
        b = s * -16.0
    else:
        a = s
        b = tl.zeros_like(s)
    if HAS_OFFSET:
        b += tl.load(OFF + idx, mask=gmask, other=0.0).to(tl.float32)
    return v * a[:, :, None] + b[:, :, None]


@triton.jit
def _grouped_gemv_kernel(X, C, S, OFF, B, Y, M, N, HALF, CHUNKS, stride_xm, stride_cn, stride_sn, stride_ys,
                         stride_ym, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, CODE: tl.constexpr,
                         HAS_OFFSET: tl.constexpr, ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                         MAGIC: tl.constexpr, MAGIC_INT4: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, RUN: tl.constexpr, RUNS: tl.constexpr):
    """The GEMV of 1-4 rows: each chunk of BLOCK_J column pairs is read as runs of RUN columns
    that share a scale, its products added to a [rows, BLOCK_N, runs, RUN] float32 sum that
    is reduced once at the end. Program (i, s) sums chunks [s * CHUNKS, (s + 1) * CHUNKS) into
    Y's slice s (split-K; one slice: the output itself)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    runs = tl.arange(0, RUNS) * RUN
    jj = runs[:, None] + tl.arange(0, RUN)[None, :]
    x_row = X + m[:, None, None].to(tl.int64) * stride_xm
    srow = (n // GROUP_N)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N, RUNS, RUN], tl.float32)
    first = tl.program_id(1) * CHUNKS * BLOCK_J
    for j0 in range(first, tl.minimum(first + CHUNKS * BLOCK_J, HALF), BLOCK_J):
        j = j0 + jj
        jmask = j < HALF
        lo, hi = _code_values(C, n, nmask, j, jmask, HALF, stride_cn, CODE, MAGIC)
        if ROW_SCALE:
            if MAGIC_INT4:
                lo, hi = lo * 16.0 - 16.0, hi * 16.0 - 16.0
        else:
            gmask = nmask[:, None] & (j0 + runs < HALF)[None, :]
            lo = _group_weights(lo, S, OFF, srow, j0 + runs, gmask, GROUP_K, HAS_OFFSET, MAGIC_INT4)
            hi = _group_weights(hi, S, OFF, srow, j0 + HALF + runs, gmask, GROUP_K, HAS_OFFSET, MAGIC_INT4)
        xmask = mmask[:, None, None] & jmask[None, :, :]
        x_lo = tl.load(x_row + j[None, :, :], mask=xmask, other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + HALF + j[None, :, :], mask=xmask, other=0.0).to(tl.float32)
        acc += x_lo[:, None, :, :] * lo[None, :, :, :] + x_hi[:, None, :, :] * hi[None, :, :, :]
    out = tl.sum(tl.sum(acc, axis=3), axis=2)
    if ROW_SCALE:
        out *= tl.load(S + n * stride_sn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        out += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y = Y + tl.program_id(1) * stride_ys + m[:, None] * stride_ym + n[None, :]
    tl.store(y, out.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def matmul(x: torch.Tensor, weight: PackedWeight | tinygemm.TinyGemmWeight, bias: torch.Tensor | None = None, *,
           block: Block | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, cols] @ W.T (+ bias)` in x's dtype; `block` forces a launch shape (tests,
    benchmarks/tune_packed.py), `out` may be a column slice of a wider output. A
    `TinyGemmWeight` runs PyTorch's int4 kernel (kernels/tinygemm.py)."""
    if isinstance(weight, tinygemm.TinyGemmWeight):
        return _add_bias_into(tinygemm.matmul(x, weight), bias, out)
    rows = x.shape[0]
    if block is None and x.is_cuda and rows >= SCALED_MM_ROWS and rows % 16 == 0 and scaled_mm_fits(weight):
        return scaled_mm(x, weight, bias, out)
    x = x.contiguous()
    n = weight.shape[0]
    if rows == 0:
        return torch.empty(rows, n, dtype=x.dtype, device=x.device) if out is None else out
    # The CUDA int4 GEMV: the default for the 1-8 rows it takes (kernels/int4_gemv.py), or forced.
    if (rows <= int4_gemv.MAX_ROWS) if block is None else block.form == "cuda":
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device) if out is None else out
        if int4_gemv.fits(x, weight, bias, out):
            int4_gemv.gemv(x, weight, bias, out)
            return out
        if block is not None:
            raise InvalidParameterError(f"the 'cuda' GEMV reads 1-{int4_gemv.CUDA_CORE_ROWS} bf16 rows (up to "
                                        f"{int4_gemv.MAX_ROWS} in whole {int4_gemv.TILE_COLS}-column groups) and "
                                        f"int4 words in groups of a power of two of at least {int4_gemv.LANE_COLS} "
                                        "columns, built on a GPU; use Block(form='stream')")
    if block is None:
        block = gemv_block(weight, rows) if rows <= GEMV_ROWS else gemm_block(weight, rows, x.dtype)
    if block.form in packed_words_gemm.FORMS:
        return _words_matmul(x, weight, bias, block, out)
    if block.form == "late":
        return _late_gemv(x, weight, bias, block, out)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device) if out is None else out
    if block.m <= GEMV_ROWS and block.form == "stream":
        if not packed_gemv.stream_fits(weight):
            raise InvalidParameterError(f"the stream GEMV cannot read a {weight.code} weight in the {weight.layout!r} "
                                        f"layout with groups of {weight.group_cols} columns; use Block(form='reduce') "
                                        f"(or models.packed.to_words for int4)")
        packed_gemv.stream_gemv(x, weight, bias, y, block)
        return y
    if block.m <= GEMV_ROWS and block.form != "reduce":
        _grouped_gemv(x, weight, bias, y, block)
        return y
    _tiles(x, weight, bias, y, block)
    return y


def _tiles(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, y: torch.Tensor, block: Block) -> None:
    """The "tiles" GEMM (and the "reduce" GEMV) into `y`; with `block.splits` other than 1
    (0: from the multiprocessors) through float32 partial sums added by a second launch."""
    rows, n, half = x.shape[0], weight.shape[0], weight.cols // 2
    block_j = min(block.j, triton.next_power_of_2(half))
    chunks_total = triton.cdiv(half, block_j)
    programs = triton.cdiv(n, block.n) * triton.cdiv(rows, block.m)
    splits, chunks, target = packed_gemv.split_k(block.splits, programs, TILE_PROGRAMS_PER_SM, chunks_total, y, rows, n)
    args = (x, weight.codes, weight.scales, weight.offsets if weight.offsets is not None else weight.scales,
            bias if bias is not None else weight.scales, target, rows, n, half, chunks, x.stride(0),
            weight.codes.stride(0), weight.scales.stride(0), target.stride(0) if splits > 1 else 0, target.stride(-2))
    # group sizes are constants so the scale index is a shift, not a division per weight; float32
    # products stay float32 (tl.dot would round them to TF32 on the GPU)
    consts = {**_layout(weight), "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
              "HAS_BIAS": bias is not None and splits == 1, "BLOCK_N": block.n, "BLOCK_J": block_j,
              "num_warps": block.warps, "num_stages": block.stages}
    grid = (triton.cdiv(n, block.n), triton.cdiv(rows, block.m), splits)
    _packed_kernel[grid](*args, DOT=block.m > GEMV_ROWS, BLOCK_M=block.m, **consts)
    if splits > 1:
        packed_gemv.sum_splits(target, bias, y)


def row_scaled(weight: PackedWeight) -> bool:
    """FP8 or int8 codes with one scale per output channel and no offsets."""
    return (weight.code in ("fp8", "int8") and weight.offsets is None and weight.group_rows == 1
            and weight.group_cols >= weight.cols)


def _late_gemv(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, block: Block,
               out: torch.Tensor | None) -> torch.Tensor:
    """The "late" form: kernels/gemv.py's GEMV on the codes, each output scaled by its channel's scale."""
    if not row_scaled(weight) or block.m > GEMV_ROWS:
        raise InvalidParameterError(f"the 'late' GEMV reads FP8 or int8 codes with one scale per output channel "
                                    f"for up to {GEMV_ROWS} rows, not a {weight.code} weight with groups of "
                                    f"{weight.group_cols}x{weight.group_rows}; use Block(form='stream')")
    g_block = gemv.Block(block.n, block.j, block.warps, block.stages, "late")
    return gemv.gemv(x, weight.codes, bias, block=g_block, scale=weight.scales.reshape(-1), out=out)


def _words_matmul(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, block: Block,
                  out: torch.Tensor | None) -> torch.Tensor:
    """The forms of kernels/packed_words_gemm.py (int4 "words" only)."""
    if weight.layout != "words":
        raise InvalidParameterError(f"the {block.form!r} GEMM reads int4 codes in the 'words' layout, not a "
                                    f"{weight.code} weight in {weight.layout!r}; use models.packed.to_words "
                                    f"or Block(form='tiles')")
    if block.form == "dequantize":
        return _add_bias_into(x @ packed_words_gemm.dequantize_words(weight, x.dtype).T, bias, out)
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device) if out is None else out
    packed_words_gemm.words_gemm(x, weight, bias, y, block)
    return y


def _layout(weight: PackedWeight) -> dict[str, object]:
    """The kernels' constants that describe `weight`'s codes and groups."""
    row_scale = weight.offsets is None and weight.group_rows == 1 and weight.group_cols >= weight.cols
    code_id = WORDS_CODE_ID if weight.layout == "words" else _CODE_IDS[weight.code]
    return {"GROUP_N": weight.group_rows, "GROUP_K": weight.group_cols, "CODE": code_id,
            "HAS_OFFSET": weight.offsets is not None, "ROW_SCALE": row_scale}


def _grouped_gemv(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, y: torch.Tensor,
                  block: Block) -> None:
    """The "cvt" / "magic" GEMV forms into `y`; with `block.splits` > 1 through float32 partial
    sums and a second launch that adds them (no atomics: the same sum every run)."""
    rows, n, half = x.shape[0], weight.shape[0], weight.cols // 2
    block_j = min(block.j, triton.next_power_of_2(half))
    if weight.layout != "halves":
        raise InvalidParameterError(f"the {block.form!r} GEMV reads int4 codes in the 'halves' layout, not "
                                    f"{weight.layout!r}; use Block(form='stream') or Block(form='reduce')")
    if not grouped_fits(weight, block_j):
        raise InvalidParameterError(f"the {block.form!r} GEMV cannot read groups of {weight.group_cols} columns in chunks of "
                         f"{block_j}; use Block(form='reduce') for this weight")
    run = block_j if weight.group_cols >= weight.cols else min(weight.group_cols, block_j)
    chunks = triton.cdiv(triton.cdiv(half, block_j), block.splits)
    splits = triton.cdiv(triton.cdiv(half, block_j), chunks)
    target = y if splits == 1 else torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    scales = weight.scales
    _grouped_gemv_kernel[(triton.cdiv(n, block.n), splits)](
        x, weight.codes, scales, weight.offsets if weight.offsets is not None else scales,
        bias if bias is not None and splits == 1 else scales, target, rows, n, half, chunks, x.stride(0),
        weight.codes.stride(0), scales.stride(0), target.stride(0) if splits > 1 else 0,
        target.stride(-2), **_layout(weight), HAS_BIAS=bias is not None and splits == 1,
        MAGIC=block.form == "magic", MAGIC_INT4=block.form == "magic" and weight.code == "int4",
        BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=block.n, BLOCK_J=block_j, RUN=run, RUNS=block_j // run, num_warps=block.warps, num_stages=block.stages)
    if splits > 1:
        packed_gemv.sum_splits(target, bias, y)


def scaled_mm_fits(weight: PackedWeight) -> bool:
    """FP8 codes with one scale per output channel and sizes `torch._scaled_mm` takes."""
    return (weight.code == "fp8" and weight.group_rows == 1 and weight.group_cols >= weight.cols
            and weight.cols % 16 == 0 and weight.shape[0] % 16 == 0)


def scaled_mm(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The product on the FP8 tensor cores: x scaled to FP8 per row (its max magnitude to 448),
    W's per-channel scales applied to the output."""
    x_scale = (x.float().abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    x8 = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    y = torch._scaled_mm(x8, weight.codes.t(), scale_a=x_scale, scale_b=weight.scales.float().reshape(1, -1),
                         out_dtype=x.dtype)
    return _add_bias_into(y, bias, out)


def _add_bias_into(y: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """A torch kernel's product `y` with the bias added, copied into `out` where one is given."""
    if bias is not None:
        y += bias
    if out is None:
        return y
    out.copy_(y)
    return out
