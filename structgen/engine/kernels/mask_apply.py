"""Grammar bitmask -> logits in one pass: per-row skip flags, a draft->target vocabulary map
(d2t), temperature scaling and greedy argmax fused, with three backends of one meaning:

- "cuda": `csrc/mask.cu` through the lazily built extension (`csrc_ext`); one launch, no
  allocation (the argmax workspace is allocated once per device), graph-capturable;
- "triton": the same function as two Triton kernels (mask/scale/block-argmax, then pick);
- "torch": the definition, in plain torch (the CPU path and what tests compare against).

For each row r and token j < V (V = logits.shape[1]):

    t(j)       = d2t[j] if d2t is given else j          # the token's id in the mask's vocabulary
    allowed(j) = bit t(j) of bitmask[r] (xgrammar layout; ids past the mask are disallowed),
                 or True when row_flags[r] == 0          # unconstrained rows skip the mask
    m(j)       = x(j) if allowed(j) else -inf
    write      : logits[r, j] = m(j) / temperature[r] (divided only where T > 0), rounded to
                 the logits' dtype
    argmax     : out[r] = t(argmax_j m(j)), NaN as -inf, ties to the lowest j. Taken before the
                 divide, which is monotonic: the greedy token is the same, and an argmax-only
                 pass (write=False) divides nothing.

Why fused: at batch 1 the step after the LM head is latency, not bandwidth: apply-mask, divide
and argmax are three or more launches over a few hundred KB; here it is one.
"""

from __future__ import annotations

import functools

import torch

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_workspaces: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []


