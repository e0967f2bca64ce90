"""The bandwidth GEMV: `y = x @ W.T` for 1-4 rows of x and W kept as int4 codes in the "words"
layout or as FP8 / int8 codes (models/packed.py), built to stream W at the memory's speed.

A batch-1 projection reads every byte of W once and does two flops per weight, so its time is
the bytes over the bandwidth if enough of them are in flight. Each program owns BLOCK_N output
rows and walks its share of the columns in chunks of `Block.j` columns:

- the chunk is a `[BLOCK_N, RUNS, RUN]` tile of vector units, K-contiguous per row, so every
  thread issues 16-byte loads (a unit is an int32 word of 8 nibbles, or 16 FP8 / int8 codes);
  RUN units share one scale, loaded once per run;
- int4 nibbles become floats without the int-to-float unit: a nibble kept in place among the
  mantissa bits of 2^23 is the float `2^23 + q * 16^k`, so one logic op and one exact
  multiply-add give q; each word's 8 products with x (one 16-byte load of x per word, split
  into 8 planes) are one multiply-add chain;
- each run's products are summed in float32 registers, scaled, and added to a float32
  accumulator that is reduced across the chunk once, after the loop; offsets multiply the
  run's sum of x instead of every weight;
- every tensor keeps the weight tile's register layout (one accumulator per row of x, not a
  rows axis), so products never move through shared memory; with `Block.stages` > 1 the next
  chunk's codes load while this one is multiplied;
- split-K: with `splits` > 1, program (i, s) sums its slice of the chunks into float32
  partials `[splits, rows, N]` and a second launch adds them in a fixed order (no atomics:
  the same sum every run). `splits=0` picks the count from the multiprocessors.

On Hopper both launches take programmatic dependent launch (kernels/dependent_launch.py): the
first chunk of codes loads while the kernel before finishes. Capturable in CUDA graphs: no host synchronisation, no allocation but the output and the
partials. The tests compare it with `PackedWeight.dequantize` followed by a matmul.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from structgen.engine.kernels.dependent_launch import launch_args, wait_for_inputs

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
    splits, chunks, target = split_k(block.splits, triton.cdiv(n, block.n), PROGRAMS_PER_SM, chunks_total, y, rows, n)
    row_scale = weight.offsets is None and weight.group_rows == 1 and weight.group_cols >= cols
    scales = weight.scales
    _stream_gemv_kernel[(triton.cdiv(n, block.n), splits)](
        x, weight.codes, scales, weight.offsets if weight.offsets is not None else scales,
        bias if bias is not None else scales, target, rows, n, cols, units, chunks,
        x.stride(0), weight.codes.stride(0), scales.stride(0), target.stride(0) if splits > 1 else 0,
        target.stride(-2), GROUP_N=weight.group_rows, GROUP_K=weight.group_cols, INT4=weight.code == "int4",
        HAS_OFFSET=weight.offsets is not None, ROW_SCALE=row_scale, HAS_BIAS=bias is not None and splits == 1,
        BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=block.n, RUNS=block_k // run_cols,
        RUN=run_cols // unit_cols, UNIT=unit_cols, PREFETCH=block.stages > 1, num_warps=block.warps,
        num_stages=block.stages, **launch_args(x.device, rows))
    if splits > 1:
        sum_splits(target, bias, y)


def split_k(splits: int, programs: int, programs_per_sm: int, chunks_total: int, y: torch.Tensor, rows: int,
            n: int) -> tuple[int, int, torch.Tensor]:
    """(splits, chunks a split, where the products go) for `chunks_total` chunks of columns:
    `splits`, or with 0 a count that brings `programs` programs (`programs_per_sm` of them a
    multiprocessor's fill) up to the GPU's; none left empty. The products go to `y` itself, or,
    split, to float32 partials `[splits, rows, n]` that `sum_splits` adds."""
    splits = splits or auto_splits(programs * PROGRAMS_PER_SM // programs_per_sm, chunks_total, y.device)
    chunks = triton.cdiv(chunks_total, splits)
    splits = triton.cdiv(chunks_total, chunks)
    target = y if splits == 1 else torch.empty(splits, rows, n, dtype=torch.float32, device=y.device)
    return splits, chunks, target


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
        y.stride(0), HAS_BIAS=bias is not None, BLOCK=1024, **launch_args(y.device, rows))


@triton.jit
def _sum_splits_kernel(P, B, Y, N, SPLITS, stride_ps, stride_pm, stride_ym, HAS_BIAS: tl.constexpr,
                       PDL: tl.constexpr, BLOCK: tl.constexpr):
    """Y's row `program_id(1)`: the split-K partial sums (float32 `[splits, rows, N]`) added up."""
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    m = tl.program_id(1)
    wait_for_inputs(PDL)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLITS):
        acc += tl.load(P + s * stride_ps + m * stride_pm + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + m * stride_ym + n, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _load_tile(crow, nmask, unit, limit, col, K, INT4: tl.constexpr):
    """The codes of units `unit` ([RUNS, RUN]) below `limit` of rows `crow`: int32 words
    [BLOCK_N, RUNS, RUN], or byte codes [BLOCK_N, RUNS, RUN, UNIT] at columns `col`."""
    umask = nmask[:, None, None] & (unit < limit)[None, :, :]
    if INT4:
        tile = tl.load(crow + unit[None, :, :], mask=umask, other=0)
    else:
        cmask = umask[:, :, :, None] & (col < K)[None, :, :, :]
        tile = tl.load(crow[:, :, :, None] + col[None, :, :, :], mask=cmask, other=0.0)
    return tile


@triton.jit
def _nibble(src, k: tl.constexpr):
    """Nibble k of every int32 word of `src` (already OR-ed with the bits of 2^23) as float32,
    exactly: kept in place among the mantissa bits of 2^23 it is the float `2^23 + q * 16^k`,
    which one multiply-add by `16^-k` and `-2^(23 - 4k)` (powers of two: no rounding) turns
    into q. `(w | C) & (M | C)` is `(w & M) | C` with a single constant per logic op."""
    f = (src & ((0xF << (4 * k)) | 0x4B000000)).to(tl.float32, bitcast=True)
    return tl.fma(f, 1.0 / (1 << (4 * k)), -8388608.0 / (1 << (4 * k)))


@triton.jit
def _nibble_planes(tile):
    """The 8 nibbles of every word of `tile` ([BLOCK_N, RUNS, RUN] int32): 8 float32 planes,
    plane p holding column 8 w + p of word w."""
    low = tile | 0x4B000000
    high = (tile >> 16) | 0x4B000000  # nibbles 4-7 at the bit positions of nibbles 0-3
    return (_nibble(low, 0), _nibble(low, 1), _nibble(low, 2), _nibble(low, 3),
            _nibble(high, 0), _nibble(high, 1), _nibble(high, 2), _nibble(high, 3))


@triton.jit
def _split8(x):
    """x [RUNS, RUN, 8] as its 8 planes along the last axis (tl.split halves the last axis)."""
    runs: tl.constexpr = x.shape[0]
    run: tl.constexpr = x.shape[1]
    even, odd = tl.split(tl.reshape(x, [runs, run, 4, 2]))
    x04, x26 = tl.split(tl.reshape(even, [runs, run, 2, 2]))
    x15, x37 = tl.split(tl.reshape(odd, [runs, run, 2, 2]))
    x0, x4 = tl.split(x04)
    x2, x6 = tl.split(x26)
    x1, x5 = tl.split(x15)
    x3, x7 = tl.split(x37)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _int4_row_products(planes, x):
    """Each word's 8 products with x's row chunk `x` ([RUNS, RUN, 8]) summed in one multiply-add
    chain: [BLOCK_N, RUNS, RUN]."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(x)
    shape: tl.constexpr = planes[0].shape
    products = planes[0] * x0[None, :, :]
    products = tl.fma(planes[1], tl.broadcast_to(x1[None, :, :], shape), products)
    products = tl.fma(planes[2], tl.broadcast_to(x2[None, :, :], shape), products)
    products = tl.fma(planes[3], tl.broadcast_to(x3[None, :, :], shape), products)
    products = tl.fma(planes[4], tl.broadcast_to(x4[None, :, :], shape), products)
    products = tl.fma(planes[5], tl.broadcast_to(x5[None, :, :], shape), products)
    products = tl.fma(planes[6], tl.broadcast_to(x6[None, :, :], shape), products)
    return tl.fma(planes[7], tl.broadcast_to(x7[None, :, :], shape), products)


@triton.jit
def _accumulate_row(acc, values, xrow, col, kmask, scale, offset, INT4: tl.constexpr,
                    HAS_OFFSET: tl.constexpr, ROW_SCALE: tl.constexpr):
    """`acc` after one chunk of one row of x (`xrow`): each unit's products summed, scaled per
    run, and the run's offset times x's sum over the unit. `values`: the int4 nibble planes,
    or the byte codes as float32 [BLOCK_N, RUNS, RUN, UNIT]."""
    x = tl.load(xrow + col, mask=kmask, other=0.0).to(tl.float32)
    if INT4:
        products = _int4_row_products(values, x)
    else:
        products = tl.sum(values * x[None, :, :, :], axis=3)
    if ROW_SCALE:
        acc += products
    else:
        acc = tl.fma(products, tl.broadcast_to(scale[:, :, None], acc.shape), acc)
        if HAS_OFFSET:
            acc += offset[:, :, None] * tl.sum(x, axis=2)[None, :, :]
    return acc


@triton.jit
def _store_row(Y, r, M, n, nmask, acc, S, B, stride_sn, stride_ym, ROW_SCALE: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    """Row r of the output (or of the program's split-K slice `Y`): the accumulator reduced."""
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if ROW_SCALE:
        out *= tl.load(S + n * stride_sn, mask=nmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        out += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(Y + r * stride_ym + n, out.to(Y.dtype.element_ty), mask=nmask & (tl.zeros_like(n) + r < M))


@triton.jit
def _stream_gemv_kernel(X, C, S, OFF, B, Y, M, N, K, UNITS, CHUNKS, stride_xm, stride_cn, stride_sn,
                        stride_ys, stride_ym, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                        INT4: tl.constexpr, HAS_OFFSET: tl.constexpr, ROW_SCALE: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        RUNS: tl.constexpr, RUN: tl.constexpr, UNIT: tl.constexpr, PREFETCH: tl.constexpr,
                        PDL: tl.constexpr):
    """Program (i, s): rows [i * BLOCK_N, (i + 1) * BLOCK_N) of W over chunks
    [s * CHUNKS, (s + 1) * CHUNKS) of RUNS * RUN units, into Y's slice s. Every tensor keeps
    the weight tile's layout (one accumulator per row of x, not a rows axis), so the products
    need no layout conversion between the loads and the sums; with PREFETCH the next chunk's
    codes load while this one is multiplied."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    runs = tl.arange(0, RUNS)
    within = runs[:, None] * RUN + tl.arange(0, RUN)[None, :]
    e = tl.arange(0, UNIT)
    crow = C + n[:, None, None].to(tl.int64) * stride_cn
    srow = (n // GROUP_N)[:, None] * stride_sn
    acc0 = tl.zeros([BLOCK_N, RUNS, RUN], tl.float32)
    acc1 = tl.zeros([BLOCK_N, RUNS, RUN], tl.float32)
    acc2 = tl.zeros([BLOCK_N, RUNS, RUN], tl.float32)
    acc3 = tl.zeros([BLOCK_N, RUNS, RUN], tl.float32)
    chunk_units: tl.constexpr = RUNS * RUN
    first = tl.program_id(1) * CHUNKS * chunk_units
    last = tl.minimum(first + CHUNKS * chunk_units, UNITS)
    col = (first + within)[:, :, None] * UNIT + e[None, None, :]
    tile = _load_tile(crow, nmask, first + within, last, col, K, INT4)
    # the first codes are loaded before waiting for x: no kernel writes weights
    wait_for_inputs(PDL)
    for u0 in range(first, last, chunk_units):
        unit = u0 + within
        col = unit[:, :, None] * UNIT + e[None, None, :]
        kmask = col < K
        if PREFETCH:
            upcoming = _load_tile(crow, nmask, unit + chunk_units, last, col + chunk_units * UNIT, K, INT4)
        else:
            tile = _load_tile(crow, nmask, unit, last, col, K, INT4)
        if INT4:
            values = _nibble_planes(tile)
        else:
            values = tile.to(tl.float32)
        scale = srow  # unused with ROW_SCALE
        offset = srow
        if not ROW_SCALE:
            run_col = (u0 + runs * RUN) * UNIT
            gmask = nmask[:, None] & (run_col < K)[None, :]
            idx = srow + (run_col // GROUP_K)[None, :]
            scale = tl.load(S + idx, mask=gmask, other=0.0).to(tl.float32)
            if HAS_OFFSET:
                offset = tl.load(OFF + idx, mask=gmask, other=0.0).to(tl.float32)
        # rows past M read row r % M (valid memory) and are never stored
        acc0 = _accumulate_row(acc0, values, X, col, kmask, scale, offset, INT4, HAS_OFFSET, ROW_SCALE)
        if BLOCK_M > 1:
            acc1 = _accumulate_row(acc1, values, X + (1 % M) * stride_xm, col, kmask, scale, offset, INT4,
                                   HAS_OFFSET, ROW_SCALE)
        if BLOCK_M > 2:
            acc2 = _accumulate_row(acc2, values, X + (2 % M) * stride_xm, col, kmask, scale, offset, INT4,
                                   HAS_OFFSET, ROW_SCALE)
            acc3 = _accumulate_row(acc3, values, X + (3 % M) * stride_xm, col, kmask, scale, offset, INT4,
                                   HAS_OFFSET, ROW_SCALE)
        if PREFETCH:
            tile = upcoming
    Y += tl.program_id(1) * stride_ys
    _store_row(Y, 0, M, n, nmask, acc0, S, B, stride_sn, stride_ym, ROW_SCALE, HAS_BIAS)
    if BLOCK_M > 1:
        _store_row(Y, 1, M, n, nmask, acc1, S, B, stride_sn, stride_ym, ROW_SCALE, HAS_BIAS)
    if BLOCK_M > 2:
        _store_row(Y, 2, M, n, nmask, acc2, S, B, stride_sn, stride_ym, ROW_SCALE, HAS_BIAS)
        _store_row(Y, 3, M, n, nmask, acc3, S, B, stride_sn, stride_ym, ROW_SCALE, HAS_BIAS)
