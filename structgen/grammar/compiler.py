"""GrammarCompiler: constraint -> CompiledGrammar for one tokenizer, with backend choice and a
cache.

One compiler per tokenizer. Compiling a JSON schema costs milliseconds to seconds; a cache hit
costs about a microsecond (a dict lookup under a lock), so the API can call `compile` on every
request.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from structgen.errors import (
    InvalidConstraintError,
    InvalidParameterError,
    StructgenError,
    UnsatisfiableConstraintError,
    UnsupportedSchemaError,
)
from structgen.grammar.backends.base import CompiledGrammar, GrammarBackend
from structgen.grammar.compile_pool import CompilePool
from structgen.grammar.large_stack import call_on_large_stack
from structgen.grammar.native import MAX_GRAMMAR_THREADS
from structgen.grammar.termination import analyse, check_not_empty, native_library
from structgen.sampling import check_int, check_number
from structgen.schema import keywords
from structgen.schema.budget import (
    DEFAULT_COMPILE_TIMEOUT_S,
    CompileBudget,
    check_budget,
    current_budget,
    within,
)
from structgen.schema.keywords import BACKENDS, unsupported_schema_error
from structgen.schema.limits import BUILD_LIMITS, DEFAULT_LIMITS, ConstraintLimits, check_source

# Compiles are CPU-bound and hold the GIL for part of their time: past a few dozen threads more
# only queue, and each is a thread the process keeps.
MAX_COMPILE_WORKERS = 64

if TYPE_CHECKING:
    from structgen.types import Constraint

log = logging.getLogger("structgen")


class GrammarCompiler:
    """Compiles constraints into grammars for one tokenizer and caches them.

    Parameters
    ----------
    tokenizer : a HF fast tokenizer (`transformers.PreTrainedTokenizerFast`).
    vocab_size : the MODEL's vocabulary size (lm_head rows), which sizes the bitmask; ids the
        tokenizer does not have are never allowed.
    stop_token_ids : tokens that end generation; a grammar allows them only where it may end.
    backend : "auto" (per constraint, the first of xgrammar, llguidance that enforces all of
        it), "xgrammar" or "llguidance".
    cache_size : compiled grammars kept (least recently used are dropped).
    threads : xgrammar compile threads (0: up to 8, one per core).
    limits : the largest constraint compiled (`ConstraintLimits`: source bytes, nesting depth,
        enum values), checked before any other work; over one, `ConstraintTooLargeError`.
    compile_timeout : seconds one compile may take (its Python-side work stops there, a native
        compile's result is dropped); over it, `ConstraintTooLargeError`.
    workers, max_queued : `submit`'s own pool: compiles run on `workers` threads, and more than
        `max_queued` different constraints waiting or running fail at once (`CompilerBusyError`).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        backend: str = "auto",
        *,
        cache_size: int = 256,
        threads: int = 0,
        limits: ConstraintLimits = DEFAULT_LIMITS,
        compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S,
        workers: int = 2,
        max_queued: int = 64,
    ):
        check_backend_name(backend)
        check_grammar_limits(limits, compile_timeout)
        _check_compiler_sizes(threads, workers, max_queued, cache_size)
        if not stop_token_ids:
            raise ValueError("stop_token_ids must name at least one token (e.g. the EOS id)")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.backend = backend
        self.cache_size = cache_size
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._backends: dict[str, GrammarBackend] = {}
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._quick: OrderedDict[tuple, bool] = OrderedDict()  # `compiles_quickly`, by constraint key
        self._lock = threading.Lock()
        self.limits = limits
        self.compile_timeout = compile_timeout
        self._pool = CompilePool(self, workers, max_queued)
        native_library()  # built now (a second, once per machine), not in a burst's first compiles

    def submit(
        self, output: Constraint | Any, backend: str | None = None, *, strict: bool = True
    ) -> Future[CompiledGrammar]:
        """`compile(to_constraint(output, strict=strict), backend)` on this compiler's own
        pool: a Future of the compiled grammar (done at once on a cache hit). `output`: a
        `Constraint` or any output type (its schema is then normalized on the pool too).
        Requests for a constraint (or hashable type) already compiling share that compile.
        `future.cancel()` stops waiting; once every request for it has cancelled, the compile
        stops at its next budget check (`RequestCancelledError` inside). The Future raises
        what `compile` and `to_constraint` raise. Raises `CompilerBusyError` at once when
        `max_queued` compiles are already waiting or running."""
        return self._pool.submit(output, backend, strict)

    def join(self, constraint: Constraint, backend: str | None = None) -> Future[CompiledGrammar] | None:
        """A Future of `constraint`'s compile where one is in flight already (shared, as
        `submit` would share it, cancelled alike), else None: many callers of one new schema
        wait for its one compile without each taking a place in the queue."""
        return self._pool.join(constraint, backend)

    def warm_up(self) -> None:
        """Build now what the first compiles would build under the GIL, holding up the compiles
        and requests of a server's first burst: each backend's vocabulary tables (0.17 s for
        llguidance's on the 2-core VM), the schema layer's Unicode classes (0.22 s) and its
        lazily imported modules. The server calls it after loading the model."""
        from structgen.schema import charsets
        from structgen.types import to_constraint

        for name in BACKENDS if self.backend == "auto" else [self.backend]:
            self.adapter(name)
        charsets.warm_up()
        to_constraint(_WARM_UP_SCHEMA)  # imports normalization, patterns, formats, the metaschema

    def close(self) -> None:
        """Cancel the compiles `submit` has in flight (their Futures raise
        `RequestCancelledError`) and end its worker threads (`LLM.close()` calls it); later
        `submit`s that need a compile raise `StructgenError`, while `compile` still runs on the
        caller's thread. Idempotent."""
        self._pool.close()

    def compile(self, constraint: Constraint, backend: str | None = None) -> CompiledGrammar:
        """The compiled grammar for `constraint` (from the cache when seen before).

        Raises `UnsupportedSchemaError` when no allowed backend enforces every keyword of a
        JSON schema (unless the constraint was made with strict=False) nor of its stricter
        `fallback`, `ConstraintTooLargeError` over a size limit or the time budget,
        `UnsatisfiableConstraintError` for a constraint with no finite output (a rule or
        `$ref` that never ends, a regex that matches nothing) and `InvalidConstraintError`
        for malformed regexes and grammars.
        """
        name = backend or self.backend
        hit = self._cached((constraint.key, name))
        if hit is not None:
            return hit
        with within(None if current_budget() else CompileBudget(self.compile_timeout, constraint.description)):
            return self._compile_checked(constraint, name, backend)

    def _compile_checked(self, constraint: Constraint, name: str, backend: str | None) -> CompiledGrammar:
        check_source(constraint.kind, constraint.source, constraint.description, self.limits)
        try:
            candidates = candidate_backends(constraint, name)
            # "auto" and an explicit backend share what either compiled
            compiled = next(
                filter(None, (self._cached((constraint.key, b)) for b in candidates)), None
            )
            if compiled is None:
                compiled = self._compile(constraint, candidates)
        except UnsupportedSchemaError as refused:
            if constraint.fallback is None:
                raise
            try:  # the stricter schema (see `Constraint.fallback`)
                compiled = self.compile(constraint.fallback, backend)
            except StructgenError:
                raise refused from None
            log.warning(
                "%s: %s; compiled a stricter equivalent instead (every output valid, some "
                "valid outputs excluded)", constraint.description, refused,
            )  # fmt: skip
        with self._lock:  # two threads may compile the same key; either result is fine
            self._cache[(constraint.key, name)] = compiled
            self._cache[(constraint.key, compiled.backend)] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def compiles_quickly(self, constraint: Constraint) -> bool:
        """Whether `constraint` compiles quickly: its first backend builds its masks lazily
        (llguidance), not ahead of time for every state (xgrammar; docs/performance.md,
        "Compiles of a burst, quick ones first"); a constraint no backend takes fails as
        quickly. Remembered per constraint (the check reads the whole schema)."""
        quick = self._quick.get(constraint.key)
        if quick is None:
            try:
                quick = constraint.kind == "text" or candidate_backends(constraint, self.backend)[0] != "xgrammar"
            except (StructgenError, ValueError):
                quick = True
            with self._lock:
                self._quick[constraint.key] = quick
                while len(self._quick) > 4 * self.cache_size + 64:
                    self._quick.popitem(last=False)
        return quick

    def cached(self, constraint: Constraint, backend: str | None = None) -> CompiledGrammar | None:
        """The grammar `submit(constraint, backend)` would return at once from the cache, or None."""
        return self._cached((constraint.key, backend or self.backend))

    def _cached(self, key: tuple) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _compile(self, constraint: Constraint, candidates: list[str]) -> CompiledGrammar:
        # the native parsers recurse once per nested rule: see large_stack
        return call_on_large_stack(functools.partial(self._compile_here, constraint, candidates))

    def _compile_here(self, constraint: Constraint, candidates: list[str]) -> CompiledGrammar:
        lengths = analyse(constraint)  # refuses what never ends before masks are built
        errors: list[tuple[str, StructgenError]] = []
        for name in candidates:
            try:
                compiled = self.adapter(name).compile(constraint)
            except StructgenError as e:
                errors.append((name, e))
                continue
            check_budget()
            compiled.forced_text_bounded = lengths is not None and lengths.forced_text_bounded()
            try:
                check_not_empty(compiled, self.vocab_size)
            except UnsatisfiableConstraintError as e:
                if not errors:
                    raise
                # the backends before it may have said why more plainly (xgrammar names a
                # `$ref` chain that resolves to itself where llguidance only stops)
                said = "; ".join(f"{name} refused it: {error}" for name, error in errors)
                raise UnsatisfiableConstraintError(f"{e}; {said}") from e
            return compiled
        if len(errors) == 1:
            raise errors[0][1]
        first = errors[0][1]
        message = f"no grammar backend can compile {constraint.description}: " + "; ".join(
            str(e) for _, e in errors
        )
        if isinstance(first, UnsupportedSchemaError):
            keyword = next((e.keyword for _, e in errors if getattr(e, "keyword", None)), None)
            raise UnsupportedSchemaError(message, keyword=keyword) from first
        raise type(first)(message) from first

    def adapter(self, name: str) -> GrammarBackend:
        """The adapter of backend `name` for this tokenizer, built on first use (it reads the
        whole vocabulary); it compiles without the keyword table, see `candidate_backends`."""
        with self._lock:
            if name not in self._backends:
                if name == "xgrammar":
                    from structgen.grammar.backends.xgrammar import XGrammarBackend

                    self._backends[name] = XGrammarBackend(
                        self.tokenizer, self.vocab_size, self.stop_token_ids, threads=self.threads
                    )
                else:
                    from structgen.grammar.backends.llguidance import LLGuidanceBackend

                    self._backends[name] = LLGuidanceBackend(
                        self.tokenizer, self.vocab_size, self.stop_token_ids
                    )
            return self._backends[name]


