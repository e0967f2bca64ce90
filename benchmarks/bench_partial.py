"""Partial-object streaming benchmark: what `partial=True` costs per token.

- `tracker` (CPU, no model): the tracker alone fed real outputs one token's text at a time (the
  default model's tokenizer cuts them): MaskBench JME instances as JSON-schema outputs (dict
  snapshots), one long output holding all of them (to show the cost per token does not grow
  with the output), and a long typed one (pydantic models, validated field by field). Reports
  microseconds per token for the parser alone and for parser + snapshot.
- `decode` (the real model, GPU or CPU): the same prompts streamed with `partial=True` and as
  text, at batch 1 and 64 (concurrent `astream`s), ms per output token each and the overhead;
  and at batch 1 the time to the first finished field beside the time to first token.

    python -m benchmarks.bench_partial                      # tracker, on CPU
    python -m benchmarks.bench_partial --modes decode --batches 1 64 --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import pydantic

from benchmarks.common import maskbench_dir, print_table, write_results
from structgen.errors import IncompleteOutputError
from structgen.partial import JsonStreamParser, partial_tracker

MASKBENCH = maskbench_dir()


class Dimensions(pydantic.BaseModel):
    length: float
    width: float
    height: float


class House(pydantic.BaseModel):
    modelName: str
    dimensions: Dimensions
    price: float
    features: list[str]


class Catalog(pydantic.BaseModel):
    houses: list[House]


def jme_rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (MASKBENCH / "JME.jsonl").read_text().splitlines()]


def token_pieces(tokenizer: Any, text: str) -> list[str]:
    """`text` cut where the tokenizer cuts it (each token's text, as a stream delivers it)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, done = [], ""
    for i in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:i])
        if not prefix.endswith("\ufffd"):
            pieces.append(prefix[len(done) :])
            done = prefix
    return pieces


def time_tracker(output_type: Any, pieces: list[str], repeats: int) -> tuple[float, float]:
    """(µs per token for the parser alone, µs per token for parser + snapshots), best of
    `repeats`."""
    parser_best = tracker_best = float("inf")
    for _ in range(repeats):
        parser = JsonStreamParser()
        t0 = time.perf_counter()
        for piece in pieces:
            parser.feed(piece)
        parser.finish()
        parser_best = min(parser_best, time.perf_counter() - t0)
        tracker = partial_tracker(output_type)
        t0 = time.perf_counter()
        for piece in pieces:
            tracker.feed(piece)
        tracker.finish(None)
        tracker_best = min(tracker_best, time.perf_counter() - t0)
    n = len(pieces)
    return parser_best / n * 1e6, tracker_best / n * 1e6


def tracker_rows(repeats: int) -> list[dict[str, Any]]:
    from structgen.engine.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model())
    rows_in = jme_rows()
    cases: list[tuple[str, Any, list[str]]] = []
    each = [(r["schema"], json.dumps(r["tests"][0]["data"])) for r in rows_in if r.get("tests")]
    cases.append(("jme-each", None, []))
    records = [json.loads(text) for _, text in each]
    long_text = json.dumps({"records": records})
    cases.append(("jme-long", {"type": "object"}, token_pieces(tokenizer, long_text)))
    house = next(r for r in rows_in if r["id"] == "JME_11")["tests"][0]["data"]
    catalog = json.dumps({"houses": [house] * 60})
    cases.append(("typed-long", Catalog, token_pieces(tokenizer, catalog)))
    rows = []
    for name, output_type, pieces in cases:
        if name == "jme-each":  # every JME instance as its own output, summed
            parser_us = tracker_us = tokens = 0.0
            for schema, text in each:
                p = token_pieces(tokenizer, text)
                a, b = time_tracker(schema, p, repeats)
                parser_us, tracker_us, tokens = parser_us + a * len(p), tracker_us + b * len(p), tokens + len(p)
            rows.append(_row(name, int(tokens), parser_us / tokens, tracker_us / tokens))
            continue
        a, b = time_tracker(output_type, pieces, repeats)
        rows.append(_row(name, len(pieces), a, b))
    return rows


