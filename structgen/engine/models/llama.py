"""One readable Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3).

The model runs a *flat* batch of new tokens (prefill chunks, decode tokens, forced or drafted
tokens of many requests, concatenated) so linear layers never compute padding; only attention
needs to know which request a token belongs to, and that lives in `AttentionBatch`.
Projections are fused (qkv, gate+up) at load time: fewer, larger matmuls. On CUDA the small
element-wise stages (residual add + RMSNorm, RoPE + KV write, SiLU * up) run as the fused
Triton kernels of `kernels/fused.py` (`LlamaModel.use_fused_kernels`): a decode step of a
small model is bound by its kernel count, not its bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from structgen.engine.attention import AttentionBatch, attend
from structgen.engine.config import ModelConfig
from structgen.engine.kernels.cpu_decode import CpuDecoder, DecoderLayerWeights, DecoderShape
from structgen.engine.kernels.cpu_quant import IntegerActivations
from structgen.engine.kv_cache import KVCache
from structgen.engine.models import cpu_decoding
from structgen.engine.models.quantized import (
    QUANTIZED_LINEARS,
    QuantizedWeight,
    adopt_linear,
    cat_rows,
    quantized_embedding,
)

if TYPE_CHECKING:
    from structgen.engine.kernels.fused import HeadNorms
    from structgen.engine.parallel import TensorParallel

# Steps of up to this many rows run norms inside the projections (fused_gemv.py takes up to
# its MAX_ROWS): at 4 rows they lost to the unfused kernels on every card timed, by up to half
# again on one H100 (docs/performance.md, "Decode step at batch 1").
FUSED_ROWS = 2


class RMSNorm(nn.Module):
    unit_offset = False  # scales by `weight`, not Gemma's `1 + weight` (kernels/fused.py reads it)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2:
            from structgen.engine.kernels.fused import rms_norm

            return rms_norm(x, self.weight, self.eps)[0]
        # Normalise in float32 like the reference implementations, so bf16 runs match them.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        if self.fused:
            from structgen.engine.kernels.fused import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        residual = residual + x
        return self.forward(residual), residual


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 style long-context scaling when configured."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = cfg.rope_scaling or {}
    rtype = rs.get("rope_type", rs.get("type"))
    if rtype == "llama3":
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif rtype == "linear":
        inv_freq = inv_freq / rs["factor"]
    return inv_freq.float()


def project(linear: nn.Linear, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """`linear(x)`, except that products of 1-16 rows take a Triton kernel where it is faster
    than cuBLAS: one row of a small matrix always, the rest where timing says so
    (kernels/gemv.py); in the batch-invariant mode every product takes `gemv.invariant_gemm`.
    Quantized layers choose their own kernels."""
    if fused and x.dim() == 2 and isinstance(linear, nn.Linear):
        from structgen.engine.kernels import batch_invariant, gemv

        if batch_invariant():  # one GEMM form for every row count (kernels/gemv.py)
            return gemv.invariant_gemm(x, linear.weight, linear.bias)
        block = gemv.plan(x.shape[0], linear.weight)
        if block is not None:
            return gemv.gemv(x, linear.weight, linear.bias, block=block)
    return linear(x)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table indexed by absolute position (HF 'rotate_half' layout)."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [N, heads, head_dim]
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_output_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.window = cfg.window_of(layer_idx)  # sliding-window layers (Phi-3's config says so)
        self.fused = False

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: AttentionBatch, kv: KVCache) -> torch.Tensor:
        n = x.shape[0]
        qkv = project(self.qkv_proj, x, self.fused)
        if self.fused and qkv.dim() == 2:
            i = self.layer_idx
            out = attend(self.fused_rope_and_cache(qkv, rope, batch, kv), kv.k[i], kv.v[i], batch, self.window)
            return project(self.o_proj, out.reshape(n, self.q_size), self.fused)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.reshape(n, self.n_heads + self.n_kv, self.head_dim)
        v = v.view(n, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.n_heads, self.n_kv], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        q, k = rope(qk, batch.positions).split([self.n_heads, self.n_kv], dim=1)  # one rotation for q and k
        kv.write(self.layer_idx, batch.token_slots, k, v)
        out = attend(q, kv.k[self.layer_idx], kv.v[self.layer_idx], batch, self.window)
        return self.o_proj(out.reshape(n, self.q_size))

    def fused_rope_and_cache(self, qkv: torch.Tensor, rope: RotaryEmbedding, batch: AttentionBatch,
                             kv: KVCache) -> torch.Tensor:
        """q after RoPE, with k and v written to the cache, in one Triton kernel (kernels/fused.py)
        that also applies the per-head q/k norms (Qwen3, Gemma 3)."""
        from structgen.engine.kernels.fused import rope_and_cache

        i = self.layer_idx
        return rope_and_cache(qkv, batch.positions, batch.token_slots, rope.cos, rope.sin, kv.k[i], kv.v[i],
                              self.n_heads, self.n_kv, self.head_dim, self.head_norms())

    def head_norms(self) -> HeadNorms | None:
        """The per-head q/k norms as the kernels take them; None without them."""
        from structgen.engine.kernels.fused import HeadNorms

        if self.q_norm is None:
            return None
        return HeadNorms(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.unit_offset)

    def norm_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, rope: RotaryEmbedding,
                     batch: AttentionBatch, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual) for a few rows: norm, qkv, the q/k norms
        where the model has them, RoPE and the KV write in one kernel (kernels/fused_gemv.py)."""
        from structgen.engine.kernels.fused_gemv import norm_qkv_rope_gemv

        i, n = self.layer_idx, x.shape[0]
        q, residual = norm_qkv_rope_gemv(
            x, self.qkv_proj.weight, self.qkv_proj.bias, norm.weight, norm.eps, residual, batch.positions,
            batch.token_slots, rope.cos, rope.sin, kv.k[i], kv.v[i], self.n_heads, self.n_kv, self.head_dim,
            head_norms=self.head_norms())
        out = attend(q, kv.k[i], kv.v[i], batch, self.window)
        return project(self.o_proj, out.reshape(n, self.q_size), True), residual


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from structgen.engine.kernels.fused import silu_mul

            return project(self.down_proj, silu_mul(project(self.gate_up_proj, x, True)), True)
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual) for a few rows: norm, gate_up and SiLU * up
        in one kernel."""
        from structgen.engine.kernels.fused_gemv import norm_silu_gemv

        h, residual = norm_silu_gemv(x, self.gate_up_proj.weight, norm.weight, norm.eps, residual)
        return project(self.down_proj, h, True), residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.fused_rows = 0  # steps of up to this many rows take the fused projections
        self.tensor_parallel = None  # this rank's group where the model is sharded (models/sharding.py)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: the ranks' partial sums added up."""
        return x if self.tensor_parallel is None else self.tensor_parallel.all_reduce(x)

    def cpu_decoder_weights(self, kv: KVCache) -> DecoderLayerWeights | None:
        """This layer as the native CPU decoder runs it; None where it is not this file's plain
        layer with packed projections."""
        attn, mlp = self.self_attn, self.mlp
        if (type(self) is not DecoderLayer or type(attn) is not Attention or type(mlp) is not MLP
                or attn.q_norm is not None or self.tensor_parallel is not None
                or {type(self.input_layernorm), type(self.post_attention_layernorm)} != {RMSNorm}):
            return None
        projections = [cpu_decoding.packed_matrix(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(p is None for p in projections) or projections[1].bias is not None:
            return None
        i = attn.layer_idx
        return DecoderLayerWeights(*projections, self.input_layernorm.weight.data, self.post_attention_layernorm.weight.data,
                                   kv.k[i], kv.v[i], attn.window or 0)

    def forward(self, x, rope, batch, kv):
        out, residual = self.forward_residual(x, None, rope, batch, kv)
        return residual + self.reduce(out)

    def forward_residual(self, x, residual, rope, batch, kv):
        """The layer with its output add left to the caller: returns (mlp output, residual
        stream), so the model fuses that add into the next layer's input norm. Under tensor
        parallelism the mlp output is this rank's part, and `x` the last layer's: the sum over
        the ranks is fused into the norm after it (`reduce_add_norm`)."""
        if x.dim() == 2 and x.shape[0] <= self.fused_rows:
            x = x if residual is None else self.reduce(x)
            h, residual = self.self_attn.norm_forward(x, residual, self.input_layernorm, rope, batch, kv)
            h, residual = self.mlp.norm_forward(self.reduce(h), residual, self.post_attention_layernorm)
            return h, residual
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = reduce_add_norm(self.tensor_parallel, x, residual, self.input_layernorm)
        h, residual = reduce_add_norm(self.tensor_parallel, self.self_attn(h, rope, batch, kv), residual,
                                      self.post_attention_layernorm)
        return self.mlp(h), residual


def reduce_add_norm(tensor_parallel: TensorParallel | None, x: torch.Tensor, residual: torch.Tensor,
                    norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), where `x` is first summed over the ranks of a split
    model: in one kernel with the add and the norm where the GPUs map each other's memory
    (kernels/peer_sum.py), else NCCL's sum and then the norm."""
    if tensor_parallel is None:
        return norm.add_forward(x, residual)
    peer_sum = tensor_parallel.peer_sum
    if peer_sum is not None and peer_sum.fits(x):
        return peer_sum.sum_add_norm(x, residual, norm.weight, norm.eps, norm.unit_offset)
    return norm.add_forward(tensor_parallel.all_reduce(x), residual)


class LlamaModel(nn.Module):
    """Decoder stack + LM head. `forward` returns hidden states of every new token; call
    `logits` only on the rows whose next-token distribution is needed."""

    # `load_hf_weights` takes packed GGUF weights (`QuantizedWeight`) on the CPU.
    takes_packed_weights = True
    # (its KV cache, the native CPU decoder over it): a class default, so models that share another's
    # modules without running this __init__ (speculative/draft_model.py) have it too.
    _cpu_decoder: tuple[KVCache, CpuDecoder | None] | None = None
    # What the native step's products of several rows multiply (quantized.use_integer_activations).
    cpu_activations: IntegerActivations | None = None
    # The last `use_fused_kernels` arguments: `load_hf_weights` applies them again, since which
    # layers may fuse depends on what their projections hold (packed weights never fuse).
    fused_setting: tuple[bool, int] | None = None

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg, max_positions)
        self.fused = False  # Triton kernels and timed GEMVs (use_fused_kernels)
        self.tensor_parallel = None  # this rank's group where the model is sharded (models/sharding.py)

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv: KVCache) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        decoder = self.cpu_decoder(kv) if cpu_decoding.runs_natively(x, batch) else None
        if decoder is not None:
            rows = cpu_decoding.decode_rows(batch, self.rope, kv)
            return self.norm(decoder.run(x.contiguous(), rows, integer_rows=cpu_decoding.prompt_rows(batch)))
        for layer in self.layers:
            x, residual = layer.forward_residual(x, residual, self.rope, batch, kv)
        return reduce_add_norm(self.tensor_parallel, x, residual, self.norm)[0]

    def cpu_decoder(self, kv: KVCache) -> CpuDecoder | None:
        """The native CPU step of this model over `kv` (kernels/cpu_decode.py; steps of up to
        `cpu_decoding.MAX_NATIVE_ROWS` rows), built on first use for each cache; None where the
        model's layers are not all eligible."""
        if self._cpu_decoder is None or self._cpu_decoder[0] is not kv:
            self._cpu_decoder = (kv, self._build_cpu_decoder(kv))
        return self._cpu_decoder[1]

    def _build_cpu_decoder(self, kv: KVCache) -> CpuDecoder | None:
        """Eligible: the plain layers of this file (RMSNorm, rotate-half RoPE, SiLU-gated MLP, no
        per-head q/k norms, no tensor parallelism), every projection packed in one GGUF format,
        fp32 activations and cache."""
        from structgen.engine.kernels import cpu_quant

        kernels = cpu_quant.load()
        if (kernels is None or type(self.rope) is not RotaryEmbedding or self.tensor_parallel is not None
                or kv.k[0].dtype != torch.float32 or self.norm.weight.dtype != torch.float32):
            return None
        layers = [layer.cpu_decoder_weights(kv) for layer in self.layers]
        if any(w is None for w in layers):
            return None
        a, mlp = self.layers[0].self_attn, self.layers[0].mlp
        shape = DecoderShape(self.config.hidden_size, a.n_heads, a.n_kv, a.head_dim, mlp.inter, self.norm.eps)
        return CpuDecoder(kernels, shape, layers, self.cpu_activations)

    def use_fused_kernels(self, enabled: bool, projection_rows: int = FUSED_ROWS) -> None:
        """Route norms, RoPE + KV write and SiLU * up through the Triton kernels (CUDA); steps
        of up to `projection_rows` rows run them inside the projections (fused_gemv.py), except
        in the batch-invariant mode (a row's numbers would depend on its step's row count).
        Dense layers with per-head q/k norms (Qwen3) stay unfused: with them the fused qkv runs
        one program a head (fewer, longer programs); a mixture of experts, whose layers are
        bound by their kernel count, takes that form (models/moe.py)."""
        from structgen.engine.kernels import batch_invariant

        self.fused_setting = (enabled, projection_rows)
        for m in self.modules():
            if hasattr(m, "fused"):
                m.fused = enabled
            if isinstance(m, DecoderLayer):
                m.fused_rows = 0
                dense = isinstance(m.self_attn.qkv_proj, nn.Linear) and isinstance(
                    getattr(m.mlp, "gate_up_proj", None), nn.Linear)  # not packed, not experts (MoE)
                plain = dense and m.self_attn.q_norm is None
                if enabled and projection_rows and plain and not batch_invariant():  # fused rows sum differently
                    from structgen.engine.kernels.fused_gemv import max_rows

                    m.fused_rows = min(projection_rows, max_rows(m.mlp.gate_up_proj.weight, m.self_attn.head_dim))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits in the model dtype (gathered from every rank's vocabulary shard)."""
        logits = project(self.lm_head, hidden, self.fused)
        if self.tensor_parallel is not None:
            logits = self.tensor_parallel.gather_vocab(logits, self.config.vocab_size)
        return logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor | QuantizedWeight]) -> None:
        """Adopt HF-named weights, fusing q/k/v and gate/up. Tensors are assigned, not copied
        into preallocated parameters: one pass over the weights instead of two. Quantized
        weights (CPU) replace their layers by the quantized ones of models/quantized.py."""
        from structgen.errors import ModelLoadError

        def take(name: str) -> torch.Tensor | QuantizedWeight:
            if name not in weights:
                raise ModelLoadError(f"weight {name!r} missing from checkpoint")
            return weights[name]

        def put(param: torch.nn.Parameter, value: torch.Tensor) -> None:
            if value.shape != param.shape:
                raise ModelLoadError(f"weight shape {tuple(value.shape)} != expected {tuple(param.shape)}")
            param.data = value.to(device=param.device, dtype=param.dtype)

        self._adopt_embeddings(take("model.embed_tokens.weight"), weights.get("lm_head.weight"))
        put(self.norm.weight, take("model.norm.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            adopt_linear(attn, "qkv_proj", cat_rows([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if attn.qkv_proj.bias is not None:
                put(attn.qkv_proj.bias, torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            adopt_linear(attn, "o_proj", take(p + "self_attn.o_proj.weight"))
            if attn.o_proj.bias is not None:
                put(attn.o_proj.bias, take(p + "self_attn.o_proj.bias"))
            if attn.q_norm is not None:
                put(attn.q_norm.weight, take(p + "self_attn.q_norm.weight"))
                put(attn.k_norm.weight, take(p + "self_attn.k_norm.weight"))
            if isinstance(layer.mlp, MLP):  # another feed-forward (models/moe.py) is its model's to load
                adopt_linear(layer.mlp, "gate_up_proj", cat_rows([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
                adopt_linear(layer.mlp, "down_proj", take(p + "mlp.down_proj.weight"))
            put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"))
            put(layer.post_attention_layernorm.weight, take(p + "post_attention_layernorm.weight"))
        if self.fused_setting is not None:  # weights adopted after the kernels were chosen
            self.use_fused_kernels(*self.fused_setting)

    def _adopt_embeddings(self, embed: torch.Tensor | QuantizedWeight, lm_head: torch.Tensor | QuantizedWeight | None) -> None:
        """The token embedding and the LM head (the embedding itself when tied)."""
        tied = self.config.tie_word_embeddings or lm_head is None
        if not isinstance(embed, torch.Tensor):
            self.embed_tokens = quantized_embedding(embed, self.norm.weight.dtype)
            if tied:
                adopt_linear(self, "lm_head", embed)
        else:
            adopt_linear(self, "embed_tokens", embed)  # nn.Embedding's weight is [vocab, hidden] too
            if tied:
                self.lm_head.weight = self.embed_tokens.weight
        if not tied:
            adopt_linear(self, "lm_head", lm_head)

    @torch.no_grad()
    def init_random_weights(self, std: float = 0.02, seed: int = 0) -> None:
        """Random weights of the real shapes, generated in place (speed work needs no files)."""
        g = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=g)


@contextmanager
def skip_init(dtype: torch.dtype) -> Iterator[None]:
    """Build modules without initialising their parameters (they are overwritten by the
    checkpoint or `init_random_weights`), in `dtype`: no wasted pass over the weights and no
    full-precision copy of an 8B model."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters, torch.get_default_dtype()
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters, _ = saved
        torch.set_default_dtype(saved[2])


@dataclass
class ModelShape:
    """Parameter count and bytes read per decode step (the HBM floor's numerator)."""

    params: int
    weight_bytes: int

    @classmethod
    def of(cls, model: LlamaModel) -> ModelShape:
        # The embedding is a row lookup per token; everything else, the LM head included
        # (tied or not), is read whole every decode step.
        ps = [p for n, p in model.named_parameters() if not n.startswith("embed_tokens")]
        if isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is getattr(model.embed_tokens, "weight", None):
            ps.append(model.lm_head.weight)
        quantized = [m for m in model.modules() if isinstance(m, QUANTIZED_LINEARS)]
        n = sum(p.numel() for p in ps) + sum(m.in_features * m.out_features for m in quantized)
        packed = sum(m.weight_bytes for m in quantized)
        return cls(params=n, weight_bytes=packed + sum(p.numel() * p.element_size() for p in ps))
