"""The all-reduce of tensor parallelism at a decode step's sizes: NCCL against the one-shot
kernel over symmetric memory (structgen/engine/all_reduce.py), each as 32 back-to-back sums
replayed in a CUDA graph, as a forward runs them. The one-shot sums are checked against
NCCL's on the same inputs.

    python -m benchmarks.bench_allreduce [--ranks 2] [--no-write]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import print_table, write_results

REDUCES_PER_GRAPH = 32
HIDDEN = 4096  # the Llama-8B shape's hidden size: a row of activations is 8 KiB in bf16
ROWS = (1, 8, 32, 64, 128)


def graph_us(fn: Any, x: torch.Tensor) -> float:
    """Microseconds per call of `fn(x)`, replayed REDUCES_PER_GRAPH times in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REDUCES_PER_GRAPH):
            fn(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (20 * REDUCES_PER_GRAPH)


def rank_main(rank: int, ranks: int, port: int, results: Any) -> None:
    from structgen.engine.all_reduce import OneShotAllReduce

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                            device_id=torch.device("cuda", rank))
    device = torch.device("cuda", rank)
    buffer = OneShotAllReduce.buffer_for(device, torch.bfloat16, ranks)
    one_shot = OneShotAllReduce(buffer) if buffer is not None else None
    rows = []
    for n in ROWS:
        x = torch.randn(n, HIDDEN, device=device, dtype=torch.bfloat16, generator=torch.Generator(device).manual_seed(rank))
        expected = x.clone()
        dist.all_reduce(expected)
        row = {"system": "nccl", "rows": n, "bytes": x.numel() * 2, "metric": "us_per_all_reduce",
               "value": graph_us(dist.all_reduce, x.clone())}
        rows.append(row)
        if one_shot is not None and one_shot.fits(x):
            same = bool(torch.equal(one_shot(x), expected))
            rows.append({**row, "system": "one-shot", "equal_to_nccl": same, "value": graph_us(one_shot, x)})
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"needs {args.ranks} GPUs, this host has {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = results.get()
    for p in procs:
        p.join(120)
    for r in rows:
        r["ranks"] = args.ranks
    print_table(rows)
    if not args.no_write:
        print(write_results(f"allreduce-{args.ranks}gpu", rows, extra={"reduces_per_graph": REDUCES_PER_GRAPH,
                                                                        "hidden": HIDDEN}))


if __name__ == "__main__":
    main()
