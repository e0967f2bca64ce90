"""Configuration dataclasses: what the model is (ModelConfig, read from config.json) and how
the engine runs it (EngineConfig). Plain data; no behaviour beyond parsing and defaults."""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from structgen.errors import InvalidParameterError
from structgen.grammar.native import MAX_GRAMMAR_THREADS
from structgen.sampling import MAX_SEED, check_int, check_number

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's names for a layer's attention


@dataclass
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder, named as in HF `config.json`."""

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # biases on q/k/v (Qwen2's always; Llama's and Qwen3's where the config says)
    attention_output_bias: bool = False  # ... and on the output projection (Llama's and Qwen3's, not Qwen2's)
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    # Gemma 3 (models/gemma3.py): sliding-window layers with their own RoPE base, queries
    # scaled by query_pre_attn_scalar, GeGLU, optional final logit soft-capping.
    layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL; () is all FULL
    sliding_window: int | None = None  # keys a SLIDING layer's query sees, itself included
    rope_local_theta: float | None = None  # RoPE base of the SLIDING layers
    query_pre_attn_scalar: float | None = None  # None: head_dim
    final_logit_softcapping: float | None = None
    hidden_act: str = "silu"
    # Phi-3 / Phi-4-mini (models/phi3.py): RoPE on the first fraction of each head's dims, and
    # LongRoPE's short factors below the pretraining context, long ones from it on.
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # Mixture of experts (models/moe.py: Qwen3-MoE, Mixtral): each token's feed-forward is the
    # routing-weighted sum of its top `num_experts_per_tok` of `num_experts` SwiGLU experts.
    num_experts: int = 0  # 0: every layer dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to one
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP of intermediate_size instead

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def window_of(self, layer: int) -> int | None:
        """The attention window of `layer`, None where it attends to its whole context."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        from structgen.errors import ModelLoadError

        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r}; structgen runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "Gemma3ForCausalLM":
            return cls._gemma3(d)
        if arch == "Phi3ForCausalLM":
            return cls._phi3(d)
        _refuse_unsupported(d, arch)
        config = cls(
            architecture=arch,
            **_shape(d),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(d),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            **_attention_biases(d, arch),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=_id_list(d.get("eos_token_id")),
            **_dense_window(d, arch),
        )
        return config._with_experts(d) if arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM") else config

    @classmethod
    def _gemma3(cls, d: dict[str, Any]) -> ModelConfig:
        """A Gemma 3 text config, in transformers 4's keys (rope_theta, rope_local_base_freq,
        rope_scaling, sliding_window_pattern) or 5's (rope_parameters per layer type)."""
        from structgen.errors import ModelLoadError

        if d.get("attn_logit_softcapping") is not None:
            raise ModelLoadError("attention logit soft-capping (Gemma 2) is not supported; structgen runs "
                                 "Gemma 3 checkpoints, whose config has attn_logit_softcapping null")
        if d.get("attention_bias"):
            raise ModelLoadError("Gemma 3 with attention biases is not supported; structgen runs Gemma 3 "
                                 "checkpoints whose config has attention_bias false")
        n_layers = d["num_hidden_layers"]
        pattern = d.get("sliding_window_pattern", 6)
        types = d.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
        params = d.get("rope_parameters") or {}
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
        scaling = d.get("rope_scaling") or {k: v for k, v in full.items() if k != "rope_theta"} or None
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        return cls(
            architecture="Gemma3ForCausalLM",
            **_shape(d),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=full.get("rope_theta", d.get("rope_theta", 1_000_000.0)),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 131_072),
            tie_word_embeddings=d.get("tie_word_embeddings", True),
            qk_norm=True,
            bos_token_id=d.get("bos_token_id", 2),
            eos_token_id=_id_list(d.get("eos_token_id", 1)),
            layer_types=tuple(types),
            sliding_window=d.get("sliding_window", 4096),
            rope_local_theta=local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0)),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            hidden_act=d.get("hidden_activation") or "gelu_pytorch_tanh",
        )

    @classmethod
    def _phi3(cls, d: dict[str, Any]) -> ModelConfig:
        """A Phi-3 / Phi-4-mini config (fused checkpoints; partial rotary; LongRoPE; Phi-3's
        sliding window on every layer), in transformers 4's or 5's keys."""
        from structgen.errors import ModelLoadError

        rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        kind = "longrope" if kind in ("su", "longrope") else kind
        if kind not in ("default", "longrope"):
            raise ModelLoadError(f"Phi-3 rope type {kind!r} is not supported; structgen runs 'default' and 'longrope'")
        window = d.get("sliding_window")
        original = d.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
        return cls(
            architecture="Phi3ForCausalLM",
            **_shape(d),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=d.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling={**rope, "rope_type": "longrope"} if kind == "longrope" else None,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=_id_list(d.get("eos_token_id")),
            layer_types=(SLIDING,) * d["num_hidden_layers"] if window else (),
            sliding_window=window,
            partial_rotary_factor=d.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)),
            original_max_position_embeddings=original,
        )

    def _with_experts(self, d: dict[str, Any]) -> ModelConfig:
        """This Qwen3-MoE or Mixtral config with its experts: Qwen3-MoE picks dense layers by
        `mlp_only_layers` and `decoder_sparse_step`; Mixtral's layers are all sparse, its
        `intermediate_size` is an expert's and its top-k weights always renormalised."""
        from structgen.errors import ModelLoadError

        qwen = self.architecture == "Qwen3MoeForCausalLM"
        if d.get("sliding_window") and d.get("use_sliding_window", not qwen):
            raise ModelLoadError(f"{self.architecture} with a sliding window is not supported; structgen runs "
                                 "MoE checkpoints whose config has sliding_window null")
        experts = d.get("num_experts") or d.get("num_local_experts") or 0
        if experts < 1 or not d.get("num_experts_per_tok"):
            raise ModelLoadError(f"{self.architecture} config has no experts (num_experts / num_experts_per_tok); "
                                 "pass the checkpoint's own config.json")
        step = d.get("decoder_sparse_step", 1) if qwen else 1
        dense = set(d.get("mlp_only_layers") or []) | {i for i in range(self.num_hidden_layers) if (i + 1) % step}
        return replace(
            self,
            num_experts=experts,
            num_experts_per_tok=d["num_experts_per_tok"],
            moe_intermediate_size=d.get("moe_intermediate_size", self.intermediate_size) if qwen else self.intermediate_size,
            norm_topk_prob=d.get("norm_topk_prob", False) if qwen else True,
            dense_layers=tuple(sorted(dense) if qwen else ()),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _shape(d: dict[str, Any]) -> dict[str, int]:
    """The sizes every family's config.json names alike (head_dim and the KV heads defaulted)."""
    n_heads = d["num_attention_heads"]
    return {
        "vocab_size": d["vocab_size"],
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "num_hidden_layers": d["num_hidden_layers"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": d.get("num_key_value_heads") or n_heads,
        "head_dim": d.get("head_dim") or d["hidden_size"] // n_heads,
    }


# Rope scalings the Llama-layout models implement (models/llama.py's `rope_inv_freq`); Phi-3's
# longrope has its own path.
ROPE_SCALINGS = ("llama3", "linear")


def _rope_scaling(d: dict[str, Any]) -> dict[str, Any] | None:
    """A Llama-layout config's rope scaling, from transformers 4's `rope_scaling` or 5's
    `rope_parameters` (which carries rope_theta too); None for plain rope. A kind the model
    would need and structgen does not compute is refused: ignored, it would give a model that
    runs and answers wrongly."""
    from structgen.errors import ModelLoadError

    params = {k: v for k, v in (d.get("rope_parameters") or {}).items() if k != "rope_theta"}
    scaling = d.get("rope_scaling") or params or None
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind in (None, "default"):
        return None
    max_positions = d.get("max_position_embeddings", 4096)
    if kind == "dynamic" and scaling.get("original_max_position_embeddings", max_positions) >= max_positions:
        return None  # dynamic NTK changes nothing up to there, and the runner caps sequences there
    if kind not in ROPE_SCALINGS:
        raise ModelLoadError(f"rope scaling {kind!r} is not supported: structgen computes "
                             f"{', '.join(map(repr, ROPE_SCALINGS))} scaling for this architecture; a checkpoint "
                             "with rope_scaling null (or one of those) runs")
    return scaling


def _attention_biases(d: dict[str, Any], arch: str) -> dict[str, bool]:
    """Which attention projections carry biases, as transformers builds each architecture:
    Qwen2 q/k/v always; Llama and Qwen3 (dense and MoE) all four where `attention_bias` is true;
    Mistral and Mixtral none (their modules ignore the key). A GGUF's converted config names the
    output projection's apart (`attention_output_bias`): llama.cpp's `llama` files may carry
    q/k/v biases alone."""
    if arch == "Qwen2ForCausalLM":
        qkv, output = True, False
    elif arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        qkv = output = False
    else:
        qkv = output = bool(d.get("attention_bias"))
    return {"attention_bias": qkv, "attention_output_bias": bool(d.get("attention_output_bias", output))}


def _refuse_unsupported(d: dict[str, Any], arch: str) -> None:
    """What a Llama-layout config may name that the model does not compute: an activation other
    than SiLU and the feed-forward's biases (`mlp_bias`). Ignored, either would give a model that
    runs and answers wrongly."""
    from structgen.errors import ModelLoadError

    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"{arch} with hidden_act {act!r} is not supported; structgen runs this architecture "
                             "with hidden_act 'silu'")
    if d.get("mlp_bias"):
        raise ModelLoadError(f"{arch} with mlp_bias true is not supported; structgen runs checkpoints whose "
                             "config has mlp_bias false (as the released ones have)")


def _dense_window(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """Mistral's sliding window (every layer; Mistral 7B v0.1 has 4,096) as the window fields;
    Qwen2 / Qwen3's `use_sliding_window` (windows on some layers only) is refused, not ignored."""
    from structgen.errors import ModelLoadError

    window = d.get("sliding_window")
    if arch == "MistralForCausalLM" and window:
        return {"layer_types": (SLIDING,) * d["num_hidden_layers"], "sliding_window": window}
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and window and d.get("use_sliding_window"):
        raise ModelLoadError(f"{arch} with use_sliding_window true is not supported; structgen runs checkpoints "
                             "whose config has use_sliding_window false (as the released ones have)")
    return {}


def _id_list(ids: int | list[int] | None) -> list[int]:
    return [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))


# -- checks of the engine settings -----------------------------------------------------------
# Each setting is checked when its dataclass is built, so a bad value is an InvalidParameterError
# naming the field, never a raw error from deep inside the engine at load or at the first call.

MAX_DRAFT_TOKENS = 64  # a verify step runs 1 + k rows a request; past this drafts only waste it
MAX_NGRAM = 64  # longest suffix an n-gram drafter matches
MAX_TENSOR_PARALLEL = 1024  # one process (GPU) a rank
MIN_SEQ_LEN = 2  # one prompt token and one generated token
# What `dtype` accepts, and the torch dtype name each stands for.
DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
_CUDA_DEVICE = re.compile(r"cuda(:\d+)?")
_T = TypeVar("_T")


def _check_bools(obj: object, owner: str, names: tuple[str, ...]) -> None:
    """Flags must be real booleans: `jump_forward="no"` is truthy and would turn it on."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            raise InvalidParameterError(f"{owner}.{name} must be True or False, got {value!r}")


def _device_name(device: object) -> str | None:
    """`device` lower-cased where it names one structgen runs on: None, "cpu", "cuda" or
    "cuda:N" (whether that GPU exists is checked when the engine is built)."""
    if device is None:
        return None
    name = device.strip().lower() if isinstance(device, str) else None
    if name is not None and (name == "cpu" or _CUDA_DEVICE.fullmatch(name)):
        return name
    hint = {"gpu": " (for a GPU pass 'cuda')", "mps": " (Apple GPUs are not supported; pass 'cpu')"}.get(name or "", "")
    raise InvalidParameterError(f"EngineConfig.device must be None (auto: 'cuda' if available, else 'cpu'), "
                                f"'cpu', 'cuda' or 'cuda:N', got {device!r}{hint}")


def _dtype_name(dtype: object) -> str | None:
    """`dtype` as the torch name of one of the aliases structgen accepts (None: the device's default)."""
    if dtype is None:
        return None
    name = DTYPE_ALIASES.get(dtype.strip().lower()) if isinstance(dtype, str) else None
    if name is None:
        raise InvalidParameterError(f"EngineConfig.dtype must be None (auto: bfloat16 on CUDA, float32 on the "
                                    f"CPU) or one of {', '.join(map(repr, DTYPE_ALIASES))}, got {dtype!r}")
    return name


def _graph_sizes(sizes: object) -> tuple[int, ...]:
    """`cuda_graph_batch_sizes` as a tuple of positive row counts (a list is accepted)."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, (tuple, list)) or not sizes:
        raise InvalidParameterError("EngineTuning.cuda_graph_batch_sizes must be a non-empty tuple of row counts "
                                    f"(e.g. (1, 2, 4, 8)), got {sizes!r}")
    for size in sizes:
        check_int("each of EngineTuning.cuda_graph_batch_sizes", size, 1, None)
    return tuple(int(s) for s in sizes)


def _built(name: str, value: object, cls: type[_T], default: _T | None) -> _T | None:
    """`value` as a `cls`: itself, `cls(**value)` for a dict, `default` for None; the user may
    write settings as plain data (a JSON file's), so a dict is taken, not refused."""
    if value is None:
        return default
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        _check_field_names(cls, value)
        return cls(**value)
    raise InvalidParameterError(f"{name} must be {cls.__name__}(...) or a dict of its fields, got {value!r}")


def _speculative(value: object) -> SpeculativeConfig | None:
    """`EngineConfig.speculative`: a SpeculativeConfig, a dict of its fields, or a method name
    alone ("ngram"), whose other fields keep their defaults."""
    if isinstance(value, str):
        return SpeculativeConfig(method=value)
    return _built("speculative", value, SpeculativeConfig, None)


def _check_field_names(cls: type, names: Any) -> None:
    """Refuse a name that is no field of `cls`, with the nearest one as a hint."""
    known = [f.name for f in fields(cls) if f.init]
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the fields are {', '.join(known)}"
            raise InvalidParameterError(f"{cls.__name__} has no field {name!r}{hint}")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (structgen/engine/speculative/): a drafter proposes up to
    `num_draft_tokens` tokens per step and the target checks them all in one forward.
    Lossless: greedy requests keep their exact tokens, sampled ones their distribution."""

    method: str = "ngram"  # "ngram" | "draft_model" | "self_draft" | "custom"
    num_draft_tokens: int = 3  # k: most tokens proposed per step
    # Steps of more requests than this run as plain decode steps: with many rows a step is
    # no longer nearly free, and drafts lose more than they earn there (docs/performance.md,
    # "Speculative decoding"). 0: no limit, the draft policy alone decides.
    max_requests: int = 8
    grammar_aware: bool = True  # cut/mask drafts with the request's grammar before verifying
    # n-gram / prompt lookup
    ngram_max: int = 4  # longest suffix n-gram matched against the context
    ngram_min: int = 1  # shortest suffix n-gram tried before giving up
    ngram_shared: bool = False  # also look up finished requests' outputs (a shared pool)
    # draft model ("draft_model": a checkpoint sharing the target's tokenizer; "self_draft":
    # the target's first `self_draft_layers` layers + its LM head, on their own KV cache)
    draft_model: str | None = None
    self_draft_layers: int = 8
    drafter: Any = None  # "custom": any object implementing speculative.drafter.Drafter

    def __post_init__(self) -> None:
        methods = ("ngram", "draft_model", "self_draft", "custom")
        if self.method not in methods:
            raise InvalidParameterError(f"speculative method must be one of {methods}, got {self.method!r}")
        check_int("SpeculativeConfig.num_draft_tokens", self.num_draft_tokens, 1, MAX_DRAFT_TOKENS)
        check_int("SpeculativeConfig.max_requests (0: no limit)", self.max_requests, 0, None)
        check_int("SpeculativeConfig.ngram_min", self.ngram_min, 1, MAX_NGRAM)
        check_int("SpeculativeConfig.ngram_max", self.ngram_max, 1, MAX_NGRAM)
        if self.ngram_min > self.ngram_max:
            raise InvalidParameterError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        check_int("SpeculativeConfig.self_draft_layers", self.self_draft_layers, 1, None)
        _check_bools(self, "SpeculativeConfig", ("grammar_aware", "ngram_shared"))
        if self.draft_model is not None and not isinstance(self.draft_model, (str, os.PathLike)):
            raise InvalidParameterError("SpeculativeConfig.draft_model must be a checkpoint path (str or Path) or "
                                        f"None, got {self.draft_model!r}")
        if self.method == "draft_model" and not self.draft_model:
            raise InvalidParameterError("method='draft_model' needs draft_model= (a checkpoint path)")
        if self.method == "custom" and self.drafter is None:
            raise InvalidParameterError("method='custom' needs drafter= (an object with propose(req, k))")


@dataclass
class EngineTuning:
    """Knobs that tune how fast the engine runs, not what a request may generate: each default
    is the measured best in docs/performance.md. Change one to reproduce a comparison there or
    to fit an unusual host: `EngineConfig(tuning=EngineTuning(...))`."""

    # Row counts captured as decode graphs on CUDA: rows, not requests, since forced, guessed
    # and draft tokens ride as extra rows (docs/performance.md, "Decode step at batch 64").
    # Those up to 4 rows a KV slot are captured (at least 256 with `prefill_in_graphs`).
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    # Prompts run through the decode graphs, a row per token, in chunks of the largest bucket,
    # instead of as eager extends, whose kernel launches set a small model's time to the first
    # token (docs/performance.md, "Prefill and time to first token").
    prefill_in_graphs: bool = True
    # Decode attention reads a prefix every row of a step shares (prefix-cached system prompts)
    # once per block of rows, not once per row (kernels/decode_attention.py, the cascade);
    # False reads it per row, as before, for an A/B (docs/performance.md, "Cascade attention").
    cascade_attention: bool = True
    # Speculative verify steps with a host-side drafter run as a loop of CUDA graphs with the
    # grammar work as host callbacks inside (engine/guided_loop.py; needs the csrc extension);
    # opt-in because it did not beat the usual path (docs/performance.md, "Speculative decoding").
    capturable_guided: bool = False
    # Threads of all grammar work: grammar.native's pool, the backends' own batch fills and the
    # mask prefetch's workers (grammar.batch.GrammarThreads). 0: auto, sized per part from half
    # the cores (docs/performance.md, "Grammar overhead").
    grammar_threads: int = 0
    # When the next step's masks are filled on worker threads during the bookkeeping
    # (grammar/prefetch.py): "auto" times both ways on this host and keeps the faster (off where
    # grammar.native's pool fills the masks), "on" where fills have been costly, "off" never
    # (docs/performance.md, "Grammar overhead").
    mask_prefetch: str = "auto"
    # How tensor-parallel ranks sum a step's activations: "auto", up to 64 rows in one kernel
    # with the norm after it, over memory the GPUs of one host map from each other
    # (kernels/peer_sum.py), larger steps through NCCL; "nccl", every sum through NCCL
    # (docs/performance.md, "Past one GPU").
    tensor_parallel_all_reduce: str = "auto"
    # Quantized weights stay packed and are de-quantized inside the products: GGUF blocks on
    # the CPU (models/quantized.py), GGUF Q4/Q8 and AWQ / GPTQ / FP8 checkpoints as the GPU's
    # int4 / int8 / FP8 weights (models/packed.py); False de-quantizes them at load
    # (docs/performance.md, "Quantized weights on the CPU").
    quantized_weights: bool = True
    # A GGUF's Q4 / Q8 blocks kept packed on CUDA too (int4 / int8 kernels) instead of
    # de-quantized to bf16 at load: off until the packed multi-row GEMM matches its reference
    # on the GPU (docs/performance.md, "Quantized weights on the GPU").
    gguf_packed_on_cuda: bool = False
    # What a prompt's CPU products (a sequence's run of 16+ new tokens in a step; every row of a
    # step past the native step's 64) with GGUF Q4_0 / Q4_1 / Q8_0 weights multiply, where the CPU
    # has VNNI; decode rows, drafts to verify and the LM head stay fp32: "int16", activations rounded per block of 32
    # to 16-bit codes, two int8 dot products each (greedy text as with fp32 activations); "int8",
    # one, as llama.cpp (faster, but greedy text drifts); "fp32", the fp32 kernels
    # (docs/performance.md, "Quantized weights on the CPU").
    prompt_activations: str = "int16"
    # While the engine has work, Python's full (oldest-generation) garbage collections are held
    # off and run once it is idle or every 10 s of work (engine/garbage_collection.py): a full
    # collection in the middle of a burst walks every request's prompt (docs/performance.md,
    # "Serving under load"). False leaves the collector's thresholds alone.
    hold_full_collections: bool = True

    def __post_init__(self) -> None:
        self.cuda_graph_batch_sizes = _graph_sizes(self.cuda_graph_batch_sizes)
        _check_bools(self, "EngineTuning", ("prefill_in_graphs", "cascade_attention", "capturable_guided",
                                            "quantized_weights", "gguf_packed_on_cuda", "hold_full_collections"))
        check_int("EngineTuning.grammar_threads (0: auto)", self.grammar_threads, 0, MAX_GRAMMAR_THREADS)
        if self.mask_prefetch not in ("auto", "on", "off"):
            raise InvalidParameterError(f"mask_prefetch must be 'auto', 'on' or 'off', got {self.mask_prefetch!r}")
        if self.tensor_parallel_all_reduce not in ("auto", "nccl"):
            raise InvalidParameterError("tensor_parallel_all_reduce must be 'auto' or 'nccl', "
                                        f"got {self.tensor_parallel_all_reduce!r}")
        if self.prompt_activations not in ("int16", "int8", "fp32"):
            raise InvalidParameterError(f"prompt_activations must be 'int16', 'int8' or 'fp32', "
                                        f"got {self.prompt_activations!r}")


def device_batch_size(gpu_memory_bytes: int | None) -> int:
    """`EngineConfig.max_batch_size` when it is None, from the GPU's total memory (None: the
    CPU). As vLLM sizes `max_num_seqs`: 1,024 on GPUs of 70 GiB or more, where a burst of a
    thousand requests is admitted at once instead of waiting for 256 slots (TTFT p50 of 1,000
    MaskBench requests 2.6 -> 1.7 s on an H200: docs/performance.md, "Slots by device"); 256
    on smaller GPUs; 64 on the CPU, whose steps grow with every row."""
    if gpu_memory_bytes is None:
        return 64
    return 1024 if gpu_memory_bytes >= 70 * 2**30 else 256


@dataclass
class EngineConfig:
    """How the engine runs a model: the user's choices. Defaults suit one user on a laptop or
    one GPU; `tuning` holds the knobs that change speed only (EngineTuning)."""

    device: str | None = None  # None: "cuda" if available, else "cpu"
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    max_batch_size: int | None = None  # concurrent requests (KV slots); None: by device (device_batch_size)
    max_seq_len: int = 4096  # per-request prompt + output tokens (capped by the model)
    # Requests that may wait for a slot; one more is refused at once with EngineBusyError (a
    # server's 503), so a flood queues neither memory nor minutes of delay without end. None: no bound.
    max_waiting: int | None = None
    kv_cache_memory_fraction: float = 0.5  # of free GPU memory (CPU: of available memory) for the KV pool
    prefill_chunk_tokens: int = 2048  # longest prefill piece scheduled in one step
    use_cuda_graphs: bool = True  # decode/verify graphs on CUDA; ignored on CPU
    jump_forward: bool = True  # append grammar-forced text without a decode step per token
    # A token's logits do not depend on the rows that share its forward (other requests, its
    # own draft or forced tokens), so greedy outputs are the same with or without speculative
    # decoding and in any batch. On the CPU it only keeps products of several rows on float32
    # activations: torch's products there still sum differently per row count
    # (docs/guide/engine-settings.md, "Batch invariance"). Off by
    # default: it costs more than the 5 % budget (docs/performance.md, "Batch invariance").
    batch_invariant: bool = False
    seed: int | None = None
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # "fp8" | "int4": a float checkpoint's projections quantized at load (less memory, fewer
    # bytes per decode step); checkpoints stored quantized (AWQ, GPTQ, FP8, GGUF) need none.
    quantization: str | None = None
    tuning: EngineTuning = field(default_factory=EngineTuning)
    # Ranks the model is split across (engine/parallel.py): each holds 1/N of the heads and
    # MLP width; rank 0 runs the engine and spawns the others (one GPU each), unless torchrun
    # launched them (several hosts: docs/guide/multi-gpu.md).
    tensor_parallel: int = 1
    # Automatic prefix caching: full KV pages of prompts are kept (LRU) and shared, so a
    # request whose prompt starts like an earlier one (a system prompt, a tool catalogue, the
    # previous chat turns) skips prefilling that part (engine/prefix_cache.py).
    prefix_caching: bool = True
    # Size of the KV page pool in tokens (None: a full max_seq_len for every request, no more
    # than kv_cache_memory_fraction of free memory holds). When requests outgrow it,
    # the newest is preempted and recomputed later.
    kv_cache_tokens: int | None = None

    def __post_init__(self) -> None:
        self.device = _device_name(self.device)
        self.dtype = _dtype_name(self.dtype)
        if self.max_batch_size is not None:
            check_int("EngineConfig.max_batch_size (None: sized to the device)", self.max_batch_size, 1, None)
        check_int("EngineConfig.max_seq_len (prompt + output tokens)", self.max_seq_len, MIN_SEQ_LEN, None)
        if self.max_waiting is not None:
            check_int("EngineConfig.max_waiting (None: no bound)", self.max_waiting, 1, None)
        check_number("EngineConfig.kv_cache_memory_fraction", self.kv_cache_memory_fraction, 0.0, 1.0,
                      open_low=True)
        check_int("EngineConfig.prefill_chunk_tokens", self.prefill_chunk_tokens, 1, None)
        _check_bools(self, "EngineConfig", ("use_cuda_graphs", "jump_forward", "batch_invariant", "prefix_caching"))
        if self.seed is not None:
            check_int("EngineConfig.seed", self.seed, 0, MAX_SEED)
        if self.kv_cache_tokens is not None:
            check_int("EngineConfig.kv_cache_tokens (None: sized from kv_cache_memory_fraction)",
                       self.kv_cache_tokens, 1, None)
        self.speculative = _speculative(self.speculative)
        self.tuning = _built("tuning", self.tuning, EngineTuning, EngineTuning())
        if self.quantization not in (None, "fp8", "int4"):
            raise InvalidParameterError(f"quantization must be None, 'fp8' or 'int4', got {self.quantization!r}")
        self._check_tensor_parallel()

    @classmethod
    def coerce(cls, config: EngineConfig | dict[str, Any] | None) -> EngineConfig:
        """`config` as an EngineConfig: None gives the defaults, a dict its fields
        (`LLM(config={"device": "cpu"})`); anything else is refused."""
        return _built("config", config, cls, None) or cls()

    def _check_tensor_parallel(self) -> None:
        check_int("EngineConfig.tensor_parallel", self.tensor_parallel, 1, MAX_TENSOR_PARALLEL)
        if self.tensor_parallel == 1:
            return
        if self.speculative is not None and self.speculative.method == "self_draft":
            raise InvalidParameterError("speculative method 'self_draft' runs the target's own layers, which are "
                                        "split under tensor_parallel > 1; use 'ngram' or 'draft_model'")
        if self.tuning.capturable_guided:
            raise InvalidParameterError("capturable_guided is not supported with tensor_parallel > 1; turn it off")
        if self.quantization is not None:
            raise InvalidParameterError("quantized layers do not split across ranks yet: pass quantization=None "
                                        "with tensor_parallel > 1, or tensor_parallel=1")


# Knobs that were EngineConfig fields: a newcomer following older docs gets the fix, not a
# bare TypeError. The last four became fixed behaviour.
_MOVED_TO_TUNING = frozenset(f.name for f in fields(EngineTuning))
_RETIRED = frozenset({"token_gate", "rehearse_jumps", "draft_held_back", "grammar_workers"})
_dataclass_init = EngineConfig.__init__


@functools.wraps(_dataclass_init)
def _engine_config_init(self: EngineConfig, *args: Any, **kwargs: Any) -> None:
    for name in kwargs:
        if name in _MOVED_TO_TUNING:
            raise InvalidParameterError(f"EngineConfig({name}=...) moved to the tuning knobs: pass "
                                        f"EngineConfig(tuning=EngineTuning({name}=...))")
        if name == "grammar_workers":
            raise InvalidParameterError("EngineConfig(grammar_workers=...) is gone: one setting sizes all "
                                        "grammar threads, EngineConfig(tuning=EngineTuning(grammar_threads=...))")
        if name in _RETIRED:
            raise InvalidParameterError(f"EngineConfig({name}=...) is no longer a setting (it is always on); "
                                        "remove it")
    _check_field_names(EngineConfig, kwargs)
    _dataclass_init(self, *args, **kwargs)


EngineConfig.__init__ = _engine_config_init  # type: ignore[method-assign]

