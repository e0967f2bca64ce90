"""The dense Llama-layout families against transformers on tiny random-weight checkpoints (CPU,
float32): Llama 3 (its rope scaling), Llama with linear scaling and Llama with attention biases
(`attention_bias`: q/k/v and the output projection), Mistral (a sliding window), Qwen2 (q/k/v
biases), Qwen3 (per-head q/k norms; with and without attention biases) give transformers' greedy tokens and logits; and each as
llama.cpp's converter writes its GGUF (`llama` with q/k rows permuted, `qwen2`, `qwen3`)
converts to the same model. On a GPU, each in bf16 through the CUDA graphs as well."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from llama_cpp_gguf import gguf_writer, greedy_tokens_both_ways, tensor_names

from structgen.engine.models.loader import load_model_config, resolve_model

STEPS = 32
PROMPTS = [[1, 17, 301, 45, 9, 88, 120, 7, 33, 250, 61, 5], [1, 400, 3, 77]]
SHAPE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "bos_token_id": 1, "eos_token_id": None, "tie_word_embeddings": False}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def tiny(family: str, path: Path, window: int | None = 8) -> torch.nn.Module:
    """A tiny random checkpoint of `family` saved to `path`, its weights far from uniform so a
    wrong layout changes the tokens; Mistral's `window` on every layer (v0.1's; None: v0.2's)."""
    import transformers

    if family == "llama3":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, rope_parameters=LLAMA3_ROPE))
    elif family == "llama-bias":  # attention_bias: biases on q/k/v and on the output projection
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, attention_bias=True))
    elif family == "llama-linear":  # linear rope scaling (extended-context fine-tunes)
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, rope_parameters=rope))
    elif family == "mistral":  # a window shorter than the sequence
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPE, sliding_window=window))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE))
    else:  # head_dim as Qwen3-0.6B's, wider than hidden / heads; "qwen3-bias": all four projections biased
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=32,
                                                                       attention_bias=family == "qwen3-bias"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.08)
    model.eval().save_pretrained(path)
    return model


def write_gguf(model: torch.nn.Module, out: Path, arch: str, extra: Callable[[Any], object] | None = None) -> None:
    """The checkpoint as llama.cpp's converter writes it (llama_cpp_gguf.py), the `llama`
    architecture's q/k rows in interleaved rotary pairs; `extra(writer)` adds metadata."""
    cfg = model.config
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    with gguf_writer(out, arch, cfg, head_dim=head_dim) as w:
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        if extra is not None:
            extra(w)
        names = tensor_names(arch, cfg.num_hidden_layers)
        for name, tensor in model.state_dict().items():
            kind = name.split(".")[-2]
            if arch == "llama" and kind in heads:  # rotate-half rows to interleaved pairs
                rows = tensor.shape[0]
                tensor = tensor.reshape(heads[kind], 2, rows // heads[kind] // 2, -1).swapaxes(1, 2).reshape(tensor.shape)
            w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())


