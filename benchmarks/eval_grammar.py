"""Grammar coverage and correctness on MaskBench (JSONSchemaBench's schemas with test instances).

For every schema, each test instance is written in our canonical JSON format (`dump_json`) and
fed to the compiled grammar: valid instances must be accepted, invalid ones rejected. Systems:

- `xgrammar`, `llguidance`: the library alone (our adapter, our formatting, no keyword table):
  what you get by handing it the schema.
- `structgen-xgrammar`, `structgen-llguidance`: `GrammarCompiler(backend=...)`, which refuses a
  schema when the keyword table says the backend would not enforce all of it.
- `structgen`: `to_constraint(JsonSchema(schema))` + `GrammarCompiler(backend="auto")`.

A schema "passes" when it compiles, every valid instance is accepted and every invalid one
rejected. Schemas run in worker processes (default 2) with a per-schema, per-backend timeout.

    python -m benchmarks.eval_grammar                      # everything (~15 min on 2 cores)
    python -m benchmarks.eval_grammar --limit 20 --categories Github_easy JME
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict, deque
from multiprocessing import get_context
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

BACKENDS = ("xgrammar", "llguidance")
TASK_MODES = (*BACKENDS, "auto")
SYSTEMS = ("xgrammar", "llguidance", "structgen-xgrammar", "structgen-llguidance", "structgen")


def maskbench_dir() -> Path:
    """`$STRUCTGEN_SHARED/data/maskbench`, by default `<repo>/../shared/data/maskbench`."""
    shared = os.environ.get("STRUCTGEN_SHARED") or Path(__file__).resolve().parents[2] / "shared"
    return Path(shared) / "data" / "maskbench"


def load_category(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- worker side ----------------------------------------------------------------------------
class Evaluator:
    """Holds the tokenizer, one raw adapter per backend and an auto compiler."""

    def __init__(self) -> None:
        from structgen.engine.models.loader import load_model_config, load_tokenizer, resolve_model
        from structgen.grammar import GrammarCompiler
        from structgen.grammar.backends.llguidance import LLGuidanceBackend
        from structgen.grammar.backends.xgrammar import XGrammarBackend

        model_dir = resolve_model(progress=False)
        tokenizer = load_tokenizer(model_dir)
        vocab = load_model_config(model_dir).vocab_size
        stop = [tokenizer.eos_token_id]
        self.raw = {
            "xgrammar": XGrammarBackend(tokenizer, vocab, stop, threads=1),
            "llguidance": LLGuidanceBackend(tokenizer, vocab, stop),
        }
        self.auto = GrammarCompiler(tokenizer, vocab, stop, cache_size=1, threads=1)
        self._data: dict[str, list[dict[str, Any]]] = {}

    def run(self, category: str, index: int, mode: str) -> dict[str, Any]:
        from structgen.errors import StructgenError
        from structgen.grammar.keywords import find_issues
        from structgen.types import Constraint, JsonSchema, to_constraint

        if category not in self._data:
            self._data[category] = load_category(maskbench_dir() / f"{category}.jsonl")
        entry = self._data[category][index]
        schema = entry["schema"]
        out: dict[str, Any] = {"compiled": False, "error": None, "issues": []}
        t0 = time.perf_counter()
        try:
            if mode == "auto":
                grammar = self.auto.compile(to_constraint(JsonSchema(schema)))
                out["backend"] = grammar.backend
            else:
                out["issues"] = [str(i) for i in find_issues(schema, mode)][:5]
                source = json.dumps(schema, ensure_ascii=False)
                grammar = self.raw[mode].compile(
                    Constraint("json_schema", source, description="schema")
                )
        except StructgenError as e:
            out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            return out
        except Exception as e:  # a library exception we failed to wrap: a bug to report
            out["error"] = f"LEAKED {type(e).__name__}: {str(e)[:300]}"
            out["leaked"] = True
            return out
        out["compiled"] = True
        out["compile_ms"] = (time.perf_counter() - t0) * 1000
        out.update(check_instances(grammar, schema, entry["tests"]))
        return out


def check_instances(grammar: Any, schema: Any, tests: list[dict[str, Any]]) -> dict[str, Any]:
    """Feed each test instance, in canonical format, to `grammar`; count the disagreements."""
    from structgen.grammar import dump_json

    counts = {
        "valid": 0,
        "invalid": 0,
        "valid_rejected": 0,
        "invalid_accepted": 0,
        "failed_tests": [],
    }
    for i, test in enumerate(tests):
        try:
            accepted = grammar.accepts(dump_json(test["data"], schema))
        except Exception:
            accepted = False
        counts["valid" if test["valid"] else "invalid"] += 1
        if accepted != test["valid"]:
            counts["invalid_accepted" if accepted else "valid_rejected"] += 1
            counts["failed_tests"].append(i)
    return counts


def _worker(conn: Any) -> None:
    evaluator = Evaluator()
    conn.send("ready")
    while (task := conn.recv()) is not None:
        conn.send(evaluator.run(*task))


# -- parent side ----------------------------------------------------------------------------
class Pool:
    """Worker processes fed one task at a time, so a task that overruns can be killed alone."""

    def __init__(self, workers: int, timeout_s: float):
        self.ctx = get_context("spawn")
        self.timeout_s = timeout_s
        self.procs = [self._spawn() for _ in range(workers)]

    def _spawn(self) -> dict[str, Any]:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker, args=(child,), daemon=True)
        proc.start()
        return {"proc": proc, "conn": parent, "task": None, "start": 0.0, "ready": False}

    def run(self, tasks: list[tuple], on_result: Any) -> None:
        todo = deque(tasks)
        while todo or any(w["task"] for w in self.procs):
            for w in self.procs:
                if w["ready"] and w["task"] is None and todo:
                    w["task"], w["start"] = todo.popleft(), time.monotonic()
                    w["conn"].send(w["task"])
            for conn in wait([w["conn"] for w in self.procs], timeout=1.0):
                w = next(w for w in self.procs if w["conn"] is conn)
                try:
                    msg = conn.recv()
                except EOFError:  # the worker died (e.g. out of memory)
                    self._restart(w, on_result, "worker died")
                    continue
                if msg == "ready":
                    w["ready"] = True
                else:
                    on_result(w["task"], msg)
                    w["task"] = None
            now = time.monotonic()
            for w in self.procs:
                if w["task"] is not None and now - w["start"] > self.timeout_s:
                    self._restart(w, on_result, f"timeout after {self.timeout_s:.0f}s")

    def _restart(self, w: dict[str, Any], on_result: Any, why: str) -> None:
        if w["task"] is not None:
            on_result(w["task"], {"compiled": False, "error": why, "timeout": True})
        w["proc"].kill()
        w["proc"].join()
        w.update(self._spawn())

    def close(self) -> None:
        for w in self.procs:
            w["conn"].send(None)
            w["proc"].join(timeout=5)


def gated(raw: dict[str, Any]) -> dict[str, Any]:
    """What GrammarCompiler(backend=b) does with the raw result: refuse if the table objects."""
    if raw.get("issues"):
        return {"compiled": False, "error": "UnsupportedSchemaError: " + raw["issues"][0]}
    return raw


def summarize(
    results: dict[tuple[str, int, str], dict[str, Any]], categories: list[str]
) -> list[dict[str, Any]]:
    """One row per (category, system), plus an ALL row per system."""
    per: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for (cat, _, mode), r in results.items():
        if mode == "auto":
            per[(cat, "structgen")].append(r)
        else:
            per[(cat, mode)].append(r)
            per[(cat, f"structgen-{mode}")].append(gated(r))
    rows = []
    for cat in [*categories, "ALL"]:
        for system in SYSTEMS:
            rs = [r for (c, s), v in per.items() if s == system and cat in (c, "ALL") for r in v]
            if rs:
                rows.append(_row(cat, system, rs))
    return rows


def _row(category: str, system: str, rs: list[dict[str, Any]]) -> dict[str, Any]:
    compiled = [r for r in rs if r["compiled"]]
    times = sorted(r["compile_ms"] for r in compiled)
    passing = [r for r in compiled if not r["valid_rejected"] and not r["invalid_accepted"]]
    return {
        "category": category,
        "system": system,
        "schemas": len(rs),
        "compiled": len(compiled),
        "passing": len(passing),
        "pass_pct": 100.0 * len(passing) / len(rs),
        "invalid_accepted": sum(r["invalid_accepted"] for r in compiled),
        "schemas_inv_acc": sum(1 for r in compiled if r["invalid_accepted"]),
        "valid_rejected": sum(r["valid_rejected"] for r in compiled),
        "compile_p50_ms": statistics.median(times) if times else None,
        "compile_p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))] if times else None,
        "timeouts": sum(1 for r in rs if r.get("timeout")),
        "leaked": sum(1 for r in rs if r.get("leaked")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--categories", nargs="*", help="default: all *.jsonl files")
    parser.add_argument("--limit", type=int, default=0, help="schemas per category (0: all)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds per schema and backend"
    )
    parser.add_argument("--details", type=Path, help="write per-schema results (JSON lines) here")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/results")
    args = parser.parse_args()

    data = maskbench_dir()
    if not data.is_dir():
        sys.exit(f"MaskBench data not found at {data} (set STRUCTGEN_SHARED)")
    categories = args.categories or sorted(p.stem for p in data.glob("*.jsonl"))
    tasks = []
    for cat in categories:
        n = len(load_category(data / f"{cat}.jsonl"))
        tasks += [(cat, i, m) for i in range(min(n, args.limit or n)) for m in TASK_MODES]

    results: dict[tuple[str, int, str], dict[str, Any]] = {}
    t0 = time.time()

    def on_result(task: tuple, result: dict[str, Any]) -> None:
        results[task] = result
        if len(results) % 300 == 0:
            print(
                f"  {len(results)}/{len(tasks)} in {time.time() - t0:.0f}s",
                file=sys.stderr,
                flush=True,
            )

    pool = Pool(args.workers, args.timeout)
    try:
        pool.run(tasks, on_result)
    finally:
        pool.close()
    wall = time.time() - t0

    from benchmarks.common import RESULTS_DIR, device_name, git_commit, print_table, slug

    rows = summarize(results, categories)
    for cat in [*categories, "ALL"]:
        print(f"\n== {cat}")
        print_table(
            [{k: v for k, v in r.items() if k != "category"} for r in rows if r["category"] == cat]
        )
    print(f"\n{len(tasks)} schema x backend runs in {wall:.0f}s with {args.workers} workers")

    if args.details:
        with args.details.open("w") as f:
            for (cat, i, mode), r in sorted(results.items()):
                f.write(json.dumps({"category": cat, "index": i, "mode": mode, **r}) + "\n")
    if not args.no_write:
        out = []
        for r in rows:
            base = {"system": r["system"], "model": "smollm2-135m", "category": r["category"]}
            extra = {k: v for k, v in r.items() if k not in ("system", "category")}
            out.append(
                {**base, "metric": "coverage", "value": r["compiled"] / r["schemas"], **extra}
            )
            out.append(
                {**base, "metric": "compliance", "value": r["passing"] / r["schemas"], **extra}
            )
        doc = {
            "benchmark": "eval",
            "device": device_name(),
            "date": time.strftime("%Y-%m-%d"),
            "commit": commit if (commit := git_commit()) != "unknown" else "uncommitted",
            "data": "MaskBench (guidance-ai/jsonschemabench), see shared/data/maskbench/SOURCE.json",
            "settings": {"workers": args.workers, "timeout_s": args.timeout, "limit": args.limit},
            "wall_s": round(wall, 1),
            "rows": out,
        }
        path = RESULTS_DIR / f"eval-grammar-{slug(doc['device'])}-{time.strftime('%Y%m%d')}.json"
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
