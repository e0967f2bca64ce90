"""Fused Triton versions of the model's small element-wise stages.

A decode step of a small model is a few hundred tiny kernels; what it costs is their count,
not their bytes. These three kernels replace ~40 torch launches per layer with 3 (residual
add + RMSNorm, also in Gemma's `(1 + w)` form; RoPE on q and k + the KV-cache write, with
Qwen3's and Gemma 3's per-head q/k norms folded in; SiLU(gate) * up, or Gemma's
tanh-GELU(gate) * up). Each rounds to the model dtype at the same
points as the torch code in `models/llama.py` / `models/gemma3.py` it replaces, so the two
paths agree to the last bit in the common cases, and the tests compare them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from structgen.engine.kernels.dependent_launch import launch_args, wait_for_inputs


@triton.jit
def _rms_norm_kernel(X, R, W, Out, ROut, stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    dt = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(ROut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0)
    if UNIT_OFFSET:  # Gemma: scaled by (1 + w) in float32, rounded once
        y = (xf * inv) * (1.0 + w.to(tl.float32))
    else:
        y = (xf * inv).to(dt).to(tl.float32) * w.to(tl.float32)
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); residual=None means plain norm(x).
    `unit_offset`: Gemma's norm, `norm(x) * (1 + weight)` in float32, rounded once."""
    n, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    _rms_norm_kernel[(n,)](
        x, r, weight, out, res_out, x.stride(0), r.stride(0), out.stride(0), res_out.stride(0), cols, eps,
        HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=triton.next_power_of_2(cols),
        num_warps=4 if cols <= 2048 else 8, **launch_args(x.device, n),
    )
    return out, res_out


@triton.jit
def head_rms_norm(x1, x2, W, eps, HALF: tl.constexpr, UNIT_OFFSET: tl.constexpr, dt: tl.constexpr):
    """Per-head RMSNorm of a [heads, head_dim] tile held as its two halves (float32), rounded
    to the model dtype where `RMSNorm` / `GemmaRMSNorm` round."""
    d = tl.arange(0, HALF)
    inv = (1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps))[:, None]
    w1 = tl.load(W + d).to(tl.float32)[None, :]
    w2 = tl.load(W + HALF + d).to(tl.float32)[None, :]
    if UNIT_OFFSET:  # Gemma: scaled by (1 + w) in float32, rounded once
        y1 = (x1 * inv) * (1.0 + w1)
        y2 = (x2 * inv) * (1.0 + w2)
    else:
        y1 = (x1 * inv).to(dt).to(tl.float32) * w1
        y2 = (x2 * inv).to(dt).to(tl.float32) * w2
    return y1.to(dt).to(tl.float32), y2.to(dt).to(tl.float32)