@pytest.mark.parametrize("family,architecture", [
    ("llama3", "LlamaForCausalLM"), ("llama-linear", "LlamaForCausalLM"), ("llama-bias", "LlamaForCausalLM"),
    ("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
    ("qwen3-bias", "Qwen3ForCausalLM")])
def test_greedy_tokens_and_logits_equal_transformers(tmp_path, family, architecture,
                                                     greedy_and_logits_match_transformers):
    ref = tiny(family, tmp_path)
    cfg = load_model_config(tmp_path)
    assert cfg.architecture == architecture
    assert cfg.attention_bias == (family in ("qwen2", "llama-bias", "qwen3-bias"))
    assert cfg.attention_output_bias == family.endswith("-bias") and cfg.qk_norm == family.startswith("qwen3")
    assert [cfg.window_of(i) for i in range(3)] == [8 if family == "mistral" else None] * 3
    greedy_and_logits_match_transformers(tmp_path, ref, PROMPTS, STEPS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama3", "llama-bias", "mistral", "qwen2", "qwen3", "qwen3-bias"])
def test_cuda_graphs_in_bf16_match_eager_and_transformers(tmp_path, family, bf16_graphs_match_eager_and_transformers):
    """On the device in bf16, each family through the CUDA graphs, the fused projections and
    the decode kernel (its attention biases, the output projection's included; Mistral's
    window): greedy tokens equal the eager path's, and the logits are within bf16 tolerance of
    transformers'."""
    model = tiny(family, tmp_path / "hf")
    bf16_graphs_match_eager_and_transformers(tmp_path / "hf", model, PROMPTS, STEPS)


@pytest.mark.parametrize("family,arch", [("mistral", "llama"), ("llama-bias", "llama"), ("qwen2", "qwen2"),
                                         ("qwen3", "qwen3")])
def test_a_gguf_converts_to_the_same_model(tmp_path, family, arch):
    """llama.cpp's GGUF of each family (Mistral v0.2+ as `llama`, its q/k permuted, a Llama with
    attention biases too; Qwen2 with its biases; Qwen3 with its q/k norms, neither permuted)
    converts to a directory our engine runs with transformers' greedy tokens."""
    ref = tiny(family, tmp_path / "hf", window=None)  # llama.cpp keeps no window for Mistral
    write_gguf(ref, tmp_path / f"tiny-{family}.gguf", arch)
    model_dir = resolve_model(tmp_path / f"tiny-{family}.gguf", cache_dir=tmp_path / "cache", progress=False)
    cfg = load_model_config(model_dir)
    assert cfg.attention_bias == (family in ("qwen2", "llama-bias")) and cfg.qk_norm == (family == "qwen3")
    assert cfg.attention_output_bias == (family == "llama-bias")
    ours, theirs = greedy_tokens_both_ways(model_dir, ref, PROMPTS[0])
    assert ours == theirs


def test_a_llama_gguf_with_q_k_v_biases_alone_runs_them(tmp_path):
    """A `llama` GGUF may carry q/k/v biases without an output bias (which an HF Llama config
    cannot say): the conversion names the two apart, and the model equals a Llama whose output
    bias is zero."""
    ref = tiny("llama-bias", tmp_path / "hf")
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.o_proj.bias.zero_()
    no_output_bias = {k: v for k, v in ref.state_dict().items() if not k.endswith("o_proj.bias")}

    class Checkpoint:  # what write_gguf reads: the config and the tensors llama.cpp would write
        config = ref.config

        @staticmethod
        def state_dict() -> dict[str, torch.Tensor]:
            return no_output_bias

    write_gguf(Checkpoint, tmp_path / "tiny-qkv-bias.gguf", "llama")
    model_dir = resolve_model(tmp_path / "tiny-qkv-bias.gguf", cache_dir=tmp_path / "cache", progress=False)
    cfg = load_model_config(model_dir)
    assert cfg.attention_bias and not cfg.attention_output_bias
    ours, theirs = greedy_tokens_both_ways(model_dir, ref, PROMPTS[0])
    assert ours == theirs


def test_mistral_and_mixtral_ignore_attention_bias_as_transformers_does():
    """transformers builds Mistral's and Mixtral's attention without biases whatever the config
    says (a key some exported configs carry), Qwen2's q/k/v always with them."""
    from structgen.engine.config import ModelConfig

    base = {**SHAPE, "attention_bias": True}
    for arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        cfg = ModelConfig.from_dict({**base, "architectures": [arch], "num_local_experts": 4, "num_experts_per_tok": 2})
        assert not cfg.attention_bias and not cfg.attention_output_bias
    cfg = ModelConfig.from_dict({**SHAPE, "architectures": ["Qwen2ForCausalLM"]})
    assert cfg.attention_bias and not cfg.attention_output_bias


def test_rope_scaling_is_read_from_either_key_and_unknown_kinds_are_refused():
    """transformers 5 writes the scaling into `rope_parameters` (with rope_theta beside it), 4 into
    `rope_scaling`; dynamic NTK is plain rope up to max_position_embeddings, where the runner caps
    sequences; a kind the model does not compute (YaRN, LongRoPE outside Phi-3) is refused, not
    ignored: ignored, the model would run and answer wrongly."""
    from structgen.engine.config import ModelConfig
    from structgen.errors import ModelLoadError

    base = {"architectures": ["LlamaForCausalLM"], **SHAPE, "head_dim": 16, "eos_token_id": 2}
    v5 = ModelConfig.from_dict({**base, "rope_parameters": LLAMA3_ROPE})
    v4 = ModelConfig.from_dict({**base, "rope_theta": 500000.0,
                                "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}})
    assert v5.rope_scaling == v4.rope_scaling and v5.rope_theta == v4.rope_theta == 500000.0
    assert ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}).rope_scaling is None
    assert ModelConfig.from_dict({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}}).rope_scaling is None
    for scaling in ({"rope_type": "yarn", "factor": 4.0}, {"type": "longrope", "factor": 2.0},
                    {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}):
        with pytest.raises(ModelLoadError, match=f"rope scaling '{scaling.get('rope_type', scaling.get('type'))}'"):
            ModelConfig.from_dict({**base, "rope_scaling": scaling})


def test_a_gguf_with_yarn_rope_scaling_is_refused(tmp_path):
    """A `qwen2` GGUF whose metadata names YaRN scaling (as long-context Qwen2.5 GGUFs do) is
    refused with the reason, not converted without it."""
    import gguf

    from structgen.errors import ModelLoadError

    ref = tiny("qwen2", tmp_path / "hf")
    path = tmp_path / "yarn.gguf"
    write_gguf(ref, path, "qwen2", extra=lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
                                                    w.add_rope_scaling_factor(4.0)))
    with pytest.raises(ModelLoadError, match="rope scaling 'yarn'"):
        resolve_model(path, cache_dir=tmp_path / "cache", progress=False)


def test_qwen_layer_windows_are_refused():
    """Qwen2 / Qwen3's `use_sliding_window` windows only some layers: refused with the reason."""
    from structgen.engine.config import ModelConfig
    from structgen.errors import ModelLoadError

    d = {"architectures": ["Qwen2ForCausalLM"], **SHAPE, "eos_token_id": 2, "sliding_window": 4096}
    assert ModelConfig.from_dict(d).layer_types == ()  # released configs: use_sliding_window false
    with pytest.raises(ModelLoadError, match="use_sliding_window"):
        ModelConfig.from_dict({**d, "use_sliding_window": True})


@pytest.mark.parametrize("flags,message", [({"mlp_bias": True}, "mlp_bias true"),
                                           ({"hidden_act": "gelu"}, "hidden_act 'gelu'")])
def test_what_the_model_does_not_compute_is_refused(tmp_path, flags, message):
    """A Llama checkpoint with biases on the feed-forward, or another activation, is refused with
    the reason: loaded without them it ran and answered wrongly."""
    import transformers

    from structgen.errors import ModelLoadError

    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, **flags)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=message):
        load_model_config(tmp_path)
