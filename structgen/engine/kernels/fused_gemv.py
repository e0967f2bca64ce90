"""Projections of steps with a few rows, with their neighbouring stages fused in (Triton).

A Llama layer is ten kernels at batch 1: norm, qkv, RoPE + KV write, attention (two), o, norm,
gate_up, SiLU * up, down. The four small ones each read a few KB, but each costs a launch gap
and a ramp-up, and for a small model that count is the step's cost. Here they ride along inside
the projections that read the weights anyway:

- **RMSNorm prologue**: each program streams all of x to multiply it with its rows of W, so it
  also sums x^2 on the way and scales its dot products by 1/rms at the end (`W @ (x * w_norm)
  / rms(x)` is the norm's output times W). With `residual`, x is `x + residual`; program 0
  also writes that sum out as the new residual stream.
- **Paired epilogues**: a program owns BLOCK_N output features *and* their partners, so the
  element-wise stage after the projection needs no other program's output.
  `silu_mul`: gate rows j and up rows `inter + j` -> `silu(gate) * up`.
  `rope`: rows d and `d + head_dim / 2` of one head -> rotated q (returned), rotated k and v
  written into the paged KV cache at each row's cache row (`AttentionBatch.token_slots`).
  With per-head q/k norms (Qwen3) a program owns a whole head, since the norm of a head needs
  all of its features: fewer, longer programs, whose chunk shapes are timed apart
  (`HEAD_CONFIGS`), and timed against the projection with its norm alone followed by
  `fused.rope_and_cache` (`SPLIT`: two launches, but the projection spread over every SM).
  `plain`: rows j and `N / 2 + j`, stored as they are (a mixture of experts' router).

So a layer is six kernels: qkv (+norm, +RoPE, +KV write), attention (two), o, gate_up (+norm,
+SiLU * up), down; four fewer a layer, and kernel count is what a small model's forward pays for
(docs/performance.md, "Decode step at batch 1"); a mixture of experts' router and experts take
the norm the same way (models/moe.py). Where streaming W is the cost these kernels
lose (every program also reads x, the residual and the norm weight, and does each row's FMAs on
CUDA cores), so `max_rows` keeps them to small models and single rows of mid-sized ones.
Numerics: the norm is applied to the fp32 dot product instead of to x rounded to the model
dtype, so results differ from the unfused path by bf16 rounding (the tests compare with a
tolerance); the epilogues round the projection's output to the model dtype first and then
follow `fused.py` exactly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from structgen.engine.kernels.dependent_launch import launch_args, wait_for_inputs
from structgen.engine.kernels.fused import HeadNorms, head_rms_norm, rope_and_cache
from structgen.engine.kernels.timed_plans import TimedPlans

log = logging.getLogger(__name__)
MAX_ROWS = 4
EPI_SILU, EPI_ROPE, EPI_PLAIN = tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)  # constexpr: the kernel reads them
# (block_n, block_k, num_warps, num_stages): block_n output features (and their partners) per
# program. Large matrices are timed over these once per shape; small ones take the first, as
# gemv.py's small matrices keep their fixed shape.
CONFIGS = ((4, 1024, 4, 4), (2, 2048, 4, 4), (8, 512, 4, 4), (4, 2048, 8, 3), (2, 1024, 4, 4))
# (block_k, num_warps, num_stages) of programs that own a whole head (block_n: half of it), the
# RoPE epilogue with per-head q/k norms: a [half, block_k] chunk and its partner per program,
# so shorter chunks and more warps than CONFIGS.
HEAD_CONFIGS = ((128, 8, 3), (256, 8, 2), (256, 16, 2), (64, 4, 4), (128, 4, 4), (512, 16, 1))
SPLIT = (0, 0, 0, 0)  # not a block shape: `norm_gemv` then `fused.rope_and_cache`, two launches
TIMED_ABOVE = 4 << 20  # weight elements


def _decode(value: list) -> tuple[int, int, int, int]:
    """A plan read from disk (timed_plans.py): a block shape, or SPLIT."""
    n, k, warps, stages = value
    return int(n), int(k), int(warps), int(stages)


_plans: TimedPlans[tuple[int, int, int, int]] = TimedPlans("fused_gemv", __file__, list, _decode)


@triton.jit
def _weight_pair_chunk(w_lo, w_hi, k, K, EVEN_K: tl.constexpr):
    """Columns `k` of a program's rows of W and of their partners, in float32; no mask on K
    where chunks divide it (masked loads streamed W slower, gemv.py)."""
    if EVEN_K:
        return tl.load(w_lo + k[None, :]).to(tl.float32), tl.load(w_hi + k[None, :]).to(tl.float32)
    kmask = (k < K)[None, :]
    return (tl.load(w_lo + k[None, :], mask=kmask, other=0.0).to(tl.float32),
            tl.load(w_hi + k[None, :], mask=kmask, other=0.0).to(tl.float32))


@triton.jit
def _normed_x_chunk(X, R, NW, ROut, m, mmask, k, K, stride_xm, stride_rm, writes_residual,
                    HAS_RES: tl.constexpr, EVEN_K: tl.constexpr):
    """(columns `k` of x (+ residual) times the norm weight, in float32; their squares summed
    per row). With a residual, `writes_residual` (one program) stores x + residual."""
    kmask = (k < K) | EVEN_K
    xmask = mmask[:, None] & kmask[None, :]
    x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=xmask, other=0.0)
    if HAS_RES:  # the residual add, rounded to the model dtype like `fused.rms_norm`
        r = tl.load(R + m[:, None] * stride_rm + k[None, :], mask=xmask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if writes_residual:
            tl.store(ROut + m[:, None] * stride_xm + k[None, :], x, mask=xmask)
    xf = x.to(tl.float32)
    return xf * tl.load(NW + k, mask=kmask, other=0.0).to(tl.float32)[None, :], tl.sum(xf * xf, 1)


@triton.jit
def _fused_gemv_kernel(
    X, R, NW, W, B, Y, ROut, M, K, stride_xm, stride_rm, stride_wn, stride_ym, eps, pair_offset,
    Pos, Rows, Cos, Sin, KC, VC, stride_cos, stride_cr, stride_ch, QNorm, KNorm, head_eps,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, EPI: tl.constexpr, EVEN_K: tl.constexpr,
    N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    j = tl.arange(0, BLOCK_N)
    if EPI == EPI_ROPE:  # programs walk heads; each owns BLOCK_N dims of a head's first half
        half: tl.constexpr = HEAD_DIM // 2
        per_head: tl.constexpr = half // BLOCK_N
        head = pid // per_head
        d = (pid % per_head) * BLOCK_N + j
        lo = head * HEAD_DIM + d
    else:
        lo = pid * BLOCK_N + j
    hi = lo + pair_offset
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    # Each chunk's products are summed at once, not kept element-wise to the end as gemv.py
    # does for large matrices: with two accumulators the late sum made the forward graph slower
    # at 2 and 4 rows.
    w_lo = W + lo[:, None].to(tl.int64) * stride_wn
    w_hi = W + hi[:, None].to(tl.int64) * stride_wn
    # The first chunk of W is loaded before waiting for x: no kernel writes weights.
    k = tl.arange(0, BLOCK_K)
    w, w2 = _weight_pair_chunk(w_lo, w_hi, k, K, EVEN_K)
    wait_for_inputs(PDL)
    xf, ss = _normed_x_chunk(X, R, NW, ROut, m, mmask, k, K, stride_xm, stride_rm, pid == 0, HAS_RES, EVEN_K)
    acc_lo = tl.sum(xf[:, None, :] * w[None, :, :], axis=2)
    acc_hi = tl.sum(xf[:, None, :] * w2[None, :, :], axis=2)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w, w2 = _weight_pair_chunk(w_lo, w_hi, k, K, EVEN_K)
        xf, sq = _normed_x_chunk(X, R, NW, ROut, m, mmask, k, K, stride_xm, stride_rm, pid == 0, HAS_RES, EVEN_K)
        ss += sq
        acc_lo += tl.sum(xf[:, None, :] * w[None, :, :], axis=2)
        acc_hi += tl.sum(xf[:, None, :] * w2[None, :, :], axis=2)
    inv = 1.0 / tl.sqrt(ss / K + eps)
    acc_lo = acc_lo * inv[:, None]
    acc_hi = acc_hi * inv[:, None]
    if HAS_BIAS:
        acc_lo += tl.load(B + lo).to(tl.float32)[None, :]
        acc_hi += tl.load(B + hi).to(tl.float32)[None, :]
    dt = Y.dtype.element_ty
    rows = m[:, None] * stride_ym
    if EPI == EPI_SILU:
        g = acc_lo.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(Y + rows + lo[None, :], (act * acc_hi.to(dt).to(tl.float32)).to(dt), mask=mmask[:, None])
    elif EPI == EPI_PLAIN:
        tl.store(Y + rows + lo[None, :], acc_lo.to(dt), mask=mmask[:, None])
        tl.store(Y + rows + hi[None, :], acc_hi.to(dt), mask=mmask[:, None])
    else:
        a = acc_lo.to(dt).to(tl.float32)
        b = acc_hi.to(dt).to(tl.float32)
        if head >= N_HEADS + N_KV:  # v: no rotation, straight into the cache
            cache_row = tl.load(Rows + m, mask=mmask, other=0).to(tl.int64)
            off = cache_row[:, None] * stride_cr + (head - N_HEADS - N_KV) * stride_ch + d[None, :]
            tl.store(VC + off, a.to(VC.dtype.element_ty), mask=mmask[:, None])
            tl.store(VC + off + half, b.to(VC.dtype.element_ty), mask=mmask[:, None])
        else:
            if HEAD_NORM:  # the program holds the whole head: its two halves are `a` and `b`
                if head < N_HEADS:
                    a, b = head_rms_norm(a, b, QNorm, head_eps, half, UNIT_OFFSET, dt)
                else:
                    a, b = head_rms_norm(a, b, KNorm, head_eps, half, UNIT_OFFSET, dt)
            pos = tl.load(Pos + m, mask=mmask, other=0).to(tl.int64)
            cs = pos[:, None] * stride_cos + d[None, :]
            # cos/sin rounded to the model dtype first, like `RotaryEmbedding.forward`.
            c1 = tl.load(Cos + cs, mask=mmask[:, None], other=0.0).to(dt).to(tl.float32)
            c2 = tl.load(Cos + cs + half, mask=mmask[:, None], other=0.0).to(dt).to(tl.float32)
            s1 = tl.load(Sin + cs, mask=mmask[:, None], other=0.0).to(dt).to(tl.float32)
            s2 = tl.load(Sin + cs + half, mask=mmask[:, None], other=0.0).to(dt).to(tl.float32)
            o1 = ((a * c1).to(dt).to(tl.float32) + (-b * s1).to(dt).to(tl.float32)).to(dt)
            o2 = ((b * c2).to(dt).to(tl.float32) + (a * s2).to(dt).to(tl.float32)).to(dt)
            if head < N_HEADS:  # q: out [M, n_heads * head_dim]
                tl.store(Y + rows + lo[None, :], o1, mask=mmask[:, None])
                tl.store(Y + rows + lo[None, :] + half, o2, mask=mmask[:, None])
            else:
                cache_row = tl.load(Rows + m, mask=mmask, other=0).to(tl.int64)
                off = cache_row[:, None] * stride_cr + (head - N_HEADS) * stride_ch + d[None, :]
                tl.store(KC + off, o1.to(KC.dtype.element_ty), mask=mmask[:, None])
                tl.store(KC + off + half, o2.to(KC.dtype.element_ty), mask=mmask[:, None])


def _launch(x, weight, bias, out, *, norm_weight, residual, eps, epi, grid, pair_offset, cfg,
            rope=None, heads=(1, 1, 2), head_norms: HeadNorms | None = None) -> torch.Tensor:
    """Launch the kernel; returns the residual stream after it (x + residual, or x)."""
    m, k = x.shape
    assert m <= MAX_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1
    res_out = torch.empty_like(x) if residual is not None else x  # written only with a residual
    bn, bk, nw, ns = cfg
    block_k = min(bk, triton.next_power_of_2(k))
    pos, token_slots, cos, sin, kc, vc = rope or (x, x, x, x, x, x)
    stride_c = kc.stride() if rope else (0, 0, 0)
    q_norm, k_norm = (head_norms.q_weight, head_norms.k_weight) if head_norms else (x, x)
    _fused_gemv_kernel[grid(bn)](
        x, residual if residual is not None else x, norm_weight, weight,
        bias if bias is not None else weight, out, res_out,
        m, k, x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0), out.stride(0),
        eps, pair_offset, pos, token_slots, cos, sin, kc, vc, cos.stride(0) if rope else 0, *stride_c[:2],
        q_norm, k_norm, head_norms.eps if head_norms else 0.0,
        HAS_RES=residual is not None, HAS_BIAS=bias is not None, EPI=epi.value,
        N_HEADS=heads[0], N_KV=heads[1], HEAD_DIM=heads[2], HEAD_NORM=head_norms is not None,
        UNIT_OFFSET=head_norms is not None and head_norms.unit_offset,
        EVEN_K=k % block_k == 0, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_K=block_k,
        num_warps=nw, num_stages=ns, **launch_args(x.device, m),
    )
    return res_out


def norm_silu_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None,
                   cfg: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up, x + residual) for `gate | up = rmsnorm(x + residual) @ weight.T`;
    weight is the fused [2I, K] gate_up matrix. Without residual the second item is x."""
    inter = weight.shape[0] // 2
    cfg = cfg or plan("silu", x.shape[0], weight, lambda c: norm_silu_gemv(x, weight, norm_weight, eps, residual, c))
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    grid = lambda bn: (triton.cdiv(inter, bn),)  # noqa: E731
    assert inter % cfg[0] == 0
    return out, _launch(x, weight, None, out, norm_weight=norm_weight, residual=residual, eps=eps, epi=EPI_SILU,
                        grid=grid, pair_offset=inter, cfg=cfg)


