"""Speculative decoding benchmark: mean acceptance length and end-to-end speedup over no
speculation, on extraction prompts built from MaskBench JME (NousResearch json-mode-eval).

Each prompt holds the schema and the schema's valid instance rendered as prose; the model
(real SmolLM2-135M-Instruct weights, greedy) extracts the JSON under the schema's grammar.
Variants: no speculation; n-gram (prompt lookup) drafting with and without grammar-aware
drafting, `-late` without drafting the next step while the device waits (its verify forward
is launched after this step's bookkeeping instead of at once), `-fixed` drafting the whole k
every step (no `DraftPolicy`: speculative/policy.py), `-capturable` in the capturable
guided decoding mode (engine/guided_loop.py: the step's host work as callbacks inside a loop of
CUDA graphs; `identical_to_usual_mode` counts its outputs equal to the plain n-gram variant's); the self-draft (the target's first layers + its LM head); each with jump-forward on
and off. Greedy speculation is lossless, so every variant must produce the baseline's exact
tokens (`identical` counts those that do).

    python -m benchmarks.bench_speculative                       # 20 prompts, batch 1, k = 3
    python -m benchmarks.bench_speculative --limit 3 --methods ngram --jump-forward on   # smoke
    python -m benchmarks.bench_speculative --targets    # issue #32's targets, one results file

`--targets` measures what issue #32 asks, n-gram drafting with k = 3 and jump-forward on, in
each `--modes` (batch_invariant off, the default, and on; one engine per mode, built in turn:
the mode is process-wide): (a) the prompts at batch 1: decode speedup and how many greedy
outputs equal plain decoding's; (b) `--target-batches` (16, 64) over as many requests (the
prompts repeated): tokens/s with speculation over without (the target: never below 1.0x).
Each row counts the speculative run's steps by the draft policy's choice (`steps_untimed`:
its plain bucket not timed yet, `steps_plain`, `steps_pays`: drafted because it pays,
`steps_trial`: drafted to time a verify bucket; speculative/policy.py), and each engine's
time in the batch's tail (`*_tail_ms`: steps with `max_requests` or fewer requests left, the
only ones the speculator sees; `*_tail_longest_ms` its longest step, `*_tail_ahead` its decode-graph
steps whose forward was launched ahead, of all its decode-graph steps) and its longest step
(`*_longest_step_ms`: a stall or a compile).
`--target-max-requests 0` lets the speculator see every step; `rounds_tokens_per_s_ratio` and
`rounds_tail_ms` (plain, n-gram) are in run order (the 2nd, 4th, ... rounds run n-gram first;
`--target-rounds` is rounded up to an even count); a row is its median round, with
`pooled_tokens_per_s_ratio` over all its rounds' tokens and time, and `order_effect`: that
ratio over the rounds that ran plain decoding first, divided by the same over the others
(1.0 where nothing drifts within a round).
It writes benchmarks/results/speculative_targets-<device>-<date>.json.

Metrics: `mean_acceptance_length` = tokens sampled per verify step (accepted drafts + the
target's own token; forced jump-forward tokens excluded), `forward_passes_per_token`,
`ms_per_token` (wall time / output tokens), `speedup` (no-speculation ms_per_token / this),
`decode_ms_per_token` / `decode_speedup` (the same from each request's first token on, i.e.
without the prompt's prefill step, which speculation does not touch), and
`decode_speedup_identical`: the same ratio over only the prompts whose output equals the
baseline's token for token (on the GPU, bf16 near-ties can flip a greedy choice because the
verify forward runs a different batch shape; a changed output changes the token count).
On a GPU, `graph_floor_ms_per_token` is the variant's decode steps re-timed as back-to-back
graph replays (no host in between; `GraphFloor`) and `x_graph_floor` its decode ms over that:
no mode that only moves the host's work (the capturable one) can go below the floor.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import maskbench_dir, print_table, write_results
from structgen import LLM, JsonSchema
from structgen.engine.config import EngineConfig, SpeculativeConfig
from structgen.engine.request import Request
from structgen.engine.speculative.speculator import Speculator
from structgen.errors import StructgenError
from structgen.sampling import SamplingParams

JME = maskbench_dir() / "JME.jsonl"  # $STRUCTGEN_SHARED honoured, as every benchmark does


@dataclass
class Case:
    id: str
    prompt_ids: list[int]
    schema: dict


# -- workload ---------------------------------------------------------------------------------
def words(key: str) -> str:
    """`securityProtocol` / `security_protocol` -> `security protocol`."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", key).replace("_", " ").strip().lower()


