"""How often a typed request gets a complete, valid value under a token budget, with the
closing and loop guards off ("before") and on ("after").

MaskBench schemas (JME, Glaiveai2K, Github_easy: the first `--limit` of each that compile),
each prompted to extract its own valid instance where it has one (else to write an example),
x max_tokens x temperature, on the default model. All requests of one setting are submitted at
once through the async API, so the engine batches them. Per category and setting: the share
of outputs complete and valid (also among the cases whose shortest completion from the start,
as the closer's search finds it, fits the budget: the target is all of them), incomplete (`IncompleteOutputError`), invalid
(`OutputValidationError`), the mean output tokens, and for JME the field accuracy (top-level
values equal to the reference instance; an output that is not complete and valid scores 0).

    python -m benchmarks.eval_completion                     # the full grid
    python -m benchmarks.eval_completion --limit 6 --max-tokens 48 --temperatures 0
    python -m benchmarks.eval_completion --device cuda

Writes benchmarks/results/eval_completion-<device>-<date>.json (shared/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from structgen import LLM, JsonSchema
from structgen.engine.closing import CLOSING_MARGIN
from structgen.engine.config import EngineConfig
from structgen.errors import IncompleteOutputError, OutputValidationError, StructgenError

CATEGORIES = ("JME", "Glaiveai2K", "Github_easy")
SYSTEMS = {"structgen-noguards": False, "structgen": True}  # closing and loop guards off / on
SHORTEST_LIMIT = 512  # longest completion from the start searched for


@dataclass
class Case:
    id: str
    category: str
    schema: dict
    prompt: str
    reference: dict | None  # the schema's valid instance, when it is an object
    shortest: int | None  # tokens of the shortest completion from the start the closer's search finds


def load_cases(llm: LLM, categories: list[str], limit: int) -> list[Case]:
    """The first `limit` schemas of each category that compile."""
    from benchmarks.common import maskbench_dir
    from benchmarks.eval_grammar import load_category

    cases = []
    for cat in categories:
        n = 0
        for row in load_category(maskbench_dir() / f"{cat}.jsonl"):
            schema = row["schema"]
            if not isinstance(schema, dict):
                continue
            try:
                compiled = llm.compile(JsonSchema(schema))
            except (StructgenError, RecursionError):
                continue
            valid = [t["data"] for t in row.get("tests", []) if t.get("valid") and isinstance(t.get("data"), dict)]
            reference = valid[0] if valid and valid[0] else None
            plan = llm.engine.closer.search.shortest(compiled.matcher(), SHORTEST_LIMIT)
            shortest = len(plan) if plan is not None else None
            cases.append(Case(row["id"], cat, schema, prompt_for(schema, reference), reference, shortest))
            n += 1
            if n == limit:
                break
    return cases


def prompt_for(schema: dict, reference: dict | None) -> str:
    if reference is not None:
        facts = "; ".join(f"{k}: {json.dumps(v, ensure_ascii=False)}" for k, v in reference.items())
        return f"Extract the record as JSON. Facts: {facts}"
    return f"Write an example JSON value for this schema: {json.dumps(schema)[:1500]}"


async def run_setting(llm: LLM, cases: list[Case], max_tokens: int, temperature: float, guards: bool,
                      seed: int) -> list[dict[str, Any]]:
    """Every case under one setting, all submitted at once; one outcome per case."""

    async def one(i: int, case: Case) -> dict[str, Any]:
        try:
            c = await llm.acomplete(JsonSchema(case.schema), case.prompt, max_tokens=max_tokens,
                                    temperature=temperature, seed=seed + i if temperature else None,
                                    close_at_budget=guards, loop_guards=guards)
        except IncompleteOutputError as e:
            return {"outcome": "incomplete", "tokens": len(e.token_ids), "guards": []}
        except OutputValidationError:
            return {"outcome": "invalid", "tokens": None, "guards": []}
        except StructgenError as e:
            return {"outcome": "error", "tokens": None, "guards": [], "error": str(e)[:200]}
        return {"outcome": "valid", "tokens": c.stats.output_tokens, "guards": list(c.stats.guards_fired),
                "accuracy": field_accuracy(c.value, case.reference)}

    return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(cases))))


def field_accuracy(value: Any, reference: dict | None) -> float | None:
    """Share of the reference's top-level fields the output has with the same value."""
    if not reference:
        return None
    if not isinstance(value, dict):
        return 0.0
    return sum(value.get(k) == v for k, v in reference.items()) / len(reference)


