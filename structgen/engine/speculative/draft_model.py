"""Draft-model drafting: a small model sharing the target's tokenizer guesses the next k
tokens greedily, one batched step per draft position, on its own KV cache.

Two sources of a draft model:
- `from_checkpoint(path, runner)`: any Llama-family checkpoint the loader reads, with the
  target's vocabulary;
- `self_draft(runner, n)`: the target's own first `n` layers followed by its final norm and LM
  head ("early exit"): no extra weights, only an `n`-layer KV cache.

Its KV cache shares the target's page table (a request's draft K/V live in the same pages of
the draft cache's pool). What the draft cache holds is tracked as the token list fed to it, so rejected
drafts, accepted drafts and re-tokenised jump-forward text are all handled alike: the next
proposal re-runs the tokens after the longest prefix still shared with the request.
With a grammar, the draft's logits are masked at every position, so it never drafts a token
the grammar forbids (the matcher is advanced along the draft and rolled back afterwards).

On CUDA each draft step replays a `DecodeGraphs` of the draft model (forward + masked argmax
in two graphs), with every new token as a one-token row, as the target's verify step does.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from structgen.engine.attention import AttentionBatch
from structgen.engine.decode_step import DecodeStep
from structgen.engine.kv_cache import KVCache
from structgen.engine.model_runner import ExtendSeq
from structgen.engine.models.llama import LlamaModel
from structgen.engine.sampler import apply_bitmask_
from structgen.errors import ModelLoadError
from structgen.grammar.backends.base import allocate_bitmask

if TYPE_CHECKING:
    from structgen.engine.model_runner import ModelRunner
    from structgen.engine.request import Request


class EarlyExitModel(LlamaModel):
    """The target's first `num_layers` decoder layers + its final norm and LM head. The
    modules are the target's own (shared, not copied); forward and logits are LlamaModel's."""

    def __init__(self, target: LlamaModel, num_layers: int):
        nn.Module.__init__(self)
        if not 1 <= num_layers < len(target.layers):
            raise ModelLoadError(f"self_draft_layers must be in [1, {len(target.layers) - 1}], got {num_layers}")
        self.config = target.config
        self.embed_tokens = target.embed_tokens
        self.layers = nn.ModuleList(list(target.layers[:num_layers]))
        self.norm = target.norm
        self.lm_head = target.lm_head
        self.rope = target.rope
        self.fused = target.fused  # LlamaModel.head reads it (kernels/gemv.py)
        self.tensor_parallel = None  # self-draft is refused under tensor parallelism (EngineConfig)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


# One draft step's work per request: (request, first position, tokens to run).
Rows = list[tuple["Request", int, list[int]]]


class DraftModelDrafter:
    """Greedy drafts from a small model (see the module docstring)."""

    def __init__(self, model: LlamaModel, kv: KVCache, runner: ModelRunner, grammar_aware: bool = True):
        self.model = model
        self.kv = kv
        self.device = runner.device
        self.grammar_aware = grammar_aware
        self.vocab_size = model.config.vocab_size
        self.fed: dict[int, list[int]] = {}  # req.id -> tokens whose K/V are in the draft cache
        self.forward_passes = 0
        self.graphs = None
        if runner.graphs is not None:  # the target captured graphs: capture the draft's too
            from structgen.engine.cuda_graphs import DecodeGraphs

            owner = SimpleNamespace(model=model, kv=kv, device=self.device, model_config=model.config,
                                    text_vocab_size=runner.text_vocab_size)
            self.graphs = DecodeGraphs(owner, tuple(runner.graphs.batch_sizes), capture=runner.graphs.capture_graphs,
                                       cascade=runner.graphs.cascade)

    @classmethod
    def self_draft(cls, runner: ModelRunner, num_layers: int, grammar_aware: bool = True) -> DraftModelDrafter:
        """Early exit from the target after `num_layers` layers."""
        from dataclasses import replace

        model = EarlyExitModel(runner.model, num_layers)
        cfg = replace(runner.model_config, num_hidden_layers=num_layers)
        kv = KVCache(cfg, runner.kv.pages, runner.dtype, runner.device)
        return cls(model, kv, runner, grammar_aware)

    @classmethod
    def from_checkpoint(cls, path: str | Path, runner: ModelRunner, grammar_aware: bool = True) -> DraftModelDrafter:
        """A separate checkpoint (HF dir, .safetensors or .gguf) with the target's vocabulary."""
        from structgen.engine.kernels import triton_enabled
        from structgen.engine.models.llama import skip_init
        from structgen.engine.models.loader import load_model_config, load_weights, resolve_model

        model_dir = resolve_model(str(path))
        cfg = load_model_config(model_dir)
        if cfg.vocab_size != runner.model_config.vocab_size:
            raise ModelLoadError(
                f"draft model {path} has vocab_size {cfg.vocab_size}, the target {runner.model_config.vocab_size}; "
                "a draft model must share the target's tokenizer"
            )
        with skip_init(runner.dtype), runner.device:
            model = LlamaModel(cfg, max_positions=runner.kv.max_seq_len)
        model.load_hf_weights(load_weights(model_dir, dtype=runner.dtype, device=runner.device))
        model.use_fused_kernels(triton_enabled(runner.device))
        kv = KVCache(cfg, runner.kv.pages, runner.dtype, runner.device)
        return cls(model.eval(), kv, runner, grammar_aware)

    # -- Drafter protocol ---------------------------------------------------------------------
    def propose(self, req: Request, k: int) -> list[int]:
        return self.propose_batch([req], [k])[0]

    @torch.inference_mode()
    def propose_batch(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        drafts: dict[Request, list[int]] = {r: [] for r in reqs}
        walked: dict[Request, int] = {}  # draft tokens each matcher was advanced by
        rows: Rows = []
        for req, k in zip(reqs, ks, strict=True):
            if k <= 0:
                continue
            # Re-run at least the last token: its logits are where the draft starts.
            start = min(common_prefix_len(self.fed.get(req.id, []), req.token_ids), len(req.token_ids) - 1)
            rows.append((req, start, req.token_ids[start:]))
            self.fed[req.id] = list(req.token_ids)
        budget = dict(zip(reqs, ks, strict=True))
        try:
            while rows:
                tokens = self._step(rows)
                next_rows: Rows = []
                for (req, _, _), tok in zip(rows, tokens, strict=True):
                    m = req.matcher if self.grammar_aware else None
                    if m is not None:
                        if not m.accept_token(tok):
                            continue  # nothing allowed (should not happen under the mask)
                        walked[req] = walked.get(req, 0) + 1
                    drafts[req].append(tok)
                    done = m.is_terminated() if m is not None else tok in req.stop_token_ids
                    if len(drafts[req]) < budget[req] and not done:
                        next_rows.append((req, len(req.token_ids) + len(drafts[req]) - 1, [tok]))
                        self.fed[req.id].append(tok)
                rows = next_rows
        finally:
            for req, n in walked.items():
                req.matcher.rollback(n)
        return [drafts[r] for r in reqs]

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """Nothing to do: the next proposal finds the shared prefix itself."""

    def release(self, req: Request) -> None:
        self.fed.pop(req.id, None)

    # -- one draft step ---------------------------------------------------------------------------
    def _masked(self, req: Request) -> bool:
        return self.grammar_aware and req.matcher is not None

    def _step(self, rows: Rows) -> list[int]:
        """Run each request's tokens on the draft model; the (masked) argmax after its last."""
        self.forward_passes += 1
        ends, n = [], 0
        for _, _, toks in rows:
            n += len(toks)
            ends.append(n - 1)
        if self.graphs is not None and self.graphs.bucket(n) is not None:
            seqs = [ExtendSeq(req.slot, start + j, [t]) for req, start, toks in rows for j, t in enumerate(toks)]
            masked = [(req.matcher, e) for (req, _, _), e in zip(rows, ends, strict=True) if self._masked(req)]
            out = self.graphs.run(_DraftStep(seqs, masked))
            return [out[e] for e in ends]
        logits = self._extend(rows)
        masked = [i for i, (req, _, _) in enumerate(rows) if self._masked(req)]
        if masked:
            bitmask = allocate_bitmask(len(masked), self.vocab_size)
            for j, i in enumerate(masked):
                rows[i][0].matcher.fill_bitmask(bitmask, j)
            idx = torch.tensor(masked, device=self.device)
            logits.index_copy_(0, idx, apply_bitmask_(logits.index_select(0, idx), bitmask.to(self.device)))
        return torch.argmax(logits, dim=-1).tolist()

    def _extend(self, rows: Rows) -> torch.Tensor:
        """Eager forward of every request's tokens; logits [len(rows), V] at each one's last."""
        flat: list[int] = []
        last: list[int] = []
        for _, _, toks in rows:
            flat.extend(toks)
            last.append(len(flat) - 1)
        batch = AttentionBatch.build([(r.slot, p, len(t)) for r, p, t in rows], self.kv.pages)
        hidden = self.model(torch.tensor(flat, dtype=torch.long, device=self.device), batch, self.kv)
        if len(last) != hidden.shape[0]:
            hidden = hidden[torch.tensor(last, dtype=torch.long, device=self.device)]
        return self.model.logits(hidden)


class _DraftStep(DecodeStep):
    """Greedy one-token rows of the draft model, each (matcher, row) in `masked` under that
    matcher's grammar mask."""

    def __init__(self, rows: list[ExtendSeq], masked: list[tuple[Any, int]]):
        has_mask = [False] * len(rows)
        for _, row in masked:
            has_mask[row] = True
        super().__init__(rows, [0.0] * len(rows), [0] * len(rows), has_mask)
        self.masked = masked

    def fill_masks(self, bitmask: torch.Tensor) -> None:  # runs while the draft forward computes
        for matcher, row in self.masked:
            matcher.fill_bitmask(bitmask, row)
