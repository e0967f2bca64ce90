"""Weights kept in GGUF block formats on the CPU: each kernel (csrc/quant_matmul.cpp, SIMD and
scalar paths) against de-quantize-then-matmul with gguf-py's independent de-quantization, the
quantized layers, and the default model loaded quantized against the same model de-quantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from structgen.engine.config import EngineConfig, EngineTuning
from structgen.engine.kernels import cpu_quant
from structgen.engine.models.quantized import QuantizedLinear, QuantizedWeight

# Bytes per block, elements per block and the offsets of the block's fp16 scales.
LAYOUT = {"Q4_0": (18, 32, (0,)), "Q4_1": (20, 32, (0, 2)), "Q8_0": (34, 32, (0,)),
          "Q4_K": (144, 256, (0, 2)), "Q6_K": (210, 256, (208,))}
COLS = 512  # a multiple of every block size


def assert_same_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`got` equals `x @ w.T` up to fp32 rounding in another summation order: each entry
    within 1e-5 of the sum of its products' magnitudes."""
    ref = x.double() @ w.double().T
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-7
    assert ((got.double() - ref).abs() <= bound).all(), (got.double() - ref).abs().max()


@pytest.fixture(scope="module")
def kernels() -> cpu_quant.QuantKernels:
    k = cpu_quant.load()
    if k is None:
        pytest.fail("the quantized CPU kernels did not build (is g++ installed?)")
    return k


SIMD_LEVELS, SIMD_IDS = [0, 1, 2], ["scalar", "avx2", "avx512"]


def at_level(kernels: cpu_quant.QuantKernels, level: int) -> cpu_quant.QuantKernels:
    if level > kernels.simd:
        pytest.skip(f"this CPU runs SIMD level {kernels.simd} at most")
    return kernels.at_simd_level(level)


