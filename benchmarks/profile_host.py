"""Host cost of a decode step with the device stubbed out: what the CPU spends per step on
scheduling, grammar masks, advancing matchers and the engine's bookkeeping.

At batch 64 a JSON decode step of a small model is host-bound on the lent H100 (SmolLM2:
1.41 ms JSON against 1.01 ms free, docs/performance.md), and how much so depends on which host
the lend gives. This measures the host side alone, on any machine: the engine runs its real
decode path (the decode graphs' `run`, run eagerly) with the forward replaced by nothing and
the sampler by a stub, so every figure is host time. Constrained rows follow a valid instance
of bench_decode's schema token by token (their masks are real xgrammar masks of realistic
states), free rows take random tokens. The stub's own time is subtracted.

The per-request part of a step (scheduling, page-table bookkeeping, the hooks each token
passes) shows as the growth from batch 16 to 64: `us_per_request` divides by the batch.

    python -m benchmarks.profile_host                       # batches 1, 16, 64; free and JSON
    python -m benchmarks.profile_host --batches 64 --grammar-workers 2
    python -m benchmarks.profile_host --serving 256 --max-tokens 64   # the whole front, see below
    python -m benchmarks.profile_host --serving 256 --one-schema --acomplete --profile /tmp/front.prof
    python -m benchmarks.profile_host --serving 64 --workload agent --serial --warm --no-write

`--serving N` runs the whole in-process path on the same stubbed device: N streams
(`LLM.astream`) with distinct MaskBench schemas submitted at once, through the asyncio front,
grammar compiles, the engine loop, scheduling, masks and detokenization; constrained rows take
a random token their mask allows. It reports the wall time, the engine's median host step and
the time to the first token (compiles included), with the engine's part of it
(`ttft_engine_p50_ms`: from the request's creation, prompt tokenized and grammar compiled, to
its first token), and when the median request passed the asyncio front's stages
(`front_grammar_p50_ms`, `front_request_p50_ms`: prompt tokenized and request made,
`front_submitted_p50_ms`; with each stage's first and last, from the burst's start). `--device-ms FIXED,PER_1K_ROWS` gives each forward device time (the sampler
sleeps, the GIL released, until it has passed), so the front's threads and the engine's host
work overlap as they do beside a GPU:

    python -m benchmarks.profile_host --serving 256 --one-schema --acomplete --max-tokens 128 \
        --graph-rows 1,2,4,8,16,32,64,128,256,512,1024 --device-ms 2,2 --no-write

`--http N` does the same over HTTP: `structgen serve`'s app with its uvicorn settings
(`server_config`) on the stubbed device in a child process, and N streamed chat completions
of bench_serving's agent workload (a ~3,000-token tool catalogue, one JSON schema) sent as the
openai client sends them, all at once or as Poisson arrivals (`--rate`). It reports lost
requests, TTFT, and the CPU time of the server's event loop thread per request and per output
token: the host work the HTTP front adds, which holds the GIL the engine thread needs; and the
whole server process's CPU time per request (every thread: prompt tokenizing in worker threads
and the stubbed engine's host work too).
`--profile FILE` records the event loop with cProfile (CPU time, so waits for the GIL do not
count) and prints its top functions. `--workload json-one` serves bench_serving's one-schema
burst instead, the stub writing what the default model writes. `client_cpu_ms_per_request` is
the sending side's CPU: by default httpx reading the SSE lines with `json.loads`; `--client
openai` drives with bench_serving's HTTP driver (the official client) from
`--client-processes` processes, so a burst can be weighed as bench_serving sends it.

    python -m benchmarks.profile_host --http 256 --max-tokens 48 --profile /tmp/server.prof
    python -m benchmarks.profile_host --http 400 --max-tokens 48 --rate 100
    python -m benchmarks.profile_host --http 256 --workload json-one --max-tokens 128 --client openai --client-processes 4

`--speculative` compares the host time of a decode step of the plain engine with the same
engine running an n-gram `Speculator` that sees every step (`--max-requests 0`, the default;
8 is `SpeculativeConfig`'s default, as `bench_speculative --targets` runs) and whose draft
policy drafts nothing (drafts priced as never accepted): a burst of `--batches`' largest count
of JSON requests with jump-forward on and budgets spread so the batch shrinks, the two engines
alternated `--repeat` times. A speculative step without drafts should cost what the plain one
does; `speculator_us` is the time inside the speculator's calls per step, `weighed` the policy's
decisions that weighed drafts (the others held a choice of no drafts), `drafter_calls` the
drafts the drafter was asked for (0 here). `tail_*`: the steps the speculator sees (the
burst's tail of `--max-requests` or fewer requests), their host time and how many of their
decode steps (`tail_graph_steps`) found their forward launched ahead (`tail_ahead`).

    python -m benchmarks.profile_host --speculative --batches 64 --repeat 4
    python -m benchmarks.profile_host --speculative --batches 64 --max-requests 8 --repeat 6
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.bench_decode import PROMPT, SCHEMA, chat
from benchmarks.bench_serving import WORKLOADS
from benchmarks.common import model_config, print_table, write_results
from structgen.engine import graph_metadata as meta
from structgen.engine.config import EngineConfig, EngineTuning
from structgen.engine.engine import Engine
from structgen.engine.request import Request
from structgen.engine.scheduler import Scheduler
from structgen.sampling import SamplingParams

INSTANCE = {"name": "Ada Lovelace", "age": 36, "city": "London", "email": "ada.lovelace@example.com",
            "tags": ["mathematics", "poetry", "engines"], "active": True}
# What the default model writes for a json-one prompt: the stub follows it, so outputs have the
# real length and jump-forward its real share.
PERSON_TEXT = '{"name": "Ada Lovelace", "age": 20, "height_m": 1.50, "member": false, "tier": "bronze"}'
PHASES = (("Engine", "_fill_masks"), ("Engine", "_advance_all"), ("Scheduler", "schedule"))


class StubDevice:
    """Replaces each bucket's (forward, sample) with host-only stand-ins: no forward, and a
    sampler that writes, for a constrained row, the first token of what is left of `text`
    after the row's output so far (its first token came from the real sampler of the prefill
    step, so the rest is re-encoded), a random token for a free row, and advances the
    metadata as the real sampler does."""

    def __init__(self, engine: Engine, tokenizer: Any, text: str, stop: int,
                 device_ms: tuple[float, float] = (0.0, 0.0)):
        """`device_ms`: (fixed, per 1,024 rows) milliseconds a forward of a bucket keeps the
        device busy; the sampler sleeps (the GIL released, as in a wait for the GPU) until
        that time after the forward's launch has passed."""
        self.engine, self.tokenizer, self.text, self.stop = engine, tokenizer, text, stop
        self._next: dict[tuple[int, ...], int] = {}  # output so far -> next token
        self.graphs = engine.runner.graphs
        self.rng = np.random.default_rng(0)
        self.seconds = 0.0
        self.device_ms = device_ms
        self._busy_until = 0.0
        for bs in self.graphs.batch_sizes:
            self.graphs._steps[bs] = (functools.partial(self._forward, bs), functools.partial(self._sample, bs))

    def _forward(self, bs: int) -> None:
        fixed, per_1k_rows = self.device_ms
        self._busy_until = time.perf_counter() + 1e-3 * (fixed + per_1k_rows * bs / 1024)

    def _sample(self, bs: int) -> None:
        t = time.perf_counter()
        if self._busy_until > t:
            time.sleep(self._busy_until - t)
        g, m = self.graphs, self.graphs.meta
        by_slot = {r.slot: r for r in self.engine.scheduler.running}
        out = np.zeros(bs, dtype=np.int64)
        for row, (slot, live) in enumerate(zip(m[meta.SLOTS, :bs].tolist(), m[meta.LIVE, :bs].tolist(), strict=True)):
            req = by_slot.get(slot) if live else None
            if req is None:
                continue
            if req.matcher is None or not m[meta.HAS_MASK, row]:
                out[row] = self.rng.integers(1000, 40000)
            else:
                out[row] = self.next_token_at(row, req)
        g.tokens[:bs] = torch.from_numpy(out)
        live = m[meta.LIVE, :bs]
        torch.mul(g.tokens[:bs], live, out=m[meta.IDS, :bs])
        m[meta.POSITIONS, :bs].add_(live)
        m[: meta.CARRIED, :bs] = m[: meta.CARRIED].index_select(1, m[meta.NEXT, :bs])
        torch.add(m[meta.POSITIONS, :bs], 1, out=m[meta.LENS, :bs])
        self.seconds += time.perf_counter() - t

    def next_token_at(self, row: int, req: Request) -> int:
        return self.next_token(req.output_ids)

    def next_token(self, output: list[int]) -> int:
        key = tuple(output)
        if key not in self._next:
            done = self.tokenizer.decode(output)
            rest = self.text[len(done):] if self.text.startswith(done) else ""
            ids = self.tokenizer.encode(rest, add_special_tokens=False) if rest else []
            self._next[key] = ids[0] if ids else self.stop
        return self._next[key]


