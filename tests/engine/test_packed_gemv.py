"""The stream GEMV (kernels/packed_gemv.py), the int4 "words" layout it reads, and the tinygemm
candidate, against their torch definition: `PackedWeight.dequantize` then a matmul in float32.

Like tests/engine/test_packed_gemm.py: they skip without CUDA; with `TRITON_INTERPRET=1` they
run on the CPU through Triton's interpreter (float32 / float16 activations).
"""

from __future__ import annotations

import os

import pytest
import torch

from structgen.engine.models.packed import (
    PackedLinear,
    PackedWeight,
    int4_weight,
    quantize_fp8,
    to_words,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_kernels = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA (or TRITON_INTERPRET=1)")
ROWS = 37  # odd, and not a multiple of any BLOCK_N


def int4(cols: int, group: int, offsets: bool = True, seed: int = 0) -> PackedWeight:
    """Random int4 codes with group scales (and offsets) in the "words" layout."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (ROWS, cols), generator=g)
    groups = -(-cols // group)
    scales = torch.rand(ROWS, groups, generator=g) * 0.02
    w = int4_weight(q, scales, -torch.rand(ROWS, groups, generator=g) * 0.1, group)
    return to_words(w if offsets else PackedWeight("int4", w.codes, w.scales, None, cols, group))


def fp8(cols: int, block_rows: int = 0, seed: int = 0) -> PackedWeight:
    """FP8 codes with a scale per output channel, or per `block_rows` x 64 block."""
    g = torch.Generator().manual_seed(seed)
    if not block_rows:
        return quantize_fp8(torch.randn(ROWS, cols, generator=g))
    codes = (torch.randn(ROWS, cols, generator=g) * 50).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-ROWS // block_rows), -(-cols // 64), generator=g) * 0.01
    return PackedWeight("fp8", codes, scales, None, cols, 64, block_rows)


def int8(cols: int, group: int, seed: int = 0) -> PackedWeight:
    """Signed int8 codes with float16 group scales (GGUF Q8_0's layout)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (ROWS, cols), generator=g).to(torch.int8)
    return PackedWeight("int8", q, (torch.rand(ROWS, -(-cols // group), generator=g) * 1e-3).half(), None, cols, group)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any()
    return float((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())


def stream(rows: int, j: int, splits: int, stages: int = 1, n: int = 8):
    from structgen.engine.kernels import packed_gemm

    return packed_gemm.Block(rows, n, j, 4, stages, "stream", splits)


# (weight, columns per chunk): K = 200 / 448 / 330 are not multiples of the chunk, groups of
# 32 / 64 / 128 columns, whole-row scales with and without offsets, FP8 per channel and per block,
# int8 in groups of 32
WEIGHTS = {
    "int4-g32": (lambda: int4(200, 32), 64),
    "int4-g64": (lambda: int4(448, 64), 256),
    "int4-g128": (lambda: int4(448, 128), 128),
    "int4-row-no-offset": (lambda: int4(330, 330, offsets=False), 128),
    "int4-row-offset": (lambda: int4(200, 200), 64),
    "fp8-channel": (lambda: fp8(200), 128),
    "fp8-block": (lambda: fp8(448, block_rows=16), 128),
    "int8-g32": (lambda: int8(200, 32), 64),
}


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("rows,splits,stages", [(1, 1, 1), (2, 3, 2), (3, 0, 1), (4, 2, 3)])
def test_stream_gemv_equals_dequantize_then_matmul(name: str, rows: int, splits: int, stages: int) -> None:
    """Every weight form at 1-4 rows, split-K off (1), forced (2, 3) and automatic (0), the
    next chunk prefetched (stages > 1) or not."""
    from structgen.engine.kernels import packed_gemm

    make, j = WEIGHTS[name]
    w = make().to(DEVICE)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, w.cols, generator=g).to(DEVICE)
    b = torch.randn(ROWS, generator=g).to(DEVICE)
    out = packed_gemm.matmul(x, w, b, block=stream(rows, j, splits, stages))
    assert out.shape == (rows, ROWS)
    assert rel_err(out, x @ w.dequantize().T + b) < 1e-6


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("name", ["int4-g32", "fp8-channel"])
def test_stream_gemv_is_the_default_for_few_rows_in_half_precision(name: str) -> None:
    """The default launch (no block) of 1-4 rows is the stream GEMV, in x's dtype."""
    from structgen.engine.kernels import packed_gemm

    w = WEIGHTS[name][0]().to(DEVICE)
    low = torch.bfloat16 if CUDA else torch.float16
    assert packed_gemm.gemv_block(w, 3).form == "stream"
    x = torch.randn(3, w.cols, generator=torch.Generator().manual_seed(3)).to(DEVICE, low)
    out = packed_gemm.matmul(x, w)
    assert out.dtype == low
    assert rel_err(out, x.float() @ w.dequantize().T) < 1e-2


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("rows,form", [(2, "reduce"), (9, None)])
def test_the_other_kernels_read_the_words_layout(rows: int, form: str | None) -> None:
    """A repacked int4 weight still runs the gathering GEMV and the tiled GEMM (prompt rows)."""
    from structgen.engine.kernels import packed_gemm

    w = int4(448, 64).to(DEVICE)
    x = torch.randn(rows, w.cols, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    block = None if form is None else packed_gemm.Block(rows, 8, 64, 4, 1, form)
    assert rel_err(packed_gemm.matmul(x, w, block=block), x @ w.dequantize().T) < 1e-5


@pytest.mark.gpu
@needs_kernels
def test_each_gemv_form_refuses_a_layout_it_cannot_read() -> None:
    from structgen.engine.kernels import packed_gemm
    from structgen.errors import InvalidParameterError

    words = int4(256, 32).to(DEVICE)
    halves = int4_weight(torch.randint(0, 16, (ROWS, 256)), torch.rand(ROWS, 8), torch.rand(ROWS, 8), 32).to(DEVICE)
    x = torch.randn(1, 256).to(DEVICE)
    with pytest.raises(InvalidParameterError, match="'halves' layout"):
        packed_gemm.matmul(x, words, block=packed_gemm.Block(1, 8, 64, 4, 1, "magic"))
    with pytest.raises(InvalidParameterError, match="to_words"):
        packed_gemm.matmul(x, halves, block=stream(1, 64, 1))
    assert packed_gemm.gemv_block(halves, 1).form == "magic"


def test_words_layout_keeps_the_weight_and_loads_only_on_cuda() -> None:
    """`to_words` changes where the nibbles sit, not what the weight de-quantizes to; a CPU
    `PackedLinear` keeps the layout it was given."""
    g = torch.Generator().manual_seed(0)
    halves = int4_weight(torch.randint(0, 16, (5, 18), generator=g), torch.rand(5, 1, generator=g),
                         torch.rand(5, 1, generator=g), 18)
    words = to_words(halves)
    assert words.layout == "words" and words.codes.dtype == torch.int32 and words.codes.shape == (5, 3)
    assert torch.equal(words.dequantize(), halves.dequantize())
    assert PackedLinear(halves).weight_packed.layout == "halves"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="bf16 kernels, CUDA graphs and tinygemm run on CUDA only")
def test_stream_gemv_in_bf16_on_cuda_captures_in_a_graph() -> None:
    """Llama-like shapes in bf16: close to the reference, split-K automatic, replayed from a CUDA
    graph with the same result; a CUDA PackedLinear repacks int4 to words."""
    from structgen.engine.kernels import packed_gemm
    from structgen.engine.models.packed import quantize_int4

    g = torch.Generator().manual_seed(0)
    for w in (quantize_int4(torch.randn(512, 2048, generator=g) * 0.02).to(DEVICE),
              quantize_fp8(torch.randn(512, 2048, generator=g) * 0.02).to(DEVICE)):
        layer = PackedLinear(w)
        assert layer.weight_packed.layout == ("words" if w.code == "int4" else "halves")
        x = torch.randn(2, 2048, generator=g).to(DEVICE, torch.bfloat16)
        eager = layer(x)
        assert rel_err(eager, x.float() @ w.dequantize().T) < 1e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        assert packed_gemm.gemv_block(layer.weight_packed, 2).form == "stream"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="tinygemm is a CUDA kernel")
def test_tinygemm_candidate_stays_close_to_the_reference() -> None:
    """tinygemm rounds scales and zeros to bf16: close to the reference, not equal."""
    from structgen.engine.kernels import packed_gemm, tinygemm
    from structgen.engine.models.packed import quantize_int4

    w = quantize_int4(torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)) * 0.02).to(DEVICE)
    assert tinygemm.tinygemm_fits(w) and not tinygemm.tinygemm_fits(int4(200, 32))
    x = torch.randn(3, 1024, device=DEVICE, dtype=torch.bfloat16)
    out = packed_gemm.matmul(x, tinygemm.to_tinygemm(to_words(w)))
    assert rel_err(out, x.float() @ w.dequantize().T) < 2e-2
