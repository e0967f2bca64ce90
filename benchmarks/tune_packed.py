"""The packed products' launch shapes on the GPU (kernels/packed_gemm.py), per projection of
the Llama-8B and Llama-70B shapes: each code (int4 in groups of 128 with offsets, FP8 per
channel) at 1, 2 and 4 rows (a decode step's GEMV) and more rows (a batch's or a prompt's GEMM:
64 by default), beside cuBLAS on the bf16 weight and the floor (packed bytes over the measured
copy bandwidth). Each candidate is timed as a forward runs it: inside a CUDA graph, one call
after another (dependent launches on where the GPU has them) over enough copies of the matrix
that none of them is still in L2 when its turn comes again.

GEMV candidates: the default (`packed_gemm.GEMV_BLOCKS`, `ROW_SCALED_BLOCKS`), the stream GEMV's launch shapes
(kernels/packed_gemv.py: int4 in the "words" layout, FP8 codes as stored; split-K off and
automatic), the previous default ("magic" / "reduce" on the "halves" layout) and, for int4,
the CUDA GEMV (kernels/int4_gemv.py, the default where it fits) and tinygemm (kernels/tinygemm.py), and for FP8 per channel the "late" GEMV (kernels/gemv.py's). GEMM rows: the default, the "tiles" GEMM on the "halves" and
"words" layouts (the previous defaults) and, for int4, the words GEMM's launch shapes
(kernels/packed_words_gemm.py: both operand orders, split-K off and automatic) and W
de-quantized once then cuBLAS. Each candidate's error against the de-quantize reference is
printed and kept; only those under 2e-2 are timed. The summary names, per code and row count,
the block with the least total time over the 8B shapes, with the `GEMV_BLOCKS` /
`WORDS_GEMM_BLOCKS` entry to paste.

    python -m benchmarks.tune_packed [--models llama-8b,llama-70b] [--rows 1,2,4,64] [--codes int4,fp8] [--budget-s 120]
    python -m benchmarks.tune_packed --models llama-8b --rows 16,64,256 --codes int4   # the int4 GEMM

Writes benchmarks/results/tune_packed-<device>-<date>.json (and a copy under $OUT if set).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.bench_gemv import matrices
from benchmarks.common import measure_copy_bandwidth_gbps, print_table, write_results
from structgen.engine.kernels import packed_gemm as P
from structgen.engine.kernels import tinygemm
from structgen.engine.models.packed import QUANTIZERS, PackedWeight, to_words

# (n, j, warps, stages) of the stream GEMV; each with split-K off (1) and automatic (0)
STREAM_TILES = ((8, 256, 4, 3), (8, 512, 4, 3), (8, 1024, 4, 3), (16, 256, 4, 3), (16, 512, 4, 3),
                (16, 1024, 4, 3), (32, 256, 4, 3), (32, 256, 8, 3), (32, 512, 8, 3), (64, 256, 8, 3),
                (16, 256, 4, 1), (16, 512, 4, 1), (8, 512, 2, 3), (16, 256, 2, 3))
# (n, j at one row, warps, stages) of the "late" GEMV (codes with one scale per output channel;
# j halves as rows double: it keeps a [rows, n, j] float32 product in registers)
LATE_TILES = ((4, 1024, 4, 4), (2, 2048, 4, 4), (8, 1024, 4, 4), (16, 512, 4, 4), (4, 2048, 8, 3))
COPIES_BYTES = 600 << 20  # the copies of a matrix a chain walks: several times the L2
# (n, j, warps, stages) of the words GEMM; each in both operand orders with automatic split-K
WORDS_TILES = ((64, 128, 4, 4), (128, 128, 4, 3), (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (256, 64, 8, 3))
# (n, j, warps, stages) of the "tiles" GEMM (FP8 / int8 codes); each with split-K off and automatic
TILE_SHAPES = ((32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3),
               (64, 64, 4, 4), (128, 64, 4, 4), (128, 128, 8, 2), (256, 64, 8, 3), (64, 128, 8, 4))
TINYGEMM = "tinygemm"  # PyTorch's int4 kernel on its own layout
SCALED_MM = "scaled_mm"  # FP8 per channel: x rounded to FP8 per row, the FP8 tensor cores (cuBLAS)
HALVES = "halves-default"  # the default launch on the "halves" int4 layout (the previous one)


def candidates(weight: PackedWeight, rows: int) -> list[P.Block | str | None]:
    """None (the default) and the blocks tried for `rows` rows of `weight`."""
    code = weight.code
    if rows > P.GEMV_ROWS:
        return [None, *(gemm_candidates(rows) if code == "int4" else tile_candidates(weight, rows))]
    m = 1 << (rows - 1).bit_length()
    stream = [P.Block(m, n, j, w, st, "stream", k) for (n, j, w, st), k in itertools.product(STREAM_TILES, (1, 0))]
    late = [P.Block(m, n, j // m, w, st, "late") for n, j, w, st in LATE_TILES] if P.row_scaled(weight) else []
    int4 = [P.Block(m, 16, 512, 4, 3, "cuda"), TINYGEMM] if code == "int4" else []
    return [None, *stream, *late, P.FALLBACK_BLOCKS[code]._replace(m=m), *int4]


def gemm_candidates(rows: int) -> list[P.Block | str]:
    """The int4 GEMM's: the previous defaults ("tiles" on either layout), W de-quantized then
    cuBLAS, and the words GEMM's launch shapes."""
    m = min(128, max(16, 1 << (rows - 1).bit_length()))
    words = [P.Block(m, n, j, w, st, form, k) for form in ("w-by-x", "x-by-w")
             for (n, j, w, st), k in [*((t, 0) for t in WORDS_TILES), (WORDS_TILES[0], 1)]]
    return [HALVES, P.dot_block(rows), P.Block(rows, 0, 0, 0, 0, "dequantize"), *words]