def _row(case: str, tokens: int, parser_us: float, tracker_us: float) -> dict[str, Any]:
    return {"system": "structgen", "case": case, "tokens": tokens, "metric": "us_per_token",
            "parser_us": round(parser_us, 2), "value": round(tracker_us, 2)}  # fmt: skip


async def _stream_all(llm: Any, prompts: list[tuple[Any, str]], partial: bool, max_tokens: int) -> int:
    async def one(schema: Any, prompt: str) -> int:
        stream = llm.astream(schema, prompt, max_tokens=max_tokens, partial=partial)
        try:
            async for _ in stream:
                pass
        except IncompleteOutputError as e:  # a small model may loop to max_tokens: same work
            return len(e.token_ids)
        return stream.completion.stats.output_tokens

    return sum(await asyncio.gather(*(one(s, p) for s, p in prompts)))


def first_field_rows(llm: Any, cases: list[tuple[Any, str]], max_tokens: int) -> list[dict[str, Any]]:
    """At batch 1: time to the first snapshot (the first token's text, as TTFT) and to the
    first finished top-level field, medians over the prompts."""
    first_token, first_field = [], []
    for schema, prompt in cases:
        t0 = time.perf_counter()
        seen = field = None
        try:
            for snapshot in llm.stream(schema, prompt, max_tokens=max_tokens, partial=True):
                now = time.perf_counter() - t0
                seen = seen if seen is not None else now
                if field is None and any(len(p) == 1 for p in snapshot.finished):
                    field = now
        except IncompleteOutputError:
            pass
        if seen is not None and field is not None:
            first_token.append(seen * 1e3)
            first_field.append(field * 1e3)
    return [{"system": "structgen-partial", "model": "smollm2-135m", "batch": 1, "metric": metric,
             "value": round(statistics.median(values), 2)}
            for metric, values in (("ttft_ms", first_token), ("time_to_first_field_ms", first_field))]  # fmt: skip


def decode_rows(batches: list[int], device: str, max_tokens: int) -> list[dict[str, Any]]:
    from structgen import LLM
    from structgen.engine.config import EngineConfig

    llm = LLM(config=EngineConfig(device=device, max_batch_size=max(batches)))
    cases = [(r["schema"], f"Fill in this JSON example: {json.dumps(r['tests'][0]['data'])}") for r in jme_rows()[:8]]
    rows = []
    for batch in batches:
        prompts = [cases[i % len(cases)] for i in range(batch)]
        asyncio.run(_stream_all(llm, prompts, False, max_tokens))  # warm up grammars and kernels
        timing = {}
        for partial in (False, True) * 3:  # alternated, best of three each
            t0 = time.perf_counter()
            tokens = asyncio.run(_stream_all(llm, prompts, partial, max_tokens))
            ms = (time.perf_counter() - t0) * 1e3 / tokens
            timing[partial] = min(timing.get(partial, float("inf")), ms)
        for partial, ms in timing.items():
            rows.append({"system": "structgen-partial" if partial else "structgen-text", "model": "smollm2-135m",
                         "batch": batch, "metric": "ms_per_token", "value": round(ms, 4)})  # fmt: skip
        overhead = (timing[True] / timing[False] - 1) * 100
        rows.append({"system": "structgen-partial", "model": "smollm2-135m", "batch": batch,
                     "metric": "overhead_pct", "value": round(overhead, 2)})  # fmt: skip
    rows += first_field_rows(llm, cases, max_tokens)
    llm.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["tracker"], choices=["tracker", "decode"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    if "tracker" in args.modes:
        rows += tracker_rows(args.repeats)
    if "decode" in args.modes:
        rows += decode_rows(args.batches, args.device, args.max_tokens)
    print_table(rows)
    print(write_results("partial", rows, extra={"modes": args.modes}))


if __name__ == "__main__":
    main()
