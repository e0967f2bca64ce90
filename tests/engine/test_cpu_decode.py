"""The native CPU step (kernels/cpu_decode.py) against the model's torch layers: the default
model, packed, two sequences of different lengths, a decode token each (with and without a
sliding window) or several new tokens for one; logits, the greedy token and the K/V written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structgen.engine.attention import AttentionBatch
from structgen.engine.config import EngineConfig
from structgen.engine.engine import Engine
from structgen.engine.model_runner import ExtendSeq, ModelRunner

PROMPTS = ["What is the capital of France?", "Give me a JSON object with a name and an age. Keep it short."]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    from structgen.engine.models.loader import load_model_config

    return Engine(load_model_config(model_dir), EngineConfig(device="cpu", max_batch_size=4, max_seq_len=256), model_dir)


@torch.inference_mode()
def torch_layers_logits(engine: Engine, spans: list[tuple[int, int, int]], tokens: list[int]) -> torch.Tensor:
    """The step through the model's torch layers (what `LlamaModel.forward` runs for a step of
    many rows)."""
    runner = engine.runner
    model, kv = runner.model, runner.kv
    batch = AttentionBatch.build(spans, kv.pages)
    x, residual = model.embed_tokens(torch.tensor(tokens)), None
    for layer in model.layers:
        x, residual = layer.forward_residual(x, residual, model.rope, batch, kv)
    return model.logits(model.norm.add_forward(x, residual)[0])


@pytest.mark.parametrize("window,new_tokens", [(0, (1, 1)), (6, (1, 1)), (0, (3, 1))],
                         ids=["decode", "decode-sliding-window", "verify-rows"])
def test_native_step_equals_the_torch_layers(engine: Engine, tokenizer, window: int, new_tokens: tuple[int, int]) -> None:
    """One step over two sequences after their prompts: a new token each (a decode step), or
    three new tokens for one (drafts to verify: causal among themselves) and one for the other."""
    runner = engine.runner
    model, kv = runner.model, runner.kv
    for layer in model.layers:
        layer.self_attn.window = window or None
    model._cpu_decoder = None  # the decoder takes each layer's window when it is built
    assert model.cpu_decoder(kv) is not None
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    slots = [kv.pages.allocate_slot() for _ in ids]
    for slot, p in zip(slots, ids, strict=True):
        runner.extend([ExtendSeq(slot, 0, p, num_logits=1)])
    new = [tokenizer.encode(" Paris is the capital", add_special_tokens=False)[:new_tokens[0]],
           tokenizer.encode("{", add_special_tokens=False)[:new_tokens[1]]]
    spans = [(slot, len(p), len(t)) for slot, p, t in zip(slots, ids, new, strict=True)]
    for slot, start, n in spans:
        kv.pages.cover(slot, start + n)
    reference = torch_layers_logits(engine, spans, [t for ts in new for t in ts])
    rows = [int(r) for slot, start, n in spans for r in kv.pages.token_slots(slot, start, n)]
    layers = (0, len(model.layers) - 1)
    k_ref = torch.stack([kv.k[i].view(-1, *kv.k[i].shape[2:])[rows].clone() for i in layers])
    native = runner.extend([ExtendSeq(slot, start, t, num_logits=len(t)) for (slot, start, _), t in zip(spans, new, strict=True)])
    k_native = torch.stack([kv.k[i].view(-1, *kv.k[i].shape[2:])[rows] for i in layers])
    torch.testing.assert_close(native, reference, rtol=0, atol=2e-3)
    assert torch.equal(native.argmax(-1), reference.argmax(-1))
    torch.testing.assert_close(k_native, k_ref, rtol=0, atol=1e-4)
    for slot in slots:
        kv.pages.release_slot(slot)


@torch.inference_mode()
def test_native_step_times_its_phases_only_while_profiling(engine: Engine, tokenizer) -> None:
    """`QuantKernels.profile_phases` times a prompt's native step phase by phase (what
    benchmarks/profile_cpu_decode.py prints); once it is off, a step adds nothing."""
    from structgen.engine.kernels import cpu_quant

    runner, kernels = engine.runner, cpu_quant.load()
    ids = tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    slot = runner.kv.pages.allocate_slot()
    kernels.profile_phases(True)
    runner.extend([ExtendSeq(slot, 0, ids, num_logits=1)])
    kernels.profile_phases(False)
    timed = kernels.phase_seconds()
    runner.extend([ExtendSeq(slot, len(ids), ids[:1], num_logits=1)])
    assert set(timed) == set(cpu_quant.PHASES)
    assert all(timed[p] > 0 for p in ("norm", "qkv", "o", "gate_up", "down", "attention", "silu", "start"))
    assert kernels.phase_seconds() == timed
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    seconds = {}
    try:  # each thread of the two is timed on request; a thread past the team's is never
        for thread in (1, 2):
            kernels.profile_phases(True, thread=thread)
            runner.extend([ExtendSeq(slot, 0, ids, num_logits=1)])
            kernels.profile_phases(False)
            seconds[thread] = kernels.phase_seconds()
    finally:
        torch.set_num_threads(previous)
    runner.kv.pages.release_slot(slot)
    assert all(seconds[1][p] > 0 for p in ("qkv", "o", "gate_up", "down", "attention"))
    assert not any(seconds[2].values())


def test_steps_of_many_rows_over_long_contexts_run_the_torch_layers() -> None:
    """The native step attends row by row: an agent turn's tail of 30 new tokens over a 3,000-token
    cached catalogue ran about 2x slower there than through SDPA in the torch layers, while a
    decode row ran faster; drafts to verify take their decode rows' path."""
    from structgen.engine.models.cpu_decoding import FEW_ROWS, LONG_CONTEXT, runs_natively
    from structgen.engine.page_table import PageTable

    pages = PageTable(256, 16, 2, 4096, torch.device("cpu"))
    slot = pages.allocate_slot()
    pages.cover(slot, 3000)

    def native(start: int, n: int) -> bool:
        return runs_natively(torch.zeros(n, 8), AttentionBatch.build([(slot, start, n)], pages))

    assert native(0, 30)  # a short prompt
    assert native(LONG_CONTEXT - 30, 30)  # a prompt's tail within LONG_CONTEXT keys
    assert not native(2970, 30)  # the agent turn's tail
    assert native(2999, 1) and native(2996, FEW_ROWS)  # a decode row over 3,000 keys, and drafts to verify




