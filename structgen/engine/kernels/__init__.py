"""Optional GPU kernels (Triton), each with a torch definition the tests compare it to:

- `decode_attention.py`: flash-decoding over the paged KV cache (one query token per sequence),
  with a prefix every row shares read once per block of rows (the cascade).
- `fused.py`: residual add + RMSNorm, RoPE + KV-cache write, SiLU(gate) * up.
- `gemv.py`: projections of 1-16 rows (GEMV and a skinny GEMM, timed against cuBLAS).
- `fused_gemv.py`: few-row projections with the norm before them and RoPE (+ q/k norms) /
  SiLU * up after, or nothing (a router).
- `packed_gemm.py`: projections by int4 / int8 / FP8 weights, de-quantized in registers;
  `packed_gemv.py` its bandwidth GEMV of 1-4 rows, `tinygemm.py` PyTorch's int4 kernel as a
  candidate.
- `sampling.py`: grammar bitmask + temperature + Gumbel noise + argmax in one pass.
- `moe.py`: a mixture of experts' router (softmax + top-k) and its experts, every (token,
  chosen expert) pair of a step in one launch per projection.
- `dependent_launch.py`: programmatic dependent launch, so that on Hopper each kernel of a
  small step starts while the one before it drains.

`use_batch_invariant(True)` (`EngineConfig.batch_invariant`) makes every kernel compute a row
the same way whatever number of rows share the launch: projections take `gemv.invariant_gemm`
(one GEMM form for every row count), the norm-fused projections are off, and decode attention
splits a sequence's keys by the cache shape and its own length only
(`decode_attention.num_splits_for`, `INVARIANT_SPLIT_KEYS`) and never cascades over a prefix
shared with its neighbours. Like
`torch.use_deterministic_algorithms` it is process-wide: engines in one process share it.

`triton_enabled(device)` is the one switch: True on CUDA when Triton imports, and on the CPU
only under Triton's interpreter (`TRITON_INTERPRET=1`, for debugging kernels without a GPU).
CPU runs otherwise never import Triton.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401

        return True
    except Exception:  # pragma: no cover - depends on the machine
        return False


@functools.cache
def _enabled(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_available() and _triton_imports()
    return device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and _triton_imports()


def triton_enabled(device: torch.device | str) -> bool:
    """Whether the Triton kernels run for tensors on `device`."""
    return _enabled(torch.device(device).type)


_batch_invariant = False


def use_batch_invariant(enabled: bool) -> None:
    """Switch the kernels' batch-invariant mode on or off for this process (see above)."""
    global _batch_invariant
    _batch_invariant = bool(enabled)


def batch_invariant() -> bool:
    """Whether the kernels run in batch-invariant mode."""
    return _batch_invariant


def decode_attention_available() -> bool:
    """Kept for callers of the first API: the decode kernel runs on CUDA with Triton."""
    return _enabled("cuda")
