"""The decode attention kernel over the paged cache at the row mixes a serving step runs,
for every split rule of a sweep (`kernels/decode_attention.SPLITS`).

Prompt rows run in the decode graphs as one row a token, each attending up to its own
position, so an agent turn's tail over a 3k-token cached tool catalogue is ~30 rows that each
walk 3k keys: how many programs share those keys decides whether the step is latency-bound.
Each case is timed replayed in a CUDA graph (`triton.testing.do_bench_cudagraph`).

    python -m benchmarks.profile_decode_attention
    python -m benchmarks.profile_decode_attention --out /tmp/attention.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import torch

from structgen.engine.kernels import decode_attention as attention

PAGE = 16
MAX_SEQ_LEN = 4096
# (name, [(rows of one sequence, its first row's context length)] per sequence)
CASES: dict[str, list[tuple[int, int]]] = {
    "agent decode, 1 row": [(1, 2950)],
    "agent prompt tail, 32 rows": [(32, 2921)],
    "agent Poisson: a tail + 16 decode rows": [(30, 2921)] + [(1, 2990)] * 16,
    "16 decode rows, 3k keys": [(1, 2990)] * 16,
    "json burst, 256 rows, 100 keys": [(1, 100)] * 256,
    "json decode, 64 rows, 100 keys": [(1, 100)] * 64,
    "json prompts, 256 rows of 8 prompts": [(32, 16)] * 8,
    "256 decode rows, 3k keys": [(1, 2990)] * 256,
}
DEFAULT = attention.SPLITS
RULES = [attention.SplitRule(p, 32, k) for p, k in itertools.product((2, 4, 8, 16), (32, 128, 256))]


def case_tensors(seqs: list[tuple[int, int]], heads: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """q, the K/V page pools, the page table and each row's slot and context length (its own
    position + 1) for sequences of (rows, first context length)."""
    dev = torch.device("cuda")
    per_slot = MAX_SEQ_LEN // PAGE
    pool_pages = len(seqs) * per_slot
    k = torch.randn(pool_pages, PAGE, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(pool_pages, device=dev).view(len(seqs), per_slot)
    slots = torch.tensor([s for s, (rows, _) in enumerate(seqs) for _ in range(rows)], device=dev, dtype=torch.int32)
    lens = torch.tensor([ctx + j for rows, ctx in seqs for j in range(rows)], device=dev, dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, device=dev, dtype=torch.bfloat16)
    return q, k, v, table, slots, lens


def time_case(seqs: list[tuple[int, int]], rule: attention.SplitRule, shape: tuple[int, int, int]) -> dict[str, Any]:
    from triton.testing import do_bench_cudagraph

    tensors = case_tensors(seqs, *shape)
    attention.SPLITS = rule
    try:
        attention.decode_attention(*tensors)  # compile outside the graph
        us = 1e3 * do_bench_cudagraph(lambda: attention.decode_attention(*tensors), rep=50)
        splits, _ = attention.split_plan(len(tensors[0]), shape[1], MAX_SEQ_LEN, tensors[0].device)
    finally:
        attention.SPLITS = DEFAULT
    return {"programs_per_sm": rule.programs_per_sm, "min_keys": rule.min_keys, "splits": splits, "us": round(us, 2)}



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="9,3,64", help="query heads, KV heads, head dim (SmolLM2's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    rows = []
    for name, seqs in CASES.items():
        timed = [time_case(seqs, rule, shape) for rule in RULES]
        best = min(timed, key=lambda r: r["us"])
        now = next(r for r in timed if r["programs_per_sm"] == DEFAULT.programs_per_sm and r["min_keys"] == DEFAULT.min_keys)
        print(f"{name:42s} now {now['us']:7.1f} us ({now['splits']} splits)   best {best['us']:7.1f} us "
              f"({best['programs_per_sm']}/SM, >= {best['min_keys']} keys, {best['splits']} splits)   "
              + " ".join(f"{r['programs_per_sm']}/{r['min_keys']}:{r['us']:.1f}" for r in timed), flush=True)
        rows.append({"case": name, "shape": shape, "timings": timed})
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