@torch.inference_mode()
def _runner_with_vnni(model_dir: Path) -> ModelRunner:
    """A CPU engine's runner of the default model, where the CPU has VNNI int8 products (skip)."""
    from structgen.engine.kernels import cpu_quant
    from structgen.engine.models.loader import load_model_config

    kernels = cpu_quant.load()
    if kernels is None or kernels.int8_level == 0:
        pytest.skip("this CPU has no VNNI int8 products")
    config = EngineConfig(device="cpu", max_batch_size=4, max_seq_len=256)
    return Engine(load_model_config(model_dir), config, model_dir).runner


def test_integer_prompt_activations_stay_near_the_fp32_ones(model_dir: Path, tokenizer) -> None:
    """A prompt's native step with its products on 16-bit activations (the default) gives the
    fp32-activation logits to within a few thousandths and the same top tokens; on int8 ones
    the logits move further (rounding flips cascade through the layers) but stay near."""
    from structgen.engine.kernels import cpu_quant
    from structgen.engine.models.quantized import use_integer_activations

    runner = _runner_with_vnni(model_dir)
    ids = tokenizer.encode(" ".join(PROMPTS), add_special_tokens=False)
    assert len(ids) >= cpu_quant.INT8_ROWS and runner.model.cpu_activations is not None

    def prompt_logits(activations: str) -> torch.Tensor:
        use_integer_activations(runner.model, cpu_quant.PROMPT_ACTIVATIONS[activations])
        runner.model._cpu_decoder = None  # rebuilt with these activations
        slot = runner.kv.pages.allocate_slot()
        runner.kv.pages.cover(slot, len(ids))
        logits = runner.extend([ExtendSeq(slot, 0, ids, num_logits=len(ids))])
        runner.kv.pages.release_slot(slot)
        return logits

    fp32, int16, int8 = prompt_logits("fp32"), prompt_logits("int16"), prompt_logits("int8")
    assert 1e-4 < (int16 - fp32).abs().max() < 2e-2
    assert torch.equal(int16.argmax(-1), fp32.argmax(-1))
    diff = (int8 - fp32).abs()
    assert 1e-1 < diff.max() < 3 and diff.mean() < 0.3, (diff.max(), diff.mean())
    assert (int8.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.85


def test_batch_invariant_engines_keep_cpu_products_on_fp32_activations(model_dir: Path) -> None:
    """The batch-invariant mode's promise (a row's logits whatever rows share its step) covers
    the CPU's products of several rows: integer activations, which round a step of 8 rows or
    more differently from a lone row's fp32 product, are off there whatever
    `prompt_activations` asks."""
    from structgen.engine.config import EngineTuning
    from structgen.engine.kernels import use_batch_invariant
    from structgen.engine.models.loader import load_model_config
    from structgen.engine.models.quantized import QuantizedLinear

    def built(invariant: bool) -> torch.nn.Module:
        config = EngineConfig(device="cpu", max_batch_size=2, max_seq_len=128, batch_invariant=invariant,
                              tuning=EngineTuning(prompt_activations="int8"))
        return Engine(load_model_config(model_dir), config, model_dir).runner.model

    try:
        for invariant in (False, True):
            model = built(invariant)
            linears = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m is not model.lm_head]
            assert linears, "the default model's GGUF weights stay packed on the CPU"
            wanted = None if invariant else model.cpu_activations
            assert invariant or wanted is not None
            assert model.cpu_activations is wanted and all(m.activations is wanted for m in linears)
            assert getattr(model.lm_head, "activations", None) is None  # the sampling rows stay fp32
    finally:
        use_batch_invariant(False)


