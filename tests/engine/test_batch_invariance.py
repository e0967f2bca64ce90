"""Batch invariance of the kernels (`kernels.use_batch_invariant`): a row's output does not
depend on how many rows share its launch or what they hold, bit for bit.

Like tests/engine/test_kernels.py these run on CUDA, or on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1 python3 -m pytest -m gpu tests/engine/test_batch_invariance.py`), which
executes each program's code with numpy and so checks the reduction order the code fixes. One
thing the interpreter cannot check: its `tl.dot` is numpy's BLAS, whose result for a row depends
on the row's place in the 16-row tile (tensor cores' does not). So on the CPU a row is compared
with itself at the same place in a tile (other rows' contents and the row count changing around
it), and on CUDA with the same row run alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA (or TRITON_INTERPRET=1)"),
]
DEVICE = torch.device("cuda" if CUDA else "cpu")
LOW = torch.bfloat16 if CUDA else torch.float16  # the interpreter mis-computes bf16 dots


@pytest.fixture
def invariant() -> Iterator[None]:
    from structgen.engine.kernels import batch_invariant, use_batch_invariant

    before = batch_invariant()
    use_batch_invariant(True)
    yield
    use_batch_invariant(before)


def alone(x: torch.Tensor, i: int) -> torch.Tensor:
    """Row i of `x` run without the others: alone on CUDA; on the CPU at the same place in its
    16-row tile, the rows before it replaced by other numbers (see the module docstring)."""
    if CUDA:
        return x[i : i + 1]
    other = torch.randn(i % 16 + 1, x.shape[1]).to(x.device, x.dtype)
    other[-1] = x[i]
    return other


@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("n,k,bias", [(40, 96, True), (300, 256, False)])
def test_invariant_gemm_computes_each_row_as_it_would_alone(n, k, bias, dtype):
    """Rows 1..16 (one tile) and past it (17, 40: more tiles): row i of an M-row product equals
    that row's product alone, and the product is right."""
    import torch.nn.functional as F

    from structgen.engine.kernels.gemv import invariant_gemm

    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    x = torch.randn(40, k, generator=g).to(DEVICE, dtype)
    full = invariant_gemm(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert float((full.double() - ref).norm() / ref.norm()) < 1e-2
    for m in (*range(1, 17), 17, 40):
        rows = invariant_gemm(x[:m], w, b)
        for i in range(m):
            single = alone(x, i)
            assert torch.equal(invariant_gemm(single, w, b)[-1], rows[i]), (m, i)


def test_decode_attention_of_a_sequence_is_the_same_in_any_batch(invariant):
    """The split count no longer follows the batch size, and a sequence's attention output is
    the same bits in a batch of 1, 4 or 16 sequences."""
    from structgen.engine.kernels.decode_attention import decode_attention, num_splits_for

    assert len({num_splits_for(b, 8, 2048, DEVICE) for b in range(1, 65)}) == 1
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, max_len, slots_total = 8, 2, 64, 512, 17
    k = torch.randn(slots_total, max_len, kv_heads, dim, generator=g).to(DEVICE, LOW)
    v = torch.randn(slots_total, max_len, kv_heads, dim, generator=g).to(DEVICE, LOW)
    q = torch.randn(16, heads, dim, generator=g).to(DEVICE, LOW)
    slots = torch.randperm(slots_total, generator=g)[:16].to(DEVICE)
    lens = torch.randint(1, max_len + 1, (16,), generator=g).to(DEVICE)
    full = decode_attention(q, k, v, slots, lens)
    for b in (1, 4):
        part = decode_attention(q[:b], k, v, slots[:b], lens[:b])
        assert torch.equal(part, full[:b]), b
    for i in (0, 7, 15):
        one = decode_attention(q[i : i + 1], k, v, slots[i : i + 1], lens[i : i + 1])
        assert torch.equal(one[0], full[i]), i


def test_rms_norm_and_sampler_rows_do_not_depend_on_the_batch():
    """The per-row kernels (one program a row): the norm and the masked argmax."""
    from structgen.engine.kernels.fused import rms_norm
    from structgen.engine.kernels.sampling import sample_tokens

    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 576, generator=g).to(DEVICE, LOW)
    r = torch.randn(16, 576, generator=g).to(DEVICE, LOW)
    w = torch.randn(576, generator=g).to(DEVICE, LOW)
    out, res = rms_norm(x, w, 1e-5, r)
    logits = torch.randn(16, 5000, generator=g).to(DEVICE)
    words = (5000 + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (16, words), generator=g, dtype=torch.int32).to(DEVICE)
    flags, temps = torch.ones(16, dtype=torch.int32, device=DEVICE), torch.zeros(16, device=DEVICE)
    seeds = torch.zeros(16, dtype=torch.int64, device=DEVICE)
    tokens = sample_tokens(logits, bitmask, flags, temps, seeds)
    for i in (0, 5, 15):
        one, one_res = rms_norm(x[i : i + 1], w, 1e-5, r[i : i + 1])
        assert torch.equal(one[0], out[i]) and torch.equal(one_res[0], res[i])
        s = slice(i, i + 1)
        assert sample_tokens(logits[s], bitmask[s], flags[s], temps[s], seeds[s])[0] == tokens[i]


