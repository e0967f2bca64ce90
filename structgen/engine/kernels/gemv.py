"""Matrix-vector products `y = x @ W^T` for decode steps of 1-16 rows (Triton).

At one row a projection is bound by reading W once. cuBLAS is not always best at it: for a
small model's matrices (a few MB) its fixed cost per call dominates, and for large ones its
kernels stream W slower than this one does (per-matrix figures: docs/performance.md, "Decode
step at batch 1"; `benchmarks/bench_gemv.py` reproduces them). The best block shape differs
per matrix, so `plan` times cuBLAS against a few block shapes once per large matrix on the
device, outside any graph capture (the decode graphs' warm-up runs every shape first), and
keeps the fastest (on disk too, for the next process: timed_plans.py). Small matrices keep the
fixed rule at one row (an earlier timing that picked slower shapes for them measured launch
cost as much as the kernel: see `time_cold`).

Two to sixteen rows (forced text, speculative verify steps, small batches) are timed for every
matrix, small ones included, per power-of-two row count: W is still read once for all rows,
and cuBLAS's kernels for a few rows stream it slower. Two more forms run there: the GEMV with
several rows (2-4), and a skinny GEMM whose rows are padded to 16 for `tl.dot`, so its cost
barely moves from 1 to 16 rows. The skinny GEMM wins most large matrices there, the GEMV a
small model's 2-4 rows, and cuBLAS keeps whatever neither beats (docs/performance.md, "Decode
step at batch 1"). Each program owns BLOCK_N output features and
streams their [BLOCK_N, K] slab of W in BLOCK_K chunks, its accumulator in registers.

Those choices depend on the row count, and so does the order in which a row's products are
summed: a row's output changes, in its last bits, with the rows sharing its launch. In the
batch-invariant mode (`kernels.use_batch_invariant`) `invariant_gemm` runs every row count,
one row to a prefill chunk, as one tiled `tl.dot` GEMM whose tile (`InvariantTiles`: rows,
features, K chunk) is a function of the matrix's shape only, with no split of K: every row
is then computed by the same code with the same reduction order, whichever tile it lands in
and whatever the other rows hold. Several tilings are kept (`INVARIANT_TILES`, passed as `tiles=`; the engine uses
`DEFAULT_INVARIANT_TILES`) so that one GPU run can time them all (`benchmarks/bench_invariant_gemm.py`)
and check each one's invariance (tests/engine/test_kernels.py); 16-row tiles were the first,
and cost a batch of 64 four tiles that each stream W.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from structgen.engine.kernels.dependent_launch import launch_args, wait_for_inputs
from structgen.engine.kernels.timed_plans import TimedPlans

log = logging.getLogger(__name__)
MAX_ROWS = 16
GEMV_ROWS = 4  # the GEMV forms keep a [rows, n, k] or [rows, n] accumulator: few rows only
DOT_ROWS = 16  # the skinny GEMM's rows, padded (tl.dot's smallest M)
MAX_WEIGHT = 4 << 20  # elements: above this cuBLAS reads W at least as fast (the untimed rule)


class Block(NamedTuple):
    """A launch shape: output features and K chunk per program, warps, pipeline stages, and
    the form: "chunk" (products summed per K chunk), "late" (summed once after the K loop) or
    "dot" (the skinny GEMM)."""

    n: int
    k: int
    warps: int
    stages: int
    form: str


# One row, timed against cuBLAS for large matrices: the best shapes of a sweep over SmolLM2,
# Llama-1B and Llama-8B matrices (late sum: one row of a large matrix).
CONFIGS = tuple(Block(n, k, w, s, "chunk") for n, k, w, s in
                ((4, 1024, 4, 4), (2, 1024, 4, 4), (2, 2048, 8, 2), (4, 1024, 8, 3), (4, 512, 4, 4)))
DEFAULT = CONFIGS[0]
# Two to four rows, timed against cuBLAS for every matrix: the shapes that won a sweep of
# those row counts (the late sum keeps a [rows, n, k] accumulator, hence the smaller chunks).
MULTI_ROW = (*(Block(n, k, w, s, "chunk") for n, k, w, s in ((2, 1024, 4, 4), (4, 1024, 4, 4), (2, 2048, 8, 2))),
             *(Block(n, k, w, s, "late") for n, k, w, s in ((1, 1024, 4, 4), (2, 512, 4, 4), (4, 512, 4, 3),
                                                           (8, 256, 4, 3))))
# The skinny GEMM's shapes that won a sweep at 1-16 rows (it is not timed for one row: the
# GEMV streams W faster there). (32, 512, 4, 4) came out of a wider grid on the 8B shape's
# matrices at 2 and 4 rows, where it beat the others on gate_up, down and the LM head.
DOT = tuple(Block(n, k, w, s, "dot") for n, k, w, s in
            ((32, 128, 4, 5), (32, 256, 4, 4), (64, 256, 8, 3), (16, 512, 4, 3), (64, 128, 4, 4),
             (32, 512, 4, 4)))
MARGIN = 0.97  # a block shape must beat cuBLAS by 3 %: near-ties stay with cuBLAS


def _decode(value: list | None) -> Block | None:
    """A plan read from disk (timed_plans.py): None (cuBLAS) or a block shape."""
    if value is None:
        return None
    n, k, warps, stages, form = value
    if form not in ("chunk", "late", "dot"):
        raise ValueError(f"no gemv form {form!r}")
    return Block(int(n), int(k), int(warps), int(stages), form)


_plans: TimedPlans[Block | None] = TimedPlans("gemv", __file__, lambda b: None if b is None else list(b), _decode)
T = TypeVar("T")


def use_gemv(rows: int, weight: torch.Tensor) -> bool:
    """The untimed rule: single rows of small matrices (see the module docstring)."""
    return rows == 1 and weight.numel() <= MAX_WEIGHT


def plan(rows: int, weight: torch.Tensor) -> Block | None:
    """The block shape to run `x[rows] @ weight.T` with, or None for cuBLAS: the fixed rule
    for one row of a small matrix; one row of a large CUDA matrix and 2-16 rows of any are
    timed on first use per (rows rounded up to a power of two, shape, dtype, device): the
    decode graphs' buckets, which their warm-up times before any capture."""
    if not weight.is_cuda or rows > MAX_ROWS:
        return None
    if use_gemv(rows, weight):
        return DEFAULT
    rows = triton.next_power_of_2(rows)
    key = (rows, tuple(weight.shape), str(weight.dtype))
    return _plans.plan_for(key, weight.device, lambda: _time(rows, weight), during_capture=None)


