"""Field-level repair vs. retrying the whole answer, on models whose validators reject the value
the greedy model writes first (a country abbreviation, a date in the past, a price, a checksum).

- `structgen-repair`: `llm.complete(Model, prompt, repair=N)`: the rejected field is decoded again
  from its start (structgen/repair.py).
- `retry-from-scratch`: what typed front ends do (Instructor's retries): generate the same
  grammar, validate, and on failure ask again with the answer and the error appended to the
  conversation, at most N more times.

Reports per case the forward passes, latency and whether the output validated, and the total
passes (and tokens run through the model, prompts included) of repair as a fraction of
retry's, each spending passes until its output validates or
its budget runs out (the issue's target: at most 30 %). Passes are exact; latencies on a shared
CPU are noisy.

    python -m benchmarks.bench_repair                 # default model, CPU or GPU
    python -m benchmarks.bench_repair --repair 3 --max-tokens 60
"""

from __future__ import annotations

import argparse
import datetime
import time
from dataclasses import dataclass
from typing import Any

import pydantic
from pydantic import BaseModel, field_validator

import structgen
from benchmarks.common import print_table, write_results


class City(BaseModel):
    name: str
    country: str

    @field_validator("country")
    @classmethod
    def full_name(cls, value: str) -> str:
        if value.isupper():
            raise ValueError("write the country's full name, not an abbreviation")
        return value


class Event(BaseModel):
    title: str
    day: datetime.date

    @field_validator("day")
    @classmethod
    def upcoming(cls, value: datetime.date) -> datetime.date:
        if value.year < 2027:
            raise ValueError("the event must be in 2027 or later")
        return value


class Product(BaseModel):
    name: str
    price: float

    @field_validator("price")
    @classmethod
    def whole_euros(cls, value: float) -> float:
        if value != int(value):
            raise ValueError("prices are whole euros, no cents")
        return value


class Account(BaseModel):
    owner: str
    number: str

    @field_validator("number")
    @classmethod
    def checksum(cls, value: str) -> str:
        digits = [int(c) for c in value if c.isdigit()]
        if len(digits) < 4 or sum(digits) % 10 != 0:
            raise ValueError("at least 4 digits whose sum is a multiple of 10 (checksum)")
        return value


@dataclass(frozen=True)
class Case:
    name: str
    model: type[BaseModel]
    prompt: str


CASES = (
    Case("country", City, "Give me a city as JSON."),
    Case("date", Event, "Invent an event as JSON."),
    Case("price", Product, "Invent a product as JSON."),
    Case("checksum", Account, "Invent a bank account as JSON."),
)


def run_repair(llm: structgen.LLM, case: Case, repairs: int, max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        done = llm.complete(case.model, case.prompt, max_tokens=max_tokens, repair=repairs)
        stats, valid = done.stats, True
    except structgen.OutputValidationError as e:  # repair gave up
        stats, valid = e.stats, False
    # Each repair runs the last kept token again, then the field's tokens and those after it.
    tokens = stats.prompt_tokens + stats.output_tokens + stats.repair_tokens + stats.repairs
    return {"passes": stats.forward_passes, "tokens": tokens, "ms": (time.perf_counter() - t0) * 1e3,
            "valid": valid, "tries": stats.repairs}


def run_retry(llm: structgen.LLM, case: Case, retries: int, max_tokens: int) -> dict[str, Any]:
    """The same grammar (the model's fields, without its validators), validated afterwards; a
    failure goes back into the conversation with its error."""
    fields = {name: (f.annotation, ...) for name, f in case.model.model_fields.items()}
    schema = pydantic.create_model(case.model.__name__, **fields)  # type: ignore[call-overload]
    messages = [{"role": "user", "content": case.prompt}]
    passes = tokens = 0
    t0 = time.perf_counter()
    tries = -1
    while tries < retries:
        tries += 1
        done = llm.complete(schema, messages, max_tokens=max_tokens)
        passes += done.stats.forward_passes
        tokens += done.stats.prompt_tokens + done.stats.output_tokens
        try:
            case.model.model_validate_json(done.text)
            valid = True
            break
        except pydantic.ValidationError as e:
            valid = False
            messages += [{"role": "assistant", "content": done.text},
                         {"role": "user", "content": f"That answer failed validation: {e}. Answer again with valid JSON."}]
    return {"passes": passes, "tokens": tokens, "ms": (time.perf_counter() - t0) * 1e3, "valid": valid,
            "tries": tries}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repair", type=int, default=3, help="repairs per field, and retries of the baseline")
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--no-write", action="store_true", help="print only, write no results file")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    totals = {"structgen-repair": 0, "retry-from-scratch": 0}
    with structgen.LLM() as llm:
        for case in CASES:
            for system, run in (("structgen-repair", run_repair), ("retry-from-scratch", run_retry)):
                r = run(llm, case, args.repair, args.max_tokens)
                rows.append({"system": system, "model": "smollm2-135m", "case": case.name, "metric": "forward_passes",
                             "value": r["passes"], "tokens_run": r["tokens"], "latency_ms": round(r["ms"], 1),
                             "valid": r["valid"], "tries": r["tries"]})
    valid = {system: sum(r["valid"] for r in rows if r["system"] == system) for system in totals}
    run = dict.fromkeys(totals, 0)
    for r in rows:
        totals[r["system"]] += r["value"]
        run[r["system"]] += r["tokens_run"]
    ratio = totals["structgen-repair"] / totals["retry-from-scratch"]
    token_ratio = run["structgen-repair"] / run["retry-from-scratch"]
    print_table(rows)
    print(f"valid outputs {valid} of {len(CASES)}; forward passes {totals}: repair / retry = {ratio:.2f}; "
          f"tokens run {run}: repair / retry = {token_ratio:.2f}")
    if not args.no_write:
        path = write_results("repair", rows, extra={
            "repair": args.repair, "max_tokens": args.max_tokens, "valid": valid, "forward_passes": totals,
            "passes_ratio": round(ratio, 3), "tokens_run": run, "tokens_run_ratio": round(token_ratio, 3),
            "note": "CPU shared with other jobs while measured: latencies are noisy, passes and tokens exact"})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
