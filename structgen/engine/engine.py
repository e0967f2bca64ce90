"""Engine: the step loop. Each step schedules pending tokens, runs one `extend` forward, fills
grammar bitmasks while the device works, samples under the masks, and advances every
request's matcher. A failure inside one request finishes that request with an error and
never touches the others.

A pure decode step (every request runs one token and samples) goes through
`ModelRunner.decode` instead, which samples on the device and returns tokens: on CUDA a
captured graph whose grammar masks are filled while its forward runs. With jump-forward
requests the step takes its tokens in (advance, jump) inside the runner's `plan_next`
callback and hands back the next step's rows, so that forward, forced text included, is
launched before the engine goes back to scheduling."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from structgen.engine.closing import BudgetCloser
from structgen.engine.config import EngineConfig, ModelConfig
from structgen.engine.decode_step import EngineDecodeStep
from structgen.engine.drafts import fill_guess_rows, take_guesses
from structgen.engine.garbage_collection import freeze_heap
from structgen.engine.jump_forward import QUIET_MIN_ALLOWED, JumpForward, quiet_tokens
from structgen.engine.model_runner import ExtendSeq, ModelRunner
from structgen.engine.reasoning import Reasoner
from structgen.engine.repair import ban_rejected, reopen_if_rejected
from structgen.engine.request import Request, RequestStatus
from structgen.engine.sampler import apply_bitmask_, sample, step_seed
from structgen.engine.scheduler import Scheduler
from structgen.engine.thread_guard import ThreadGuard, one_thread
from structgen.errors import (
    EngineError,
    InvalidConstraintError,
    InvalidParameterError,
    PromptTooLongError,
    UnsatisfiableConstraintError,
)
from structgen.grammar import GrammarThreads, accept_one, accept_tokens, native
from structgen.grammar.backends.base import (
    ACCEPTED,
    COMPLETED,
    FAILED,
    FILLED,
    JUMPS,
    TERMINATED,
    HostMaskRow,
    allocate_bitmask,
    allowed_ids,
    would_accept,
)
from structgen.sampling import SamplingParams

if TYPE_CHECKING:
    from structgen.grammar.prefetch import MaskPrefetcher

log = logging.getLogger("structgen.engine")

# A rejected token is a dead end of the constraint (not an engine fault) only where none of the
# tokens the mask allows is accepted; beyond this many allowed tokens it is not a dead end.
DEAD_END_PROBES = 256


_NOT_PLAIN = ACCEPTED | TERMINATED | COMPLETED | FAILED  # of these bits, a plain step's rows have ACCEPTED only


def _check_host(config: EngineConfig) -> None:
    """Refuse a device this host lacks, and more tensor-parallel ranks than it can spawn (one
    GPU each on CUDA, one core each on the CPU); a torchrun launch brings its own ranks."""
    from structgen.engine.model_runner import pick_device

    device = pick_device(config)
    if config.tensor_parallel == 1:
        return
    from structgen.engine.parallel import Rendezvous

    if Rendezvous.from_torchrun() is not None:
        return
    have = torch.cuda.device_count() if device.type == "cuda" else native.usable_cores()
    unit = "GPUs" if device.type == "cuda" else "usable CPU cores"
    if config.tensor_parallel > have:
        raise InvalidParameterError(f"EngineConfig.tensor_parallel={config.tensor_parallel} spawns a process per "
                                    f"rank on this host, which has {have} {unit}; pass at most {have}, or launch "
                                    "the ranks with torchrun across hosts (docs/guide/multi-gpu.md)")


class Engine:
    def __new__(cls, *args: object, **kwargs: object) -> Engine:
        freeze_heap()  # before this engine exists: a dropped engine must stay collectable
        return super().__new__(cls)

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig | None = None,
        model_dir: Path | None = None,
        stop_token_ids: set[int] | None = None,
        text_vocab_size: int | None = None,
    ):
        self.stop_token_ids = set(stop_token_ids if stop_token_ids is not None else model_config.eos_token_id)
        self.config = EngineConfig.coerce(config)
        self.model_config = model_config
        # Settings this host cannot run are refused before any process, weight or cache exists.
        self.grammar_threads = self._grammar_threads()
        _check_host(self.config)
        # text_vocab_size: the tokenizer's ids (TokenizerReport); a wider LM head's extra
        # logits are never sampled.
        # Tensor parallelism: this process is rank 0 of a group whose other ranks run the same
        # forwards on their shard of the model (engine/parallel.py).
        self.tensor_parallel = None
        if self.config.tensor_parallel > 1:
            from structgen.engine.parallel import start_tensor_parallel

            self.tensor_parallel = start_tensor_parallel(model_config, self.config, model_dir)
        try:
            self.runner = ModelRunner(model_config, self.config, model_dir, text_vocab_size, self.tensor_parallel)
        except BaseException:
            self.close()
            raise
        self.device = self.runner.device
        self.vocab_size = model_config.vocab_size
        # A step may write past a request's tokens: a draft and the forward launched ahead (a
        # speculator raises this for its drafts, `Speculator.__init__`).
        self.scheduler = Scheduler(self.runner.kv.pages, self.runner.kv.num_slots, self.config.prefill_chunk_tokens,
                                   lookahead=2)
        self.max_seq_len = self.runner.max_seq_len
        self.jump_forward_hook: JumpForward | None = None  # built by use_tokenizer
        self.closer = BudgetCloser()  # closes outputs near max_tokens once given the tokenizer
        self.reasoner = Reasoner(self.closer)  # think sections before constrained answers
        # Whether someone waits to hand the engine requests or aborts (EngineLoop sets it):
        # runs of steps that do not come back to `step` between them stop for it.
        self.interrupted: Callable[[], bool] = _nobody_waits
        # step, add_request and abort on one thread at a time (EngineLoop holds it while it works)
        self.thread_guard = ThreadGuard()
        self._rng = random.Random(self.config.seed)  # noise seeds of unseeded sampled rows
        self._mask_row = HostMaskRow(self.vocab_size, self.stop_token_ids)  # one matcher's next tokens (finish checks, errors)
        # Masks of the next decode step filled while the last one's tokens were taken in
        # (`_take_tokens`): the buffer and, as grammar.prefetch records them, which rows.
        self._prefilled: tuple[torch.Tensor, dict] | None = None
        self.speculator = None  # speculative decoding (spec/speculator.py) when configured
        if self.config.speculative is not None:
            from structgen.engine.speculative.speculator import Speculator

            self.speculator = Speculator(self, self.config.speculative)
        if self.config.tuning.grammar_threads:
            native.size_pool(self.grammar_threads.pool, self)  # the pool is process-wide: LLM.close() leaves it
        native.use_pool(self)
        self.prefetcher = self._mask_prefetcher()

    def _grammar_threads(self) -> GrammarThreads:
        """The threads of the grammar work (`EngineTuning.grammar_threads`, or the auto sizes,
        `$STRUCTGEN_GRAMMAR_THREADS` among them), refused past `native.thread_limit()`; a
        configured number also resizes grammar.native's process-wide pool once the model is
        built."""
        configured = self.config.tuning.grammar_threads
        if configured:
            native.check_threads(configured)
        return GrammarThreads.resolve(configured)

    def _mask_prefetcher(self) -> MaskPrefetcher | None:
        """Next step's masks filled on worker threads during the bookkeeping (grammar/prefetch.py).
        With speculation too, for its plain steps: before it drafts or verifies, the speculator
        lets a prefetch in flight finish (`Speculator.settle_prefetch`). Not, unless forced on,
        where grammar.native's pool fills masks: it fills a whole step's masks inline within
        the forward, and a prefetch only adds hand-offs (docs/performance.md, "Grammar overhead")."""
        mode = self.config.tuning.mask_prefetch
        if mode == "off" or (mode == "auto" and native.pool_in_use()):
            return None
        from structgen.grammar.prefetch import MaskPrefetcher, PrefetchTuner

        return MaskPrefetcher(self.grammar_threads.prefetch, tuner=PrefetchTuner() if mode == "auto" else None)

    def close(self, release_memory: bool = False) -> None:
        """Stop the tensor-parallel worker ranks, if any, and leave the grammar pool's users;
        with `release_memory` (nothing steps this engine any more), also drop the model, its KV
        cache, graphs and drafter, so a closed LLM that is still referenced holds no device
        memory; idempotent."""
        native.release_pool(self)
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
        if release_memory:
            self.speculator = None
            self.runner.release_memory()

    # -- requests -------------------------------------------------------------------------
    def use_tokenizer(self, tokenizer: Any) -> None:
        """Build the components that read text: jump-forward (requests use it unless
        `jump_forward=False`; on CUDA the batch-1 decode graphs also get its token gate), the
        budget closer and the speculator's text drafters."""
        # Guesses on with speculation too: its steps without drafts are plain decode steps, and a
        # verify step drops the guesses of its requests (`Speculator._accept`).
        jump = self.jump_forward_hook = JumpForward(tokenizer, self.vocab_size, self.stop_token_ids)
        if self.device.type == "cuda":
            self.runner.set_token_gate(quiet_tokens(jump.vocab), QUIET_MIN_ALLOWED)
        self.closer.use_tokenizer(tokenizer, self.vocab_size, self.stop_token_ids)
        self.reasoner.use_tokenizer(tokenizer, self.vocab_size, self.stop_token_ids)
        if self.speculator is not None:
            self.speculator.use_tokenizer(tokenizer)

    @one_thread
    def add_request(self, request: Request) -> Request:
        """Queue a request; raises PromptTooLongError before it takes any resources."""
        need = request.num_prompt + request.params.max_tokens
        if request.num_prompt == 0:
            raise EngineError("empty prompt: at least one token is needed")
        if need > self.max_seq_len:
            raise PromptTooLongError(
                f"prompt of {request.num_prompt} tokens + max_tokens {request.params.max_tokens} = {need} "
                f"exceeds the context of {self.max_seq_len} tokens; shorten the prompt or lower max_tokens"
            )
        if request.validator is not None and self.speculator is not None:
            raise InvalidParameterError("repair does not run with speculative decoding; pass repair=0, or build "
                                        "the LLM without EngineConfig.speculative")
        if request.params.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(request.params.seed)
        jf = request.params.jump_forward
        request.jump_forward = (self.config.jump_forward if jf is None else jf) and request.matcher is not None
        self.reasoner.admit(request)  # HOOK(reasoning): a think section first, its matcher parked
        self.closer.admit(request)  # HOOK(closing): the request's first budget check
        if request.jump_forward and self.jump_forward_hook is not None:
            # What the grammar forces before any sampling (`{"name": `) rides along with the
            # prompt's prefill; a grammar that forces its whole output finishes right here.
            self.jump_forward_hook(self, request)
            if request.finished:
                self._notify(request)
                return request
        self.scheduler.add(request)
        return request

    @one_thread
    def abort(self, request: Request, reason: str = "abort", error: BaseException | None = None) -> None:
        if not request.finished:
            request.finish(reason, error)
        self.scheduler.remove(request)
        self._notify(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ---------------------------------------------------------------------------
    @one_thread
    def step(self) -> list[Request]:
        """Run one forward over every running request; return requests that finished."""
        graphs = self.runner.graphs
        # With prompts in the graphs, a step's tokens are capped at the largest bucket.
        budget = graphs.max_batch_size if graphs is not None and self.config.tuning.prefill_in_graphs else None
        batch = self.scheduler.schedule(token_budget=budget)
        if not batch:
            return []
        if self.speculator is not None and self.speculator.runs(batch):
            return self._speculative_step(batch)
        if self._is_decode_step(batch):
            return self._decode_step(batch)
        self._time_step(None)
        seqs, sampling, guessed = [], [], {}
        for req, n in batch:
            start = req.num_cached
            ids = req.token_ids[start : start + n]
            guess = req.guess if start + n == len(req.token_ids) else None
            # A guess is one more token, with logits at it and at the token before it.
            seqs.append(ExtendSeq(req.slot, start, ids) if guess is None else ExtendSeq(req.slot, start, [*ids, guess], 2))
        try:
            logits = self.runner.extend(seqs)  # async on CUDA: the mask work below overlaps it
        except Exception as exc:  # a broken batch fails its requests, not the engine
            log.exception("forward failed")
            for req, _ in batch:
                self.abort(req, "error", EngineError(f"forward pass failed: {exc}"))
            return [req for req, _ in batch]
        row = 0
        for seq, (req, n) in zip(seqs, batch, strict=True):
            req.num_cached += n
            req.stats.forward_passes += 1
            if req.num_cached == len(req.token_ids):  # it samples at its first logits row
                if seq.num_logits == 2:
                    guessed[len(sampling)] = row + 1  # and after its guess at the second
                sampling.append((row, req))
            row += seq.num_logits
        finished = self._sample_and_advance(logits, sampling, guessed)
        for req, _ in batch:
            if not req.finished:
                self._notify(req)
        return finished

    def _speculative_step(self, batch: list[tuple[Request, int]]) -> list[Request]:
        """Draft, then verify every draft in one forward (speculative/); where nobody drafts
        (the draft policy found drafts do not pay at this batch), a plain decode step, timed
        for the policy as what a step without drafts costs."""
        spec = self.speculator
        assert spec is not None
        started = time.perf_counter()
        drafts = spec.drafts(batch)
        if spec.skips_verify(batch, drafts) and self._is_decode_step(batch):
            finished = self._decode_step(batch)
            spec.policy.record_step(sum(n for _, n in batch), time.perf_counter() - started)
            return finished
        self._time_step(None)
        return spec.verify_step(batch, drafts, started)

    def _is_decode_step(self, batch: list[tuple[Request, int]]) -> bool:
        """Every row fits the decode graphs: each request runs all its pending tokens and
        samples after the last, or (`prefill_in_graphs`) runs a chunk of its prompt and
        samples nothing; none needs top-k/top-p (those rows take the eager sampler). Tokens
        beyond one a request (jump-forward text, prompt chunks) ride in the decode graphs as
        extra rows, one per token, when they fit a captured bucket: an eager extend is
        host-bound launches, many times a graph replay on a GPU (docs/performance.md,
        "Prefill and time to first token")."""
        rows = guesses = 0
        for req, n in batch:
            p = req.params
            if n < req.num_pending and not self.config.tuning.prefill_in_graphs:  # a chunk that samples nothing
                return False
            if not p.greedy and (p.top_k > 0 or p.top_p < 1.0):
                return False
            if n > 1 and (self.runner.graphs is None
                          or (req.num_cached < req.num_prompt and not self.config.tuning.prefill_in_graphs)):
                return False  # no graphs to put the forced tokens in, or a prefill kept eager
            rows += n
            guesses += req.guess is not None and req.num_cached + n == len(req.token_ids)
        graphs = self.runner.graphs
        if guesses and graphs is not None and graphs.bucket(rows + guesses) is None:
            for req, _ in batch:  # the guesses ride only where they fit the graphs
                req.guess = None
            guesses = 0
        if graphs is None:
            return rows == len(batch)
        return rows + guesses == len(batch) or graphs.bucket(rows + guesses) is not None

    def _decode_step(self, batch: list[tuple[Request, int]]) -> list[Request]:
        step = EngineDecodeStep(self, batch)
        if self.prefetcher is not None and len(step.constrained) >= self.prefetcher.min_rows:
            graphs, n = self.runner.graphs, step.num_rows
            self._time_step((graphs.bucket(n) if graphs is not None else n, len(step.constrained) // 16))
        else:
            self._time_step(None)
        try:
            tokens = self.runner.decode(step)
        except Exception as exc:  # a broken batch fails its requests, not the engine
            log.exception("decode step failed")
            for req, _ in batch:
                self.abort(req, "error", EngineError(f"forward pass failed: {exc}"))
            return [req for req, _ in batch]
        if step.finished is None:
            # The next masks are filled as the tokens are taken in where the next forward is
            # queued already (or on the CPU, where nothing overlaps anyway).
            graphs = self.runner.graphs
            ahead = self.device.type != "cuda" or (graphs is not None and graphs.launched_ahead)
            step.take_tokens(tokens, fill_next=ahead and not step.chunks and self.prefetcher is None)
        for req in step.reqs:
            if not req.finished:
                self._notify(req)
        return step.finished

    @staticmethod
    def _decode_rows(batch: list[tuple[Request, int]]) -> tuple[list[ExtendSeq], list[int | None]]:
        """A request's tokens as one run, laid out as a row per token (`cuda_graphs.step_rows`):
        a row attends to its slot up to its own position, and every row's K/V is written before
        any attention reads it, so rows of one request are exactly a causal multi-token extend.
        Returns the runs and each request's sampled row, counted in rows (its last pending
        token's), or None for a prompt chunk that stops short of its pending tokens. A
        request's guess runs as the row after its sampled row."""
        seqs: list[ExtendSeq] = []
        last: list[int | None] = []
        rows = 0
        for r, n in batch:
            start, ids = r.num_cached, r.token_ids
            seqs.append(ExtendSeq(r.slot, start, ids[start : start + n], n))
            rows += n
            sampled = start + n == len(ids)
            last.append(rows - 1 if sampled else None)
            if r.guess is not None and sampled:  # the row after the last
                seqs.append(ExtendSeq(r.slot, len(ids), [r.guess]))
                rows += 1
        return seqs, last

    def _plain_next_step(self, reqs: list[Request], tokens: list[int]
                         ) -> tuple[list[ExtendSeq] | None, list | None, dict[int, EngineError]]:
        """The next step's rows when it is surely the predicted one: every running request
        is in this step, takes its sampled token (its grammar accepts it here), stays
        unfinished and has no forced text after it; else None. Also what the matchers made of
        their tokens, aligned with `reqs` (None: nobody took one), and the errors of those that
        raised, by index, for taking the tokens in."""
        s = self.scheduler
        if s.waiting or len(s.running) != len(reqs):
            return None, None, {}
        for req, tok in zip(reqs, tokens, strict=True):
            if req.may_finish_at(tok):
                return None, None, {}
        taken, failed = self._take_tokens(reqs, tokens, {}, check_jump=self.jump_forward_hook is not None)
        # A rejected token or a grammar that raised is left to taking the tokens in, which
        # fails that request alone (so is forced text: the jump-forward hook decides it).
        for req, st in zip(reqs, taken, strict=True):
            if st is not None and (st & _NOT_PLAIN != ACCEPTED or (st & JUMPS and req.jump_forward)):
                return None, taken, failed
        return [ExtendSeq(req.slot, len(req.token_ids), [tok]) for req, tok in zip(reqs, tokens, strict=True)], taken, {}

    def _take_tokens(
        self, reqs: list[Request], tokens: list[int], errors: dict[int, BaseException], check_jump: bool = False,
        fill_next: bool = False,
    ) -> tuple[list, dict[int, EngineError]]:
        """Hand every constrained request (but those in `errors`) its token in one batch
        (`grammar.accept_tokens`); returns the statuses aligned with `reqs` (None: no matcher
        took one) and, by index, an error quoting each matcher that raised. `fill_next`: the next step's masks
        are filled on the way where the grammar's pool can, at the rows they will most likely
        have (request i at row i: the same requests, one token each); `_not_prefilled` checks
        that guess row by row."""
        matchers = [r.matcher for r in reqs]
        if errors or None in matchers:
            idx = [i for i, m in enumerate(matchers) if m is not None and i not in errors]
            if not idx:
                return [None] * len(reqs), {}
            matchers, tokens = [matchers[i] for i in idx], [tokens[i] for i in idx]
        else:
            idx = range(len(reqs))
        target = self.runner.mask_buffer(len(reqs)) if fill_next else None
        status, raised = accept_tokens(matchers, tokens, check_jump=check_jump, bitmask=target,
                                       rows=idx if target is not None else None)
        failed = {j: EngineError(f"grammar failed on sampled token {tokens[j]}: {exc}") for j, exc in raised.items()}
        if target is not None and any(st & FILLED for st in status):
            self._prefilled = (target, {id(m): (i, m, m.version) for i, m, st in zip(idx, matchers, status, strict=True)
                                        if st & FILLED})
        if len(idx) == len(reqs):
            return status, failed
        taken: list = [None] * len(reqs)
        for i, st in zip(idx, status, strict=True):
            taken[i] = st
        return taken, {idx[j]: exc for j, exc in failed.items()}

    def _not_prefilled(self, bitmask: torch.Tensor, rows: list[tuple[int, object]]) -> list[tuple[int, object]]:
        """`rows` (row, matcher) but those whose mask `_take_tokens` filled for that matcher in
        its present state (moved into `bitmask` at `row` if it went elsewhere); forgets them."""
        from structgen.grammar.prefetch import serve_filled

        prefilled, self._prefilled = self._prefilled, None
        if prefilled is None:
            return rows
        return serve_filled(*prefilled, bitmask, rows)

    def _plan_decode_step(self) -> list[ExtendSeq] | None:
        """The rows of the next step when it will surely be a decode step (nobody to admit or
        prefill); None otherwise. A wrong plan only costs a discarded forward."""
        try:
            batch = self.scheduler.peek()
            if not batch or not self._is_decode_step(batch):
                return None
            spec = self.speculator
            if spec is not None and spec.runs(batch):
                return spec.plan_step(batch)  # a plain or a verify step (its drafts are kept for it)
            return self._decode_rows(batch)[0]
        except Exception:  # pragma: no cover - planning must never fail the step
            log.exception("planning the next decode step failed")
            return None

    def _time_step(self, shape: tuple[int, int] | None) -> None:
        """Tell the prefetch's tuner a step starts; `shape`: (rows bucket, constrained rows //
        16) for a decode step it may time, None for one it may not."""
        tuner = self.prefetcher.tuner if self.prefetcher is not None else None
        if tuner is not None:
            tuner.step(time.perf_counter(), shape)

    def _prefetch_masks(self) -> None:
        """Start filling the masks of the step that will most likely come next (every running
        request decodes; its sampled row as `_decode_rows` lays it out) on the prefetcher's
        threads. The guess is checked row by row when the masks are taken."""
        pairs, row = [], -1
        for r in self.scheduler.running:
            if not r.finished and r.num_cached >= r.num_prompt:
                row += len(r.token_ids) - r.num_cached  # its last pending token is sampled
                if r.matcher is not None:
                    pairs.append((row, r.matcher))
        if not pairs:
            return
        try:
            self.prefetcher.start(self.runner.mask_buffer(row + 1), pairs)  # the buffer that step fills
        except Exception:  # pragma: no cover - the masks are then filled on the spot
            log.exception("starting the mask prefetch failed")

    def _fill_masks(self, bitmask: torch.Tensor, rows: list[tuple[int, object]]) -> dict[int, BaseException]:
        """Fill `bitmask[row]` from each matcher (batched through the backends' thread pools);
        a matcher that fails is reported by row, the others' rows are still filled. Rows a
        prefetch already filled are taken from it."""
        from structgen.grammar import fill_bitmasks

        if self.prefetcher is not None:
            rows = self.prefetcher.take(bitmask, rows)
        if not rows:
            return {}
        try:
            timed = self.prefetcher is not None and len(rows) >= self.prefetcher.min_rows
            t = time.perf_counter() if timed else 0.0
            fill_bitmasks([m for _, m in rows], bitmask, [i for i, _ in rows], threads=self.grammar_threads)
            if timed:
                self.prefetcher.observe(time.perf_counter() - t)  # worth prefetching next time?
            return {}
        except Exception:
            errors: dict[int, BaseException] = {}
            for i, m in rows:  # find the culprit(s) one by one
                try:
                    m.fill_bitmask(bitmask, i)
                except Exception as exc:
                    errors[i] = exc
            return errors

    def ban_rejected(self, bitmask: torch.Tensor, rows: list[tuple[int, Request, int | None]]) -> None:
        """HOOK(repair): keep repaired requests off the text their validator rejected
        (engine/repair.py); `rows`: (bitmask row, request, draft it samples after)."""
        if self.jump_forward_hook is not None:
            ban_rejected(bitmask, rows, self.jump_forward_hook.vocab)

    def _noise_seed(self, req: Request, ahead: int = 0) -> int:
        """Seed of this step's sampling noise: a function of (seed, position) for seeded
        requests, so they reproduce whatever they are batched with (and with or without
        guesses: `ahead` 1 is a guess row's, the position after)."""
        if req.params.greedy:
            return 0
        if req.params.seed is None:
            return self._rng.getrandbits(63)
        return step_seed(req.params.seed, len(req.token_ids) + ahead)

    @torch.inference_mode()  # logits are the forward's inference tensors; masking writes them
    def _sample_and_advance(self, logits: torch.Tensor, sampling: list[tuple[int, Request]],
                            guessed: dict[int, int] | None = None) -> list[Request]:
        """Sample at `sampling`'s (logits row, request) and advance; `guessed[i]`: the logits
        row of request i's guess (see `drafts.take_guesses`)."""
        if not sampling:
            return []
        guessed = guessed or {}
        reqs = [r for _, r in sampling]
        n = len(sampling)
        rows = torch.tensor([i for i, _ in sampling] + list(guessed.values()), device=self.device)
        if guessed or len(rows) != logits.shape[0]:  # (guess rows come last, out of order)
            logits = logits.index_select(0, rows)
        # No mask for free text, nor while a request thinks (engine/reasoning.py parks its matcher).
        constrained = [(j, r) for j, r in enumerate(reqs) if r.matcher is not None]
        errors: dict[int, BaseException] = {}
        bad_guesses: set[int] = set()
        if constrained:
            bitmask = allocate_bitmask(len(constrained) + len(guessed), self.vocab_size)
            for k, exc in self._fill_masks(bitmask, [(k, r.matcher) for k, (_, r) in enumerate(constrained)]).items():
                errors[constrained[k][0]] = exc
            bad_guesses, broken = fill_guess_rows(bitmask, [(i, reqs[i], len(constrained) + k)
                                                            for k, i in enumerate(guessed)])
            errors.update(broken)
            if any(r.rejected for r in reqs):
                self.ban_rejected(bitmask, [(k, r, None) for k, (_, r) in enumerate(constrained)]
                                  + [(len(constrained) + k, reqs[i], reqs[i].guess) for k, i in enumerate(guessed)])
            idx = torch.tensor([j for j, _ in constrained] + [n + k for k in range(len(guessed))], device=self.device)
            masked = apply_bitmask_(logits.index_select(0, idx), bitmask.to(self.device, non_blocking=True))
            logits.index_copy_(0, idx, masked)
        params = [r.params for r in reqs] + [reqs[i].params for i in guessed]
        seeds = [self._noise_seed(r) for r in reqs] + [self._noise_seed(reqs[i], 1) for i in guessed]
        tokens = sample(logits, params, seeds).tolist()
        if guessed:
            tokens = take_guesses(reqs, tokens[:n], dict(zip(guessed, tokens[n:], strict=True)), bad_guesses, errors,
                                 self._advance)
        return self._advance_all(reqs, tokens, errors)

    def _advance_all(
        self, reqs: list[Request], tokens: list[int], errors: dict[int, BaseException], prefetch: bool = False,
        taken: list | None = None, plain: bool = False, fill_next: bool = False,
    ) -> list[Request]:
        """Advance each request by its sampled token; `errors[i]` (its grammar failed this
        step) finishes request i with that error instead. Returns those that finished.
        `prefetch`: the next step's masks start filling once every matcher has advanced, and
        the rest (freeing slots, callbacks) runs meanwhile. `taken`: what each matcher made of
        its token where it has taken it already (`_take_tokens`), else the tokens are handed
        over here in one batch, filling the next step's masks on the way when `fill_next`.
        `plain`: every request was checked by `_plain_next_step` (token accepted, not
        complete, nothing forced, no stop or length limit reached), so only appending the
        token is left."""
        if plain:
            for req, tok in zip(reqs, tokens, strict=True):
                self._append_plain(req, tok)
                self._announce_finish(req)  # (the closer may have closed it at its budget)
        else:
            if taken is None:
                hook = self.jump_forward_hook is not None and any(r.jump_forward for r in reqs)
                taken, failed = self._take_tokens(reqs, tokens, errors, check_jump=hook, fill_next=fill_next)
                errors = errors | failed
            for i, (req, tok) in enumerate(zip(reqs, tokens, strict=True)):
                try:
                    if i in errors:
                        exc = errors[i]
                        raise exc if isinstance(exc, (EngineError, InvalidConstraintError)) else EngineError(
                            f"grammar failed while computing the token mask: {exc}")
                    if self._takes_plainly(req, tok, taken[i]):
                        self._append_plain(req, tok)
                    else:
                        self._advance(req, tok, status=taken[i], jump_checked=True)
                except InvalidConstraintError as exc:  # the request's own fault: no traceback in the log
                    log.info("request %d failed: %s", req.id, exc)
                    req.finish("error", exc)
                except Exception as exc:
                    log.exception("request %d failed", req.id)
                    req.finish("error", EngineError(str(exc)))
                self._announce_finish(req)
        if prefetch and self.prefetcher is not None:
            self._prefetch_masks()
        # HOOK(repair): a rejected output goes back to its bad field, keeping its slot.
        finished = [req for req in reqs if req.finished and not reopen_if_rejected(self, req)]
        for req in finished:
            self.scheduler.remove(req)
            if req.validator is not None:
                self._notify(req)
        return finished

    def _announce_finish(self, req: Request) -> None:
        """Tell the caller of a request that finished while the step advanced it, now rather
        than after the rest of the step (a burst's outputs close together, and the step that
        closes them is long); its slot is freed after. One with a validator is told after
        `reopen_if_rejected`, which may yet reopen it (repair)."""
        if req.finished and req.validator is None:
            self._notify(req)

    @staticmethod
    def _takes_plainly(req: Request, tok: int, status: int | None) -> bool:
        """Whether `req` passes `_plain_next_step`'s test alone: its matcher accepted `tok`
        (`status`, from `_take_tokens`), nothing is forced after it and it cannot finish
        here; then the rest of `_advance` would find nothing to do (a batch of 256 nearly
        always has a row that jumps, so the whole-step test rarely passes)."""
        return (status is not None and status & _NOT_PLAIN == ACCEPTED
                and not (status & JUMPS and req.jump_forward) and not req.may_finish_at(tok))

    def _append_plain(self, req: Request, tok: int) -> None:
        """Append a token its grammar accepted, after which nothing is forced and the request
        cannot finish (`_plain_next_step`'s rows): only the hooks a token passes are left."""
        req.append([tok])
        if req.thinking:  # HOOK(reasoning): the closing tag, a stop token or the budget
            self.reasoner.after_token(req)
        if req.num_output >= req.close_at:  # HOOK(closing): a loop or budget check due
            self.closer.at_budget(req, completed=False)  # (a plain row's grammar is not complete)

    def _advance(self, req: Request, tok: int, jump_forward: bool = True, status: int | None = None,
                 jump_checked: bool = False) -> None:
        """Feed one sampled token to the request's grammar and decide whether it is done.
        `jump_forward=False`: more tokens of this step follow (accepted drafts), jump later.
        `status`: what the matcher made of the token where it has taken it already
        (`_take_tokens`; None: it takes it here); `jump_checked`: that status says whether
        text is forced next (JUMPS), so the jump-forward hook runs only where it is."""
        m = req.matcher
        if m is not None:
            if status is None:
                status, jump_checked = accept_one(m, tok), False
            if status & FAILED:
                raise EngineError(f"grammar failed on sampled token {tok}")
            if not status & ACCEPTED:
                self._raise_rejected(req, tok)
        if req.ends_at(tok, terminated=m is not None and bool(status & TERMINATED)):
            req.finish("stop")
            return
        req.append([tok])
        if req.thinking:  # HOOK(reasoning): the closing tag, a stop token or the budget
            self.reasoner.after_token(req)
        if req.num_output >= req.close_at:  # HOOK(closing): max_tokens, or a budget check due
            self.closer.at_budget(req, m is not None and bool(status & COMPLETED))
            if req.finished:
                return
        if req.finish_if_done(m is not None and bool(status & COMPLETED), lambda: self._only_stop_allowed(m)):
            return
        if jump_forward and req.jump_forward and self.jump_forward_hook is not None and (
                m is None or not jump_checked or status & JUMPS):
            self.jump_forward_hook(self, req)

    def _raise_rejected(self, req: Request, tok: int) -> None:
        """The matcher refused the sampled token. Where no token its mask allows is accepted
        (the mask is empty, or llguidance's mask over-approximates), the constraint needs text
        this model's vocabulary cannot spell: the request's constraint is at fault."""
        m = req.matcher
        allowed = allowed_ids(self._mask_row.fill(m))
        if not m.is_completed() and len(allowed) <= DEAD_END_PROBES and not any(
                would_accept(m, int(t)) for t in allowed):
            raise UnsatisfiableConstraintError(
                f"the constraint cannot be continued after {req.num_output} output token(s): "
                "no token of this model's vocabulary spells the text it requires next (often a "
                "character the tokenizer has no bytes for); allow other text at that point")
        why = m.error()
        raise EngineError(f"grammar rejected sampled token {tok}; the mask and matcher disagree"
                          + (f" ({m.backend}: {why})" if why else ""))

    def _only_stop_allowed(self, matcher) -> bool:
        return self._mask_row.only_stop(matcher)

    def _notify(self, req: Request) -> None:
        if req.on_update is not None and (req.progress_updates or req.finished):
            try:
                req.on_update(req)
            except Exception:  # a broken callback must not break the loop
                log.exception("on_update callback of request %d failed", req.id)

    # -- synchronous convenience ----------------------------------------------------------------
    def run(self, requests: list[Request]) -> list[Request]:
        """Add requests and step until all of them have finished (no background thread)."""
        for r in requests:
            self.add_request(r)
        while any(not r.finished for r in requests):
            self.step()
        return requests


def _nobody_waits() -> bool:
    return False


__all__ = ["Engine", "Request", "RequestStatus", "SamplingParams", "freeze_heap"]
