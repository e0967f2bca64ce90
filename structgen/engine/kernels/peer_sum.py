"""The sum over tensor-parallel ranks of a step's activations, fused with the residual add and
RMSNorm after it: one kernel over memory the GPUs of one host map from each other (Triton).

A tensor-parallel decode step sums a few kilobytes twice a layer. NCCL's ring takes about 7 us
a sum inside the decode graphs, and the add + norm after it is one more kernel, which cannot
start before NCCL's has ended (docs/performance.md, "Past one GPU"). Here each rank writes its
part straight into every peer's buffer (PyTorch's symmetric memory maps them) and reads the
others' parts from its own. A buffer's words start as a sentinel, the bits of -0.0, which no
part holds (a part's -0.0 is written as +0.0), so the data is its own flag: a reader polls its
words until none is the sentinel, and no barrier is needed (TensorRT-LLM's "Lamport"
all-reduce). The reader puts the sentinel back after reading. Two regions alternate, per row:
each rank keeps a phase word for every row in its own memory, which the program of that row
reads and flips, so eager calls and graph replays alike alternate with no host state, and the
ranks' phases stay equal because they make the same calls. Two regions are enough: a rank
writes a row's part of call n + 2 only after it read this rank's part of that row for call
n + 1, which this rank wrote after it had reset the row's words of call n.

A program owns a row: it sums the ranks' parts in rank order, so every rank holds the same
bits, then adds the residual and normalises as `fused._rms_norm_kernel` does. A rank that never
writes (it died) leaves its peers polling; they give up after `SPINS` polls (seconds), and the
engine's liveness check reports the rank (engine/parallel.py).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from structgen.engine.kernels.dependent_launch import launch_args, wait_for_inputs

SENTINEL = -32768  # the 16-bit pattern of -0.0 in bf16 and fp16
_SENTINEL = tl.constexpr(SENTINEL)  # as the kernels read it
MAX_WORLD = 4  # ranks whose buffers a launch takes
MAX_ROWS = 64  # rows summed here; a prompt's larger steps go through NCCL
MAX_COLS = 16384
SPINS = 1 << 22  # polls of a part before a reader gives up on its writer


@triton.jit
def _take(buf, offs, mask, spins):
    """A peer's part from this rank's buffer, once every word has arrived; then the words are
    set back to the sentinel for the call after next."""
    v = tl.load(buf + offs, mask=mask, other=0, volatile=True)
    n = 0
    while (tl.sum((v == _SENTINEL).to(tl.int32), 0) > 0) & (n < spins):
        v = tl.load(buf + offs, mask=mask, other=0, volatile=True)
        n += 1
    tl.store(buf + offs, tl.full(v.shape, _SENTINEL, tl.int16), mask=mask)
    return v


@triton.jit
def _peer_sum_norm_kernel(X, R, W, Out, ROut, Phase, Own, B0, B1, B2, B3, stride_x, stride_r, stride_o, stride_ro,
                          rank_stride, n_cols, eps, spins,
                          RANK: tl.constexpr, WORLD: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    phase = tl.load(Phase + row)
    region_offset = phase.to(tl.int64) * WORLD * rank_stride
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    dt = x.dtype
    bits = x.to(tl.int16, bitcast=True)
    bits = tl.where(bits == _SENTINEL, tl.zeros_like(bits), bits)  # -0.0 as +0.0 (on the bits: a float
    # compare with zero may be folded away, since -0.0 == 0)
    mine = region_offset + RANK * rank_stride + row * n_cols + cols  # my part's words in any buffer
    if RANK != 0:
        tl.store(B0 + mine, bits, mask=mask)
    if RANK != 1:
        tl.store(B1 + mine, bits, mask=mask)
    if WORLD > 2 and RANK != 2:
        tl.store(B2 + mine, bits, mask=mask)
    if WORLD > 3 and RANK != 3:
        tl.store(B3 + mine, bits, mask=mask)
    acc = tl.zeros([BLOCK], tl.float32)
    for q in tl.static_range(WORLD):  # in rank order on every rank: the same bits everywhere
        if q == RANK:
            acc += x.to(tl.float32)
        else:
            part = _take(Own, region_offset + q * rank_stride + row * n_cols + cols, mask, spins)
            acc += part.to(dt, bitcast=True).to(tl.float32)
    r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
    h = (acc.to(dt).to(tl.float32) + r.to(tl.float32)).to(dt)  # the sum rounded as NCCL's, then the add
    tl.store(ROut + row * stride_ro + cols, h, mask=mask)
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0)
    if UNIT_OFFSET:
        y = (hf * inv) * (1.0 + w.to(tl.float32))
    else:
        y = (hf * inv).to(dt).to(tl.float32) * w.to(tl.float32)
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)
    tl.store(Phase + row, 1 - phase)  # this row's next call uses the other region


class PeerSum:
    """The summing buffers of this rank and views of its peers', mapped by every rank of the
    default group (building one is a collective: `PeerSum.build`)."""

    def __init__(self, buffers: list[torch.Tensor], rank: int, cols: int, dtype: torch.dtype):
        self.buffers = buffers  # rank q's buffer, as this rank maps it: [2 regions, ranks, MAX_ROWS, cols]
        self.spins = SPINS
        self.rank, self.world_size, self.cols, self.dtype = rank, len(buffers), cols, dtype
        self.rank_stride = MAX_ROWS * cols
        self.phase = torch.zeros(MAX_ROWS, dtype=torch.int32, device=buffers[rank].device)  # each row's region

    @classmethod
    def build(cls, device: torch.device, dtype: torch.dtype, cols: int) -> PeerSum:
        """Map the buffers (every rank calls this; `usable` said all of them can)."""
        from torch.distributed import _symmetric_memory as symm_mem

        world, rank = dist.get_world_size(), dist.get_rank()
        words = 2 * world * MAX_ROWS * cols
        mine = symm_mem.empty(words, dtype=torch.int16, device=device)
        mine.fill_(SENTINEL)
        torch.cuda.synchronize(device)  # every word a sentinel before any peer may write
        handle = symm_mem.rendezvous(mine, dist.group.WORLD.group_name)
        buffers = [mine if q == rank else handle.get_buffer(q, (words,), torch.int16) for q in range(world)]
        return cls(buffers, rank, cols, dtype)

    @staticmethod
    def usable(device: torch.device, world_size: int, dtype: torch.dtype, cols: int) -> bool:
        """Whether this rank can take part: every rank on this host with peer access between
        their GPUs, a torch with symmetric memory, a 16-bit dtype and a row one program holds."""
        if (device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or world_size > MAX_WORLD
                or cols > MAX_COLS):
            return False
        try:
            from torch.distributed import _symmetric_memory  # noqa: F401
        except ImportError:
            return False
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if local != world_size or world_size > torch.cuda.device_count():
            return False
        here = device.index if device.index is not None else torch.cuda.current_device()
        return all(torch.cuda.can_device_access_peer(here, other) for other in range(world_size) if other != here)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == self.cols and x.dtype == self.dtype
                and x.stride(1) == 1)

    def sum_add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(sum of x over the ranks + residual) * weight, that sum + residual), every rank
        the same bits; `x` must `fit`."""
        rows, cols = x.shape
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        b = self.buffers + [self.buffers[0]] * (MAX_WORLD - self.world_size)
        _peer_sum_norm_kernel[(rows,)](
            x, residual, weight, out, res_out, self.phase, self.buffers[self.rank], *b,
            x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0), self.rank_stride, cols, eps, self.spins,
            RANK=self.rank, WORLD=self.world_size, UNIT_OFFSET=unit_offset, BLOCK=triton.next_power_of_2(cols),
            num_warps=4 if cols <= 2048 else 8, **launch_args(x.device, rows),
        )
        return out, res_out