def tile_candidates(weight: PackedWeight, rows: int) -> list[P.Block | str]:
    """The byte codes' GEMM: the "tiles" launch shapes and, for FP8 per channel, the FP8 tensor
    cores (another product: x rounded to FP8)."""
    m = P.dot_block(rows).m
    tiles = [P.Block(m, n, j, w, st, "tiles", k) for (n, j, w, st), k in itertools.product(TILE_SHAPES, (1, 0))]
    return [*tiles, *([SCALED_MM] if P.scaled_mm_fits(weight) else [])]


class Forms:
    """Copies of one weight in each layout a candidate reads (int4: "halves", "words",
    tinygemm's); copy 0 is the weight itself, the others random of the same shape and code."""

    def __init__(self, weight: PackedWeight, copies: list[PackedWeight]):
        self.halves = [weight, *copies]
        self.words = [to_words(w) for w in self.halves]
        fits = tinygemm.tinygemm_fits(weight)
        self.tiny = [tinygemm.to_tinygemm(w) for w in self.halves] if fits else None

    def run(self, x: torch.Tensor, block: P.Block | str | None, copy: int = 0) -> torch.Tensor:
        if block == TINYGEMM:
            if self.tiny is None:
                raise ValueError("tinygemm cannot hold this weight")
            return P.matmul(x, self.tiny[copy])
        if block == HALVES:
            return P.matmul(x, self.halves[copy])
        if block == SCALED_MM:
            return P.scaled_mm(x, self.halves[copy])
        # the GEMV's grouped forms read "halves"; "tiles" runs on "words", as a CUDA model loaded it
        on_halves = isinstance(block, P.Block) and block.form in P.GEMV_FORMS and block.form not in ("stream", "late", "cuda")
        return P.matmul(x, (self.halves if on_halves else self.words)[copy], block=block)


def time_chain(run: Callable[[int], object], copies: int, reps: int = 5) -> float:
    """Microseconds a call of `run(copy)` takes inside a CUDA graph that calls it for every copy
    in turn, three times over (the best of `reps` timings of four replays)."""
    for i in range(copies):  # compiles, and times any plan outside the capture
        run(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            for i in range(copies):
                run(i)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        for _ in range(4):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (4 * 3 * copies))
    return best


