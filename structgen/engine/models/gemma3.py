"""Gemma 3 (text): the Llama decoder with Gemma's differences, sharing Llama's layers where
they are the same (fused q/k/v and gate/up projections, RoPE table, KV writes, attention).

What differs from Llama (transformers' `Gemma3ForCausalLM` is the reference):
- RMSNorm scales by `(1 + w)`, in float32 before the cast back (`GemmaRMSNorm`);
- each layer norms both sides of attention and of the MLP ("sandwich" norms);
- q and k are RMS-normed per head, queries scaled by `query_pre_attn_scalar ** -0.5`;
- five of every six layers attend through a sliding window with their own RoPE base
  (`rope_local_base_freq`), the others globally with `rope_theta` (and its scaling);
- embeddings are multiplied by sqrt(hidden_size); the MLP is GeGLU (tanh GELU);
- logits may be soft-capped (`final_logit_softcapping`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from structgen.engine.attention import AttentionBatch, attend
from structgen.engine.config import ModelConfig
from structgen.engine.kv_cache import KVCache
from structgen.engine.models.llama import MLP, Attention, RotaryEmbedding, project


class GemmaRMSNorm(nn.Module):
    """`x / rms(x) * (1 + w)`, computed in float32 and cast back once (weights stored as HF
    stores them: zero is the identity)."""

    unit_offset = True  # the `(1 + w)` form, as the fused kernels of kernels/fused.py take it

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.fused = False  # the Triton kernel on CUDA (kernels/fused.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2:
            from structgen.engine.kernels.fused import rms_norm

            return rms_norm(x, self.weight, self.eps, unit_offset=True)[0]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        if self.fused and x.dim() == 2:
            from structgen.engine.kernels.fused import rms_norm

            return rms_norm(x, self.weight, self.eps, residual, unit_offset=True)
        total = x + residual
        return self(total), total


class GemmaAttention(Attention):
    """Llama's attention (its window included) with Gemma's q/k norms and query scale."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        # attend() scales by head_dim ** -0.5; Gemma by query_pre_attn_scalar ** -0.5.
        scalar = cfg.query_pre_attn_scalar or self.head_dim
        self.query_scale = (self.head_dim / scalar) ** 0.5

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: AttentionBatch, kv: KVCache) -> torch.Tensor:
        if self.fused and x.dim() == 2:
            return self._fused_forward(x, rope, batch, kv)
        n = x.shape[0]
        q, k, v = project(self.qkv_proj, x, self.fused).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(n, self.n_heads, self.head_dim))
        k = self.k_norm(k.reshape(n, self.n_kv, self.head_dim))
        q, k = rope(q, batch.positions), rope(k, batch.positions)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        kv.write(self.layer_idx, batch.token_slots, k, v.reshape(n, self.n_kv, self.head_dim))
        out = attend(q, kv.k[self.layer_idx], kv.v[self.layer_idx], batch, self.window)
        return project(self.o_proj, out.reshape(n, self.q_size), self.fused)

    def _fused_forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: AttentionBatch, kv: KVCache) -> torch.Tensor:
        """The CUDA path: Llama's fused q/k norms, RoPE and KV write, then Gemma's query scale."""
        n, i = x.shape[0], self.layer_idx
        q = self.fused_rope_and_cache(project(self.qkv_proj, x, True), rope, batch, kv)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        out = attend(q, kv.k[i], kv.v[i], batch, self.window)
        return project(self.o_proj, out.reshape(n, self.q_size), True)


class GegluMLP(MLP):
    """gate/up fused as in Llama, with tanh-approximated GELU instead of SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2:
            from structgen.engine.kernels.fused import gelu_tanh_mul

            return project(self.down_proj, gelu_tanh_mul(project(self.gate_up_proj, x, True)), True)
        gate, up = project(self.gate_up_proj, x, self.fused).split(self.inter, dim=-1)
        return project(self.down_proj, F.gelu(gate, approximate="tanh") * up, self.fused)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.self_attn = GemmaAttention(cfg, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = GegluMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: AttentionBatch, kv: KVCache) -> torch.Tensor:
        h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, batch, kv))
        h, x = self.pre_feedforward_layernorm.add_forward(h, x)  # norm(x + h), x + h
        return x + self.post_feedforward_layernorm(self.mlp(h))


class Gemma3Model(nn.Module):
    """Decoder stack + LM head with `LlamaModel`'s interface (forward, head, logits,
    use_fused_kernels, load_hf_weights, init_random_weights)."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg, max_positions)
        local = replace(cfg, rope_theta=cfg.rope_local_theta or cfg.rope_theta, rope_scaling=None)
        self.local_rope = RotaryEmbedding(local, max_positions)
        self.fused = False

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv: KVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers scales by sqrt(hidden) rounded to the model dtype; so do we (a Python
        # number: nothing to copy inside a CUDA graph).
        x = x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype).item()
        for layer in self.layers:
            rope = self.rope if layer.self_attn.window is None else self.local_rope
            x = layer(x, rope, batch, kv)
        return self.norm(x)

    def use_fused_kernels(self, enabled: bool, projection_rows: int = 0) -> None:
        """On CUDA: the norms, q/k norms + RoPE + KV write and GeGLU as Triton kernels
        (kernels/fused.py), projections of few rows through the timed GEMVs (kernels/gemv.py)."""
        self.fused = enabled
        for m in self.modules():
            if isinstance(m, (Attention, MLP, GemmaRMSNorm)):
                m.fused = enabled

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits in the model dtype, soft-capped where the config says."""
        logits = project(self.lm_head, hidden, self.fused)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Adopt transformers' Gemma3ForCausalLM names, fusing q/k/v and gate/up."""
        from structgen.errors import ModelLoadError

        def put(param: torch.nn.Parameter, *names: str) -> None:
            missing = [n for n in names if n not in weights]
            if missing:
                raise ModelLoadError(f"weight {missing[0]!r} missing from the Gemma 3 checkpoint; "
                                     "pass a complete Gemma3ForCausalLM directory or GGUF")
            value = torch.cat([weights[n] for n in names]) if len(names) > 1 else weights[names[0]]
            if value.shape != param.shape:
                raise ModelLoadError(f"weight {names[0]!r} has shape {tuple(value.shape)}, the config "
                                     f"says {tuple(param.shape)}; the config.json does not match the weights")
            param.data = value.to(device=param.device, dtype=param.dtype)

        put(self.embed_tokens.weight, "model.embed_tokens.weight")
        put(self.norm.weight, "model.norm.weight")
        if "lm_head.weight" in weights and not self.config.tie_word_embeddings:
            put(self.lm_head.weight, "lm_head.weight")
        else:
            self.lm_head.weight = self.embed_tokens.weight
        for i, layer in enumerate(self.layers):
            p, attn = f"model.layers.{i}.", layer.self_attn
            put(attn.qkv_proj.weight, *(p + f"self_attn.{n}_proj.weight" for n in "qkv"))
            put(attn.o_proj.weight, p + "self_attn.o_proj.weight")
            put(attn.q_norm.weight, p + "self_attn.q_norm.weight")
            put(attn.k_norm.weight, p + "self_attn.k_norm.weight")
            put(layer.mlp.gate_up_proj.weight, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            put(layer.mlp.down_proj.weight, p + "mlp.down_proj.weight")
            for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"):
                put(getattr(layer, norm).weight, p + norm + ".weight")

    @torch.no_grad()
    def init_random_weights(self, std: float = 0.02, seed: int = 0) -> None:
        """Random weights of the real shapes (speed work needs no files); norms the identity."""
        g = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.zero_()
            else:
                p.normal_(0.0, std, generator=g)
