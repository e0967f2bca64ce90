"""Per projection matrix of the Llama-8B and 70B shapes: cuBLAS on bf16 weights against the
packed products of `kernels/packed_gemm.py` on the same weights quantized to int4 (groups of
128) and FP8 (per channel), at decode row counts. Each packed product is timed at every block
shape of a small grid, so the defaults (`packed_gemm.GEMV`, `dot_block`) can be checked or
replaced; the GB/s column is the packed bytes read over the time (compare with the copy
bandwidth `bench_decode` measures).

Times are `gemv.time_cold` (L2 flushed before each call), in microseconds.

    python -m benchmarks.bench_packed_gemm [--models llama-8b,llama-70b] [--rows 1,4,16,64]

Writes benchmarks/results/packed_gemm-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
import torch.nn.functional as F
import triton

from benchmarks.bench_gemv import matrices
from benchmarks.common import print_table, write_results
from structgen.engine.kernels import gemv as G
from structgen.engine.kernels import packed_gemm
from structgen.engine.models.packed import QUANTIZERS, PackedWeight


def blocks(rows: int) -> list[packed_gemm.Block | None]:
    """None (the default choice) and a grid around it."""
    if rows <= packed_gemm.GEMV_ROWS:
        grid = itertools.product((2, 4, 8), (128, 256, 512), (4, 8), (3,))
        return [None, *(packed_gemm.Block(triton.next_power_of_2(rows), n, j, w, s) for n, j, w, s in grid)]
    m = packed_gemm.dot_block(rows).m
    grid = itertools.product((16, 32, 64), (32, 64, 128), (4,), (3, 4))
    return [None, *(packed_gemm.Block(m, n, j, w, s) for n, j, w, s in grid)]


def time_packed(weight: PackedWeight, x: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """The default block's time, and the best of the grid with its shape."""
    def run(block: packed_gemm.Block | None) -> torch.Tensor:
        return packed_gemm.matmul(x, weight, block=block)

    right = [b for b in blocks(x.shape[0]) if float((run(b).float() - ref).norm()) <= 0.05 * float(ref.norm())]
    times = G.time_all(run, right, x.device)
    best = min(times, key=times.__getitem__)
    return {"default_us": times.get(None, float("nan")) * 1e3, "best_us": times[best] * 1e3,
            "best_block": None if best is None else list(best), "bytes": weight.nbytes}


def bench_matrix(model: str, name: str, n: int, k: int, rows: list[int], device: torch.device) -> list[dict[str, Any]]:
    """cuBLAS on the bf16 weight and the packed products of its int4 and FP8 forms, per row count."""
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    packed = {q: QUANTIZERS[q](w) for q in ("int4", "fp8")}
    out: list[dict[str, Any]] = []
    for m in rows:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        cublas = G.time_all(lambda _, x=x: F.linear(x, w), [None], device)[None] * 1e3
        out.append({"model": model, "matrix": name, "rows": m, "format": "bf16 cuBLAS", "us": cublas,
                    "gb_s": w.numel() * 2 / cublas / 1e3})
        for q, weight in packed.items():
            r = time_packed(weight, x, x.float() @ weight.dequantize().T)
            out.append({"model": model, "matrix": name, "rows": m, "format": q, "us": r["default_us"],
                        "gb_s": r["bytes"] / r["default_us"] / 1e3, **r})
        print(*out[-3:], sep="\n", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-8b,llama-70b")
    ap.add_argument("--rows", default="1,4,16,64")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "bench_packed_gemm times CUDA kernels"
    device = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    results: list[dict[str, Any]] = []
    for model in args.models.split(","):
        for name, (n, k) in matrices(model).items():
            results += bench_matrix(model, name, n, k, rows, device)
            torch.cuda.empty_cache()
    print_table([{k: r.get(k) for k in ("model", "matrix", "rows", "format", "us", "gb_s", "best_us", "best_block")}
                 for r in results])
    print("wrote", write_results("packed_gemm", results))


if __name__ == "__main__":
    main()
