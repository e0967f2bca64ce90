"""PyTorch's int4 kernel ("tinygemm": `torch._weight_int4pack_mm`, CUDA, bf16) as a candidate
for an int4 `PackedWeight` (models/packed.py), behind `packed_gemm.matmul`.

tinygemm reads its own tiled layout (`torch._convert_weight_to_int4pack` of bytes whose high
nibble is the even column) and computes `w = (q - 8) * scale + zero` with scale and zero in
bf16, so a weight `q * scale + offset` maps to `zero = offset + 8 * scale`: the same values up
to bf16's rounding of the scales, which is why it is a candidate measured against the
de-quantize reference (benchmarks/tune_packed.py), not the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from structgen.errors import InvalidParameterError

if TYPE_CHECKING:
    from structgen.engine.kernels.packed_gemm import PackedWeight

GROUPS = (32, 64, 128, 256)  # the group sizes the kernel takes
INNER_K_TILES = (8, 4, 2)  # the widest inner tiling whose 16-column tiles divide the columns wins


@dataclass(frozen=True)
class TinyGemmWeight:
    """An int4 weight in tinygemm's layout: `packed` codes, `scales_and_zeros` bf16
    `[cols / group, rows, 2]`."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group: int
    rows: int
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)


def tinygemm_fits(weight: PackedWeight) -> bool:
    """Whether tinygemm can hold `weight`: int4 on CUDA, a scale per row and group of a size it
    takes, rows a multiple of 8 and columns of 32."""
    return (weight.code == "int4" and weight.codes.is_cuda and weight.group_rows == 1
            and weight.group_cols in GROUPS and weight.cols % weight.group_cols == 0
            and weight.shape[0] % 8 == 0 and weight.cols % 32 == 0)


def to_tinygemm(weight: PackedWeight) -> TinyGemmWeight:
    """`weight`'s codes and groups in tinygemm's layout (see the module docstring)."""
    if not tinygemm_fits(weight):
        raise InvalidParameterError(
            f"tinygemm cannot hold a {weight.code} weight of shape {weight.shape} with groups of "
            f"{weight.group_cols}x{weight.group_rows} on {weight.codes.device}; it needs int4 on CUDA, groups "
            f"of {GROUPS} columns, rows a multiple of 8 and columns of 32: use packed_gemm.matmul's own kernels")
    q = weight.code_values().to(torch.int32)
    high_even = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    inner = next(t for t in INNER_K_TILES if weight.cols % (t * 16) == 0)
    packed = torch._convert_weight_to_int4pack(high_even.contiguous(), inner)
    scales = weight.scales.float()
    zeros = 8 * scales + (weight.offsets.float() if weight.offsets is not None else 0)
    scales_and_zeros = torch.stack([scales.T, zeros.T], dim=-1).to(torch.bfloat16).contiguous()
    return TinyGemmWeight(packed, scales_and_zeros, weight.group_cols, weight.shape[0], weight.cols)


def matmul(x: torch.Tensor, weight: TinyGemmWeight) -> torch.Tensor:
    """`x @ W.T` by tinygemm (x computed in bf16, returned in x's dtype)."""
    return torch._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), weight.packed, weight.group,
                                     weight.scales_and_zeros).to(x.dtype)
