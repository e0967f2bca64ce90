"""Grammar correctness on a deterministic sample of MaskBench (real-world JSON schemas with
valid and invalid test instances), with each backend and with "auto".

Every test instance is written in the grammars' canonical format (`dump_json`); a compiled
grammar must accept the valid ones and must never accept an invalid one. Failures to compile
must be clean structgen errors. The full run over all 3,300 schemas is
`python -m benchmarks.eval_grammar`; this samples a few small schemas per category.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from structgen.errors import StructgenError
from structgen.grammar import dump_json
from structgen.types import JsonSchema, to_constraint

PER_CATEGORY = 3
MAX_SCHEMA_CHARS = 3000  # small schemas keep the sample fast on two CPU cores
COMPILE_TIMEOUT_S = 20.0
SYSTEMS = ("xgrammar", "llguidance", "auto")


def sample(maskbench_dir: Path) -> list[tuple[str, int, dict[str, Any]]]:
    """The first PER_CATEGORY small schemas of each category that have test instances."""
    picked = []
    for path in sorted(maskbench_dir.glob("*.jsonl")):
        n = 0
        for i, line in enumerate(path.read_text().splitlines()):
            entry = json.loads(line)
            if entry["tests"] and len(json.dumps(entry["schema"])) <= MAX_SCHEMA_CHARS:
                picked.append((path.stem, i, entry))
                n += 1
                if n == PER_CATEGORY:
                    break
    return picked


def compile_with_timeout(compiler, constraint, backend: str) -> Any:
    """compile() in a thread (the backends release the GIL); None if it overruns."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["grammar"] = compiler.compile(constraint, backend=backend)
        except BaseException as e:  # re-raised in the test thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(COMPILE_TIMEOUT_S)
    if thread.is_alive():
        return None
    if "error" in box:
        raise box["error"]
    return box["grammar"]


def test_normalized_schemas_keep_every_verdict(maskbench_dir: Path):
    """The schema a grammar is compiled from (`schema.normalize`) must judge every test
    instance exactly as the original schema does."""
    import jsonschema

    for category, index, entry in sample(maskbench_dir):
        schema = entry["schema"]
        try:
            constraint = to_constraint(JsonSchema(schema), strict=False)
        except StructgenError:
            continue
        if constraint.relaxed:  # keywords left out of the grammar on purpose (strict=False)
            continue
        rewritten = json.loads(constraint.source)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        for test in entry["tests"]:
            verdict = cls(schema).is_valid(test["data"])
            assert cls(rewritten).is_valid(test["data"]) == verdict, f"{category}[{index}]"


def test_maskbench_sample(maskbench_dir: Path, grammar_compiler):
    stats: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    invalid_accepted, leaked = [], []
    for category, index, entry in sample(maskbench_dir):
        for system in SYSTEMS:
            s = stats[(category, system)]
            s["schemas"] += 1
            try:
                constraint = to_constraint(JsonSchema(entry["schema"]))
                grammar = compile_with_timeout(grammar_compiler, constraint, system)
            except StructgenError:
                continue  # refused cleanly: coverage, not correctness
            except Exception as e:
                leaked.append(f"{category}[{index}] {system}: {type(e).__name__}: {e}")
                continue
            if grammar is None:
                s["timeouts"] += 1
                continue
            s["compiled"] += 1
            schema = json.loads(constraint.source)
            wrong = 0
            for test in entry["tests"]:
                accepted = grammar.accepts(dump_json(test["data"], schema))
                if accepted and not test["valid"]:
                    invalid_accepted.append(f"{category}[{index}] {system}: {test['data']!r:.200}")
                    wrong += 1
                elif not accepted and test["valid"]:
                    s["valid_rejected"] += 1
                    wrong += 1
            s["passing"] += wrong == 0

    _print_table(stats)
    assert not leaked, "library exceptions escaped:\n" + "\n".join(leaked)
    assert not invalid_accepted, "grammars accepted invalid instances:\n" + "\n".join(
        invalid_accepted
    )
    auto = [s for (_, system), s in stats.items() if system == "auto"]
    passing = sum(s["passing"] for s in auto) / sum(s["schemas"] for s in auto)
    assert passing >= 0.9, f"auto passes only {passing:.0%} of the sample"


def _print_table(stats: dict[tuple[str, str], dict[str, int]]) -> None:
    cols = ("schemas", "compiled", "passing", "valid_rejected", "timeouts")
    print(f"\n{'category':24s} {'system':10s} " + " ".join(f"{c:>14s}" for c in cols))
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for (category, system), s in sorted(stats.items()):
        print(f"{category:24s} {system:10s} " + " ".join(f"{s[c]:14d}" for c in cols))
        for c in cols:
            totals[system][c] += s[c]
    for system, s in totals.items():
        print(f"{'ALL':24s} {system:10s} " + " ".join(f"{s[c]:14d}" for c in cols))


# Real schemas the rewrites of issue #2 made compile and pass, one per rewrite: recursive
# $refs merged with their siblings (WashingtonPost 0), key order (JsonSchemaStore 60),
# llguidance's lexer budget (Github_medium 132), `not` of a pattern (Github_hard 233),
# oneOf branches apart by type (Github_medium 172) and by closed keys (JsonSchemaStore 30).
FIXED = ["WashingtonPost/0", "JsonSchemaStore/60", "Github_medium/132", "Github_hard/233",
         "Github_medium/172", "JsonSchemaStore/30"]  # fmt: skip


@pytest.mark.parametrize("name", FIXED)
def test_fixed_maskbench_schemas_pass(maskbench_dir: Path, grammar_compiler, name):
    category, index = name.split("/")
    line = (maskbench_dir / f"{category}.jsonl").read_text().splitlines()[int(index)]
    entry = json.loads(line)
    constraint = to_constraint(JsonSchema(entry["schema"]))
    grammar = grammar_compiler.compile(constraint)
    schema = json.loads(constraint.source)
    for test in entry["tests"]:
        assert grammar.accepts(dump_json(test["data"], schema)) == test["valid"], test["description"]