def fits(case: Case, max_tokens: int) -> bool:
    """Whether the case's shortest completion from the start fits the budget, with the closer's margin."""
    return case.shortest is not None and case.shortest + CLOSING_MARGIN <= max_tokens


def summarize(cases: list[Case], outcomes: list[dict[str, Any]], category: str, max_tokens: int) -> dict[str, Any]:
    picked = [(c, o) for c, o in zip(cases, outcomes, strict=True) if c.category == category or category == "ALL"]
    n = len(picked)
    fitting = [o for c, o in picked if fits(c, max_tokens)]
    share = {k: sum(o["outcome"] == k for _, o in picked) / n for k in ("valid", "incomplete", "invalid", "error")}
    tokens = [o["tokens"] for _, o in picked if o["tokens"] is not None]
    row = {"schemas": n, "complete_valid": share["valid"], "incomplete": share["incomplete"],
           "fitting": len(fitting),
           "fitting_complete_valid": sum(o["outcome"] == "valid" for o in fitting) / len(fitting) if fitting else None,
           "invalid": share["invalid"], "errors": share["error"],
           "mean_output_tokens": statistics.fmean(tokens) if tokens else None,
           "closed": sum("budget_closing" in o["guards"] for _, o in picked),
           "loops_closed": sum("repetition" in o["guards"] or "integer_digits" in o["guards"] for _, o in picked)}
    scored = [(c, o) for c, o in picked if c.category == "JME" and c.reference]
    if scored:
        row["jme_field_accuracy"] = statistics.fmean(o.get("accuracy") or 0.0 for _, o in scored)
    return row


def to_result_rows(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per metric (shared/BENCHMARKS.md), the setting's keys alongside."""
    metrics = ("complete_valid", "fitting_complete_valid", "incomplete", "invalid", "mean_output_tokens",
               "jme_field_accuracy")
    out = []
    for r in table:
        base = {k: r[k] for k in ("system", "category", "max_tokens", "temperature", "schemas")}
        for m in metrics:
            if r.get(m) is not None:
                out.append({**base, "model": "smollm2-135m", "metric": m, "value": r[m]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--categories", nargs="*", default=list(CATEGORIES))
    parser.add_argument("--limit", type=int, default=60, help="schemas per category")
    parser.add_argument("--max-tokens", type=int, nargs="*", default=[48, 96, 192])
    parser.add_argument("--temperatures", type=float, nargs="*", default=[0.0, 1.0])
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    parser.add_argument("--max-batch-size", type=int, default=None, help="default: the engine's")
    parser.add_argument("--seed", type=int, default=0, help="seeds of the sampled requests: seed + case index")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/results")
    args = parser.parse_args()

    from benchmarks.common import maskbench_dir, print_table, write_results

    if not maskbench_dir().is_dir():
        sys.exit(f"MaskBench data not found at {maskbench_dir()} (set STRUCTGEN_SHARED)")
    config = EngineConfig(device=args.device)
    if args.max_batch_size:
        config.max_batch_size = args.max_batch_size
    llm = LLM(config=config)
    cases = load_cases(llm, args.categories, args.limit)
    t0 = time.time()
    table = []
    for max_tokens in args.max_tokens:
        for temperature in args.temperatures:
            for system, guards in SYSTEMS.items():
                outcomes = asyncio.run(run_setting(llm, cases, max_tokens, temperature, guards, args.seed))
                for cat in [*args.categories, "ALL"]:
                    table.append({"system": system, "category": cat, "max_tokens": max_tokens,
                                  "temperature": temperature, **summarize(cases, outcomes, cat, max_tokens)})
                missed = [c.id for c, o in zip(cases, outcomes, strict=True)
                          if fits(c, max_tokens) and o["outcome"] != "valid"]
                if missed and guards:
                    print(f"  fitting but not complete and valid: {missed}", file=sys.stderr)
                print(f"max_tokens={max_tokens} temperature={temperature} {system}: {time.time() - t0:.0f}s",
                      file=sys.stderr)
    print_table(table)
    llm.close()
    if not args.no_write:
        settings = {"categories": args.categories, "limit": args.limit, "max_tokens": args.max_tokens,
                    "temperatures": args.temperatures, "seed": args.seed, "cases": [c.id for c in cases]}
        path = write_results("eval_completion", to_result_rows(table),
                             extra={"settings": settings, "wall_s": round(time.time() - t0, 1),
                                    "data": "MaskBench (guidance-ai/jsonschemabench), see shared/data/maskbench/SOURCE.json"})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