def prose(value: Any, path: tuple[str, ...] = ()) -> list[str]:
    """Sentences stating every leaf of a JSON instance: "The ssid is OfficeNetSecure." """
    subject = "The " + " ".join(path) if path else "The record"
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in prose(v, (*path, words(k)))]
    if isinstance(value, list):
        if all(not isinstance(v, dict | list) for v in value):
            items = [str(v) for v in value]
            listed = ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else "".join(items) or "none"
            return [f"{subject} are {listed}."]
        return [s for i, v in enumerate(value) for s in prose(v, (*path, f"item {i + 1}"))]
    if value is None:
        return [f"{subject} is unknown."]
    if isinstance(value, bool):
        return [f"{subject} is {'yes' if value else 'no'}."]
    return [f"{subject} is {value}."]


def extraction_prompt(schema: dict, instance: dict) -> str:
    return (
        "Extract the information in the text as JSON that follows the schema.\n\n"
        f"Schema:\n{json.dumps(schema)}\n\nText:\n{' '.join(prose(instance))}"
    )


def load_cases(llm: LLM, path: Path, limit: int, max_prompt_tokens: int) -> list[Case]:
    cases: list[Case] = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        valid = [t["data"] for t in row["tests"] if t["valid"] and isinstance(t["data"], dict) and t["data"]]
        if not isinstance(row["schema"], dict) or not valid:
            continue
        try:
            llm.compile(JsonSchema(row["schema"]))
        except (StructgenError, ValueError, TypeError, RecursionError):
            continue
        ids = llm.encode_prompt(extraction_prompt(row["schema"], valid[0]))
        if len(ids) > max_prompt_tokens:
            continue
        cases.append(Case(row["id"], ids, row["schema"]))
        if len(cases) == limit:
            break
    return cases


# -- running ------------------------------------------------------------------------------------
def run(llm: LLM, cases: list[Case], batch: int, jump_forward: bool, max_tokens: int) -> tuple[float, list[Request]]:
    """Wall time and finished requests for `cases`, `batch` at a time (engine stepped here)."""
    eng, stop = llm.engine, frozenset(llm.engine.stop_token_ids)
    done: list[Request] = []
    t0 = time.perf_counter()
    for i in range(0, len(cases), batch):
        reqs = [
            Request(c.prompt_ids, SamplingParams(max_tokens=max_tokens, jump_forward=jump_forward),
                    llm.compile(JsonSchema(c.schema)).matcher(), stop)
            for c in cases[i : i + batch]
        ]
        eng.run(reqs)
        done += reqs
    return time.perf_counter() - t0, done


def summarize(name: str, batch: int, jf: bool, k: int, wall: float, reqs: list[Request], base: list[Request] | None) -> dict:
    tokens = sum(r.num_output for r in reqs)
    steps = sum(r.stats.verify_steps for r in reqs)
    accepted = sum(r.stats.accepted_tokens for r in reqs)
    row = {
        "system": name, "model": "smollm2-135m", "batch": batch, "constrained": True, "jump_forward": jf,
        "draft_len": k, "prompts": len(reqs), "tokens": tokens,
        "mean_acceptance_length": (accepted + steps) / steps if steps else 1.0,
        "drafted": sum(r.stats.drafted_tokens for r in reqs), "accepted": accepted,
        "forced": sum(r.stats.forced_tokens for r in reqs),
        "forward_passes_per_token": sum(r.stats.forward_passes for r in reqs) / max(tokens, 1),
        "ms_per_token": 1e3 * wall / max(tokens, 1), "wall_s": wall,
        # First token -> finish: without the prompt's prefill step, which speculation cannot speed up.
        "decode_ms_per_token": 1e3 * sum(r.stats.decode_s for r in reqs) / max(sum(r.num_output - 1 for r in reqs), 1),
        "errors": sum(r.finish_reason == "error" for r in reqs),
    }
    if base is not None:
        same = [(a, b) for a, b in zip(reqs, base, strict=True) if a.output_ids == b.output_ids]
        row["identical"] = len(same)
        # On the prompts whose output equals the baseline's (same tokens, so a fair ratio):
        # bf16 near-ties can flip a greedy choice when the verify forward's batch shape differs.
        spec_s = sum(a.stats.decode_s for a, _ in same)
        row["decode_speedup_identical"] = sum(b.stats.decode_s for _, b in same) / spec_s if spec_s else None
    return row


