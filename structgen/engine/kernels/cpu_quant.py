"""CPU products with weights in GGUF block formats (`structgen/csrc/quant_matmul.cpp`), and their reference.

The kernels de-quantize each block as they multiply it, so a decode step reads the packed
bytes (a Q4_1 weight is 5 bits) instead of fp32 copies (32 bits): a CPU decode step is bound
by the bytes it reads. Built with the system C++ compiler on first use (a few seconds, no torch
or Python headers) into `~/.cache/structgen/native/` (`$STRUCTGEN_CACHE/native`), one file per
source hash. `load()` returns None where it cannot be built (no compiler, not Linux/macOS,
`STRUCTGEN_DISABLE_NATIVE=1`); the model then de-quantizes its weights at load instead.

`dequantize_reference` (gguf-py's numpy de-quantization, an independent implementation of the
same formats) followed by a torch matmul is what the tests compare every kernel against.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from structgen import csrc

log = logging.getLogger("structgen.engine")

SOURCE = csrc.source("quant_matmul.cpp")
# ggml type ids of the block formats the kernels multiply (gguf.GGMLQuantizationType values).
FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
# Products of more rows than this de-quantize the weight once and use torch's matmul: a prompt's
# rows amortise the de-quantization and torch's GEMM reuses each weight across many rows.
MAX_KERNEL_ROWS = 32
# Products of at least this many rows may run on integer activations (`IntegerActivations`):
# below it the fp32 kernel is as fast.
INT8_ROWS = 8
INT8_FORMATS = frozenset({"Q4_0", "Q4_1", "Q8_0"})  # the K formats keep the fp32 kernel
# The native step's phases as `QuantKernels.phase_seconds` names them (quant_matmul.cpp's Phase):
# the products' tiles per projection, the activations' rounding to integers, the waits at barriers
# and the call's set-up with the threads' start.
PHASES = ("norm", "quantize", "qkv", "o", "gate_up", "down", "rope_kv", "attention", "silu", "residual",
          "wait", "start")


@dataclass(frozen=True)
class IntegerActivations:
    """Products of at least `min_rows` rows with Q4_0 / Q4_1 / Q8_0 weights multiply their
    activations rounded per block of 32 to `planes` int8 planes on VNNI dot products: 1, int8
    codes (as llama.cpp); 2, a second plane rounding what the first left, 16-bit codes."""

    min_rows: int
    planes: int


# EngineTuning.prompt_activations -> what the CPU products of several rows run on.
PROMPT_ACTIVATIONS = {"fp32": None, "int16": IntegerActivations(INT8_ROWS, 2),
                      "int8": IntegerActivations(INT8_ROWS, 1)}


class QuantKernels:
    """The built library: `matmul`, `dequantize`, `dequantize_rows` over packed weights
    (uint8 `[rows, row_bytes]`, GGUF block layout) and fp32 activations."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self.simd = int(lib.sgq_simd())  # 2: AVX-512F, 1: AVX2/FMA/F16C, 0: scalar code

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, qtype: str, cols: int,
               out: torch.Tensor | None = None, threads: int = 0,
               activations: IntegerActivations | None = None) -> torch.Tensor:
        """`x @ W.T` for fp32 `x` [n, cols] and W packed as `packed` [rows, row_bytes];
        `out` may be a column slice of a larger [n, *] fp32 tensor with unit column stride. With
        `activations`, a product of enough rows in Q4_0 / Q4_1 / Q8_0 multiplies `x` rounded to
        integer codes (`int8_matmul_reference`) where the CPU has VNNI (`int8_level`)."""
        x = x.float().contiguous()
        n, rows = x.shape[0], packed.shape[0]
        if out is None:
            out = torch.empty(n, rows, dtype=torch.float32)
        rc = self._lib.sgq_matmul(FORMATS[qtype], packed.data_ptr(), rows, cols, packed.stride(0),
                                  x.data_ptr(), n, out.data_ptr(), out.stride(0),
                                  threads or torch.get_num_threads(), self.simd, *_integer_args(activations))
        if rc != 0:
            raise ValueError(f"{qtype} matmul of {cols} columns is not supported")
        return out

    def dequantize(self, packed: torch.Tensor, qtype: str, cols: int, threads: int = 0) -> torch.Tensor:
        """The fp32 weight [rows, cols] of `packed`."""
        out = torch.empty(packed.shape[0], cols, dtype=torch.float32)
        rc = self._lib.sgq_dequantize(FORMATS[qtype], packed.data_ptr(), packed.shape[0], cols,
                                      packed.stride(0), out.data_ptr(), threads or torch.get_num_threads(),
                                      self.simd)
        if rc != 0:
            raise ValueError(f"{qtype} de-quantization of {cols} columns is not supported")
        return out

    def dequantize_rows(self, packed: torch.Tensor, qtype: str, cols: int, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows `ids` of the weight (an embedding lookup)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), cols, dtype=torch.float32)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < packed.shape[0]:
            raise IndexError(f"row id out of range for a weight of {packed.shape[0]} rows")
        self._lib.sgq_dequantize_rows(FORMATS[qtype], packed.data_ptr(), cols, packed.stride(0), ids.data_ptr(),
                                      ids.numel(), out.data_ptr(), torch.get_num_threads(), self.simd)
        return out

    def decode_layers(self, shape: object, layers: object, num_layers: int, rows: object, hidden: int,
                      threads: int, activations: IntegerActivations | None = None, lead: int = 0) -> int:
        """`sgq_decode_layers` on ctypes structures (kernels/cpu_decode.py builds them), with
        `activations` for the step's first `lead` rows (the others' products stay fp32): 0, or -1
        for a layer the native decoder does not run."""
        return int(self._lib.sgq_decode_layers(shape, layers, num_layers, rows, hidden, threads, self.simd,
                                               *_integer_args(activations), lead))

    def profile_phases(self, enabled: bool, thread: int = 0) -> None:
        """Start (sums reset) or stop timing `decode_layers`' phases on its thread `thread`."""
        self._lib.sgq_profile_phases(thread + 1 if enabled else 0)

    def phase_seconds(self) -> dict[str, float]:
        """Seconds per phase of `decode_layers` since `profile_phases(True)`, by `PHASES` name."""
        out = (ctypes.c_double * len(PHASES))()
        self._lib.sgq_phase_seconds(out, len(PHASES))
        return dict(zip(PHASES, out, strict=True))

    @property
    def int8_level(self) -> int:
        """2 where products run on AVX512-VNNI int8 dot products, 1 on AVX-VNNI, 0 where
        `IntegerActivations` change nothing (no VNNI, or the SIMD level capped below it)."""
        return int(self._lib.sgq_int8_level(self.simd))

    def at_simd_level(self, level: int) -> QuantKernels:
        """The same library capped at SIMD `level` (tests compare every path to the reference)."""
        capped = QuantKernels(self._lib)
        capped.simd = min(level, self.simd)
        return capped


