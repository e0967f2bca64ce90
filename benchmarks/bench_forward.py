"""Forward-only benchmark: ms per decode forward (one CUDA-graph replay, no host in the loop)
per bucket of rows, against the HBM floor, in these variants in the same process: the default
(fused projections of `kernels/fused_gemv.py` up to `FUSED_ROWS` rows, and 2-16 rows through
`kernels/gemv.py` where timed faster than cuBLAS), without the fused projections, with cuBLAS
for every product of more than one row, the batch-invariant mode (`EngineConfig.batch_invariant`:
every product through `gemv.invariant_gemm`, no fused projections, attention split as at batch
1), and the fused projections at every row count they take (`fused_max_rows`: the check on
`FUSED_ROWS`, on each card).

This isolates the GPU side of a decode step: bench_decode's ms/step also holds the sampler and
whatever the host does between steps. Random weights of real shapes; no tokenizer or files.

    python -m benchmarks.bench_forward                        # all shapes, buckets 1,2,4,8,16
    python -m benchmarks.bench_forward --models llama-8b --buckets 1 --replays 300
"""

from __future__ import annotations

import argparse
import gc
import statistics
from typing import Any

import torch

from benchmarks.common import (
    decode_weight_bytes,
    hbm_floor_ms,
    measure_copy_bandwidth_gbps,
    model_config,
    print_table,
    write_results,
)
from structgen.engine.config import EngineConfig, EngineTuning
from structgen.engine.kernels import fused_gemv, gemv, use_batch_invariant
from structgen.engine.model_runner import ModelRunner
from structgen.engine.models.llama import FUSED_ROWS

MODELS = ("smollm2-135m", "llama-1b", "llama-8b")


def time_forward(runner: ModelRunner, bucket: int, replays: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean ms per replay of the bucket's forward graph, replayed
    back to back (as the engine queues a pre-launched forward behind the sampler)."""
    forward = runner.graphs._steps[bucket][0]
    for _ in range(10):
        forward()
    means = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(replays):
            forward()
        end.record()
        torch.cuda.synchronize()
        means.append(start.elapsed_time(end) / replays)
    return statistics.median(means)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--buckets", default="1,2,4,8,16")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "bench_forward times CUDA graphs"
    buckets = [int(b) for b in args.buckets.split(",")]
    bandwidth = measure_copy_bandwidth_gbps()
    rows: list[dict[str, Any]] = []
    floors: dict[str, float] = {}
    for model in args.models.split(","):
        cfg = model_config(model)
        floors[model] = hbm_floor_ms(decode_weight_bytes(cfg, torch.bfloat16), bandwidth)
        ec = EngineConfig(max_batch_size=max(8, max(buckets)), max_seq_len=1024, use_cuda_graphs=False,
                          batch_invariant=False, tuning=EngineTuning(cuda_graph_batch_sizes=tuple(buckets)))
        runner = ModelRunner(cfg, ec, None)
        timed: dict[tuple[str, int], list[float]] = {}
        used: dict[str, int] = {}  # variant -> projection rows the layers took (fused_gemv.max_rows)
        # (fused projection rows asked, most rows of a product the Triton kernels may take,
        # the batch-invariant mode)
        variants = {"default": (FUSED_ROWS, gemv.MAX_ROWS, False), "unfused": (0, gemv.MAX_ROWS, False),
                    "cublas_multirow": (FUSED_ROWS, 1, False), "batch_invariant": (FUSED_ROWS, gemv.MAX_ROWS, True)}
        if FUSED_ROWS < fused_gemv.MAX_ROWS:  # the fused projections at every row count they take
            variants["fused_max_rows"] = (fused_gemv.MAX_ROWS, gemv.MAX_ROWS, False)
        for _ in range(2):  # each variant twice, interleaved: the better of two captures each
            for name, (fused_rows, gemv_rows, invariant) in variants.items():
                use_batch_invariant(invariant)
                runner.model.use_fused_kernels(True, projection_rows=fused_rows)
                used[name] = runner.model.layers[0].fused_rows
                gemv.MAX_ROWS = gemv_rows
                runner.graphs = None
                gc.collect()
                runner.capture_decode_graphs()
                for b in buckets:
                    timed.setdefault((name, b), []).append(time_forward(runner, b, args.replays))
        gemv.MAX_ROWS = variants["default"][1]
        use_batch_invariant(False)
        for (name, b), ms in sorted(timed.items(), key=lambda kv: (kv[0][1], list(variants).index(kv[0][0]))):
            value = min(ms)
            rows.append({"model": f"{model}-shape", "rows": b, "variant": name,
                         "fused_projections": used[name] >= b,
                         "multi_row_timed": variants[name][1] >= b > 1 and not variants[name][2],
                         "ms": round(value, 4), "runs_ms": [round(v, 4) for v in ms],
                         "x_floor": round(value / floors[model], 3), "floor_ms": round(floors[model], 4)})
            print(rows[-1], flush=True)
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\ndevice: {torch.cuda.get_device_name()}  copy bandwidth: {bandwidth:.0f} GB/s")
    print_table([{k: r[k] for k in ("model", "rows", "variant", "fused_projections", "multi_row_timed", "ms", "x_floor",
                                    "floor_ms")} for r in rows])
    if not args.no_write:
        print("wrote", write_results("forward", rows, floors, {"copy_bandwidth_gbps": bandwidth,
                                                               "replays": args.replays}))


if __name__ == "__main__":
    main()
