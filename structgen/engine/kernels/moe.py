"""Mixture-of-experts kernels: the router (softmax + top-k) in one launch, and every (token,
chosen expert) pair of a step in one launch for gate/up (+ SiLU * up) and one for down (+ the
routing weight).

The pairs are sorted by expert and each expert's run padded to whole blocks of BLOCK_M rows
(`align_by_expert`), so a program multiplies one block of rows by one expert's weights, read
once per block. Every shape depends only on the number of tokens, never on the routing: the
alignment is one launch over fixed-size buffers, blocks past the padded total return at once,
and padding rows hold a sentinel pair. Nothing reads a value back to the host, so a decode
step captures into a CUDA graph. Steps of at most `GEMV_MAX_PAIRS` pairs (decode batches)
skip the sort: one GEMV per pair over its expert's weights, fewer launches where they, not the
bytes, would cost.

The torch references the tests compare to are `models/moe.experts_reference` and the torch
path of `models/moe.SparseMoE.route`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Up to this many (token, expert) pairs a step runs one GEMV per pair (no sort): decode batches.
GEMV_MAX_PAIRS = 64


@dataclass
class ExpertBlocks:
    """Pairs (token * top_k + slot) sorted by expert and padded to blocks of `block_m` rows."""

    sorted_pairs: torch.Tensor  # [max_blocks * block_m] pair index, `num_pairs` on padding rows
    block_experts: torch.Tensor  # [max_blocks] the expert of each block
    padded_total: torch.Tensor  # [1] rows in use; blocks from there on have nothing to do
    block_m: int
    num_pairs: int


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks the alignment may fill: at most min(E, pairs) partial ones beyond
    ceil(pairs / block_m) full ones."""
    return min(num_experts, pairs) + triton.cdiv(pairs, block_m)