class RandomAllowedDevice(StubDevice):
    """The stub with, for a constrained row, a random token its host mask allows (any schema)."""

    def next_token_at(self, row: int, req: Request) -> int:
        words = self.graphs._bitmask_words[row]
        nonzero = np.flatnonzero(words)
        word = int(self.rng.choice(nonzero))
        bits = [b for b in range(32) if int(words[word]) >> b & 1]
        return word * 32 + int(self.rng.choice(bits))


class TextFollowingDevice(RandomAllowedDevice):
    """The stub following `text` where the row's mask allows its next token (a first token
    from the real sampler, or jump-forward's spelling, can leave it), else a random allowed one."""

    def next_token_at(self, row: int, req: Request) -> int:
        token = self.next_token(req.output_ids)
        if int(self.graphs._bitmask_words[row][token // 32]) >> (token % 32) & 1:
            return token
        return super().next_token_at(row, req)


class PhaseTimer:
    """Wall time inside a few engine methods while `on` (wrappers on the classes)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False
        self._saved = []
        for owner, name in PHASES:
            cls = {"Engine": Engine, "Scheduler": Scheduler}[owner]
            original = getattr(cls, name)
            self._saved.append((cls, name, original))
            setattr(cls, name, self._wrap(name, original))

    def _wrap(self, name: str, f):
        @functools.wraps(f)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                if self.on:
                    self.seconds[name] += time.perf_counter() - t

        return timed

    def restore(self) -> None:
        for cls, name, original in self._saved:
            setattr(cls, name, original)


def host_us_per_step(engine: Engine, stub: StubDevice, phases: PhaseTimer, prompt: list[int], batch: int,
                     grammar, steps: int) -> dict[str, Any]:
    """Host microseconds per pure decode step (the stub's time taken out), over rounds of
    `batch` requests until `steps` steps were timed: the median step (a shared host stalls
    now and then, which the mean also shows) and the mean."""
    stop = frozenset(engine.stop_token_ids) if grammar is not None else frozenset()
    timed = 0
    each: list[float] = []
    phases.seconds.clear()
    rounds = 0
    while timed < steps:
        rounds += 1
        if rounds > 4 * steps:
            raise RuntimeError("no decode step could be timed: requests finish at once (stub tokens rejected?)")
        reqs = [Request(prompt, SamplingParams(max_tokens=128),
                        grammar.matcher() if grammar is not None else None, stop) for _ in range(batch)]
        for r in reqs:
            engine.add_request(r)
        while any(r.num_output == 0 for r in reqs):
            engine.step()
        engine.step()
        phases.on = True
        while timed < steps and all(not r.finished for r in reqs):
            stub_before, t = stub.seconds, time.perf_counter()
            engine.step()
            each.append(time.perf_counter() - t - (stub.seconds - stub_before))
            timed += 1
        phases.on = False
        for r in reqs:
            engine.abort(r)
    median = float(np.median(each))
    out = {"host_us_per_step": 1e6 * median, "us_per_request": 1e6 * median / batch,
           "mean_us": 1e6 * sum(each) / timed, "steps": timed}
    out.update({f"{k}_us": 1e6 * v / timed for k, v in phases.seconds.items()})
    return out


def tiny_engine(tokenizer: Any, max_batch_size: int, max_seq_len: int = 1024, **config: Any) -> Engine:
    """The real vocabulary with one tiny layer (its cost is stubbed), decode graphs run eagerly."""
    cfg = model_config("smollm2-135m")
    cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 1, 64, 128
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 1, 32
    ec = EngineConfig(device="cpu", max_batch_size=max_batch_size, max_seq_len=max_seq_len, use_cuda_graphs=False, **config)
    engine = Engine(cfg, ec, None, stop_token_ids=set(cfg.eos_token_id))
    engine.runner.capture_decode_graphs(capture=False)
    engine.runner.graphs.prelaunch = True  # the GPU path: next forward queued behind the sampler
    return engine


def serving_workload(name: str, n: int, tokenizer: Any) -> list[Any]:
    """bench_serving's requests of workload `name` (one of WORKLOADS)."""
    from benchmarks.bench_serving import agent_workload, json_one_workload, json_workload
    from benchmarks.common import maskbench_dir

    if name == "json-one":
        return json_one_workload(n)
    if name in ("agent", "agent-short"):
        return agent_workload(n, maskbench_dir(), tokenizer, catalogue=name == "agent")
    return json_workload(n, maskbench_dir())


def serving_run(tokenizer: Any, n: int, max_tokens: int, grammar_threads: int, workload: str = "json",
                acomplete: bool = False, profile_path: Path | None = None,
                graph_rows: tuple[int, ...] | None = None, warm: bool = False,
                serial: bool = False, device_ms: tuple[float, float] = (0.0, 0.0),
                timeline: bool = False) -> dict[str, Any]:
    """`n` requests at once (`serial`: one at a time) through `LLM.astream` (or `LLM.acomplete`)
    on the stubbed device, of bench_serving's `workload` (WORKLOADS); with
    `profile_path`, cProfile of the event loop's thread into that file and of the engine
    steps into that file + ".engine". `graph_rows`: the decode graphs' row buckets
    (`EngineTuning.cuda_graph_batch_sizes`; the largest caps a step's rows). `warm`: the
    same burst runs once before the measured one, whose prompts then hit the prefix cache.
    `device_ms`: the stub's device time per forward (StubDevice); `timeline`: print each
    step of the measured burst (`print_timeline`). As bench_serving's decode
    bound does, a small schema is compiled and a text tokenized before the burst, so a cold
    burst pays for its own schema's grammar, not for the first use of the grammar library."""
    import asyncio
    import cProfile

    from structgen import LLM

    sizes = {"cuda_graph_batch_sizes": graph_rows} if graph_rows else {}
    requests = serving_workload(workload, n, tokenizer)
    seq_len = 4096 if workload.startswith("agent") else 1024  # the catalogue is about 3,000 tokens; one engine for both twins
    engine = tiny_engine(tokenizer, n, seq_len, tuning=EngineTuning(grammar_threads=grammar_threads, **sizes))
    llm = LLM.from_engine(engine, tokenizer, "stub")
    stop = min(engine.stop_token_ids)
    one_schema = workload == "json-one"
    stub = (TextFollowingDevice(engine, tokenizer, PERSON_TEXT, stop, device_ms) if one_schema
            else RandomAllowedDevice(engine, tokenizer, "", stop, device_ms))
    llm.compile({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    tokenizer.encode("Say something as JSON.")
    if warm:
        asyncio.run(ServingClient(llm, max_tokens, acomplete, serial).run_all(requests))
    graph_steps = engine.runner.graphs.steps
    steps = StepLog(engine, stub)
    front = FrontTimes(llm)
    client = ServingClient(llm, max_tokens, acomplete, serial)
    profilers = (cProfile.Profile(), cProfile.Profile()) if profile_path else None
    if profilers:  # each engine step, as the engine thread may have started in the warm-up run
        engine.step = functools.partial(profilers[1].runcall, engine.step)
        profilers[0].enable()
    try:
        wall = asyncio.run(client.run_all(requests))
        graphed = engine.runner.graphs.steps - graph_steps  # before close() drops the graphs
    finally:
        llm.close()
        if profilers:
            profilers[0].disable()
            profilers[0].dump_stats(profile_path)
            profilers[1].dump_stats(f"{profile_path}.engine")
    busy = [x for x in steps.seconds if x > 0]
    ttft = client.ttft
    if timeline:
        print_timeline(steps, client.started)
    return {"workload": workload, "serial": serial, "streams": n, "api": "acomplete" if acomplete else "astream", "wall_s": round(wall, 2),
            "output_tokens": client.tokens, "host_tok_per_s": round(client.tokens / wall, 1),
            "steps": len(busy), "eager_steps": len(busy) - graphed, "steps_per_s": round(len(busy) / wall, 1),
            "tokens_per_step": round(client.tokens / max(len(busy), 1), 1),
            "steps_to_admit_all": steps.first_full,
            "steps_to_prefill_all": steps.prefilled, "host_ms_per_step": round(1e3 * float(np.median(busy)), 2),
            # The engine's host time until every prompt had run: admission, prefix matching,
            # prompt chunks (the part of the burst's TTFT the engine spends on the host).
            "host_ms_prompt_steps": round(1e3 * sum(steps.seconds[: steps.prefilled or 0]), 2),
            "host_cpu_ms_prompt_steps": round(1e3 * sum(steps.cpu_seconds[: steps.prefilled or 0]), 2),
            "host_cpu_ms_per_step": round(1e3 * float(np.median([c for c, x in zip(steps.cpu_seconds, steps.seconds, strict=True)
                                                                  if x > 0])), 2),
            "engine_busy_s": round(sum(busy), 2),
            # The engine thread's CPU over the whole burst (the stub's included): what a host-path
            # change saves, steadier on a shared machine than a median step or the wall time.
            "engine_cpu_s": round(sum(steps.cpu_seconds), 3), "ttft_p50_ms": round(1e3 * float(np.nanmedian(ttft)), 2),
            "ttft_p99_ms": round(1e3 * float(np.nanquantile(ttft, 0.99)), 2),
            # From the request's creation (prompt tokenized, grammar compiled) to its first token.
            "ttft_engine_p50_ms": round(1e3 * float(np.median(client.engine_ttft)), 2) if client.engine_ttft else None,
            "tpot_p99_ms": round(1e3 * float(np.quantile(client.tpot, 0.99)), 2) if client.tpot else None,
            "host_ms_per_request": round(1e3 * sum(busy) / n, 2),
            "ttft_max_s": round(float(np.nanmax(ttft)), 2), "no_output": int(np.isnan(ttft).sum()),
            "failed": dict(Counter(client.failed)), **front.medians_ms(client.started)}


class FrontTimes:
    """When each request of a burst passed the asyncio front's stages: its constraint and
    grammar found (`grammar`), its prompt tokenized and engine request made (`request`), the
    request handed to the engine loop (`submitted`); reported as medians from the burst's
    start. Wrappers set on the LLM instance, keyed by the caller's task."""

    def __init__(self, llm: Any):
        self.at: dict[Any, dict[str, float]] = defaultdict(dict)
        self._by_request: dict[int, dict[str, float]] = {}
        self._acompile, self._arequest = llm._acompile, llm._arequest
        llm._acompile, llm._arequest = self.acompile, self.arequest
        self._submit, llm.loop.submit = llm.loop.submit, self.submit

    def _mark(self, stage: str) -> dict[str, float]:
        import asyncio

        times = self.at[asyncio.current_task()]
        times[stage] = time.perf_counter()
        return times

    async def acompile(self, *args: Any, **kwargs: Any) -> Any:
        out = await self._acompile(*args, **kwargs)
        self._mark("grammar")
        return out

    async def arequest(self, *args: Any, **kwargs: Any) -> Any:
        out = await self._arequest(*args, **kwargs)
        self._by_request[id(out[0])] = self._mark("request")
        return out

    def submit(self, request: Request) -> Any:
        self._by_request.get(id(request), {})["submitted"] = time.perf_counter()
        return self._submit(request)

    def medians_ms(self, started: float) -> dict[str, float]:
        """Each stage's median and (`_first`, `_last`) its spread, in ms from `started`."""
        out = {}
        for stage in ("grammar", "request", "submitted"):
            times = [1e3 * (t[stage] - started) for t in self.at.values() if stage in t]
            if times:
                out[f"front_{stage}_p50_ms"] = round(float(np.median(times)), 2)
                out[f"front_{stage}_first_last_ms"] = (round(min(times), 1), round(max(times), 1))
        return out


class StepLog:
    """The engine's host seconds per step (the stub's time taken out), the first step at
    which every request of the run was in the running batch, and the first after which every
    prompt had been run."""

    def __init__(self, engine: Engine, stub: StubDevice):
        self.engine, self.stub, self._step = engine, stub, engine.step
        self.seconds: list[float] = []
        # The engine thread's CPU seconds a step (the stub's included): on a shared machine
        # less noisy than the wall time, which counts waits for the cores and the GIL.
        self.cpu_seconds: list[float] = []
        self.first_full: int | None = None
        self.prefilled: int | None = None  # the step by which every prompt had been run
        # Per step: its start, its rows, prompt tokens and prompts, and how many requests
        # got their first token in it.
        self.timeline: list[tuple[float, int, int, int, int]] = []
        self._batch: list[tuple[Request, int]] = []
        self._schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self.schedule
        engine.step = self.step

    def schedule(self, token_budget: int | None = None) -> list[tuple[Request, int]]:
        self._batch = self._schedule(token_budget)
        return self._batch

    def step(self) -> list[Request]:
        stub_before, t, cpu = self.stub.seconds, time.perf_counter(), time.thread_time()
        self._batch = []
        try:
            return self._step()
        finally:
            self.seconds.append(time.perf_counter() - t - (self.stub.seconds - stub_before))
            self.cpu_seconds.append(time.thread_time() - cpu)
            prompts = [n for r, n in self._batch if r.num_cached - n < r.num_prompt]  # (num_cached: after the step)
            firsts = sum(1 for r, _ in self._batch if r.first_token_at is not None and r.first_token_at >= t)
            self.timeline.append((t, sum(n for _, n in self._batch), sum(prompts), len(prompts), firsts))
            scheduler = self.engine.scheduler
            if self.first_full is None and len(scheduler.running) == scheduler.max_batch_size:
                self.first_full = len(self.seconds)
            if self.first_full is not None and self.prefilled is None and not scheduler.waiting and all(
                    r.num_cached >= r.num_prompt for r in scheduler.running):
                self.prefilled = len(self.seconds)


def print_timeline(steps: StepLog, started: float) -> None:
    """Each step of a burst until two steps after its last prompt ran: its start after the
    burst's, host time, rows, prompt tokens (and prompts) and first tokens."""
    last = max((i for i, row in enumerate(steps.timeline) if row[3]), default=0)
    for i, (t, rows, prompt_tokens, prompts, firsts) in enumerate(steps.timeline[: last + 3]):
        print(f"step {i:3d} at {1e3 * (t - started):7.1f} ms  host {1e3 * steps.seconds[i]:5.1f} ms  rows {rows:5d}  "
              f"prompt tokens {prompt_tokens:5d} ({prompts:3d} prompts)  first tokens {firsts:3d}")


class ServingClient:
    """The callers of `serving_run`: each request through `astream` or `acomplete`; their
    TTFTs (for `acomplete`, the wall time less the decode time, as bench_serving counts it),
    output tokens and refusals."""

    def __init__(self, llm: Any, max_tokens: int, acomplete: bool, serial: bool = False):
        self.llm, self.max_tokens, self.acomplete, self.serial = llm, max_tokens, acomplete, serial
        self.ttft: list[float] = []
        self.engine_ttft: list[float] = []  # the engine's part of each TTFT (`GenerationStats.ttft_s`)
        self.tpot: list[float] = []
        self.started = 0.0  # when the last `run_all` began
        self.tokens = 0
        self.failed: list[str] = []

    async def one(self, req: Any) -> None:
        from structgen import IncompleteOutputError, JsonSchema, StructgenError

        t0, first, stats = time.perf_counter(), None, None
        try:
            if self.acomplete:
                stats = (await self.llm.acomplete(JsonSchema(req.schema), req.messages, max_tokens=self.max_tokens)).stats
                first = time.perf_counter() - t0 - stats.decode_s
            else:
                stream = self.llm.astream(JsonSchema(req.schema), req.messages, max_tokens=self.max_tokens)
                async for _ in stream:
                    first = first or time.perf_counter() - t0
                stats = stream.completion.stats
        except IncompleteOutputError as exc:  # an output cut at max_tokens raises at its end
            stats = exc.stats
            first = first or time.perf_counter() - t0 - stats.decode_s
        except StructgenError as exc:  # refused (a full compile queue, a compile budget spent)
            self.failed.append(f"{type(exc).__name__}: {str(exc)[:120]}")
        self.tokens += stats.output_tokens if stats is not None else 0
        self.ttft.append(first if first is not None else float("nan"))
        if stats is not None and stats.output_tokens > 1:
            self.engine_ttft.append(stats.ttft_s)
            self.tpot.append(stats.decode_s / (stats.output_tokens - 1))

    async def run_all(self, requests: list[Any]) -> float:
        import asyncio

        t = self.started = time.perf_counter()
        if self.serial:
            for r in requests:
                await self.one(r)
        else:
            await asyncio.gather(*(self.one(r) for r in requests))
        return time.perf_counter() - t


# -- the HTTP server on the stubbed device -------------------------------------------------------
def serve_stubbed(port: int, max_batch_size: int, stats_path: Path, profile_path: Path | None,
                  workload: str = "agent", front_processes: int = 0) -> None:
    """The child of `--http`: the real app and uvicorn settings (`server_config`) on the stubbed
    device until SIGINT/SIGTERM; then the event loop thread's CPU seconds (and its cProfile).
    For json-one the stub writes what the default model writes (PERSON_TEXT), else random
    allowed tokens. With `front_processes` the HTTP server runs in processes of its own and the
    figures are the engine process's (its main thread serves the fronts' calls)."""
    import cProfile
    import json

    import uvicorn

    from structgen import LLM
    from structgen.engine.models.loader import load_tokenizer, resolve_model
    from structgen_server.app import create_app, server_config

    tokenizer = load_tokenizer(resolve_model(progress=False))
    engine = tiny_engine(tokenizer, max_batch_size, max_seq_len=4096)
    stop = min(engine.stop_token_ids)
    if workload == "json-one":
        TextFollowingDevice(engine, tokenizer, PERSON_TEXT, stop)
    else:
        RandomAllowedDevice(engine, tokenizer, "", stop)
    llm = LLM.from_engine(engine, tokenizer, "stub")
    if front_processes:
        from structgen_server.fronts import serve_with_fronts

        def serve() -> None:
            serve_with_fronts(llm, front_processes, "127.0.0.1", port, {}, "warning")
    else:
        serve = uvicorn.Server(server_config(create_app(llm), "127.0.0.1", port, "warning")).run
    profiler = cProfile.Profile(time.thread_time) if profile_path else None  # CPU, not GIL waits
    cpu, process_cpu = time.thread_time(), time.process_time()
    if profiler:
        profiler.enable()
    try:
        serve()
    except KeyboardInterrupt:  # uvicorn shuts down gracefully, then re-raises the signal
        pass
    finally:
        if profiler:
            profiler.disable()
            profiler.dump_stats(profile_path)
        stats_path.write_text(json.dumps({"loop_cpu_s": time.thread_time() - cpu,
                                          "process_cpu_s": time.process_time() - process_cpu}))
        llm.close()


async def stream_one(client: Any, messages: list[dict[str, Any]], schema: dict[str, Any], max_tokens: int,
                     delay: float) -> dict[str, Any]:
    """One streamed chat completion as the openai client sends it; its TTFT, SSE events and
    completion tokens, or its error."""
    import asyncio
    import json

    await asyncio.sleep(delay)
    body = {"model": "stub", "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}
    t0, ttft, events, tokens = time.perf_counter(), None, 0, 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk, events = json.loads(line[6:]), events + 1
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - t0
    except Exception as exc:  # counted as lost, as bench_serving counts it
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return {"ttft_s": ttft, "events": events, "tokens": tokens, "latency_s": time.perf_counter() - t0}


async def drive_http(url: str, requests: list[Any], max_tokens: int, rate: float | None) -> tuple[list[dict], float]:
    """All requests at once (`rate` None) or Poisson arrivals, each over its own connection
    from one pool (as `bench_serving` drives the server)."""
    import asyncio
    import random

    import httpx

    rng, delays, t = random.Random(0), [], 0.0
    for _ in requests:
        delays.append(t)
        t += rng.expovariate(rate) if rate else 0.0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(stream_one(client, r.messages, r.schema, max_tokens, d)
                                     for r, d in zip(requests, delays, strict=True)))
    return list(out), time.perf_counter() - t0


def http_run(n: int, max_tokens: int, rate: float | None, profile_path: Path | None,
             workload: str = "agent", client: str = "httpx", client_processes: int = 1,
             front_processes: int = 0) -> dict[str, Any]:
    """`n` streams of bench_serving's `workload` against `structgen serve`'s app on the stubbed
    device (a child process): the server's event loop CPU per request and token, and the
    client's CPU per request. `client` "httpx" reads the SSE lines with `json.loads`;
    "openai" is bench_serving's HTTP driver (the official client, from `client_processes`
    processes)."""
    import asyncio
    import json
    import signal
    import subprocess
    import sys
    import tempfile

    import httpx

    from benchmarks.bench_serving import http_drive
    from structgen.engine.models.loader import load_tokenizer, resolve_model
    from structgen_server.process import free_port

    port, stats = free_port(), Path(tempfile.mkstemp(suffix=".json")[1])
    cmd = [sys.executable, "-m", "benchmarks.profile_host", "--serve-stubbed", str(port), "--max-batch", str(n),
           "--workload", workload, "--stats-out", str(stats), "--front-processes", str(front_processes),
           *(["--profile-out", str(profile_path)] if profile_path else [])]
    child = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(httpx, f"{url}/health", child)
        requests = serving_workload(workload, n, load_tokenizer(resolve_model(progress=False)))
        if client == "openai":
            res = http_drive(f"{url}/v1", "stub", requests, rate, max_tokens, 600.0, client_processes)
            results = [{"error": o.error} if o.error else
                       {"ttft_s": o.ttft_s, "tokens": o.output_tokens, "events": None, "valid": o.valid}
                       for o in res.outcomes]
            wall, client_cpu = res.wall_s, res.client_cpu_s or 0.0
        else:
            cpu = time.process_time()
            results, wall = asyncio.run(drive_http(url, requests, max_tokens, rate))
            client_cpu = time.process_time() - cpu
    finally:
        child.send_signal(signal.SIGINT)
        child.wait(60)
    ok = [r for r in results if "error" not in r]
    server = json.loads(stats.read_text())
    loop_cpu = server["loop_cpu_s"]
    tokens = sum(r["tokens"] for r in ok)
    events = sum(r["events"] for r in ok) if client == "httpx" else None
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"]]
    return {"workload": workload, "streams": n, "arrival": "closed" if rate is None else f"poisson {rate:g}/s",
            "front_processes": front_processes,
            "client": client if client == "httpx" else f"openai x{client_processes}", "wall_s": round(wall, 2),
            "lost": len(results) - len(ok), "tokens": tokens, "sse_events": events,
            **({"valid": sum(r["valid"] for r in ok)} if client == "openai" else {}),
            "tok_per_s": round(tokens / wall, 1),
            "ttft_p50_s": round(float(np.median(ttft)), 3) if ttft else None,
            "ttft_p99_s": round(float(np.quantile(ttft, 0.99)), 3) if ttft else None,
            "loop_cpu_s": round(loop_cpu, 2), "loop_ms_per_request": round(1e3 * loop_cpu / max(len(ok), 1), 2),
            "loop_us_per_token": round(1e6 * loop_cpu / max(tokens, 1), 1),
            "server_cpu_ms_per_request": round(1e3 * server["process_cpu_s"] / max(len(ok), 1), 2),
            "client_cpu_ms_per_request": round(1e3 * client_cpu / max(len(results), 1), 2),
            "first_errors": sorted({r["error"] for r in results if "error" in r})[:3]}


def _wait_healthy(httpx: Any, url: str, child: Any, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"the stubbed server exited with {child.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the stubbed server was not healthy within {timeout_s:.0f} s")


def print_profile(path: Path, top: int = 30) -> None:
    """The server event loop's functions by their own time, then by cumulative time."""
    import pstats

    for key in ("tottime", "cumulative"):
        pstats.Stats(str(path)).sort_stats(key).print_stats(top)


def serving_main(tokenizer: Any, args: argparse.Namespace) -> None:
    """`--serving`: the fastest of `--repeat` runs, printed and (unless `--no-write`) written."""
    runs = []
    for _ in range(args.repeat):
        runs.append(serving_run(tokenizer, args.serving, args.max_tokens, args.grammar_threads, args.workload,
                                args.acomplete, args.profile, parse_rows(args.graph_rows), args.warm, args.serial,
                                parse_device_ms(args.device_ms), args.timeline))
        print(runs[-1], flush=True)
    if args.profile:
        print_profile(Path(f"{args.profile}.engine"))
    best = max(runs, key=lambda r: r["host_tok_per_s"])
    if not args.no_write:
        row = {"system": "structgen", "model": "smollm2-135m", "workload": args.workload, "metric": "tokens_per_s",
               "value": best["host_tok_per_s"], "graph_rows": args.graph_rows or "default", **best}
        print("wrote", write_results("host_serving", [row], extra={
            "device": "cpu", "runs": args.repeat,
            "note": "the whole in-process front on a stubbed device (no forward): host time only; the "
                    "fastest of `runs`; CPU figures on a shared machine: noisy"}))


class MethodTimer:
    """Wall seconds spent in, and calls of, some methods of one object (wrappers set on the
    instance)."""

    def __init__(self, obj: Any, names: tuple[str, ...]):
        self.seconds = 0.0
        self.calls = 0
        for name in names:
            setattr(obj, name, self._wrap(getattr(obj, name)))

    def _wrap(self, f):
        @functools.wraps(f)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            self.calls += 1
            try:
                return f(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        return timed


def burst_host_us(engine: Engine, stub: StubDevice, prompt: list[int], grammar: Any, batch: int,
                  spec_timer: MethodTimer, tail: int) -> dict[str, Any]:
    """Host microseconds per step (the stub's time taken out) of `batch` JSON requests whose
    budgets run from 8 to 7 + `batch` tokens, run to the end: the median and mean step, the
    mean time inside the speculator's per-step calls (`spec_timer`), and the burst's tail
    (steps with `tail` or fewer requests running or waiting): its host time and how many of
    its decode steps found their forward launched ahead (`ahead`: on a GPU the others make the
    device wait for the host's bookkeeping)."""
    stop = frozenset(engine.stop_token_ids)
    spec_before = spec_timer.seconds
    reqs = [Request(prompt, SamplingParams(max_tokens=8 + i), grammar.matcher(), stop) for i in range(batch)]
    for r in reqs:
        engine.add_request(r)
    graphs, sched = engine.runner.graphs, engine.scheduler
    each: list[float] = []
    tail_s, tail_steps, tail_graph, tail_ahead = 0.0, 0, 0, 0
    while engine.has_work():
        in_tail = len(sched.running) + len(sched.waiting) <= tail
        runs, ahead = graphs.steps, graphs.steps_ahead
        stub_before, t = stub.seconds, time.perf_counter()
        engine.step()
        each.append(time.perf_counter() - t - (stub.seconds - stub_before))
        if in_tail:
            tail_s, tail_steps = tail_s + each[-1], tail_steps + 1
            tail_graph, tail_ahead = tail_graph + graphs.steps - runs, tail_ahead + graphs.steps_ahead - ahead
    return {"host_us_per_step": 1e6 * float(np.median(each)), "mean_us": 1e6 * sum(each) / len(each),
            "speculator_us": 1e6 * (spec_timer.seconds - spec_before) / len(each),
            "steps": len(each), "tokens": sum(r.num_output for r in reqs),
            "tail_host_ms": 1e3 * tail_s, "tail_steps": tail_steps, "tail_graph_steps": tail_graph,
            "tail_ahead": tail_ahead}


def speculative_main(tokenizer: Any, args: argparse.Namespace) -> None:
    """`--speculative` (the module docstring): plain and no-draft speculative steps alternated."""
    from structgen.engine.config import SpeculativeConfig
    from structgen.engine.speculative.policy import Acceptance
    from structgen.engine.speculative.speculator import Speculator
    from structgen.grammar import GrammarCompiler, dump_json
    from structgen.types import JsonSchema, to_constraint

    batch = max(int(b) for b in args.batches.split(","))
    engine = tiny_engine(tokenizer, batch, tuning=EngineTuning(grammar_threads=args.grammar_threads,
                                                                mask_prefetch=args.mask_prefetch))
    engine.use_tokenizer(tokenizer)
    grammar = GrammarCompiler(tokenizer, engine.model_config.vocab_size, sorted(engine.stop_token_ids)).compile(
        to_constraint(JsonSchema(SCHEMA)))
    text = dump_json(INSTANCE, SCHEMA)
    stub = TextFollowingDevice(engine, tokenizer, text, min(engine.stop_token_ids))
    spec = Speculator(engine, SpeculativeConfig(max_requests=args.max_requests))
    spec.use_tokenizer(tokenizer)
    spec.policy.engine_wide = Acceptance(0.0, 1.0)  # drafts never accepted: none pays
    timer = MethodTimer(spec, ("drafts", "skips_verify", "plan_step"))  # the engine's calls
    asked = MethodTimer(spec.drafter, ("candidates",))  # a draft for one request
    prompt = tokenizer.encode(chat(tokenizer, f"{PROMPT} Source: {text}"), add_special_tokens=False)
    rows = []
    tail = args.max_requests or batch  # the steps the speculator sees
    for speculator in (None, spec):  # warm-up
        engine.speculator = speculator
        burst_host_us(engine, stub, prompt, grammar, batch, timer, tail)
    for rnd in range(args.repeat):
        for name, speculator in (("plain", None), ("speculative", spec)):
            engine.speculator = speculator
            rows.append({"engine": name, "batch": batch, "round": rnd,
                         **{k: round(v, 1) for k, v in burst_host_us(engine, stub, prompt, grammar, batch, timer, tail).items()}})
            print(rows[-1], flush=True)
    engine.speculator = None
    print_table(rows)
    print("decisions", dict(spec.policy.decisions), "weighed", spec.policy.weighed, "drafter_calls", asked.calls)
    if not args.no_write:
        print("wrote", write_results("host_speculative", rows, extra={
            "device": "cpu", "decisions": dict(spec.policy.decisions), "weighed": spec.policy.weighed,
            "drafter_calls": asked.calls, "max_requests": args.max_requests,
            "note": "host microseconds per step, device stubbed, JSON rows with jump-forward; plain engine "
                    "and n-gram speculation whose policy drafts nothing, alternated; CPU figures on a "
                    "shared machine: noisy"}))


def parse_device_ms(text: str | None) -> tuple[float, float]:
    """`--device-ms` ("FIXED,PER_1K_ROWS") as StubDevice's `device_ms`; none: (0, 0)."""
    if not text:
        return (0.0, 0.0)
    fixed, per_1k_rows = (float(v) for v in text.split(","))
    return (fixed, per_1k_rows)


def parse_rows(text: str | None) -> tuple[int, ...] | None:
    """`--graph-rows` ("1,2,4,...") as `EngineTuning.cuda_graph_batch_sizes`, or None (the default)."""
    return tuple(int(r) for r in text.split(",")) if text else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--repeat", type=int, default=3, help="runs per row; the fastest is kept (a shared host is noisy)")
    ap.add_argument("--grammar-threads", type=int, default=0, help="EngineTuning.grammar_threads (0: auto)")
    ap.add_argument("--mask-prefetch", default="off", choices=["auto", "on", "off"], help="EngineTuning.mask_prefetch")
    ap.add_argument("--tokenizer-dir", type=Path, default=None, help="SmolLM2 tokenizer files (default: the model's)")
    ap.add_argument("--serving", type=int, default=0, metavar="N", help="N streams through the whole front (see above)")
    ap.add_argument("--max-tokens", type=int, default=64, help="--serving: max_tokens of each stream")
    ap.add_argument("--workload", default=None, choices=WORKLOADS,
                    help="bench_serving's workload (default: json with --serving, agent with --http)")
    ap.add_argument("--one-schema", dest="workload", action="store_const", const="json-one", help="--serving: --workload json-one")
    ap.add_argument("--serial", action="store_true", help="--serving: one request at a time (default: all at once)")
    ap.add_argument("--acomplete", action="store_true", help="--serving: LLM.acomplete instead of LLM.astream")
    ap.add_argument("--graph-rows", default=None, help="--serving: decode graph row buckets, e.g. 1,2,4,...,1024")
    ap.add_argument("--device-ms", default=None, metavar="FIXED,PER_1K_ROWS",
                    help="--serving: device milliseconds a forward takes, e.g. 2,2 (default: none, host time only)")
    ap.add_argument("--timeline", action="store_true", help="--serving: print the measured burst's steps")
    ap.add_argument("--warm", action="store_true", help="--serving: measure the burst's second run (prefix cache hits)")
    ap.add_argument("--http", type=int, default=0, metavar="N", help="N streams over HTTP to the stubbed server")
    ap.add_argument("--rate", type=float, default=None, help="--http: Poisson arrivals per second (default: all at once)")
    ap.add_argument("--profile", type=Path, default=None, help="--http, --serving: cProfile the event loop into this file (--serving: the engine thread into FILE.engine)")
    ap.add_argument("--client", default="httpx", choices=["httpx", "openai"],
                    help="--http: SSE lines read with json.loads, or bench_serving's openai client driver")
    ap.add_argument("--client-processes", type=int, default=1, help="--http --client openai: client processes")
    ap.add_argument("--front-processes", type=int, default=0, help="--http: `structgen serve --front-processes`")
    ap.add_argument("--serve-stubbed", type=int, default=0, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--max-batch", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--stats-out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--speculative", action="store_true", help="plain vs no-draft speculative steps (see above)")
    ap.add_argument("--max-requests", type=int, default=0,
                    help="--speculative: SpeculativeConfig.max_requests (0: the speculator sees every step)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.workload is None:
        args.workload = "agent" if args.http else "json"
    if args.serve_stubbed:
        serve_stubbed(args.serve_stubbed, args.max_batch, args.stats_out, args.profile_out, args.workload,
                      args.front_processes)
        return
    if args.http:
        print(http_run(args.http, args.max_tokens, args.rate, args.profile, args.workload, args.client,
                       args.client_processes, args.front_processes))
        if args.profile:
            print_profile(args.profile)
        return
    from structgen.engine.models.loader import load_tokenizer, resolve_model
    from structgen.grammar import GrammarCompiler, dump_json
    from structgen.types import JsonSchema, to_constraint

    tokenizer = load_tokenizer(args.tokenizer_dir or resolve_model(progress=False))
    if args.serving:
        serving_main(tokenizer, args)
        return
    if args.speculative:
        speculative_main(tokenizer, args)
        return
    batches = [int(b) for b in args.batches.split(",")]
    engine = tiny_engine(tokenizer, max(batches), jump_forward=False,
                         tuning=EngineTuning(grammar_threads=args.grammar_threads, mask_prefetch=args.mask_prefetch))
    cfg = engine.model_config
    grammar = GrammarCompiler(tokenizer, cfg.vocab_size, sorted(engine.stop_token_ids)).compile(
        to_constraint(JsonSchema(SCHEMA)))
    text = dump_json(INSTANCE, SCHEMA)
    assert grammar.accepts(text), "the instance must be valid for the schema"
    stub = StubDevice(engine, tokenizer, text, min(engine.stop_token_ids))
    phases = PhaseTimer()
    prompt = tokenizer.encode(chat(tokenizer, PROMPT), add_special_tokens=False)
    rows = []
    try:
        host_us_per_step(engine, stub, phases, prompt, batches[0], grammar, 16)  # warm-up
        for batch in batches:
            for constrained in (False, True):
                r = min((host_us_per_step(engine, stub, phases, prompt, batch, grammar if constrained else None,
                                          args.steps) for _ in range(args.repeat)), key=lambda x: x["host_us_per_step"])
                rows.append({"batch": batch, "constrained": constrained,
                             **{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}})
                print(rows[-1], flush=True)
    finally:
        phases.restore()
    print_table(rows)
    if not args.no_write:
        print("wrote", write_results("host", rows, extra={
            "device": "cpu", "grammar_threads": args.grammar_threads, "mask_prefetch": args.mask_prefetch, "instance": text,
            "note": "host microseconds per decode step, device stubbed (forward: none; sampler: the "
                    "next token of a valid instance for JSON rows); SmolLM2 vocabulary, xgrammar. "
                    "CPU figures on a shared machine: noisy"}))


if __name__ == "__main__":
    main()