class PolicyTrace:
    """What the draft policy chose in one run: steps by total drafts asked for, and its cost
    tables at the end (us per step by row bucket, without and with drafts): why an adaptive
    run reads slower than `-fixed`."""

    def __init__(self, speculator: Speculator | None) -> None:
        self.policy = speculator.policy if speculator is not None and speculator.adaptive else None
        self.drafts: Counter[int] = Counter()

    def __enter__(self) -> PolicyTrace:
        if self.policy is not None:
            decide = self.policy.draft_lengths

            def traced(reqs: list[object], budgets: list[int], rows: int) -> list[int]:
                lengths = decide(reqs, budgets, rows)
                self.drafts[sum(lengths)] += 1
                return lengths

            self.policy.draft_lengths = traced
        return self

    def __exit__(self, *exc: object) -> None:
        if self.policy is not None:
            del self.policy.draft_lengths  # the class's method again

    def row(self) -> dict[str, Any]:
        if self.policy is None:
            return {}
        costs = {name: {b: round(1e6 * t, 1) for b, t in sorted(table.seconds.items())}
                 for name, table in (("plain", self.policy.plain), ("verify", self.policy.verify))}
        return {"steps_by_drafts": dict(sorted(self.drafts.items())), "policy_costs_us": costs}


class GraphFloor:
    """What a variant would cost with no host time at all: each decode step it ran through the
    decode graphs (buckets of at most 16 rows: prompts run in larger ones), re-timed as
    back-to-back replays of that bucket's forward + sampler, summed over the variant's decoded
    tokens. A mode that only moves host work (the capturable mode) cannot beat it."""

    def __init__(self, graphs: Any) -> None:
        from structgen.engine.cuda_graphs import DecodeGraphs

        self.graphs, self.counts = graphs, {}
        self.on = False
        original = DecodeGraphs.run

        def counted(this, step, *a, **kw):
            if self.on and this is self.graphs:
                bs = this.bucket(len(step.rows))
                if bs is not None and bs <= 16:
                    self.counts[bs] = self.counts.get(bs, 0) + 1
            return original(this, step, *a, **kw)

        DecodeGraphs.run = counted
        self._ms: dict[int, float] = {}

    def step_ms(self, bs: int, n: int = 200) -> float:
        """ms per back-to-back (forward, sampler) replay of bucket `bs`."""
        import torch

        if bs not in self._ms:
            forward, sample = self.graphs._steps[bs]
            for _ in range(10):
                forward()
                sample()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(n):
                forward()
                sample()
            end.record()
            end.synchronize()
            self._ms[bs] = start.elapsed_time(end) / n
            self.graphs.discard_ahead()  # the replays rewrote what a pre-launched forward computed
        return self._ms[bs]

    def take(self, decoded_tokens: int) -> dict[str, Any]:
        """The floor of the steps counted since the last call, per decoded token."""
        counts, self.counts = self.counts, {}
        ms = sum(c * self.step_ms(bs) for bs, c in counts.items())
        return {"graph_steps": dict(sorted(counts.items())),
                "graph_floor_ms_per_token": ms / max(decoded_tokens, 1)}


