"""Phi-3 / Phi-4-mini against transformers' Phi3ForCausalLM on tiny random-weight checkpoints
(CPU, float32): fused qkv / gate_up tensors, partial rotary (3/4 of each head, as Phi-4-mini),
LongRoPE's short factors and attention factor, and Phi-3's sliding window shorter than the
sequence; and the same checkpoint as a llama.cpp `phi3` GGUF."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from llama_cpp_gguf import gguf_writer, greedy_tokens_both_ways, tensor_names

from structgen.engine.models.loader import load_model_config

STEPS = 32
PROMPTS = [[1, 17, 301, 45, 9, 88, 120, 7, 33, 250, 61, 5], [1, 400, 3, 77]]


def tiny_phi3(tmp_path: Path, **overrides) -> tuple[Path, torch.nn.Module]:
    from transformers import Phi3Config, Phi3ForCausalLM

    half = int(32 * overrides.get("partial_rotary_factor", 1.0)) // 2
    g = torch.Generator().manual_seed(3)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
            "long_factor": (2 + 4 * torch.rand(half, generator=g)).tolist(),
            "partial_rotary_factor": overrides.get("partial_rotary_factor", 1.0)}
    cfg = Phi3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     original_max_position_embeddings=64, rope_parameters=rope, pad_token_id=0,
                     bos_token_id=1, eos_token_id=None, tie_word_embeddings=False, **overrides)
    torch.manual_seed(0)
    model = Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.08)
    model.save_pretrained(tmp_path)
    return tmp_path, model


@pytest.mark.parametrize("overrides", [
    {"partial_rotary_factor": 0.75},  # Phi-4-mini
    {"sliding_window": 8},  # Phi-3-mini: every layer windowed
])
def test_greedy_tokens_and_logits_equal_transformers(tmp_path, overrides, greedy_and_logits_match_transformers):
    path, ref = tiny_phi3(tmp_path, **overrides)
    cfg = load_model_config(path)
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.rope_scaling["rope_type"] == "longrope"
    greedy_and_logits_match_transformers(path, ref, PROMPTS, STEPS)


def test_long_factors_take_over_at_the_pretraining_context(tmp_path):
    """Positions from original_max_position_embeddings on rotate with the long factors."""
    from structgen.engine.models.phi3 import PartialRotaryEmbedding

    cfg = load_model_config(tiny_phi3(tmp_path, partial_rotary_factor=0.75)[0])
    rope = PartialRotaryEmbedding(cfg, 128)
    rs, r = cfg.rope_scaling, 24
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    scale = (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(64.0))).sqrt()
    for pos, factors in ((63, rs["short_factor"]), (64, rs["long_factor"]), (100, rs["long_factor"])):
        expected = (pos * base / torch.tensor(factors)).cos() * scale
        assert torch.allclose(rope.cos[pos, : r // 2], expected, atol=1e-5)
    assert (rope.cos[:, r // 2 : 16] == 1).all() and (rope.sin[:, r // 2 : 16] == 0).all()  # not rotated


def write_phi3_gguf(model: torch.nn.Module, out: Path) -> None:
    """The tiny checkpoint as llama.cpp's converter writes a Phi-3 GGUF (llama_cpp_gguf.py), its
    rotary dimensions and LongRoPE factors (as tensors) besides."""
    cfg = model.config
    rope = cfg.rope_parameters
    with gguf_writer(out, "phi3", cfg) as w:
        w.add_rope_dimension_count(int(32 * rope["partial_rotary_factor"]))
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        names = tensor_names("phi3", cfg.num_hidden_layers)
        for name, tensor in model.state_dict().items():
            w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), tensor.float().numpy())
        w.add_tensor("rope_factors_long.weight", torch.tensor(rope["long_factor"]).float().numpy())
        w.add_tensor("rope_factors_short.weight", torch.tensor(rope["short_factor"]).float().numpy())


def test_a_phi3_gguf_converts_to_the_same_model(tmp_path):
    """llama.cpp's `phi3` GGUF (fused tensors, rotary dims, LongRoPE factor tensors) converts
    to a directory our engine runs with transformers' greedy tokens."""
    from structgen.engine.models.loader import resolve_model

    _, ref = tiny_phi3(tmp_path / "hf", partial_rotary_factor=0.75)
    write_phi3_gguf(ref, tmp_path / "tiny-phi3.gguf")
    model_dir = resolve_model(tmp_path / "tiny-phi3.gguf", cache_dir=tmp_path / "cache", progress=False)
    cfg = load_model_config(model_dir)
    assert (cfg.partial_rotary_factor, cfg.original_max_position_embeddings) == (0.75, 64)
    ours, theirs = greedy_tokens_both_ways(model_dir, ref, PROMPTS[0])
    assert ours == theirs


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs CUDA (or TRITON_INTERPRET=1)")
def test_decode_graph_steps_equal_transformers_in_float32(tmp_path, greedy_through_graph_steps):
    """Llama's fused kernels (RoPE + KV write from the permuted partial-rotary table, the
    norm-in-projection GEMVs) and the decode graphs' step on Phi-4-mini's layout: transformers'
    greedy tokens. On the CPU under TRITON_INTERPRET=1 the graph steps run eagerly."""
    path, ref = tiny_phi3(tmp_path, partial_rotary_factor=0.75, sliding_window=8)
    ours = greedy_through_graph_steps(path, PROMPTS, 20)
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert tokens == out[0, len(prompt):].tolist()
