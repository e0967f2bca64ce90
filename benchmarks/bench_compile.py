"""Compile throughput for a burst of distinct JSON schemas: schemas compiled per second when N
different MaskBench schemas (JME, Glaiveai2K, Github_easy, as bench_serving's json workload)
arrive at once, through the API's async compile path (`LLM.aprepare`: the schema normalized
in a worker thread, then the compile gate and the compiler's own pool), with nothing cached.

No model runs: the LLM wraps a one-layer engine with the real vocabulary, so every figure is
host time (the machine's cores, not its GPU). A schema the compiler refuses counts as done
(its time is spent all the same) and is reported under `refused`.

    python -m benchmarks.bench_compile                  # 300 distinct schemas, one burst
    python -m benchmarks.bench_compile --n 1000 --serial   # also one at a time, same schemas
    python -m benchmarks.bench_compile --n 100 --threads 1,2   # and the compiler alone on 1, 2 threads

`--threads` adds rows without the API: `to_constraint`, `bound_integers` and `GrammarCompiler.compile` on
that many plain threads, xgrammar's own threads at one, so the rows say how compiles of
different schemas add up across cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_serving import JSON_CATEGORIES, _entries
from benchmarks.common import maskbench_dir, print_table, write_results


def distinct_schemas(n: int, data_dir: Path, max_schema_chars: int = 4_000) -> list[dict[str, Any]]:
    """Up to `n` different schemas, round robin over the categories."""
    pools = []
    for category in JSON_CATEGORIES:
        seen: dict[str, dict[str, Any]] = {}
        for entry in _entries(category, data_dir):
            text = json.dumps(entry["schema"], sort_keys=True)
            if len(text) <= max_schema_chars:
                seen.setdefault(text, entry["schema"])
        pools.append(list(seen.values()))
    out = []
    for i in range(max(len(p) for p in pools)):
        out += [p[i] for p in pools if i < len(p)]
    return out[:n]


async def _prepare(llm: Any, schema: dict[str, Any], errors: Counter[str]) -> float:
    from structgen import JsonSchema, StructgenError

    t = time.perf_counter()
    try:
        await llm.aprepare(JsonSchema(schema))
    except StructgenError as e:
        errors[type(e).__name__] += 1
    return time.perf_counter() - t


async def burst(llm: Any, schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """All `schemas` at once: wall time, schemas per second, per-schema latency."""
    errors: Counter[str] = Counter()
    cpu, t = time.process_time(), time.perf_counter()
    latencies = await asyncio.gather(*(_prepare(llm, s, errors) for s in schemas))
    wall = time.perf_counter() - t
    return _row("burst", len(schemas), wall, time.process_time() - cpu, latencies, errors)


async def one_at_a_time(llm: Any, schemas: list[dict[str, Any]]) -> dict[str, Any]:
    errors: Counter[str] = Counter()
    cpu, t = time.process_time(), time.perf_counter()
    latencies = [await _prepare(llm, s, errors) for s in schemas]
    wall = time.perf_counter() - t
    return _row("serial", len(schemas), wall, time.process_time() - cpu, latencies, errors)


def _row(mode: str, n: int, wall: float, cpu: float, latencies: list[float], errors: Counter[str]) -> dict[str, Any]:
    return {"system": "structgen", "mode": mode, "schemas": n, "metric": "schemas_per_s",
            "value": round(n / wall, 1), "wall_s": round(wall, 2), "cpu_per_wall": round(cpu / wall, 2),
            "p50_ms": round(1e3 * float(np.median(latencies)), 1),
            "p99_ms": round(1e3 * float(np.percentile(latencies, 99)), 1), "refused": dict(errors)}


def on_threads(tokenizer: Any, schemas: list[dict[str, Any]], workers: int) -> dict[str, Any]:
    """The compiler alone, fresh caches, on `workers` threads."""
    from structgen import JsonSchema, StructgenError
    from structgen.grammar import GrammarCompiler
    from structgen.grammar.digit_bounds import bound_integers
    from structgen.types import _cached_build, to_constraint

    _cached_build.cache_clear()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], threads=1, cache_size=len(schemas))
    errors: Counter[str] = Counter()

    def one(schema: dict[str, Any]) -> float:
        t = time.perf_counter()
        try:
            compiler.compile(bound_integers(to_constraint(JsonSchema(schema))))
        except StructgenError as e:
            errors[type(e).__name__] += 1
        return time.perf_counter() - t

    for name in ("xgrammar", "llguidance"):
        compiler.adapter(name)  # vocabulary tables built before the clock starts
    cpu, t = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        latencies = list(pool.map(one, schemas))
    wall = time.perf_counter() - t
    return _row(f"threads-{workers}", len(schemas), wall, time.process_time() - cpu, latencies, errors)


def new_llm() -> Any:
    """An LLM over a one-layer engine with the default model's vocabulary (fresh caches)."""
    from benchmarks.profile_host import tiny_engine
    from structgen import LLM
    from structgen.engine.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(progress=False))
    return LLM.from_engine(tiny_engine(tokenizer, 4), tokenizer, "stub")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300, help="distinct schemas in the burst")
    ap.add_argument("--serial", action="store_true", help="also compile them one at a time (a fresh LLM)")
    ap.add_argument("--threads", default="", help="comma-separated thread counts: the compiler alone (see above)")
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    logging.getLogger("structgen").setLevel(logging.ERROR)  # fallbacks to stricter schemas
    schemas = distinct_schemas(args.n, args.data_dir or maskbench_dir())
    rows = []
    if args.threads:
        from structgen.engine.models.loader import load_tokenizer, resolve_model

        tokenizer = load_tokenizer(resolve_model(progress=False))
        for workers in map(int, args.threads.split(",")):
            rows.append(on_threads(tokenizer, schemas, workers))
            print(rows[-1], flush=True)
    modes = [burst] + ([one_at_a_time] if args.serial else [])
    for mode in modes:
        llm = new_llm()
        try:
            rows.append(asyncio.run(mode(llm, schemas)))
        finally:
            llm.close()
        print(rows[-1], flush=True)
    print_table(rows)
    if not args.no_write:
        print("wrote", write_results("compile", rows, extra={
            "cpu_count": os.cpu_count(), "categories": list(JSON_CATEGORIES),
            "note": "distinct MaskBench schemas through LLM.aprepare, nothing cached; host time only"}))


if __name__ == "__main__":
    main()