def test_a_decode_row_beside_a_prompt_computes_what_it_computes_alone(model_dir: Path, tokenizer) -> None:
    """With integer prompt activations (the default), one native step of another request's
    23-token prompt and a decode row gives the decode row the logits it gets alone, bit for
    bit, and the prompt's rows those of the prompt alone: only a prompt's rows round their
    activations, so a request's numbers do not follow what runs beside it."""
    runner = _runner_with_vnni(model_dir)
    prompt = tokenizer.encode(" ".join(PROMPTS), add_special_tokens=False)
    context = prompt[:5]
    pages = runner.kv.pages
    fresh, decoding = pages.allocate_slot(), pages.allocate_slot()
    pages.cover(decoding, len(context) + 1)
    pages.cover(fresh, len(prompt))
    runner.extend([ExtendSeq(decoding, 0, context, num_logits=1)])
    decode = ExtendSeq(decoding, len(context), [prompt[7]], num_logits=1)
    whole = ExtendSeq(fresh, 0, prompt, num_logits=len(prompt))
    decode_alone, prompt_alone = runner.extend([decode]), runner.extend([whole])
    together = runner.extend([whole, decode])
    assert runner.model.cpu_activations is not None and len(prompt) >= 16
    assert torch.equal(together[-1:], decode_alone)
    assert torch.equal(together[:-1], prompt_alone)


@torch.inference_mode()
def test_the_native_step_computes_the_same_at_any_thread_count(model_dir: Path, tokenizer) -> None:
    """A prompt's integer-activation rows and a decode row beside them give the same logits and
    write the same keys bit for bit at 1, 2 and 7 threads: the threads' shares of each product
    (at 7, one of the fused qkv's splits moves to a k head's start), of attention's rows and of
    SiLU's rows change where each number is computed, not how."""
    runner = _runner_with_vnni(model_dir)
    kv, pages = runner.kv, runner.kv.pages
    prompt = tokenizer.encode(" ".join(PROMPTS), add_special_tokens=False)
    context = prompt[:5]
    results = []
    for threads in (1, 2, 7):
        fresh, decoding = pages.allocate_slot(), pages.allocate_slot()
        pages.cover(decoding, len(context) + 1)
        pages.cover(fresh, len(prompt))
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            runner.extend([ExtendSeq(decoding, 0, context, num_logits=1)])
            logits = runner.extend([ExtendSeq(fresh, 0, prompt, num_logits=len(prompt)),
                                    ExtendSeq(decoding, len(context), [prompt[7]], num_logits=1)])
        finally:
            torch.set_num_threads(previous)
        rows = [int(r) for r in pages.token_slots(fresh, 0, len(prompt))]
        keys = torch.stack([kv.k[i].view(-1, *kv.k[i].shape[2:])[rows].clone() for i in (0, len(kv.k) - 1)])
        results.append((logits, keys))
        pages.release_slot(fresh)
        pages.release_slot(decoding)
    assert runner.model.cpu_activations is not None and len(prompt) >= 16
    for logits, keys in results[1:]:
        assert torch.equal(logits, results[0][0])
        assert torch.equal(keys, results[0][1])