def _time(rows: int, weight: torch.Tensor, reps: int = 15) -> Block | None:
    """cuBLAS against each block shape on `weight` (`time_all`); a block shape must win by
    MARGIN and compute the right product."""
    x = torch.randn(rows, weight.shape[1], device=weight.device, dtype=weight.dtype)
    ref = F.linear(x, weight).float()
    if rows == 1:  # a large matrix (`use_gemv` settles small ones untimed): the late sum
        candidates = [b._replace(form="late") for b in CONFIGS]
    else:
        candidates = [*(MULTI_ROW if rows <= GEMV_ROWS else ()), *DOT]

    def run(cfg: Block | None) -> torch.Tensor:
        return F.linear(x, weight) if cfg is None else gemv(x, weight, block=cfg)

    right = [c for c in candidates if _computes(run, c, ref)]
    times = time_all(run, [None, *right], weight.device, reps)
    best = min(right, key=times.__getitem__, default=None)
    return best if best is not None and times[best] < MARGIN * times[None] else None


def _computes(run: Callable[[Block], torch.Tensor], block: Block, ref: torch.Tensor) -> bool:
    """Does `block` compute the right product here? A shape that computes wrong, or that this
    device or Triton version cannot compile (`tl.dot` on an older GPU, say), is never chosen;
    this first call also compiles it."""
    try:
        return bool((run(block).float() - ref).norm() <= 1e-2 * ref.norm())
    except Exception as exc:  # noqa: BLE001 - any failure means: not this shape
        log.info("gemv block %s unusable for %s: %s", block, tuple(ref.shape), exc)
        return False


def time_all(run: Callable[[T], object], candidates: list[T], device: torch.device, reps: int = 15) -> dict[T, float]:
    """`time_cold` of `run(c)` for each candidate, every one timed twice and its better time
    kept: the first timed (cuBLAS, in `_time`) reads slow until the clocks are up."""
    times = {c: time_cold(lambda c=c: run(c), device, reps) for c in candidates}
    return {c: min(t, time_cold(lambda c=c: run(c), device, reps)) for c, t in times.items()}


def time_cold(run: Callable[[], object], device: torch.device, reps: int = 15) -> float:
    """Median ms of `run()` with L2 flushed before each call (a forward reads every matrix
    cold: the model is far larger than L2). The device first sleeps while the host queues every
    call: timed one launch at a time, a kernel this short would be timed waiting for its own
    Python launch after the flush, which once ranked block shapes by launch cost."""
    flush = torch.empty(96 << 20, dtype=torch.int8, device=device)
    run()
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda._sleep(500_000 * reps)  # cycles per call, longer than a launch: the queue stays ahead
    for start, end in events:
        flush.zero_()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events)