@triton.jit
def _align_kernel(Ids, SortedPairs, BlockExperts, PaddedTotal, num_pairs,
                  NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """One program per expert: count every expert's pairs (each program alike, no second
    launch), place this expert's pairs in pair order after the padded runs of the experts
    before it, fill its padding rows with the sentinel and name it as its blocks' expert."""
    expert = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(Ids + p, mask=p < num_pairs, other=BLOCK_E)
        counts += tl.sum((ids[None, :] == experts[:, None]).to(tl.int32), axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < expert, padded, 0), 0)
    mine = tl.sum(tl.where(experts == expert, counts, 0), 0)
    mine_padded = tl.sum(tl.where(experts == expert, padded, 0), 0)
    if expert == 0:
        tl.store(PaddedTotal, tl.sum(padded, 0).to(tl.int64))
    placed = 0
    for p0 in range(0, num_pairs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(Ids + p, mask=p < num_pairs, other=BLOCK_E)
        hit = (ids == expert).to(tl.int32)
        rank = placed + tl.cumsum(hit, 0) - 1
        tl.store(SortedPairs + start + rank, p, mask=hit == 1)
        placed += tl.sum(hit, 0)
    pad = mine + tl.arange(0, BLOCK_M)
    tl.store(SortedPairs + start + pad, num_pairs, mask=pad < mine_padded)
    for b in range(0, mine_padded // BLOCK_M):
        tl.store(BlockExperts + start // BLOCK_M + b, expert)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort the pairs of `topk_ids` [tokens, top_k] by expert (in pair order within one),
    each expert's run padded to a multiple of `block_m`, in one launch and shapes fixed by the
    token count. Rows and blocks past `padded_total` are left unset: no kernel reads them."""
    pairs, device = topk_ids.numel(), topk_ids.device
    blocks = max_blocks(pairs, num_experts, block_m)
    out = ExpertBlocks(torch.empty(blocks * block_m, dtype=torch.int32, device=device),
                       torch.empty(blocks, dtype=torch.int32, device=device),
                       torch.empty(1, dtype=torch.int64, device=device), block_m, pairs)
    block_e = triton.next_power_of_2(num_experts)
    _align_kernel[(num_experts,)](topk_ids.contiguous().view(-1), out.sorted_pairs, out.block_experts,
                                  out.padded_total, pairs, NUM_EXPERTS=num_experts, BLOCK_E=block_e,
                                  BLOCK_M=block_m, BLOCK_P=max(16, 16384 // block_e), num_warps=4)
    return out


def align_by_expert_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """`align_by_expert` in torch (a stable sort and scatters), which the tests compare it to."""
    flat = topk_ids.flatten().long()
    pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[by_expert]
    blocks = max_blocks(pairs, num_experts, block_m)
    sorted_pairs = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, (padded_end - padded)[by_expert] + rank, order.to(torch.int32))
    starts = torch.arange(blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, starts, right=True).clamp_(max=num_experts - 1)
    return ExpertBlocks(sorted_pairs, block_experts.to(torch.int32), padded_end[-1:], block_m, pairs)


@triton.jit
def _route_kernel(Logits, Weights, Ids, stride_l, num_experts,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    """One token's router: softmax over the experts in float32, the top k by probability
    (highest first), renormalised to sum to one where NORMALIZE."""
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(Logits + row * stride_l + experts, mask=experts < num_experts, other=float("-inf"))
    logits = logits.to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, 0))
    probs = probs / tl.sum(probs, 0)
    left = tl.where(experts < num_experts, probs, -1.0)
    slots = tl.arange(0, K_PAD)
    chosen_p = tl.zeros((K_PAD,), dtype=tl.float32)
    chosen_id = tl.zeros((K_PAD,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        best_id = tl.min(tl.where(left == best, experts, BLOCK_E), 0)
        chosen_p = tl.where(slots == j, best, chosen_p)
        chosen_id = tl.where(slots == j, best_id.to(tl.int64), chosen_id)
        left = tl.where(experts == best_id, -1.0, left)
    if NORMALIZE:
        chosen_p = chosen_p / tl.sum(chosen_p, 0)
    tl.store(Weights + row * TOP_K + slots, chosen_p, mask=slots < TOP_K)
    tl.store(Ids + row * TOP_K + slots, chosen_id, mask=slots < TOP_K)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights, int64 expert ids), both [tokens, top_k]: softmax, top k, optionally
    renormalised, in one launch (`models/moe.SparseMoE.route`'s torch path is the reference)."""
    tokens, num_experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    _route_kernel[(tokens,)](logits, weights, ids, logits.stride(0), num_experts, TOP_K=top_k,
                             K_PAD=triton.next_power_of_2(top_k), NORMALIZE=normalize,
                             BLOCK_E=triton.next_power_of_2(num_experts), num_warps=1)
    return weights, ids


@triton.jit
def _gate_up_kernel(X, W, Out, SortedPairs, BlockExperts, PaddedTotal,
                    stride_x, stride_we, stride_wn, stride_o, num_pairs, inter, hidden,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Out[pair, n] = silu(x[token] . W[e, n]) * (x[token] . W[e, inter + n]) for one block."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(PaddedTotal):
        return
    pair = tl.load(SortedPairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(BlockExperts + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_gate = W + expert * stride_we + cols[None, :] * stride_wn
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(X + token[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        acc_gate = tl.dot(a, tl.load(w_gate + ks[:, None], mask=w_mask, other=0.0), acc_gate,
                          input_precision=PRECISION)
        acc_up = tl.dot(a, tl.load(w_up + ks[:, None], mask=w_mask, other=0.0), acc_up,
                        input_precision=PRECISION)
    dt = Out.dtype.element_ty
    # Rounded to the model dtype where the torch path rounds: the projection, then SiLU * up.
    gate, up = acc_gate.to(dt).to(tl.float32), acc_up.to(dt).to(tl.float32)
    h = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up
    tl.store(Out + pair[:, None].to(tl.int64) * stride_o + cols[None, :], h.to(dt),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(H, W, RouteWeights, Out, SortedPairs, BlockExperts, PaddedTotal,
                 stride_h, stride_we, stride_wn, stride_o, num_pairs, hidden, inter,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Out[pair, n] = route_weight[pair] * (h[pair] . W[e, n]) for one block, in float32."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(PaddedTotal):
        return
    pair = tl.load(SortedPairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    row = pair.to(tl.int64)
    expert = tl.load(BlockExperts + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_rows = W + expert * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(H + row[:, None] * stride_h + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.load(w_rows + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0), acc,
                     input_precision=PRECISION)
    dt = H.dtype.element_ty
    route = tl.load(RouteWeights + row, mask=valid, other=0.0).to(tl.float32)
    out = acc.to(dt).to(tl.float32) * route[:, None]
    tl.store(Out + row[:, None] * stride_o + cols[None, :], out, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _gate_up_gemv_kernel(X, W, Ids, Out, stride_x, stride_we, stride_wn, stride_o, inter, hidden,
                         TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Out[pair, n] = silu(x[token] . W[e, n]) * (x[token] . W[e, inter + n]) for one pair."""
    pair, pid_n = tl.program_id(0), tl.program_id(1)
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(Ids + pair).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_gate = W + expert * stride_we + cols[:, None] * stride_wn
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(X + token * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w_mask = col_ok[:, None] & k_ok[None, :]
        acc_gate += tl.sum(tl.load(w_gate + ks[None, :], mask=w_mask, other=0.0).to(tl.float32) * a, axis=1)
        acc_up += tl.sum(tl.load(w_up + ks[None, :], mask=w_mask, other=0.0).to(tl.float32) * a, axis=1)
    dt = Out.dtype.element_ty
    gate, up = acc_gate.to(dt).to(tl.float32), acc_up.to(dt).to(tl.float32)
    h = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up
    tl.store(Out + pair.to(tl.int64) * stride_o + cols, h.to(dt), mask=col_ok)


@triton.jit
def _down_gemv_kernel(H, W, Ids, RouteWeights, Out, stride_h, stride_we, stride_wn, stride_o, hidden, inter,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Out[pair, n] = route_weight[pair] * (h[pair] . W[e, n]) for one pair, in float32."""
    pair, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    expert = tl.load(Ids + pair).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_rows = W + expert * stride_we + cols[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(H + pair * stride_h + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        acc += tl.sum(tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * a,
                      axis=1)
    dt = H.dtype.element_ty
    out = acc.to(dt).to(tl.float32) * tl.load(RouteWeights + pair).to(tl.float32)
    tl.store(Out + pair * stride_o + cols, out, mask=col_ok)


def block_m_for(pairs: int) -> int:
    """Rows per block: 16 (tl.dot's least) while experts see a token or two, 64 for prefills."""
    return 16 if pairs <= 512 else 64


def grouped_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for SwiGLU experts stored
    stacked: gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I]."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if tokens * top_k <= GEMV_MAX_PAIRS:
        return _gathered_experts(x, topk_ids, topk_weights, gate_up, down)
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    blocks = align_by_expert(topk_ids, num_experts, block_m_for(tokens * top_k))
    n_blocks = blocks.block_experts.numel()
    x = x.contiguous()
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    block_n, block_k = 64, 64
    # float32 models multiply in full precision (TF32 would drift from the torch path).
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _gate_up_kernel[(n_blocks, triton.cdiv(inter, block_n))](
        x, gate_up, h, blocks.sorted_pairs, blocks.block_experts, blocks.padded_total,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0), blocks.num_pairs, inter, hidden,
        TOP_K=top_k, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, num_warps=4)
    out = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(n_blocks, triton.cdiv(hidden, block_n))](
        h, down, topk_weights.contiguous().view(-1), out, blocks.sorted_pairs, blocks.block_experts,
        blocks.padded_total, h.stride(0), down.stride(0), down.stride(1), out.stride(0), blocks.num_pairs,
        hidden, inter, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, num_warps=4)
    return out.view(tokens, top_k, hidden).sum(1).to(x.dtype)


def _gathered_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`grouped_experts` for a few pairs: one GEMV per (token, chosen expert), no sorting."""
    tokens, hidden = x.shape
    top_k, inter = topk_ids.shape[1], gate_up.shape[1] // 2
    pairs = tokens * top_k
    x, ids = x.contiguous(), topk_ids.contiguous().view(-1)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    block_n, block_k = 32, 128
    _gate_up_gemv_kernel[(pairs, triton.cdiv(inter, block_n))](
        x, gate_up, ids, h, x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0), inter, hidden,
        TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    _down_gemv_kernel[(pairs, triton.cdiv(hidden, block_n))](
        h, down, ids, topk_weights.contiguous().view(-1), out, h.stride(0), down.stride(0), down.stride(1),
        out.stride(0), hidden, inter, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out.view(tokens, top_k, hidden).sum(1).to(x.dtype)
