"""Mixture-of-experts kernels: the router (softmax + top-k) in one launch, and a step's
(token, chosen expert) pairs in one launch per projection.

Decode steps (at most `PAIR_MAX` pairs) take the pair kernels, unsorted: gate_up (+ SiLU * up)
over (pair, feature block), each program streaming its expert's gate and up rows once, and
down over (token, feature block), each program streaming the rows of the token's top_k
experts in turn, the routing weights applied and the top-k sum done in registers in a fixed
order (deterministic, no atomics, no second launch). At one token that reads each routed
expert's weights once, the floor of the step. Where a layer folds its post-attention norm into
the kernels after it (models/moe.py), gate_up normalises its token's row itself (`InputNorm`).

Larger steps (prefills) sort the pairs by expert and pad each expert's run to whole blocks
of BLOCK_M rows (`align_by_expert`), so a program multiplies one block of rows by one
expert's weights through the tensor cores, read once per block. Every shape depends only on
the number of tokens, never on the routing: the alignment is one launch over fixed-size
buffers, blocks past the padded total return at once, and padding rows hold a sentinel pair.

Nothing reads a value back to the host, so a decode step captures into a CUDA graph. The
launch shapes (`Tiles`) of decode-sized steps are timed once per shape on the device
(`expert_tiles`), like the dense GEMV's (kernels/gemv.py); `benchmarks/profile_moe.py` prints
the candidates' times. The torch references the tests compare to are
`models/moe.experts_reference` and the torch path of `models/moe.SparseMoE.route`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from structgen.engine.kernels.dependent_launch import launch_args, wait_for_inputs
from structgen.engine.kernels.timed_plans import TimedPlans

# Up to this many (token, expert) pairs a step takes the pair kernels (no sort): decode batches.
PAIR_MAX = 64


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
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                  PDL: tl.constexpr):
    """One token's router: softmax over the experts in float32, the top k by probability
    (highest first), renormalised to sum to one where NORMALIZE."""
    wait_for_inputs(PDL)
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
        # never past the last expert, even for a row of NaNs (a padding row's garbage)
        best_id = tl.minimum(tl.min(tl.where(left == best, experts, BLOCK_E), 0), num_experts - 1)
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
                             BLOCK_E=triton.next_power_of_2(num_experts), num_warps=1, **launch_args(logits.device, tokens))
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
def _gate_up_pairs_kernel(X, W, Ids, NW, Out, stride_x, stride_we, stride_wn, stride_o, inter, hidden, eps,
                          TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          HAS_NORM: tl.constexpr, PDL: tl.constexpr):
    """Out[pair, n] = silu(x[token] . W[e, n]) * (x[token] . W[e, inter + n]) for BLOCK_N
    features of one pair: the gate and up rows streamed once in BLOCK_K chunks, products
    summed once after the loop (a sum per chunk puts a barrier between two loads of W).
    HAS_NORM: x[token] is RMS-normed first (weight NW), as `fused_gemv` does: x times the
    norm weight in the products, its squares summed on the way, the sums scaled by 1/rms."""
    pair, pid_n = tl.program_id(0), tl.program_id(1)
    wait_for_inputs(PDL)  # the expert ids are the router's output
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(Ids + pair).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w_gate = W + expert * stride_we + n[:, None].to(tl.int64) * stride_wn
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x_k = tl.load(X + token * stride_x + k).to(tl.float32)
            gate_k = tl.load(w_gate + k[None, :], mask=n_ok[:, None], other=0.0)
            up_k = tl.load(w_up + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k < hidden
            x_k = tl.load(X + token * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
            gate_k = tl.load(w_gate + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            up_k = tl.load(w_up + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_NORM:
            squares += x_k * x_k
            x_k = x_k * tl.load(NW + k, mask=(k < hidden) | EVEN_K, other=0.0).to(tl.float32)
        acc_gate += gate_k.to(tl.float32) * x_k[None, :]
        acc_up += up_k.to(tl.float32) * x_k[None, :]
    gate, up = tl.sum(acc_gate, 1), tl.sum(acc_up, 1)
    if HAS_NORM:
        inv = 1.0 / tl.sqrt(tl.sum(squares, 0) / hidden + eps)
        gate, up = gate * inv, up * inv
    dt = Out.dtype.element_ty
    # Rounded to the model dtype where the torch path rounds: the projection, then SiLU * up.
    gate, up = gate.to(dt).to(tl.float32), up.to(dt).to(tl.float32)
    h = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up
    tl.store(Out + pair.to(tl.int64) * stride_o + n, h.to(dt), mask=n_ok)


@triton.jit
def _down_tokens_kernel(H, W, Ids, RouteWeights, Out, stride_h, stride_we, stride_wn, stride_o, hidden, inter,
                        TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """Out[token, n] = sum_k route_weight[pair k] * (h[pair k] . W[e_k, n]) for BLOCK_N
    features of one token: its top_k experts' rows (BLOCK_E, top_k rounded up to a power of
    two) streamed side by side in BLOCK_K chunks, the weights folded into h, every product
    summed in float32 in a fixed order (no atomics) and rounded once. The expert ids are
    loaded once, before the loop, so no load of W waits on a load of an id."""
    token, pid_n = tl.program_id(0), tl.program_id(1)
    wait_for_inputs(PDL)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    e = tl.arange(0, BLOCK_E)
    e_ok = e < TOP_K
    pairs = token.to(tl.int64) * TOP_K + e
    experts = tl.load(Ids + pairs, mask=e_ok, other=0).to(tl.int64)
    route = tl.load(RouteWeights + pairs, mask=e_ok, other=0.0)
    w_rows = W + experts[None, :, None] * stride_we + n[:, None, None].to(tl.int64) * stride_wn
    h_rows = H + pairs[:, None] * stride_h
    w_ok = n_ok[:, None, None] & e_ok[None, :, None]
    acc = tl.zeros((BLOCK_N, BLOCK_E, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            h_k = tl.load(h_rows + k[None, :], mask=e_ok[:, None], other=0.0)
            w_k = tl.load(w_rows + k[None, None, :], mask=w_ok, other=0.0)
        else:
            k_ok = k < inter
            h_k = tl.load(h_rows + k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
            w_k = tl.load(w_rows + k[None, None, :], mask=w_ok & k_ok[None, None, :], other=0.0)
        acc += w_k.to(tl.float32) * (h_k.to(tl.float32) * route[:, None])[None, :, :]
    tl.store(Out + token.to(tl.int64) * stride_o + n, tl.sum(tl.sum(acc, 2), 1).to(Out.dtype.element_ty), mask=n_ok)


class Tiles(NamedTuple):
    """A launch shape: output features and K chunk per program, warps, pipeline stages."""

    n: int
    k: int
    warps: int
    stages: int


# Candidates, the first the default (untimed: small matrices, the batch-invariant mode, a
# launch first met inside a graph capture). The pair kernels' shapes stream one row of W per
# few features with long K chunks, as the dense GEMV's winners do; the grouped kernels' are
# tensor-core tiles over BLOCK_M rows.
PAIR_GATE_UP = (Tiles(4, 1024, 4, 4), Tiles(2, 2048, 8, 2), Tiles(8, 512, 4, 3), Tiles(4, 512, 4, 4))
# The down kernel holds a [n, top_k, k] float32 product: n * k stays small.
PAIR_DOWN = (Tiles(2, 256, 4, 4), Tiles(4, 256, 4, 3), Tiles(1, 256, 4, 4), Tiles(4, 128, 4, 4),
             Tiles(8, 128, 4, 3), Tiles(2, 512, 4, 3))
GROUPED = (Tiles(64, 64, 4, 3), Tiles(64, 128, 4, 3), Tiles(128, 64, 4, 3), Tiles(32, 128, 4, 4))
# Steps of up to this many tokens (decode batches) have their tiles timed, once per power of two.
TIMED_MAX_TOKENS = 64
# Experts smaller than this (elements of one expert's gate_up) keep the defaults, untimed.
TIMED_MIN_EXPERT = 1 << 20


@dataclass(frozen=True)
class ExpertTiles:
    """The launch shapes of one step's two expert kernels."""

    gate_up: Tiles
    down: Tiles


