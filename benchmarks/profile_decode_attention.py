"""The decode attention kernel alone, with its cascade over a shared prefix on and off.

The rows a graph step runs: prompt tails of 25 rows (2, 10 and 40 sequences: a turn's tail, a
few turns', a burst's prompt step) and 256 one-row decode steps, over contexts of 60 tokens
(short prompts: no shared prefix, so "on" shows the cascade's cost where it cannot help) and
3,000 whose leading pages every sequence shares (an agent's cached tool catalogue). "on" passes
the prefix the engine's rule picks (attention.cascade_prefix: the shared whole pages before
every row, 0 below CASCADE_MIN_KEYS), "off" passes none (the kernel as before the cascade).
Each is timed alone in a CUDA graph (bench_kernels.graph_time_us), per call = per layer; "err"
is on against off (relative, bf16), which must stay within the kernel tests' 1e-2.

    python -m benchmarks.profile_decode_attention                   # SmolLM2: 9 q / 3 kv heads, dim 64
    python -m benchmarks.profile_decode_attention --heads 32 --kv-heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.bench_kernels import graph_time_us
from benchmarks.common import device_name, print_table
from structgen.engine.attention import CASCADE_MIN_KEYS, CASCADE_MIN_ROWS
from structgen.engine.kernels.decode_attention import decode_attention

PAGE = 16
LAYOUTS = ((2, 25), (10, 25), (40, 25), (256, 1))  # (sequences, rows each)
CONTEXTS = (60, 3000)


def layout(seqs: int, rows: int, ctx: int, kv_heads: int, dim: int, max_seq_len: int):
    """(k, v, table, slots, lens, shared keys): `seqs` sequences whose last `rows` positions end
    at `ctx`, their whole pages before the first row one set of pages, the rest their own."""
    per_seq = max_seq_len // PAGE
    common = (ctx - rows) // PAGE
    own = -(-ctx // PAGE) - common
    table = torch.zeros(seqs, per_seq, dtype=torch.long)
    table[:, :common] = torch.arange(1, common + 1)
    table[:, common : common + own] = torch.arange(common + 1, common + 1 + seqs * own).view(seqs, own)
    pages = common + 1 + seqs * own
    k = torch.randn(pages, PAGE, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    slots = torch.arange(seqs).repeat_interleave(rows)
    lens = (torch.arange(ctx - rows, ctx) + 1).repeat(seqs)
    return k, v, table.cuda(), slots.cuda(), lens.cuda(), common * PAGE


def on_and_off(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
               lens: torch.Tensor, prefix: int) -> dict:
    """us per call with the cascade over `prefix` keys and without, and their relative difference."""
    on = functools.partial(decode_attention, q, k, v, table, slots, lens,
                           prefix_len=torch.tensor([prefix], device="cuda"))
    off = functools.partial(decode_attention, q, k, v, table, slots, lens)
    want, got = off().double(), on().double()
    err = float((got - want).norm() / want.norm())
    t_off, t_on = graph_time_us(off), graph_time_us(on)
    return {"off_us": t_off, "on_us": t_on, "speedup": t_off / t_on, "err": err, "ok": err < 1e-2}


def profile(heads: int, kv_heads: int, dim: int, max_seq_len: int) -> list[dict]:
    out = []
    for ctx in CONTEXTS:
        for seqs, rows in LAYOUTS:
            k, v, table, slots, lens, common = layout(seqs, rows, ctx, kv_heads, dim, max_seq_len)
            n = seqs * rows
            prefix = common if common >= CASCADE_MIN_KEYS and n >= CASCADE_MIN_ROWS else 0  # the engine's rule
            q = torch.randn(n, heads, dim, dtype=torch.bfloat16, device="cuda")
            out.append({"rows": f"{n} ({seqs} x {rows})", "ctx": ctx, "prefix": prefix,
                        **on_and_off(q, k, v, table, slots, lens, prefix)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=4096, help="the page table's width (EngineConfig)")
    args = ap.parse_args()
    print(f"{device_name()}: {args.heads} q heads, {args.kv_heads} kv heads, head_dim {args.head_dim}, "
          f"page {PAGE}, bf16; us per call (one layer)")
    rows = profile(args.heads, args.kv_heads, args.head_dim, args.max_seq_len)
    print_table(rows)
    if not all(r["ok"] for r in rows):
        raise SystemExit("cascade on and off disagree")


if __name__ == "__main__":
    main()
