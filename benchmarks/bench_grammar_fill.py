"""Mask fills of a batch of xgrammar matchers: row by row from Python, xgrammar's batch call,
and `grammar.native`'s pool at several thread counts. Host-only (no GPU needed); run it on
the lent GPU host to see what its cores give.

Rows are JSON matchers of bench_decode's schema, advanced along a valid instance: "spread"
puts row i at token i * len / rows of it (a batch at many points of its outputs), "string"
puts every row at the same point inside a string value (a lock-step batch: bench_decode's
rows all decode the same prompt greedily).

    python -m benchmarks.bench_grammar_fill [--rows 8,64] [--threads 1,2,4,8] [--tokenizer-dir D]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xgrammar as xgr

from benchmarks.bench_decode import SCHEMA
from benchmarks.common import print_table, write_results
from benchmarks.profile_host import INSTANCE
from structgen.engine.models.loader import load_tokenizer, resolve_model
from structgen.grammar import JSON_SEPARATORS, allocate_bitmask, native


def matchers(compiled: xgr.CompiledGrammar, ids: list[int], rows: int, layout: str) -> list[xgr.GrammarMatcher]:
    out = []
    for i in range(rows):
        m = xgr.GrammarMatcher(compiled)
        k = (i * len(ids)) // rows if layout == "spread" else 5  # 5: inside the "name" string
        for t in ids[:k]:
            assert m.accept_token(t)
        out.append(m)
    return out


def timed_us(f: Callable[[], None], n: int = 300) -> float:
    """Median of 5 runs of n calls, microseconds a call."""
    f()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            f()
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,64")
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--tokenizer-dir", type=Path, default=None)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.tokenizer_dir or resolve_model(progress=False))
    vocab = 49152
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=False)
    ids = tokenizer.encode(json.dumps(INSTANCE, separators=JSON_SEPARATORS), add_special_tokens=False)
    pool = native.load()
    rows_out: list[dict[str, Any]] = []
    for n in [int(r) for r in args.rows.split(",")]:
        for layout in ("spread", "string"):
            ms = matchers(compiled, ids, n, layout)
            bitmask = allocate_bitmask(n, vocab, host_only=True)
            handles = [native.handle(m) for m in ms]
            rows = list(range(n))

            def row_by_row(ms: list = ms, bitmask=bitmask) -> None:
                for i, m in enumerate(ms):
                    m.fill_next_token_bitmask(bitmask, i)

            batch = xgr.BatchGrammarMatcher(1)
            results = {"python, row by row": timed_us(row_by_row),
                       "xgrammar batch, 1 thread": timed_us(lambda b=batch, ms=ms, bm=bitmask: b.batch_fill_next_token_bitmask(ms, bm))}
            reference = bitmask.clone()
            if pool is not None:
                for t in [int(x) for x in args.threads.split(",")]:
                    pool.set_threads(t)
                    bitmask.fill_(0)
                    pool.fill(handles, bitmask, rows)
                    assert bitmask.equal(reference), "native fill differs from xgrammar's"
                    results[f"native pool, {t} threads"] = timed_us(lambda h=handles, bm=bitmask, r=rows: pool.fill(h, bm, r))
                pool.set_threads(native.default_threads())
            for system, us in results.items():
                rows_out.append({"system": system, "rows": n, "layout": layout, "metric": "us_per_fill", "value": round(us, 1)})
                print(rows_out[-1], flush=True)
    print(f"\nhost: {os.cpu_count()} cores")
    print_table(rows_out)
    if not args.no_write:
        print("wrote", write_results("grammar-fill", rows_out, extra={
            "cpu_count": os.cpu_count(), "default_threads": native.default_threads(),
            "note": "host microseconds per batch mask fill (median of 5 x 300); bench_decode's JSON schema"}))


if __name__ == "__main__":
    main()