_plans: TimedPlans[ExpertTiles] = TimedPlans(
    "moe", __file__, lambda t: [list(t.gate_up), list(t.down)],
    lambda v: ExpertTiles(*(Tiles(*(int(x) for x in tiles)) for tiles in v)))


def expert_tiles(tokens: int, top_k: int, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertTiles:
    """The tiles for a step of `tokens` tokens: timed on first use per (power of two of the
    tokens, path, shapes, dtype, device) where `_worth_timing`, outside any graph capture (the
    decode graphs' warm-up runs every bucket first); the defaults elsewhere."""
    pairs = tokens * top_k <= PAIR_MAX
    default = ExpertTiles(PAIR_GATE_UP[0], PAIR_DOWN[0]) if pairs else ExpertTiles(GROUPED[0], GROUPED[0])
    if not _worth_timing(tokens, gate_up):
        return default
    bucket = triton.next_power_of_2(tokens)
    key = (bucket, pairs, top_k, tuple(gate_up.shape), tuple(down.shape), str(gate_up.dtype))
    return _plans.plan_for(key, gate_up.device, lambda: fastest_tiles(bucket, top_k, gate_up, down, pairs)[0],
                           during_capture=default)


def _worth_timing(tokens: int, gate_up: torch.Tensor) -> bool:
    from structgen.engine.kernels import batch_invariant

    return (gate_up.is_cuda and not batch_invariant() and tokens <= TIMED_MAX_TOKENS
            and gate_up[0].numel() >= TIMED_MIN_EXPERT)


def fastest_tiles(tokens: int, top_k: int, gate_up: torch.Tensor, down: torch.Tensor,
                  pairs: bool) -> tuple[ExpertTiles, dict[str, dict[Tiles, float]]]:
    """(the fastest tiles, ms of every candidate per kernel) for `tokens` tokens routed to
    distinct random experts, on the pair kernels or the grouped ones; each kernel timed cold
    (`gemv.time_all`), a candidate that fails or computes otherwise than the default left out."""
    from structgen.engine.kernels.gemv import time_all

    num_experts, two_inter, hidden = gate_up.shape
    device, gen = gate_up.device, torch.Generator(device=gate_up.device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=device, dtype=gate_up.dtype, generator=gen)
    ids = torch.rand(tokens, num_experts, device=device, generator=gen).argsort(-1)[:, :top_k]
    weights = torch.rand(tokens, top_k, device=device, generator=gen).softmax(-1)
    step = _PairLaunches(x, ids, weights) if pairs else _SortedLaunches(x, ids, weights, num_experts)
    candidates = (PAIR_GATE_UP, PAIR_DOWN) if pairs else (GROUPED, GROUPED)
    times = {}
    h = step.gate_up(gate_up, candidates[0][0])
    right = [t for t in candidates[0] if _computes(lambda t: step.gate_up(gate_up, t), t, h)]
    times["gate_up"] = time_all(lambda t: step.gate_up(gate_up, t), right, device)
    out = step.down(h, down, candidates[1][0])
    right = [t for t in candidates[1] if _computes(lambda t: step.down(h, down, t), t, out)]
    times["down"] = time_all(lambda t: step.down(h, down, t), right, device)
    best = ExpertTiles(*(min(times[k], key=times[k].__getitem__) for k in ("gate_up", "down")))
    return best, times


def _computes(run, tiles: Tiles, expected: torch.Tensor) -> bool:
    """Does `tiles` compile here and compute what the default tiles do?"""
    try:
        return bool((run(tiles).float() - expected.float()).norm() <= 1e-2 * expected.float().norm())
    except Exception:  # noqa: BLE001 - any failure (shared memory, registers) means: not this shape
        return False


def block_m_for(pairs: int) -> int:
    """Rows per sorted block: 16 (tl.dot's least) while experts see a token or two, 64 for prefills."""
    return 16 if pairs <= 512 else 64


class InputNorm(NamedTuple):
    """An RMSNorm (`weight`, `eps`) the experts apply to their input rows themselves."""

    weight: torch.Tensor
    eps: float


def grouped_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor, tiles: ExpertTiles | None = None,
                    norm: InputNorm | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for SwiGLU experts stored
    stacked: gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I]; launched with
    `tiles`, by default `expert_tiles`'. With `norm`, of rmsnorm(x[t]) instead, the norm
    recomputed inside the gate_up kernel (decode steps: at most PAIR_MAX pairs)."""
    tokens, top_k = topk_ids.shape
    tiles = tiles or expert_tiles(tokens, top_k, gate_up, down)
    if tokens * top_k <= PAIR_MAX:
        step = _PairLaunches(x, topk_ids, topk_weights, norm)
    else:
        assert norm is None, f"the norm is fused into the pair kernels only (at most {PAIR_MAX} pairs)"
        step = _SortedLaunches(x, topk_ids, topk_weights, gate_up.shape[0])
    return step.down(step.gate_up(gate_up, tiles.gate_up), down, tiles.down)


class _PairLaunches:
    """A step's two launches over its (token, chosen expert) pairs, unsorted: gate_up per
    (pair, feature block), down per (token, feature block) over the token's experts."""

    def __init__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 norm: InputNorm | None = None):
        self.x = x.contiguous()
        self.ids = topk_ids.contiguous().view(-1)
        self.weights = topk_weights.to(torch.float32).contiguous().view(-1)
        self.tokens, self.top_k = topk_ids.shape
        self.norm = norm

    def gate_up(self, w: torch.Tensor, tiles: Tiles) -> torch.Tensor:
        x, norm, (_, two_inter, hidden) = self.x, self.norm, w.shape
        inter, pairs = two_inter // 2, self.ids.numel()
        h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
        bk = min(tiles.k, triton.next_power_of_2(hidden))
        _gate_up_pairs_kernel[(pairs, triton.cdiv(inter, tiles.n))](
            x, w, self.ids, norm.weight if norm else x, h, x.stride(0), w.stride(0), w.stride(1), h.stride(0),
            inter, hidden, norm.eps if norm else 0.0, TOP_K=self.top_k, BLOCK_N=tiles.n, BLOCK_K=bk,
            EVEN_K=hidden % bk == 0, HAS_NORM=norm is not None,
            num_warps=tiles.warps, num_stages=tiles.stages, **launch_args(x.device, self.tokens))
        return h

    def down(self, h: torch.Tensor, w: torch.Tensor, tiles: Tiles) -> torch.Tensor:
        _, hidden, inter = w.shape
        out = torch.empty(self.tokens, hidden, dtype=h.dtype, device=h.device)
        bk = min(tiles.k, triton.next_power_of_2(inter))
        _down_tokens_kernel[(self.tokens, triton.cdiv(hidden, tiles.n))](
            h, w, self.ids, self.weights, out, h.stride(0), w.stride(0), w.stride(1), out.stride(0), hidden, inter,
            TOP_K=self.top_k, BLOCK_E=triton.next_power_of_2(self.top_k), BLOCK_N=tiles.n, BLOCK_K=bk,
            EVEN_K=inter % bk == 0,
            num_warps=tiles.warps, num_stages=tiles.stages, **launch_args(h.device, self.tokens))
        return out


