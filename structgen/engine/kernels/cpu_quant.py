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
# Products of at least this many rows may run on int8 activations (`QuantKernels.matmul`'s
# `int8_rows`, EngineTuning.int8_prompt_products): below it the fp32 kernel is as fast.
INT8_ROWS = 8
INT8_FORMATS = frozenset({"Q4_0", "Q4_1", "Q8_0"})  # the K formats keep the fp32 kernel


class QuantKernels:
    """The built library: `matmul`, `dequantize`, `dequantize_rows` over packed weights
    (uint8 `[rows, row_bytes]`, GGUF block layout) and fp32 activations."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self.simd = int(lib.sgq_simd())  # 2: AVX-512F, 1: AVX2/FMA/F16C, 0: scalar code

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, qtype: str, cols: int,
               out: torch.Tensor | None = None, threads: int = 0, int8_rows: int = 0) -> torch.Tensor:
        """`x @ W.T` for fp32 `x` [n, cols] and W packed as `packed` [rows, row_bytes];
        `out` may be a column slice of a larger [n, *] fp32 tensor with unit column stride. A
        product of at least `int8_rows` rows (0: none) in Q4_0 / Q4_1 / Q8_0 multiplies `x`
        quantized to int8 (`int8_matmul_reference`) where the CPU has VNNI (`int8_level`)."""
        x = x.float().contiguous()
        n, rows = x.shape[0], packed.shape[0]
        if out is None:
            out = torch.empty(n, rows, dtype=torch.float32)
        rc = self._lib.sgq_matmul(FORMATS[qtype], packed.data_ptr(), rows, cols, packed.stride(0),
                                  x.data_ptr(), n, out.data_ptr(), out.stride(0),
                                  threads or torch.get_num_threads(), self.simd, int8_rows)
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
                      threads: int, int8_rows: int = 0) -> int:
        """`sgq_decode_layers` on ctypes structures (kernels/cpu_decode.py builds them): 0, or -1
        for a layer the native decoder does not run."""
        return int(self._lib.sgq_decode_layers(shape, layers, num_layers, rows, hidden, threads, self.simd,
                                               int8_rows))

    @property
    def int8_level(self) -> int:
        """2 where products run on AVX512-VNNI int8 dot products, 1 on AVX-VNNI, 0 where
        `int8_rows` changes nothing (no VNNI, or the SIMD level capped below it)."""
        return int(self._lib.sgq_int8_level(self.simd))

    def at_simd_level(self, level: int) -> QuantKernels:
        """The same library capped at SIMD `level` (tests compare every path to the reference)."""
        capped = QuantKernels(self._lib)
        capped.simd = min(level, self.simd)
        return capped


def dequantize_reference(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """The fp32 weight of `packed` by gguf-py's numpy de-quantization."""
    import gguf

    return torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(packed.numpy(), gguf.GGMLQuantizationType[qtype]), dtype=np.float32))


def matmul_reference(x: torch.Tensor, packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """`x @ W.T` by de-quantizing W first: what `QuantKernels.matmul` must equal."""
    return x.float() @ dequantize_reference(packed, qtype).T


def quantize_activations_reference(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` [n, cols] rounded as the int8 products round it: per block of 32, scale
    d = max|x| / 127 and q = round-half-even(x * (1 / d)), returned de-quantized (q * d)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).reshape(x.shape)


def int8_matmul_reference(x: torch.Tensor, packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """What `QuantKernels.matmul(..., int8_rows=...)` must equal: `x` quantized per 32-block
    to int8, both operands de-quantized, multiplied in float64."""
    return (quantize_activations_reference(x).double() @ dequantize_reference(packed, qtype).double().T).float()


@functools.cache
def load() -> QuantKernels | None:
    """The kernels, built on first use; None (logged once) where they cannot be had."""
    if os.environ.get("STRUCTGEN_DISABLE_NATIVE") == "1":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except Exception as exc:  # no compiler, a failed build, a platform without shared objects
        log.warning("quantized CPU kernels unavailable (%s); GGUF weights are de-quantized to fp32 "
                    "at load (more memory, slower steps). Install g++ to get them.", exc)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.sgq_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, i64, ptr, i64, ctypes.c_int, ctypes.c_int, i64]
    lib.sgq_dequantize.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.sgq_dequantize_rows.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.sgq_decode_layers.argtypes = [ptr, ptr, i64, ptr, ptr, ctypes.c_int, ctypes.c_int, i64]
    lib.sgq_int8_level.argtypes = [ctypes.c_int]
    return QuantKernels(lib)


def _build() -> Path:
    def commands(compiler: str, source: Path, output: Path) -> list[list[str]]:
        base = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", str(source), "-o", str(output)]
        return [[*base, "-fopenmp"], base]  # a compiler without OpenMP: one thread, still packed

    return csrc.build_library(SOURCE.name, commands)
