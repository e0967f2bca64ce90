"""The packed-weight products (kernels/packed_gemm.py) against their torch definition,
`PackedWeight.dequantize` then a matmul: every code (int4 with offsets, int8, FP8 per channel
and per block; int4 in the "words" layout a CUDA model loads), the GEMV and GEMM forms, with
and without a bias.

GPU tests: they skip without CUDA; with `TRITON_INTERPRET=1` they run on the CPU through
Triton's interpreter (float32 / float16 activations: the interpreter mis-computes bf16 dots).
`torch._scaled_mm` runs on the CPU too, so its test is not GPU-only.
"""

from __future__ import annotations

import os

import pytest
import torch

from structgen.engine.models.packed import PackedWeight, int4_weight, quantize_fp8, to_words

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
LOW = torch.bfloat16 if CUDA else torch.float16
needs_kernels = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA (or TRITON_INTERPRET=1)")
ROWS, COLS = 72, 192  # neither a multiple of the 64-row tile nor of the 256-pair chunk


def weight(code: str, seed: int = 0) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    if code == "int4":
        q = torch.randint(0, 16, (ROWS, COLS), generator=g)
        scales = torch.rand(ROWS, COLS // 32, generator=g) * 0.02
        return int4_weight(q, scales, -torch.rand(ROWS, COLS // 32, generator=g) * 0.1, 32)
    if code == "int8":
        q = torch.randint(-127, 128, (ROWS, COLS), generator=g).to(torch.int8)
        return PackedWeight("int8", q, (torch.rand(ROWS, COLS // 32, generator=g) * 1e-3).half(), None, COLS, 32)
    if code == "fp8":
        return quantize_fp8(torch.randn(ROWS, COLS, generator=g))
    codes = (torch.randn(ROWS, COLS, generator=g) * 50).to(torch.float8_e4m3fn)  # "fp8-block": 32 x 64 blocks
    return PackedWeight("fp8", codes, torch.rand(-(-ROWS // 32), COLS // 64, generator=g) * 0.01, None, COLS, 64, 32)


def words_weight(group: int, offsets: bool, cols: int = 204, seed: int = 0) -> PackedWeight:
    """An int4 weight in the "words" layout, ROWS x `cols` (204: the last word padded, the
    last group short), groups of `group` columns, with or without offsets."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-cols // group)
    w = int4_weight(torch.randint(0, 16, (ROWS, cols), generator=g), torch.rand(ROWS, groups, generator=g) * 0.02,
                    -torch.rand(ROWS, groups, generator=g) * 0.1, group)
    return to_words(w if offsets else PackedWeight("int4", w.codes, w.scales, None, cols, group))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any()
    return float((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("code", ["int4", "int8", "fp8", "fp8-block"])
@pytest.mark.parametrize("rows", [1, 3, 9, 70])
@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matmul_equals_dequantize_then_matmul(code: str, rows: int, dtype: torch.dtype, bias: bool) -> None:
    from structgen.engine.kernels import packed_gemm

    w = weight(code, seed=rows).to(DEVICE)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, COLS, generator=g).to(DEVICE, dtype)
    b = torch.randn(ROWS, generator=g).to(DEVICE, dtype) if bias else None
    ref = x.float() @ w.dequantize().T + (b.float() if bias else 0)
    out = packed_gemm.matmul(x, w, b)
    assert out.dtype == dtype and out.shape == (rows, ROWS)
    # float32 GEMV sums in another order; the GEMM rounds W's tile to x's dtype for tl.dot
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("code", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("form,splits", [("reduce", 1), ("cvt", 1), ("magic", 1), ("magic", 3)])
def test_every_gemv_form_equals_dequantize_then_matmul(code: str, form: str, splits: int) -> None:
    """The forms benchmarks/tune_packed.py chooses between, split-K included (3 splits of the
    96 column pairs in chunks of 32: the last program's chunk is masked)."""
    from structgen.engine.kernels import packed_gemm

    w = weight(code, seed=5).to(DEVICE)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, COLS, generator=g).to(DEVICE)
    b = torch.randn(ROWS, generator=g).to(DEVICE)
    out = packed_gemm.matmul(x, w, b, block=packed_gemm.Block(4, 8, 32, 4, 1, form, splits))
    assert rel_err(out, x @ w.dequantize().T + b) < 1e-5


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("code", ["int8", "fp8", "fp8-block"])
@pytest.mark.parametrize("splits", [1, 2, 0])
def test_tiles_gemm_split_k_equals_dequantize_then_matmul(code: str, splits: int) -> None:
    """The byte codes' "tiles" GEMM split along the columns (2 splits of 3 chunks: one share is
    short; 0: the count from the multiprocessors), bias added once, into a column slice."""
    from structgen.engine.kernels import packed_gemm

    w = weight(code, seed=7).to(DEVICE)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(20, COLS, generator=g).to(DEVICE)
    b = torch.randn(ROWS, generator=g).to(DEVICE)
    out = torch.zeros(20, ROWS + 10, device=DEVICE)
    packed_gemm.matmul(x, w, b, block=packed_gemm.Block(16, 32, 32, 4, 1, "tiles", splits), out=out[:, 4:4 + ROWS])
    assert rel_err(out[:, 4:4 + ROWS], x @ w.dequantize().T + b) < 1e-5
    assert not out[:, :4].any() and not out[:, 4 + ROWS:].any()


def test_gemm_block_takes_a_codes_timed_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """A code's entry in TILES_BLOCKS replaces `dot_block` for its row bucket only; float32
    activations keep one stage (their pipelined tiles overflow shared memory)."""
    from structgen.engine.kernels import packed_gemm

    tuned = packed_gemm.Block(64, 128, 64, 8, 4, "tiles", 0)
    monkeypatch.setattr(packed_gemm, "TILES_BLOCKS", {"fp8": {64: tuned}})
    w = weight("fp8")
    assert packed_gemm.gemm_block(w, 40) == tuned and packed_gemm.gemm_block(w, 100) == tuned
    assert packed_gemm.gemm_block(w, 40, torch.float32) == tuned._replace(stages=1)
    assert packed_gemm.gemm_block(w, 16) == packed_gemm.dot_block(16)
    assert packed_gemm.gemm_block(weight("int8"), 40) == packed_gemm.dot_block(40)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_late_gemv_reads_fp8_codes_scaled_per_channel(rows: int) -> None:
    """The "late" form (kernels/gemv.py on FP8 codes, each output scaled by its channel's
    scale), written into a column slice; it refuses FP8 with 2D block scales."""
    from structgen.engine.kernels import packed_gemm
    from structgen.errors import InvalidParameterError

    w = weight("fp8", seed=rows).to(DEVICE)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, COLS, generator=g).to(DEVICE)
    b = torch.randn(ROWS, generator=g).to(DEVICE)
    wide = torch.zeros(rows, ROWS + 8, device=DEVICE)
    block = packed_gemm.Block(rows, 4, 64, 4, 2, "late")
    out = packed_gemm.matmul(x, w, b, block=block, out=wide[:, 8:])
    assert out.data_ptr() == wide[:, 8:].data_ptr() and not wide[:, :8].any()
    assert rel_err(out, x @ w.dequantize().T + b) < 1e-5
    with pytest.raises(InvalidParameterError, match="one scale per output channel"):
        packed_gemm.matmul(x, weight("fp8-block").to(DEVICE), block=block)


@pytest.mark.gpu
@needs_kernels
def test_grouped_gemv_refuses_groups_that_straddle_its_runs() -> None:
    from structgen.engine.kernels import packed_gemm
    from structgen.errors import InvalidParameterError

    w = weight("fp8-block").to(DEVICE)  # groups of 64 columns; each half of a row holds 96
    assert not packed_gemm.grouped_fits(w, 64) and packed_gemm.grouped_fits(w, 32)
    assert packed_gemm.gemv_block(w, 1).form == "stream"  # the stream GEMV reads any power-of-two group
    with pytest.raises(InvalidParameterError, match="groups of 64 columns"):
        packed_gemm.matmul(torch.randn(1, COLS).to(DEVICE), w, block=packed_gemm.Block(1, 8, 64, 4, 1, "magic"))


@pytest.mark.gpu
@needs_kernels
def test_packed_matmul_writes_into_a_column_slice() -> None:
    from structgen.engine.kernels import packed_gemm

    w = weight("int4").to(DEVICE)
    x = torch.randn(2, COLS).to(DEVICE)
    out = torch.zeros(2, ROWS + 10, device=DEVICE)
    packed_gemm.matmul(x, w, out=out[:, 4:4 + ROWS])
    assert rel_err(out[:, 4:4 + ROWS], x @ w.dequantize().T) < 1e-5
    assert not out[:, :4].any() and not out[:, 4 + ROWS:].any()


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("rows", [5, 16, 33, 64, 200])
@pytest.mark.parametrize("group", [32, 128, 204])
@pytest.mark.parametrize("offsets,bias", [(True, False), (False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
def test_words_gemm_equals_dequantize_then_matmul(rows: int, group: int, offsets: bool, bias: bool,
                                                  dtype: torch.dtype) -> None:
    """The default GEMM of an int4 weight in the "words" layout (what a CUDA model loads) at
    each row bucket of `WORDS_GEMM_BLOCKS`; a group of the whole row without offsets scales
    the output instead of the tiles."""
    from structgen.engine.kernels import packed_gemm

    w = words_weight(group, offsets, seed=rows).to(DEVICE)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, w.cols, generator=g).to(DEVICE, dtype)
    b = torch.randn(ROWS, generator=g).to(DEVICE, dtype) if bias else None
    assert packed_gemm.gemm_block(w, rows, dtype).form in ("x-by-w", "w-by-x")
    out = packed_gemm.matmul(x, w, b)
    assert out.dtype == dtype and out.shape == (rows, ROWS)
    ref = x.float() @ w.dequantize().T + (b.float() if bias else 0)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("form", ["x-by-w", "w-by-x", "dequantize", "tiles"])
@pytest.mark.parametrize("group,splits", [(24, 1), (100, 3), (64, 0), (6, 2)])
def test_every_words_gemm_form_reads_any_group(form: str, group: int, splits: int) -> None:
    """Groups that straddle a chunk (24, 100: runs of 8 and 4 columns; 6: of 2) or are a power
    of two smaller than it, with split-K (3 splits of 4 chunks: one program's share is short),
    into a column slice of a wider output."""
    from structgen.engine.kernels import packed_gemm

    w = words_weight(group, offsets=True, cols=248, seed=group).to(DEVICE)
    g = torch.Generator().manual_seed(group)
    x = torch.randn(20, w.cols, generator=g).to(DEVICE)
    b = torch.randn(ROWS, generator=g).to(DEVICE)
    out = torch.zeros(20, ROWS + 10, device=DEVICE)
    packed_gemm.matmul(x, w, b, block=packed_gemm.Block(16, 32, 64, 4, 1, form, splits), out=out[:, 4:4 + ROWS])
    assert rel_err(out[:, 4:4 + ROWS], x @ w.dequantize().T + b) < 1e-5
    assert not out[:, :4].any() and not out[:, 4 + ROWS:].any()


@pytest.mark.gpu
@needs_kernels
def test_words_gemm_refuses_the_halves_layout() -> None:
    from structgen.engine.kernels import packed_gemm
    from structgen.errors import InvalidParameterError

    w = weight("int4").to(DEVICE)
    assert packed_gemm.gemm_block(w, 64).form == "tiles"
    with pytest.raises(InvalidParameterError, match="to_words"):
        packed_gemm.matmul(torch.randn(8, COLS).to(DEVICE), w, block=packed_gemm.Block(16, 32, 64, 4, 1, "w-by-x"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="captures a CUDA graph")
@pytest.mark.parametrize("rows", [16, 64])
def test_words_gemm_replays_in_a_cuda_graph(rows: int) -> None:
    """A decode step's GEMM (split-K partials included) captured once and replayed on new rows."""
    from structgen.engine.kernels import packed_gemm

    w = words_weight(128, offsets=True, cols=512).to(DEVICE)
    x = torch.randn(rows, w.cols, device=DEVICE, dtype=torch.bfloat16)
    packed_gemm.matmul(x, w)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = packed_gemm.matmul(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_err(out, x.float() @ w.dequantize().T) < 1e-2


def test_scaled_mm_path_stays_close_to_the_weight_only_product() -> None:
    """Prompt rows of an FP8 per-channel weight on the FP8 tensor cores: x is rounded to FP8
    per row too, so the product is close, not equal (e4m3 keeps 3 mantissa bits)."""
    pytest.importorskip("triton")
    from structgen.engine.kernels import packed_gemm

    g = torch.Generator().manual_seed(1)
    w = quantize_fp8(torch.randn(80, COLS, generator=g)).to(DEVICE)
    assert packed_gemm.scaled_mm_fits(w) and not packed_gemm.scaled_mm_fits(weight("fp8-block"))
    x = torch.randn(32, COLS, generator=g).to(DEVICE, LOW)
    bias = torch.randn(80, generator=g).to(DEVICE, LOW)
    out = packed_gemm.scaled_mm(x, w, bias)
    assert out.dtype == LOW
    assert rel_err(out, x.float() @ w.dequantize().T + bias.float()) < 0.05


@pytest.mark.gpu
@pytest.mark.slow  # under the interpreter; seconds on a GPU
@needs_kernels
@pytest.mark.parametrize("method", ["awq", "fp8"])
def test_quantized_model_through_the_kernels_matches_its_float_weights(tmp_path, method: str) -> None:
    """A tiny AWQ / FP8 checkpoint run through the Triton kernels (the decode graphs on CUDA)
    against the same model's float weights: prompt logits close, and greedy decoding through
    the graphs gives the tokens eager decoding gives."""
    from test_hf_quantized import PROMPTS, QUANT_CONFIGS, quantized_checkpoint, write_dir

    from structgen.engine.config import EngineConfig, ModelConfig
    from structgen.engine.engine import Engine
    from structgen.engine.model_runner import ExtendSeq
    from structgen.engine.request import Request
    from structgen.engine.sampler import SamplingParams

    stored, floats = quantized_checkpoint(method)
    dirs = [write_dir(tmp_path / "q", stored, QUANT_CONFIGS[method]), write_dir(tmp_path / "f", floats, None)]
    cfg = ModelConfig.from_file(dirs[0] / "config.json")
    dtype = "bfloat16" if CUDA else "float32"
    engines = [Engine(cfg, EngineConfig(device=str(DEVICE), dtype=dtype, max_batch_size=2, max_seq_len=64,
                                        use_cuda_graphs=graphs), d) for d, graphs in ((dirs[0], True), (dirs[1], False),
                                                                                      (dirs[0], False))]
    logits = [e.runner.extend([ExtendSeq(0, 0, PROMPTS[0], num_logits=5)]) for e in engines[:2]]
    assert rel_err(logits[0], logits[1]) < (2e-2 if CUDA else 1e-4)
    outputs = []
    for e in (engines[0], engines[2]):
        reqs = [Request(p, SamplingParams(max_tokens=6)) for p in PROMPTS]
        e.run(reqs)
        outputs.append([r.output_ids for r in reqs])
    assert outputs[0] == outputs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="loads the default model on CUDA")
def test_default_gguf_model_on_cuda_keeps_its_q4_1_weights_packed(model_dir) -> None:
    """With `gguf_packed_on_cuda` the default model's Q4_1 projections load as int4 and its Q8_0 embedding (and
    the tied LM head) as int8; prompt logits stay close to the model de-quantized to bf16."""
    from structgen.engine.config import EngineConfig, EngineTuning
    from structgen.engine.engine import Engine
    from structgen.engine.model_runner import ExtendSeq
    from structgen.engine.models.loader import load_model_config
    from structgen.engine.models.packed import PackedLinear

    cfg = load_model_config(model_dir)
    engines = [Engine(cfg, EngineConfig(max_batch_size=2, max_seq_len=256,
                                        tuning=EngineTuning(quantized_weights=q, gguf_packed_on_cuda=q)),
                      model_dir) for q in (True, False)]
    model = engines[0].runner.model
    assert model.layers[0].mlp.down_proj.weight_packed.code == "int4"
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.weight_packed.code == "int8"
    ids = [1, 9690, 198, 2683, 314, 253, 5356, 30]
    logits = [e.runner.extend([ExtendSeq(0, 0, ids, num_logits=len(ids))]) for e in engines]
    assert rel_err(logits[0], logits[1]) < 2e-2