def label(block: P.Block | str | None) -> str:
    if block is None or isinstance(block, str):
        return block or "default"
    return f"{block.form} m{block.m} n{block.n} j{block.j} w{block.warps} s{block.stages} k{block.splits}"


def tune_matrix(model: str, name: str, n: int, k: int, codes: list[str], rows: list[int],
                bandwidth: float) -> list[dict[str, Any]]:
    """Every candidate of every code and row count on one projection, the bf16 product beside."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    out = []
    for code in codes:
        weight = QUANTIZERS[code](w)
        copies = [QUANTIZERS[code](torch.randn_like(w) * 0.02) for _ in range(-(-COPIES_BYTES // weight.nbytes) - 1)]
        forms = Forms(weight, copies)
        out += [r for m in rows for r in tune_case(f"{model}-shape", name, w, forms, m, bandwidth)]
        del forms, copies
        torch.cuda.empty_cache()
    return out


def bf16_chain_us(x: torch.Tensor, w: torch.Tensor) -> float:
    """cuBLAS on the bf16 weight (and copies of it), timed as `time_chain` times the candidates."""
    weights = [w, *(torch.randn_like(w) for _ in range(-(-COPIES_BYTES // (w.numel() * 2)) - 1))]
    return time_chain(lambda i: F.linear(x, weights[i]), len(weights))


def tune_case(model: str, name: str, w: torch.Tensor, forms: Forms, m: int,
              bandwidth: float) -> list[dict[str, Any]]:
    """One code at one row count: each candidate's time, x floor and error (right ones only)."""
    weight = forms.halves[0]
    x = torch.randn(m, w.shape[1], device=w.device, dtype=torch.bfloat16)
    ref = x.float() @ weight.dequantize().T
    bf16_us = bf16_chain_us(x, w)
    errors = {}
    for b in candidates(weight, m):
        try:
            errors[b] = float((forms.run(x, b).float() - ref).norm() / ref.norm())
        except Exception as e:  # a block the compiler or the layout refuses is skipped, not fatal
            print(f"  {weight.code} {name} m={m} {label(b)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    del ref
    wrong = {label(b): f"{e:.1e}" for b, e in errors.items() if not e < 2e-2}
    if wrong:
        print(f"  {weight.code} {name} m={m} errors over 2e-2 (not timed): {wrong}", flush=True)
    copies = len(forms.halves)
    times = {b: time_chain(lambda i, b=b: forms.run(x, b, i), copies) / 1e3 for b, e in errors.items() if e < 2e-2}
    floor_us = weight.nbytes / bandwidth / 1e3
    best = min(times, key=times.__getitem__)
    previous = P.dot_block(m) if m > P.GEMV_ROWS and weight.code == "int4" else None
    old = f", old {times[previous] * 1e3:.1f} us" if previous in times else ""
    print(f"{model} {name} {weight.code} m={m}: default {times.get(None, float('nan')) * 1e3:.1f} us, best "
          f"{label(best)} {times[best] * 1e3:.1f} us = {times[best] * 1e3 / floor_us:.2f}x floor "
          f"{floor_us:.1f} us (err {errors[best]:.1e}), bf16 {bf16_us:.1f} us{old}", flush=True)
    return [{"model": model, "matrix": name, "code": weight.code, "rows": m, "block": label(b), "us": t * 1e3,
             "x_floor": t * 1e3 / floor_us, "floor_us": floor_us, "bf16_us": bf16_us, "err": errors[b]}
            for b, t in times.items()]


def table_entry(block_label: str) -> str:
    """The `GEMV_BLOCKS` / `WORDS_GEMM_BLOCKS` entry of a Block's `label` (other candidates:
    the label)."""
    form, *fields = block_label.split()
    if form not in (*P.GEMV_FORMS, *P.GEMM_FORMS):
        return f"{block_label!r} (not a Block)"
    m, n, j, warps, stages, splits = (int(f[1:]) for f in fields)
    return f"Block({m}, {n}, {j}, {warps}, {stages}, {form!r}, {splits})"


def summary(rows: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    """Per code and row count: the default's and the best common block's times over `model`'s
    matrices (the block with the least total time among those that ran on every matrix)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["model"] == f"{model}-shape":
            groups[(r["code"], r["rows"])].append(r)
    out = []
    for (code, m), rs in groups.items():
        per_block: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in rs:
            per_block[r["block"]].append(r)
        n_mats = len({r["matrix"] for r in rs})
        full = {b: v for b, v in per_block.items() if len(v) == n_mats}
        if not full:
            continue
        total = {b: sum(r["us"] for r in v) for b, v in full.items()}
        best = min(total, key=total.__getitem__)
        cuda = [b for b in full if b.startswith("cuda")]
        if m <= P.GEMV_ROWS:
            # the CUDA GEMV has no table entry: matmul takes it by default wherever it fits, and
            # the table holds the launch for weights it does not fit (so "default" is it too)
            kept = [b for b in full if not cuda or not (b.startswith("cuda") or b == "default")]
            entry = min(kept, key=total.__getitem__)
            table = "ROW_SCALED_BLOCKS" if entry.startswith("late") else f"GEMV_BLOCKS[{code!r}]"
            print(f"{table}[{m}] = {table_entry(entry)}  # {model}", flush=True)
            if cuda:
                print(f"  the CUDA GEMV: {total[cuda[0]]:.1f} us against that entry's {total[entry]:.1f}", flush=True)
        elif best.startswith("dequantize"):
            print(f"DEQUANTIZE_ROWS <= {m}  # {model}: W de-quantized then cuBLAS is the fastest", flush=True)
        elif best.startswith("tiles") and code != "int4":
            print(f"TILES_BLOCKS[{code!r}][{P.dot_block(m).m}] = {table_entry(best)}  # {model}, {m} rows", flush=True)
        elif code == "int4":
            print(f"WORDS_GEMM_BLOCKS[{min(128, 1 << (m - 1).bit_length())}] = {table_entry(best)}  # {model}, "
                  f"{m} rows", flush=True)
        previous = [label(P.dot_block(m))] if m > P.GEMV_ROWS else []
        for b in dict.fromkeys(["default", HALVES, *previous, *cuda, TINYGEMM, SCALED_MM, best]):
            if b not in full:
                continue
            v = full[b]
            out.append({"model": f"{model}-shape", "code": code, "rows": m, "block": b,
                        "us": sum(r["us"] for r in v), "floor_us": sum(r["floor_us"] for r in v),
                        "x_floor": sum(r["us"] for r in v) / max(sum(r["floor_us"] for r in v), 1e-9),
                        "bf16_us": sum(r["bf16_us"] for r in v)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-8b,llama-70b")
    ap.add_argument("--rows", default="1,2,4,64")
    ap.add_argument("--codes", default="int4,fp8")
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="start no new matrix after this many seconds (the results so far are written)")
    args = ap.parse_args()
    start = time.perf_counter()
    assert torch.cuda.is_available(), "tune_packed times CUDA kernels"
    bandwidth = measure_copy_bandwidth_gbps("cuda")
    print(f"copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    rows, codes = [int(r) for r in args.rows.split(",")], args.codes.split(",")
    results: list[dict[str, Any]] = []
    for model in args.models.split(","):
        for name, (n, k) in matrices(model).items():
            if name != "head" and time.perf_counter() - start < args.budget_s:
                results += tune_matrix(model, name, n, k, codes, rows, bandwidth)
    totals = [s for model in args.models.split(",") for s in summary(results, model)]
    print_table(totals)
    path = write_results("tune_packed", [{"system": "structgen", "metric": "us", "value": r["us"], **r}
                                         for r in results], extra={"bandwidth_gbs": bandwidth, "summary": totals})
    print("wrote", path)
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)


if __name__ == "__main__":
    main()
