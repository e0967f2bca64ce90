"""Server load test: N concurrent clients send JSON-schema chat requests to a real structgen
server on loopback; every request must come back 200 with output that validates.

    python -m benchmarks.bench_server                  # starts the default model, CPU
    python -m benchmarks.bench_server --url http://127.0.0.1:8000/v1 --model NAME

Records p50/p99 latency, requests/s and output tokens/s, failures (non-200 / transport
errors / invalid JSON) and lost requests (no answer at all), in
benchmarks/results/server-<device>-<date>.json; then the same kind of requests in-process
through `LLM.acomplete` with the same concurrency (system "structgen-inprocess"), so the
server's own overhead can be read off.

    python -m benchmarks.bench_server --adversarial [--requests 500] [--attack-scale 1.0]

runs the good clients twice on one server: alone, then while a second set of clients sends the
worst requests (`benchmarks/server_attacks.py`: huge prompts, n=16 fan-out over many prompts,
a 20,000-value enum, a 300-deep schema, a self-referential one, half-open connections, streams
left after one chunk). It records both runs' p50/p99, lost requests, what the bad requests got
back and the server's peak RSS, in benchmarks/results/server_adversarial-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from typing import Any

import httpx
import jsonschema

from benchmarks.common import print_table, write_results
from benchmarks.server_attacks import attack_process
from structgen_server.process import ServerProcess, cap_address_space

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


async def run_load(url: str, model: str, n_requests: int, concurrency: int, max_tokens: int,
                   timeout_s: float = 600.0) -> dict[str, Any]:
    """Send `n_requests` from `concurrency` workers; return latencies and counts (a request with
    no answer within `timeout_s`, or none at all, is lost)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n_requests):
        queue.put_nowait(i)
    latencies: list[float] = []
    failures: list[str] = []
    outcomes: dict[int, str] = {}  # request -> "ok" | "truncated" | "failed" | "lost"; missing = lost
    tokens = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout_s) as client:

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
                    outcomes[i] = "lost"
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
        "latencies": latencies, "failures": failures,
        "lost": n_requests - len(outcomes) + sum(v == "lost" for v in outcomes.values()),
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
    if not lat:  # every request lost: no latency to report
        return [{**common, "metric": m, "value": None} for m in ("p50_ms", "p99_ms", "latency_ms")]
    return [
        {**common, "metric": "p50_ms", "value": round(percentile(lat, 0.50) * 1e3, 1)},
        {**common, "metric": "p99_ms", "value": round(percentile(lat, 0.99) * 1e3, 1)},
        {**common, "metric": "latency_ms", "value": round(statistics.mean(lat) * 1e3, 1)},
        {**common, "metric": "requests_per_s", "value": round(len(lat) / res["wall_s"], 2)},
        {**common, "metric": "tokens_per_s", "value": round(res["tokens"] / res["wall_s"], 1)},
    ]


# Seconds the attacks run before the good clients start, so that they meet a server under attack.
ATTACK_HEAD_START_S = 5.0


async def run_adversarial(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The good clients' load while a process of attackers (`server_attacks.attack_process`)
    sends the worst requests alongside."""
    ctx = multiprocessing.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    attackers = ctx.Process(target=attack_process, args=(url, model, args.attack_scale, stop, results))
    attackers.start()
    await asyncio.sleep(ATTACK_HEAD_START_S)
    try:
        res = await run_load(url, model, args.requests, args.concurrency, args.max_tokens, args.timeout)
    finally:
        stop.set()
        attacks = await asyncio.to_thread(results.get, True, 60)
        attackers.join(10)
    return {**res, "attacks": attacks}


def proc_status_mb(pid: int, field: str) -> float | None:
    """A `/proc/<pid>/status` memory field (VmHWM: peak RSS, VmRSS: now) in MB; None elsewhere."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(f"{field}:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="an already running server's /v1 URL (default: start one)")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--device", default=None, help="for a started server: cpu or cuda")
    ap.add_argument("--inprocess", type=int, default=128,
                    help="also run this many of the requests in-process via LLM.acomplete (0: skip)")
    ap.add_argument("--adversarial", action="store_true",
                    help="a clean run, then the same load beside the worst requests (server_attacks.py)")
    ap.add_argument("--attack-scale", type=float, default=1.0,
                    help="size of the bad requests (prompt bytes, enum values, fan-out prompts) x this")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds before a good request counts as lost")
    ap.add_argument("--server-pid", type=int, help="with --url: the server's pid, for its peak RSS")
    ap.add_argument("--server-memory-gb", type=float, default=None,
                    help="address space a started server may add to what it holds once up, so that a "
                         "runaway request cannot take the host (default 6 on CPU; none on CUDA, whose "
                         "driver maps more as it goes)")
    ap.add_argument("--max-client-errors", type=int, default=None,
                    help="a started server's --max-client-errors (default: the server's default)")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    return ap.parse_args()


