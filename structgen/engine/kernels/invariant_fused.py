"""The batch-invariant GEMM (`gemv.invariant_gemm`) with a Llama layer's small stages fused in.

In the batch-invariant mode a row's numbers must not depend on how many rows share its step, so
the per-row-count kernels, `fused_gemv.py`'s norm-fused projections among them, are off, and a
layer at batch 1 runs ten kernels where the default mode runs six: for a small model kernel
count is the step's cost (docs/performance.md, "Batch invariance"). These kernels put three of
them back inside the invariant GEMM, for every row count, so they stay invariant:

- `norm_gemm`: `W @ rms_norm(x + residual)`. Each program streams its rows of x (plus the
  residual) through the tile, sums x^2 on the way and scales its dot products by 1/rms at
  the end (`fused_gemv.py`'s prologue); the programs of the first feature block then write
  `x + residual` out as the new residual stream.
- `silu_gemm`: `W @ (silu(gate) * up)` from the gate_up projection's output, the product
  formed chunk by chunk as the tile loads it.

A row's sums run in the same order whatever the row count: its tile has `invariant_block`'s
fixed shape, its norm sum is over the same chunks, and no sum involves another row. Numerics:
the norm scales the float32 dot product instead of x rounded to the model dtype, as in
`fused_gemv.py`, so results differ from the unfused invariant path by bf16 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from structgen.engine.kernels.dependent_launch import launch_args, wait_for_inputs
from structgen.engine.kernels.gemv import invariant_block

PRO_NORM, PRO_SILU = tl.constexpr(1), tl.constexpr(2)  # constexpr: the kernel reads them


@triton.jit(do_not_specialize=["M"])
def _prologue_kernel(X, R, G, W, B, Y, RO, M, N, K, stride_xm, stride_rm, stride_wn, stride_ym, stride_rom, eps,
                     PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     PDL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`gemv._invariant_kernel`'s tile (program p: row tile p % tiles, feature block p //
    tiles), its x chunk formed by the prologue: PRO_NORM, `(x + R) * G` with the row's sum of
    squares kept and the residual sum written to RO by feature block 0; PRO_SILU, `silu(x) *
    x[:, K:]` (gate | up)."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(M, BLOCK_M)
    block_n = pid // tiles
    n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (pid % tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    nmask, mmask = n < N, m < M
    w_ptr = W + n[:, None].to(tl.int64) * stride_wn
    x_ptr = X + m[:, None].to(tl.int64) * stride_xm
    wait_for_inputs(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    squares = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        xmask = mmask[:, None] & kmask[None, :]
        if EVEN_K:  # masked on K only where the chunks do not divide it (gemv._load_chunk)
            w = tl.load(w_ptr + k[None, :], mask=nmask[:, None], other=0.0)
        else:
            w = tl.load(w_ptr + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(x_ptr + k[None, :], mask=xmask, other=0.0)
        dt = x.dtype
        if PROLOGUE == PRO_NORM:
            if HAS_RES:
                r = tl.load(R + m[:, None].to(tl.int64) * stride_rm + k[None, :], mask=xmask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, 1)
            g = tl.load(G + k, mask=kmask, other=0.0).to(tl.float32)
            a = (xf * g[None, :]).to(dt)
        else:
            up = tl.load(x_ptr + K + k[None, :], mask=xmask, other=0.0).to(tl.float32)
            gate = x.to(tl.float32)
            a = ((gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up).to(dt)
        acc = tl.dot(a, tl.trans(w), acc)
    if PROLOGUE == PRO_NORM:
        acc = acc * (1.0 / tl.sqrt(squares / K + eps))[:, None]
        if HAS_RES:  # after the loop: a store in it would stop its loads' pipelining
            if block_n == 0:
                for k0 in range(0, K, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    xmask = mmask[:, None] & (k < K)[None, :]
                    x = tl.load(x_ptr + k[None, :], mask=xmask, other=0.0)
                    r = tl.load(R + m[:, None].to(tl.int64) * stride_rm + k[None, :], mask=xmask, other=0.0)
                    tl.store(RO + m[:, None].to(tl.int64) * stride_rom + k[None, :],
                             (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype), mask=xmask)
    if HAS_BIAS:
        acc += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y_ptr = Y + m[:, None].to(tl.int64) * stride_ym + n[None, :]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _launch(x: torch.Tensor, weight: torch.Tensor, k: int, prologue: tl.constexpr, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual sum) of one launch over x's rows; the sum is x where none is formed."""
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == k
    m, n = x.shape[0], weight.shape[0]
    tile_rows, block = invariant_block(weight, m)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if residual is not None else x
    if m == 0:
        return y, res_out
    bk = min(block.k, triton.next_power_of_2(k))
    r = residual if residual is not None else x
    grid = (triton.cdiv(n, block.n) * triton.cdiv(m, tile_rows),)
    _prologue_kernel[grid](
        x, r, norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight,
        y, res_out, m, n, k,
        x.stride(0), r.stride(0), weight.stride(0), y.stride(0), res_out.stride(0), eps,
        PROLOGUE=prologue, HAS_RES=residual is not None, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, BLOCK_M=tile_rows, BLOCK_N=block.n,
        BLOCK_K=bk, num_warps=block.warps, num_stages=block.stages, **launch_args(x.device, m))
    return y, res_out


def norm_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor,
              eps: float, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * norm_weight @ weight^T + bias, x + residual) for x [M, K],
    weight [N, K], each row computed as it would be alone; without `residual`, (..., x)."""
    return _launch(x, weight, x.shape[1], PRO_NORM, bias, residual, norm_weight, eps)


def silu_gemm(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ weight^T for gate_up [M, 2K] (gate | up) and weight [N, K], each row
    computed as it would be alone."""
    return _launch(gate_up, weight, gate_up.shape[1] // 2, PRO_SILU)[0]
