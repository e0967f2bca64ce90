"""Native sources, shipped as package data and compiled lazily on first use (never at install):
`grammar_step.cpp`, the CPU pool of xgrammar mask fills (grammar/native.py), `quant_matmul.cpp`,
the CPU products with GGUF-packed weights (engine/kernels/cpu_quant.py), and `hostfunc.cpp`,
`mask.cu`, `gate.cu`, the CUDA extension (engine/kernels/csrc_ext.py). The loaders find their
sources here, so a regular (non-editable) install keeps the native paths."""

from __future__ import annotations

from pathlib import Path

DIR = Path(__file__).resolve().parent


def source(name: str) -> Path:
    """The path of native source file `name` in this package."""
    return DIR / name


__all__ = ["DIR", "source"]