class StepProfile:
    """`--profile`: wall time inside the step's phases (host clock). `wait` is the host blocked
    on the device (the graphs' one sync per step): step time minus wait is host work the
    device does not overlap."""

    PHASES = {
        "structgen.engine.speculative.speculator:Speculator": ("propose", "_forward_and_sample", "_accept", "_plan_next"),
        "structgen.engine.speculative.speculator:VerifyStep": ("fill_masks", "plan_next"),
        "structgen.engine.engine:Engine": ("step", "_decode_step", "_advance", "_fill_masks"),
        "structgen.engine.scheduler:Scheduler": ("schedule",),
        "structgen.engine.cuda_graphs:DecodeGraphs": ("run",),
        "structgen.engine.model_runner:ModelRunner": ("extend",),
        "structgen.engine.jump_forward:JumpForward": ("__call__",),
    }

    def __init__(self) -> None:
        import importlib

        import torch

        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        for where, names in self.PHASES.items():
            mod, cls_name = where.split(":")
            cls = getattr(importlib.import_module(mod), cls_name)
            for name in names:
                fn = cls.__dict__[name]
                wrapped = self._timed(f"{cls_name}.{name}", fn.__func__ if isinstance(fn, staticmethod) else fn)
                setattr(cls, name, staticmethod(wrapped) if isinstance(fn, staticmethod) else wrapped)
        if torch.cuda.is_available():
            torch.cuda.Event.synchronize = self._timed("wait", torch.cuda.Event.synchronize)

    def _timed(self, key: str, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.totals[key] = self.totals.get(key, 0.0) + time.perf_counter() - t
                self.counts[key] = self.counts.get(key, 0) + 1
        return wrapper

    def report(self, label: str) -> None:
        parts = [f"{k.split('.')[-1] if k.count('.') == 0 else k} {1e3 * v / self.counts[k]:.3f} ms x{self.counts[k]}"
                 for k, v in sorted(self.totals.items())]
        print(f"  profile {label}: " + "; ".join(parts))
        self.totals.clear()
        self.counts.clear()


# -- issue #32's targets ------------------------------------------------------------------------
TARGET_K = 3


class StepClock:
    """Wall time of every engine step while installed (a wrapper on the engine instance), split
    by the batch's tail: steps with at most `tail` requests running or waiting; and, in the
    tail, how many steps ran in the decode graphs and how many of those found their forward
    launched ahead (the others made the device wait for the host's bookkeeping)."""

    def __init__(self, engine: Any, tail: int) -> None:
        self.engine, self.tail = engine, tail
        self.steps: list[tuple[int, float]] = []  # (requests, seconds)
        self.tail_graph_steps = self.tail_ahead = 0
        self.tail_traced: list[tuple[float, str]] = []  # (seconds, what the step was)

    def __enter__(self) -> StepClock:
        step, sched, graphs = self.engine.step, self.engine.scheduler, self.engine.runner.graphs

        def timed() -> list[Request]:
            n, t = len(sched.running) + len(sched.waiting), time.perf_counter()
            runs, ahead = (graphs.steps, graphs.steps_ahead) if graphs is not None else (0, 0)
            spec = self.engine.speculator
            decided = spec.policy.decisions.copy() if spec is not None else Counter()
            try:
                return step()
            finally:
                seconds = time.perf_counter() - t
                self.steps.append((n, seconds))
                if n <= self.tail:
                    ran, early = (graphs.steps - runs, graphs.steps_ahead - ahead) if graphs is not None else (0, 0)
                    self.tail_graph_steps += ran
                    self.tail_ahead += early
                    kinds = ",".join(sorted((spec.policy.decisions - decided) if spec is not None else ())) or "-"
                    self.tail_traced.append((seconds, f"{n} requests, decided {kinds}, graph steps {ran} (ahead {early})"))

        self.engine.step = timed
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.step

    def row(self, name: str) -> dict[str, Any]:
        tail = [s for n, s in self.steps if n <= self.tail]
        return {f"{name}_tail_ms": 1e3 * sum(tail), f"{name}_tail_steps": len(tail),
                f"{name}_tail_longest_ms": 1e3 * max(tail, default=0.0),
                f"{name}_tail_ahead": f"{self.tail_ahead}/{self.tail_graph_steps}",
                f"{name}_steps": len(self.steps), f"{name}_longest_step_ms": 1e3 * max(s for _, s in self.steps),
                # where a tail's time went: its slowest steps, and what each was
                f"{name}_tail_slowest": [f"{1e3 * s:.2f} ms: {what}" for s, what in sorted(self.tail_traced)[::-1][:3]]}


def parting(a: list[int], b: list[int]) -> int:
    """The first position where token lists `a` and `b` differ (one ending counts)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def timed_pair(llm: LLM, spec: Speculator, cases: list[Case], batch: int, max_tokens: int,
               ngram_first: bool = False) -> dict[str, Any]:
    """Plain decoding and n-gram speculation over `cases`, `batch` at a time (each after a
    warm-up at that batch), plain first unless `ngram_first`: the ratios the targets are about
    and the identical outputs, and where each run's time went (its tail of `max_requests` or
    fewer requests, its longest step)."""
    eng, result, clocks = llm.engine, {}, {}
    pair = (("plain", None), ("ngram", spec))
    for name, speculator in pair[::-1] if ngram_first else pair:
        eng.speculator = speculator
        run(llm, cases[:batch], batch, True, max_tokens)  # warm-up: Triton JIT, graphs, allocator
        gc.collect()  # a collection inside a sub-second run moves its rate by several percent
        before = spec.policy.decisions.copy()
        stops, shadowed = spec.policy.blocks.total(), spec.policy.shadowed
        with StepClock(eng, spec.config.max_requests) as clocks[name]:
            result[name] = run(llm, cases, batch, True, max_tokens)
    eng.speculator = None
    decided = spec.policy.decisions - before  # the measured run's steps by the policy's choice
    (plain_s, plain), (spec_s, spec_reqs) = result["plain"], result["ngram"]
    plain_tokens, spec_tokens = sum(r.num_output for r in plain), sum(r.num_output for r in spec_reqs)
    decode = [sum(r.stats.decode_s for r in reqs) / max(sum(r.num_output - 1 for r in reqs), 1)
              for reqs in (plain, spec_reqs)]
    return {"batch": batch, "requests": len(cases),
            "identical": sum(a.output_ids == b.output_ids for a, b in zip(spec_reqs, plain, strict=True)),
            # where the others part: (request, first differing output position, its verify steps)
            "differ": [(i, parting(a.output_ids, b.output_ids), a.stats.verify_steps)
                       for i, (a, b) in enumerate(zip(spec_reqs, plain, strict=True)) if a.output_ids != b.output_ids],
            "plain_tokens": plain_tokens, "plain_s": plain_s, "ngram_tokens": spec_tokens, "ngram_s": spec_s,
            "plain_tokens_per_s": plain_tokens / plain_s, "ngram_tokens_per_s": spec_tokens / spec_s,
            "tokens_per_s_ratio": (spec_tokens / spec_s) / (plain_tokens / plain_s),
            "decode_ms_per_token_plain": 1e3 * decode[0], "decode_ms_per_token_ngram": 1e3 * decode[1],
            "decode_speedup": decode[0] / decode[1] if decode[1] else None,
            "errors": sum(r.finish_reason == "error" for r in (*plain, *spec_reqs))} | {
            f"steps_{kind}": decided[kind] for kind in ("untimed", "plain", "pays", "trial")} | {
            # drafting stopped by its realized rate; drafts scored unseen (speculative/policy.py)
            "realized_stops": spec.policy.blocks.total() - stops, "unseen_drafts": spec.policy.shadowed - shadowed} | (
            clocks["plain"].row("plain") | clocks["ngram"].row("ngram"))


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round of the median tokens/s ratio."""
    return sorted(rounds, key=lambda r: r["tokens_per_s_ratio"])[len(rounds) // 2]


def pooled_ratio(rounds: list[dict[str, Any]]) -> float:
    """N-gram speculation's tokens/s over plain decoding's, each over all its rounds' tokens and
    time: a round's ratio moves by tens of percent at batch 64 (a sub-second run), the pooled
    one by what the rounds share."""
    def rate(name: str) -> float:
        return sum(r[f"{name}_tokens"] for r in rounds) / sum(r[f"{name}_s"] for r in rounds)
    return rate("ngram") / rate("plain")


def measure_targets(args: argparse.Namespace, invariant: bool) -> list[dict[str, Any]]:
    """(a) and (b) of `--targets` (the module docstring) with one engine in one mode."""
    llm = LLM(backend=args.backend, config=EngineConfig(device=args.device, max_seq_len=2048, max_batch_size=64,
                                                        batch_invariant=invariant))
    eng = llm.engine
    cases = load_cases(llm, args.data, args.limit, args.max_prompt_tokens)
    eng.speculator = None
    _, first = run(llm, cases, 1, True, args.max_tokens)
    # Only prompts whose greedy output completes: a looping output is trivially easy to draft.
    kept = [c for c, r in zip(cases, first, strict=True) if r.finish_reason == "stop"]
    config = SpeculativeConfig(num_draft_tokens=TARGET_K)
    if args.target_max_requests is not None:
        config = SpeculativeConfig(num_draft_tokens=TARGET_K, max_requests=args.target_max_requests)
    spec = Speculator(eng, config)
    spec.use_tokenizer(llm.tokenizer)
    mode = {"batch_invariant": invariant, "prompts": len(cases), "complete": len(kept), "draft_len": TARGET_K,
            "max_requests": config.max_requests}
    rows = [mode | timed_pair(llm, spec, kept, 1, args.max_tokens)]
    if not invariant or args.target_batches_invariant:
        for batch in (int(b) for b in args.target_batches.split(",") if b):
            work = (kept * -(-batch // max(len(kept), 1)))[:batch]
            # Rounds alternate which engine runs first, as many of each, so drift within a round
            # (clocks, the allocator, Python's heap) favours neither: it moved batch 64 more than
            # speculation did (docs/performance.md, "On the H200 after 940d5c7"; `order_effect`).
            rounds = [timed_pair(llm, spec, work, batch, args.max_tokens, ngram_first=i % 2 == 1)
                      for i in range(2 * -(-args.target_rounds // 2))]
            ratios = [round(r["tokens_per_s_ratio"], 3) for r in rounds]  # in run order: warm-up effects show
            tails = [(round(r["plain_tail_ms"], 1), round(r["ngram_tail_ms"], 1)) for r in rounds]
            rows.append(mode | median_round(rounds) | {
                "rounds_tokens_per_s_ratio": ratios, "rounds_tail_ms": tails,
                "pooled_tokens_per_s_ratio": pooled_ratio(rounds),
                # the pooled ratio of the rounds that ran plain decoding first over the others'
                "order_effect": pooled_ratio(rounds[::2]) / pooled_ratio(rounds[1::2])})
    llm.close()
    return rows


def run_targets(args: argparse.Namespace) -> None:
    """`--targets`: every mode in turn, one table, one results file."""
    rows: list[dict[str, Any]] = []
    for mode in args.modes.split(","):
        rows += measure_targets(args, invariant=mode == "invariant")
        gc.collect()
    shown = ["batch_invariant", "max_requests", "batch", "requests", "complete", "identical", "decode_speedup",
             "tokens_per_s_ratio", "plain_tokens_per_s", "ngram_tokens_per_s", "errors",
             "steps_untimed", "steps_plain", "steps_pays", "steps_trial", "realized_stops", "unseen_drafts",
             "plain_tail_ms", "ngram_tail_ms",
             "plain_tail_steps", "ngram_tail_steps", "plain_tail_longest_ms", "ngram_tail_longest_ms",
             "plain_tail_ahead", "ngram_tail_ahead", "plain_longest_step_ms", "ngram_longest_step_ms",
             "rounds_tokens_per_s_ratio", "pooled_tokens_per_s_ratio", "order_effect", "rounds_tail_ms"]
    print_table([{c: r.get(c) for c in shown} for r in rows])
    for r in rows:
        print(f"batch {r['batch']}, invariant {r['batch_invariant']}: outputs that differ {r['differ']}")
        print(f"batch {r['batch']}, invariant {r['batch_invariant']}: slowest tail steps, plain "
              f"{r['plain_tail_slowest']}, n-gram {r['ngram_tail_slowest']}")
    if not args.no_write:
        path = write_results("speculative_targets", rows, extra={
            "settings": vars(args) | {"data": str(args.data)},
            "targets": "batch 1: identical == complete and decode_speedup >= 1.8; batches 16, 64: "
                       "tokens_per_s_ratio (the median round) and pooled_tokens_per_s_ratio >= 1.0"})
        print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=JME)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=1536)
    ap.add_argument("--draft-len", default="3", help="draft length k, or a comma list (n-gram only beyond the first)")
    ap.add_argument("--batches", default="1", help="comma list of batch sizes, e.g. 1,16,64")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each prompt this many times (fills batch 64 from fewer prompts)")
    ap.add_argument("--methods", default="ngram,self_draft", help="comma list of ngram, self_draft")
    ap.add_argument("--self-draft-layers", type=int, default=8)
    ap.add_argument("--jump-forward", choices=("on", "off", "both"), default="both")
    ap.add_argument("--device", default=None)
    ap.add_argument("--backend", default="auto", help="grammar backend: auto, xgrammar, llguidance")
    ap.add_argument("--profile", action="store_true", help="time the step's phases per variant")
    ap.add_argument("--batch-invariant", choices=("on", "off"), default="on", help="EngineConfig.batch_invariant")
    ap.add_argument("--targets", action="store_true", help="issue #32's targets (the module docstring)")
    ap.add_argument("--modes", default="default,invariant", help="--targets: comma list of default, invariant")
    ap.add_argument("--target-batches", default="16,64", help="--targets: the batches of (b)")
    ap.add_argument("--target-batches-invariant", action="store_true",
                    help="--targets: (b) in the invariant mode too (by default in the default mode only)")
    ap.add_argument("--target-rounds", type=int, default=2,
                    help="--targets: rounds of (b), plain then n-gram and the other way round in turn (rounded up to "
                         "an even count); the row keeps the round of the median tokens/s ratio (one round of 64 "
                         "requests moves by several percent) and the pooled ratio")
    ap.add_argument("--target-max-requests", type=int, default=None,
                    help="--targets: SpeculativeConfig.max_requests (default: its default; 0: the speculator "
                         "sees every step, its policy alone decides)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.targets:
        run_targets(args)
        return

    # 64 slots: the decode graphs are captured up to 64 rows, which a verify step of 16 x (1 + 3) fills.
    llm = LLM(backend=args.backend, config=EngineConfig(device=args.device, max_seq_len=2048, max_batch_size=64,
                                                        batch_invariant=args.batch_invariant == "on"))
    profile = StepProfile() if args.profile else None
    eng = llm.engine
    cases = load_cases(llm, args.data, args.limit, args.max_prompt_tokens) * args.repeat
    print(f"{len(cases)} JME extraction prompts on {eng.device}, "
          f"prompt tokens {min(len(c.prompt_ids) for c in cases)}..{max(len(c.prompt_ids) for c in cases)}")
    ks = [int(x) for x in args.draft_len.split(",")]
    variants: list[tuple[str, SpeculativeConfig | None]] = [("structgen-nospec", None)]
    methods = args.methods.split(",")
    for i, k in enumerate(ks):
        tag = "" if i == 0 else f"-k{k}"  # the first draft length keeps the plain names
        if "ngram" in methods:
            variants += [(f"structgen-ngram{tag}", SpeculativeConfig(num_draft_tokens=k)),
                         (f"structgen-ngram-late{tag}", SpeculativeConfig(num_draft_tokens=k)),
                         (f"structgen-ngram-fixed{tag}", SpeculativeConfig(num_draft_tokens=k)),
                         (f"structgen-ngram-capturable{tag}", SpeculativeConfig(num_draft_tokens=k)),
                         (f"structgen-ngram-nogrammar{tag}", SpeculativeConfig(num_draft_tokens=k, grammar_aware=False))]
        if "self_draft" in methods and i == 0:
            for aware, suffix in ((True, ""), (False, "-nogrammar")):
                variants.append((f"structgen-selfdraft{args.self_draft_layers}{suffix}", SpeculativeConfig(
                    method="self_draft", self_draft_layers=args.self_draft_layers, num_draft_tokens=k, grammar_aware=aware)))
    speculators = {name: None if spec is None else Speculator(eng, spec) for name, spec in variants}
    for name, s in speculators.items():
        if "-late" in name:  # each verify forward launched after the step's bookkeeping, as before
            s.drafter.host_only = False
        if "-capturable" in name:  # the capturable mode: verify steps in guided_loop.py's loop
            s.capturable = True
        if "-fixed" in name:  # every request drafts its whole budget, whatever the batch (no DraftPolicy)
            s.adaptive = False
    for s in speculators.values():
        if s is not None:
            s.use_tokenizer(llm.tokenizer)  # what LLM does for a speculator it is built with
    jfs = {"on": [True], "off": [False], "both": [True, False]}[args.jump_forward]

    floor = GraphFloor(eng.runner.graphs) if eng.runner.graphs is not None and eng.runner.graphs.capture_graphs else None
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for jf in jfs:
            # Only prompts whose greedy output completes within max_tokens: a 135M model sometimes
            # loops on a schema with open properties, and a loop is trivially easy to draft.
            eng.speculator = None
            _, first = run(llm, cases, 1, jf, args.max_tokens)
            kept = [c for c, r in zip(cases, first, strict=True) if r.finish_reason == "stop"]
            print(f"batch {batch}, jump_forward={jf}: {len(kept)} of {len(cases)} outputs complete")
            if not kept:
                continue
            base = None
            outputs: dict[str, list[list[int]]] = {}
            for name, spec in variants:
                eng.speculator = speculators[name]  # one engine, its drafters swapped between runs
                run(llm, kept[:1], 1, jf, args.max_tokens)  # warm-up: Triton JIT, allocator
                if profile:
                    profile.report("warm-up")  # dropped
                if floor is not None:
                    floor.on, floor.counts = True, {}
                with PolicyTrace(speculators[name]) as trace:
                    wall, reqs = run(llm, kept, batch, jf, args.max_tokens)
                if floor is not None:
                    floor.on = False
                if profile:
                    profile.report(f"{name} batch={batch} jf={jf}")
                row = summarize(name, batch, jf, 0 if spec is None else spec.num_draft_tokens, wall, reqs, base)
                row.update(trace.row())
                base = base or reqs
                if floor is not None and "-capturable" not in name:  # its loop steps are not `run`s
                    row.update(floor.take(sum(r.num_output - 1 for r in reqs)))
                    row["x_graph_floor"] = row["decode_ms_per_token"] / row["graph_floor_ms_per_token"]
                outputs[name] = [r.output_ids for r in reqs]
                usual = outputs.get(name.replace("-capturable", ""))
                if "-capturable" in name and usual is not None:  # greedy: the mode must not change outputs
                    row["identical_to_usual_mode"] = sum(a == b for a, b in zip(outputs[name], usual, strict=True))
                rows.append(row)
            ref = next(r for r in rows if r["system"] == "structgen-nospec" and r["batch"] == batch and r["jump_forward"] == jf)
            for r in rows:
                if r["batch"] == batch and r["jump_forward"] == jf:
                    r["speedup"] = ref["ms_per_token"] / r["ms_per_token"]
                    r["decode_speedup"] = ref["decode_ms_per_token"] / r["decode_ms_per_token"]
    eng.speculator = None
    shown = ["system", "batch", "jump_forward", "tokens", "identical", "mean_acceptance_length",
             "forward_passes_per_token", "ms_per_token", "speedup", "decode_ms_per_token", "decode_speedup",
             "decode_speedup_identical", "identical_to_usual_mode", "graph_floor_ms_per_token", "x_graph_floor", "errors",
             "steps_by_drafts"]
    print_table([{c: r.get(c) for c in shown} for r in rows])
    if not args.no_write:
        path = write_results("speculative", rows, extra={"settings": vars(args) | {"data": str(args.data)}})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
