"""Phi-3 / Phi-4-mini: the Llama decoder with fused checkpoints, partial rotary embeddings and
LongRoPE (transformers' `Phi3ForCausalLM` is the reference).

The checkpoint already stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, the
layouts Llama's layers fuse into at load. Partial rotary (Phi-4-mini rotates the first 3/4 of
each head's dims) is turned into full rotary at load time, so every Llama kernel (RoPE + KV
write, the fused projections) runs it unchanged: the q and k rows of each head are permuted so
that rotated pairs (i, i + r/2) of the first r dims sit at (j, j + D/2) and the rest fill the
other places, and those other places get frequency zero (cos 1, sin 0: untouched). Scores are
unchanged because q and k are permuted alike; values are not permuted.

LongRoPE scales each frequency by `short_factor` below `original_max_position_embeddings` and
by `long_factor` from there on, and cos/sin by the attention factor. The table is per position:
a token's rotation never changes once cached. (transformers instead switches the whole
sequence to the long factors once it passes the pretraining context, re-rotating only new
tokens; the two agree below it.)
"""

from __future__ import annotations

import math

import torch

from structgen.engine.config import ModelConfig
from structgen.engine.models.llama import LlamaModel, RotaryEmbedding


def rotary_dim(cfg: ModelConfig) -> int:
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def head_permutation(cfg: ModelConfig) -> torch.Tensor:
    """New position -> old dim of a head, placing partial-rotary pairs at rotate-half pairs."""
    d, r = cfg.head_dim, rotary_dim(cfg)
    half_pass = (d - r) // 2
    first = list(range(r // 2)) + list(range(r, r + half_pass))
    second = list(range(r // 2, r)) + list(range(r + half_pass, d))
    return torch.tensor(first + second)


class PartialRotaryEmbedding(RotaryEmbedding):
    """The cos/sin table of the permuted layout: rotary frequencies (LongRoPE-scaled) on the
    first r/2 pair places, zero on the rest, cos/sin of the rotated dims times the attention
    factor."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        torch.nn.Module.__init__(self)
        d, r = cfg.head_dim, rotary_dim(cfg)
        base = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, base)
        scale = 1.0
        rs = cfg.rope_scaling or {}
        if rs.get("rope_type") == "longrope":
            original = rs.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
            short = base / torch.tensor(rs["short_factor"], dtype=torch.float32)
            long = base / torch.tensor(rs["long_factor"], dtype=torch.float32)
            freqs = torch.outer(positions, short)
            freqs[original:] = torch.outer(positions[original:], long)
            factor = rs.get("factor") or cfg.max_position_embeddings / original
            scale = rs.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
        pairs = torch.zeros(max_positions, d // 2)
        pairs[:, : r // 2] = freqs
        emb = torch.cat([pairs, pairs], dim=-1)
        rotated = torch.cat([torch.arange(d // 2) < r // 2] * 2)  # places holding rotated dims
        cos = torch.where(rotated, emb.cos() * scale, torch.ones(()))
        sin = torch.where(rotated, emb.sin() * scale, torch.zeros(()))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)


class Phi3Model(LlamaModel):
    """`LlamaModel` with the permuted partial-rotary table and Phi-3's checkpoint names."""

    takes_packed_weights = False  # its fused tensors are split and permuted as floats

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__(cfg, max_positions)
        if cfg.partial_rotary_factor != 1.0 or cfg.rope_scaling:
            self.rope = PartialRotaryEmbedding(cfg, max_positions)

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Split Phi-3's fused tensors into Llama's names (q/k rows permuted per head for the
        partial-rotary layout) and load those."""
        from structgen.errors import ModelLoadError

        cfg = self.config
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        perm = head_permutation(cfg) if cfg.partial_rotary_factor != 1.0 else None
        out = dict(weights)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            for fused in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"):
                if p + fused not in weights:
                    raise ModelLoadError(f"weight {p + fused!r} missing from the Phi-3 checkpoint; pass a complete "
                                         "Phi3ForCausalLM directory")
            q, k, v = out.pop(p + "self_attn.qkv_proj.weight").split([q_size, kv_size, kv_size])
            if perm is not None:
                q = q.view(cfg.num_attention_heads, cfg.head_dim, -1)[:, perm].reshape(q_size, -1)
                k = k.view(cfg.num_key_value_heads, cfg.head_dim, -1)[:, perm].reshape(kv_size, -1)
            out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = q, k
            out[p + "self_attn.v_proj.weight"] = v
            gate, up = out.pop(p + "mlp.gate_up_proj.weight").chunk(2)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        super().load_hf_weights(out)
