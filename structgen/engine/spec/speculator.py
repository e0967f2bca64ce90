"""Speculative decoding inside the engine step: draft before the forward, verify after it.

Per step, for every request whose pending tokens all run this step (a decode step, or the
last chunk of its prompt):

1. `propose`: the drafter guesses up to k tokens. With grammar-aware drafting the guess is
   walked through the request's grammar matcher and cut at the first token the grammar
   forbids (a draft model masks its own logits instead); among a drafter's alternative
   candidates the one the grammar allows furthest wins. The matcher is rolled back after.
2. The engine runs pending + draft tokens in one `extend` with `num_logits = 1 + len(draft)`.
   Jump-forward tokens are part of the pending tokens: a free draft that needs no checking.
3. `verify`: the mask of every draft position is filled by advancing the matcher along the
   draft (then rolled back), applied to the target's rows, and the acceptance rule of
   `verify.py` picks the tokens: exact match for greedy requests, rejection sampling for
   sampled ones. The emitted tokens go through the engine's `_advance` (matcher, stop,
   max_tokens, jump-forward after the last one); the KV cache keeps the accepted prefix
   (`num_cached` moves back over rejected drafts, whose K/V are overwritten later).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from structgen.engine.config import SpeculativeConfig
from structgen.engine.sampler import allocate_bitmask, apply_bitmask_
from structgen.engine.spec import drafter as drafter_hooks
from structgen.engine.spec.drafter import Drafter
from structgen.engine.spec.verify import accept_greedy, accept_sampled, target_probs
from structgen.errors import EngineError

if TYPE_CHECKING:
    from structgen.engine.engine import Engine
    from structgen.engine.request import Request

log = logging.getLogger("structgen.engine")


def build_drafter(config: SpeculativeConfig, engine: Engine) -> Drafter:
    """The drafter `config.method` names."""
    if config.method == "ngram":
        from structgen.engine.spec.ngram import NgramDrafter

        return NgramDrafter(config.ngram_min, config.ngram_max, shared=config.ngram_shared)
    if config.method == "self_draft":
        from structgen.engine.spec.draft_model import DraftModelDrafter

        return DraftModelDrafter.self_draft(engine.runner, config.self_draft_layers, config.grammar_aware)
    if config.method == "draft_model":
        from structgen.engine.spec.draft_model import DraftModelDrafter

        return DraftModelDrafter.from_checkpoint(config.draft_model, engine.runner, config.grammar_aware)
    if not callable(getattr(config.drafter, "propose", None)):
        raise EngineError("SpeculativeConfig.drafter must have a propose(req, k) method")
    return config.drafter


def grammar_prefix_len(req: Request, tokens: list[int]) -> int:
    """How many leading `tokens` the request's grammar accepts (matcher left unchanged)."""
    m = req.matcher
    n = 0
    for t in tokens:
        if m.is_terminated() or not m.accept_token(t):
            break
        n += 1
    if n:
        m.rollback(n)
    return n


