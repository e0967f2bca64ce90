"""`y = x @ W.T` for W kept as int4 / int8 / FP8 codes with group scales (models/packed.py),
de-quantized in registers (Triton), so a decode step reads the packed bytes only.

Every program loops over the column pairs `(j, j + cols / 2)`: an int4 byte holds both, the
byte formats read them from the two halves of a row, and x's two halves are read alike, so
every load is contiguous whatever the code. Two forms:

- the GEMV (1-4 rows): products in float32 summed per chunk, W read once for every row;
- the tiled GEMM (more rows): each W tile de-quantized to x's dtype and fed to `tl.dot`,
  rows in blocks of 16 to 64.

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

GEMV_ROWS = 4  # the GEMV keeps a [rows, BLOCK_N, BLOCK_J] product in registers: few rows only
SCALED_MM_ROWS = 128  # from here FP8 per-channel products run on the FP8 tensor cores
_CODE_IDS = {"int4": 0, "int8": 1, "fp8": 1}  # int8 and FP8 codes both load and convert to float
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

    @property
    def shape(self) -> tuple[int, int]: ...


class Block(NamedTuple):
    """A launch shape: rows, output features and column pairs per program; warps; stages."""

    m: int
    n: int
    j: int
    warps: int
    stages: int


GEMV = Block(4, 4, 256, 4, 3)  # rows are set per call


def dot_block(rows: int) -> Block:
    """The GEMM's tile for `rows` rows: 16 rows (tl.dot's smallest) up to 64 per program;
    narrower in N while the rows fit one tile, so a decode step still has programs enough to
    keep every multiprocessor reading W."""
    m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    return Block(m, 32 if rows <= 64 else 64, 64, 4, 3)


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
def _packed_kernel(X, C, S, OFF, B, Y, M, N, HALF, stride_xm, stride_cn, stride_sn, stride_ym,
                   GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                   CODE: tl.constexpr, HAS_OFFSET: tl.constexpr, ROW_SCALE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    """Both forms: DOT feeds W's tiles (in x's dtype) to `tl.dot`, else float32 products are
    summed per chunk (the GEMV: one program for all rows, W read once)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < M
    x_row = X + m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for j0 in range(0, HALF, BLOCK_J):
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
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def matmul(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None, *,
           block: Block | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, cols] @ W.T (+ bias)` in x's dtype; `block` forces a launch shape (tests),
    `out` may be a column slice of a wider output."""
    rows = x.shape[0]
    if block is None and x.is_cuda and rows >= SCALED_MM_ROWS and rows % 16 == 0 and scaled_mm_fits(weight):
        return scaled_mm(x, weight, bias, out)
    x = x.contiguous()
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device) if out is None else out
    if rows == 0:
        return y
    block = block or (GEMV._replace(m=triton.next_power_of_2(rows)) if rows <= GEMV_ROWS else dot_block(rows))
    half = weight.cols // 2
    args = (x, weight.codes, weight.scales, weight.offsets if weight.offsets is not None else weight.scales,
            bias if bias is not None else weight.scales, y, rows, n, half, x.stride(0), weight.codes.stride(0),
            weight.scales.stride(0), y.stride(0))
    row_scale = weight.offsets is None and weight.group_rows == 1 and weight.group_cols >= weight.cols
    # group sizes are constants so the scale index is a shift, not a division per weight; float32
    # products stay float32 (tl.dot would round them to TF32 on the GPU)
    consts = {"GROUP_N": weight.group_rows, "GROUP_K": weight.group_cols, "CODE": _CODE_IDS[weight.code],
              "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32", "HAS_OFFSET": weight.offsets is not None, "ROW_SCALE": row_scale,
              "HAS_BIAS": bias is not None,
              "BLOCK_N": block.n, "BLOCK_J": min(block.j, triton.next_power_of_2(half)),
              "num_warps": block.warps, "num_stages": block.stages}
    grid = (triton.cdiv(n, block.n), triton.cdiv(rows, block.m))
    _packed_kernel[grid](*args, DOT=block.m > GEMV_ROWS, BLOCK_M=block.m, **consts)
    return y


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
    if bias is not None:
        y += bias
    if out is None:
        return y
    out.copy_(y)
    return out
