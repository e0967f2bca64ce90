"""What a Python host callback inside a CUDA graph costs (`csrc/hostfunc.cpp`): the price the
capturable guided mode (`engine/guided_loop.py`) pays twice a verify step.

A graph holds `PAIRS` pairs of (one tiny kernel, one host callback); stream order makes each
kernel wait for the callback before it. Replays are queued with the GIL released and the wall
time per pair is reported, for:

- `kernel`: the kernels alone (no callback), the floor;
- `callback`: a no-op Python callback after each kernel, the main thread waiting GIL-free
  (as `GuidedLoop` waits);
- `callback_busy`: the same while the main thread runs Python: CUDA's callback thread needs
  the GIL, which the running thread gives up only at the interpreter's switch interval;
- `callback_busy_fast_switch`: the same with `sys.setswitchinterval(1e-4)`.

    python -m benchmarks.bench_hostfunc [--pairs 20] [--replays 50]

Writes benchmarks/results/hostfunc-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.common import print_table, write_results


def build(pairs: int, callback: bool) -> torch.cuda.CUDAGraph:
    from structgen.engine.kernels.hostfunc import hostfunc

    @hostfunc
    def noop() -> None:
        pass

    x = torch.zeros(1, device="cuda")
    x.add_(1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(pairs):
            x.add_(1)
            if callback:
                noop.launch()
    g._keep = x  # the graph's buffer lives as long as the graph
    return g


def time_pairs(g: torch.cuda.CUDAGraph, pairs: int, replays: int, busy: bool) -> float:
    """Microseconds of wall time per (kernel, callback) pair over `replays` queued replays."""
    from structgen.engine.kernels import hostfunc

    hostfunc.synchronize()
    done = torch.cuda.Event()
    t = time.perf_counter()
    for _ in range(replays):
        hostfunc.replay(g)
    done.record()
    if busy:  # Python on the main thread until the GPU is done: holds the GIL between checks
        while not done.query():
            sum(range(200))
    hostfunc.synchronize()
    return (time.perf_counter() - t) / (replays * pairs) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=20, help="(kernel, callback) pairs per graph")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per variant; the median is kept")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_hostfunc needs a CUDA device")
    from structgen.engine.kernels import csrc_ext, hostfunc

    csrc_ext.load()
    graphs = {False: build(args.pairs, False), True: build(args.pairs, True)}
    switch = sys.getswitchinterval()
    variants: list[tuple[str, bool, bool, float]] = [
        ("kernel", False, False, switch),
        ("callback", True, False, switch),
        ("callback_busy", True, True, switch),
        ("callback_busy_fast_switch", True, True, 1e-4),
    ]
    rows: list[dict[str, Any]] = []
    try:
        for name, callback, busy, interval in variants:
            sys.setswitchinterval(interval)
            # With a busy main thread each callback may wait a whole switch interval: fewer replays.
            replays = max(2, args.replays // 10) if busy else args.replays
            time_pairs(graphs[callback], args.pairs, 2, busy)  # warm-up
            runs = [time_pairs(graphs[callback], args.pairs, replays, busy) for _ in range(args.repeats)]
            rows.append({"variant": name, "us_per_pair": round(statistics.median(runs), 2),
                         "runs_us": [round(r, 2) for r in runs], "switch_interval_s": interval,
                         "pairs": args.pairs, "replays": replays})
            print(rows[-1], flush=True)
    finally:
        sys.setswitchinterval(switch)
    base = rows[0]["us_per_pair"]
    for r in rows:
        r["callback_us"] = round(r["us_per_pair"] - base, 2)
    print(f"\ndevice: {torch.cuda.get_device_name()}  callbacks run: {hostfunc.stats()['calls']}")
    print_table([{k: r[k] for k in ("variant", "us_per_pair", "callback_us", "switch_interval_s")} for r in rows])
    if not args.no_write:
        print("wrote", write_results("hostfunc", rows, extra={"note": "wall us per (tiny kernel, host callback) "
                                                                      "pair in a replayed graph; callback_us: "
                                                                      "minus the kernel-only floor"}))


if __name__ == "__main__":
    main()
