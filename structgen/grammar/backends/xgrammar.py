"""xgrammar backend: the default. Compiles a pushdown automaton with precomputed token masks;
matchers are C++ objects; batch mask fills run outside the GIL, per-matcher calls keep it."""

from __future__ import annotations

import queue
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xgrammar as xgr

from structgen.errors import EngineError, InvalidConstraintError, UnsupportedSchemaError
from structgen.grammar import native
from structgen.grammar.backends.base import (
    FORCED_TEXT_MAX_BYTES,
    TERMINATED,
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    control_token_ids,
    set_only_tokens,
    token_bytes,
    truncate_utf8,
)
from structgen.schema.json_format import JSON_SEPARATORS
from structgen.schema.patterns import dot_without_newline

if TYPE_CHECKING:
    from structgen.types import Constraint

ANY_TEXT_REGEX = r"[\s\S]*"
# Matcher methods of a few microseconds that keep the GIL (`keep_gil_for_matcher_calls`).
GIL_KEEPING_METHODS = ("accept_token", "rollback", "find_jump_forward_string", "is_completed", "is_terminated",
                       "fill_next_token_bitmask", "reset")
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[09:00:51] /project/cpp/x.cc:83: "


class XGrammarMatcher(GrammarMatcher):
    """Thin wrapper: xgrammar's matcher already has the semantics the engine wants.

    Termination is tracked here (xgrammar terminates exactly when it accepts one of the stop
    tokens its tokenizer info was built with, the ones given here): the engine asks every row
    every step, and an attribute costs less than a native call."""

    backend = "xgrammar"

    def __init__(self, matcher: xgr.GrammarMatcher, stop_token_ids: Sequence[int], words: int | None = None,
                 forced_text_bounded: bool = True):
        self.xgr_matcher = matcher
        # xgrammar's jump-forward string has no length limit: asked only where the grammar
        # bounds it (`CompiledGrammar.forced_text_bounded`), then cut to the caller's limit.
        self.forced_text_bounded = forced_text_bounded
        self._handle = native.handle(matcher)  # for grammar.native's batch fills
        # The FFI object behind xgrammar's Python class: its methods called directly skip a
        # wrapper a call (jump-forward makes ~15 accepts and as many probes a jump).
        self._ffi = matcher._handle
        self._stop_token_ids = stop_token_ids
        self._stop = frozenset(stop_token_ids)
        self._terminated = False
        self._words = words  # bitmask words xgrammar fills; the rest (padding ids) stay 0

    def accept_token(self, token_id: int) -> bool:
        self.version += 1
        if self._terminated:
            return False
        ok = self._ffi.accept_token(token_id, False)
        if ok and token_id in self._stop:
            self._terminated = True
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        self.version += 1
        if self._terminated:
            return 0
        accept, stop = self._ffi.accept_token, self._stop
        for n, tid in enumerate(token_ids):
            if not accept(tid, False):
                return n
            if tid in stop:
                self._terminated = True
                return n + 1
        return len(token_ids)

    def first_accepted(self, token_ids: Sequence[int]) -> int | None:
        if self._terminated:
            return None
        accept = self._ffi.accept_token
        for tid in token_ids:
            if accept(tid, False):
                self.version += 1
                self._ffi.rollback(1)
                return tid
        return None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:  # xgrammar raises here; see base class
            set_only_tokens(bitmask, row, self._stop_token_ids)
        elif self._words is None:
            self.xgr_matcher.fill_next_token_bitmask(bitmask, row)
        else:  # xgrammar ignores row strides: fill a tokenizer-wide row, then place it
            row_mask = np.empty((1, self._words), dtype=np.int32)
            self.xgr_matcher.fill_next_token_bitmask(torch.from_numpy(row_mask), 0)
            _place_rows(bitmask, [row], row_mask)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        self.version += 1
        try:
            self._ffi.rollback(num_tokens)
        except RuntimeError as e:
            raise EngineError(f"grammar rollback of {num_tokens} tokens failed: {_clean(e)}") from e
        self._terminated = False  # a stop token is always the last one accepted

    def jump_forward_string(self, max_bytes: int = FORCED_TEXT_MAX_BYTES) -> str:
        if self._terminated or not self.forced_text_bounded:
            return ""
        return truncate_utf8(str(self._ffi.find_jump_forward_string()), max_bytes)

    def is_terminated(self) -> bool:
        return self._terminated

    def is_completed(self) -> bool:
        return self._ffi.is_completed()

    def reset(self) -> None:
        self.version += 1
        self.xgr_matcher.reset()
        self._terminated = False


