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
import hashlib
import json
import statistics
import sys
import time
from collections import deque
from multiprocessing import get_context
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from benchmarks.common import maskbench_dir

BACKENDS = ("xgrammar", "llguidance")
FALLBACK = "~fallback"  # raw results of a schema's stricter fallback: backend + FALLBACK
SYSTEMS = ("xgrammar", "llguidance", "structgen-xgrammar", "structgen-llguidance", "structgen")


def load_category(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- worker side ----------------------------------------------------------------------------
class Evaluator:
    """Holds the tokenizer and one adapter per backend; compiles schemas as given (no keyword
    table: that is applied in the parent, see `outcomes`)."""

    def __init__(self) -> None:
        from structgen.engine.models.loader import load_model_config, load_tokenizer, resolve_model
        from structgen.grammar.backends.llguidance import LLGuidanceBackend
        from structgen.grammar.backends.xgrammar import XGrammarBackend

        model_dir = resolve_model(progress=False)
        tokenizer = load_tokenizer(model_dir)
        vocab = load_model_config(model_dir).vocab_size
        stop = [tokenizer.eos_token_id]
        self.backends = {
            "xgrammar": XGrammarBackend(tokenizer, vocab, stop, threads=1),
            "llguidance": LLGuidanceBackend(tokenizer, vocab, stop),
        }
        self._data: dict[str, list[dict[str, Any]]] = {}

    def run(self, category: str, index: int, backend: str, source: str) -> dict[str, Any]:
        from structgen.errors import StructgenError
        from structgen.types import Constraint

        if category not in self._data:
            self._data[category] = load_category(maskbench_dir() / f"{category}.jsonl")
        tests = self._data[category][index]["tests"]
        out: dict[str, Any] = {"compiled": False, "error": None}
        t0 = time.perf_counter()
        try:
            constraint = Constraint("json_schema", source, description="schema")
            grammar = self.backends[backend.removesuffix(FALLBACK)].compile(constraint)
        except StructgenError as e:
            out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            return out
        except Exception as e:  # a library exception we failed to wrap: a bug to report
            out.update(error=f"LEAKED {type(e).__name__}: {str(e)[:300]}", leaked=True)
            return out
        out["compiled"] = True
        out["compile_ms"] = (time.perf_counter() - t0) * 1000
        out.update(check_instances(grammar, json.loads(source), tests))
        return out


def generation_sources(schema: Any) -> tuple[str, str | None]:
    """The schema text structgen compiles (`to_constraint`: checked and normalized), and its
    stricter fallback (`Constraint.fallback`) if it has one. Where no backend enforces every
    keyword (structgen refuses it) the libraries alone still see the normalized schema, and
    where structgen refuses it for another reason, the schema as given."""
    from structgen.errors import StructgenError, UnsupportedSchemaError
    from structgen.schema.normalize import normalize_exact, normalize_schema
    from structgen.types import JsonSchema, _canonical, to_constraint

    try:
        constraint = to_constraint(JsonSchema(schema))
    except UnsupportedSchemaError:
        generated, inexact = normalize_exact(schema)
        tightened = normalize_schema(schema, tighten=True) if inexact else None
        return _canonical(generated), None if tightened is None else _canonical(tightened)
    except StructgenError:
        return json.dumps(schema, ensure_ascii=False), None
    return constraint.source, constraint.fallback and constraint.fallback.source


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


def outcomes(schema: Any, raw: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every system's result for one schema, from the raw compiles (`raw[backend]`, and
    `raw[backend + FALLBACK]` for the schema's stricter fallback when it has one).

    The structgen systems apply what the product applies before compiling: `to_constraint`
    (schema checks, and for "auto" the enforceability check) and `candidate_backends` (the
    keyword table). They then get the first candidate whose compile succeeded, exactly as
    `GrammarCompiler.compile` does (a candidate that timed out stops it there), and when none
    did, the same for the fallback.
    """
    from structgen.errors import StructgenError
    from structgen.grammar import candidate_backends
    from structgen.types import JsonSchema, to_constraint

    def refused(e: StructgenError) -> dict[str, Any]:
        return {"compiled": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}

    def compile_as_product(constraint: Any, backend: str, tail: str = "") -> dict[str, Any]:
        try:
            order = candidate_backends(constraint, backend)
        except StructgenError as e:
            result = refused(e)
        else:
            # a variant compiled only where the product's constraint had it (no fallback: none)
            tried = {b: raw.get(b + tail, {"compiled": False, "error": "not compiled"}) for b in order}
            ok = [b for b in order if tried[b]["compiled"] or tried[b].get("timeout")]
            chosen = ok[0] if ok else order[-1]
            result = {**tried[chosen], "backend": chosen + tail}
        if result["compiled"] or result.get("timeout") or constraint.fallback is None:
            return result
        fallback = compile_as_product(constraint.fallback, backend, FALLBACK)
        return fallback if fallback["compiled"] or fallback.get("timeout") else result

    out = dict(raw)
    try:  # as the product builds it by default (strict): refused where no backend enforces it
        constraint = to_constraint(JsonSchema(schema))
    except StructgenError as e:
        return {**out, **{s: refused(e) for s in SYSTEMS if s.startswith("structgen")}}
    for b in [*BACKENDS, "auto"]:
        out["structgen" if b == "auto" else f"structgen-{b}"] = compile_as_product(constraint, b)
    return out


def summarize(
    results: dict[tuple[str, int], dict[str, Any]], categories: list[str]
) -> list[dict[str, Any]]:
    """One row per (category, system), plus an ALL row per system."""
    rows = []
    for cat in [*categories, "ALL"]:
        for system in SYSTEMS:
            rs = [r[system] for (c, _), r in results.items() if cat in (c, "ALL")]
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


def raw_fingerprint() -> str:
    """What a raw result depends on besides the schema text: the backend adapters, the JSON
    writer the instances go through, and the library versions. A cached result made with
    other code is stale (Github_easy #176 kept, for hours, an 'invalid accepted' from when
    the writer still turned 12345.0 into 12345)."""
    from importlib.metadata import version

    import structgen.grammar as grammar
    import structgen.schema.json_format as json_format

    files = sorted((Path(grammar.__file__).parent / "backends").glob("*.py")) + [Path(json_format.__file__)]
    h = hashlib.sha1()
    for f in files:
        h.update(f.read_bytes())
    for lib in BACKENDS:
        h.update(version(lib).encode())
    return h.hexdigest()


def run_backends(
    categories: list[str], limit: int, workers: int, timeout_s: float, cache: Path | None
) -> dict[tuple[str, int, str], dict[str, Any]]:
    """Compile + instance check of every schema with every backend, in worker processes.

    Results are appended to `cache` as they come and reused on the next run when the compiled
    schema text and `raw_fingerprint()` are unchanged (so editing the normalizer re-runs only
    the schemas it changes).
    """
    fingerprint = raw_fingerprint()

    def key(source: str) -> str:
        return hashlib.sha1((fingerprint + source).encode()).hexdigest()

    cached: dict[tuple[str, int, str], dict[str, Any]] = {}
    if cache and cache.exists():
        for line in cache.read_text().splitlines():
            r = json.loads(line)
            cached[(r.pop("category"), r.pop("index"), r.pop("backend"))] = r
    raw: dict[tuple[str, int, str], dict[str, Any]] = {}
    tasks = []
    for cat in categories:
        entries = load_category(maskbench_dir() / f"{cat}.jsonl")
        for i, entry in enumerate(entries[: limit or None]):
            source, fallback = generation_sources(entry["schema"])
            variants = [(b, source) for b in BACKENDS]
            if fallback is not None:
                variants += [(b + FALLBACK, fallback) for b in BACKENDS]
            for b, text in variants:
                hit = cached.get((cat, i, b))
                if hit is not None and hit.get("sha") == key(text):
                    raw[(cat, i, b)] = hit
                else:
                    tasks.append((cat, i, b, text))
    print(f"{len(raw)} cached results, {len(tasks)} to run", file=sys.stderr, flush=True)
    t0 = time.time()
    log = cache.open("a") if cache else None

    def on_result(task: tuple, result: dict[str, Any]) -> None:
        cat, i, b, source = task
        result["sha"] = key(source)
        raw[(cat, i, b)] = result
        if log:
            log.write(json.dumps({"category": cat, "index": i, "backend": b, **result}) + "\n")
            log.flush()
        if len(raw) % 200 == 0:
            print(f"  {len(raw)} done, {time.time() - t0:.0f}s", file=sys.stderr, flush=True)

    pool = Pool(workers, timeout_s)
    try:
        pool.run(tasks, on_result)
    finally:
        pool.close()
        if log:
            log.close()
    return raw


def write_results(rows: list[dict[str, Any]], settings: dict[str, Any], wall_s: float) -> Path:
    """benchmarks/results/eval-grammar-<device>-<date>.json, format of shared/BENCHMARKS.md."""
    from benchmarks.common import RESULTS_DIR, device_name, git_commit, slug

    out = []
    for r in rows:
        base = {"system": r["system"], "model": "smollm2-135m", "category": r["category"]}
        extra = {k: v for k, v in r.items() if k not in ("system", "category")}
        out.append({**base, "metric": "coverage", "value": r["compiled"] / r["schemas"], **extra})
        out.append({**base, "metric": "compliance", "value": r["passing"] / r["schemas"], **extra})
    commit = git_commit()
    doc = {
        "benchmark": "eval",
        "device": device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit if commit != "unknown" else "uncommitted",
        "data": "MaskBench (guidance-ai/jsonschemabench), see shared/data/maskbench/SOURCE.json",
        "settings": settings,
        "wall_s": round(wall_s, 1),
        "rows": out,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"eval-grammar-{slug(doc['device'])}-{time.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


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
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "structgen" / "eval-grammar-cache.jsonl",
        help="per-schema results, reused while the compiled schema text and the code are unchanged",
    )
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/results")
    args = parser.parse_args()

    from benchmarks.common import print_table

    if not maskbench_dir().is_dir():
        sys.exit(f"MaskBench data not found at {maskbench_dir()} (set STRUCTGEN_SHARED)")
    categories = args.categories or sorted(p.stem for p in maskbench_dir().glob("*.jsonl"))
    t0 = time.time()
    args.cache.parent.mkdir(parents=True, exist_ok=True)
    raw = run_backends(categories, args.limit, args.workers, args.timeout, args.cache)
    wall = time.time() - t0

    results = {}
    for cat in categories:
        for i, entry in enumerate(load_category(maskbench_dir() / f"{cat}.jsonl")):
            if all((cat, i, b) in raw for b in BACKENDS):
                names = [b + tail for b in BACKENDS for tail in ("", FALLBACK)]
                results[(cat, i)] = outcomes(
                    entry["schema"], {b: raw[(cat, i, b)] for b in names if (cat, i, b) in raw}
                )
    rows = summarize(results, categories)
    for cat in [*categories, "ALL"]:
        print(f"\n== {cat}")
        print_table(
            [{k: v for k, v in r.items() if k != "category"} for r in rows if r["category"] == cat]
        )
    print(
        f"\n{len(results)} schemas x {len(BACKENDS)} backends in {wall:.0f}s, {args.workers} workers"
    )
    if not args.no_write:
        settings = {"workers": args.workers, "timeout_s": args.timeout, "limit": args.limit}
        print(f"wrote {write_results(rows, settings, wall)}")


if __name__ == "__main__":
    main()
