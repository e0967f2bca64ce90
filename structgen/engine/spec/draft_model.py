"""Draft-model drafting: a small model sharing the target's tokenizer guesses the next k
tokens greedily, one batched forward per draft position, on its own KV cache.

Two sources of a draft model:
- `from_checkpoint(path, runner)`: any Llama-family checkpoint the loader reads, with the
  target's vocabulary;
- `self_draft(runner, n)`: the target's own first `n` layers followed by its final norm and LM
  head ("early exit"): no extra weights, only an `n`-layer KV cache.

Its KV cache uses the target's slot numbers (a request's draft K/V live in `req.slot` of the
draft cache). What the draft cache holds is tracked as the token list fed to it, so rejected
drafts, accepted drafts and re-tokenised jump-forward text are all handled the same way: the
next proposal re-runs the tokens after the longest prefix still shared with the request.
With a grammar, the draft's logits are masked at every position, so it never drafts a token
the grammar forbids (the matcher is advanced along the draft and rolled back afterwards).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from structgen.engine.attention import AttentionBatch
from structgen.engine.kv_cache import KVCache
from structgen.engine.sampler import allocate_bitmask, apply_bitmask_
from structgen.errors import ModelLoadError

if TYPE_CHECKING:
    from structgen.engine.model_runner import ModelRunner
    from structgen.engine.models.llama import LlamaModel
    from structgen.engine.request import Request


class EarlyExitModel(nn.Module):
    """The target's first `num_layers` decoder layers + its final norm and LM head. The
    modules are the target's own (shared, not copied)."""

    def __init__(self, target: LlamaModel, num_layers: int):
        super().__init__()
        if not 1 <= num_layers < len(target.layers):
            raise ModelLoadError(f"self_draft_layers must be in [1, {len(target.layers) - 1}], got {num_layers}")
        self.config = target.config
        self.embed_tokens = target.embed_tokens
        self.layers = nn.ModuleList(list(target.layers[:num_layers]))
        self.norm = target.norm
        self.lm_head = target.lm_head
        self.rope = target.rope

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv: KVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, self.rope, batch, kv)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class DraftModelDrafter:
    """Greedy drafts from a small model (see the module docstring)."""

    def __init__(self, model: nn.Module, kv: KVCache, device: torch.device, grammar_aware: bool = True):
        self.model = model
        self.kv = kv
        self.device = device
        self.grammar_aware = grammar_aware
        self.vocab_size = model.config.vocab_size
        self.fed: dict[int, list[int]] = {}  # req.id -> tokens whose K/V are in the draft cache
        self.forward_passes = 0

    @classmethod
    def self_draft(cls, runner: ModelRunner, num_layers: int, grammar_aware: bool = True) -> DraftModelDrafter:
        """Early exit from the target after `num_layers` layers."""
        from dataclasses import replace

        model = EarlyExitModel(runner.model, num_layers)
        cfg = replace(runner.model_config, num_hidden_layers=num_layers)
        kv = KVCache(cfg, runner.kv.num_slots, runner.kv.max_seq_len, runner.dtype, runner.device)
        return cls(model, kv, runner.device, grammar_aware)

    @classmethod
    def from_checkpoint(cls, path: str | Path, runner: ModelRunner, grammar_aware: bool = True) -> DraftModelDrafter:
        """A separate checkpoint (HF dir, .safetensors or .gguf) with the target's vocabulary."""
        from structgen.engine.models.llama import LlamaModel, RotaryEmbedding
        from structgen.engine.models.loader import load_model_config, load_weights, resolve_model

        model_dir = resolve_model(str(path))
        cfg = load_model_config(model_dir)
        if cfg.vocab_size != runner.model_config.vocab_size:
            raise ModelLoadError(
                f"draft model {path} has vocab_size {cfg.vocab_size}, the target {runner.model_config.vocab_size}; "
                "a draft model must share the target's tokenizer"
            )
        with torch.device("meta"):
            model = LlamaModel(cfg, max_positions=1)
        model = model.to_empty(device=runner.device).to(runner.dtype)
        model.load_hf_weights(load_weights(model_dir, dtype=runner.dtype, device=runner.device))
        model.rope = RotaryEmbedding(cfg, runner.kv.max_seq_len).to(runner.device)
        kv = KVCache(cfg, runner.kv.num_slots, runner.kv.max_seq_len, runner.dtype, runner.device)
        return cls(model.eval(), kv, runner.device, grammar_aware)

    # -- Drafter protocol ---------------------------------------------------------------------
    def propose(self, req: Request, k: int) -> list[int]:
        return self.propose_batch([req], [k])[0]

    @torch.inference_mode()
    def propose_batch(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        walked = [0] * len(reqs)  # draft tokens each matcher was advanced by
        live, seqs = [], []
        for i, (req, k) in enumerate(zip(reqs, ks, strict=True)):
            if k <= 0:
                continue
            fed = self.fed.get(req.id, [])
            # Re-run at least the last token: its logits are where the draft starts.
            start = min(common_prefix_len(fed, req.token_ids), len(req.token_ids) - 1)
            live.append(i)
            seqs.append((req.slot, start, req.token_ids[start:]))
            self.fed[req.id] = list(req.token_ids)
        try:
            while live:
                logits = self._extend(seqs)
                constrained = [
                    (row, reqs[i].matcher) for row, i in enumerate(live) if self.grammar_aware and reqs[i].matcher
                ]
                if constrained:
                    mask = allocate_bitmask(len(constrained), self.vocab_size)
                    for j, (_, m) in enumerate(constrained):
                        m.fill_bitmask(mask, j)
                    idx = torch.tensor([row for row, _ in constrained], device=self.device)
                    masked = apply_bitmask_(logits.index_select(0, idx), mask.to(self.device, non_blocking=True))
                    logits.index_copy_(0, idx, masked)
                tokens = torch.argmax(logits, dim=-1).tolist()
                next_live, next_seqs = [], []
                for row, i in enumerate(live):
                    req, tok = reqs[i], tokens[row]
                    m = req.matcher if self.grammar_aware else None
                    if m is not None:
                        if not m.accept_token(tok):
                            continue  # nothing allowed (should not happen under the mask)
                        walked[i] += 1
                    drafts[i].append(tok)
                    done = m.is_terminated() if m is not None else tok in req.stop_token_ids
                    if len(drafts[i]) < ks[i] and not done:
                        next_live.append(i)
                        next_seqs.append((req.slot, len(req.token_ids) + len(drafts[i]) - 1, [tok]))
                        self.fed[req.id].append(tok)
                live, seqs = next_live, next_seqs
        finally:
            for i, n in enumerate(walked):
                if n:
                    reqs[i].matcher.rollback(n)
        return drafts

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """Nothing to do: the next proposal finds the shared prefix itself."""

    def release(self, req: Request) -> None:
        self.fed.pop(req.id, None)

    # -- the draft forward ----------------------------------------------------------------------
    def _extend(self, seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """Run each (slot, start, tokens) on the draft model; logits of each one's last token."""
        flat: list[int] = []
        last: list[int] = []
        for _, _, toks in seqs:
            flat.extend(toks)
            last.append(len(flat) - 1)
        batch = AttentionBatch.build([(s, p, len(t)) for s, p, t in seqs], self.device, decode_kernel=self._decode_kernel(seqs))
        hidden = self.model(torch.tensor(flat, dtype=torch.long, device=self.device), batch, self.kv)
        if len(last) != hidden.shape[0]:
            hidden = hidden[torch.tensor(last, dtype=torch.long, device=self.device)]
        self.forward_passes += 1
        return self.model.logits(hidden)

    def _decode_kernel(self, seqs: list[tuple[int, int, list[int]]]) -> bool:
        if self.device.type != "cuda" or any(len(t) != 1 for _, _, t in seqs):
            return False
        from structgen.engine.kernels import decode_attention_available

        return decode_attention_available()
