"""Masked sampling in one pass over the logits: grammar bitmask, temperature, Gumbel noise and
argmax fused, graph-safe (every per-row input is a device tensor).

Sampling is Gumbel-max: `argmax(logits / T + G)` with `G = -log(-log(U))` draws exactly
from `softmax(logits / T)`. The uniforms come from Philox keyed by a per-row seed and the
token id, so a seeded request draws the same noise whatever it is batched with and whichever
path (graph or eager) runs its step. Greedy rows (T = 0) skip the noise; rows whose flag says
"no grammar" skip the bitmask, so unconstrained rows need no all-ones mask.

Two kernels: each program reduces one block of one row's vocabulary to (max, argmax); the
second picks the best block per row. Ties go to the lowest token id, like `torch.argmax`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def _block_argmax_kernel(Logits, stride_l, Bitmask, stride_b, HasMask, Temp, Seeds, PVal, PIdx,
                         vocab, n_blocks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    valid = offs < vocab
    x = tl.load(Logits + row * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    if tl.load(HasMask + row) != 0:
        words = tl.load(Bitmask + row * stride_b + offs // 32, mask=valid, other=0)
        x = tl.where(((words >> (offs % 32)) & 1) != 0, x, float("-inf"))
    t = tl.load(Temp + row)
    if t > 0:
        u = tl.rand(tl.load(Seeds + row), offs)
        x = x / t - tl.log(-tl.log(u))
    # NaN never wins (torch.argmax would pick it, but then no grammar could accept it), and
    # an all -inf block ties at its first lane, always a real token id.
    x = tl.where(x == x, x, float("-inf"))
    best = tl.max(x, 0)
    idx = tl.argmax(x, 0)
    tl.store(PVal + row * n_blocks + blk, best)
    tl.store(PIdx + row * n_blocks + blk, blk * BLOCK + idx)


@triton.jit
def _pick_kernel(PVal, PIdx, Out, n_blocks, BLOCKS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BLOCKS_PAD)
    v = tl.load(PVal + row * n_blocks + b, mask=b < n_blocks, other=float("-inf"))
    best = tl.argmax(v, 0)
    tl.store(Out + row, tl.load(PIdx + row * n_blocks + best))


def sample_tokens(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    has_mask: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of `logits` [B, V] (any float dtype).

    Parameters
    ----------
    bitmask: int32 [B, ceil(V/32)], bit set = allowed; read only where `has_mask` [B] is nonzero.
    temperature: float32 [B]; 0 = greedy. seeds: int64 [B], Philox seed of each row's noise.
    out: optional int64 [B] to write into (a graph's static output).
    """
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    n_blocks = triton.cdiv(vocab, BLOCK_V)
    pval = torch.empty(rows, n_blocks, dtype=torch.float32, device=logits.device)
    pidx = torch.empty(rows, n_blocks, dtype=torch.int64, device=logits.device)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _block_argmax_kernel[(rows, n_blocks)](
        logits, logits.stride(0), bitmask, bitmask.stride(0), has_mask, temperature, seeds, pval, pidx,
        vocab, n_blocks, BLOCK=BLOCK_V, num_warps=4,
    )
    _pick_kernel[(rows,)](pval, pidx, out, n_blocks, BLOCKS_PAD=triton.next_power_of_2(n_blocks), num_warps=1)
    return out
