"""Short programs that use the SDK exit with the code they ask for, never with an abort.

A daemon engine thread still inside a step while the interpreter finalizes used to abort the
process ("terminate called without an active exception", exit code 134) after all output,
at random (issue 27). Each script in tests/exit_scripts/ runs in a fresh interpreter on the
default model; two run at a time to bound the wall time on a two-core machine."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPTS_DIR = Path(__file__).parent / "exit_scripts"
SCRIPTS = sorted(p for p in SCRIPTS_DIR.glob("*.py") if not p.name.startswith("_"))
REPO_ROOT = Path(__file__).resolve().parents[1]
PARALLEL = 2
SCRIPT_TIMEOUT_S = 180
ABORT_MARK = "terminate called"


@dataclass
class ScriptRun:
    script: Path
    expected: int
    returncode: int
    stderr: str

    @property
    def clean(self) -> bool:
        return self.returncode == self.expected and ABORT_MARK not in self.stderr

    def describe(self) -> str:
        tail = "\n    ".join(self.stderr.strip().splitlines()[-6:])
        return f"{self.script.name}: exit {self.returncode} (expected {self.expected})\n    {tail}"


def expected_exit(script: Path) -> int:
    """The exit code a script asks for on its first line (`# expect-exit: N`), else 0."""
    first = script.read_text().splitlines()[0]
    return int(first.split(":", 1)[1]) if first.startswith("# expect-exit:") else 0


def run_script(script: Path) -> ScriptRun:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=SCRIPTS_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    return ScriptRun(script, expected_exit(script), done.returncode, done.stderr)


def run_back_to_back(scripts: list[Path]) -> list[ScriptRun]:
    with ThreadPoolExecutor(PARALLEL) as pool:
        return list(pool.map(run_script, scripts))


def assert_all_clean(runs: list[ScriptRun]) -> None:
    bad = [r.describe() for r in runs if not r.clean]
    assert not bad, f"{len(bad)} of {len(runs)} scripts did not exit cleanly:\n" + "\n".join(bad)


def test_the_exit_scripts_cover_ten_ways_to_end_a_program(model_dir: Path) -> None:
    assert len(SCRIPTS) == 10
    assert {expected_exit(s) for s in SCRIPTS} == {0, 1, 3}


def test_each_exit_script_exits_with_its_own_code_and_no_abort(model_dir: Path) -> None:
    assert_all_clean(run_back_to_back(SCRIPTS))


@pytest.mark.slow
def test_fifty_exit_scripts_back_to_back_exit_cleanly(model_dir: Path) -> None:
    assert_all_clean(run_back_to_back(SCRIPTS * 5))


def test_closing_the_engine_loop_aborts_its_requests_and_stops_its_thread(model_dir: Path) -> None:
    import structgen
    from structgen.errors import EngineError, RequestCancelledError

    llm = structgen.LLM(config=structgen.EngineConfig(device="cpu", max_seq_len=1024))
    stream = llm.stream(str, "Write a long story about the sea.", max_tokens=500)
    next(stream)  # decoding has started
    llm.loop.close()
    assert not llm.loop._thread.is_alive()
    with pytest.raises(RequestCancelledError):
        list(stream)
    with pytest.raises(EngineError, match="closed"):
        llm.generate(str, "Hello", max_tokens=2)
