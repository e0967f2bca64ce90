"""The bandwidth GEMV: `y = x @ W.T` for 1-4 rows of x and W kept as int4 codes in the "words"
layout or as FP8 / int8 codes (models/packed.py), built to stream W at the memory's speed.

A batch-1 projection reads every byte of W once and does two flops per weight, so its time is
the bytes over the bandwidth if enough of them are in flight. Each program owns BLOCK_N output
rows and walks its share of the columns in chunks of `Block.j` columns:

- the chunk is a `[BLOCK_N, RUNS, RUN]` tile of vector units, K-contiguous per row, so every
  thread issues 16-byte loads (a unit is an int32 word of 8 nibbles, or 16 FP8 / int8 codes);
  RUN units share one scale, loaded once per run;
- int4 nibbles become floats without the int-to-float unit: a nibble masked in place and OR-ed
  into the mantissa of 2^23 is `2^23 + q * 16^p` exactly, so one logic op and one subtraction
  give `q * 16^p`, and x's column is scaled by `16^-p` (exact) once per chunk instead;
- each run's products are summed in float32 registers, scaled, and added to a float32
  accumulator that is reduced across the chunk once, after the loop; offsets multiply the
  run's sum of x instead of every weight;
- split-K: with `splits` > 1, program (i, s) sums its slice of the chunks into float32
  partials `[splits, rows, N]` and a second launch adds them in a fixed order (no atomics:
  the same sum every run). `splits=0` picks the count from the multiprocessors.

Capturable in CUDA graphs: no host synchronisation, no allocation but the output and the
partials. The tests compare it with `PackedWeight.dequantize` followed by a matmul.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from structgen.engine.kernels.packed_gemm import Block, PackedWeight

UNIT_COLS = {"int4": 8, "int8": 16, "fp8": 16}  # columns per 16-byte-friendly vector unit
PROGRAMS_PER_SM = 4  # the split-K target of splits=0: programs enough to keep each SM reading


def stream_fits(weight: PackedWeight) -> bool:
    """Whether the stream GEMV reads `weight`: int4 in the "words" layout or byte codes, and
    groups that are whole rows or a power of two of at least one vector unit (a run of
    units then never straddles two groups)."""
    if weight.code == "int4" and weight.layout != "words":
        return False
    g = weight.group_cols
    return g >= weight.cols or (g & (g - 1) == 0 and g >= UNIT_COLS[weight.code])


def stream_gemv(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, y: torch.Tensor,
                block: Block) -> None:
    """`y = x @ W.T (+ bias)` for x's 1-4 rows by the stream kernel with launch shape `block`
    (`block.j`: columns per chunk, a power of two)."""
    rows, n, cols = x.shape[0], weight.shape[0], weight.cols
    unit_cols = UNIT_COLS[weight.code]
    block_k = max(unit_cols, min(block.j, triton.next_power_of_2(cols)))
    run_cols = block_k if weight.group_cols >= cols else min(weight.group_cols, block_k)
    units = weight.codes.shape[1] if weight.code == "int4" else triton.cdiv(cols, unit_cols)
    chunks_total = triton.cdiv(cols, block_k)
    splits = block.splits or auto_splits(triton.cdiv(n, block.n), chunks_total, x.device)
    chunks = triton.cdiv(chunks_total, splits)
    splits = triton.cdiv(chunks_total, chunks)
    target = y if splits == 1 else torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    row_scale = weight.offsets is None and weight.group_rows == 1 and weight.group_cols >= cols
    scales = weight.scales
    _stream_gemv_kernel[(triton.cdiv(n, block.n), splits)](
        x, weight.codes, scales, weight.offsets if weight.offsets is not None else scales,
        bias if bias is not None else scales, target, rows, n, cols, units, chunks,
        x.stride(0), weight.codes.stride(0), scales.stride(0), target.stride(0) if splits > 1 else 0,
        target.stride(-2), GROUP_N=weight.group_rows, GROUP_K=weight.group_cols, INT4=weight.code == "int4",
        HAS_OFFSET=weight.offsets is not None, ROW_SCALE=row_scale, HAS_BIAS=bias is not None and splits == 1,
        BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=block.n, RUNS=block_k // run_cols,
        RUN=run_cols // unit_cols, UNIT=unit_cols, num_warps=block.warps, num_stages=block.stages)
    if splits > 1:
        sum_splits(target, bias, y)


def auto_splits(programs: int, chunks: int, device: torch.device) -> int:
    """Split-K count that brings `programs` output blocks up to PROGRAMS_PER_SM per SM."""
    return max(1, min(chunks, PROGRAMS_PER_SM * _multiprocessors(device) // max(programs, 1)))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _multiprocessors(device: torch.device) -> int:
    """The device's SMs (a small stand-in for the CPU interpreter)."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def sum_splits(partials: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    """`y` = the split-K partial sums (float32 `[splits, rows, N]`) added in order, plus `bias`."""
    splits, rows, n = partials.shape
    _sum_splits_kernel[(triton.cdiv(n, 1024), rows)](
        partials, bias if bias is not None else partials, y, n, splits, partials.stride(0), partials.stride(1),
        y.stride(0), HAS_BIAS=bias is not None, BLOCK=1024)


