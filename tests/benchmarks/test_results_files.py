"""The results files the benchmarks write: the standard keys of ../shared/BENCHMARKS.md, and the
host the figures came from (CPU figures move with it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import common


def test_a_results_file_names_its_benchmark_commit_and_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setenv("STRUCTGEN_COMMIT", "abc1234")
    path = common.write_results("demo", [{"system": "structgen", "value": 1.5}], extra={"settings": {"n": 1}})
    doc = json.loads(path.read_text())
    assert path.name.startswith(f"demo-{common.slug(common.device_name())}-")
    assert doc["benchmark"] == "demo" and doc["commit"] == "abc1234" and doc["rows"][0]["value"] == 1.5
    assert doc["settings"] == {"n": 1}
    assert doc["host"]["cores"] == os.cpu_count()
    if Path("/proc/cpuinfo").exists():  # Linux: the model name the kernel reports
        assert doc["host"]["cpu"] and doc["host"]["cpu"] in Path("/proc/cpuinfo").read_text()