class _SortedLaunches:
    """A step's launches over its pairs sorted by expert into blocks of BLOCK_M rows
    (`align_by_expert`): each block multiplies its rows by its expert's weights, read once."""

    def __init__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
        self.x = x.contiguous()
        self.weights = topk_weights.contiguous().view(-1)
        self.tokens, self.top_k = topk_ids.shape
        self.blocks = align_by_expert(topk_ids, num_experts, block_m_for(topk_ids.numel()))
        # float32 models multiply in full precision (TF32 would drift from the torch path).
        self.precision = "ieee" if x.dtype == torch.float32 else "tf32"

    def gate_up(self, w: torch.Tensor, tiles: Tiles) -> torch.Tensor:
        x, b, (_, two_inter, hidden) = self.x, self.blocks, w.shape
        inter = two_inter // 2
        h = torch.empty(b.num_pairs, inter, dtype=x.dtype, device=x.device)
        _gate_up_kernel[(b.block_experts.numel(), triton.cdiv(inter, tiles.n))](
            x, w, h, b.sorted_pairs, b.block_experts, b.padded_total, x.stride(0), w.stride(0), w.stride(1),
            h.stride(0), b.num_pairs, inter, hidden, TOP_K=self.top_k, BLOCK_M=b.block_m, BLOCK_N=tiles.n,
            BLOCK_K=tiles.k, PRECISION=self.precision, num_warps=tiles.warps, num_stages=tiles.stages)
        return h

    def down(self, h: torch.Tensor, w: torch.Tensor, tiles: Tiles) -> torch.Tensor:
        b, (_, hidden, inter) = self.blocks, w.shape
        out = torch.empty(b.num_pairs, hidden, dtype=torch.float32, device=h.device)
        _down_kernel[(b.block_experts.numel(), triton.cdiv(hidden, tiles.n))](
            h, w, self.weights, out, b.sorted_pairs, b.block_experts, b.padded_total, h.stride(0), w.stride(0),
            w.stride(1), out.stride(0), b.num_pairs, hidden, inter, BLOCK_M=b.block_m, BLOCK_N=tiles.n,
            BLOCK_K=tiles.k, PRECISION=self.precision, num_warps=tiles.warps, num_stages=tiles.stages)
        return out.view(self.tokens, self.top_k, hidden).sum(1).to(h.dtype)
