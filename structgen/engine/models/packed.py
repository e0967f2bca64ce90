"""Weights kept quantized on the GPU (int4, int8, FP8) and the layer that multiplies by them.

A `PackedWeight` is a `[rows, cols]` weight as integer or FP8 codes with scales per group:
`w[n, k] = code[n, k] * scale[n // group_rows, k // group_cols] (+ offset[same index])`.

- "int4": codes 0..15, two per byte: byte `[n, j]` holds column `j` in its low nibble and
  column `j + cols // 2` in its high one, so a kernel reads both halves of x contiguously.
  AWQ, GPTQ and GGUF Q4_0 / Q4_1 weights all map to it (a zero point z becomes the offset
  `-z * scale`, GGUF's minimum is the offset itself). On CUDA a `PackedLinear` repacks them
  to the "words" layout (`to_words`): int32 `[rows, ceil(cols / 8)]`, nibble i of word w
  holding column `8 w + i`, which the bandwidth GEMV (kernels/packed_gemv.py) streams in
  16-byte loads.
- "int8": signed codes `[rows, cols]` (GGUF Q8_0).
- "fp8": e4m3 codes `[rows, cols]` with scales per output channel or per 2D block (HF FP8
  checkpoints, or a float model quantized at load).

Scales and offsets are stored in float16 where that holds them exactly, else float32.
`PackedLinear` stands in for `nn.Linear`: the Triton kernels of kernels/packed_gemm.py where
`triton_enabled` (CUDA, or the CPU under Triton's interpreter), else its torch reference
(`dequantize` then the matmul), which is also what the tests compare the kernels to.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from structgen.errors import ModelLoadError

CODES = ("int4", "int8", "fp8")
LAYOUTS = ("halves", "words")  # where an int4 weight's nibbles sit (the module docstring)
WORD_COLS = 8  # int4 columns per int32 word of the "words" layout
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
INT4_GROUP = 128  # columns per scale when a float weight is quantized to int4 at load


@dataclass(frozen=True)
class PackedWeight:
    """A `[rows, cols]` weight as `codes` of kind `code` with group `scales` (and `offsets`)."""

    code: str
    codes: torch.Tensor
    scales: torch.Tensor  # [ceil(rows / group_rows), ceil(cols / group_cols)]
    offsets: torch.Tensor | None
    cols: int
    group_cols: int
    group_rows: int = 1
    layout: str = "halves"

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ModelLoadError(f"unknown packed weight code {self.code!r}; one of {CODES}")
        if self.layout not in LAYOUTS or (self.layout == "words" and self.code != "int4"):
            raise ModelLoadError(f"layout {self.layout!r} of a {self.code} weight: use 'halves', or 'words' "
                                 f"for int4 codes (to_words repacks them)")
        if self.code == "int4" and self.cols % 2:
            raise ModelLoadError(f"an int4 weight needs an even column count, got {self.cols}")
        for name in ("codes", "scales", "offsets"):  # the kernels step along rows by stride, columns by 1
            t = getattr(self, name)
            if t is not None and not t.is_contiguous():
                object.__setattr__(self, name, t.contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.offsets is None else self.offsets.numel() * self.offsets.element_size()
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size() + extra

    def to(self, device: torch.device | str) -> PackedWeight:
        offsets = None if self.offsets is None else self.offsets.to(device)
        return replace(self, codes=self.codes.to(device), scales=self.scales.to(device), offsets=offsets)

    def code_values(self) -> torch.Tensor:
        """The codes as float32 `[rows, cols]`."""
        if self.layout == "words":
            return unpack_nibbles(self.codes).reshape(self.codes.shape[0], -1)[:, :self.cols].float()
        if self.code == "int4":
            return unpack_int4(self.codes).float()
        return self.codes.float()

    def expand(self, t: torch.Tensor) -> torch.Tensor:
        """A per-group tensor (scales, offsets) repeated to the weight's `[rows, cols]`."""
        rows, cols = self.shape
        t = t.float().repeat_interleave(self.group_rows, 0)[:rows]
        return t.repeat_interleave(self.group_cols, 1)[:, :cols]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in `dtype`, computed in float32 (the kernels' reference)."""
        w = self.code_values() * self.expand(self.scales)
        if self.offsets is not None:
            w = w + self.expand(self.offsets)
        return w.to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 `[rows, cols // 2]` of int4 codes `q` (values 0..15, `[rows, cols]`)."""
    half = q.shape[1] // 2
    q = q.to(torch.uint8)
    return q[:, :half] | (q[:, half:] << 4)


def unpack_int4(codes: torch.Tensor) -> torch.Tensor:
    """The `[rows, cols]` uint8 codes 0..15 of `pack_int4`'s bytes."""
    return torch.cat([codes & 0xF, codes >> 4], dim=1)


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words `[..., w]` as their 8 nibbles in bit order: `[..., w, 8]` (values 0..15)."""
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    return (words.to(torch.int32)[..., None] >> shifts) & 0xF


def to_words(weight: PackedWeight) -> PackedWeight:
    """An int4 weight in the "words" layout (the same values; columns padded with code 0 to a
    multiple of 8, which the kernels multiply by x's absent columns, never read)."""
    if weight.code != "int4" or weight.layout == "words":
        return weight
    q = unpack_int4(weight.codes)  # uint8: a byte per code, the largest temporary
    q = F.pad(q, (0, -q.shape[1] % WORD_COLS)).reshape(q.shape[0], -1, WORD_COLS)
    words = torch.zeros(q.shape[:2], dtype=torch.int64, device=q.device)  # bit 31 set overflows int32
    for i in range(WORD_COLS):
        words |= q[:, :, i].to(torch.int64) << (4 * i)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return replace(weight, codes=words, layout="words")


def compact(t: torch.Tensor) -> torch.Tensor:
    """`t` (float) in float16 where that is exact, else float32: scales stay small without
    changing what the weight de-quantizes to."""
    t = t.float()
    half = t.half()
    return half if torch.equal(half.float(), t) else t


def int4_weight(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int) -> PackedWeight:
    """An int4 weight from codes `q` `[rows, cols]` and per-group scales and offsets `[rows, groups]`."""
    return PackedWeight("int4", pack_int4(q), compact(scales), compact(offsets), q.shape[1], group)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> PackedWeight:
    """`w` rounded to 16 levels per group of `group` columns between the group's min and max
    (one group per row where `group` does not divide the columns)."""
    rows, cols = w.shape
    group = group if cols % group == 0 else cols
    g = w.float().reshape(rows, cols // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-12)  # a constant group still divides by a scale
    q = ((g - lo[..., None]) / scales[..., None]).round().clamp(0, 15).reshape(rows, cols)
    return int4_weight(q, scales, lo, group)


def quantize_fp8(w: torch.Tensor) -> PackedWeight:
    """`w` as FP8 e4m3 codes with one float32 scale per row (its max magnitude over 448)."""
    wf = w.float()
    scales = (wf.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    codes = (wf / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return PackedWeight("fp8", codes, scales, None, w.shape[1], w.shape[1])


GGUF_BLOCK = 32  # elements per Q4_0 / Q4_1 / Q8_0 block
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144}


def from_gguf(qtype: str, packed: torch.Tensor, cols: int) -> PackedWeight | None:
    """A GGUF weight (uint8 `[rows, row_bytes]` blocks) as the same values in a PackedWeight;
    None for block formats without one here (the caller de-quantizes those).

    Each block is an fp16 scale d (Q4_1: then an fp16 minimum m) and 32 codes: Q4_0 / Q4_1
    bytes hold elements i (low nibble) and i + 16 (high), Q8_0 bytes are int8;
    `w = d * (q - 8)`, `d * q + m`, `d * q` respectively. Q4_K: `_q4_k`.
    """
    if qtype not in GGUF_BLOCK_BYTES:
        return None
    rows = packed.shape[0]
    if qtype == "Q4_K":
        return _q4_k(packed.reshape(rows, cols // 256, 144), cols)
    blocks = packed.reshape(rows, cols // GGUF_BLOCK, GGUF_BLOCK_BYTES[qtype])
    d = blocks[..., :2].contiguous().view(torch.float16)[..., 0].float()
    if qtype == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
        return PackedWeight("int8", q, compact(d), None, cols, GGUF_BLOCK)
    qs = blocks[..., -16:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(rows, cols)
    offsets = -8 * d if qtype == "Q4_0" else blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    return int4_weight(q, d, offsets, GGUF_BLOCK)


def _q4_k(blocks: torch.Tensor, cols: int) -> PackedWeight:
    """Q4_K super-blocks of 256 (fp16 d and dmin, 8 six-bit scales and minimums, 128 bytes of
    nibbles, 64 elements per 32 bytes: low nibbles first) as groups of 32 with float32 scales
    `d * sc` and offsets `-dmin * m`: the values gguf-py computes."""
    rows, nb = blocks.shape[:2]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    packed = blocks[..., 4:16].reshape(rows, nb, 3, 4)
    lo, hi, both = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = torch.cat([lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)], dim=-1).float()
    m = torch.cat([hi & 0x3F, (both >> 4) | ((hi >> 2) & 0x30)], dim=-1).float()
    qs = blocks[..., 16:].reshape(rows, nb, 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=3).reshape(rows, cols)
    return int4_weight(q, (d * sc).reshape(rows, -1), (-(dmin * m)).reshape(rows, -1), GGUF_BLOCK)


QUANTIZERS = {"fp8": quantize_fp8, "int4": quantize_int4}  # EngineConfig.quantization's methods


def stack_rows(parts: list[PackedWeight]) -> PackedWeight | None:
    """The row concatenation of `parts` (fused q/k/v, gate/up) as one weight, or None where
    their formats differ (the caller de-quantizes them)."""
    first = parts[0]
    same = all(p.code == first.code and p.layout == first.layout and p.cols == first.cols and p.group_cols == first.group_cols
               and p.group_rows == first.group_rows and p.scales.dtype == first.scales.dtype
               and (p.offsets is None) == (first.offsets is None)
               and (p.offsets is None or p.offsets.dtype == first.offsets.dtype) for p in parts)
    if not same or any(p.shape[0] % first.group_rows for p in parts[:-1]):
        return None
    offsets = None if first.offsets is None else torch.cat([p.offsets for p in parts])
    return replace(first, codes=torch.cat([p.codes for p in parts]), scales=torch.cat([p.scales for p in parts]),
                   offsets=offsets)


class PackedLinear(nn.Module):
    """`y = x @ W.T (+ bias)` for a `PackedWeight` W, de-quantized inside the product."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        # the GEMV streams int4 codes as int32 words on CUDA; the CPU keeps the layout it loaded
        self.weight_packed = to_words(weight) if weight.codes.is_cuda else weight
        self.in_features = weight.cols
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def weight_bytes(self) -> int:
        return self.weight_packed.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from structgen.engine.kernels import triton_enabled

        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if triton_enabled(x.device):
            from structgen.engine.kernels import packed_gemm

            y = packed_gemm.matmul(x2, self.weight_packed, self.bias)
        else:
            y = F.linear(x2, self.weight_packed.dequantize(x.dtype), self.bias)
        return y.reshape(*lead, self.out_features)


class PackedEmbedding(nn.Module):
    """Rows of a `PackedWeight` (one scale row per weight row), de-quantized on lookup."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype):
        super().__init__()
        if weight.group_rows != 1:
            raise ModelLoadError("an embedding with scales shared across rows is not supported; "
                                 "the checkpoint's embedding must be float or quantized per row")
        self.weight_packed = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w, flat = self.weight_packed, ids.reshape(-1)
        offsets = None if w.offsets is None else w.offsets[flat]
        rows = replace(w, codes=w.codes[flat], scales=w.scales[flat], offsets=offsets)
        return rows.dequantize(self.dtype).reshape(*ids.shape, w.cols)