def test_a_verify_steps_rows_get_the_logits_of_one_row_decode_steps(invariant):
    """The whole model in the batch-invariant mode: a token's logits are the same bits whether
    it runs as a one-row decode step or as the first row of a four-row step (a verify step's
    draft rows, or jump-forward's forced rows), and the fused norm projections are off."""
    from structgen.engine.attention import AttentionBatch
    from structgen.engine.config import ModelConfig
    from structgen.engine.kv_cache import KVCache
    from structgen.engine.models.llama import LlamaModel, skip_init

    cfg = ModelConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    with skip_init(LOW):
        model = LlamaModel(cfg, 64).to(DEVICE)
    model.init_random_weights(std=0.05)
    model.use_fused_kernels(True)
    assert [layer.fused_rows for layer in model.layers] == [0, 0]
    kv = KVCache(cfg, num_slots=2, max_seq_len=64, dtype=LOW, device=DEVICE)

    def rows(start: int, ids: list[int]) -> torch.Tensor:
        """The logits of `ids` run as one-token rows at positions start.. of slot 1."""
        batch = AttentionBatch.build([(1, start + j, 1) for j in range(len(ids))], DEVICE, decode_kernel=True)
        return model.logits(model(torch.tensor(ids, device=DEVICE), batch, kv))

    draft = [7, 31, 2, 250]
    with torch.inference_mode():
        rows(0, [5, 17, 42, 8, 99])  # the prompt
        verify = rows(5, draft)  # the pending token and three drafts
        steps = [rows(5 + j, [t])[0] for j, t in enumerate(draft)]  # decoded one at a time
    assert torch.equal(verify[0], steps[0])
    # The later rows sit at other places in their tile than a one-row step's row: checked
    # bit for bit on CUDA only (the module docstring).
    for j in range(1, len(draft)):
        assert torch.equal(verify[j], steps[j]) if CUDA else float((verify[j] - steps[j]).abs().max()) < 1e-2


@pytest.mark.skipif(not CUDA, reason="the real model's steps on the GPU")
def test_speculative_and_jump_forward_outputs_equal_plain_greedy_outputs_on_jme(model_dir, maskbench_dir):
    """The issue's guarantee on 20 JME prompts, one at a time, the default model in bf16 with
    the batch-invariant mode on (the default): n-gram speculation (k = 3), jump-forward and
    both give plain greedy decoding's tokens exactly. And verify steps leave the token gate
    alone (its one-row forward would be wasted ahead of the next verify step)."""
    import json

    from structgen import LLM, JsonSchema
    from structgen.engine.config import EngineConfig, SpeculativeConfig
    from structgen.engine.request import Request
    from structgen.engine.speculative.speculator import Speculator
    from structgen.errors import StructgenError
    from structgen.sampling import SamplingParams

    llm = LLM(model_dir, config=EngineConfig(max_seq_len=2048, max_batch_size=4))
    eng = llm.engine
    assert eng.config.batch_invariant
    cases = []
    for line in (maskbench_dir / "JME.jsonl").read_text().splitlines():
        row = json.loads(line)
        valid = [t["data"] for t in row["tests"] if t["valid"] and isinstance(t["data"], dict)]
        if not valid or not isinstance(row["schema"], dict):
            continue
        try:
            grammar = llm.compile(JsonSchema(row["schema"]))
        except (StructgenError, ValueError, TypeError, RecursionError):
            continue
        text = f"Write this record as JSON.\nSchema: {json.dumps(row['schema'])}\nRecord: {json.dumps(valid[0])}"
        ids = llm.encode_prompt(text)
        if len(ids) <= 1500:
            cases.append((ids, grammar))
        if len(cases) == 20:
            break
    assert len(cases) == 20
    ngram = Speculator(eng, SpeculativeConfig(method="ngram", num_draft_tokens=3))
    ngram.use_tokenizer(llm.tokenizer)

    def outputs(speculator: Speculator | None, jump_forward: bool) -> tuple[list[list[int]], int]:
        """Each prompt's output, and the rows that were not one-row decode steps."""
        eng.speculator = speculator
        done, extra_rows = [], 0
        for ids, grammar in cases:
            req = Request(ids, SamplingParams(max_tokens=96, jump_forward=jump_forward), grammar.matcher(),
                          frozenset(eng.stop_token_ids))
            eng.run([req])
            assert req.finish_reason != "error", req.error
            done.append(req.output_ids)
            extra_rows += req.stats.accepted_tokens + req.stats.forced_tokens
        return done, extra_rows

    plain, _ = outputs(None, False)
    graphs = eng.runner.graphs
    for speculator, jf in ((ngram, False), (None, True), (ngram, True)):
        gate_runs = graphs.gate_runs
        got, extra_rows = outputs(speculator, jf)
        assert extra_rows > 0  # drafts were accepted / text was forced: multi-row steps ran
        if speculator is not None:  # a verify step never runs the token gate's one-row forward
            assert graphs.gate_runs == gate_runs
        differ = [i for i, (a, b) in enumerate(zip(got, plain, strict=True)) if a != b]
        assert not differ, f"speculative={speculator is not None} jump_forward={jf}: prompts {differ} differ"
