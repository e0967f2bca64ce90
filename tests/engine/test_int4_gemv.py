"""The CUDA int4 GEMV (kernels/int4_gemv.py, csrc/int4_gemv.cu) against the float32 reference
`PackedWeight.dequantize` then a matmul, and against the Triton stream GEMV it replaces by
default. GPU only: it is a CUDA kernel of bf16 arithmetic."""

from __future__ import annotations

import pytest
import torch

from structgen.engine.models.packed import PackedWeight, int4_weight, to_words

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="a CUDA kernel")]


def weight(rows: int, cols: int, group: int, offsets: bool, seed: int = 0, half_scales: bool = True,
           half_offsets: bool = False) -> PackedWeight:
    """Random int4 codes in the "words" layout; scales and offsets kept in float16 where they are
    exact in it (`half_*`), else float32 (`compact`)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols), generator=g)
    groups = -(-cols // group)
    scales = torch.rand(rows, groups, generator=g) * 0.02 + 0.001
    shifts = -torch.rand(rows, groups, generator=g) * 0.1
    scales = scales.half().float() if half_scales else scales.half().float() + 1e-7
    shifts = shifts.half().float() if half_offsets else shifts.half().float() - 1e-6
    w = int4_weight(q, scales, shifts, group)
    assert w.scales.dtype == (torch.float16 if half_scales else torch.float32)
    assert w.offsets.dtype == (torch.float16 if half_offsets else torch.float32)
    if not offsets:
        w = PackedWeight("int4", w.codes, w.scales, None, cols, group)
    return to_words(w).to("cuda")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def cuda_block(rows: int):
    from structgen.engine.kernels import packed_gemm

    return packed_gemm.Block(rows, 16, 512, 4, 3, "cuda")


# (rows of W, cols, group). Groups of 32 and 64 (GGUF Q4) take the CUDA-core form: one step of
# its 4,096 columns, less, and more than two (9,248: the third step's words reach only some of
# the warps). At 2-4 rows, groups of 128 or more (AWQ / GPTQ) in whole 128-column tiles take
# the tensor-core form: every warp a chunk and fewer chunks than warps (5 tiles), more chunks
# than warps (14,336: Llama-8B's down), a group over two tiles, a whole row of 9 tiles; a whole
# row of 8.25 tiles (1,056) stays on the CUDA-core form. W's row counts are not a multiple of
# either form's features (8, 16).
SHAPES = [(37, 4096, 128), (200, 1056, 32), (64, 2048, 2048), (1000, 512, 64), (45, 9248, 32),
          (300, 14336, 128), (17, 1152, 1152), (40, 640, 256), (24, 1056, 1056)]


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("offsets", [True, False])
def test_cuda_gemv_is_close_to_the_reference(rows: int, shape: tuple[int, int, int], offsets: bool) -> None:
    """Within bf16 rounding of the float32 reference, and as close as the stream GEMV (whose
    products are float32, rounded to bf16 once)."""
    from structgen.engine.kernels import packed_gemm

    n, cols, group = shape
    w = weight(n, cols, group, offsets, seed=rows)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=g).to("cuda", torch.bfloat16)
    b = torch.randn(n, generator=g).to("cuda", torch.bfloat16)
    ref = x.float() @ w.dequantize().T + b.float()
    out = packed_gemm.matmul(x, w, b, block=cuda_block(rows))
    stream = packed_gemm.matmul(x, w, b, block=packed_gemm.Block(rows, 16, 512, 4, 3, "stream", 0))
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2
    assert rel_err(out, ref) < 2 * rel_err(stream, ref) + 2e-3


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] >= 128 and s[1] % 128 == 0])
def test_tensor_core_form_is_as_close_as_the_stream_gemv(rows: int, shape: tuple[int, int, int]) -> None:
    """2-8 rows with groups of 128 columns or more take the tensor-core form (the default launch
    too, past the CUDA-core form's 4 rows), whose products are exact in float32: as close to the
    reference as the stream GEMV, where the CUDA-core form's bf16 products are about twice as far."""
    from structgen.engine.kernels import packed_gemm

    n, cols, group = shape
    w = weight(n, cols, group, True, seed=rows)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to("cuda", torch.bfloat16)
    ref = x.float() @ w.dequantize().T
    out = packed_gemm.matmul(x, w, block=cuda_block(rows))
    assert torch.equal(packed_gemm.matmul(x, w), out)
    stream = packed_gemm.matmul(x[:4], w, block=packed_gemm.Block(4, 16, 512, 4, 3, "stream", 0))
    assert rel_err(out[:4], ref[:4]) < 1.3 * rel_err(stream, ref[:4]) + 2e-4
    assert rel_err(out, ref) < 1.3 * rel_err(stream, ref[:4]) + 4e-4


@pytest.mark.parametrize("half_scales,half_offsets", [(True, True), (True, False), (False, True), (False, False)])
def test_cuda_gemv_reads_each_group_dtype_and_writes_a_column_slice(half_scales: bool, half_offsets: bool) -> None:
    """Scales and offsets each in float16 or float32, bias absent, the output a column slice of
    a wider tensor whose other columns stay untouched."""
    from structgen.engine.kernels import packed_gemm

    w = weight(96, 1024, 128, True, half_scales=half_scales, half_offsets=half_offsets)
    x = torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16)
    wide = torch.full((2, 160), 7.0, device="cuda", dtype=torch.bfloat16)
    packed_gemm.matmul(x, w, block=cuda_block(2), out=wide[:, 32:128])
    assert rel_err(wide[:, 32:128], x.float() @ w.dequantize().T) < 1e-2
    assert bool((wide[:, :32] == 7).all()) and bool((wide[:, 128:] == 7).all())


