"""Native sources, shipped as package data and compiled lazily on first use (never at install):
`grammar_step.cpp`, the CPU pool of xgrammar mask fills (grammar/native.py), `grammar_lengths.cpp`,
the rules' shortest outputs (grammar/termination.py), `quant_matmul.cpp`,
the CPU products with GGUF-packed weights (engine/kernels/cpu_quant.py) and the CPU decode
step built on them (engine/kernels/cpu_decode.py), and `hostfunc.cpp`,
`mask.cu`, `gate.cu`, the CUDA extension (engine/kernels/csrc_ext.py). The loaders find their
sources here, so a regular (non-editable) install keeps the native paths."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

DIR = Path(__file__).resolve().parent


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
    root = Path(os.environ.get("STRUCTGEN_CACHE") or Path.home() / ".cache" / "structgen") / "native"
    out = root / f"{path.stem}-{digest}.so"
    if out.is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:  # concurrent builders each rename whole
        partial = Path(tmp) / out.name
        for cmd in commands(compiler, path, partial):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0:
                os.replace(partial, out)
                return out
        raise RuntimeError(f"building {name} failed: {done.stderr.strip()[-2000:]}")


__all__ = ["DIR", "build_library", "source"]