def norm_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
              residual: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              cfg: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) @ weight.T + bias, x + residual) for a weight of an even number
    of rows (a program owns rows j and N / 2 + j); without residual the second item is x."""
    half = weight.shape[0] // 2
    assert weight.shape[0] == 2 * half
    cfg = cfg or plan("plain", x.shape[0], weight, lambda c: norm_gemv(x, weight, norm_weight, eps, residual, bias, c))
    cfg = (math.gcd(cfg[0], half), *cfg[1:])  # a block width that divides the half
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    grid = lambda bn: (half // bn,)  # noqa: E731
    return out, _launch(x, weight, bias, out, norm_weight=norm_weight, residual=residual, eps=eps, epi=EPI_PLAIN,
                        grid=grid, pair_offset=half, cfg=cfg)


def norm_qkv_rope_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    residual: torch.Tensor | None, positions: torch.Tensor, token_slots: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int, head_dim: int,
    cfg: tuple[int, int, int, int] | None = None, head_norms: HeadNorms | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, n_heads, head_dim], x + residual): `qkv = rmsnorm(x + residual) @ weight.T + bias`,
    q and k rotated (HF rotate-half layout), k and v written at each token's cache row
    (`token_slots`, into the paged cache seen as rows; the work of `fused.rms_norm` +
    projection + `fused.rope_and_cache` in one kernel). With `head_norms` each q and k head is
    RMS-normed before its rotation (Qwen3): one program a head, or, where timing keeps `SPLIT`,
    the projection and `fused.rope_and_cache` in two launches."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos.stride(-1) == 1
    k_cache, v_cache = k_cache.view(-1, n_kv, head_dim), v_cache.view(-1, n_kv, head_dim)
    half = head_dim // 2
    if cfg is None:
        candidates = [*((half, *c) for c in HEAD_CONFIGS), SPLIT] if head_norms is not None else CONFIGS
        cfg = plan("rope" if head_norms is None else "rope_heads", x.shape[0], weight, lambda c: norm_qkv_rope_gemv(
            x, weight, bias, norm_weight, eps, residual, positions, token_slots, cos, sin, k_cache, v_cache,
            n_heads, n_kv, head_dim, c, head_norms), candidates)
    if cfg == SPLIT:
        qkv, residual = norm_gemv(x, weight, norm_weight, eps, residual, bias)
        return rope_and_cache(qkv, positions, token_slots, cos, sin, k_cache, v_cache, n_heads, n_kv, head_dim,
                              head_norms), residual
    bn = half if head_norms is not None else min(cfg[0], half)
    q = torch.empty(x.shape[0], n_heads, head_dim, dtype=x.dtype, device=x.device)
    grid = lambda bn: ((n_heads + 2 * n_kv) * (half // bn),)  # noqa: E731
    return q, _launch(x, weight, bias, q.view(x.shape[0], -1), norm_weight=norm_weight, residual=residual,
                      eps=eps, epi=EPI_ROPE, grid=grid, pair_offset=half, cfg=(bn, *cfg[1:]),
                      rope=(positions, token_slots, cos, sin, k_cache, v_cache), heads=(n_heads, n_kv, head_dim),
                      head_norms=head_norms)


def max_rows(gate_up: torch.Tensor, head_dim: int) -> int:
    """The most rows a step may have for a layer with this gate_up matrix to take these kernels
    (0: never). They pay where kernel count is the cost and lose where streaming W is: each
    program reads x, the residual and the norm weight besides its rows of W, and does every
    row's FMAs on CUDA cores, so they are taken for small models at few rows only (`rows_for`).
    Shapes whose halves (intermediate size, half a head) some block width in CONFIGS does not
    divide are left alone."""
    if not widths_divide(gate_up.shape[0] // 2, head_dim // 2):
        return 0
    return rows_for(gate_up)


def widths_divide(*sizes: int) -> bool:
    """Whether every block width in CONFIGS divides each of `sizes` (the halves a program's
    features and their partners are taken from)."""
    return all(size % cfg[0] == 0 for cfg in CONFIGS for size in sizes)


def rows_for(weight: torch.Tensor) -> int:
    """The most rows these kernels take for a layer whose largest fused matrix is `weight`
    (figures: docs/performance.md, "Decode step at batch 1"): up to MAX_ROWS for small
    matrices; one row up to the 1B shape's gate_up (33.5M elements), where they win; none past
    it (the 8B shape's gate_up shard at tensor parallel 2, 58.7M elements, reads W slower
    through them: "Past one GPU")."""
    if weight.numel() <= TIMED_ABOVE:
        return MAX_ROWS
    return 1 if weight.numel() <= 40 << 20 else 0


def plan(kind: str, rows: int, weight: torch.Tensor, run: Callable[[tuple[int, int, int, int]], object],
         candidates: Sequence[tuple[int, int, int, int]] = CONFIGS) -> tuple[int, int, int, int]:
    """The block shape for this (kind, matrix): the fastest of `candidates`, timed once per shape
    for large CUDA matrices, outside any graph capture; else the first."""
    if not weight.is_cuda or weight.numel() <= TIMED_ABOVE:
        return candidates[0]
    key = (kind, rows, tuple(weight.shape), str(weight.dtype), tuple(candidates))  # (by head size: rope_heads)
    return _plans.plan_for(key, weight.device, lambda: _time(run, candidates, weight.device),
                           during_capture=candidates[0])


def _time(run: Callable[[tuple[int, int, int, int]], object], candidates: Sequence[tuple[int, int, int, int]],
          device: torch.device) -> tuple[int, int, int, int]:
    """The fastest of `candidates` (`gemv.time_all`) that this device compiles. Runs the real
    call, so its side effects (KV writes) must be harmless: the decode graphs' warm-up, on
    padding rows, is where this happens. Every block width divides the shapes that get here
    (`max_rows`)."""
    from structgen.engine.kernels.gemv import time_all

    times = time_all(run, [c for c in candidates if _compiles(run, c)], device)
    return min(times, key=times.__getitem__)


def _compiles(run: Callable[[tuple[int, int, int, int]], object], cfg: tuple[int, int, int, int]) -> bool:
    """Does `cfg` compile and launch here (registers, shared memory)? The first call compiles it."""
    try:
        run(cfg)
        return True
    except Exception as exc:  # noqa: BLE001 - any failure means: not this shape
        log.info("fused gemv block %s unusable: %s", cfg, exc)
        return False
