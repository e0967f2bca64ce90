"""Lazy loader of the CUDA extension built from `structgen/csrc/` (`hostfunc.cpp`, `mask.cu`, `gate.cu`,
`int4_gemv.cu`).

Built with `torch.utils.cpp_extension.load` on first use on a GPU machine, never at install
time, into a cached build directory (`$STRUCTGEN_CSRC_DIR`, else `$TORCH_EXTENSIONS_DIR/
structgen_csrc`, else `~/.cache/structgen/csrc`), one sub-directory per torch/CUDA/arch, so a
second process loads the finished `.so` in well under a second. The sources include no torch
headers (raw pointers and pybind11 only), which keeps a cold build near half a minute.

`load()` returns the module or raises `CsrcUnavailable` saying why (no CUDA, no nvcc, build
error); `available()` answers without raising, so callers can fall back to Triton/torch.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

from structgen.csrc import DIR as CSRC_DIR

SOURCES = ("hostfunc.cpp", "mask.cu", "gate.cu", "int4_gemv.cu")
NAME = "structgen_csrc"


class CsrcUnavailable(RuntimeError):
    """The CUDA extension cannot be used here; the message says why and what to change."""


def build_dir() -> Path:
    """Where the extension is built: per torch version, CUDA version and GPU architecture."""
    if os.environ.get("STRUCTGEN_CSRC_DIR"):
        root = Path(os.environ["STRUCTGEN_CSRC_DIR"])
    elif os.environ.get("TORCH_EXTENSIONS_DIR"):
        root = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / NAME
    else:
        root = Path.home() / ".cache" / "structgen" / "csrc"
    major, minor = torch.cuda.get_device_capability()
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda}-sm{major}{minor}".replace("+", "_")
    return root / tag


def _why_unavailable() -> str | None:
    if os.environ.get("STRUCTGEN_DISABLE_CSRC") == "1":
        return "disabled by STRUCTGEN_DISABLE_CSRC=1"
    missing = [s for s in SOURCES if not (CSRC_DIR / s).is_file()]
    if missing:
        return f"sources {', '.join(missing)} not found in {CSRC_DIR} (they ship as package data: reinstall structgen)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.version.cuda is None:
        return "this torch build has no CUDA"
    from torch.utils.cpp_extension import CUDA_HOME

    if shutil.which("nvcc") is None and not (CUDA_HOME and Path(CUDA_HOME, "bin", "nvcc").exists()):
        return "nvcc not found (install the CUDA toolkit or set CUDA_HOME)"
    return None


@functools.cache
def load() -> ModuleType:
    """Build (first time) and import the extension; raises CsrcUnavailable."""
    reason = _why_unavailable()
    if reason is not None:
        raise CsrcUnavailable(f"structgen CUDA extension unavailable: {reason}")
    from torch.utils import cpp_extension

    major, minor = torch.cuda.get_device_capability()
    arch = f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", "4")
    try:
        module = cpp_extension.load(
            name=NAME,
            sources=[str(CSRC_DIR / s) for s in SOURCES],
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=["-O3", "-std=c++17", arch],
            build_directory=str(out),
            with_cuda=True,
            verbose=os.environ.get("STRUCTGEN_CSRC_VERBOSE") == "1",
        )
    except Exception as exc:  # compiler errors arrive as RuntimeError/CalledProcessError
        raise CsrcUnavailable(f"building the structgen CUDA extension in {out} failed: {exc}") from exc
    atexit.register(_at_exit, module)
    return module


def _at_exit(module: ModuleType) -> None:
    # Callbacks still queued after this point must not touch a finalizing interpreter; then the
    # blocks that captured graphs kept alive can go.
    module.shutdown()
    module.release_all()


@functools.cache
def available() -> bool:
    """Whether `load()` succeeds (it is attempted at most once per process)."""
    try:
        load()
        return True
    except CsrcUnavailable:
        return False