def main() -> None:
    args = _parse_args()
    server = None
    if args.url is None:
        extra = ["--device", args.device] if args.device else []
        if args.max_client_errors is not None:
            extra += ["--max-client-errors", str(args.max_client_errors)]
        server = ServerProcess([*extra, "--max-batch-size", str(args.concurrency), "--max-seq-len", "1024",
                                "--log-level", "warning"]).start()
        headroom_gb = args.server_memory_gb if args.server_memory_gb is not None else 0 if args.device == "cuda" else 6
        if headroom_gb > 0:
            cap_address_space(server.proc.pid, int(headroom_gb * 2**30))
    url = args.url or server.url
    pid = server.proc.pid if server is not None else args.server_pid
    try:
        asyncio.run(run_load(url, args.model, min(args.concurrency, 8), args.concurrency, args.max_tokens))  # warm-up
        res = asyncio.run(run_load(url, args.model, args.requests, args.concurrency, args.max_tokens,
                                   args.timeout))
        if args.adversarial:
            rss_before = proc_status_mb(pid, "VmRSS") if pid else None
            bad = asyncio.run(run_adversarial(url, args.model, args))
            memory = {"rss_before_attacks_mb": rss_before,
                      "peak_rss_mb": proc_status_mb(pid, "VmHWM") if pid else None,
                      "server_alive": server is None or server.proc.poll() is None}
    finally:
        if server is not None:
            server.stop()

    common = {"model": "smollm2-135m", "batch": args.concurrency, "constrained": True, "max_tokens": args.max_tokens}
    if args.adversarial:
        common = {**common, "system": "structgen", "requests": args.requests}
        rows = adversarial_rows(common, res, bad, memory)
        print_table(rows)
        print("bad requests' outcomes:", json.dumps(bad["attacks"], indent=1))
        _finish("server_adversarial", rows, [*res["failures"], *bad["failures"]], args,
                {"attacks": bad["attacks"], **memory})
        return
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
    _finish("server", rows, res["failures"], args, {"wall_s": round(res["wall_s"], 2)})


def adversarial_rows(common: dict[str, Any], clean: dict[str, Any], bad: dict[str, Any],
                     memory: dict[str, Any]) -> list[dict[str, Any]]:
    """p50/p99 and errors of the good clients alone and under attack, their p99 ratio, and the
    server's memory."""
    rows = []
    for load, res in (("clean", clean), ("adversarial", bad)):
        rows += [{**r, "load": load} for r in _rows(common, res) if r["metric"] in ("p50_ms", "p99_ms")]
        rows.append({**common, "load": load, "metric": "errors", "value": len(res["failures"]),
                     "lost": res["lost"], "truncated": res["truncated"]})
    p99 = {r["load"]: r["value"] for r in rows if r["metric"] == "p99_ms"}
    ratio = p99["adversarial"] / p99["clean"] if p99["adversarial"] and p99["clean"] else None
    rows.append({**common, "load": "adversarial", "metric": "p99_vs_clean",
                 "value": ratio and round(ratio, 2)})
    rows.append({**common, "load": "adversarial", "metric": "peak_rss_mb", "value": memory["peak_rss_mb"],
                 "server_alive": memory["server_alive"]})
    return rows


def _finish(benchmark: str, rows: list[dict[str, Any]], failures: list[str], args: argparse.Namespace,
            settings: dict[str, Any]) -> None:
    for f in failures[:10]:
        print("FAILED", f)
    if args.no_write:
        return
    path = write_results(benchmark, rows, extra={"settings": {**vars(args), **settings}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
