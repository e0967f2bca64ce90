"""Matrix-vector products `y = x @ W^T` for one-row decode steps of small models (Triton).

At one row a projection is bound by reading W once, but for a small model's matrices (a few
MB) cuBLAS's fixed cost per call dominates: measured on an H100 (2026-11, CUDA graphs, cold
weights) its kernels took 3.3-5.2 us on SmolLM2-135M's four projections where this one takes
2.5-4.0 us, i.e. ~0.1 ms of a 0.9 ms step. From ~4M weights up cuBLAS is as fast or faster,
and at 4 rows it always was, so `use_gemv` sends only single rows of small matrices here.
Each program owns BLOCK_N output features, streams their [BLOCK_N, K] slab of W in BLOCK_K
chunks and keeps its accumulator in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 4
MAX_WEIGHT = 4 << 20  # elements: above this cuBLAS reads W at least as fast


def use_gemv(rows: int, weight: torch.Tensor) -> bool:
    """Whether `gemv` beats cuBLAS for this product (see the module docstring)."""
    return rows == 1 and weight.numel() <= MAX_WEIGHT


@triton.jit
def _gemv_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_ptr = W + n[:, None].to(tl.int64) * stride_wn
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(w_ptr + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         block_n: int = 4, block_k: int = 1024, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )
    return y
