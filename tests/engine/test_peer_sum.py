"""The peer sum (kernels/peer_sum.py): each rank's norm of the summed parts plus the residual
equals the torch definition, both ranks hold the same bits, call after call (each row's
region alternates and its words are reset), with parts that hold -0.0 (the sentinel's bits).
On two GPUs eagerly and replayed from a CUDA graph; on the CPU, two processes run the kernel in
Triton's interpreter over shared memory, which checks the protocol (writes, polls, resets,
phases) wherever the tests run."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLS, EPS = 4096, 1e-5


def _inputs(call: int, rank: int, rows: int, cols: int = COLS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's part, the residual, the norm weight) of a call: any rank can make any's."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    part = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    part[:, :7] = -0.0  # the sentinel's bits must arrive as a zero, not stall the reader
    g = torch.Generator().manual_seed(999_999 + call)
    residual = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(cols, generator=g)).to(torch.bfloat16)
    return part, residual, weight


def _expected(call: int, rows: int, world: int, cols: int = COLS) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [_inputs(call, q, rows, cols)[0] for q in range(world)]
    _, residual, weight = _inputs(call, 0, rows, cols)
    total = sum(p.float() for p in parts).to(torch.bfloat16)
    h = (total.float() + residual.float()).to(torch.bfloat16)
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
    return (weight * y).float(), h


def _rank(rank: int, world: int, port: int, results: dict) -> None:
    from structgen.engine.kernels.peer_sum import PeerSum

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    peer_sum = PeerSum.build(device, torch.bfloat16, COLS)
    errors, outs = [], []
    calls = [(c, rows) for c, rows in enumerate([1, 1, 3, 64, 2, 1, 17, 64, 1, 5] * 3)]
    for call, rows in calls:  # eager
        part, residual, weight = (t.to(device) for t in _inputs(call, rank, rows))
        y, h = peer_sum.sum_add_norm(part, residual, weight, EPS)
        want_y, want_h = _expected(call, rows, world)
        errors.append(((y.float().cpu() - want_y).abs().max().item(), torch.equal(h.cpu(), want_h)))
        outs.append(y.cpu())
    # Graph replays: a captured "forward" of four calls, replayed with new inputs.
    bufs = [tuple(t.to(device) for t in _inputs(100 + i, rank, 2)) for i in range(4)]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        [peer_sum.sum_add_norm(p, r, w, EPS) for p, r, w in bufs]  # compiled outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            captured = [peer_sum.sum_add_norm(p, r, w, EPS) for p, r, w in bufs]
    for replay in range(5):
        for i, (p, r, w) in enumerate(bufs):
            new = _inputs(200 + 10 * replay + i, rank, 2)
            p.copy_(new[0]), r.copy_(new[1]), w.copy_(new[2])
        graph.replay()
        torch.cuda.synchronize()
        for i, (y, h) in enumerate(captured):
            want_y, want_h = _expected(200 + 10 * replay + i, 2, world)
            errors.append(((y.float().cpu() - want_y).abs().max().item(), torch.equal(h.cpu(), want_h)))
            outs.append(y.cpu())
    results[rank] = (errors, outs)
    dist.barrier()
    os._exit(0)  # NCCL's teardown after graph capture can hang (engine/parallel.py, `leave`)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gpu
def test_peer_sum_equals_the_torch_sum_and_norm_on_both_ranks_eager_and_in_graphs():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from structgen.engine.kernels.peer_sum import PeerSum

    if not PeerSum.usable(torch.device("cuda", 0), 2, torch.bfloat16, COLS):
        pytest.skip("the two GPUs cannot map each other's memory")
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_rank, args=(2, _free_port(), results), nprocs=2, join=True, start_method="spawn")
    (errors0, outs0), (errors1, outs1) = results[0], results[1]
    assert all(same for _, same in errors0 + errors1)  # residual streams: exact
    assert max(err for err, _ in errors0 + errors1) < 0.05  # the norm: rsqrt against 1/sqrt, bf16
    assert all(torch.equal(a, b) for a, b in zip(outs0, outs1, strict=True))  # the ranks agree bit for bit


CPU_COLS = 64
# Rows per call: rows 0 and 1 take part in odd and even numbers of calls in a row, so their
# regions alternate independently of the others'.
CPU_CALLS = [(c, rows) for c, rows in enumerate([1, 3, 1, 1, 2, 5, 1, 2, 1])]


def _cpu_rank(rank: int, buffers: list[torch.Tensor], results: dict) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported in this process
    from structgen.engine.kernels.peer_sum import PeerSum

    peer_sum = PeerSum(buffers, rank, CPU_COLS, torch.bfloat16)
    peer_sum.spins = 20_000  # a part that never arrives fails the test instead of stalling it
    outs = []
    for call, rows in CPU_CALLS:
        part, residual, weight = _inputs(call, rank, rows, CPU_COLS)
        outs.append(peer_sum.sum_add_norm(part, residual, weight, EPS))
    results[rank] = (outs, peer_sum.phase.clone())


def test_peer_sum_protocol_between_two_processes_in_the_triton_interpreter():
    from structgen.engine.kernels.peer_sum import MAX_ROWS, SENTINEL

    words = 2 * 2 * MAX_ROWS * CPU_COLS  # [regions, ranks, rows, cols]
    buffers = [torch.full((words,), SENTINEL, dtype=torch.int16).share_memory_() for _ in range(2)]
    context = mp.get_context("spawn")
    results = context.Manager().dict()
    procs = [context.Process(target=_cpu_rank, args=(rank, buffers, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(240)
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    (outs0, phase0), (outs1, phase1) = results[0], results[1]
    for (call, rows), (y0, h0), (y1, h1) in zip(CPU_CALLS, outs0, outs1, strict=True):
        assert torch.equal(y0, y1) and torch.equal(h0, h1)  # the ranks agree bit for bit
        want_y, want_h = _expected(call, rows, 2, CPU_COLS)
        # The interpreter rounds float32 to bf16 by truncation, where the GPU rounds to nearest:
        # the sum and the add each within a bf16 step of their own size.
        total = sum(_inputs(call, q, rows, CPU_COLS)[0].float() for q in range(2))
        assert bool(((h0.float() - want_h.float()).abs() <= 2**-7 * (total.abs() + want_h.float().abs())).all())
        assert torch.allclose(y0.float(), want_y, rtol=2**-5, atol=2e-2)
    assert all(bool((b == SENTINEL).all()) for b in buffers)  # every word read was reset
    uses = [sum(rows > r for _, rows in CPU_CALLS) for r in range(MAX_ROWS)]
    assert phase0.tolist() == phase1.tolist() == [u % 2 for u in uses]
