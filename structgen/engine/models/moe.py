"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral (transformers' `Qwen3MoeForCausalLM` and
`MixtralForCausalLM` are the references), Llama's layers with a sparse feed-forward.

Attention, norms, RoPE and the LM head are Llama's (Qwen3-MoE's q/k norms included). In a
sparse layer a router picks each token's top k experts by softmax probability (renormalised
to sum to one where `norm_topk_prob` says, always for Mixtral) and the feed-forward is the
weighted sum of those experts' SwiGLU outputs. Experts are stored stacked, gate and up fused:
`gate_up` [E, 2I, H], `down` [E, H, I]. On CUDA one grouped Triton kernel runs every expert
of a step (kernels/moe.py, fixed shapes: inside the CUDA graphs); elsewhere the torch loop over
the experts a step routes to (`experts_reference`), which the tests compare the kernel to.

A decode step of a few rows is bound by its kernel count, so there a sparse layer runs its two
norms inside the kernels after them, each recomputing its row's norm (`sparse_fused_rows`):
the input norm inside qkv with the q/k norms, RoPE and the KV write (kernels/fused_gemv.py),
the post-attention norm inside both the router's projection (which also writes the residual
stream, the add done once) and the experts' gate_up (which reads that stream). A layer at one
row is then eight kernels: qkv, attention (two), o, router, top-k, gate_up, down (nine where
timing keeps the q/k norms and RoPE in a kernel of their own: `fused_gemv.SPLIT`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from structgen.engine.config import ModelConfig
from structgen.engine.models.llama import FUSED_ROWS, DecoderLayer, LlamaModel, RMSNorm, project

# HF names of a sparse layer's tensors inside `model.layers.N.` in released checkpoints, per
# family: (router, per-expert prefix, gate, up, down).
_EXPERT_NAMES = {
    "Qwen3MoeForCausalLM": ("mlp.gate.weight", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts", "w1", "w3", "w2"),
}
# transformers 5's module names (its state dicts, our GGUF conversions): experts stacked.
STACKED_ROUTER, STACKED_GATE_UP, STACKED_DOWN = "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def experts_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), one matmul per expert a token
    was routed to (its row count is read back: the CPU path, not a graph's)."""
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    for expert in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down[expert]) * weights[token, slot, None]
        out.index_add_(0, token, h)
    return out


class SparseMoE(nn.Module):
    """Router + stacked SwiGLU experts: the feed-forward of a sparse layer.

    The experts, nearly all of the model's bytes, are built on the meta device and get their
    memory from the checkpoint (`MoeModel.load_hf_weights`) or `materialize`: the checkpoint is
    read into memory whole before it is adopted, and a second, empty copy of the experts beside
    it would not fit where the model only just does."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden, device="meta"))
        self.down = nn.Parameter(torch.empty(experts, hidden, inter, device="meta"))
        self.fused = False  # the grouped Triton kernel (kernels/moe.py)

    def materialize(self) -> None:
        """Uninitialised expert memory beside the router, for weights drawn in place."""
        like = self.gate.weight
        for name in ("gate_up", "down"):
            meta = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(meta.shape, dtype=like.dtype, device=like.device)))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights, expert ids), both [tokens, top_k]: the top k experts by softmax
        probability, highest first."""
        logits = project(self.gate, x, self.fused)
        if self.fused:
            from structgen.engine.kernels.moe import route

            return route(logits, self.top_k, self.norm_topk_prob)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.fused:
            from structgen.engine.kernels.moe import grouped_experts

            return grouped_experts(x, ids, weights, self.gate_up, self.down)
        return experts_reference(x, ids, weights, self.gate_up, self.down)

    def norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual) for a few rows, with no norm kernel: the
        router's projection normalises x + residual itself and writes that sum out (the one
        add), and the experts' gate_up kernel reads the sum and normalises it again."""
        from structgen.engine.kernels.fused_gemv import norm_gemv
        from structgen.engine.kernels.moe import InputNorm, grouped_experts, route

        logits, residual = norm_gemv(x, self.gate.weight, norm.weight, norm.eps, residual)
        weights, ids = route(logits, self.top_k, self.norm_topk_prob)
        out = grouped_experts(residual, ids, weights, self.gate_up, self.down, norm=InputNorm(norm.weight, norm.eps))
        return out, residual


