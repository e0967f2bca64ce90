"""Speculative decoding as the engine step: draft, verify every draft in one forward, accept.

Per step, for every request whose pending tokens all run this step (a decode step, or the
last chunk of its prompt):

1. `propose`: the drafter guesses up to k tokens. With grammar-aware drafting the guess is
   walked through the request's grammar matcher and cut at the first token the grammar
   forbids (a draft model masks its own logits instead); among a drafter's alternative
   candidates the one the grammar allows furthest wins. The matcher is rolled back after.
   Jump-forward tokens are already pending: a free draft that needs no checking.
2. One forward runs pending + draft tokens and samples a token at each of the 1 + k sampling
   positions under that position's grammar mask (filled by advancing the matcher along the
   draft while the device computes, then rolled back), with the engine's sampler and noise.
   A verify step is a decode step over *rows*: each token is a one-token row with its own
   slot, position and context length, so when the whole step fits a captured batch size it
   replays the runner's decode CUDA graph (forward + masked sampler); otherwise it is an
   eager `extend` with `num_logits = 1 + k`.
3. `verify.accept_draft` keeps drafts while they equal the target's token (exact match for
   greedy, point-mass rejection sampling for sampled requests; see verify.py). The emitted
   tokens are taken in as the engine's `_advance` takes tokens (matcher, stop, max_tokens;
   jump-forward after the last one), a run of plain ones appended at once (emit.py);
   `num_cached` keeps pending + accepted drafts, the rejected drafts' K/V are overwritten
   later.
4. With a drafter that runs on the host (`host_only`: n-gram) and a step in the decode graphs,
   3 happens inside the graphs' `plan_next`, as soon as the tokens are on the host, followed
   by 1 for the next step (`_plan_next`); that step's verify forward is launched right then,
   and the next `step` reuses those drafts. The device waits for the accept and the draft,
   not for the rest of the step's bookkeeping (docs/performance.md, "Speculative decoding").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from structgen.engine.config import SpeculativeConfig
from structgen.engine.decode_step import DecodeStep
from structgen.engine.model_runner import ExtendSeq
from structgen.engine.sampler import apply_bitmask_, sample, step_seed
from structgen.engine.speculative import drafter as drafter_hooks
from structgen.engine.speculative.drafter import Drafter
from structgen.engine.speculative.emit import emit
from structgen.engine.speculative.policy import DraftPolicy
from structgen.engine.speculative.verify import accept_draft
from structgen.engine.speculative.verify_rows import (
    GraphRows,
    fill_draft_masks,
    graph_rows,
    sampling_spans,
    step_tokens,
    token_rows,
)
from structgen.errors import EngineError
from structgen.grammar.backends.base import allocate_bitmask

if TYPE_CHECKING:
    from structgen.engine.engine import Engine
    from structgen.engine.guided_loop import LoopStep
    from structgen.engine.request import Request

log = logging.getLogger("structgen.engine")


def build_drafter(config: SpeculativeConfig, engine: Engine) -> Drafter:
    """The drafter `config.method` names."""
    if config.method == "ngram":
        from structgen.engine.speculative.ngram import NgramDrafter

        return NgramDrafter(config.ngram_min, config.ngram_max, shared=config.ngram_shared)
    if config.method == "self_draft":
        from structgen.engine.speculative.draft_model import DraftModelDrafter

        return DraftModelDrafter.self_draft(engine.runner, config.self_draft_layers, config.grammar_aware)
    if config.method == "draft_model":
        from structgen.engine.speculative.draft_model import DraftModelDrafter

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


MAX_FAILURES_IN_A_ROW = 16  # drafting steps that raise before the drafter is switched off
LOOP_STEPS = 64  # most verify steps one engine step runs in the capturable mode's loop


class Speculator:
    def __init__(self, engine: Engine, config: SpeculativeConfig):
        self.engine = engine
        self.config = config
        self.drafter = build_drafter(config, engine)
        self._tracked: set[Request] = set()  # requests the drafter may hold state for
        self.drafter_failures = 0  # steps whose drafting raised
        self._failing = 0  # of those, in a row
        self.disabled: str | None = None  # why drafting stopped for good, if it did
        self._planned: tuple[tuple, list[list[int]]] | None = None  # (batch key, drafts) from _plan_next
        # request -> (its length when drafted for, the draft): drafts the policy did not give,
        # checked against the tokens the request emits (`_check_shadows`)
        self._shadows: dict[Request, tuple[int, list[int]]] = {}
        self.capturable = engine.config.tuning.capturable_guided  # verify steps in guided_loop.py's loop
        graphs = engine.runner.graphs
        self.policy = DraftPolicy(tuple(graphs.batch_sizes) if graphs is not None else ())
        self.adaptive = True  # draft lengths from `policy`; False: always the budget (benchmarks)
        # A verify step writes its drafts' K/V past a request's tokens: the scheduler reserves
        # their pages, here, however the speculator came to the engine (benchmarks and tests
        # set one on a built engine, which reserved two positions: a third draft at a new page
        # wrote to the scratch page in the decode graphs and read it back).
        scheduler = engine.scheduler
        scheduler.lookahead = max(scheduler.lookahead, 2 + config.num_draft_tokens)

    def use_tokenizer(self, tokenizer: Any) -> None:
        """Hand the tokenizer to a drafter that can use it (n-gram: space-insensitive matching)."""
        hook = getattr(self.drafter, "use_tokenizer", None)
        if hook is not None:
            hook(tokenizer)

    # -- before the forward -------------------------------------------------------------------
    def propose(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        """Draft tokens for each (request, pending tokens run this step) of the batch. A
        drafter that fails costs this step its drafts, nothing else; one that fails
        MAX_FAILURES_IN_A_ROW steps in a row is switched off (`disabled` says why), rather
        than paying for it, and logging a traceback, on every step."""
        self._release_gone()
        ks = budgets = self._budgets(batch)
        if self.adaptive:  # only the drafts that pay for their rows (policy.py)
            self._check_shadows(batch)
            ks = self.policy.draft_lengths([req for req, _ in batch], budgets, sum(n for _, n in batch))
        drafts: list[list[int]] = [[] for _ in batch]
        if self.disabled is not None:
            return drafts
        if self.adaptive:
            self._draft_unseen(batch, budgets, ks)
        if not any(ks):  # the drafter is asked about nobody
            return drafts
        self.settle_prefetch()
        todo = [i for i, k in enumerate(ks) if k > 0]
        reqs = [batch[i][0] for i in todo]
        self._tracked.update(reqs)
        candidates = getattr(self.drafter, "candidates", None)
        pick = candidates is not None and self.config.grammar_aware  # choose among alternatives
        try:
            if pick:
                proposed = [self._best_candidate(r, candidates(r, ks[i])) for r, i in zip(reqs, todo, strict=True)]
            else:
                proposed = drafter_hooks.propose_all(self.drafter, reqs, [ks[i] for i in todo])
            for req, i, d in zip(reqs, todo, proposed, strict=True):
                drafts[i] = self._cut(req, [int(t) for t in d[: ks[i]]], grammar_checked=pick)
        except Exception as exc:
            self.drafter_failures += 1
            self._failing += 1
            name = type(self.drafter).__name__
            if self._failing >= MAX_FAILURES_IN_A_ROW:
                self.disabled = f"drafter {name} failed {self._failing} steps in a row, last with {exc!r}"
                log.error("%s; speculative decoding is off for this engine", self.disabled)
            else:
                log.exception("drafter %s failed; this step runs without drafts", name)
            return [[] for _ in batch]
        self._failing = 0
        return drafts

    def _draft_unseen(self, batch: list[tuple[Request, int]], budgets: list[int], ks: list[int]) -> None:
        """Draft, without running it, for the requests that could draft and were given none
        where their drafts would pay if accepted: their acceptance rate keeps following their
        text (policy.py). The drafter's first proposal, not cut by the grammar (a token the
        grammar forbids is one the request cannot emit: it scores as rejected, as it would be).
        Only with a drafter that runs on the host (a lookup of microseconds); a failure costs
        nothing but the check."""
        if not getattr(self.drafter, "host_only", False) or all(ks) or not self.policy.could_pay(
                budgets, sum(n for _, n in batch)):
            return
        for (req, _), budget, k in zip(batch, budgets, ks, strict=True):
            if budget > 0 and k == 0 and req not in self._shadows:
                try:
                    draft = [int(t) for t in self.drafter.propose(req, budget)[:budget]]
                except Exception:  # a shadow draft is advice: the real drafting reports failures
                    return
                self._tracked.add(req)
                self._shadows[req] = (len(req.token_ids), draft)

    def _check_shadows(self, batch: list[tuple[Request, int]]) -> None:
        """Score each unseen draft of `batch`'s requests against the tokens emitted since, once
        they differ or the whole draft is covered (a draft of nothing scores as rejected)."""
        for req, _ in batch:
            shadow = self._shadows.get(req)
            if shadow is None:
                continue
            start, draft = shadow
            if len(req.token_ids) < start:  # rolled back past it: no verdict
                del self._shadows[req]
                continue
            emitted = req.token_ids[start : start + len(draft)]
            agree = next((j for j, (a, b) in enumerate(zip(emitted, draft, strict=False)) if a != b), len(emitted))
            if agree < len(emitted) or len(emitted) == len(draft):
                del self._shadows[req]
                self.policy.record_shadow(req, max(len(draft), 1), agree)

    def _budgets(self, batch: list[tuple[Request, int]]) -> list[int]:
        """Most draft tokens for each request now: 0 unless its logits row is a sampling
        position (it runs all its pending tokens, its prompt done); never more than max_tokens
        leaves room for (drafts + the bonus token). One pass, plain attributes: it runs on
        every step the speculator sees, drafts or not."""
        k = self.config.num_draft_tokens
        return [max(0, min(k, r.params.max_tokens - (len(r.token_ids) - r.num_prompt) - 1))
                if r.num_cached + n == len(r.token_ids) >= r.num_prompt else 0 for r, n in batch]

    def _best_candidate(self, req: Request, cands: Iterable[list[int]]) -> list[int]:
        """The candidate with the longest grammar-valid prefix, cut there. `cands` is read
        only up to the first one the grammar takes whole."""
        if req.matcher is None:
            return next(iter(cands), [])
        best: list[int] = []
        for c in cands:
            c = self._in_vocab(c)
            n = grammar_prefix_len(req, c)
            if n > len(best):
                best = c[:n]
            if n == len(c):
                break
        return best

    def _in_vocab(self, draft: list[int]) -> list[int]:
        if not draft or (min(draft) >= 0 and max(draft) < self.engine.vocab_size):
            return draft
        for j, t in enumerate(draft):
            if not 0 <= t < self.engine.vocab_size:
                return draft[:j]
        return draft

    def _cut(self, req: Request, draft: list[int], grammar_checked: bool = False) -> list[int]:
        """Drop what can never be used: ids outside the vocabulary, tokens after a stop
        token, and (grammar-aware) tokens from the first one the grammar forbids."""
        draft = self._in_vocab(draft)
        if req.matcher is not None:
            if self.config.grammar_aware and not grammar_checked:
                return draft[: grammar_prefix_len(req, draft)]
            return draft
        for j, t in enumerate(draft):
            if req.ends_at(t, terminated=False):
                return draft[: j + 1]
        return draft

    def _release_gone(self) -> None:
        """Aborted or finished requests: let the drafter drop their state."""
        gone = [r for r in self._tracked if r.finished]
        for r in gone:
            self._tracked.discard(r)
            self._shadows.pop(r, None)
            self.policy.release(r)
            drafter_hooks.release(self.drafter, r)

    # -- the step -------------------------------------------------------------------------------
    def step(self, batch: list[tuple[Request, int]]) -> list[Request]:
        """Draft, run pending + draft tokens in one forward sampling every position under its
        mask, accept, advance. Returns the requests that finished. The step's wall time goes
        to the draft policy (the capturable mode's loop, several steps at once, is not timed)."""
        started = time.perf_counter()
        drafts = self.drafts(batch)
        return self.verify_step(batch, drafts, started)

    def drafts(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        """This step's drafts: those the previous step planned for this very batch, else
        proposed now."""
        drafts = self._planned_drafts(batch)
        return self.propose(batch) if drafts is None else drafts

    def runs(self, batch: list[tuple[Request, int]]) -> bool:
        """Whether speculation runs this step at all: at most `max_requests` requests (more
        run the engine's plain step, which this speculator does not see), or with fixed draft
        lengths (every step drafts)."""
        cap = self.config.max_requests
        return not self.adaptive or not cap or len(batch) <= cap

    def skips_verify(self, batch: list[tuple[Request, int]], drafts: list[list[int]]) -> bool:
        """Whether this step, where nobody drafts, runs as a plain decode step (the engine's
        own path, whose next forward is launched ahead and whose masks are filled during the
        forward). One request's step does only where the policy chose no drafts: where it asked
        for drafts and the drafter found none, the step stays a verify step, whose next
        forward this speculator plans. Only for a drafter that runs on the host (a draft
        model keeps a KV cache of its own that follows every step), not in the capturable
        mode, nor with fixed draft lengths."""
        return ((len(batch) > 1 or not self.policy.chose_drafts) and not any(drafts) and self.adaptive
                and not self.capturable and getattr(self.drafter, "host_only", False))

    def plan_step(self, batch: list[tuple[Request, int]]) -> list[ExtendSeq] | None:
        """The rows of the next step, `batch`, planned from a plain step: its drafts are
        proposed now and kept for it (`drafts`), and its forward launched ahead whichever step
        it is, the plain one or (with a drafter that runs on the host, outside the capturable
        mode) the verify step, as a verify step plans its successor (`_plan_next`)."""
        drafts = self.propose(batch)
        self._planned = (self._batch_key(batch, drafts), drafts)
        if not self.skips_verify(batch, drafts) and (self._capturable() or not getattr(self.drafter, "host_only", False)):
            return None  # its forward runs when the step does
        return self._rows_of(batch, drafts)

    def settle_prefetch(self) -> None:
        """Let the engine's mask prefetch in flight finish, and drop it: drafting and verifying
        walk the matchers its workers fill (grammar/prefetch.py: nobody else may use them until
        it is taken or waited for). A step without drafts keeps it for its masks."""
        prefetcher = self.engine.prefetcher
        if prefetcher is not None:
            prefetcher.wait()

    def verify_step(self, batch: list[tuple[Request, int]], drafts: list[list[int]], started: float) -> list[Request]:
        """`step` with its drafts chosen; `started`: when the step began (perf_counter)."""
        self.settle_prefetch()
        if self._capturable():
            joining = self._joining(batch)
            bucket = self._loop_bucket(len(batch) + len(joining))
            fitted = self._fit(batch, drafts, bucket)
            if fitted is not None:
                done: list[Request] = []
                first = self._loop_step(batch, fitted, sampling_spans(batch, fitted), done, bucket)
                if first is not None:
                    return self._run_loop(first, bucket, done, [req for req, _ in batch] + joining)
        finished = self._verify(batch, drafts)
        self.policy.record_step(step_tokens(batch, drafts), time.perf_counter() - started,
                                sum(len(d) for d in drafts))
        return finished

    def _verify(self, batch: list[tuple[Request, int]], drafts: list[list[int]]) -> list[Request]:
        """One forward over every pending and draft token, then accept and advance; returns
        the requests that finished."""
        eng = self.engine
        spans = sampling_spans(batch, drafts)
        finished: list[list[Request]] = []

        def take(tokens: list[int], errors: dict[Request, BaseException]) -> None:
            finished.append(self._take(batch, drafts, spans, tokens, errors))

        try:
            self._forward_and_sample(batch, drafts, spans, take)
        except Exception as exc:  # a broken batch fails its requests, not the engine
            log.exception("verify forward failed")
            for req, _ in batch:
                eng.abort(req, "error", EngineError(f"forward pass failed: {exc}"))
            return [req for req, _ in batch]
        for req, _ in batch:
            if not req.finished:
                eng._notify(req)
        return finished[0]

    def _take(self, batch: list[tuple[Request, int]], drafts: list[list[int]], spans: list[tuple[int, int] | None],
              tokens: list[int], errors: dict[Request, BaseException]) -> list[Request]:
        """Accept each request's drafts against the sampled tokens (row order) and advance it;
        returns the requests that finished (removed from the scheduler and notified)."""
        eng = self.engine
        finished = []
        for (req, n), draft, span in zip(batch, drafts, spans, strict=True):
            req.stats.forward_passes += 1
            if span is None:  # a prefill chunk: nothing to sample yet
                req.num_cached += n
                continue
            self._accept(req, n, draft, tokens[span[0] : span[0] + 1 + len(draft)], errors.get(req))
            if req.finished:
                eng.scheduler.remove(req)
                eng._notify(req)
                self._tracked.discard(req)
                self.policy.release(req)
                drafter_hooks.release(self.drafter, req)
                finished.append(req)
        return finished

    # -- the capturable mode (guided_loop.py) -----------------------------------------------------
    def _capturable(self) -> bool:
        """Verify steps run in the capturable mode's loop: asked for, a host-side drafter, decode
        graphs, and on CUDA the csrc extension (host callbacks)."""
        eng = self.engine
        if not (self.capturable and getattr(self.drafter, "host_only", False)) or self.disabled:
            return False
        if eng.runner.graphs is None:
            return False
        if eng.device.type != "cuda":
            return True  # graphs run eagerly (tests): the loop does too
        from structgen.engine.kernels import csrc_ext

        return csrc_ext.available()

    def _joining(self, batch: list[tuple[Request, int]]) -> list[Request]:
        """The running requests outside `batch` whose prompts have run: the loop's later steps
        (`scheduler.peek`) bring them in, as where the scheduler held their decoding back for
        this step's prompt (scheduler.py), so the loop's bucket and pages are for them too."""
        stepping = {id(req) for req, _ in batch}
        return [r for r in self.engine.scheduler.running if id(r) not in stepping and r.num_cached >= r.num_prompt]

    def _loop_bucket(self, requests: int) -> int:
        """The loop's rows: 1 + k a request (steps with more are cut to fit, see `_fit`)."""
        graphs = self.engine.runner.graphs
        return graphs.bucket(min(requests * (1 + self.config.num_draft_tokens), graphs.max_batch_size))

    @staticmethod
    def _fit(batch: list[tuple[Request, int]], drafts: list[list[int]], rows: int) -> list[list[int]] | None:
        """`drafts` cut (longest first) so the step runs at most `rows` tokens; None if its
        pending tokens alone (forced text, prompts) are more."""
        excess = step_tokens(batch, drafts) - rows
        if excess <= 0:
            return drafts
        drafts = [list(d) for d in drafts]
        while excess > 0:
            longest = max(drafts, key=len)
            if not longest:
                return None
            longest.pop()
            excess -= 1
        return drafts

    def _loop_step(self, batch: list[tuple[Request, int]], drafts: list[list[int]],
                   spans: list[tuple[int, int] | None], finished: list[Request], bucket: int) -> LoopStep | None:
        """This verify step as a step of the loop over `bucket` rows (its `take` plans the next
        one, drafts cut to fit); None where it cannot be one: a request that does not sample,
        or rows the graphs do not take."""
        from structgen.engine.guided_loop import LoopStep

        samplers = [(req, d, s) for (req, _), d, s in zip(batch, drafts, spans, strict=True) if s is not None]
        if len(samplers) != len(batch) or not self._in_graphs(batch, step_tokens(batch, drafts)):
            return None
        g = graph_rows(batch, drafts, spans, *self._sampling(samplers))
        errors: dict[Request, BaseException] = {}

        def fill(bitmask: torch.Tensor) -> None:
            errors.update(fill_draft_masks(bitmask, g.masks))

        def take(tokens: list[int], plan: bool) -> LoopStep | None:
            finished.extend(self._take(batch, drafts, spans, [tokens[f] for f in g.order], errors))
            for req, _ in batch:
                if not req.finished:
                    self.engine._notify(req)
            if not plan or self.engine.interrupted():
                return None
            proposed = self._propose_next()  # its drafts serve the engine's step if the loop stops
            if proposed is None:
                return None
            nxt, nxt_drafts = proposed
            fitted = self._fit(nxt, nxt_drafts, bucket)
            if fitted is None:
                return None
            return self._loop_step(nxt, fitted, sampling_spans(nxt, fitted), finished, bucket)

        rows = g.rows
        return LoopStep([r.token_ids[0] for r in rows], [r.start for r in rows], [r.slot for r in rows],
                        g.temperatures, g.seeds, g.has_mask, fill, take)

    def _run_loop(self, first: LoopStep, bucket: int, finished: list[Request], running: list[Request]) -> list[Request]:
        """Run verify steps in the loop from `first` until one cannot continue it; returns the
        requests that finished. `running`: the requests its steps may run, in `first` or
        joining later; each reserves pages for a full step's rows (a request that drafted
        nothing in `first` may draft its budget later)."""
        eng = self.engine
        rows = 1 + self.config.num_draft_tokens  # a request's pending token and drafts a step
        try:
            eng.runner.run_guided(first, bucket, LOOP_STEPS, {r.slot: (rows, len(r.token_ids) - 1) for r in running})
        except Exception as exc:  # a broken loop fails the running requests, not the engine
            log.exception("capturable guided loop failed")
            for req in list(eng.scheduler.running):
                eng.abort(req, "error", EngineError(f"guided loop step failed: {exc}"))
                finished.append(req)
        return finished

    # -- the next step, planned while the device waits --------------------------------------------
    def _plan_next(self) -> list[ExtendSeq] | None:
        """The next verify step's rows, drafts included, when that step is sure (nobody to admit
        or prefill) and fits the decode graphs, so its forward is launched as soon as this
        step's tokens are taken in; where nobody drafts, the rows of the engine's plain step
        that will run instead (`_rows_of`). Its drafts are proposed here and kept for that
        step. Only for drafters that run on the host: a draft model's forwards would queue
        behind it."""
        try:
            proposed = self._propose_next()
            return None if proposed is None else self._rows_of(*proposed)
        except Exception:  # pragma: no cover - planning must never fail the step
            log.exception("planning the next verify step failed")
            return None

    def _rows_of(self, batch: list[tuple[Request, int]], drafts: list[list[int]]) -> list[ExtendSeq] | None:
        """The rows of the step `batch` with `drafts` will run: the engine's plain step where
        nobody drafts (with jump-forward's guess rows, which a verify step has not), else the
        verify step's where it fits the decode graphs; None where neither is in the graphs."""
        eng = self.engine
        if self.skips_verify(batch, drafts) and eng._is_decode_step(batch):
            return eng._decode_rows(batch)[0]  # the engine's plain step comes: its rows, guesses too
        spans = sampling_spans(batch, drafts)
        if any(s is None for s in spans):
            return None
        rows, _ = token_rows(batch, drafts, spans)
        return rows if self._in_graphs(batch, len(rows)) else None

    def _propose_next(self) -> tuple[list[tuple[Request, int]], list[list[int]]] | None:
        """The next step's batch and its drafts, when that step is sure (nobody to admit or
        prefill); the drafts are kept for it (`_planned_drafts`)."""
        batch = self.engine.scheduler.peek()
        if not batch:
            return None
        drafts = self.propose(batch)
        self._planned = (self._batch_key(batch, drafts), drafts)
        return batch, drafts

    def _planned_drafts(self, batch: list[tuple[Request, int]]) -> list[list[int]] | None:
        """Drafts proposed for this very batch by the previous step's plan, if any."""
        planned, self._planned = self._planned, None
        if planned is None or planned[0] != self._batch_key(batch, planned[1]):
            return None
        return planned[1]

    @staticmethod
    def _batch_key(batch: list[tuple[Request, int]], drafts: list[list[int]]) -> tuple:
        """What a proposal of `drafts` depends on: the requests, the tokens each runs, and their
        tokens. A proposal of no drafts keys on the batch's size and rows alone: a different
        batch of that shape then runs without drafts too, which is always safe, and a step
        without drafts builds no per-request key."""
        if not any(drafts):
            return len(batch), sum(n for _, n in batch)
        return tuple((id(r), n, len(r.token_ids)) for r, n in batch)

    def _in_graphs(self, batch: list[tuple[Request, int]], num_tokens: int) -> bool:
        """Whether a verify step of `num_tokens` rows runs in the decode graphs: a captured
        bucket fits it, and no row needs top-k / top-p (the graphs' sampler does neither)."""
        graphs = self.engine.runner.graphs
        filtered = any(not r.params.greedy and (r.params.top_k > 0 or r.params.top_p < 1.0) for r, _ in batch)
        return graphs is not None and not filtered and graphs.bucket(num_tokens) is not None

    @torch.inference_mode()  # the forward's logits are inference tensors; masking writes them
    def _forward_and_sample(
        self, batch: list[tuple[Request, int]], drafts: list[list[int]], spans: list[tuple[int, int] | None],
        take: Callable[[list[int], dict[Request, BaseException]], None],
    ) -> None:
        """One forward over every pending + draft token; `take(tokens, errors)` gets a sampled
        token at every sampling position (in row order). Uses the runner's decode graphs when
        the whole step fits one, treating each token as a one-token row (its own position and
        context length); there, with a host-side drafter, `take` runs as soon as the tokens
        are on the host and the next verify step's forward is launched right behind it
        (`_plan_next`), before this step's bookkeeping."""
        eng, runner = self.engine, self.engine.runner
        samplers = [(req, d, s) for (req, _), d, s in zip(batch, drafts, spans, strict=True) if s is not None]
        temps, seeds = self._sampling(samplers)
        errors: dict[Request, BaseException] = {}
        in_graphs = self._in_graphs(batch, step_tokens(batch, drafts))
        if not samplers and not (in_graphs and eng.config.tuning.prefill_in_graphs):  # only prefill chunks
            runner.extend([ExtendSeq(r.slot, r.num_cached, r.token_ids[r.num_cached : r.num_cached + n], 0) for r, n in batch])
            take([], errors)
            return
        if in_graphs:
            plans = getattr(self.drafter, "host_only", False) and len(samplers) == len(batch)
            step = VerifyStep(self, graph_rows(batch, drafts, spans, temps, seeds), errors, take, plans)
            out = runner.decode(step)
            if not step.taken:
                take([out[f] for f in step.order], errors)
            return
        seqs = []
        for (req, n), d, s in zip(batch, drafts, spans, strict=True):
            start = req.num_cached
            seqs.append(ExtendSeq(req.slot, start, req.token_ids[start : start + n] + d, num_logits=0 if s is None else 1 + len(d)))
        logits = runner.extend(seqs)  # async on CUDA: the mask walk below overlaps it
        constrained = [(req, s[0], d) for req, d, s in samplers if req.matcher is not None]
        if constrained:
            idx = [s + j for _, s, d in constrained for j in range(1 + len(d))]
            bitmask = allocate_bitmask(len(idx), eng.vocab_size)
            local, r = [], 0
            for req, _, d in constrained:
                local.append((req, r, d))
                r += 1 + len(d)
            errors.update(fill_draft_masks(bitmask, local))
            bitmask = bitmask.to(eng.device, non_blocking=True)
            if len(idx) == logits.shape[0]:  # every row constrained: mask in place
                apply_bitmask_(logits, bitmask)
            else:
                idx_t = torch.tensor(idx, device=eng.device)
                logits.index_copy_(0, idx_t, apply_bitmask_(logits.index_select(0, idx_t), bitmask))
        tokens = torch.argmax(logits, dim=-1).tolist()  # greedy rows' answer
        for req, d, (r0, _) in samplers:
            if req.params.greedy:
                continue
            # Sampled rows one at a time, stopping at the first mismatch: the rows after it
            # are never read (same noise per row, so the same tokens as sampling them all).
            for j in range(r0, r0 + 1 + len(d)):
                tokens[j] = int(sample(logits[j : j + 1], [req.params], [seeds[j]])[0])
                if j - r0 == len(d) or tokens[j] != d[j - r0]:
                    break
        take(tokens, errors)

    def _sampling(self, samplers: list[tuple[Request, list[int], tuple[int, int]]]) -> tuple[list[float], list[int]]:
        """Temperature and noise seed of every sampling row (row order)."""
        temps, seeds = [], []
        for req, d, _ in samplers:
            pos = len(req.token_ids)
            temps += [req.params.temperature] * (1 + len(d))
            seeds += [self._noise_seed(req, pos + j) for j in range(1 + len(d))]
        return temps, seeds

    def _noise_seed(self, req: Request, position: int) -> int:
        """The sampling noise of the token at `position`: the engine's rule (a function of
        (seed, position) for seeded requests), so speculation does not change seeded outputs."""
        if req.params.greedy:
            return 0
        if req.params.seed is None:
            return self.engine._rng.getrandbits(63)
        return step_seed(req.params.seed, position)

    def _accept(self, req: Request, n: int, draft: list[int], tokens: list[int], error: BaseException | None) -> None:
        """Keep the accepted prefix of the draft, emit it and the target's token (emit.py: as
        the engine's `_advance` would); the KV cache keeps pending + accepted drafts."""
        eng = self.engine
        # A guess (engine/drafts.py) is for the step right after its jump: this one, which ran
        # no guess row; kept, it would run later at a position it was not proposed for.
        req.guess = None
        try:
            if error is not None:
                raise EngineError(f"grammar failed while computing the token mask: {error}")
            emitted = accept_draft(tokens, draft)
            accepted = len(emitted) - 1
            req.num_cached += n + accepted  # rejected drafts' K/V are overwritten later
            req.stats.drafted_tokens += len(draft)
            req.stats.accepted_tokens += accepted
            req.stats.verify_steps += 1
            drafter_hooks.notify_verified(self.drafter, req, len(draft), accepted)
            self.policy.record_verified(req, len(draft), accepted)
            emit(eng, req, emitted)
        except Exception as exc:
            log.exception("request %d failed", req.id)
            req.finish("error", exc if isinstance(exc, EngineError) else EngineError(str(exc)))


class VerifyStep(DecodeStep):
    """A verify step in the decode graphs (`graph_rows`): its grammar rows are filled along
    each draft, and with a host-side drafter (`plans_next`) its tokens are taken in (`take`,
    in sampling order) as soon as they are on the host, then the next verify step planned."""

    def __init__(self, speculator: Speculator, g: GraphRows, errors: dict[Request, BaseException],
                 take: Callable[[list[int], dict[Request, BaseException]], None], plans: bool):
        # No token gate: the next step is a verify step of several rows, so the one-row forward
        # the gate would run on the device ahead of it is almost always wasted.
        super().__init__(g.rows, g.temperatures, g.seeds, g.has_mask, predict_next=plans, plans_next=plans,
                         gate_next=False)
        self.speculator, self.masks, self.order, self.errors, self.take = speculator, g.masks, g.order, errors, take
        self.taken = False  # the tokens went in while planning

    def fill_masks(self, bitmask: torch.Tensor) -> None:
        self.errors.update(fill_draft_masks(bitmask, self.masks))

    def plan_next(self, tokens: list[int]) -> list[ExtendSeq] | None:
        self.taken = True
        self.take([tokens[f] for f in self.order], self.errors)
        return self.speculator._plan_next()
