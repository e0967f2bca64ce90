"""Per projection matrix of real model shapes, 1-16 rows: cuBLAS against the Triton forms
`kernels/gemv.py` chooses from (the GEMV summing per chunk or late, the skinny `tl.dot` GEMM),
each at its best block shape. This is the sweep behind `gemv.CONFIGS`, `MULTI_ROW` and `DOT`;
`bench_forward` shows what the choice does to a whole forward.

Times are `gemv.time_cold` (L2 flushed before each call, the device asleep while the host
queues them; every candidate timed twice, the better kept), in microseconds.

    python -m benchmarks.bench_gemv [--models smollm2-135m,llama-1b,llama-8b] [--rows 1,2,4,8,16]

Writes benchmarks/results/gemv-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import model_config, print_table, write_results
from structgen.engine.kernels import gemv as G

MODELS = ("smollm2-135m", "llama-1b", "llama-8b")


def matrices(model: str) -> dict[str, tuple[int, int]]:
    """(out features, in features) of each projection of one layer, and the LM head."""
    c = model_config(model)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
            "head": (c.vocab_size, c.hidden_size)}


def sweep(n: int, k: int, rows: int, device: torch.device) -> dict[str, Any]:
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    ref = F.linear(x, w).float()
    blocks = [*G.CONFIGS, *(b._replace(form="late") for b in G.CONFIGS)] if rows == 1 else []
    blocks += [*(G.MULTI_ROW if 1 < rows <= G.GEMV_ROWS else ()), *(G.DOT if rows > 1 else ())]

    def run(b: G.Block | None) -> torch.Tensor:
        return F.linear(x, w) if b is None else G.gemv(x, w, block=b)

    right = [b for b in blocks if G._computes(run, b, ref)]
    times = G.time_all(run, [None, *right], device)
    out: dict[str, Any] = {"cublas_us": round(times[None] * 1e3, 2)}
    for form in ("chunk", "late", "dot"):
        best = min((b for b in right if b.form == form), key=times.__getitem__, default=None)
        out[f"{form}_us"] = round(times[best] * 1e3, 2) if best is not None else None
        out[f"{form}_block"] = list(best[:4]) if best is not None else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA device")
    device = torch.device("cuda")
    rows_out: list[dict[str, Any]] = []
    for model in args.models.split(","):
        for name, (n, k) in matrices(model).items():
            for rows in (int(r) for r in args.rows.split(",")):
                r = {"model": f"{model}-shape", "matrix": name, "n": n, "k": k, "rows": rows, **sweep(n, k, rows, device)}
                rows_out.append(r)
                print(r, flush=True)
    print(f"\ndevice: {torch.cuda.get_device_name()}")
    print_table([{k: r[k] for k in ("model", "matrix", "rows", "cublas_us", "chunk_us", "late_us", "dot_us")}
                 for r in rows_out])
    if not args.no_write:
        print("wrote", write_results("gemv", rows_out, extra={"timing": "gemv.time_cold, L2 flushed, best of two"}))


if __name__ == "__main__":
    main()