def sparse_fused_rows(layer: DecoderLayer, projection_rows: int) -> int:
    """The most rows a step may have for this sparse layer to run its norms inside its kernels
    (module doc): up to `projection_rows`, as many as the fused qkv takes for its size
    (`fused_gemv.rows_for`), and as the experts' pair kernels take (PAIR_MAX pairs); 0 for
    packed projections, block widths that do not divide half a head (without q/k norms,
    whose programs own whole heads) or an odd number of experts (the router's kernel pairs
    its rows)."""
    from structgen.engine.kernels.fused_gemv import rows_for, widths_divide
    from structgen.engine.kernels.moe import PAIR_MAX

    attn, moe = layer.self_attn, layer.mlp
    if not isinstance(attn.qkv_proj, nn.Linear) or moe.gate.weight.shape[0] % 2:
        return 0
    if attn.q_norm is None and not widths_divide(attn.head_dim // 2):
        return 0
    return min(projection_rows, PAIR_MAX // moe.top_k, rows_for(attn.qkv_proj.weight))


class MoeModel(LlamaModel):
    """`LlamaModel` whose sparse layers (`ModelConfig.is_moe_layer`) have a `SparseMoE` as
    their MLP; dense layers keep Llama's."""

    takes_packed_weights = False  # expert tensors are stacked as floats

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__(cfg, max_positions)
        for i, layer in enumerate(self.layers):
            if cfg.is_moe_layer(i):
                layer.mlp = SparseMoE(cfg)  # the dense MLP Llama built is dropped here

    def use_fused_kernels(self, enabled: bool, projection_rows: int = FUSED_ROWS) -> None:
        """Llama's fused kernels and the grouped expert kernel; steps of up to `projection_rows`
        rows run a sparse layer's norms inside its kernels (`sparse_fused_rows`; not in the
        batch-invariant mode, where a row's sums must not depend on its step's row count)."""
        from structgen.engine.kernels import batch_invariant

        super().use_fused_kernels(enabled, projection_rows)
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                fits = enabled and not batch_invariant()
                layer.fused_rows = sparse_fused_rows(layer, projection_rows) if fits else 0

    @torch.no_grad()
    def init_random_weights(self, std: float = 0.02, seed: int = 0) -> None:
        for m in self.modules():
            if isinstance(m, SparseMoE):
                m.materialize()
        super().init_random_weights(std, seed)

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Stack each sparse layer's experts (per-expert or already stacked tensors) and load
        the rest under Llama's names. The expert tensors are taken out of `weights`, so each
        layer's originals are freed once stacked (a large model never holds two copies)."""
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoE):
                self._adopt_experts(layer.mlp, f"model.layers.{i}.", weights)
        super().load_hf_weights(weights)

    def _adopt_experts(self, moe: SparseMoE, prefix: str, weights: dict[str, torch.Tensor]) -> None:
        """Move one sparse layer's router and experts out of `weights` into `moe`."""
        from structgen.errors import ModelLoadError

        router, experts, gate, up, down = _EXPERT_NAMES[self.config.architecture]
        stacked = prefix + STACKED_GATE_UP in weights
        router = STACKED_ROUTER if stacked else router
        missing = f"missing from the {self.config.architecture} checkpoint; pass its complete directory or GGUF"
        for name in (router, STACKED_DOWN) if stacked else (router,):
            if prefix + name not in weights:
                raise ModelLoadError(f"weight {prefix + name!r} {missing}")
        tensors = {"gate": weights.pop(prefix + router)}
        if stacked:
            tensors["gate_up"] = weights.pop(prefix + STACKED_GATE_UP)
            tensors["down"] = weights.pop(prefix + STACKED_DOWN)
        else:
            per_expert = [[f"{prefix}{experts}.{e}.{n}.weight" for n in (gate, up, down)]
                          for e in range(self.config.num_experts)]
            absent = [n for names in per_expert for n in names if n not in weights]
            if absent:
                raise ModelLoadError(f"weight {absent[0]!r} {missing}")
            tensors["gate_up"] = torch.stack([torch.cat([weights.pop(g), weights.pop(u)]) for g, u, _ in per_expert])
            tensors["down"] = torch.stack([weights.pop(d) for _, _, d in per_expert])
        like = moe.gate.weight
        for name, value in tensors.items():
            expected = like.shape if name == "gate" else getattr(moe, name).shape
            if value.shape != expected:
                raise ModelLoadError(f"{prefix}{name} has shape {tuple(value.shape)}, the config says "
                                     f"{tuple(expected)}; the config.json does not match the weights")
            owner, attr = (moe.gate, "weight") if name == "gate" else (moe, name)
            setattr(owner, attr, nn.Parameter(value.to(device=like.device, dtype=like.dtype)))
