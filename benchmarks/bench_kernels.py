"""The fused grammar-mask kernel (`csrc/mask.cu`) against xgrammar's
`apply_token_bitmask_inplace` (its "cuda" and "triton" backends), and batch-1 apply-then-sample
against the fused mask + temperature + argmax.

    python -m benchmarks.bench_kernels [--dtypes bfloat16,float32] [--out DIR]

Time: each op is captured 20 times back to back in a CUDA graph and the graph's replays are
timed with CUDA events (median of several), so launch overhead stays out and small cases are
not host-bound. Floor: the bytes the op must move (logits read + written, bitmask read; with
random masks no 8-token group is all-allowed or all-masked, so no kernel can skip any) over
the device-to-device copy bandwidth measured in the same run. Small cases (one row is 100-600
KB) sit in L2, so their "x floor" can drop below 1; the floor is meant for large batches.
Launches: kernels counted by the profiler for one batch-1 step of each pipeline.
Writes benchmarks/results/kernels-<device>-<date>.json (and a copy under --out).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import measure_copy_bandwidth_gbps, print_table, write_results

VOCABS = (49152, 128256, 151936)
ROWS = (1, 8, 64, 256, 512)
REPEAT = 20  # ops per graph


def graph_time_us(fn: Callable[[], None], trials: int = 7, replays: int = 5) -> float:
    """Median microseconds per call of `fn`, captured REPEAT times in one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up: compiles Triton kernels, allocates workspaces
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(REPEAT):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(trials):
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * REPEAT))
    return statistics.median(times)