def _integer_args(activations: IntegerActivations | None) -> tuple[int, int]:
    """(fewest rows, planes) as the native functions take them; 0 rows: fp32 activations."""
    return (0, 1) if activations is None else (activations.min_rows, activations.planes)


def dequantize_reference(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """The fp32 weight of `packed` by gguf-py's numpy de-quantization."""
    import gguf

    return torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(packed.numpy(), gguf.GGMLQuantizationType[qtype]), dtype=np.float32))


def matmul_reference(x: torch.Tensor, packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """`x @ W.T` by de-quantizing W first: what `QuantKernels.matmul` must equal."""
    return x.float() @ dequantize_reference(packed, qtype).T


def quantize_activations_reference(x: torch.Tensor, planes: int = 1) -> torch.Tensor:
    """fp32 `x` [n, cols] rounded as the integer products round it, returned de-quantized: per
    block of 32, scale d = max|x| / 127 and q = round-half-even(x * (1 / d)); with two planes
    also q_low = round-half-even(256 (x / d - q)) clamped to int8, the value d (q + q_low / 256)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    scaled = blocks * inverse
    codes = torch.round(scaled)
    if planes == 2:
        codes = codes + torch.clamp(torch.round((scaled - codes) * 256), -128, 127) / 256
    return (codes * d).reshape(x.shape)


def int8_matmul_reference(x: torch.Tensor, packed: torch.Tensor, qtype: str, planes: int = 1) -> torch.Tensor:
    """What `QuantKernels.matmul(..., activations=IntegerActivations(..., planes))` must equal:
    `x` rounded per 32-block to integer codes, both operands de-quantized, multiplied in float64."""
    xq = quantize_activations_reference(x, planes).double()
    return (xq @ dequantize_reference(packed, qtype).double().T).float()


@functools.cache
def load() -> QuantKernels | None:
    """The kernels, built on first use; None (logged once) where they cannot be had."""
    if os.environ.get("STRUCTGEN_DISABLE_NATIVE") == "1":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except Exception as exc:  # no compiler, a failed build, a platform without shared objects
        log.warning("quantized CPU kernels unavailable (%s); GGUF weights are de-quantized to fp32 "
                    "at load (more memory, slower steps). Install g++ to get them.", exc)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.sgq_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, i64, ptr, i64, ctypes.c_int, ctypes.c_int, i64,
                               ctypes.c_int]
    lib.sgq_dequantize.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.sgq_dequantize_rows.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.sgq_decode_layers.argtypes = [ptr, ptr, i64, ptr, ptr, ctypes.c_int, ctypes.c_int, i64, ctypes.c_int, i64]
    lib.sgq_int8_level.argtypes = [ctypes.c_int]
    lib.sgq_profile_phases.argtypes = [ctypes.c_int]
    lib.sgq_phase_seconds.argtypes = [ptr, ctypes.c_int]
    return QuantKernels(lib)


def build() -> Path:
    """The kernels' shared library, compiled once per machine (csrc.build_library)."""

    def commands(compiler: str, source: Path, output: Path) -> list[list[str]]:
        base = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", str(source), "-o", str(output)]
        return [[*base, "-fopenmp"], base]  # a compiler without OpenMP: one thread, still packed

    return csrc.build_library(SOURCE.name, commands)