def mask_workspace(rows: int, device: torch.device | str) -> torch.Tensor:
    """The CUDA kernel's argmax scratch (12 bytes per row, zero between launches) for `device`,
    grown on demand. Call once before capturing a graph so capture allocates nothing; launches
    that may run concurrently on different streams need workspaces of their own."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ws = _workspaces.get(device)
    if ws is None or ws.numel() < rows * 12:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("mask_apply: argmax workspace must be allocated before graph capture; "
                               "run apply_token_bitmask(..., argmax=True) once eagerly first")
        if ws is not None:
            _retired.append(ws)  # graphs captured earlier still point at it: never free it
        ws = _workspaces[device] = torch.zeros(max(rows, 64) * 12, dtype=torch.uint8, device=device)
    return ws


def pick_backend(logits: torch.Tensor) -> str:
    """"cuda" when the extension builds here, else "triton" on CUDA, else "torch"."""
    if logits.is_cuda:
        from structgen.engine.kernels import csrc_ext, triton_enabled

        if csrc_ext.available():
            return "cuda"
        if triton_enabled(logits.device):
            return "triton"
    return "torch"


def apply_token_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    row_flags: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    argmax: bool = False,
    out: torch.Tensor | None = None,
    write: bool = True,
    workspace: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor | None:
    """Mask (and scale) `logits` [rows, V] in place; optionally return the greedy token per row.

    Parameters
    ----------
    bitmask: int32 [>= rows, W], bit set = allowed. row_flags: int32 or bool [rows]; rows with 0
    skip the mask. d2t: int32/int64 [>= V], the target-vocabulary id of each logits column.
    temperature: float32 [rows]; rows with T > 0 are divided by T. argmax / out: return the
    argmax per row as int64 [rows] (into `out` when given, a graph's static buffer).
    write: False leaves `logits` untouched (argmax only: the kernel then only reads).
    backend: "auto" | "cuda" | "triton" | "torch".

    Returns `out` (the argmax) when asked for, else None.
    """
    _check(logits, bitmask, row_flags, d2t, temperature, out)
    argmax = argmax or out is not None
    if argmax and out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if backend == "auto":
        backend = pick_backend(logits)
    if backend == "cuda":
        _apply_cuda(logits, bitmask, row_flags, d2t, temperature, out, write, workspace)
    elif backend == "triton":
        _apply_triton(logits, bitmask, row_flags, d2t, temperature, out, write)
    elif backend == "torch":
        ref = apply_token_bitmask_reference(logits, bitmask, row_flags=row_flags, d2t=d2t,
                                            temperature=temperature, argmax=argmax, write=write)
        if out is not None and ref is not None:
            out.copy_(ref)
    else:
        raise ValueError(f"unknown backend {backend!r}; one of auto, cuda, triton, torch")
    return out


def _check(logits, bitmask, row_flags, d2t, temperature, out) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in _DTYPES:
        raise ValueError("logits must be [rows, V], unit stride along V, float32/float16/bfloat16")
    rows, vocab = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(1) != 1 or bitmask.shape[0] < rows:
        raise ValueError("bitmask must be int32 [>= rows, W] with unit stride along W")
    for name, t, dtypes, n in (("row_flags", row_flags, (torch.int32, torch.bool), rows),
                               ("d2t", d2t, (torch.int32, torch.int64), vocab),
                               ("temperature", temperature, (torch.float32,), rows),
                               ("out", out, (torch.int64,), rows)):
        if t is None:
            continue
        if t.dtype not in dtypes or t.dim() != 1 or not t.is_contiguous() or t.shape[0] < n:
            raise ValueError(f"{name} must be a contiguous 1-D {'/'.join(map(str, dtypes))} tensor "
                             f"of at least {n} elements")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, logits on {logits.device}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device}, logits on {logits.device}")


def _apply_cuda(logits, bitmask, row_flags, d2t, temperature, out, write, workspace) -> None:
    from structgen.engine.kernels import csrc_ext

    ext = csrc_ext.load()
    rows, vocab = logits.shape
    if out is not None and workspace is None:
        workspace = mask_workspace(rows, logits.device)
    ext.mask_apply(
        logits.data_ptr(), _DTYPES[logits.dtype], rows, vocab, logits.stride(0),
        bitmask.data_ptr(), bitmask.stride(0), bitmask.shape[1],
        row_flags.data_ptr() if row_flags is not None else 0,
        0 if row_flags is None else (1 if row_flags.dtype == torch.int32 else 2),
        d2t.data_ptr() if d2t is not None else 0, int(d2t is not None and d2t.dtype == torch.int64),
        temperature.data_ptr() if temperature is not None else 0,
        out.data_ptr() if out is not None else 0,
        workspace.data_ptr() if workspace is not None else 0,
        int(write), torch.cuda.current_stream(logits.device).cuda_stream,
    )


TRITON_BLOCK = 2048


@functools.cache
def _triton_kernels():
    """The Triton kernels, defined on first use so CPU-only runs never import Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def mask_kernel(X, stride_x, Bm, stride_b, words, Flags, D2T, Temp, PVal, PIdx, vocab, n_blocks,
                    HAS_FLAGS: tl.constexpr, HAS_D2T: tl.constexpr, HAS_TEMP: tl.constexpr,
                    WRITE: tl.constexpr, ARGMAX: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        valid = offs < vocab
        x = tl.load(X + row * stride_x + offs, mask=valid, other=0.0).to(tl.float32)
        if HAS_D2T:
            tid = tl.load(D2T + offs, mask=valid, other=0).to(tl.int64)
        else:
            tid = offs.to(tl.int64)
        inside = (tid >= 0) & (tid < words * 32)
        tc = tl.where(inside, tid, 0)
        w = tl.load(Bm + row * stride_b + tc // 32, mask=valid, other=0)
        allowed = (((w >> (tc % 32).to(tl.int32)) & 1) != 0) & inside
        if HAS_FLAGS:
            allowed = allowed | (tl.load(Flags + row) == 0)
        v = tl.where(allowed, x, float("-inf"))
        if ARGMAX:
            m = tl.where(valid & (v == v), v, float("-inf"))  # NaN never wins
            tl.store(PVal + row * n_blocks + blk, tl.max(m, 0))
            tl.store(PIdx + row * n_blocks + blk, blk * BLOCK + tl.argmax(m, 0))
        if WRITE:
            if HAS_TEMP:
                t = tl.load(Temp + row)
                v = tl.where(t > 0, tl.math.div_rn(v, tl.where(t > 0, t, 1.0)), v)  # IEEE, like torch
            tl.store(X + row * stride_x + offs, v.to(X.dtype.element_ty), mask=valid)

    @triton.jit
    def pick_kernel(PVal, PIdx, D2T, Out, n_blocks, HAS_D2T: tl.constexpr, BLOCKS_PAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        b = tl.arange(0, BLOCKS_PAD)
        v = tl.load(PVal + row * n_blocks + b, mask=b < n_blocks, other=float("-inf"))
        j = tl.load(PIdx + row * n_blocks + tl.argmax(v, 0))
        if HAS_D2T:
            j = tl.load(D2T + j).to(tl.int64)
        tl.store(Out + row, j)

    return triton, mask_kernel, pick_kernel


def _apply_triton(logits, bitmask, row_flags, d2t, temperature, out, write) -> None:
    triton, mask_kernel, pick_kernel = _triton_kernels()
    rows, vocab = logits.shape
    n_blocks = triton.cdiv(vocab, TRITON_BLOCK)
    argmax = out is not None
    dev = logits.device
    pval = torch.empty(rows, n_blocks, dtype=torch.float32, device=dev) if argmax else logits
    pidx = torch.empty(rows, n_blocks, dtype=torch.int64, device=dev) if argmax else logits
    flags = row_flags.view(torch.uint8) if row_flags is not None and row_flags.dtype == torch.bool else row_flags
    mask_kernel[(rows, n_blocks)](
        logits, logits.stride(0), bitmask, bitmask.stride(0), bitmask.shape[1],
        flags if flags is not None else bitmask, d2t if d2t is not None else bitmask,
        temperature if temperature is not None else logits, pval, pidx, vocab, n_blocks,
        HAS_FLAGS=row_flags is not None, HAS_D2T=d2t is not None, HAS_TEMP=temperature is not None,
        WRITE=write, ARGMAX=argmax, BLOCK=TRITON_BLOCK, num_warps=4,
    )
    if argmax:
        pick_kernel[(rows,)](pval, pidx, d2t if d2t is not None else pidx, out, n_blocks,
                             HAS_D2T=d2t is not None, BLOCKS_PAD=triton.next_power_of_2(n_blocks),
                             num_warps=1)


def apply_token_bitmask_reference(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    row_flags: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    argmax: bool = False,
    write: bool = True,
) -> torch.Tensor | None:
    """The definition (module docstring) in torch: float32 throughout, any device."""
    rows, vocab = logits.shape
    limit = bitmask.shape[1] * 32
    tid = d2t[:vocab].long() if d2t is not None else torch.arange(vocab, device=logits.device)
    inside = (tid >= 0) & (tid < limit)
    t = tid.clamp(0, limit - 1)
    bits = (bitmask[:rows, t // 32] >> (t % 32).to(torch.int32)) & 1
    allowed = (bits != 0) & inside
    if row_flags is not None:
        allowed |= (row_flags[:rows] == 0).unsqueeze(1)
    v = logits.float().masked_fill(~allowed, float("-inf"))
    result = None
    if argmax:
        idx = torch.nan_to_num(v, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")).argmax(1)
        result = tid[idx]
    if write:
        if temperature is not None:
            temp = temperature[:rows].unsqueeze(1)
            v = torch.where(temp > 0, v / torch.where(temp > 0, temp, 1.0), v)
        logits.copy_(v)
    return result