def count_kernels(fn: Callable[[], None]) -> int:
    """GPU kernels (and memsets/copies) one call of `fn` launches, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a profiler problem must not lose the timings
        print(f"profiler failed ({exc!r}); launches not counted")
        return -1
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def mask_systems(xgr) -> dict[str, Callable[..., None]]:
    from structgen.engine.kernels.mask_apply import apply_token_bitmask

    systems = {
        "structgen-cuda": lambda x, bm: apply_token_bitmask(x, bm, backend="cuda"),
        "structgen-triton": lambda x, bm: apply_token_bitmask(x, bm, backend="triton"),
    }
    if xgr is not None:
        v = None  # xgrammar detects the vocab from the shapes (they match exactly here)
        systems["xgrammar-cuda"] = lambda x, bm: xgr.apply_token_bitmask_inplace(x, bm, vocab_size=v, backend="cuda")
        systems["xgrammar-triton"] = lambda x, bm: xgr.apply_token_bitmask_inplace(x, bm, vocab_size=v, backend="triton")
    return systems


def bench_mask_case(x: torch.Tensor, bm: torch.Tensor, bw_gbps: float, systems: dict) -> list[dict]:
    """Every system on one (dtype, vocab, rows) case; the fused op on the same inputs."""
    from structgen.engine.kernels.mask_apply import apply_token_bitmask

    rows, vocab = x.shape
    elt = x.element_size()
    mask_bytes = bm.numel() * 4
    base = {"dtype": str(x.dtype).removeprefix("torch."), "vocab": vocab, "batch": rows}
    out_rows = []
    moved = 2 * rows * vocab * elt + mask_bytes
    for name, fn in systems.items():
        us = graph_time_us(functools.partial(fn, x, bm))
        out_rows.append({"system": name, "op": "mask", **base, "metric": "us", "value": us,
                         "floor_us": moved / (bw_gbps * 1e3), "x_floor": us * bw_gbps * 1e3 / moved,
                         "gbps": moved / (us * 1e3)})
    # Fused greedy step: mask + temperature + argmax, logits only read.
    temp = torch.full((rows,), 0.7, device="cuda")
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    read = rows * vocab * elt + mask_bytes
    for backend in ("cuda", "triton"):
        fn = functools.partial(apply_token_bitmask, x, bm, temperature=temp, out=out, write=False,
                               backend=backend)
        us = graph_time_us(fn)
        out_rows.append({"system": f"structgen-{backend}", "op": "mask+temp+argmax", **base,
                         "metric": "us", "value": us, "floor_us": read / (bw_gbps * 1e3),
                         "x_floor": us * bw_gbps * 1e3 / read, "gbps": read / (us * 1e3)})
    return out_rows


def random_inputs(rows: int, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Normal logits and random mask words (never zeros: they would flatter a skipping kernel)."""
    g = torch.Generator(device="cuda").manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, device="cuda", generator=g).to(dtype)
    bm = torch.randint(-(2**31), 2**31 - 1, (rows, vocab // 32), device="cuda", dtype=torch.int64,
                       generator=g).to(torch.int32)
    return x, bm


def bench_mask(dtypes: list[torch.dtype], bw_gbps: float, xgr) -> list[dict]:
    systems = mask_systems(xgr)
    out_rows = []
    for dtype in dtypes:
        for vocab in VOCABS:
            for rows in ROWS:
                out_rows += bench_mask_case(*random_inputs(rows, vocab, dtype), bw_gbps, systems)
    return out_rows


def pipelines(xgr, x, bm, temp, out) -> dict[str, Callable[[], None]]:
    """Batch-1 greedy step after the LM head: ours fused, xgrammar's apply then divide + argmax."""
    from structgen.engine.kernels.mask_apply import apply_token_bitmask

    steps = {"structgen-fused": functools.partial(apply_token_bitmask, x, bm, temperature=temp, out=out,
                                                  write=False, backend="cuda")}
    if xgr is None:
        return steps

    def apply_then_sample(backend: str) -> None:
        xgr.apply_token_bitmask_inplace(x, bm, backend=backend)
        torch.argmax(x / temp.unsqueeze(1), dim=-1, out=out)

    steps["xgrammar-cuda+argmax"] = functools.partial(apply_then_sample, "cuda")
    steps["xgrammar-triton+argmax"] = functools.partial(apply_then_sample, "triton")
    return steps


def bench_batch1(xgr, dtype: torch.dtype) -> list[dict]:
    """One batch-1 greedy step after the LM head: apply-then-sample vs fused, per vocab."""
    out_rows = []
    for vocab in VOCABS:
        x, bm = random_inputs(1, vocab, dtype)
        temp = torch.full((1,), 0.7, device="cuda")
        out = torch.empty(1, dtype=torch.int64, device="cuda")
        for name, fn in pipelines(xgr, x, bm, temp, out).items():
            launches = count_kernels(fn)
            graph_us = graph_time_us(fn)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(200):
                fn()
            end.record()
            end.synchronize()
            eager_us = start.elapsed_time(end) * 1e3 / 200
            out_rows.append({"system": name, "op": "batch1-step", "dtype": str(dtype).removeprefix("torch."),
                             "vocab": vocab, "batch": 1, "metric": "us", "value": graph_us,
                             "eager_us": eager_us, "launches": launches})
    return out_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--out", default=None, help="also copy the JSON here (the device's $OUT)")
    ap.add_argument("--quick", action="store_true",
                    help="large batches only, no xgrammar CUDA build, no batch-1 step; prints, writes nothing")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    from structgen.engine.kernels import csrc_ext

    csrc_ext.load()
    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
        print("xgrammar not importable: measuring structgen only")
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    bw = statistics.median(measure_copy_bandwidth_gbps() for _ in range(3))
    print(f"device-to-device copy: {bw:.0f} GB/s (read + write)")
    if args.quick:
        systems = mask_systems(xgr)
        systems.pop("xgrammar-cuda", None)  # its first use compiles for about a minute
        print_table([r for rows in (256, 512) for vocab in VOCABS for dtype in dtypes
                     for r in bench_mask_case(*random_inputs(rows, vocab, dtype), bw, systems)])
        return
    rows = bench_mask(dtypes, bw, xgr) + bench_batch1(xgr, dtypes[0])
    print_table(rows)
    path = write_results("kernels", rows, extra={"copy_bandwidth_gbps": bw, "ops_per_graph": REPEAT,
                                                 "mask": "random int32 words (about half allowed)"})
    print(f"wrote {path}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(args.out) / path.name)


if __name__ == "__main__":
    main()
