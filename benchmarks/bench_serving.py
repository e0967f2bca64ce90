"""Serving benchmark in the manner of vLLM's: many requests, closed and open loop, in process
and over HTTP with the official `openai` client (issue 30).

    python -m benchmarks.bench_serving --device cuda                      # everything
    python -m benchmarks.bench_serving --workloads json --modes inprocess --requests 64
    python -m benchmarks.bench_serving --workloads json-one --modes inprocess --arrivals closed --requests 256

Workloads:
- `json`: MaskBench JME, Glaiveai2K and Github_easy schemas (round robin), one extraction or
  form-filling prompt each, `response_format` = the schema;
- `agent`: every request shares one system prompt of about 3,000 tokens (a tool catalogue
  built from Glaiveai2K function schemas) and asks for a tool call (a JSON object naming one
  of the tools), as a function-calling agent's turns do;
- `agent-short`: the same turns and schema with a one-line system prompt, the baseline of
  issue 30's agent target (TTFT within 1.5x of it, concurrent and one at a time);
- `json-one`: issue 30's first target, every request with the same 5-field schema (a string,
  an integer, a number, a boolean and an enum: one compile, then cache hits) and its own short
  extraction prompt, so what is measured is decoding many streams, not compiling.

Arrivals: `closed` submits every request at once; `serial` sends them one at a time; a rate
(requests/s) sends them as a Poisson process. For each (workload, mode, arrival): output tokens/s, requests/s, TTFT and TPOT p50 /
p99, valid outputs (jsonschema), lost requests. The decode-step bound beside them is the
engine's constrained step at the run's batch size, measured in the same process
(on a GPU; `--no-bound` to skip): what the GPU allows if every step were full.

`--paired A,B[,C...] --bursts N` compares workloads in process, all at once, as issue 30's agent
target does (agent against agent-short): a cold burst of each, then N rounds of one warm burst
of each, the order reversed every other round, so that the host's drift between bursts (a third
of a burst's TTFT on the lent H200 hosts) falls on all alike; a row per workload holds the
median of each figure over its warm bursts (`bursts_ttft_p50_ms` lists them) and its share of
the decode-step bound, and A's row the ratio of its median TTFT p50 to B's (`ttft_p50_ratio`,
with each round's in `rounds_ttft_p50_ratio`), written to `serving_paired-<card>-<date>.json`.
The bound is measured after every round, on a twin engine of the same config in the same
process, and the share is the median tok/s against the median bound
(`rounds_decode_bound_tok_per_s` lists them): on the lent hosts one process's bound moved
from 61k to 100k tok/s between measurements seconds apart, apart from the bursts, so a bound
taken once set the share more than the bursts did. Before each burst and each bound a fixed
Python loop is timed (`host_speed_ms`, `bursts_host_speed_ms`, `rounds_bound_host_speed_ms`):
those hosts' single-core speed moves about 2x from one burst to the next, and the host-bound
figures with it. `--timeline` prints a line per warm burst on where its engine steps went
(benchmarks/step_timeline.py).
A third workload puts issue 30's two concurrent targets in one file from one process:

    python -m benchmarks.bench_serving --paired agent,agent-short,json-one --bursts 8 --requests 256 --max-tokens 128

Over HTTP the requests leave from `--http-clients` processes (default half the cores, at most
8; 1 sends them all from this one): the openai client spends 12-27 ms of CPU per streamed
request, more than the server (its httpx pool re-scans every connection on each request's
start and end, and pydantic builds every chunk), so from one process a burst of hundreds of
streams measures the client, and from 4 a burst of 1,000 was still paced by them (H200,
2026-11-29: TTFT p50 1.79 s from 4, 1.31 s from 8, the server unchanged). `client_cpu_ms_per_request`
says what the senders spent; each HTTP row names `http_clients`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import re
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import torch

from benchmarks.common import host_speed_ms, maskbench_dir, print_table, write_results
from benchmarks.step_timeline import StepTimeline

JSON_CATEGORIES = ("JME", "Glaiveai2K", "Github_easy")
CATALOGUE_TOKENS = 3_000


@dataclass(frozen=True)
class ServingRequest:
    messages: list[dict[str, str]]
    schema: dict[str, Any]


@dataclass
class Outcome:
    """What one request got: latency, time to first token, output tokens, validity."""

    latency_s: float = 0.0
    ttft_s: float = 0.0
    output_tokens: int = 0
    valid: bool = False
    incomplete: bool = False  # stopped at max_tokens before the output was complete
    error: str = ""
    refused: bool = False  # a clear refusal of the request's schema (400), not a lost request
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache held
    text: str = ""  # the output, validated once the run's clock has stopped (`drive`)
    # In process: the part of `ttft_s` after the request was built (prompt tokenized, grammar
    # compiled) and handed to the engine; the rest is the asyncio front's.
    engine_ttft_s: float | None = None
    # In process: the call to the engine request made (`front_s`), and the engine's finish to
    # the call's return (`delivery_s`): `ttft_s` (latency less decode) holds both.
    front_s: float | None = None
    delivery_s: float | None = None


@dataclass
class Results:
    """The rows so far, written out after each (a run cut short by a time limit keeps them)."""

    settings: dict[str, str]
    write: bool = True
    rows: list[dict[str, Any]] = field(default_factory=list)
    benchmark: str = "serving"  # the file's name; `--paired` writes its medians apart

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.write:
            write_results(self.benchmark, self.rows, extra={"settings": self.settings})


@dataclass
class RunResult:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    client_cpu_s: float | None = None  # HTTP: CPU time of the client process(es) during the run


# -- workloads ---------------------------------------------------------------------------------
def _entries(category: str, data_dir: Path) -> list[dict[str, Any]]:
    lines = (data_dir / f"{category}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _prompt(entry: dict[str, Any]) -> str:
    valid = [t["data"] for t in entry.get("tests", []) if t.get("valid")]
    if valid:  # an extraction: the reference instance rendered as text to read back
        facts = "; ".join(f"{k}: {v}" for k, v in valid[0].items()) if isinstance(valid[0], dict) else valid[0]
        return f"Extract the record as JSON from this text. {facts}"
    return f"Fill in this form as JSON. {entry.get('description') or 'Use plausible values.'}"


def json_workload(n: int, data_dir: Path, max_schema_chars: int = 4_000) -> list[ServingRequest]:
    """`n` requests, round robin over the categories' schemas (small enough for a prompt)."""
    pools = [[e for e in _entries(c, data_dir) if len(json.dumps(e["schema"])) <= max_schema_chars]
             for c in JSON_CATEGORIES]
    out = []
    for i in range(n):
        pool = pools[i % len(pools)]
        entry = pool[(i // len(pools)) % len(pool)]
        out.append(ServingRequest([{"role": "user", "content": _prompt(entry)}], entry["schema"]))
    return out


PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "height_m": {"type": "number"},
                   "member": {"type": "boolean"}, "tier": {"enum": ["bronze", "silver", "gold"]}},
    "required": ["name", "age", "height_m", "member", "tier"], "additionalProperties": False,
}
_NAMES = ("Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov", "Donald Knuth",
          "Frances Allen", "John Backus", "Margaret Hamilton", "Ken Thompson", "Radia Perlman")


