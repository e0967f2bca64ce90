"""Normalizations running on several threads at once (a burst of distinct schemas) give what
each gives alone: the enum index they share per draft keeps each one's enum sets apart."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from structgen.schema.normalize import normalize_exact


def _enum_schema(i: int) -> dict:
    values = [f"v{i}-{k}" for k in range(300)]
    return {"type": "object", "properties": {"tag": {"enum": values, "not": {"const": values[0]}}}}


def test_normalizations_on_threads_equal_those_run_one_by_one(maskbench_dir: Path):
    lines = (maskbench_dir / "Glaiveai2K.jsonl").read_text().splitlines()[:20]
    schemas = [json.loads(line)["schema"] for line in lines if line.strip()] + [_enum_schema(i) for i in range(8)]
    alone = [json.dumps(normalize_exact(s), sort_keys=True) for s in schemas]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda s: json.dumps(normalize_exact(s), sort_keys=True), schemas))
    assert together == alone
    for i, text in enumerate(alone[-8:]):  # each `not` took its own enum's first value out
        assert f'"v{i}-0"' not in text and f'"v{i}-1"' in text
