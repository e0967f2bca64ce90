"""Gemma 3 against transformers' Gemma3ForCausalLM on a tiny random-weight checkpoint (CPU,
float32): sliding-window layers whose window is shorter than the sequence, a query scale that
is not head_dim, linear RoPE scaling on the global layers and logit soft-capping, so each of
Gemma's differences from Llama changes the tokens if it is wrong."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import pytest
import torch
from pydantic import BaseModel

from structgen.engine.config import EngineConfig
from structgen.engine.engine import Engine
from structgen.engine.model_runner import ExtendSeq
from structgen.engine.models.loader import load_model_config
from structgen.engine.request import Request
from structgen.errors import InvalidParameterError
from structgen.sampling import SamplingParams
from structgen.types import Regex

WINDOW = 8
STEPS = 32
PROMPTS = [[2, 17, 301, 45, 9, 88, 120, 7, 33, 250, 61, 5], [2, 400, 3, 77]]


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        final_logit_softcapping=5.0, max_position_embeddings=256, eos_token_id=1,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms and embeddings far from their init, so each one matters
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)
    path = tmp_path_factory.mktemp("tiny-gemma3")
    model.save_pretrained(path)
    return path, model


def reference_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_config_reads_gemma3_layers(tiny_gemma):
    cfg = load_model_config(tiny_gemma[0])
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert [cfg.window_of(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling["factor"]) == (1e6, 1e4, 2.0)
    assert cfg.query_pre_attn_scalar == 24 and cfg.final_logit_softcapping == 5.0


def test_greedy_tokens_and_logits_equal_transformers(tiny_gemma):
    """32 greedy steps past a window of 8, two prompts batched and prefilled in chunks of 5
    (windowed masks over cached prefixes): the same tokens as transformers, logits close."""
    path, ref = tiny_gemma
    engine = Engine(load_model_config(path), EngineConfig(device="cpu", max_batch_size=2, max_seq_len=128,
                                                          prefill_chunk_tokens=5), path)
    reqs = [Request(p, SamplingParams(max_tokens=STEPS)) for p in PROMPTS]
    engine.run(reqs)
    for prompt, req in zip(PROMPTS, reqs, strict=True):
        assert req.output_ids == reference_greedy(ref, prompt)
    full = PROMPTS[0] + reqs[0].output_ids
    with torch.no_grad():
        expected = ref(torch.tensor([full])).logits[0]
    slot = engine.runner.kv.pages.allocate_slot()
    ours = engine.runner.extend([ExtendSeq(slot, 0, full, num_logits=len(full))])
    engine.runner.kv.pages.release_slot(slot)
    assert torch.allclose(ours, expected, atol=1e-4, rtol=1e-4)


def test_a_window_wider_than_the_sequence_changes_the_logits(tiny_gemma):
    """Negative control: the window is in force (dropping it changes the late positions)."""
    path, _ = tiny_gemma
    cfg = load_model_config(path)
    seq = PROMPTS[0] * 3
    logits = {}
    for window in (WINDOW, 1000):
        cfg.sliding_window = window
        engine = Engine(cfg, EngineConfig(device="cpu", max_batch_size=1, max_seq_len=128), path)
        logits[window] = engine.runner.extend([ExtendSeq(0, 0, seq, num_logits=len(seq))])
    assert torch.allclose(logits[WINDOW][:WINDOW], logits[1000][:WINDOW], atol=1e-5)
    assert not torch.allclose(logits[WINDOW][-1], logits[1000][-1], atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_in_bf16_match_eager_and_transformers(tiny_gemma):
    """On the device in bf16: greedy tokens through the CUDA graphs (decode kernel with the
    window) equal the eager path's, and prefill logits are within bf16 tolerance of
    transformers'."""
    path, ref = tiny_gemma
    outs = {}
    for graphs in (True, False):
        ec = EngineConfig(device="cuda", dtype="bfloat16", max_batch_size=2, max_seq_len=128, use_cuda_graphs=graphs,
                          prefill_in_graphs=False)
        engine = Engine(load_model_config(path), ec, path)
        reqs = [Request(p, SamplingParams(max_tokens=STEPS)) for p in PROMPTS]
        engine.run(reqs)
        outs[graphs] = [r.output_ids for r in reqs]
        full = PROMPTS[0] + outs[graphs][0]
        slot = engine.runner.kv.pages.allocate_slot()
        ours = engine.runner.extend([ExtendSeq(slot, 0, full, num_logits=len(full))])
    assert outs[True] == outs[False]
    hf = ref.to("cuda", torch.bfloat16)
    with torch.no_grad():
        expected = hf(torch.tensor([full], device="cuda")).logits[0].float()
    ref.to("cpu", torch.float32)
    assert float((ours - expected).norm() / expected.norm()) < 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs CUDA (or TRITON_INTERPRET=1)")