@triton.jit
def _load_chunk(w_ptr, X, stride_xm, m, mmask, nmask, k, K, EVEN_K: tl.constexpr):
    """W's [BLOCK_N, BLOCK_K] and x's [BLOCK_M, BLOCK_K] chunks at columns `k` of the
    multi-row forms, masked on K only where the chunks do not divide it."""
    if EVEN_K:
        w = tl.load(w_ptr + k[None, :], mask=nmask[:, None], other=0.0)
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=mmask[:, None], other=0.0)
    else:
        kmask = k < K
        w = tl.load(w_ptr + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
    return w, x


@triton.jit
def _load_row_chunk(w_ptr, nmask, k, K, EVEN_K: tl.constexpr):
    """W's [BLOCK_N, BLOCK_K] chunk at columns `k` of the one-row form, masked on K only
    where the chunks do not divide it (masked loads streamed W slower)."""
    if EVEN_K:
        return tl.load(w_ptr + k[None, :], mask=nmask[:, None], other=0.0)
    return tl.load(w_ptr + k[None, :], mask=nmask[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _load_x_chunk(X, k, K, EVEN_K: tl.constexpr):
    """x's chunk at columns `k` of the one-row form."""
    if EVEN_K:
        return tl.load(X + k)
    return tl.load(X + k, mask=k < K, other=0.0)


@triton.jit
def _gemv_kernel(X, W, B, S, Y, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                 HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr, SUM_LATE: tl.constexpr, PDL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w_ptr = W + n[:, None].to(tl.int64) * stride_wn
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    # One row of a large matrix (SUM_LATE) accumulates products element-wise and sums them once
    # after the loop: a sum per chunk puts a cross-warp reduction (a barrier) between two loads
    # of W. It is written apart, with no mask on K where chunks divide it: the general form
    # streamed large matrices' W slower. Small matrices keep the sum per chunk, in the general
    # form: on SmolLM2-135M either change made the forward graph slower (docs/performance.md,
    # "Decode step at batch 1"). Two to four rows of a matrix can take either form (`plan`
    # times both).
    if not SUM_LATE:
        wait_for_inputs(PDL)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            w = tl.load(w_ptr + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
        if HAS_SCALE:
            acc *= tl.load(S + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])
    elif BLOCK_M > 1:  # 2-4 rows: W streamed once for every row, products summed after the loop
        wait_for_inputs(PDL)
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w, x = _load_chunk(w_ptr, X, stride_xm, m, mmask, nmask, k0 + tl.arange(0, BLOCK_K), K, EVEN_K)
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        out2 = tl.sum(acc3, 2)
        if HAS_SCALE:
            out2 *= tl.load(S + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            out2 += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + m[:, None] * stride_ym + n[None, :], out2.to(Y.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])
    else:  # one row of a large matrix
        # The first chunk of W is loaded before waiting for x: no kernel writes weights.
        k = tl.arange(0, BLOCK_K)
        w = _load_row_chunk(w_ptr, nmask, k, K, EVEN_K)
        wait_for_inputs(PDL)
        acc1 = _load_x_chunk(X, k, K, EVEN_K).to(tl.float32)[None, :] * w.to(tl.float32)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            w = _load_row_chunk(w_ptr, nmask, k, K, EVEN_K)
            acc1 += _load_x_chunk(X, k, K, EVEN_K).to(tl.float32)[None, :] * w.to(tl.float32)
        out = tl.sum(acc1, 1)
        if HAS_SCALE:
            out *= tl.load(S + n, mask=nmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            out += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(Y + n, out.to(Y.dtype.element_ty), mask=nmask)


@triton.jit
def _dot_tile(X, W, B, Y, m, n, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
              EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows `m` x features `n` of the product: W's slab streamed once through the tensor cores
    in BLOCK_K chunks, summed in K order whichever rows the tile holds."""
    nmask = n < N
    mmask = m < M
    w_ptr = W + n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, x = _load_chunk(w_ptr, X, stride_xm, m, mmask, nmask, k0 + tl.arange(0, BLOCK_K), K, EVEN_K)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y_ptr = Y + m[:, None].to(tl.int64) * stride_ym + n[None, :]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _dot_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                EVEN_K: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The skinny GEMM: rows padded to BLOCK_M (16, tl.dot's smallest), W streamed once through
    the tensor cores, so 16 rows cost about what 2 do."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    wait_for_inputs(PDL)
    _dot_tile(X, W, B, Y, tl.arange(0, BLOCK_M), n, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS, EVEN_K,
              BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit(do_not_specialize=["M"])
def _invariant_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                      EVEN_K: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_dot_kernel` over row tiles: program p takes row tile p % tiles and feature block
    p // tiles, so the tiles that read one slab of W run side by side and share it in L2. A
    row's sums never involve another row, and the code is the same for every row count."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(M, BLOCK_M)
    n = (pid // tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (pid % tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    wait_for_inputs(PDL)
    _dot_tile(X, W, B, Y, m, n, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)


class Tile(NamedTuple):
    """One tile of the batch-invariant GEMM: `rows` (`tl.dot`'s M: 16 takes the warp-level MMA,
    64 and more the warp-group MMA on Hopper), features per program for matrices of fewer / at
    least WIDE_N outputs, warps and pipeline stages."""

    rows: int
    n: int
    n_wide: int
    warps: int
    stages: int


class InvariantTiles(NamedTuple):
    """A tiling of the batch-invariant GEMM: the widest K chunk tried (the widest of k, k/2,
    k/4 that divides K is taken; one chunk for every tile), and (up to this many rows, tile)
    pairs in ascending order, the last for any row count. With one tile a row is computed by
    the same code at every row count; with two, only where both MMA shapes sum a K chunk
    alike, which the tests check per tiling on the card."""

    k: int
    tiles: tuple[tuple[float, Tile], ...]


WIDE_N = 8192
ANY = float("inf")
ROWS16, ROWS64 = Tile(16, 16, 32, 4, 3), Tile(64, 32, 64, 4, 4)
INVARIANT_TILES = {
    "rows16": InvariantTiles(256, ((ANY, ROWS16),)),  # the first form: four tiles at a batch of 64
    "rows64": InvariantTiles(128, ((ANY, ROWS64),)),
    "rows64-wide": InvariantTiles(64, ((ANY, Tile(64, 64, 128, 4, 4)),)),
    "rows128": InvariantTiles(64, ((ANY, Tile(128, 64, 128, 8, 3)),)),
    "rows16+64": InvariantTiles(128, ((16, ROWS16), (ANY, ROWS64))),
    # 64-row tiles up to a batch of 64, square ones for prefill chunks and large verify steps.
    "rows64+128": InvariantTiles(128, ((64, ROWS64), (ANY, Tile(128, 128, 128, 8, 3)))),
}
DEFAULT_INVARIANT_TILES = "rows64"
# The engine's tiling; the others are there for the sweep and the tests, which pass `tiles=`.
_INVARIANT_DEFAULT = INVARIANT_TILES[DEFAULT_INVARIANT_TILES]


def invariant_block(weight: torch.Tensor, rows: int, tiles: InvariantTiles | None = None) -> tuple[int, Block]:
    """(rows per tile, launch shape) of the batch-invariant GEMM for `rows` rows: a function
    of W's shape only, never timed, so two processes compute the same bits."""
    t = tiles or _INVARIANT_DEFAULT
    n, k = weight.shape
    chunk = next((c for c in (t.k, t.k // 2, t.k // 4) if k % c == 0), t.k)
    tile = next(tile for most, tile in t.tiles if rows <= most)
    return tile.rows, Block(tile.n if n < WIDE_N else tile.n_wide, chunk, tile.warps, tile.stages, "dot")


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   tiles: InvariantTiles | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] in x's dtype, for any M, each row
    computed exactly as it would be alone (the module docstring); `tiles` defaults to the
    process-wide tiling."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    assert weight.stride(-1) == 1
    tile_rows, block = invariant_block(weight, m, tiles)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bk = min(block.k, triton.next_power_of_2(k))
    grid = (triton.cdiv(n, block.n) * triton.cdiv(m, tile_rows),)
    _invariant_kernel[grid](x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0),
                            weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
                            BLOCK_M=tile_rows, BLOCK_N=block.n, BLOCK_K=bk,
                            num_warps=block.warps, num_stages=block.stages, **launch_args(x.device, m))
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         block: Block = DEFAULT, scale: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= GEMV_ROWS, or DOT_ROWS for the skinny GEMM), weight [N, K] -> [M, N] in
    x's dtype. `scale` [N] multiplies each output feature (FP8 codes with a scale per output
    channel: the GEMV forms only); `out` may be given, e.g. a column slice of a wider output."""
    m, k = x.shape
    n = weight.shape[0]
    dot = block.form == "dot"
    assert m <= (DOT_ROWS if dot else GEMV_ROWS) and x.stride(-1) == 1 and weight.stride(-1) == 1
    assert scale is None or (not dot and scale.numel() == n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (m, n) and y.stride(-1) == 1
    bk = min(block.k, triton.next_power_of_2(k))
    b = bias if bias is not None else weight
    sizes = (m, n, k, x.stride(0), weight.stride(0), y.stride(0))
    grid = (triton.cdiv(n, block.n),)
    if dot:
        _dot_kernel[grid](x, weight, b, y, *sizes, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, BLOCK_M=DOT_ROWS,
                          BLOCK_N=block.n, BLOCK_K=bk, num_warps=block.warps, num_stages=block.stages,
                          **launch_args(x.device, m))
        return y
    _gemv_kernel[grid](
        x, weight, b, scale if scale is not None else weight, y, *sizes, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, EVEN_K=k % bk == 0,
        SUM_LATE=block.form == "late",
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block.n, BLOCK_K=bk,
        num_warps=block.warps, num_stages=block.stages, **launch_args(x.device, m),
    )
    return y
