"""Matrix-vector products `y = x @ W^T` for one-row decode steps (Triton; up to 4 rows work).

At one row a projection is bound by reading W once. cuBLAS is not always best at it: for a
small model's matrices (a few MB) its fixed cost per call dominates, and for some large ones
its kernels stream W slower than this one does. Measured on an H100 (2026-11, CUDA graphs,
weights cold in L2): SmolLM2-135M's four projections 3.3-5.2 us in cuBLAS, 2.5-4.0 us here;
Llama-8B's lm_head 371 vs 331 us (2.83 vs 3.17 TB/s) and gate_up 82 vs 78 us, while its qkv
projection is cuBLAS's (20.6 us) and the best block shape differs per matrix. So `plan` times
cuBLAS against a few block shapes once per large matrix on the device, outside any graph
capture (the decode graphs' warm-up runs every shape first), and keeps the fastest. Small
matrices keep the fixed rule: timed in isolation they picked shapes that ran slower inside the
decode graph (SmolLM2 batch 1 0.90 instead of 0.79 ms/step). Rows past one take cuBLAS.
Each program owns BLOCK_N output features, streams their [BLOCK_N, K] slab of W in BLOCK_K
chunks and keeps its accumulator in registers.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 4
MAX_WEIGHT = 4 << 20  # elements: above this cuBLAS reads W at least as fast (the untimed rule)
# (block_n, block_k, num_warps, num_stages) timed against cuBLAS: the best shapes of a sweep
# over SmolLM2, Llama-1B and Llama-8B matrices on the H100.
CONFIGS = ((4, 1024, 4, 4), (2, 2048, 4, 4), (2, 4096, 8, 3))
DEFAULT = CONFIGS[0]
MARGIN = 0.97  # a block shape must beat cuBLAS by 3 %: near-ties stay with cuBLAS
_plans: dict[tuple, tuple[int, int, int, int] | None] = {}


def use_gemv(rows: int, weight: torch.Tensor) -> bool:
    """The untimed rule: single rows of small matrices (see the module docstring)."""
    return rows == 1 and weight.numel() <= MAX_WEIGHT


def plan(rows: int, weight: torch.Tensor) -> tuple[int, int, int, int] | None:
    """The block shape to run `x[rows] @ weight.T` with, or None for cuBLAS: the fixed rule,
    except one row of a large CUDA matrix, timed on first use per (shape, dtype, device)."""
    if rows != 1 or not weight.is_cuda or weight.numel() <= MAX_WEIGHT:
        return DEFAULT if weight.is_cuda and use_gemv(rows, weight) else None
    key = (rows, tuple(weight.shape), weight.dtype, weight.device)
    if key not in _plans:
        if torch.cuda.is_current_stream_capturing():  # no timing inside a capture
            return None
        _plans[key] = _time(rows, weight)
    return _plans[key]


def _time(rows: int, weight: torch.Tensor, reps: int = 15) -> tuple[int, int, int, int] | None:
    """Median time of cuBLAS and of each block shape on `weight`, L2 flushed before each call
    (a forward reads every matrix cold: the model is far larger than L2)."""
    x = torch.randn(rows, weight.shape[1], device=weight.device, dtype=weight.dtype)
    flush = torch.empty(96 << 20, dtype=torch.int8, device=weight.device)
    ref = F.linear(x, weight).float()
    times: dict[tuple[int, int, int, int] | None, float] = {}
    for cfg in (None, *CONFIGS):
        def run(cfg=cfg) -> torch.Tensor:
            if cfg is None:
                return F.linear(x, weight)
            bn, bk, nw, ns = cfg
            return gemv(x, weight, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)

        y = run().float()  # compiles; a shape that computes wrong is never chosen
        if cfg is not None and (y - ref).norm() > 1e-2 * ref.norm():
            continue
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            flush.zero_()
            start.record()
            run()
            end.record()
        torch.cuda.synchronize(weight.device)
        times[cfg] = statistics.median(s.elapsed_time(e) for s, e in events)
    best = min((c for c in times if c is not None), key=times.__getitem__, default=None)
    return best if best is not None and times[best] < MARGIN * times[None] else None


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