class XGrammarCompiledGrammar(CompiledGrammar):
    def __init__(
        self, constraint: Constraint, compiled: xgr.CompiledGrammar, stop_ids: list[int], words: int | None = None,
        forced_text_bounded: bool = True,
    ):
        super().__init__("xgrammar", constraint, forced_text_bounded)
        self.xgr_compiled = compiled
        self._stop_token_ids = stop_ids
        self._words = words

    def matcher(self) -> XGrammarMatcher:
        m = XGrammarMatcher(
            xgr.GrammarMatcher(self.xgr_compiled), self._stop_token_ids, self._words, self.forced_text_bounded
        )
        m.grammar = self
        return m

    def _accepts_text(self, text: str) -> bool:
        m = xgr.GrammarMatcher(self.xgr_compiled)
        return m.accept_string(text) and m.is_completed()


class XGrammarBackend(GrammarBackend):
    """Compiles constraints with `xgrammar.GrammarCompiler` for one tokenizer."""

    name = "xgrammar"

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], threads: int = 8
    ):
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        keep_gil_for_matcher_calls()
        # A model whose embedding is wider than its tokenizer (padded vocabularies, or a
        # random-weight 128k-vocab shape with a 49k tokenizer): xgrammar would treat every
        # padding id as a special token and check it on every step (much slower fills). Give
        # it the tokenizer's own size and leave the padding words of each mask row at zero.
        tokenizer_size = len(tokenizer)
        self._words = (tokenizer_size + 31) // 32 if tokenizer_size < vocab_size else None
        if self._words is not None and any(t >= tokenizer_size for t in stop_token_ids):
            self._words = None  # a stop id in the padding: keep the full width
        size = vocab_size if self._words is None else tokenizer_size
        # The tokens' bytes as xgrammar decodes them (`token_bytes`, shared with jump-forward and
        # the llguidance adapter: one decode of the vocabulary), given raw. xgrammar takes a
        # token for a control token only where its text is empty: SmolLM2's `<|im_start|>` or
        # `<repo_name>` it would allow inside JSON strings, so those are emptied.
        vocab = list(token_bytes(tokenizer, size))
        for t in control_token_ids(tokenizer, size) - set(stop_token_ids):
            vocab[t] = b""
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=size, stop_token_ids=list(stop_token_ids))
        self._info, self._threads = info, threads
        # One xgrammar compiler compiles one grammar at a time (a lock inside), so concurrent
        # compiles each take an idle one; there are never more than compiles ever ran at once.
        self._idle: queue.SimpleQueue[xgr.GrammarCompiler] = queue.SimpleQueue()

    def compile(self, constraint: Constraint) -> XGrammarCompiledGrammar:
        try:
            compiled = self._compile_grammar(build_grammar(constraint))
        except (RuntimeError, ValueError, TypeError) as e:
            what = f"xgrammar cannot compile {constraint.description}: {_clean(e)}"
            if constraint.kind == "json_schema":
                raise UnsupportedSchemaError(what) from e
            raise InvalidConstraintError(what) from e
        return XGrammarCompiledGrammar(constraint, compiled, self.stop_token_ids, self._words)

    def _compile_grammar(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        try:
            compiler = self._idle.get_nowait()
        except queue.Empty:
            # GrammarCompiler (ours) caches compiled grammars; xgrammar's own cache would keep
            # a second reference to each for the process lifetime.
            compiler = xgr.GrammarCompiler(self._info, max_threads=self._threads, cache_enabled=False)
        try:
            return compiler.compile_grammar(grammar)
        finally:
            self._idle.put(compiler)


def keep_gil_for_matcher_calls() -> bool:
    """Make xgrammar's per-matcher calls keep the GIL, process-wide; False where this
    xgrammar's matchers are not apache-tvm-ffi objects (nothing changed).

    tvm-ffi releases the GIL around every call by default. A call of a microsecond that lets
    it go must then take it back, and while another thread runs Python (the event loop
    settling a burst's finished requests, a server streaming) it waits up to that thread's
    switch interval, hundreds of times the call itself; a jump makes a dozen such calls
    (docs/performance.md, "Serving under load"). A single row's fill is kept too (the engine
    thread's jump-forward and finish checks make them); the batch fills, long and run on
    worker threads, still let the GIL go."""
    try:
        from xgrammar.tvm_ffi_binding._ffi_api import GrammarMatcher as FfiMatcher

        methods = {m.name: m.func for m in FfiMatcher.__tvm_ffi_type_info__.methods}
    except (ImportError, AttributeError):
        return False
    for name in GIL_KEEPING_METHODS:
        if hasattr(methods.get(name), "release_gil"):
            methods[name].release_gil = False
    return True


def build_grammar(constraint: Constraint) -> xgr.Grammar:
    """The xgrammar `Grammar` of a constraint: parsed only, no token masks (milliseconds), so
    the compiler can analyse it (grammar/termination.py) before paying for the masks. Raises
    xgrammar's RuntimeError / ValueError / TypeError where it cannot read it."""
    if constraint.kind == "json_schema":
        # strict_mode=False: objects stay open unless the schema closes them (JSON Schema
        # semantics, same as llguidance); structgen.types closes model schemas.
        return xgr.Grammar.from_json_schema(
            constraint.source, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=False
        )
    if constraint.kind == "regex":
        return xgr.Grammar.from_regex(dot_without_newline(constraint.source))
    if constraint.kind == "grammar" and constraint.syntax == "lark":
        return xgr.Grammar.from_lark(constraint.source)
    if constraint.kind == "grammar":
        return xgr.Grammar.from_ebnf(constraint.source)
    # text: any string; the engine may skip masking entirely for it
    return xgr.Grammar.from_regex(ANY_TEXT_REGEX)


def _clean(e: BaseException) -> str:
    """xgrammar's C++ messages start with a timestamp and a source path; keep the message."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(e).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(e).__name__


def fill_job(
    matchers: Sequence[XGrammarMatcher], rows: Sequence[int], bitmask: torch.Tensor, threads: int
) -> tuple[Callable[[], None] | None, Callable[[], None] | None]:
    """Fill many rows at once, in two parts: `run`, one native call that releases the GIL (may
    run on another thread), then `finish` (None: nothing left), on the caller's thread. The
    call is `grammar.native`'s pool where it builds with two threads or more (`threads` is
    then its own), else xgrammar's thread pool with `threads`. Terminated matchers' rows are
    written here and now. The worker must make no other native call before `run`'s: each
    releases and retakes the GIL, which would leave it waiting while another thread runs
    Python (grammar/prefetch.py)."""
    on_pool = native.pool_in_use()  # then the matchers go by their tvm-ffi handles
    live, rows_live = [], []
    for m, r in zip(matchers, rows, strict=True):
        if m._terminated:
            m.fill_bitmask(bitmask, r)
        else:
            live.append(m._handle if on_pool else m.xgr_matcher)
            rows_live.append(r)
    if not live:
        return None, None
    words = matchers[0]._words  # one backend (one tokenizer) per batch
    if on_pool:  # one GIL-free call, spread over the pool's threads
        pool = native.load()
        return (lambda: pool.fill(live, bitmask, rows_live, words)), None
    batch = _batch_matcher(threads)
    if words is None:
        return (lambda: batch.batch_fill_next_token_bitmask(live, bitmask, rows_live)), None
    # Padded vocabulary: xgrammar ignores row strides, so fill a contiguous tokenizer-wide
    # block and place its rows.
    block = np.empty((len(live), words), dtype=np.int32)
    block_rows = list(range(len(live)))
    block_t = torch.from_numpy(block)
    return (lambda: batch.batch_fill_next_token_bitmask(live, block_t, block_rows)), (
        lambda: _place_rows(bitmask, rows_live, block)
    )


def accept_natively(
    matchers: Sequence[XGrammarMatcher], tokens: Sequence[int], check_jump: bool,
    bitmask: torch.Tensor | None, rows: Sequence[int] | None,
) -> list[int]:
    """`grammar.accept_tokens` for xgrammar matchers, where grammar.native builds: one call on
    its pool, the next masks filled in it when `bitmask` is given. Statuses per matcher."""
    words = matchers[0]._words
    status = native.load().advance([m._handle for m in matchers], tokens, check_jump, bitmask, rows, words)
    for m, st in zip(matchers, status, strict=True):
        m.version += 1
        if st & TERMINATED:
            m._terminated = True
    return status


def _place_rows(bitmask: torch.Tensor, rows: list[int], block: np.ndarray) -> None:
    """Copy tokenizer-wide mask rows into `rows` of a model-wide bitmask; the padding words
    are zero (those ids never exist). numpy, not torch: torch's CPU ops start its intra-op
    threads, which fight xgrammar's pool for the cores."""
    out, words, lo = bitmask.numpy(), block.shape[1], rows[0]
    index = slice(lo, lo + len(rows)) if rows == list(range(lo, lo + len(rows))) else rows
    out[index, :words] = block
    out[index, words:] = 0


_BATCH: dict[int, xgr.BatchGrammarMatcher] = {}


def _batch_matcher(threads: int) -> xgr.BatchGrammarMatcher:
    if threads not in _BATCH:
        _BATCH[threads] = xgr.BatchGrammarMatcher(threads if threads > 0 else "auto")
    return _BATCH[threads]
