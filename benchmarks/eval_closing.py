"""Budget closing over MaskBench: every JME, Glaiveai2K and Github_easy schema (the prompts of
bench_serving's `json` workload) with a small `max_tokens`, so closing is forced early; counts
the outputs that end complete and valid, closed but invalid per jsonschema, incomplete
(`IncompleteOutputError`) or failed otherwise, and lists the failures for classifying.

    python3 -m benchmarks.eval_closing --max-tokens 24 --batch 24 --out /tmp/closing.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema

from benchmarks.bench_serving import JSON_CATEGORIES, _entries, _prompt
from benchmarks.common import maskbench_dir, write_results


def _outcome(schema: dict[str, Any], text: str) -> tuple[str, str | None]:
    try:
        jsonschema.validate(json.loads(text), schema)
        return "valid", None
    except jsonschema.ValidationError as exc:
        return "invalid", f"{exc.validator}: {exc.message[:200]}"
    except (ValueError, jsonschema.SchemaError) as exc:
        return "invalid", str(exc)[:200]


async def _one(llm: Any, category: str, entry: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    from structgen import IncompleteOutputError, JsonSchema, StructgenError

    row: dict[str, Any] = {"category": category, "id": entry.get("id")}
    messages = [{"role": "user", "content": _prompt(entry)}]
    try:
        c = await llm.acomplete(JsonSchema(entry["schema"]), messages, max_tokens=max_tokens, temperature=0.0)
        outcome, why = _outcome(entry["schema"], c.text)
        row.update(outcome=outcome, why=why, text=c.text, guards=c.stats.guards_fired,
                   dropped=c.stats.dropped_tokens)
    except IncompleteOutputError as exc:
        row.update(outcome="incomplete", error=str(exc)[:300], text=exc.partial_text)
    except StructgenError as exc:
        row.update(outcome=f"error:{type(exc).__name__}", error=str(exc)[:300])
    return row


async def _run(llm: Any, work: list[tuple[str, dict[str, Any]]], max_tokens: int, batch: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(0, len(work), batch):
        rows += await asyncio.gather(*(_one(llm, c, e, max_tokens) for c, e in work[i : i + batch]))
        print(f"{len(rows)}/{len(work)}", dict(Counter(r["outcome"] for r in rows)), flush=True)
    return rows


def shortest_from_start(llm: Any, schema: dict[str, Any]) -> int | None:
    """Tokens of the closer's shortest completion of the empty output (None: none found): an
    output whose budget is below it cannot end complete."""
    from structgen import JsonSchema

    matcher = llm.grammars.compile(llm._constraint(JsonSchema(schema), True)).matcher()
    plan = llm.engine.closer.search.shortest(matcher, 1024)
    return None if plan is None else len(plan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--limit", type=int, default=0, help="schemas per category (0: all)")
    ap.add_argument("--max-schema-chars", type=int, default=4_000)
    ap.add_argument("--out", type=Path, help="every row (JSON lines), for classifying failures")
    ap.add_argument("--label", default="structgen")
    args = ap.parse_args()

    from structgen import LLM

    data = maskbench_dir()
    work = []
    for cat in JSON_CATEGORIES:
        entries = [e for e in _entries(cat, data) if len(json.dumps(e["schema"])) <= args.max_schema_chars]
        work += [(cat, e) for e in entries[: args.limit or None]]
    with LLM() as llm:
        t0 = time.perf_counter()
        rows = asyncio.run(_run(llm, work, args.max_tokens, args.batch))
        elapsed = time.perf_counter() - t0
        schemas = {(c, e.get("id")): e["schema"] for c, e in work}
        for r in rows:
            if r["outcome"] in ("incomplete", "invalid"):
                r["shortest_from_start"] = shortest_from_start(llm, schemas[(r["category"], r["id"])])
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = Counter(r["outcome"] for r in rows)
    counts["incomplete_closable"] = sum(r["outcome"] == "incomplete" and (r["shortest_from_start"] or 10**9) <= args.max_tokens
                                        for r in rows)
    print(json.dumps(dict(counts)), f"{elapsed:.0f}s")
    write_results(f"closing-{args.label}", [
        {"system": args.label, "model": "smollm2-135m", "max_tokens": args.max_tokens, "metric": k, "value": v}
        for k, v in sorted(counts.items())], extra={"schemas": len(rows), "seconds": round(elapsed)})


if __name__ == "__main__":
    main()