@triton.jit
def _rotate_half(x1, x2, c1, c2, s1, s2, dt: tl.constexpr):
    """RoPE of the two halves, each product rounded like `x * cos + rotated * sin` in dt."""
    o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _rope_kv_kernel(QKV, Pos, Rows, Cos, Sin, QOut, KC, VC, QNorm, KNorm, eps,
                    stride_qkv, stride_cos, stride_qo_n, stride_qo_h,
                    stride_cr, stride_ch,
                    N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEADS_PAD: tl.constexpr,
                    HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                    PDL: tl.constexpr):
    wait_for_inputs(PDL)
    n = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + n).to(tl.int64)
    cache_row = tl.load(Rows + n).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, half)
    row = QKV + n * stride_qkv
    dt = QOut.dtype.element_ty
    # cos/sin rounded to the model dtype first, like `RotaryEmbedding.forward`.
    c1 = tl.load(Cos + pos * stride_cos + d).to(dt).to(tl.float32)[None, :]
    c2 = tl.load(Cos + pos * stride_cos + half + d).to(dt).to(tl.float32)[None, :]
    s1 = tl.load(Sin + pos * stride_cos + d).to(dt).to(tl.float32)[None, :]
    s2 = tl.load(Sin + pos * stride_cos + half + d).to(dt).to(tl.float32)[None, :]

    # q heads: [0, N_HEADS), k heads follow, then v heads.
    qm = (h < N_HEADS)[:, None]
    x1 = tl.load(row + h[:, None] * HEAD_DIM + d[None, :], mask=qm, other=0.0).to(tl.float32)
    x2 = tl.load(row + h[:, None] * HEAD_DIM + half + d[None, :], mask=qm, other=0.0).to(tl.float32)
    if HAS_NORM:
        x1, x2 = head_rms_norm(x1, x2, QNorm, eps, half, UNIT_OFFSET, dt)
    o1, o2 = _rotate_half(x1, x2, c1, c2, s1, s2, dt)
    qo = QOut + n * stride_qo_n + h[:, None] * stride_qo_h + d[None, :]
    tl.store(qo, o1, mask=qm)
    tl.store(qo + half, o2, mask=qm)

    km = (h < N_KV)[:, None]
    kbase = row + N_HEADS * HEAD_DIM
    x1 = tl.load(kbase + h[:, None] * HEAD_DIM + d[None, :], mask=km, other=0.0).to(tl.float32)
    x2 = tl.load(kbase + h[:, None] * HEAD_DIM + half + d[None, :], mask=km, other=0.0).to(tl.float32)
    if HAS_NORM:
        x1, x2 = head_rms_norm(x1, x2, KNorm, eps, half, UNIT_OFFSET, dt)
    o1, o2 = _rotate_half(x1, x2, c1, c2, s1, s2, dt)
    cache_off = cache_row * stride_cr + h[:, None] * stride_ch + d[None, :]
    tl.store(KC + cache_off, o1.to(KC.dtype.element_ty), mask=km)
    tl.store(KC + cache_off + half, o2.to(KC.dtype.element_ty), mask=km)

    vbase = kbase + N_KV * HEAD_DIM
    v1 = tl.load(vbase + h[:, None] * HEAD_DIM + d[None, :], mask=km, other=0.0)
    v2 = tl.load(vbase + h[:, None] * HEAD_DIM + half + d[None, :], mask=km, other=0.0)
    tl.store(VC + cache_off, v1.to(VC.dtype.element_ty), mask=km)
    tl.store(VC + cache_off + half, v2.to(VC.dtype.element_ty), mask=km)


@dataclass(frozen=True)
class HeadNorms:
    """Per-head RMSNorm weights of q and k (Qwen3, Gemma 3), applied before RoPE; `unit_offset`
    is Gemma's `norm(x) * (1 + weight)` form."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    unit_offset: bool = False


def rope_and_cache(
    qkv: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int, head_dim: int,
    norms: HeadNorms | None = None,
) -> torch.Tensor:
    """Rotate q and k of each token (HF rotate-half layout), write k and v at the token's
    cache row (`token_slots`, into the paged cache [pages, page_size, n_kv, head_dim] seen as
    rows), and return the rotated q as [N, n_heads, head_dim]. With `norms`, each q and k head
    is RMS-normed first, in the same launch."""
    n = qkv.shape[0]
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    k_cache, v_cache = k_cache.view(-1, n_kv, head_dim), v_cache.view(-1, n_kv, head_dim)
    q = torch.empty(n, n_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    q_weight, k_weight = (norms.q_weight, norms.k_weight) if norms is not None else (qkv, qkv)
    _rope_kv_kernel[(n,)](
        qkv, positions, token_slots, cos, sin, q, k_cache, v_cache, q_weight, k_weight,
        norms.eps if norms is not None else 0.0,
        qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        N_HEADS=n_heads, N_KV=n_kv, HEADS_PAD=triton.next_power_of_2(max(n_heads, n_kv)),
        HEAD_DIM=head_dim, HAS_NORM=norms is not None, UNIT_OFFSET=norms is not None and norms.unit_offset,
        num_warps=4, **launch_args(qkv.device, n),
    )
    return q


@triton.jit
def _act_mul_kernel(X, Out, stride_x, stride_o, inter, GELU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + inter + cols, mask=mask, other=0.0)
    dt = gate.dtype
    g = gate.to(tl.float32)
    if GELU:  # tanh-approximated GELU; tanh(z) = 1 - 2 / (exp(2z) + 1)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = (0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))).to(dt).to(tl.float32)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * up.to(tl.float32)).to(dt), mask=mask)


def _act_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    n, two_i = x.shape
    inter = two_i // 2
    out = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    block = 1024
    _act_mul_kernel[(n, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter, GELU=gelu, BLOCK=block,
                                                    num_warps=4, **launch_args(x.device, n))
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> silu(gate) * up, [N, I]."""
    return _act_mul(x, gelu=False)


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> gelu_tanh(gate) * up, [N, I] (Gemma's GeGLU)."""
    return _act_mul(x, gelu=True)