class Speculator:
    def __init__(self, engine: Engine, config: SpeculativeConfig):
        self.engine = engine
        self.config = config
        self.drafter = build_drafter(config, engine)
        self._tracked: set[Request] = set()  # requests the drafter may hold state for

    # -- before the forward -------------------------------------------------------------------
    def propose(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        """Draft tokens for each (request, pending tokens run this step) of the batch."""
        self._release_gone()
        ks = [self._budget(req, n) for req, n in batch]
        todo = [i for i, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in batch]
        if not todo:
            return drafts
        reqs = [batch[i][0] for i in todo]
        self._tracked.update(reqs)
        candidates = getattr(self.drafter, "candidates", None)
        if candidates is not None and self.config.grammar_aware:
            proposed = [self._best_candidate(r, candidates(r, ks[i])) for r, i in zip(reqs, todo, strict=True)]
        else:
            proposed = drafter_hooks.propose_all(self.drafter, reqs, [ks[i] for i in todo])
        for req, i, d in zip(reqs, todo, proposed, strict=True):
            drafts[i] = self._cut(req, [int(t) for t in d[: ks[i]]])
        return drafts

    def _budget(self, req: Request, n: int) -> int:
        """Most draft tokens for this request now: 0 unless its logits row is a sampling
        position; never more than max_tokens leaves room for (drafts + the bonus token)."""
        if n != req.num_pending or req.num_cached + n < req.num_prompt:
            return 0
        return max(0, min(self.config.num_draft_tokens, req.params.max_tokens - req.num_output - 1))

    def _best_candidate(self, req: Request, cands: list[list[int]]) -> list[int]:
        if req.matcher is None or not cands:
            return cands[0] if cands else []
        best, best_len = [], -1
        for c in cands:
            n = grammar_prefix_len(req, c)
            if n > best_len:
                best, best_len = c, n
            if n == len(c):
                break
        return best

    def _cut(self, req: Request, draft: list[int]) -> list[int]:
        """Drop what can never be used: tokens after a stop token, and (grammar-aware) tokens
        from the first one the grammar forbids."""
        if req.matcher is not None:
            if self.config.grammar_aware:
                return draft[: grammar_prefix_len(req, draft)]
            return draft
        for j, t in enumerate(draft):
            if t in req.stop_token_ids:
                return draft[: j + 1]
        return draft

    def _release_gone(self) -> None:
        """Aborted or finished requests: let the drafter drop their state."""
        gone = [r for r in self._tracked if r.finished]
        for r in gone:
            self._tracked.discard(r)
            drafter_hooks.release(self.drafter, r)

    # -- after the forward --------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, batch: list[tuple[Request, int]], drafts: list[list[int]]) -> list[Request]:
        """Accept/reject every draft, advance the requests; return those that finished.
        `logits` has 1 + len(draft) rows per request, in batch order."""
        eng = self.engine
        sampling: list[tuple[Request, int, int, list[int]]] = []  # req, first row, cached, draft
        row = 0
        for (req, n), draft in zip(batch, drafts, strict=True):
            req.num_cached += n
            req.stats.forward_passes += 1
            if req.num_cached == len(req.token_ids):
                sampling.append((req, row, req.num_cached, draft))
            row += 1 + len(draft)
        if not sampling:
            return []
        rows = torch.tensor([r + j for _, r, _, d in sampling for j in range(1 + len(d))], device=eng.device)
        logits = logits.index_select(0, rows) if rows.numel() != logits.shape[0] else logits
        self._mask(logits, sampling)
        greedy_tokens = torch.argmax(logits, dim=-1).tolist()
        finished, offset = [], 0
        for req, _, cached, draft in sampling:
            span = slice(offset, offset + 1 + len(draft))
            offset = span.stop
            try:
                if req.params.greedy:
                    emitted = accept_greedy(greedy_tokens[span], draft)
                else:
                    emitted = accept_sampled(target_probs(logits[span], req.params), draft, req.generator)
                accepted = len(emitted) - 1
                req.num_cached = cached + accepted  # K/V of rejected drafts are left to be overwritten
                req.stats.drafted_tokens += len(draft)
                req.stats.accepted_tokens += accepted
                req.stats.verify_steps += 1
                drafter_hooks.notify_verified(self.drafter, req, len(draft), accepted)
                for j, tok in enumerate(emitted):
                    eng._advance(req, tok, jump_forward=j == len(emitted) - 1)
                    if req.finished:
                        break
            except Exception as exc:
                log.exception("request %d failed", req.id)
                req.finish("error", exc if isinstance(exc, EngineError) else EngineError(str(exc)))
            if req.finished:
                eng.scheduler.remove(req)
                eng._notify(req)
                self._tracked.discard(req)
                drafter_hooks.release(self.drafter, req)
                finished.append(req)
        return finished

    def _mask(self, logits: torch.Tensor, sampling: list[tuple[Request, int, int, list[int]]]) -> None:
        """Apply each constrained request's grammar mask at each of its rows, in place. Rows
        after a draft token the grammar forbids stay unmasked: acceptance stops before them."""
        eng = self.engine
        spans, offset = [], 0
        for req, _, _, draft in sampling:
            if req.matcher is not None:
                spans.append((req, offset, draft))
            offset += 1 + len(draft)
        if not spans:
            return
        idx = torch.tensor([o + j for _, o, d in spans for j in range(1 + len(d))], device=eng.device)
        bitmask = allocate_bitmask(idx.numel(), eng.vocab_size)
        r = 0
        for req, _, draft in spans:
            m = req.matcher
            m.fill_bitmask(bitmask, r)
            walked = 0
            for d in draft:
                if not m.accept_token(d):
                    break
                walked += 1
                if m.is_terminated():  # a drafted stop token: nothing follows it
                    break
                m.fill_bitmask(bitmask, r + walked)
            if walked:
                m.rollback(walked)
            r += 1 + len(draft)
        masked = apply_bitmask_(logits.index_select(0, idx), bitmask.to(eng.device, non_blocking=True))
        logits.index_copy_(0, idx, masked)
