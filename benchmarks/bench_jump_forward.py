"""Jump-forward benchmark: forward passes per output token and latency with jump-forward on and
off, at batch 1 and 16, on object-heavy shared schemas (MaskBench JME, Kubernetes, GitHub)
with extraction-style prompts (the schema's valid instance rendered as facts).

Two ways to pick the tokens:

- `model`: the model chooses (real weights). Outputs differ between on and off (re-tokenised
  boundaries change what a model sees), so figures are per output token, and every output is
  validated against its schema.
- `replay`: the output is the schema's valid instance (in the grammar's JSON format), fed as
  the only allowed token at each step on top of the real grammar mask. On and off produce
  identical text, so passes and latency compare exactly; any weights will do, which lets the
  GPU run use random weights of the real shape when the real ones are not on the machine.

With jump-forward on, the held-back end of forced text runs as a one-token guess by default
(`JumpForward.guesses`); `--guesses both` also times jump-forward without guesses
(`structgen-noguesses` rows).

Speedups are off/on wall time, and (`speedup_stopped_in_both`) the ratio of summed request
latencies over the requests that ended with a stop in both runs: a request that loops to
max_tokens in one run otherwise sets the whole wall of a batch-16 run. In model mode
`speedup_same_output` takes only the requests whose text is the same on and off: a model
given the forced text's own tokens can go elsewhere (on the CPU one schema of 16 runs to 382
tokens with jump-forward on, 79 off), and the wall then compares different outputs. At batch 1 the
`speedup_at_equal_pass_cost` rows say what fewer passes alone give: the speedup if every pass
with jump-forward on cost what a pass costs with it off (the prompt's passes and time to first
token as measured). On a GPU, where a pass with forced rows costs at least a decode pass, it is
the ceiling, and the distance to it is what jump-forward costs per pass.

    python -m benchmarks.bench_jump_forward                          # model + replay, batches 1,16
    python -m benchmarks.bench_jump_forward --modes replay --weights random --tokenizer-dir DIR
    python -m benchmarks.bench_jump_forward --modes replay --weights random --shape llama-8b --tokenizer-dir DIR
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import maskbench_dir, model_config, print_table, write_results
from structgen import LLM, JsonSchema
from structgen.engine.config import EngineConfig, EngineTuning, ModelConfig
from structgen.engine.engine import Engine
from structgen.engine.jump_forward import JumpForward, VocabBytes
from structgen.engine.request import Request
from structgen.errors import StructgenError
from structgen.grammar import GrammarMatcher, dump_json
from structgen.grammar.backends.base import FORCED_TEXT_MAX_BYTES, set_only_tokens
from structgen.sampling import SamplingParams
from structgen.types import to_constraint

MASKBENCH = maskbench_dir()
CATEGORIES = ("JME", "Kubernetes", "Github_easy", "Github_medium")


@dataclass
class Case:
    id: str
    schema: dict
    prompt_ids: list[int]
    target: str  # the valid instance in the grammar's format (replay mode)
    next_tokens: dict[int, list[int]] = field(default_factory=dict)  # replay: byte offset -> next token


# -- workload -------------------------------------------------------------------------------------
def extraction_prompt(instance: dict) -> str:
    facts = "; ".join(f"{k}: {json.dumps(v, ensure_ascii=False)}" for k, v in instance.items())
    return f"Extract the record as JSON. Facts: {facts}"


def load_cases(
    llm: LLM, data_dir: Path, categories: Sequence[str], per_category: int, max_tokens: int
) -> list[Case]:
    """Object schemas whose valid instance compiles, is accepted by its grammar, and fits."""
    tok = llm.tokenizer
    cases: list[Case] = []
    for cat in categories:
        n = 0
        for line in (data_dir / f"{cat}.jsonl").read_text().splitlines():
            row = json.loads(line)
            schema = row["schema"]
            valid = [t["data"] for t in row["tests"] if t["valid"] and isinstance(t["data"], dict) and t["data"]]
            if not isinstance(schema, dict) or not valid:
                continue
            try:
                grammar = llm.compile(JsonSchema(schema))
                target = dump_json(valid[0], schema)
            except (StructgenError, ValueError, TypeError, RecursionError):
                continue
            ids = tok.encode(target, add_special_tokens=False)
            if not grammar.accepts(target) or len(ids) > max_tokens - 8:
                continue
            prompt = llm.encode_prompt(extraction_prompt(valid[0]))
            cases.append(Case(row["id"], schema, prompt, target))
            n += 1
            if n == per_category:
                break
    return cases


class ReplayMatcher(GrammarMatcher):
    """The real grammar matcher, with its mask narrowed to the next token of a known output.

    The real mask is still computed (its cost is part of a step; `batch_replay_fills` batches
    it like the engine's own rows) and the jump-forward hook reads the real one through
    `inner`, so forced text and held-back tokens are decided by the grammar, not by the
    replayed text."""

    backend = "replay"

    def __init__(self, inner: GrammarMatcher, case: Case, vocab: VocabBytes, tokenizer: Any, stop_ids: list[int]):
        self.inner, self.target, self.vocab, self.tokenizer, self.stop_ids = inner, case.target.encode(), vocab, tokenizer, stop_ids
        self.cache = case.next_tokens
        self.history: list[int] = []
        self.offset = 0

    def next_token(self) -> list[int]:
        """The first token of the remaining text, cached per offset (harness time, not the
        engine's: the warm-up runs fill the cache). Encoding a 64-byte window gives the same
        first token as encoding it all unless that token nearly fills the window; the whole
        rest is encoded only then."""
        if self.offset >= len(self.target):
            return self.stop_ids
        ids = self.cache.get(self.offset)
        if ids is None:
            window = self.target[self.offset : self.offset + 64]
            ids = self.tokenizer.encode(window.decode("utf-8", errors="ignore"), add_special_tokens=False)[:1]
            if ids and len(window) == 64 and len(self.vocab.tokens[ids[0]]) >= 32:
                rest = self.target[self.offset :].decode("utf-8", errors="ignore")
                ids = self.tokenizer.encode(rest, add_special_tokens=False)[:1]
            self.cache[self.offset] = ids
        return ids

    def accept_token(self, token_id: int) -> bool:
        if not self.inner.accept_token(token_id):
            return False
        self.history.append(token_id)
        self.offset += len(self.vocab.tokens[token_id])
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)
        set_only_tokens(bitmask, row, self.next_token())

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)
        for _ in range(num_tokens):
            self.offset -= len(self.vocab.tokens[self.history.pop()])

    def jump_forward_string(self, max_bytes: int = FORCED_TEXT_MAX_BYTES) -> str:
        return self.inner.jump_forward_string(max_bytes)

    @property
    def version(self) -> int:  # every state change goes through inner
        return self.inner.version

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def reset(self) -> None:
        self.inner.reset()
        self.history, self.offset = [], 0


class ReplayJumpForward(JumpForward):
    """Hold-back decisions and rehearsals read the grammar's own mask, not the replay-narrowed
    one (which would tell the rehearsal which token comes)."""

    def _allowed(self, m: Any):
        return super()._allowed(m.inner if isinstance(m, ReplayMatcher) else m)

    def rehearse(self, req: Request, allowed: np.ndarray, done: Callable[[], bool], guess: int | None = None) -> None:
        m = req.matcher
        if isinstance(m, ReplayMatcher):
            if guess is not None and not m.accept_token(guess):
                return
            allowed = self._allowed(m).copy()
            if guess is not None:
                m.rollback(1)
        super().rehearse(req, allowed, done, guess)


def batch_replay_fills(engine: Engine) -> None:
    """Fill replay rows' real masks in one batch per backend, as the engine fills its own
    rows (`Engine._fill_masks`: one call to the backends' pools), then narrow each row."""
    fill_real = engine._fill_masks

    def fill(bitmask: torch.Tensor, rows: list[tuple[int, Any]]) -> dict[int, BaseException]:
        errors = fill_real(bitmask, [(i, m.inner if isinstance(m, ReplayMatcher) else m) for i, m in rows])
        for i, m in rows:
            if isinstance(m, ReplayMatcher) and i not in errors:
                set_only_tokens(bitmask, i, m.next_token())
        return errors

    engine._fill_masks = fill


# -- running ------------------------------------------------------------------------------------
def make_requests(llm: LLM, cases: list[Case], mode: str, jf: bool, max_tokens: int) -> list[Request]:
    stop = sorted(llm.engine.stop_token_ids)
    reqs = []
    for c in cases:
        matcher = llm.compile(JsonSchema(c.schema)).matcher()
        if mode == "replay":
            matcher = ReplayMatcher(matcher, c, llm.engine.jump_forward_hook.vocab, llm.tokenizer, stop)
        reqs.append(Request(c.prompt_ids, SamplingParams(max_tokens=max_tokens, jump_forward=jf), matcher, frozenset(stop)))
    return reqs


def step_kind(engine: Engine) -> str:
    """What the engine's next step will be: "prefill" (someone is admitted or prefilling),
    "extend" (forced tokens are pending) or "decode"."""
    running = engine.scheduler.running
    if engine.scheduler.waiting or any(r.num_cached < r.num_prompt for r in running):
        return "prefill"
    return "extend" if any(r.num_pending > 1 for r in running) else "decode"


class StepTimer:
    """Times engine steps, split into pure decode steps and steps that also run forced tokens.
    No device sync between steps: the engine's own per-step sync (reading the sampled tokens)
    is what a caller sees, and an extra one would serialise the next step's pre-launched
    forward with the host work it is meant to overlap."""

    def __init__(self, engine: Engine):
        self.engine, self.decode, self.extend = engine, [], []
        self.extend_rows: list[int] = []
        self.times: dict[int, tuple[float, float]] = {}  # request id -> (first token, finish) in s

    def run(self, reqs: list[Request]) -> float:
        """Wall time of serving `reqs`, added at once; also each one's time to its first
        sampled token and to its finish from that start (`self.times`). The requests' own
        clocks start when they are built, and the harness builds a batch's requests one after
        another (matchers, ~3 ms each), so the first ones' clocks would count the others'."""
        e = self.engine
        t0 = time.perf_counter()
        for r in reqs:
            e.add_request(r)
        done: dict[int, float] = {}
        while any(not r.finished for r in reqs):
            kind = step_kind(e)
            if kind == "extend":
                self.extend_rows.append(sum(r.num_pending for r in e.scheduler.running))
            t = time.perf_counter()
            e.step()
            now = time.perf_counter()
            if kind != "prefill":
                (self.extend if kind == "extend" else self.decode).append(now - t)
            for r in reqs:
                if r.finished and r.id not in done:
                    done[r.id] = now
        if e.device.type == "cuda":
            torch.cuda.synchronize()  # a discarded pre-launched forward belongs to this run
        end = time.perf_counter()
        for r in reqs:
            first = r.first_token_at if r.first_token_at is not None else t0
            self.times[r.id] = (first - t0, done.get(r.id, end) - t0)
        return end - t0


def measure(llm: LLM, cases: list[Case], mode: str, jf: bool, batch: int, max_tokens: int) -> dict[str, Any]:
    constraint = {c.id: to_constraint(JsonSchema(c.schema)) for c in cases}
    timer = StepTimer(llm.engine)
    graphs = llm.engine.runner.graphs
    steps0 = (graphs.steps, graphs.steps_ahead, graphs.gate_runs, graphs.gate_wasted) if graphs is not None else (0,) * 4
    latencies, done = [], []
    if batch == 1:
        for c in cases:
            (req,) = make_requests(llm, [c], mode, jf, max_tokens)
            latencies.append(timer.run([req]))
            done.append((c, req))
        wall = sum(latencies)
    else:
        group = (cases * (batch // len(cases) + 1))[:batch]
        reqs = make_requests(llm, group, mode, jf, max_tokens)
        wall = timer.run(reqs)
        done = list(zip(group, reqs, strict=True))
        latencies = [timer.times[r.id][1] for r in reqs]
    tokens = sum(r.num_output for _, r in done)
    passes = sum(r.stats.forward_passes for _, r in done)
    graph_steps = graphs.steps - steps0[0] if graphs is not None else 0
    ahead = graphs.steps_ahead - steps0[1] if graphs is not None else 0
    valid, texts = 0, {}
    for c, r in done:
        text = texts[c.id] = llm.tokenizer.decode(r.output_ids)
        try:
            if r.finish_reason == "stop":
                constraint[c.id].parse(text)
                valid += mode != "replay" or text == c.target
        except StructgenError:
            pass
    return {
        "tokens": tokens, "forward_passes": passes, "forced": sum(r.stats.forced_tokens for _, r in done),
        # Held-back tokens run as guesses, and those the model picked (a pass saved each).
        "guessed": sum(r.stats.drafted_tokens for _, r in done),
        "accepted": sum(r.stats.accepted_tokens for _, r in done),
        "passes_per_token": passes / max(tokens, 1), "wall_s": wall,
        "latency_ms": 1e3 * statistics.mean(latencies), "ms_per_token": 1e3 * wall / max(tokens, 1),
        "valid": valid, "n": len(done),
        # (output tokens, forward passes, finish reason, latency in s, time to first token in s,
        # passes of the prompt) per case.
        "per_case": {c.id: (r.num_output, r.stats.forward_passes, r.finish_reason, lat, timer.times[r.id][0],
                            prompt_passes(llm.engine, len(c.prompt_ids)))
                     for (c, r), lat in zip(done, latencies, strict=True)},
        "texts": texts,
        # Rows of each step that ran forced tokens: which graph buckets jump-forward lands in.
        "extend_rows": dict(sorted(collections.Counter(timer.extend_rows).items())),
        "decode_step_ms": 1e3 * statistics.mean(timer.decode) if timer.decode else None,
        "extend_step_ms": 1e3 * statistics.mean(timer.extend) if timer.extend else None,
        # Graph steps whose forward was already running when the host got to them.
        "prelaunched_pct": 100 * ahead / graph_steps if graph_steps else None,
        # Forwards the device's token gate ran before the host decided, and those it then wasted.
        "gate_runs": graphs.gate_runs - steps0[2] if graphs is not None else 0,
        "gate_wasted": graphs.gate_wasted - steps0[3] if graphs is not None else 0,
    }


def prompt_passes(engine: Engine, prompt_len: int) -> int:
    """Forward passes a prompt of this length takes alone (chunks of the step token budget)."""
    graphs = engine.runner.graphs
    chunk = engine.config.prefill_chunk_tokens
    if graphs is not None and engine.config.tuning.prefill_in_graphs:
        chunk = min(chunk, graphs.max_batch_size)
    return -(-prompt_len // chunk)


def equal_pass_cost_speedup(off: dict, on: dict, cases: list[str]) -> float:
    """The speedup over `cases` if every jump-forward pass after the prompt cost what a pass
    costs with it off: on a GPU the most fewer passes can give, whatever the engine does per pass. Per
    case, the off run's time after the first token spread over its passes after the prompt
    (whose last pass samples the first token), times the on run's passes there, plus the on
    run's own time to first token."""
    ideal = 0.0
    for c in cases:
        _, passes_off, _, lat_off, ttft_off, prompt = off["per_case"][c]
        _, passes_on, _, _, ttft_on, _ = on["per_case"][c]
        per_pass = (lat_off - ttft_off) / max(passes_off - prompt, 1)
        ideal += ttft_on + per_pass * (passes_on - prompt)
    return sum(off["per_case"][c][3] for c in cases) / max(ideal, 1e-9)


def build_llm(weights: str, tokenizer_dir: Path | None, device: str | None, graphs: bool,
              shape: str | None = None, prefill_in_graphs: bool = True,
              batch_invariant: bool = False) -> tuple[LLM, str]:
    """The real default model, or random weights of its shape (config.json next to the
    tokenizer) or of a `benchmarks.common` shape (`llama-1b`, `llama-8b`: the SmolLM2
    tokenizer on the real vocab width), where the forward weighs more against the host."""
    config = EngineConfig(device=device, max_batch_size=16, max_seq_len=1536, use_cuda_graphs=graphs,
                          batch_invariant=batch_invariant, tuning=EngineTuning(prefill_in_graphs=prefill_in_graphs))
    if weights == "real":
        return LLM(config=config), "smollm2-135m"
    from structgen.engine.models.loader import load_tokenizer, resolve_model

    src = tokenizer_dir or resolve_model(progress=False)
    tokenizer = load_tokenizer(src)
    cfg = model_config(shape) if shape else ModelConfig.from_file(Path(src) / "config.json")
    name = f"{shape or 'smollm2-135m'}-shape"
    engine = Engine(cfg, config, None, stop_token_ids={tokenizer.eos_token_id, *cfg.eos_token_id})
    return LLM.from_engine(engine, tokenizer, name), name


def add_rows(rows: list, table: list, res: dict, model: str, mode: str, batch: int, note: dict) -> None:
    """Result rows (BENCHMARKS.md format) and table lines for one (mode, batch) on/off pair."""
    off, on = res[False], res[True]
    for jf, r in res.items():
        common = {"system": "structgen" if jf else "structgen-nojf", "model": model, "batch": batch,
                  "constrained": True, "mode": mode, "jump_forward": jf, **note, "tokens": r["tokens"],
                  "forced_tokens": r["forced"], "guessed": r["guessed"], "accepted": r["accepted"],
                  "valid": r["valid"], "n": r["n"],
                  "decode_step_ms": r["decode_step_ms"], "extend_step_ms": r["extend_step_ms"],
                  "prelaunched_pct": r["prelaunched_pct"], "walls_s": r.get("walls_s")}
        rows.append({**common, "metric": "forward_passes_per_token", "value": r["passes_per_token"]})
        rows.append({**common, "metric": "latency_ms", "value": r["latency_ms"]})
        rows.append({**common, "metric": "ms_per_token", "value": r["ms_per_token"]})
        table.append({"mode": mode, **note, "batch": batch, "jf": "on" if jf else "off",
                      "valid": f"{r['valid']}/{r['n']}", "tokens": r["tokens"], "forced": r["forced"],
                      "guesses": f"{r['accepted']}/{r['guessed']}",
                      "passes/tok": r["passes_per_token"], "latency_ms": r["latency_ms"],
                      "ms/tok": r["ms_per_token"], "wall_s": r["wall_s"],
                      "decode_step_ms": r["decode_step_ms"], "extend_step_ms": r["extend_step_ms"],
                      "prelaunched_pct": r["prelaunched_pct"], "gate_runs": r["gate_runs"],
                      "gate_wasted": r["gate_wasted"]})
    rows.append({"system": "structgen", "model": model, "batch": batch, "constrained": True, "mode": mode,
                 **note, "metric": "speedup", "value": off["wall_s"] / on["wall_s"]})
    # A request that runs to max_tokens in one run (the model loops) weighs on that run's wall,
    # at batch 16 all of it: also the speedup over the requests that stopped in both.
    both, stopped = stopped_in_both(off, on)
    rows.append({"system": "structgen", "model": model, "batch": batch, "constrained": True, "mode": mode,
                 **note, "metric": "speedup_stopped_in_both", "value": stopped, "cases": len(both)})
    table.append({"mode": mode, **note, "batch": batch, "jf": "on/off",
                  "passes/tok": on["passes_per_token"] / off["passes_per_token"],
                  "latency_ms": on["latency_ms"] / off["latency_ms"], "wall_s": off["wall_s"] / on["wall_s"]})
    table.append({"mode": mode, **note, "batch": batch, "jf": f"speedup, {len(both)} stopped in both",
                  "wall_s": stopped})
    same, speedup = same_output(off, on)
    rows.append({"system": "structgen", "model": model, "batch": batch, "constrained": True, "mode": mode,
                 **note, "metric": "speedup_same_output", "value": speedup, "cases": len(same)})
    table.append({"mode": mode, **note, "batch": batch, "jf": f"speedup, {len(same)} with the same output",
                  "wall_s": speedup})
    if batch == 1:  # requests one at a time: each one's latency is its own steps
        for name, cases in (("speedup_at_equal_pass_cost", list(on["per_case"])),
                            ("speedup_at_equal_pass_cost_stopped_in_both", both)):
            value = equal_pass_cost_speedup(off, on, cases)
            rows.append({"system": "structgen", "model": model, "batch": batch, "constrained": True, "mode": mode,
                         **note, "metric": name, "value": value, "cases": len(cases)})
            table.append({"mode": mode, **note, "batch": batch, "jf": f"{name}, {len(cases)} cases",
                          "wall_s": value})
    for jf, r in res.items():
        rows.append({"system": "structgen" if jf else "structgen-nojf", "model": model, "batch": batch,
                     "constrained": True, "mode": mode, "jump_forward": jf, **note, "metric": "per_case",
                     "value": per_case_value(r), "extend_rows": r["extend_rows"]})


def stopped_in_both(off: dict, on: dict) -> tuple[list[str], float]:
    """The cases that ended with a stop in both runs, and the speedup of their summed latencies."""
    both = [c for c, v in on["per_case"].items() if v[2] == "stop" and off["per_case"][c][2] == "stop"]
    return both, sum(off["per_case"][c][3] for c in both) / max(sum(on["per_case"][c][3] for c in both), 1e-9)


def same_output(off: dict, on: dict) -> tuple[list[str], float]:
    """The cases whose output text is the same with jump-forward on and off (both stopped),
    and the speedup of their summed latencies: in model mode the fair figure, as the other
    cases' outputs differ in length (the re-tokenised prefix leads the model elsewhere)."""
    same = [c for c in stopped_in_both(off, on)[0] if on["texts"][c] == off["texts"][c]]
    return same, sum(off["per_case"][c][3] for c in same) / max(sum(on["per_case"][c][3] for c in same), 1e-9)


def per_case_value(r: dict) -> dict[str, dict[str, Any]]:
    return {c: {"tokens": v[0], "passes": v[1], "finish": v[2], "latency_ms": round(1e3 * v[3], 3),
                "ttft_ms": round(1e3 * v[4], 3)} for c, v in r["per_case"].items()}


def add_variant_rows(rows: list, table: list, run: dict, res: dict, model: str, mode: str, batch: int,
                     note: dict, without: str) -> None:
    """A jump-forward run `without` one of its parts ("gate": the token gate, "guesses": the
    held-back guesses), beside the default's on/off pair."""
    common = {"system": f"structgen-no{without}", "model": model, "batch": batch, "constrained": True, "mode": mode,
              "jump_forward": True, **note, "decode_step_ms": run["decode_step_ms"],
              "extend_step_ms": run["extend_step_ms"], "walls_s": run.get("walls_s"),
              "tokens": run["tokens"], "passes_per_token": run["passes_per_token"]}
    rows.append({**common, "metric": "ms_per_token", "value": run["ms_per_token"]})
    rows.append({**common, "metric": "speedup", "value": res[False]["wall_s"] / run["wall_s"]})
    both, stopped = stopped_in_both(res[False], run)
    rows.append({**common, "metric": "speedup_stopped_in_both", "value": stopped, "cases": len(both)})
    table.append({"mode": mode, **note, "batch": batch, "jf": f"on, no {without}", "tokens": run["tokens"],
                  "passes/tok": run["passes_per_token"], "ms/tok": run["ms_per_token"],
                  "wall_s": run["wall_s"], "decode_step_ms": run["decode_step_ms"],
                  "extend_step_ms": run["extend_step_ms"]})
    table.append({"mode": mode, **note, "batch": batch, "jf": f"speedup, no {without}",
                  "wall_s": res[False]["wall_s"] / run["wall_s"]})
    table.append({"mode": mode, **note, "batch": batch, "jf": f"speedup, no {without}, {len(both)} stopped in both",
                  "wall_s": stopped})
    rows.append({**common, "metric": "per_case", "value": per_case_value(run)})


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median wall time, with every run's wall time alongside."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    return {**ordered[(len(ordered) - 1) // 2], "walls_s": [round(r["wall_s"], 4) for r in runs]}


def case_rows(res: dict, note: dict) -> list[dict[str, Any]]:
    """Per schema (replay, batch 1, identical outputs): forward passes per token off and on."""
    out = []
    for cid, (tokens, passes_off, *_) in res[False]["per_case"].items():
        passes_on = res[True]["per_case"][cid][1]
        out.append({"case": cid, **note, "tokens": tokens, "passes/tok off": passes_off / max(tokens, 1),
                    "passes/tok on": passes_on / max(tokens, 1), "fewer_passes_pct": 100 * (1 - passes_on / max(passes_off, 1))})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="model,replay", help="model and/or replay")
    ap.add_argument("--weights", default="real", choices=["real", "random"])
    ap.add_argument("--tokenizer-dir", type=Path, default=None, help="tokenizer + config.json (random weights)")
    ap.add_argument("--shape", default=None, choices=["llama-1b", "llama-8b"],
                    help="random weights of this shape instead of the tokenizer dir's config.json")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--data-dir", type=Path, default=MASKBENCH, help="MaskBench *.jsonl files")
    ap.add_argument("--graphs", default="on", help="CUDA graphs: on, off or on,off (GPU only)")
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeat", type=int, default=3, help="off/on runs, interleaved; the median wall is kept")
    ap.add_argument("--eager-prefill", action="store_true",
                    help="prompts run as eager extends (EngineTuning(prefill_in_graphs=False))")
    ap.add_argument("--token-gate", default="on", choices=["on", "off", "both"],
                    help="batch-1 jump-forward steps behind the device-decided gate; both: also time it off")
    ap.add_argument("--guesses", default="on", choices=["on", "off", "both"],
                    help="held-back tokens run as guesses (JumpForward.guesses); both: also time them off")
    ap.add_argument("--batch-invariant", choices=("on", "off"), default="off",
                    help="EngineConfig.batch_invariant: on, a jump-forward extend's rows compute what decode "
                         "steps would, so both runs return the same text and the speedup is on equal outputs")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    modes = [m for m in args.modes.split(",") if m]
    if args.shape and args.weights != "random":
        ap.error("--shape needs --weights random")
    if args.weights == "random" and "model" in modes:
        modes.remove("model")  # a random model's free choices mean nothing
    rows: list[dict[str, Any]] = []
    table: list[dict[str, Any]] = []
    cases: list[Case] = []
    per_case: list[dict[str, Any]] = []
    for graphs in args.graphs.split(","):
        llm, model = build_llm(args.weights, args.tokenizer_dir, args.device, graphs == "on", args.shape,
                               not args.eager_prefill, args.batch_invariant == "on")
        engine = llm.engine
        engine.jump_forward_hook = ReplayJumpForward(
            llm.tokenizer, engine.vocab_size, engine.stop_token_ids, vocab=engine.jump_forward_hook.vocab
        )
        cases = load_cases(llm, args.data_dir, args.categories.split(","), args.per_category, args.max_tokens)
        print(f"{len(cases)} cases: {', '.join(c.id for c in cases)}", flush=True)
        batch_replay_fills(engine)
        # warm-up: first forwards allocate, fill caches (the replay targets' tokens too)
        measure(llm, cases[:2], "replay", True, 1, args.max_tokens)
        for jf in (False, True):
            measure(llm, cases, "replay", jf, len(cases), args.max_tokens)
        graph_note = {} if engine.device.type != "cuda" else {"cuda_graphs": graphs == "on"}
        for mode in modes:
            for batch in (int(b) for b in args.batches.split(",")):
                # Steady state: new step shapes (Triton specialisations, SDPA plans) cost
                # tens of ms the first time; a server pays that once, not per request.
                measure(llm, cases[: max(2, min(batch, len(cases)))], mode, True, batch, args.max_tokens)
                gate, guesses = args.token_gate != "off", args.guesses != "off"
                variants = [(False, gate, guesses), (True, gate, guesses)]
                if args.token_gate == "both":
                    variants.append((True, False, guesses))
                if args.guesses == "both":
                    variants.append((True, gate, False))
                runs: dict[tuple[bool, bool, bool], list[dict[str, Any]]] = {v: [] for v in variants}
                for _ in range(args.repeat):  # interleaved: slow phases of the host hit every variant
                    for jf, g, d in variants:
                        if engine.runner.graphs is not None:
                            engine.runner.graphs.use_token_gate = g
                        engine.jump_forward_hook.guesses = d
                        runs[(jf, g, d)].append(measure(llm, cases, mode, jf, batch, args.max_tokens))
                res = {jf: median_run(runs[(jf, gate, guesses)]) for jf in (False, True)}
                group = len(table)
                add_rows(rows, table, res, model, mode, batch, graph_note)
                if args.token_gate == "both":
                    add_variant_rows(rows, table, median_run(runs[(True, False, guesses)]), res, model, mode, batch,
                                     graph_note, "gate")
                if args.guesses == "both":
                    add_variant_rows(rows, table, median_run(runs[(True, gate, False)]), res, model, mode, batch,
                                     graph_note, "guesses")
                if mode == "replay" and batch == 1:
                    per_case = case_rows(res, graph_note)
                    print_table(per_case)
                print_table(table[group:])
        del llm, engine
    print_table(table)
    print("(last row per group: passes/tok = on/off ratio, wall_s = speedup off/on)")
    if not args.no_write:
        extra = {"cases": [c.id for c in cases], "weights": args.weights, "per_case_replay_batch1": per_case,
                 "prefill_in_graphs": not args.eager_prefill, "batch_invariant": args.batch_invariant == "on",
                 "note": "batch 1: requests one after another (latency = per request); batch 16: all at once"}
        name = "jump_forward" if args.weights == "real" else f"jump_forward-random-{model}"
        print("wrote", write_results(name, rows, extra=extra))


if __name__ == "__main__":
    main()
