"""The CUDA int4 GEMV (`csrc/int4_gemv.cu`): `y = x @ W.T (+ bias)` for 1-8 bf16 rows of x and
an int4 weight in the "words" layout, the default for those rows where it `fits`.

Two forms, chosen by the launch (csrc/int4_gemv.cu says how each works):
- one row, and groups under 128 columns (GGUF's Q4 formats): bf16x2 arithmetic on the CUDA
  cores, about half the stream GEMV's instructions a weight (instructions, not bytes, bounded
  the stream GEMV at one row on Hopper: docs/performance.md, "Int4 at one row: a CUDA GEMV");
  bf16 products with float32 sums per 32 columns, so close to the float32 reference, not equal;
- 2-8 rows with groups of 128 columns or more, in whole 128-column tiles (AWQ / GPTQ, and
  weights quantized at load): tensor-core mma whose n holds the rows, so a 4-row verify step
  costs about what one row does (5-8 rows only here: the CUDA-core form stops at 4); its products are exact in float32 sums, as close to the
  reference as the stream GEMV (docs/performance.md, "Int4 at 2-8 rows: a tensor-core GEMV").
The tests bound both forms' error; the Triton stream GEMV remains the path for float32
activations, the CPU interpreter, and shapes this one refuses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from structgen.engine.kernels.dependent_launch import launch_args

if TYPE_CHECKING:
    from structgen.engine.models.packed import PackedWeight

MAX_ROWS = 8  # the tensor-core form's; the CUDA-core form takes up to CUDA_CORE_ROWS
CUDA_CORE_ROWS = 4
TILE_COLS = 128  # the tensor-core form reads whole tiles of this many columns, each inside one group
LANE_COLS = 32  # columns a lane reads at once (16 bytes of words): a scale group holds whole ones
_GROUP_DTYPES = (torch.float16, torch.float32)


def fits(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, y: torch.Tensor) -> bool:
    """Whether the kernel takes this product: CUDA, bf16 x of 1-4 rows (5-8 where the weight
    `takes_tensor_cores`), int4 words in rows of whole 16-byte loads with groups of a power of two
    of at least 32 columns (or whole rows), scales and offsets in float16 or float32, 16-byte
    aligned operands, the extension built."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and 1 <= x.shape[0] <= MAX_ROWS and y.dtype == torch.bfloat16):
        return False
    if weight.code != "int4" or weight.layout != "words" or weight.group_rows != 1:
        return False
    if weight.codes.device != x.device or y.device != x.device:  # raw pointers: one device
        return False
    cols, group = weight.cols, weight.group_cols
    if cols % LANE_COLS or not (group >= cols or (group % LANE_COLS == 0 and group & (group - 1) == 0)):
        return False
    if x.shape[0] > CUDA_CORE_ROWS and not takes_tensor_cores(weight):
        return False
    offsets = weight.offsets
    if weight.scales.dtype not in _GROUP_DTYPES or (offsets is not None and offsets.dtype not in _GROUP_DTYPES):
        return False
    if weight.scales.shape[0] * weight.scales.stride(0) >= 2**31:  # the kernel indexes scales in int32
        return False
    codes = weight.codes
    if codes.stride(0) % 4 or codes.data_ptr() % 16 or x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        return False
    if y.stride(1) != 1 or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()
                                                   or bias.device != x.device)):
        return False
    from structgen.engine.kernels import csrc_ext

    return csrc_ext.available()


def takes_tensor_cores(weight: PackedWeight) -> bool:
    """Whether 2-8 rows of x run the tensor-core form on `weight` (whole 128-column tiles, each
    inside one group); the launch decides the same way (`takes_mma` in csrc/int4_gemv.cu)."""
    cols, group = weight.cols, weight.group_cols
    return cols % TILE_COLS == 0 and (group >= cols or group % TILE_COLS == 0)


def gemv(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    """`y = x @ W.T (+ bias)` for a product that `fits` (y may be a column slice of a wider output)."""
    from structgen.engine.kernels import csrc_ext

    group_words = weight.group_cols // 8 if weight.group_cols < weight.cols else 1 << 30
    offsets = weight.offsets
    csrc_ext.load().int4_gemv(
        weight.codes.data_ptr(), weight.codes.stride(0), weight.cols // 8, weight.scales.data_ptr(),
        offsets.data_ptr() if offsets is not None else 0, weight.scales.stride(0), group_words.bit_length() - 1,
        int(weight.scales.dtype == torch.float16), int(offsets is not None and offsets.dtype == torch.float16),
        x.data_ptr(), x.stride(0), x.shape[0], bias.data_ptr() if bias is not None else 0, y.data_ptr(),
        y.stride(0), weight.shape[0], int(launch_args(x.device, x.shape[0])["PDL"]),
        torch.cuda.current_stream(x.device).cuda_stream)
