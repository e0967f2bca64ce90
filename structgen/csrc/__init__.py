"""Native sources, shipped as package data and compiled lazily on first use (never at install):
`grammar_step.cpp`, the CPU pool of xgrammar mask fills (grammar/native.py), `grammar_lengths.cpp`,
the rules' shortest outputs (grammar/termination.py), `quant_matmul.cpp`,
the CPU products with GGUF-packed weights (engine/kernels/cpu_quant.py) and the CPU decode
step built on them (engine/kernels/cpu_decode.py), and `hostfunc.cpp`,
`mask.cu`, `gate.cu`, the CUDA extension (engine/kernels/csrc_ext.py). The loaders find their
sources here, so a regular (non-editable) install keeps the native paths."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

DIR = Path(__file__).resolve().parent
log = logging.getLogger(__name__)


def cache_root() -> Path:
    """Where structgen keeps what it builds once per machine (converted models, native
    libraries, timed kernel plans): $STRUCTGEN_CACHE, else ~/.cache/structgen."""
    root = os.environ.get("STRUCTGEN_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "structgen"


def source(name: str) -> Path:
    """The path of native source file `name` in this package."""
    return DIR / name


def build_library(name: str, commands: Callable[[str, Path, Path], list[list[str]]], key: bytes = b"") -> Path:
    """Compile source `name` into a shared library, cached under `$STRUCTGEN_CACHE/native` (or
    ~/.cache/structgen/native) by the hash of the source, the compiler and `key`.
    `commands(compiler, source, output)` gives the compiler command lines to try in turn (say,
    with OpenMP, then without); the first that succeeds is kept. Raises RuntimeError with the
    compiler's message when none does or no C++ compiler is on PATH."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    path = source(name)
    digest = hashlib.sha256(path.read_bytes() + compiler.encode() + key).hexdigest()[:16]
    root = cache_root() / "native"
    out = root / f"{path.stem}-{digest}.so"
    if out.is_file():
        return out
    with _lock_of(out):  # a build in progress in this process (`build_in_background`) is waited for
        if out.is_file():
            return out
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:  # concurrent processes each rename whole
            partial = Path(tmp) / out.name
            for cmd in commands(compiler, path, partial):
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode == 0:
                    os.replace(partial, out)
                    return out
            raise RuntimeError(f"building {name} failed: {done.stderr.strip()[-2000:]}")


_locks: dict[Path, threading.Lock] = {}
_locks_lock = threading.Lock()


def _lock_of(out: Path) -> threading.Lock:
    with _locks_lock:
        return _locks.setdefault(out, threading.Lock())


def _forget_locks() -> None:
    """In a forked child: a lock a build thread of the parent held would stay held for good
    (the thread is not forked), and the child's first build of that library would hang."""
    global _locks, _locks_lock
    _locks, _locks_lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_locks)


def build_in_background(builds: list[Callable[[], object]]) -> threading.Thread:
    """Run `builds` (library builds, each cached once built) one after another in a daemon
    thread: on a machine that has not built them, the compilers run while the model loads
    instead of after it. A failure is left to the build's own caller to report, when it
    loads the library."""

    def run() -> None:
        for build in builds:
            try:
                build()
            except Exception as exc:  # noqa: BLE001 - reported by the loader that needs it
                log.debug("background build failed: %s", exc)

    thread = threading.Thread(target=run, name="structgen-native-builds", daemon=True)
    thread.start()
    return thread


__all__ = ["DIR", "build_in_background", "build_library", "cache_root", "source"]
