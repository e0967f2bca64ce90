"""Timed launch shapes kept on disk (kernels/timed_plans.py): a later process reads what an
earlier one timed instead of timing again, but never across a change of device, versions or
kernel source, and a damaged file is timed over. On the CPU (the device identity is "cpu"),
with the cache folder in a temporary directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from structgen.engine.kernels.gemv import Block
from structgen.engine.kernels.timed_plans import TimedPlans

CPU = torch.device("cpu")
KEY = (8, (4096, 2048), "torch.bfloat16")
FAST = Block(32, 512, 4, 4, "dot")


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STRUCTGEN_CACHE", str(tmp_path))
    return tmp_path / "plans"


def family(source: Path, name: str = "gemv") -> TimedPlans[Block | None]:
    """A fresh instance: what a new process sees."""
    return TimedPlans(name, str(source), lambda b: None if b is None else list(b),
                      lambda v: None if v is None else Block(*v))


def never() -> Block | None:
    raise AssertionError("timed again")


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "kernel.py"
    path.write_text("# the kernel, version 1\n")
    return path


def test_a_plan_timed_by_one_process_is_read_by_the_next(source: Path) -> None:
    timings = []
    first = family(source)
    assert first.plan_for(KEY, CPU, lambda: timings.append(1) or FAST, during_capture=None) == FAST
    assert first.plan_for(KEY, CPU, never, during_capture=None) == FAST and timings == [1]
    later = family(source)
    assert not later.remembers(KEY, CPU)
    assert later.plan_for(KEY, CPU, never, during_capture=None) == FAST
    assert later.remembers(KEY, CPU)


def test_cublas_chosen_is_a_plan_too(source: Path) -> None:
    """`None` (cuBLAS won) is kept like any block shape, not taken for "not timed yet"."""
    family(source).plan_for(KEY, CPU, lambda: None, during_capture=FAST)
    assert family(source).plan_for(KEY, CPU, never, during_capture=FAST) is None


def test_another_family_kernel_source_or_key_times_afresh(source: Path) -> None:
    family(source).plan_for(KEY, CPU, lambda: FAST, during_capture=None)
    other = Block(4, 1024, 4, 4, "chunk")
    assert family(source, "fused_gemv").plan_for(KEY, CPU, lambda: other, during_capture=None) == other
    assert family(source).plan_for((16, *KEY[1:]), CPU, lambda: other, during_capture=None) == other
    source.write_text("# the kernel, version 2: an edited kernel may be fastest at another shape\n")
    assert family(source).plan_for(KEY, CPU, lambda: other, during_capture=None) == other


def test_plans_of_both_processes_are_kept_in_one_file(source: Path, cache: Path) -> None:
    a, b = family(source), family(source)
    a.plan_for(KEY, CPU, lambda: FAST, during_capture=None)
    b.plan_for((16, *KEY[1:]), CPU, lambda: None, during_capture=None)  # b adds to the file a wrote
    stored = json.loads(a.path(CPU).read_text())
    assert stored["device"] == "cpu" and len(stored["plans"]) == 2
    assert [p.name for p in cache.iterdir()] == [a.path(CPU).name]  # no temporary file left behind


@pytest.mark.parametrize("damage", ["{not json", '{"plans": {"[8]": [1, 2]}}', '["a list"]', ""])
def test_a_damaged_file_is_timed_over_and_rewritten(source: Path, damage: str) -> None:
    plans = family(source)
    plans.path(CPU).parent.mkdir(parents=True)
    plans.path(CPU).write_text(damage)
    assert plans.plan_for(KEY, CPU, lambda: FAST, during_capture=None) == FAST
    assert family(source).plan_for(KEY, CPU, never, during_capture=None) == FAST


def test_an_unwritable_cache_keeps_plans_in_memory(source: Path, cache: Path) -> None:
    cache.parent.mkdir(exist_ok=True)
    cache.write_text("a file where the folder would be")
    plans = family(source)
    assert plans.plan_for(KEY, CPU, lambda: FAST, during_capture=None) == FAST
    assert plans.plan_for(KEY, CPU, never, during_capture=None) == FAST


def test_a_plan_another_process_wrote_meanwhile_is_the_one_used(source: Path) -> None:
    """Two replicas started together both time a shape: the second to finish runs the first's
    plan, so both run the same kernels."""
    first, second = family(source), family(source)
    second.plan_for((16, *KEY[1:]), CPU, lambda: None, during_capture=None)  # (second has read the file)
    assert first.plan_for(KEY, CPU, lambda: FAST, during_capture=None) == FAST
    assert second.plan_for(KEY, CPU, lambda: Block(4, 1024, 4, 4, "chunk"), during_capture=None) == FAST
