"""The batch-invariant GEMM's tilings (`gemv.INVARIANT_TILES`) against the per-row-count path
(`gemv.plan`: the timed GEMV / skinny GEMM / cuBLAS pick) on one model shape's matrices, at
the row counts the engine launches: 1 (a decode step), k + 1 (a verify step), 16 and 64 (batches)
and 256 (a batch of 64 verifying 3 drafts each). Each tiling is also checked for invariance on
these matrices: rows of the M-row product against the same rows computed alone, bit for bit.

`forward_ms` is the projections of one forward: layers x (qkv + o + gate_up + down) + the LM
head, each timed with `gemv.time_cold` (L2 flushed, best of two).

    python -m benchmarks.bench_invariant_gemm [--model llama-8b] [--rows 1,4,16,64,256]

Writes benchmarks/results/invariant_gemm-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.bench_gemv import matrices
from benchmarks.common import model_config, print_table, write_results
from structgen.engine.kernels import gemv as G

CHECKED_ROWS = (0, 1, 5, 15, 16, 63, 64, 255)  # rows compared with their one-row product


def per_row_count(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What `models.llama.project` runs outside the batch-invariant mode."""
    block = G.plan(x.shape[0], w)
    return F.linear(x, w) if block is None else G.gemv(x, w, block=block)


def is_invariant(x: torch.Tensor, w: torch.Tensor, tiles: G.InvariantTiles) -> bool:
    """Rows of the product of `x`'s rows equal their one-row products, bit for bit."""
    full = G.invariant_gemm(x, w, tiles=tiles)
    return all(torch.equal(G.invariant_gemm(x[i : i + 1], w, tiles=tiles)[0], full[i])
               for i in CHECKED_ROWS if i < x.shape[0])


def sweep_matrix(n: int, k: int, rows: int, device: torch.device) -> dict[str, Any]:
    """Microseconds of each variant on one [n, k] matrix at `rows` rows, and each tiling's
    invariance there."""
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    per_row_count(x, w)  # the plan's timing, outside the timed calls
    runs = {"cublas": lambda: F.linear(x, w), "per_row_count": lambda: per_row_count(x, w)}
    for name, tiles in G.INVARIANT_TILES.items():
        runs[name] = lambda tiles=tiles: G.invariant_gemm(x, w, tiles=tiles)
    times = G.time_all(lambda name: runs[name](), list(runs), device)
    out: dict[str, Any] = {f"{name}_us": round(t * 1e3, 2) for name, t in times.items()}
    out["invariant"] = [name for name, tiles in G.INVARIANT_TILES.items() if is_invariant(x, w, tiles)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_invariant_gemm needs a CUDA device")
    device = torch.device("cuda")
    layers = model_config(args.model).num_hidden_layers
    variants = ["per_row_count", "cublas", *G.INVARIANT_TILES]
    rows_out: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    for rows in (int(r) for r in args.rows.split(",")):
        per_matrix = {name: sweep_matrix(n, k, rows, device) for name, (n, k) in matrices(args.model).items()}
        rows_out += [{"model": f"{args.model}-shape", "matrix": m, "rows": rows, **r} for m, r in per_matrix.items()]
        forward = {v: sum(r[f"{v}_us"] * (1 if m == "head" else layers) for m, r in per_matrix.items()) / 1e3
                   for v in variants}
        invariant_everywhere = set.intersection(*(set(r["invariant"]) for r in per_matrix.values()))
        line = {"rows": rows, "per_row_count_ms": round(forward["per_row_count"], 3)}
        for v in G.INVARIANT_TILES:
            line[v] = f"{forward[v] / forward['per_row_count']:.3f}x" + ("" if v in invariant_everywhere else " NOT-INV")
        summary.append(line)
        print(line, flush=True)
    print(f"\ndevice: {torch.cuda.get_device_name()}; forward projections vs the per-row-count path "
          f"(default tiling {G.DEFAULT_INVARIANT_TILES})")
    print_table(summary)
    if not args.no_write:
        print("wrote", write_results("invariant_gemm", rows_out, extra={
            "summary": summary, "default_tiling": G.DEFAULT_INVARIANT_TILES,
            "timing": "gemv.time_cold, L2 flushed, best of two; forward = layers x one layer's projections + head"}))


if __name__ == "__main__":
    main()
