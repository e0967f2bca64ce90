"""Tensor-parallel sharding of a Llama-family decoder (Megatron layout).

Each rank builds the model from a per-rank `ModelConfig` (`rank_config`: a 1/N share of the
query heads, KV heads and MLP width), so its q/k/v and gate/up projections are the
column-parallel shards and o and down the row-parallel ones, and its KV cache holds its own KV
heads only. `WeightShard` cuts each checkpoint tensor while it is read, so a rank never holds
another rank's weights; `apply_tensor_parallel` then adds the one all-reduce after each
attention and MLP block and swaps in the vocabulary-parallel embedding (each rank holds
`ceil(vocab / N)` rows, padded with zeros) whose LM head's logits are gathered whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from structgen.engine.config import ModelConfig

if TYPE_CHECKING:
    from structgen.engine.parallel import TensorParallel

# Architectures whose model module is models/llama.py's (others keep their own layouts).
SHARDABLE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
COLUMN_PARALLEL = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.")
ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
# A row-parallel projection's bias: rank 0 adds it, the others hold zeros, so the sum of the
# ranks' partial outputs carries it once.
ROW_PARALLEL_BIAS = ("self_attn.o_proj.bias",)
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


def rank_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The shapes one of `world_size` ranks holds; raises where the model does not split."""
    from structgen.errors import InvalidParameterError

    if cfg.architecture not in SHARDABLE_ARCHITECTURES:
        raise InvalidParameterError(
            f"tensor_parallel={world_size}: {cfg.architecture} is not supported under tensor parallelism; "
            f"use tensor_parallel=1 or a model of {', '.join(SHARDABLE_ARCHITECTURES)}")
    sizes = {"attention heads": cfg.num_attention_heads, "KV heads": cfg.num_key_value_heads,
             "intermediate_size": cfg.intermediate_size}
    for what, n in sizes.items():
        if n % world_size:
            fits = [d for d in range(1, cfg.num_key_value_heads + 1)
                    if all(v % d == 0 for v in sizes.values())]
            raise InvalidParameterError(
                f"tensor_parallel={world_size} does not divide the model's {n} {what}; pick a size "
                f"that divides them all: {', '.join(map(str, fits))} (or run replicas instead)")
    return replace(cfg, num_attention_heads=cfg.num_attention_heads // world_size,
                   num_key_value_heads=cfg.num_key_value_heads // world_size,
                   intermediate_size=cfg.intermediate_size // world_size)


def vocab_rows(vocab_size: int, world_size: int) -> int:
    """Rows of the embedding and LM head each rank holds (the last rank's are zero-padded)."""
    return -(-vocab_size // world_size)


@dataclass(frozen=True)
class WeightShard:
    """Which part of each HF-named checkpoint tensor rank `rank` of `world_size` keeps."""

    rank: int
    world_size: int

    def __call__(self, name: str, tensor: Any) -> torch.Tensor:
        """`tensor`'s shard: a safetensors slice (only the shard is read) or a tensor."""
        shape = tensor.get_shape() if hasattr(tensor, "get_shape") else list(tensor.shape)
        if name.endswith(VOCAB_PARALLEL):
            rows = vocab_rows(shape[0], self.world_size)
            part = tensor[self.rank * rows : min((self.rank + 1) * rows, shape[0])]
            return F.pad(part, (0, 0, 0, rows - part.shape[0]))
        if name.endswith(ROW_PARALLEL_BIAS):
            bias = tensor[:]
            return bias if self.rank == 0 else torch.zeros_like(bias)
        split = 0 if any(k in name for k in COLUMN_PARALLEL) else 1 if name.endswith(ROW_PARALLEL) else None
        if split is None:
            return tensor[:]  # norms: every rank holds them whole
        n = shape[split] // self.world_size
        cut = slice(self.rank * n, (self.rank + 1) * n)
        return (tensor[cut] if split == 0 else tensor[:, cut]).contiguous()


class VocabParallelEmbedding(nn.Module):
    """The token embedding's rows [first, first + rows): ids outside embed to zeros and the
    ranks' lookups are summed, so every rank ends with the whole embedding."""

    def __init__(self, rows: int, hidden_size: int, first: int, tensor_parallel: TensorParallel):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.first = first
        self.tensor_parallel = tensor_parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tensor_parallel.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


def apply_tensor_parallel(model: nn.Module, tensor_parallel: TensorParallel) -> None:
    """Make `model` (built from `rank_config`, weights not yet loaded) this rank's shard: the
    vocabulary-parallel embedding and LM head, and an all-reduce after every row-parallel
    projection (models/llama.py, `DecoderLayer.reduce`)."""
    cfg = model.config
    rows = vocab_rows(cfg.vocab_size, tensor_parallel.world_size)
    model.embed_tokens = VocabParallelEmbedding(rows, cfg.hidden_size, tensor_parallel.rank * rows, tensor_parallel)
    model.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)
    model.tensor_parallel = tensor_parallel
    for layer in model.layers:
        layer.tensor_parallel = tensor_parallel
