"""The native libraries' builds (structgen/csrc): cached per machine, and built in a thread while
a newcomer's first model loads, where a loader that needs one meanwhile waits for that build
instead of compiling it a second time. Real compiler commands, a temporary cache."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from structgen.csrc import build_in_background, build_library


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STRUCTGEN_CACHE", str(tmp_path))
    return tmp_path / "native"


def slow_commands(runs: Path):
    """A "compiler" that takes a while and counts its runs."""

    def commands(compiler: str, source: Path, output: Path) -> list[list[str]]:
        return [["sh", "-c", f'sleep 0.5; echo run >> "{runs}"; cp "{source}" "{output}"']]

    return commands


def test_a_build_in_progress_is_waited_for_not_run_twice(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    built: list[Path] = []
    thread = build_in_background([lambda: built.append(build_library("grammar_lengths.cpp", slow_commands(runs)))])
    path = build_library("grammar_lengths.cpp", slow_commands(runs))  # the loader, meanwhile
    thread.join(10)
    assert runs.read_text().splitlines() == ["run"]
    assert built == [path] and path.is_file()
    assert build_library("grammar_lengths.cpp", slow_commands(runs)) == path  # cached: no run
    assert runs.read_text().splitlines() == ["run"]


def test_a_failed_background_build_is_left_to_its_loader_to_report(tmp_path: Path) -> None:
    def failing(compiler: str, source: Path, output: Path) -> list[list[str]]:
        return [["sh", "-c", "echo 'no such header' >&2; exit 1"]]

    build_in_background([lambda: build_library("grammar_step.cpp", failing)]).join(10)
    with pytest.raises(RuntimeError, match="building grammar_step.cpp failed: no such header"):
        build_library("grammar_step.cpp", failing)


def test_the_llm_starts_every_library_it_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM()` hands the builds of the three libraries it loads to the thread (they are the
    loaders' own build functions, so what is built is what is loaded; the GGUF block kernels
    also de-quantize a GGUF's weights for a GPU, so they are built whatever the device)."""
    from structgen import api
    from structgen.engine.kernels import cpu_quant
    from structgen.grammar import native, termination

    started: list[list] = []
    monkeypatch.setattr("structgen.csrc.build_in_background", lambda builds: started.append(builds)
                        or threading.Thread())
    api._start_native_builds()
    assert started == [[cpu_quant.build, native.build, termination.build_lengths_library]]
    monkeypatch.setenv("STRUCTGEN_DISABLE_NATIVE", "1")
    api._start_native_builds()
    assert len(started) == 1


def test_a_child_forked_during_a_build_builds_without_waiting_for_the_parents_thread(tmp_path: Path) -> None:
    """The parent's build thread holds its library's lock; a child forked meanwhile (a prefork
    server) has no such thread, and must not wait for that lock forever."""
    import os
    import signal

    runs = tmp_path / "runs"
    started = threading.Event()

    def slow(compiler: str, source: Path, output: Path) -> list[list[str]]:
        started.set()
        return [["sh", "-c", f'sleep 2; echo run >> "{runs}"; cp "{source}" "{output}"']]

    thread = build_in_background([lambda: build_library("grammar_lengths.cpp", slow)])
    assert started.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: builds it itself (its own compiler run) within the alarm
        signal.alarm(20)
        try:
            build_library("grammar_lengths.cpp", slow_commands(tmp_path / "child-runs"))
            os._exit(0)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    thread.join(20)
    assert os.waitstatus_to_exitcode(status) == 0