def test_default_launch_takes_the_cuda_gemv_and_replays_in_a_graph() -> None:
    """bf16 x of 1-4 rows on a fitting weight runs the CUDA GEMV by default; captured in a CUDA
    graph it gives the eager result."""
    from structgen.engine.kernels import int4_gemv, packed_gemm

    w = weight(512, 2048, 128, True)
    x = torch.randn(3, 2048, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(3, 512, device="cuda", dtype=torch.bfloat16)
    assert int4_gemv.fits(x, w, None, y)
    eager = packed_gemm.matmul(x, w)
    assert torch.equal(eager, packed_gemm.matmul(x, w, block=cuda_block(3)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = packed_gemm.matmul(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_cuda_gemv_refuses_what_it_cannot_read() -> None:
    """float32 x, groups of 16 columns and columns not a multiple of 32 are not its shapes: the
    default launch keeps the stream GEMV there, a forced one says what to use."""
    from structgen.engine.kernels import int4_gemv, packed_gemm
    from structgen.errors import InvalidParameterError

    w = weight(64, 1024, 128, True)
    x32 = torch.randn(1, 1024, device="cuda")
    y32 = torch.empty(1, 64, device="cuda")
    assert not int4_gemv.fits(x32, w, None, y32)
    with pytest.raises(InvalidParameterError, match="form='stream'"):
        packed_gemm.matmul(x32, w, block=cuda_block(1))
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, 64, device="cuda", dtype=torch.bfloat16)
    small_groups = weight(64, 1024, 16, True)
    assert not int4_gemv.fits(x, small_groups, None, y)
    odd = weight(64, 1000, 1000, True)
    assert not int4_gemv.fits(torch.randn(1, 1000, device="cuda", dtype=torch.bfloat16), odd, None, y)
    assert rel_err(packed_gemm.matmul(x, small_groups), x.float() @ small_groups.dequantize().T) < 1e-2
    # 5-8 rows only in whole 128-column tiles of groups of 128 or more: groups of 32 keep the
    # words GEMM by default, and a forced launch says what to use
    q4 = weight(64, 1024, 32, True)
    x5 = torch.randn(5, 1024, device="cuda", dtype=torch.bfloat16)
    y5 = torch.empty(5, 64, device="cuda", dtype=torch.bfloat16)
    assert not int4_gemv.fits(x5, q4, None, y5) and int4_gemv.fits(x5, w, None, y5)
    with pytest.raises(InvalidParameterError, match="form='stream'"):
        packed_gemm.matmul(x5, q4, block=cuda_block(5))
    assert rel_err(packed_gemm.matmul(x5, q4), x5.float() @ q4.dequantize().T) < 1e-2
    assert not int4_gemv.fits(torch.randn(9, 1024, device="cuda", dtype=torch.bfloat16), w, None,
                              torch.empty(9, 64, device="cuda", dtype=torch.bfloat16))