# A schema through the schema layer's usual paths (`warm_up`): a pattern, a format, bounds,
# an optional union, a reference.
_WARM_UP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]+$", "maxLength": 12},
                   "when": {"type": "string", "format": "date-time"},
                   "count": {"type": "integer", "minimum": 0, "maximum": 1000},
                   "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                   "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 4}},
    "required": ["code", "count"],
    "$defs": {"tag": {"enum": ["a", "b"]}},
}


def candidate_backends(constraint: Constraint, backend: str = "auto") -> list[str]:
    """The backends `GrammarCompiler.compile` tries for `constraint`, in order: for JSON
    schemas, those that enforce every keyword (see `keywords`), so "auto" never falls back to
    one that would silently ignore a keyword; xgrammar (fastest masks) first, unless its
    compile would be slow for this schema (`keywords.xgrammar_compile_cost`). Needs no
    tokenizer.

    Raises `UnsupportedSchemaError` when none qualifies (strict constraints only).
    """
    check_backend_name(backend)
    allowed = list(BACKENDS) if backend == "auto" else [backend]
    kind = constraint.kind
    if kind == "json_schema":
        schema = json.loads(constraint.source)
        issues = {b: keywords.find_issues(schema, b) for b in allowed}
        if not constraint.strict:  # best effort: fewest unenforced keywords first
            return sorted(allowed, key=lambda b: len(issues[b]))
        ok = [b for b in allowed if not issues[b]]
        if not ok:
            raise unsupported_schema_error(issues)
        if backend == "auto" and ok[0] == "xgrammar" and keywords.xgrammar_compile_cost(schema):
            ok.reverse()  # both enforce it; llguidance compiles in ms where xgrammar takes seconds
        return ok
    issue = None
    if kind == "regex":
        issue = keywords.regex_issue(constraint.source) or keywords.ascii_class_issue(constraint.source)
    if issue and "xgrammar" in allowed:
        if backend == "xgrammar":
            raise InvalidConstraintError(
                f"xgrammar would not enforce regex {constraint.source!r} as written ({issue}); use "
                "backend 'llguidance' or 'auto', or rewrite it without (lookaround: (?=...), (?!...), "
                "(?<=...), (?<!...); \\D, \\W: a class such as [^0-9])"
            )
        allowed.remove("xgrammar")
    if kind == "grammar" and constraint.syntax == "lark" and backend == "auto":
        return ["llguidance", "xgrammar"]  # Lark is llguidance's native syntax
    return allowed


