"""The `structgen` command's answers to user mistakes, run as a user runs it (a subprocess):
one line `structgen: error: ...` naming the problem and its fix, exit code 2, no traceback.
The mistakes are caught before the model loads, so each run takes about a second."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT_S = 120


def structgen(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "structgen", *argv], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=cwd)


def one_line_error(r: subprocess.CompletedProcess[str], *words: str) -> str:
    """The run failed with exit code 2 and a single `structgen: error:` line holding `words`."""
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("structgen: error: "), r.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("argv", "words"), [
    (["--grammar", "nofile.gbnf"], ["--grammar nofile.gbnf", "no such file"]),
    (["--schema", "missing.json"], ["--schema missing.json", "no such file"]),
    (["--schema", "schemas/missing"], ["--schema schemas/missing", "no such file"]),
    (["--max-tokens", "0"], ["--max-tokens 0", "at least 1"]),
])
def test_generate_names_a_missing_file_or_a_bad_flag(argv: list[str], words: list[str], tmp_path: Path) -> None:
    one_line_error(structgen("generate", *argv, "hi", cwd=tmp_path), *words)


def test_generate_refuses_a_directory_as_schema_or_grammar(tmp_path: Path) -> None:
    one_line_error(structgen("generate", "--schema", str(tmp_path), "hi"), "is a directory")
    one_line_error(structgen("generate", "--grammar", str(tmp_path), "hi"), "is a directory")


def test_a_model_with_a_broken_config_json_names_the_file(tmp_path: Path, model_dir: Path) -> None:
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    for text in ("{not json", "[1, 2]"):
        (tmp_path / "config.json").write_text(text)
        one_line_error(structgen("generate", "--model", str(tmp_path), "hi"), str(tmp_path / "config.json"))


@pytest.mark.parametrize(("argv", "words"), [
    (["--port", "-1"], ["--port -1", "0-65535"]),
    (["--port", "70000"], ["--port 70000", "0-65535"]),
    (["--max-body-bytes", "-1"], ["--max-body-bytes -1", "at least 1"]),
    (["--default-max-tokens", "0"], ["--default-max-tokens 0", "at least 1"]),
    (["--default-max-tokens", "-5"], ["--default-max-tokens -5"]),
    (["--max-generations-per-request", "0"], ["--max-generations-per-request 0"]),
    (["--data-parallel", "0"], ["--data-parallel 0"]),
    (["--data-parallel", "-1"], ["--data-parallel -1"]),
    (["--front-processes", "-1"], ["--front-processes -1", "at least 0"]),
    (["--max-enum-values", "0"], ["--max-enum-values 0", "at least 1"]),
    (["--max-constraint-bytes", "-1"], ["--max-constraint-bytes -1", "at least 1"]),
    (["--compile-timeout", "0"], ["--compile-timeout 0.0", "positive number of seconds"]),
    (["--max-constraint-depth", "65"], ["--max-constraint-depth 65", "over the most structgen takes, 64"]),
    (["--host", "no-such-host.invalid"], ["--host no-such-host.invalid"]),
])
def test_serve_refuses_bad_flags_before_loading_the_model(argv: list[str], words: list[str]) -> None:
    one_line_error(structgen("serve", *argv), *words)


def test_serve_reports_a_port_in_use_before_loading_the_model() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        one_line_error(structgen("serve", "--port", str(port)), f"port {port}", "in use", "--port")


def test_ctrl_c_stops_an_idle_server_with_one_line_and_exit_130() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(  # SIGINT as a terminal sends it (a background child may inherit it ignored)
        [sys.executable, "-m", "structgen.cli", "serve", "--device", "cpu", "--port", str(port)],
        stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # serving once uvicorn says so
            if "Uvicorn running" in line:
                break
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=TIMEOUT_S) == 130, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in rest and rest.strip().splitlines()[-1] == "structgen: interrupted", rest


@pytest.mark.parametrize("fronts", [[], ["--front-processes", "1"]], ids=["single server", "front processes"])
def test_port_0_serves_on_the_port_it_picked_and_answers_its_loopback_names(fronts: list[str]) -> None:
    # The default Host checks once named port 0, so every request by a loopback name was refused.
    import re
    import threading
    import time

    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "structgen_server", "--device", "cpu", "--port", "0",
                             "--max-seq-len", "256", "--log-level", "warning", *fronts], stderr=subprocess.PIPE,
                            text=True)
    lines: list[str] = []
    assert proc.stderr is not None
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"picked port (\d+)", "".join(lines))):
            assert time.monotonic() < deadline and proc.poll() is None, f"no port named: {lines[-5:]}"
            time.sleep(0.1)
        root = f"http://127.0.0.1:{found.group(1)}"
        while True:
            try:
                if httpx.get(f"{root}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the server never answered on its port"
            time.sleep(0.25)
        for name in ("127.0.0.1", "localhost"):
            r = httpx.get(f"{root}/v1/models", headers={"Host": f"{name}:{found.group(1)}"}, timeout=10)
            assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