@triton.jit
def _sum_splits_kernel(P, B, Y, N, SPLITS, stride_ps, stride_pm, stride_ym, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Y's row `program_id(1)`: the split-K partial sums (float32 `[splits, rows, N]`) added up."""
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    m = tl.program_id(1)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLITS):
        acc += tl.load(P + s * stride_ps + m * stride_pm + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + m * stride_ym + n, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _int4_run_products(C, X, crow, xrow, cmask, mmask, unit, K, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, RUNS: tl.constexpr, RUN: tl.constexpr):
    """For words `unit` ([RUNS, RUN]) of rows `crow`: the [rows, BLOCK_N, RUNS, RUN] products
    of each word's 8 columns with x, and x's [rows, RUNS, RUN] column sums."""
    words = tl.load(crow + unit[None, :, :], mask=cmask, other=0)
    high = words >> 16  # nibbles 4-7 at the bit positions of nibbles 0-3
    products = tl.zeros([BLOCK_M, BLOCK_N, RUNS, RUN], tl.float32)
    x_sum = tl.zeros([BLOCK_M, RUNS, RUN], tl.float32)
    for p in tl.static_range(8):
        if p < 4:
            src = words
        else:
            src = high
        # the nibble in the mantissa of 2^23: the float is 2^23 + q * 16^(p % 4), exactly
        q = ((src & (0xF << (4 * (p % 4)))) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        col = unit * 8 + p
        xp = tl.load(xrow + col[None, :, :], mask=mmask[:, None, None] & (col < K)[None, :, :], other=0.0)
        xp = xp.to(tl.float32)
        x_sum += xp
        products += (xp * (1.0 / (1 << (4 * (p % 4)))))[:, None, :, :] * q[None, :, :, :]
    return products, x_sum


@triton.jit
def _byte_run_products(C, X, crow, xrow, cmask, mmask, unit, K, UNIT: tl.constexpr):
    """For units `unit` ([RUNS, RUN]) of UNIT byte codes (FP8 / int8) of rows `crow`: the
    [rows, BLOCK_N, RUNS, RUN] products summed over each unit, and x's column sums."""
    e = tl.arange(0, UNIT)
    col = unit[:, :, None] * UNIT + e[None, None, :]
    kmask = col < K
    codes = tl.load(crow[:, :, :, None] + col[None, :, :, :], mask=cmask[:, :, :, None] & kmask[None, :, :, :],
                    other=0.0).to(tl.float32)
    xs = tl.load(xrow[:, :, :, None] + col[None, :, :, :], mask=mmask[:, None, None, None] & kmask[None, :, :, :],
                 other=0.0).to(tl.float32)
    products = tl.sum(xs[:, None, :, :, :] * codes[None, :, :, :, :], axis=4)
    return products, tl.sum(xs, axis=3)


@triton.jit
def _stream_gemv_kernel(X, C, S, OFF, B, Y, M, N, K, UNITS, CHUNKS, stride_xm, stride_cn, stride_sn,
                        stride_ys, stride_ym, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                        INT4: tl.constexpr, HAS_OFFSET: tl.constexpr, ROW_SCALE: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        RUNS: tl.constexpr, RUN: tl.constexpr, UNIT: tl.constexpr):
    """Program (i, s): rows [i * BLOCK_N, (i + 1) * BLOCK_N) of W over chunks
    [s * CHUNKS, (s + 1) * CHUNKS) of RUNS * RUN units, into Y's slice s."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    runs = tl.arange(0, RUNS)
    within = runs[:, None] * RUN + tl.arange(0, RUN)[None, :]
    crow = C + n[:, None, None].to(tl.int64) * stride_cn
    xrow = X + m[:, None, None].to(tl.int64) * stride_xm
    srow = (n // GROUP_N)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N, RUNS, RUN], tl.float32)
    acc_offset = tl.zeros([BLOCK_M, BLOCK_N, RUNS], tl.float32)
    chunk_units: tl.constexpr = RUNS * RUN
    first = tl.program_id(1) * CHUNKS * chunk_units
    for u0 in range(first, tl.minimum(first + CHUNKS * chunk_units, UNITS), chunk_units):
        unit = u0 + within
        cmask = nmask[:, None, None] & (unit < UNITS)[None, :, :]
        if INT4:
            products, x_sum = _int4_run_products(C, X, crow, xrow, cmask, mmask, unit, K, BLOCK_M, BLOCK_N,
                                                 RUNS, RUN)
        else:
            products, x_sum = _byte_run_products(C, X, crow, xrow, cmask, mmask, unit, K, UNIT)
        if ROW_SCALE:
            acc += products
        else:
            run_col = (u0 + runs * RUN) * UNIT
            gmask = nmask[:, None] & (run_col < K)[None, :]
            idx = srow + (run_col // GROUP_K)[None, :]
            scale = tl.load(S + idx, mask=gmask, other=0.0).to(tl.float32)
            acc += products * scale[None, :, :, None]
            if HAS_OFFSET:
                offset = tl.load(OFF + idx, mask=gmask, other=0.0).to(tl.float32)
                acc_offset += offset[None, :, :] * tl.sum(x_sum, axis=2)[:, None, :]
    out = tl.sum(tl.sum(acc, axis=3), axis=2) + tl.sum(acc_offset, axis=2)
    if ROW_SCALE:
        out *= tl.load(S + n * stride_sn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        out += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y = Y + tl.program_id(1) * stride_ys + m[:, None] * stride_ym + n[None, :]
    tl.store(y, out.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])
