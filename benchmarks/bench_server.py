"""Server load test: N concurrent clients send JSON-schema chat requests to a real structgen
server on loopback; every request must come back 200 with output that validates.

    python -m benchmarks.bench_server                  # starts the default model, CPU
    python -m benchmarks.bench_server --url http://127.0.0.1:8000/v1 --model NAME

Records p50/p99 latency, requests/s and output tokens/s, failures (non-200 / transport
errors / invalid JSON) and lost requests (no answer at all), in
benchmarks/results/server-<device>-<date>.json; then the same kind of requests in-process
through `LLM.acomplete` with the same concurrency (system "structgen-inprocess"), so the
server's own overhead can be read off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx
import jsonschema

from benchmarks.common import print_table, write_results
from structgen_server.process import ServerProcess

# Small extraction schemas with bounded fields, so outputs finish within a small max_tokens.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Tokyo", "Lima"]}, "sunny": {"type": "boolean"}},
     "required": ["city", "sunny"], "additionalProperties": False},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}, "score": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["sentiment", "score"], "additionalProperties": False},
]
PROMPTS = [
    "{i}: Extract the person: Alice Smith, 34 years old.",
    "{i}: Weather report for Tokyo: clear skies all day.",
    "{i}: Review: 'the soup was cold but the staff were lovely'. Rate it.",
]


async def run_load(url: str, model: str, n_requests: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Send `n_requests` from `concurrency` workers; return latencies and counts."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n_requests):
        queue.put_nowait(i)
    latencies: list[float] = []
    failures: list[str] = []
    outcomes: dict[int, str] = {}  # request -> "ok" | "truncated" | "failed"; missing = lost
    tokens = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:

        async def worker() -> None:
            nonlocal tokens
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                k = i % len(SCHEMAS)
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": PROMPTS[k].format(i=i)}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": SCHEMAS[k], "strict": True}},
                    "max_tokens": max_tokens,
                    "temperature": 0,
                }
                t0 = time.perf_counter()
                try:
                    r = await client.post("/chat/completions", json=body)
                except httpx.HTTPError as e:
                    failures.append(f"{i}: {type(e).__name__}: {e}")
                    outcomes[i] = "failed"
                    continue
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    failures.append(f"{i}: HTTP {r.status_code} {r.text[:200]}")
                    outcomes[i] = "failed"
                    continue
                data = r.json()
                tokens += data["usage"]["completion_tokens"]
                choice = data["choices"][0]
                if choice["finish_reason"] == "length":
                    outcomes[i] = "truncated"  # a valid prefix cut by max_tokens, as asked
                    continue
                try:
                    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[k])
                    outcomes[i] = "ok"
                except (ValueError, jsonschema.ValidationError) as e:
                    failures.append(f"{i}: invalid output {choice['message']['content']!r}: {e}")
                    outcomes[i] = "failed"

        t_start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t_start
    return {
        "latencies": latencies, "failures": failures, "lost": n_requests - len(outcomes),
        "truncated": sum(v == "truncated" for v in outcomes.values()), "tokens": tokens, "wall_s": wall,
    }


async def run_inprocess(llm: Any, n_requests: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    """The same requests through `LLM.acomplete` in this process, `concurrency` at a time (what
    the server does per HTTP request): the engine's own figures, so the difference from
    `run_load` is the cost of HTTP, JSON and the server."""
    from structgen.errors import IncompleteOutputError
    from structgen.types import JsonSchema

    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(i: int) -> int:
        k = i % len(SCHEMAS)
        async with sem:
            t0 = time.perf_counter()
            try:
                c = await llm.acomplete(JsonSchema(SCHEMAS[k]), [{"role": "user", "content": PROMPTS[k].format(i=i)}],
                                        max_tokens=max_tokens, temperature=0)
                n = c.stats.output_tokens
            except IncompleteOutputError as e:
                n = len(e.token_ids)
            latencies.append(time.perf_counter() - t0)
            return n

    t_start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(n_requests))))
    return {"latencies": latencies, "tokens": tokens, "wall_s": time.perf_counter() - t_start}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _rows(common: dict[str, Any], res: dict[str, Any]) -> list[dict[str, Any]]:
    lat = res["latencies"]
    return [
        {**common, "metric": "p50_ms", "value": round(percentile(lat, 0.50) * 1e3, 1)},
        {**common, "metric": "p99_ms", "value": round(percentile(lat, 0.99) * 1e3, 1)},
        {**common, "metric": "latency_ms", "value": round(statistics.mean(lat) * 1e3, 1)},
        {**common, "metric": "requests_per_s", "value": round(len(lat) / res["wall_s"], 2)},
        {**common, "metric": "tokens_per_s", "value": round(res["tokens"] / res["wall_s"], 1)},
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="an already running server's /v1 URL (default: start one)")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--device", default=None, help="for a started server: cpu or cuda")
    ap.add_argument("--inprocess", type=int, default=128,
                    help="also run this many of the requests in-process via LLM.acomplete (0: skip)")
    args = ap.parse_args()

    server = None
    if args.url is None:
        extra = ["--device", args.device] if args.device else []
        server = ServerProcess([*extra, "--max-batch-size", str(args.concurrency), "--max-seq-len", "1024",
                                "--log-level", "warning"]).start()
    url = args.url or server.url
    try:
        asyncio.run(run_load(url, args.model, min(args.concurrency, 8), args.concurrency, args.max_tokens))  # warm-up
        res = asyncio.run(run_load(url, args.model, args.requests, args.concurrency, args.max_tokens))
    finally:
        if server is not None:
            server.stop()

    common = {"model": "smollm2-135m", "batch": args.concurrency, "constrained": True, "max_tokens": args.max_tokens}
    rows = _rows({**common, "system": "structgen", "requests": args.requests}, res)
    rows.append({**common, "system": "structgen", "requests": args.requests, "metric": "errors",
                 "value": len(res["failures"]), "lost": res["lost"], "truncated": res["truncated"]})
    if args.inprocess:
        import structgen

        llm = structgen.LLM(config=structgen.EngineConfig(device=args.device, max_batch_size=args.concurrency, max_seq_len=1024))
        asyncio.run(run_inprocess(llm, min(args.concurrency, 8), args.concurrency, args.max_tokens))  # warm-up
        ref = asyncio.run(run_inprocess(llm, args.inprocess, args.concurrency, args.max_tokens))
        rows += _rows({**common, "system": "structgen-inprocess", "requests": args.inprocess}, ref)
    print_table(rows)
    for f in res["failures"][:10]:
        print("FAILED", f)
    path = write_results("server", rows, extra={"settings": {**vars(args), "wall_s": round(res["wall_s"], 2)}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