def test_decode_graph_steps_equal_transformers_in_float32(tiny_gemma, greedy_through_graph_steps):
    """The decode graphs' step (Triton decode attention with each layer's window, the GEMV
    projections) in float32: transformers' greedy tokens. On the CPU under TRITON_INTERPRET=1
    the graph steps run eagerly."""
    path, ref = tiny_gemma
    ours = greedy_through_graph_steps(path, PROMPTS, 20)
    assert ours == [reference_greedy(ref, p)[:20] for p in PROMPTS]


# ----------------------------------------------------------------------------- the real 270M


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def gemma(gemma_dir: Path):
    from structgen import LLM

    with LLM("gemma-3-270m", config=EngineConfig(device="cpu", max_batch_size=2, max_seq_len=512)) as llm:
        yield llm


def test_gemma_3_270m_fills_a_pydantic_model_on_cpu(gemma):
    """The base model from its package: a raw prompt (it has no chat template) gets its <bos>."""
    city = gemma.generate(City, "Paris is the capital of France. As JSON:", max_tokens=40)
    assert city == City(name="Paris", country="France")
    assert gemma.tokenizer_report.text_vocab_size == 262144


def test_gemma_3_270m_without_a_chat_template_refuses_messages_clearly(gemma):
    with pytest.raises(InvalidParameterError, match="no chat template; pass the prompt as a string with chat=False"):
        gemma.generate(City, [{"role": "user", "content": "Paris?"}], max_tokens=8)


def test_gemma_3_270m_config_from_its_gguf(gemma_dir: Path):
    cfg = load_model_config(gemma_dir)
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.head_dim, cfg.sliding_window) == (262144, 18, 256, 512)
    assert [i for i in range(18) if cfg.window_of(i) is None] == [5, 11, 17]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.eos_token_id) == (1e6, 1e4, [1, 106])


def test_the_gguf_path_resolves_to_the_same_conversion(gemma_dir: Path):
    from structgen.engine.models.loader import gemma3_gguf_path, resolve_model

    assert resolve_model(gemma3_gguf_path(), progress=False) == gemma_dir


@pytest.mark.slow
@pytest.mark.parametrize("output_type,prompt,expected", [
    (Literal["positive", "negative"],
     "Review: 'Terrible and boring.' Sentiment: negative\nReview: 'I love this movie, wonderful!' Sentiment:",
     "positive"),
    (Regex(r"[0-9]{4}"), "World War II ended in", "1945"),
])
def test_gemma_3_270m_typed_examples(gemma, output_type, prompt, expected):
    assert gemma.generate(output_type, prompt, max_tokens=8) == expected


@pytest.mark.slow
def test_gemma_3_270m_greedy_tokens_equal_transformers(gemma, gemma_dir: Path):
    """The real checkpoint: our tokens are transformers' on the same converted directory."""
    from transformers import AutoModelForCausalLM

    text = "Q: What is 2+3?\nA:"
    ours = gemma.complete(str, text, chat=False, max_tokens=16).token_ids
    ref = AutoModelForCausalLM.from_pretrained(str(gemma_dir), dtype=torch.float32).eval()
    assert ours == reference_greedy(ref, gemma.encode_prompt(text, chat=False))[: len(ours)]