def json_one_workload(n: int) -> list[ServingRequest]:
    """`n` extraction requests sharing PERSON_SCHEMA, each prompt a different person."""
    out = []
    for i in range(n):
        name, tier = _NAMES[i % len(_NAMES)], PERSON_SCHEMA["properties"]["tier"]["enum"][i % 3]
        text = (f"Extract the person as JSON. {name} is {20 + i % 60} years old and {1.5 + (i % 50) / 100:.2f} m "
                f"tall, {'a' if i % 2 else 'not a'} member, tier {tier}.")
        out.append(ServingRequest([{"role": "user", "content": text}], PERSON_SCHEMA))
    return out


def agent_workload(n: int, data_dir: Path, tokenizer: Any, catalogue: bool = True) -> list[ServingRequest]:
    """`n` tool-call turns sharing one system prompt: a catalogue of Glaiveai2K functions of
    about CATALOGUE_TOKENS tokens, or (`catalogue` False) one line."""
    tools, text = [], "You are an agent. Answer with a JSON tool call. Tools:\n"
    for i, entry in enumerate(_entries("Glaiveai2K", data_dir)):
        line = json.dumps({"name": f"tool_{i}", "parameters": entry["schema"]}) + "\n"
        if len(tokenizer.encode(text + line)) > CATALOGUE_TOKENS:
            break
        tools.append(f"tool_{i}")
        text += line
    schema = {"type": "object", "properties": {"name": {"enum": tools}, "arguments": {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
    if not catalogue:
        text = "You are an agent. Answer with a JSON tool call."
    return [ServingRequest([{"role": "system", "content": text},
                            {"role": "user", "content": f"Request {i}: call the tool that fits task {i}."}],
                           schema) for i in range(n)]


WORKLOADS = ("json", "json-one", "agent", "agent-short")  # by the names the options take


# -- runners -----------------------------------------------------------------------------------
def validate_outcomes(outcomes: list[Outcome], requests: list[ServingRequest]) -> None:
    """Set each complete outcome's `valid`, one validator per schema. After the run, not in
    it: in-process requests share the engine's process, and `jsonschema.validate` checks the
    schema itself on every call (milliseconds each), time the engine thread would lose."""
    validators: dict[str, Any] = {}
    for outcome, req in zip(outcomes, requests, strict=True):
        if outcome.error:
            continue
        key = json.dumps(req.schema, sort_keys=True)
        if key not in validators:
            validators[key] = jsonschema.validators.validator_for(req.schema)(req.schema)
        try:
            outcome.valid = validators[key].is_valid(json.loads(outcome.text))
        except (ValueError, jsonschema.SchemaError):
            outcome.valid = False


class RequestClock:
    """When each in-process call's engine request was made (prompt tokenized, grammar found),
    by the caller's task: a wrapper on the LLM instance's `_arequest` (as profile_host's
    FrontTimes), over the class's method so that runners never stack."""

    def __init__(self, llm: Any):
        self.made: dict[Any, float] = {}
        self._arequest = type(llm)._arequest.__get__(llm)
        llm._arequest = self.arequest

    async def arequest(self, *args: Any, **kwargs: Any) -> Any:
        out = await self._arequest(*args, **kwargs)
        self.made[asyncio.current_task()] = time.perf_counter()
        return out

    def split(self, t0: float, latency: float, stats: Any) -> dict[str, float | None]:
        """This task's front and delivery seconds (None where its request was never made)."""
        made = self.made.pop(asyncio.current_task(), None)
        if made is None:
            return {"front_s": None, "delivery_s": None}
        return {"front_s": made - t0, "delivery_s": latency - (made - t0) - stats.ttft_s - stats.decode_s}


def inprocess_runner(llm: Any, max_tokens: int) -> Callable[[ServingRequest], Awaitable[Outcome]]:
    from structgen import IncompleteOutputError, JsonSchema

    clock = RequestClock(llm)

    async def run(req: ServingRequest) -> Outcome:
        t0 = time.perf_counter()
        try:
            c = await llm.acomplete(JsonSchema(req.schema), req.messages, max_tokens=max_tokens, temperature=0.0)
        except IncompleteOutputError as exc:
            latency, st = time.perf_counter() - t0, exc.stats
            return Outcome(latency, latency - st.decode_s, st.output_tokens, incomplete=True, engine_ttft_s=st.ttft_s,
                           prompt_tokens=st.prompt_tokens, cached_tokens=st.cached_prompt_tokens,
                           **clock.split(t0, latency, st))
        latency, st = time.perf_counter() - t0, c.stats
        return Outcome(latency, latency - st.decode_s, st.output_tokens, prompt_tokens=st.prompt_tokens,
                       cached_tokens=st.cached_prompt_tokens, text=c.text, engine_ttft_s=st.ttft_s,
                       **clock.split(t0, latency, st))

    return run


def http_runner(client: Any, model: str, max_tokens: int) -> Callable[[ServingRequest], Awaitable[Outcome]]:
    async def run(req: ServingRequest) -> Outcome:
        t0, ttft, parts, tokens, finish, usage = time.perf_counter(), 0.0, [], 0, None, None
        stream = await client.chat.completions.create(
            model=model, messages=req.messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True},
            response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": req.schema}})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                usage, tokens = chunk.usage, chunk.usage.completion_tokens
        text = "".join(parts)
        details = getattr(usage, "prompt_tokens_details", None)
        return Outcome(time.perf_counter() - t0, ttft, tokens, incomplete=finish == "length", text=text,
                       prompt_tokens=usage.prompt_tokens if usage is not None else 0,
                       cached_tokens=(getattr(details, "cached_tokens", None) or 0) if details is not None else 0)

    return run


Arrival = float | str | None  # requests/s (Poisson), "serial" (one at a time) or None (all at once)


def _arrival(text: str) -> Arrival:
    return None if text == "closed" else text if text == "serial" else float(text)


def arrival_delays(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """When each of `n` requests is sent, in seconds from the start: all at once (`rate` None)
    or as a Poisson process of `rate` requests/s."""
    rng, delays, t = random.Random(seed), [], 0.0
    for _ in range(n):
        delays.append(t)
        t += rng.expovariate(rate) if rate else 0.0
    return delays


async def send_all(run: Callable[[ServingRequest], Awaitable[Outcome]], requests: list[ServingRequest],
                   delays: list[float] | None, timeout_s: float) -> list[Outcome]:
    """Each request sent `delays[i]` seconds from now, or (`delays` None) one at a time."""

    async def one(req: ServingRequest, delay: float) -> Outcome:
        await asyncio.sleep(delay)
        try:
            return await asyncio.wait_for(run(req), timeout_s)
        except Exception as exc:  # counted, and the run goes on
            return Outcome(error=f"{type(exc).__name__}: {str(exc)[:200]}", refused=_refusal(exc))

    if delays is None:
        return [await one(r, 0.0) for r in requests]
    return list(await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays, strict=True))))


async def drive(run: Callable[[ServingRequest], Awaitable[Outcome]], requests: list[ServingRequest],
                rate: Arrival, timeout_s: float, seed: int = 0) -> RunResult:
    """All requests at once (`rate` None), one at a time ("serial") or as a Poisson process
    of `rate` requests/s."""
    delays = None if rate == "serial" else arrival_delays(len(requests), rate if isinstance(rate, float) else None, seed)
    t0 = time.perf_counter()
    outcomes = await send_all(run, requests, delays, timeout_s)
    wall = time.perf_counter() - t0
    validate_outcomes(outcomes, requests)
    return RunResult(outcomes, wall)


def _refusal(exc: BaseException) -> bool:
    """The system said the request's schema cannot be served (a schema with no finite
    instance, one over a limit, one its grammar backend cannot enforce), in process or as a
    400 / 422: a clear answer, not a lost request."""
    from structgen.errors import InvalidConstraintError, UnsupportedSchemaError

    return (isinstance(exc, (InvalidConstraintError, UnsupportedSchemaError))
            or getattr(exc, "status_code", None) in (400, 422))


# -- figures -----------------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1)


def summarize(res: RunResult) -> dict[str, Any]:
    ok = [o for o in res.outcomes if not o.error]
    tokens = sum(o.output_tokens for o in ok)
    tpot = [(o.latency_s - o.ttft_s) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    prompt = sum(o.prompt_tokens for o in ok)
    return {
        "requests": len(res.outcomes), "refused": sum(o.refused for o in res.outcomes),
        "lost": sum(bool(o.error) and not o.refused for o in res.outcomes),
        "valid": sum(o.valid for o in ok), "invalid": sum(not o.valid for o in ok),
        "incomplete": sum(o.incomplete for o in ok), "output_tokens": tokens,
        "prefix_hit_rate": round(sum(o.cached_tokens for o in ok) / prompt, 3) if prompt else None,
        "tok_per_s": round(tokens / res.wall_s, 1), "req_per_s": round(len(ok) / res.wall_s, 2),
        "ttft_p50_ms": _pct([o.ttft_s for o in ok], 0.5), "ttft_p99_ms": _pct([o.ttft_s for o in ok], 0.99),
        "ttft_mean_ms": round(1e3 * statistics.fmean(o.ttft_s for o in ok), 1) if ok else None,
        "ttft_engine_p50_ms": _pct([o.engine_ttft_s for o in ok if o.engine_ttft_s is not None], 0.5),
        "front_p50_ms": _pct([o.front_s for o in ok if o.front_s is not None], 0.5),
        "delivery_p50_ms": _pct([o.delivery_s for o in ok if o.delivery_s is not None], 0.5),
        "tpot_p50_ms": _pct(tpot, 0.5), "tpot_p99_ms": _pct(tpot, 0.99),
        "mean_output_tokens": round(tokens / len(ok), 1) if ok else None,
        "client_cpu_ms_per_request": round(1e3 * res.client_cpu_s / len(res.outcomes), 2)
        if res.client_cpu_s is not None and res.outcomes else None,
        "first_errors": sorted({o.error for o in res.outcomes if o.error})[:3],
    }


def decode_bound_tok_per_s(llm: Any, batch: int) -> float:
    """Output tokens/s if every step ran `batch` constrained rows: batch / step time of
    bench_decode's measurement on this engine's model."""
    from benchmarks.bench_decode import time_decode

    engine = llm.engine
    grammar = llm.compile({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    ids = llm.tokenizer.encode("Say something as JSON.")
    step_ms = time_decode(engine, ids, batch, grammar, steps=32)["value"]
    return round(batch / (step_ms / 1000.0), 1)


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--workloads", default="json,agent")
    ap.add_argument("--modes", default="inprocess,http",
                    help="inprocess, http (`structgen serve`), http-fronts (`serve --front-processes`)")
    ap.add_argument("--front-processes", type=int, default=4, help="http-fronts: the server's front processes")
    ap.add_argument("--arrivals", default="closed,50,100",
                    help="closed (all at once), serial (one at a time) and/or request rates per second")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch-size", type=int, default=None,
                    help="concurrent requests (default on a GPU: the engine's, device_batch_size; 16 on the CPU: "
                         "256 slots of 4,096 positions hold 19 GB of CPU KV cache, and the HTTP mode's server could "
                         "not fork)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--graph-rows", default=None,
                    help="decode graph row buckets (EngineTuning.cuda_graph_batch_sizes), e.g. 1,2,4,...,1024: "
                         "the largest caps a step's rows, prompt rows included (in process only)")
    ap.add_argument("--backend", default="auto", choices=["auto", "xgrammar", "llguidance"],
                    help="our grammar backend (LLM(backend=...), `serve --backend`): llguidance to compare with a "
                         "peer serving with it (scripts/device/vllm.sh starts vLLM with guidance)")
    ap.add_argument("--tuning", action="append", default=[], metavar="FIELD=VALUE",
                    help="an EngineTuning field for this run, e.g. prefill_in_graphs=false (in process only)")
    ap.add_argument("--prefill-chunk-tokens", type=int, default=None,
                    help="EngineConfig.prefill_chunk_tokens: most tokens of an eager prefill step")
    ap.add_argument("--http-clients", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)), metavar="N",
                    help="client processes sending the HTTP requests (default: half the cores, at most 8; from 4, "
                         "a burst of 1,000 was paced by the clients; 1: all from this process; a serial run uses one)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--data-dir", type=Path, default=None, help="MaskBench jsonl folder (default: ../shared)")
    ap.add_argument("--no-bound", action="store_true", help="skip the decode-step bound")
    ap.add_argument("--peer", action="append", default=[], metavar="NAME=URL",
                    help="also run the HTTP workloads against this OpenAI-compatible server (e.g. "
                         "vllm=http://127.0.0.1:8100/v1), serving the same weights as --peer-model")
    ap.add_argument("--peer-model", default="smollm2", help="the model name the peers serve")
    ap.add_argument("--paired", default=None, metavar="A,B[,C...]",
                    help="two or more workloads' warm bursts alternated in process, A's TTFT against B's "
                         "(the module docstring); --workloads, --modes and --arrivals are then not used")
    ap.add_argument("--bursts", type=int, default=8, help="--paired: warm bursts of each workload")
    ap.add_argument("--timeline", action="store_true",
                    help="--paired: print where each warm burst's engine steps went (benchmarks/step_timeline.py)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if unknown_modes := set(args.modes.split(",")) - {"inprocess", "http", "http-fronts"}:
        ap.error(f"--modes takes inprocess, http and http-fronts, comma-separated (got {', '.join(unknown_modes)})")
    if args.paired is not None:
        names = args.paired.split(",")
        unknown = [name for name in names if name not in WORKLOADS]
        if len(names) < 2 or unknown:
            ap.error(f"--paired takes two or more of {', '.join(WORKLOADS)}, comma-separated "
                     f"(got {args.paired!r})")
    return args


def _tuning_value(item: str) -> tuple[str, object]:
    """`FIELD=VALUE` of --tuning as the field's name and value: an int, a float, true / false,
    a comma-separated tuple of ints, or else the text (`mask_prefetch=on`)."""
    name, _, text = item.partition("=")
    if text.lower() in ("true", "false"):
        return name, text.lower() == "true"
    if "," in text:
        return name, tuple(int(v) for v in text.split(",") if v)
    for kind in (int, float):
        try:
            return name, kind(text)
        except ValueError:
            pass
    return name, text


def main() -> None:
    args = _parse_args()
    from structgen import LLM
    from structgen.engine.config import EngineConfig, EngineTuning
    from structgen.engine.model_runner import batch_size_on

    if args.max_batch_size is None:
        on_gpu = torch.cuda.is_available() and args.device in (None, "cuda")
        args.max_batch_size = batch_size_on(EngineConfig(), torch.device("cuda")) if on_gpu else 16

    data_dir = args.data_dir or maskbench_dir()
    tuning = dict(_tuning_value(item) for item in args.tuning)
    if args.graph_rows:
        tuning["cuda_graph_batch_sizes"] = tuple(int(r) for r in args.graph_rows.split(","))
    extra = {"device": args.device} if args.device else {}
    if args.prefill_chunk_tokens:
        extra["prefill_chunk_tokens"] = args.prefill_chunk_tokens
    cfg = EngineConfig(max_batch_size=args.max_batch_size, max_seq_len=4096, tuning=EngineTuning(**tuning), **extra)
    results = Results({k: str(v) for k, v in vars(args).items()}, write=not args.no_write,
                      benchmark="serving_paired" if args.paired else "serving")
    with LLM(config=cfg, backend=args.backend) as llm, contextlib.ExitStack() as stack:
        workloads = {"json": lambda: json_workload(args.requests, data_dir),
                     "json-one": lambda: json_one_workload(args.requests),
                     "agent": lambda: agent_workload(args.requests, data_dir, llm.tokenizer),
                     "agent-short": lambda: agent_workload(args.requests, data_dir, llm.tokenizer, catalogue=False)}
        on_gpu = torch.cuda.is_available() and args.device in (None, "cuda")
        rows = min(args.max_batch_size, args.requests)
        if args.paired:
            # The bound of each round on a twin engine (same config, so the same graphs and
            # kernels): stepping the serving engine from this thread between bursts could race
            # its loop thread, which finishes a burst's last step after the callers return.
            twin = stack.enter_context(LLM(config=cfg, backend=args.backend)) if on_gpu and not args.no_bound else None
            bound = functools.partial(decode_bound_tok_per_s, twin, rows) if twin is not None else None
            run_paired(llm, {name: workloads[name]() for name in args.paired.split(",")}, args.bursts, args, bound,
                       results)
        else:
            bound = decode_bound_tok_per_s(llm, rows) if on_gpu and not args.no_bound else None
            for name in args.workloads.split(","):
                requests = workloads[name]()
                for mode in args.modes.split(","):
                    run_mode(llm, mode, name, requests, args, bound, results)
                for peer in args.peer:
                    run_peer(peer, name, requests, args, bound, results)
    print_table(results.rows)
    if results.write:
        print("wrote", write_results(results.benchmark, results.rows, extra={"settings": results.settings}))


def run_mode(llm: Any, mode: str, workload: str, requests: list[ServingRequest], args: argparse.Namespace,
             bound: float | None, results: Results) -> None:
    arrivals = [_arrival(a) for a in args.arrivals.split(",")]
    if mode == "inprocess":
        run = inprocess_runner(llm, args.max_tokens)
        for rate in arrivals:
            res = asyncio.run(drive(run, requests, rate, args.timeout))
            results.add({**_row(workload, mode, rate, res, bound), "backend": args.backend})
        return
    from structgen_server.process import ServerProcess

    server_args = ["--max-batch-size", str(args.max_batch_size), "--max-seq-len", "4096", "--log-level", "warning",
                   "--backend", args.backend]
    if mode == "http-fronts":  # the HTTP server in processes of its own
        server_args += ["--front-processes", str(args.front_processes)]
    with ServerProcess([*server_args, *(["--device", args.device] if args.device else [])]) as server:
        assert server.proc is not None
        cpu = ServerCpu(server.proc.pid)
        first_text = HistogramMean(server.root, "structgen_stream_first_text_seconds")
        planned = HistogramMean(server.root, "structgen_request_plan_seconds")
        for rate in arrivals:
            before, timed, plans = cpu.seconds(), first_text.read(), planned.read()
            res = http_drive(server.url, llm.model_name, requests, rate, args.max_tokens, args.timeout,
                             args.http_clients)
            row = _row(workload, mode, rate, res, bound, http_clients=args.http_clients)
            results.add({**row, "backend": args.backend, **cpu.spent_since(before, res.wall_s),
                         "server_ttft_mean_ms": first_text.mean_since(timed),
                         "server_plan_mean_ms": planned.mean_since(plans)})


class HistogramMean:
    """A server's own mean of a Prometheus histogram `name` over a run, from its `_sum` and
    `_count` (every label set added up). For the time to first token ours is
    `structgen_stream_first_text_seconds` (handler start to first text; of it,
    `structgen_request_plan_seconds` is the compile and tokenizer queues), vLLM's
    `vllm:time_to_first_token_seconds` (from the arrival time its input processor gives a
    rendered, tokenized prompt: vllm/v1/engine/input_processor.py). Against the client's mean TTFT it splits the server's time from the
    clients' sending and reading; None where the server exposes no such histogram."""

    def __init__(self, root: str, name: str):
        self.url, self.name = f"{root}/metrics", name

    def read(self) -> tuple[float, int] | None:
        import httpx

        try:
            text = httpx.get(self.url, timeout=10).text
        except httpx.HTTPError:
            return None
        series = re.findall(rf"^{re.escape(self.name)}_(sum|count)(?:{{[^}}]*}})? (\S+)$", text, re.M)
        if not series:
            return None
        return (sum(float(v) for kind, v in series if kind == "sum"),
                sum(int(float(v)) for kind, v in series if kind == "count"))

    def mean_since(self, before: tuple[float, int] | None) -> float | None:
        after = self.read()
        if before is None or after is None or after[1] == before[1]:
            return None
        return round(1e3 * (after[0] - before[0]) / (after[1] - before[1]), 1)


class ServerCpu:
    """CPU seconds a `structgen serve` process tree spends (Linux /proc; zeros elsewhere): its
    event loop (the main thread), the whole process (the engine, compile and mask threads too)
    and its front processes. A loop near one busy core over a burst is what bounds it."""

    def __init__(self, pid: int):
        self.pid = pid

    def seconds(self) -> dict[str, float]:
        proc = Path(f"/proc/{self.pid}")
        children = {c for task in proc.glob("task/*") for c in _read(task / "children").split()}
        return {"loop": _cpu_seconds(proc / "task" / str(self.pid) / "stat"), "process": _cpu_seconds(proc / "stat"),
                "fronts": sum(_cpu_seconds(Path(f"/proc/{c}/stat")) for c in children)}

    def spent_since(self, before: dict[str, float], wall_s: float) -> dict[str, float]:
        now = self.seconds()
        spent = {k: round(now[k] - before[k], 2) for k in now}
        return {"server_loop_cpu_s": spent["loop"], "server_cpu_s": spent["process"], "fronts_cpu_s": spent["fronts"],
                "server_loop_busy": round(spent["loop"] / wall_s, 2) if wall_s else None}


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _cpu_seconds(stat: Path) -> float:
    """User + system time of a /proc stat file (fields 14 and 15, after the command's
    parenthesised name), 0.0 where it is gone."""
    text = _read(stat)
    if not text:
        return 0.0
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_paired(llm: Any, requests: dict[str, list[ServingRequest]], bursts: int, args: argparse.Namespace,
               bound: Callable[[], float] | None, results: Results) -> None:
    """`--paired`: a cold burst of each workload, then `bursts` rounds of a warm burst of each,
    in reverse order every other round, `bound()` measured before the cold bursts and after
    each round; rows as the module docstring says (the first workload's TTFT against the
    second's)."""
    run = inprocess_runner(llm, args.max_tokens)
    names = list(requests)
    first = bound() if bound is not None else None
    for name in names:
        results.add(_row(name, "inprocess", None, asyncio.run(drive(run, requests[name], None, args.timeout)), first)
                    | {"burst": "cold"})
    warm: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    bounds: list[float] = []
    bound_speeds: list[float] = []  # host_speed_ms beside each bound
    timeline = StepTimeline(llm.engine) if getattr(args, "timeline", False) else None
    for i in range(bursts):
        for name in names if i % 2 == 0 else names[::-1]:
            speed = host_speed_ms()
            if timeline is not None:
                timeline.reset()
            warm[name].append(summarize(asyncio.run(drive(run, requests[name], None, args.timeout)))
                              | {"host_speed_ms": speed})
            print(name, "warm burst", i, json.dumps(warm[name][-1]), flush=True)
            if timeline is not None:
                print(name, "steps", i, json.dumps(timeline.summary()), flush=True)
        if bound is not None:
            bound_speeds.append(host_speed_ms())
            bounds.append(bound())
            print("decode-step bound after round", i, bounds[-1], "host_speed_ms", bound_speeds[-1], flush=True)
    if timeline is not None:
        timeline.close()
    rows = [paired_row(name, warm[name], bounds) | {"rounds_bound_host_speed_ms": bound_speeds or None}
            for name in names]
    a, b = warm[names[0]], warm[names[1]]
    rows[0]["ttft_p50_ratio"] = round(rows[0]["ttft_p50_ms"] / rows[1]["ttft_p50_ms"], 3)
    rows[0]["rounds_ttft_p50_ratio"] = [round(x["ttft_p50_ms"] / y["ttft_p50_ms"], 3) for x, y in zip(a, b, strict=True)]
    for row in rows:
        results.add(row)


def paired_row(workload: str, bursts: list[dict[str, Any]], bounds: list[float]) -> dict[str, Any]:
    """A workload's row over its warm bursts: the median of each numeric figure, the counts of
    requests summed, and every burst's TTFT p50; with the decode-step bound of each round
    (`bounds`, none without), the share of the median tok/s in the median bound: one
    measurement of the bound moved 61-100k tok/s within a process on the lent H200 hosts,
    apart from the bursts, so one taken once set the share more than the bursts did."""
    summed = ("requests", "refused", "lost", "valid", "invalid", "incomplete", "output_tokens")
    figures: dict[str, Any] = {}
    for key, first in bursts[0].items():
        values = [b[key] for b in bursts]
        if key in summed:
            figures[key] = sum(values)
        elif isinstance(first, (int, float)) and all(isinstance(v, (int, float)) for v in values):
            figures[key] = round(statistics.median(values), 3)
    figures["first_errors"] = sorted({e for b in bursts for e in b["first_errors"]})[:3]
    bound = round(statistics.median(bounds), 1) if bounds else None
    return {"system": "structgen", "model": "smollm2-135m", "workload": workload, "mode": "inprocess",
            "arrival": "closed", "burst": f"median of {len(bursts)} warm", **figures,
            "bursts_ttft_p50_ms": [b["ttft_p50_ms"] for b in bursts],
            "bursts_tok_per_s": [b["tok_per_s"] for b in bursts],
            "bursts_host_speed_ms": [b["host_speed_ms"] for b in bursts if "host_speed_ms" in b] or None,
            "decode_bound_tok_per_s": bound,
            "rounds_decode_bound_tok_per_s": bounds or None,
            "share_of_bound": round(figures["tok_per_s"] / bound, 3) if bound else None}


def run_peer(peer: str, workload: str, requests: list[ServingRequest], args: argparse.Namespace,
             bound: float | None, results: Results) -> None:
    """The same HTTP requests against a peer's OpenAI-compatible server (NAME=URL)."""
    name, _, url = peer.partition("=")
    ttft = HistogramMean(url.rstrip("/").removesuffix("/v1"), "vllm:time_to_first_token_seconds")
    for a in args.arrivals.split(","):
        rate = _arrival(a)
        timed = ttft.read()
        res = http_drive(url, args.peer_model, requests, rate, args.max_tokens, args.timeout, args.http_clients)
        row = _row(workload, "http", rate, res, bound, system=name, http_clients=args.http_clients)
        results.add({**row, "server_ttft_mean_ms": ttft.mean_since(timed)})


def http_drive(url: str, model: str, requests: list[ServingRequest], rate: Arrival, max_tokens: int,
               timeout_s: float, processes: int = 1) -> RunResult:
    """The requests over HTTP with the official openai client, from this process
    (`processes` 1, or a serial run) or spread round robin over `processes` client processes
    that start together and keep the arrival times: one process parsing every stream's chunks
    can be what bounds a burst, rather than the server."""
    if processes <= 1 or rate == "serial":
        cpu = time.process_time()
        res = asyncio.run(_http(url, model, requests, rate, max_tokens, timeout_s))
        res.client_cpu_s = time.process_time() - cpu
        return res
    import multiprocessing
    import queue

    delays = arrival_delays(len(requests), rate if isinstance(rate, float) else None)
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding an engine's threads
    start, results = ctx.Barrier(processes + 1), ctx.Queue()
    shards = [list(range(k, len(requests), processes)) for k in range(processes)]
    procs = [ctx.Process(target=_client_process, daemon=True, args=(
        k, url, model, [requests[i] for i in shard], [delays[i] for i in shard], max_tokens, timeout_s, start, results))
        for k, shard in enumerate(shards)]
    for p in procs:
        p.start()
    try:
        start.wait(timeout=300)
        t0 = time.monotonic()
        merged: list[Outcome] = [Outcome()] * len(requests)
        ends, cpu = [], 0.0
        for _ in procs:
            k, outcomes, end, cpu_s = results.get(timeout=timeout_s + 300)
            for i, outcome in zip(shards[k], outcomes, strict=True):
                merged[i] = Outcome(**outcome)
            ends.append(end)
            cpu += cpu_s
    except (queue.Empty, threading.BrokenBarrierError) as exc:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"a client process did not report (exit codes {codes})") from exc
    finally:
        for p in procs:
            p.join(10)
    validate_outcomes(merged, requests)
    return RunResult(merged, max(ends) - t0, cpu)


def _client_process(k: int, url: str, model: str, requests: list[ServingRequest], delays: list[float],
                    max_tokens: int, timeout_s: float, start: Any, results: Any) -> None:
    """One client process of `http_drive`: its share of the requests once every process is
    ready; (k, outcomes as dicts, monotonic end, CPU seconds) to `results`."""

    async def run() -> tuple[list[dict[str, Any]], float, float]:
        async with _openai_client(url, timeout_s) as client:
            start.wait()
            cpu = time.process_time()
            outcomes = await send_all(http_runner(client, model, max_tokens), requests, delays, timeout_s)
            end, cpu = time.monotonic(), time.process_time() - cpu
            return [asdict(o) for o in outcomes], end, cpu

    results.put((k, *asyncio.run(run())))


def _openai_client(url: str, timeout_s: float) -> Any:
    import httpx
    import openai

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0,
                              http_client=httpx.AsyncClient(limits=limits, timeout=timeout_s))


async def _http(url: str, model: str, requests: list[ServingRequest], rate: Arrival, max_tokens: int,
                timeout_s: float) -> RunResult:
    async with _openai_client(url, timeout_s) as client:
        return await drive(http_runner(client, model, max_tokens), requests, rate, timeout_s)


def _row(workload: str, mode: str, rate: Arrival, res: RunResult, bound: float | None,
         system: str = "structgen", http_clients: int | None = None) -> dict[str, Any]:
    figures = summarize(res)
    print(system, workload, mode, rate or "closed", json.dumps(figures), flush=True)  # progress on long runs
    # the sending processes: a burst's TTFT is theirs too (12-27 ms of client CPU a streamed request)
    senders = {"http_clients": http_clients} if http_clients else {}
    return {"system": system, "model": "smollm2-135m", "workload": workload, "mode": mode, **senders,
            "arrival": "closed" if rate is None else rate if isinstance(rate, str) else f"poisson {rate:g}/s", **figures,
            "decode_bound_tok_per_s": bound,
            "share_of_bound": round(figures["tok_per_s"] / bound, 3) if bound else None}


if __name__ == "__main__":
    main()