def check_backend_name(name: object) -> None:
    """Refuse a backend that is not 'auto' or one of BACKENDS, with the nearest as a hint."""
    if name == "auto" or name in BACKENDS:
        return
    close = difflib.get_close_matches(name, ["auto", *BACKENDS], n=1) if isinstance(name, str) else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise InvalidParameterError(
        f"unknown grammar backend {name!r}; use 'auto', {', '.join(map(repr, BACKENDS))}{hint}"
    )


def check_grammar_limits(limits: ConstraintLimits, compile_timeout: float) -> None:
    """Refuse limits that are not a `ConstraintLimits` of positive integers, or a compile
    time budget that is not a positive number of seconds (before a model loads)."""
    if not isinstance(limits, ConstraintLimits):
        raise InvalidParameterError(f"limits must be a ConstraintLimits, got {type(limits).__name__}; pass e.g. "
                                    "limits=structgen.ConstraintLimits(max_enum_values=50_000)")
    for name, most in (("max_source_bytes", BUILD_LIMITS.max_source_bytes), ("max_depth", BUILD_LIMITS.max_depth),
                       ("max_enum_values", None)):
        check_int(f"ConstraintLimits.{name}", getattr(limits, name), 1, most)
    check_number("compile_timeout (seconds)", compile_timeout, 0.0, None, open_low=True)


def _check_compiler_sizes(threads: int, workers: int, max_queued: int, cache_size: int) -> None:
    """Each is a thread count, a queue or a cache the user sizes: a bound keeps one argument
    from starting thousands of threads or holding every grammar ever compiled."""
    check_int("GrammarCompiler threads (0: auto)", threads, 0, MAX_GRAMMAR_THREADS)
    check_int("GrammarCompiler workers", workers, 1, MAX_COMPILE_WORKERS)
    check_int("GrammarCompiler max_queued", max_queued, 1, None)
    check_int("GrammarCompiler cache_size", cache_size, 0, None)
