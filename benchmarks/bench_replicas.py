"""Data-parallel throughput: one JSON workload over HTTP against `structgen serve` (one engine)
and against `structgen serve --data-parallel N` (N engines behind one front end, one GPU
each), in the same run; output tokens/s of each, their ratio, and lost requests.

The workload is bench_serving's `json` (MaskBench schemas) where its data is present, else
extraction requests of the 64-request JSON workload (bench_decode's `end_to_end`) repeated to
`--requests`. Closed loop: every request is sent at once, after a warm-up of each server.

    python -m benchmarks.bench_replicas --replicas 2 --requests 256
    python -m benchmarks.bench_replicas --device cpu --model DIR --replicas 2 --requests 8   # dry run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_decode import CITIES, E2E_SCHEMA, NAMES
from benchmarks.bench_serving import ServingRequest, drive, http_runner, json_workload, summarize
from benchmarks.common import maskbench_dir, print_table, write_results

SERVED_NAME = "bench"


def workload(n: int) -> tuple[str, list[ServingRequest]]:
    """(its name, `n` requests)."""
    data = maskbench_dir()
    if (data / "JME.jsonl").is_file():
        return "maskbench-json", json_workload(n, data)
    requests = [ServingRequest([{"role": "user", "content": f"Extract the person as JSON: {NAMES[i % 8]} "
                                 f"{NAMES[(i // 8) % 8]}son is {20 + i % 50} years old and lives in "
                                 f"{CITIES[(i * 3) % 8]}."}], E2E_SCHEMA) for i in range(n)]
    return "extraction-json", requests


def serve_args(args: argparse.Namespace, replicas: int) -> list[str]:
    out = ["--served-model-name", SERVED_NAME, "--max-batch-size", str(args.max_batch_size),
           "--max-seq-len", "4096", "--log-level", "warning"]
    out += ["--data-parallel", str(replicas)] if replicas > 1 else []
    out += ["--device", args.device] if args.device else []
    return out + (["--model", str(args.model)] if args.model else [])


async def _run(url: str, requests: list[ServingRequest], args: argparse.Namespace):
    import httpx
    import openai

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0,
                                  http_client=httpx.AsyncClient(limits=limits, timeout=args.timeout)) as client:
        run = http_runner(client, SERVED_NAME, args.max_tokens)
        await drive(run, requests[: min(8, len(requests))], None, args.timeout)  # warm: compiles, graphs
        return await drive(run, requests, None, args.timeout)


def measure(replicas: int, requests: list[ServingRequest], args: argparse.Namespace) -> dict[str, Any]:
    """One server of `replicas` engines on the first `replicas` GPUs: the closed-loop figures."""
    from structgen_server.process import ServerProcess
    from structgen_server.replicas import visible_gpus

    gpus = visible_gpus() if args.device != "cpu" else []
    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus[:replicas])} if gpus else {}
    t0 = time.perf_counter()
    with ServerProcess(serve_args(args, replicas), startup_timeout=args.startup_timeout, env=env) as server:
        started = time.perf_counter() - t0
        figures = summarize(asyncio.run(_run(server.url, requests, args)))
    row = {"system": "structgen" if replicas == 1 else f"structgen-dp{replicas}", "replicas": replicas,
           "gpus": gpus[:replicas], "startup_s": round(started, 1), **figures}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch-size", type=int, default=128)
    ap.add_argument("--device", default=None)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the default model)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--startup-timeout", type=float, default=240.0)
    ap.add_argument("--dump", type=Path, default=None, help="also write the rows here after each server")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    name, requests = workload(args.requests)
    rows: list[dict[str, Any]] = []
    for replicas in (1, args.replicas):
        rows.append({"workload": name, "model": str(args.model or "smollm2-135m"), "metric": "tok_per_s",
                     **measure(replicas, requests, args)})
        rows[-1]["value"] = rows[-1]["tok_per_s"]
        if args.dump is not None:
            args.dump.write_text(json.dumps({"rows": rows}, default=str))
    speedup = rows[1]["tok_per_s"] / max(rows[0]["tok_per_s"], 1e-9)
    print_table([{k: r.get(k) for k in ("system", "replicas", "requests", "lost", "valid", "tok_per_s",
                                        "req_per_s", "ttft_p50_ms", "tpot_p50_ms")} for r in rows])
    print(f"DP {args.replicas} vs 1 replica: {speedup:.2f}x output tokens/s; lost requests "
          f"{[r['lost'] for r in rows]}")
    if not args.no_write:
        extra = {"speedup": round(speedup, 3), "settings": {k: str(v) for k, v in vars(args).items()}}
        print("wrote", write_results("replicas", rows, extra=extra))


if __name__ == "__main__":
    main()