def random_blocks(qtype: str, rows: int, cols: int = COLS, seed: int = 0) -> torch.Tensor:
    """Random packed weights: random quant bits, fp16 scales of a trained model's size."""
    nbytes, elems, scales = LAYOUT[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // elems, nbytes), dtype=np.uint8)
    for off in scales:
        s = rng.uniform(-0.02, 0.02, size=(rows, cols // elems)).astype(np.float16)
        raw[:, :, off:off + 2] = s.view(np.uint8).reshape(rows, cols // elems, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


@pytest.mark.parametrize("qtype", sorted(LAYOUT))
@pytest.mark.parametrize("simd", SIMD_LEVELS, ids=SIMD_IDS)
def test_dequantize_equals_gguf_reference_exactly(kernels, qtype: str, simd: int) -> None:
    k = at_level(kernels, simd)
    packed = random_blocks(qtype, 13)
    ref = cpu_quant.dequantize_reference(packed, qtype)
    assert torch.equal(k.dequantize(packed, qtype, COLS), ref)
    ids = torch.tensor([12, 0, 5, 5])
    assert torch.equal(k.dequantize_rows(packed, qtype, COLS, ids), ref[ids])


@pytest.mark.parametrize("qtype", sorted(LAYOUT))
@pytest.mark.parametrize("rows,n", [(1, 1), (37, 1), (37, 3), (129, 6)])
@pytest.mark.parametrize("simd", SIMD_LEVELS, ids=SIMD_IDS)
def test_matmul_equals_dequantize_then_matmul(kernels, qtype: str, rows: int, n: int, simd: int) -> None:
    k = at_level(kernels, simd)
    packed = random_blocks(qtype, rows, seed=rows + n)
    x = torch.randn(n, COLS, generator=torch.Generator().manual_seed(n))
    got = k.matmul(x, packed, qtype, COLS)
    assert_same_product(got, x, cpu_quant.dequantize_reference(packed, qtype))
    torch.testing.assert_close(got, cpu_quant.matmul_reference(x, packed, qtype), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("qtype", sorted(LAYOUT))
@pytest.mark.parametrize("simd", SIMD_LEVELS, ids=SIMD_IDS)
def test_one_activation_row_sums_like_several(kernels, qtype: str, simd: int) -> None:
    """A single activation row runs weight rows several at a time (a decode step's GEMV);
    each output still sums in the order of the several-row kernel, bit for bit, rows not a
    multiple of the group included."""
    k = at_level(kernels, simd)
    packed = random_blocks(qtype, 37, seed=5)
    x = torch.randn(2, COLS, generator=torch.Generator().manual_seed(5))
    assert torch.equal(k.matmul(x[:1], packed, qtype, COLS), k.matmul(x, packed, qtype, COLS)[:1])


def test_matmul_writes_into_a_column_slice(kernels) -> None:
    packed = random_blocks("Q4_1", 7)
    x = torch.randn(2, COLS)
    out = torch.zeros(2, 20)
    kernels.matmul(x, packed, "Q4_1", COLS, out=out[:, 5:12])
    assert_same_product(out[:, 5:12], x, cpu_quant.dequantize_reference(packed, "Q4_1"))
    assert not out[:, :5].any() and not out[:, 12:].any()


@pytest.mark.parametrize("n", [1, 5, cpu_quant.MAX_KERNEL_ROWS + 3], ids=["decode", "few", "prefill"])
def test_linear_of_mixed_formats_equals_reference(kernels, n: int) -> None:
    """A fused projection whose parts are in different formats (as in Q4_K_M files), with a
    bias, at batch 1, a few rows (kernel) and many rows (de-quantized tile + torch matmul)."""
    parts = [QuantizedWeight("Q4_K", random_blocks("Q4_K", 9), COLS),
             QuantizedWeight("Q6_K", random_blocks("Q6_K", 4), COLS),
             QuantizedWeight("Q6_K", random_blocks("Q6_K", 3, seed=1), COLS)]
    bias = torch.randn(16)
    layer = QuantizedLinear(parts, bias)
    assert len(layer.parts) == 2  # the two Q6_K neighbours share one packed tensor
    x = torch.randn(n, COLS)
    w = torch.cat([cpu_quant.dequantize_reference(p.packed, p.qtype) for p in parts])
    assert_same_product(layer(x) - bias, x, w)


INT8_FORMATS = sorted(cpu_quant.INT8_FORMATS)
INT8_LEVELS, INT8_IDS = [1, 2], ["avx-vnni", "avx512-vnni"]


def int8_at_level(kernels: cpu_quant.QuantKernels, level: int) -> cpu_quant.QuantKernels:
    k = kernels.at_simd_level(level)
    if k.int8_level != level:
        pytest.skip(f"this CPU has no {INT8_IDS[level - 1]} int8 products")
    return k


@pytest.mark.parametrize("qtype", INT8_FORMATS)
@pytest.mark.parametrize("rows,n,cols", [(37, 9, 96), (8, 5, COLS), (13, 50, 160), (150, 7, 576),
                                         (12, 50, 672), (6, 9, 1536)])
@pytest.mark.parametrize("level", INT8_LEVELS, ids=INT8_IDS)
@pytest.mark.parametrize("planes", [1, 2], ids=["int8", "int16"])
def test_integer_matmul_equals_its_reference(kernels, qtype: str, rows: int, n: int, cols: int, level: int,
                                             planes: int) -> None:
    """Activations rounded per 32-block to int8 codes (or 16-bit codes as two int8 planes)
    against the packed blocks: the int32 dot products are exact, so the kernel equals the fp64
    product of both de-quantized operands up to fp32 rounding, for weight rows and activation
    rows that fill no whole tile (a last tile of 1, 2 or 3 rows), block counts that fill no
    group of four (3, 5 and the default model's 18: padding inside a group, a last pair), wide
    units of 16 before groups and a padded pair (21) or alone (48), and a
    thread's share of rows past the offsets' 64-column tiles; and it is not the fp32-activation product."""
    k = int8_at_level(kernels, level)
    packed = random_blocks(qtype, rows, cols, seed=rows + n)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n)) * torch.linspace(0.1, 4, cols)
    got = k.matmul(x, packed, qtype, cols, activations=cpu_quant.IntegerActivations(n, planes))
    xq, w = cpu_quant.quantize_activations_reference(x, planes), cpu_quant.dequantize_reference(packed, qtype)
    assert_same_product(got, xq, w)
    reference = cpu_quant.int8_matmul_reference(x, packed, qtype, planes)
    # Q8_0's unsigned codes are q + 128 against an offset of -128 d: its two terms cancel about
    # a hundredfold over long rows, and so does their fp32 rounding.
    tolerance = 1e-4 if qtype == "Q8_0" and cols > COLS else 1e-5
    torch.testing.assert_close(got, reference, rtol=tolerance, atol=tolerance)
    off = (got - reference).abs().max()
    assert (got - cpu_quant.matmul_reference(x, packed, qtype)).abs().max() > 10 * off


@pytest.mark.parametrize("level", INT8_LEVELS, ids=INT8_IDS)
def test_integer_products_leave_fewer_rows_and_k_formats_on_fp32(kernels, level: int) -> None:
    k = int8_at_level(kernels, level)
    x = torch.randn(7, COLS, generator=torch.Generator().manual_seed(3))
    q41, q4k = random_blocks("Q4_1", 12), random_blocks("Q4_K", 12)
    assert torch.equal(k.matmul(x, q41, "Q4_1", COLS, activations=cpu_quant.IntegerActivations(8, 2)),
                       k.matmul(x, q41, "Q4_1", COLS))
    assert torch.equal(k.matmul(x, q4k, "Q4_K", COLS, activations=cpu_quant.IntegerActivations(2, 1)),
                       k.matmul(x, q4k, "Q4_K", COLS))


def test_integer_linear_past_the_kernel_rows_equals_reference(kernels) -> None:
    """A fused projection of a Q4_1 and a Q8_0 part (each into its column slice) with a bias:
    with integer activations, a prompt of more than MAX_KERNEL_ROWS rows multiplies them
    instead of a de-quantized weight; a Q4_K part keeps the fp32 product."""
    if kernels.int8_level == 0:
        pytest.skip("this CPU has no VNNI int8 products")
    parts = [QuantizedWeight("Q4_1", random_blocks("Q4_1", 9), COLS),
             QuantizedWeight("Q8_0", random_blocks("Q8_0", 6), COLS),
             QuantizedWeight("Q4_K", random_blocks("Q4_K", 5), COLS)]
    bias = torch.randn(20)
    layer = QuantizedLinear(parts, bias)
    layer.activations = cpu_quant.PROMPT_ACTIVATIONS["int8"]
    x = torch.randn(cpu_quant.MAX_KERNEL_ROWS + 3, COLS)
    y = layer(x) - bias
    int8 = torch.cat([cpu_quant.int8_matmul_reference(x, p.packed, p.qtype) for p in parts[:2]], dim=1)
    torch.testing.assert_close(y[:, :15], int8, rtol=1e-5, atol=1e-4)
    assert_same_product(y[:, 15:], x, cpu_quant.dequantize_reference(parts[2].packed, "Q4_K"))


def test_converted_default_model_stays_quantized_on_disk(model_dir: Path) -> None:
    from safetensors import safe_open

    from structgen.engine.models.loader import packed_formats

    assert (model_dir / "model.safetensors").stat().st_size <= 120 * 2**20
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as st:
        formats = packed_formats(st.metadata())
    assert formats["model.layers.0.mlp.down_proj.weight"] == ("Q4_1", 1536)
    assert formats["model.embed_tokens.weight"] == ("Q8_0", 576)


PROMPTS = ["What is the capital of France?", "Give me a JSON object with a name and an age."]


def test_quantized_model_matches_dequantized_model(model_dir: Path, tokenizer) -> None:
    """The default model with packed weights against the same weights de-quantized to fp32
    (fp32 activations on both): logits of a prompt equal up to fp32 summation order, and greedy
    continuations agree."""
    from structgen.engine.engine import Engine
    from structgen.engine.model_runner import ExtendSeq
    from structgen.engine.models.loader import load_model_config
    from structgen.engine.request import Request
    from structgen.engine.sampler import SamplingParams

    cfg = load_model_config(model_dir)
    engines = [Engine(cfg, EngineConfig(device="cpu", max_batch_size=4, max_seq_len=256,
                                        tuning=EngineTuning(quantized_weights=q, prompt_activations="fp32")),
                      model_dir) for q in (True, False)]
    assert isinstance(engines[0].runner.model.layers[0].mlp.down_proj, QuantizedLinear)
    assert not isinstance(engines[1].runner.model.layers[0].mlp.down_proj, QuantizedLinear)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=False) for p in PROMPTS]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    logits = [e.runner.extend([ExtendSeq(0, 0, ids[0], num_logits=len(ids[0]))]) for e in engines]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=2e-3)
    outputs = []
    for e in engines:
        reqs = [Request(p, SamplingParams(max_tokens=8)) for p in ids]
        e.run(reqs)
        outputs.append([r.output_ids for r in reqs])
    assert outputs[0] == outputs[1]
