"""llguidance backend: an Earley parser over a lazily built lexer; covers more of JSON Schema
than xgrammar and refuses (instead of ignoring) what it cannot enforce."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import llguidance

from structgen.errors import (
    ConstraintTooLargeError,
    EngineError,
    InvalidConstraintError,
    UnsatisfiableConstraintError,
    UnsupportedSchemaError,
)
from structgen.grammar.backends.base import (
    FORCED_TEXT_MAX_BYTES,
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    control_token_ids,
    set_only_tokens,
    token_bytes,
)
from structgen.schema.json_format import JSON_SEPARATORS
from structgen.schema.keywords import llguidance_crash_issues, strip_annotation_formats

if TYPE_CHECKING:
    import torch

    from structgen.types import Constraint

# Same fixed format as xgrammar (see json_format.py); applied as overrides so a schema's own
# "x-guidance" options cannot bring back unbounded whitespace.
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": JSON_SEPARATORS[0],
    "key_separator": JSON_SEPARATORS[1],
}
# strict=False: best effort; ignore unimplemented keywords and treat oneOf as anyOf.
LENIENT_OPTIONS = {**JSON_OPTIONS, "lenient": True, "coerce_one_of": True}
ANY_TEXT_LARK = r"start: /(?s:.*)/"
# llguidance analyses each lexeme's regex (a pattern and its length bounds together) with a
# budget; past it, the lexeme silently matches less than it should (MaskBench Github_medium
# 132/133: strings with pattern "^(?:\\S+\\s+){0,49}\\S+$" and maxLength 500 rejected valid
# text). 20x the default (1M, a short analysis) fixes those at a bounded compile cost.
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=20_000_000)


class LLGuidanceMatcher(GrammarMatcher):
    """Adapts `llguidance.LLMatcher` to our semantics.

    llguidance enters a permanent error state on a rejected token and does not count the stop
    token in its rollback history, so tokens are offered with `try_consume_tokens` (which
    leaves the state alone on rejection) and the stop token is tracked here.
    """

    backend = "llguidance"

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: Sequence[int]):
        self.ll_matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._stop = frozenset(stop_token_ids)
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        return self.accept_tokens((token_id,)) == 1

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        if self._terminated:
            return 0
        self.version += 1
        ids = list(token_ids)
        stop_at = next((i for i, t in enumerate(ids) if t in self._stop), len(ids))
        n = self.ll_matcher.try_consume_tokens(ids[:stop_at]) if stop_at else 0
        if n == stop_at < len(ids) and self.ll_matcher.is_accepting():
            self._terminated = True
            return n + 1
        return n

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            set_only_tokens(bitmask, row, self._stop_token_ids)
        else:
            _check_bitmask(bitmask, row)
            words = bitmask.shape[1]
            self.ll_matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), words * 4)
            if self.ll_matcher.is_error():
                raise self._failure("computing the token mask")

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        self.version += 1
        if self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens and not self.ll_matcher.rollback(num_tokens):
            raise self._failure(f"rolling back {num_tokens} token(s)")

    def _failure(self, action: str) -> EngineError | InvalidConstraintError:
        """The error for a matcher that failed while `action`: the constraint's own fault where
        llguidance's lexer or parser grew past its limit (a bounded repeat of a group in a regex
        multiplies the lexer's states: seen with `(?:\\S+\\s+){0,99}` in a MaskBench schema; a
        required property that refers back to its own object makes every value endless, and the
        parser's items grow without bound) or where it allows no token (a dead end inside it),
        else ours."""
        error = self.ll_matcher.get_error()
        if "too many expressions" in error or "LexerTooComplex" in error:
            return ConstraintTooLargeError(
                f"the constraint grew too complex for llguidance's lexer while {action} ({error.splitlines()[0]}); "
                "simplify its regex patterns (bounded repeats of groups, such as (?:\\S+\\s+){0,99}, multiply "
                "the lexer's states) or compile it with backend='xgrammar'"
            )
        if "Too many items" in error or "ParserTooComplex" in error:
            return ConstraintTooLargeError(
                f"the constraint grew too complex for llguidance's parser while {action} ({error.splitlines()[0]}); "
                "a very long repetition (\"a\"{100000} in a grammar, a huge minItems) or a schema whose required "
                "properties lead back to the same object ({'$ref': '#'} under 'required', which has no finite "
                "value) does this: shorten the repetition or make the recursion optional; else simplify the "
                "constraint or compile it with backend='xgrammar'"
            )
        if "NoExtensionBias" in error:
            return UnsatisfiableConstraintError(
                f"the constraint allows no token at this point of the output ({error.splitlines()[0]} while "
                f"{action}): a part of it matches nothing (an alternative no value satisfies, a $ref loop); "
                "fix that part"
            )
        return EngineError(f"grammar failed while {action}: {error}")

    def jump_forward_string(self, max_bytes: int = FORCED_TEXT_MAX_BYTES) -> str:
        if self._terminated:
            return ""
        # llguidance bounds its forced bytes itself; they may end inside a UTF-8 character
        # (the rest comes with the next step).
        return self.ll_matcher.compute_ff_bytes()[: max(0, max_bytes)].decode("utf-8", errors="ignore")

    def is_terminated(self) -> bool:
        return self._terminated

    def error(self) -> str | None:
        m = self.ll_matcher
        if m.is_error():
            return m.get_error()
        return f"llguidance stopped: {m.stop_reason()}" if m.is_stopped() else None

    def is_completed(self) -> bool:
        return self._terminated or self.ll_matcher.is_accepting()

    def reset(self) -> None:
        self.version += 1
        self.ll_matcher.reset()
        self._terminated = False


class LLGuidanceCompiledGrammar(CompiledGrammar):
    """Holds one matcher at the start state; new matchers are deep copies of it, which share
    the compiled lexer and parser tables (microseconds instead of re-building the grammar)."""

    def __init__(
        self,
        constraint: Constraint,
        template: llguidance.LLMatcher,
        tokenizer: llguidance.LLTokenizer,
        stop_ids: list[int],
    ):
        super().__init__("llguidance", constraint)
        self._template = template
        self._tokenizer = tokenizer
        self._stop_token_ids = stop_ids

    def matcher(self) -> LLGuidanceMatcher:
        m = LLGuidanceMatcher(self._template.deep_copy(), self._stop_token_ids)
        m.grammar = self
        return m

    def _accepts_text(self, text: str) -> bool:
        m = self._template.deep_copy()
        ids = self._tokenizer.tokenize_str(text)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


class _VocabBytes:
    """What `llguidance.TokenizerWrapper` reads: every token's bytes, the special ids and an
    encode function (for text the grammar forces; not used to compute masks)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        tokens = list(token_bytes(tokenizer, vocab_size))
        # Special: the control tokens and ids without bytes (padding of a wider LM head). The
        # stop tokens explicitly: where a tokenizer does not list one in `all_special_ids` (the
        # GPU machine's transformers), llguidance took `<|im_end|>` for text and allowed it
        # inside JSON strings, while the adapter stops on it.
        special = control_token_ids(tokenizer, vocab_size, stop_token_ids)
        special |= {t for t, b in enumerate(tokens) if not b}
        for t in special:  # llguidance marks specials itself; give them their text
            name = tokenizer.convert_ids_to_tokens(t) if t < len(tokenizer) else None
            tokens[t] = (name or f"<special_{t}>").encode()
        self.tokens = tokens
        self.special_token_ids = sorted(special)
        self.eos_token_id = stop_token_ids[0] if stop_token_ids else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        # llguidance calls back here for forced text (often, e.g. at every jump-forward check):
        # the Rust tokenizer behind a fast HF tokenizer is much cheaper than `encode`.
        fast = getattr(tokenizer, "backend_tokenizer", None)
        self._encode = (
            (lambda s: fast.encode(s, add_special_tokens=False).ids)
            if fast is not None
            else (lambda s: tokenizer.encode(s, add_special_tokens=False))
        )

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


class LLGuidanceBackend(GrammarBackend):
    """Compiles constraints into llguidance grammars for one tokenizer."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        # Token bytes come from xgrammar's TokenizerInfo rather than from llguidance.hf, which
        # re-parses the tokenizer's JSON: with transformers 5.17 (the GPU machine) that JSON
        # no longer reads as byte-level BPE there, every "Ġ" stays a literal character, and
        # the masks go wrong (after `":` only `:` was allowed).
        vocab = _VocabBytes(tokenizer, vocab_size, list(stop_token_ids))
        self._tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(vocab), n_vocab=vocab_size, eos_token=list(stop_token_ids)
        )

    def compile(self, constraint: Constraint) -> LLGuidanceCompiledGrammar:
        grammar = self._grammar(constraint)
        # The constructor builds the lexer and parser (GIL released) and records, instead of
        # raising, any error in the grammar.
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            what = (
                f"llguidance cannot compile {constraint.description}: {_clean(matcher.get_error())}"
            )
            if constraint.kind == "json_schema" and "Unsatisfiable schema" in matcher.get_error():
                # a schema nothing satisfies (`{"not": {}}`, contradictory `allOf`): the caller's
                # to fix, not a keyword another backend or strict=False could take
                raise UnsatisfiableConstraintError(f"{what}; no JSON value satisfies it")
            if constraint.kind == "json_schema":
                raise UnsupportedSchemaError(
                    what, keyword=_unimplemented_keyword(matcher.get_error())
                )
            raise InvalidConstraintError(what)
        return LLGuidanceCompiledGrammar(constraint, matcher, self._tokenizer, self.stop_token_ids)

    def _grammar(self, constraint: Constraint) -> str:
        M = llguidance.LLMatcher
        try:
            if constraint.kind == "json_schema":
                schema = strip_annotation_formats(json.loads(constraint.source))
                _refuse_crashing(schema, constraint.description)
                options = JSON_OPTIONS if constraint.strict else LENIENT_OPTIONS
                return M.grammar_from_json_schema(json.dumps(schema), overrides=options)
            if constraint.kind == "regex":
                return M.grammar_from_regex(constraint.source)
            if constraint.kind == "grammar" and constraint.syntax == "lark":
                for schema in _lark_json_schemas(constraint.source):
                    _refuse_crashing(schema, f"the %json schema in {constraint.description}")
                return M.grammar_from_lark(constraint.source)
            if constraint.kind == "grammar":
                return llguidance.grammar_from("gbnf", constraint.source)
            return M.grammar_from_lark(ANY_TEXT_LARK)
        except ValueError as e:  # GBNF that does not convert to Lark, malformed JSON
            raise InvalidConstraintError(
                f"llguidance cannot read {constraint.description}: {e}"
            ) from e


def _refuse_crashing(schema: Any, what: str) -> None:
    """Raise before llguidance sees a schema its native compiler would crash on (the process
    dies, so its own errors never come); `GrammarCompiler` skips this backend for them, but a
    best-effort compile (strict=False) and Lark's `%json` schemas still come here."""
    found = llguidance_crash_issues(schema)
    if found:
        raise UnsupportedSchemaError(
            f"llguidance cannot compile {what}: {found[0]}",
            keyword=found[0].keyword,
            path=found[0].path,
        )


_LARK_JSON = re.compile(r"%json\s*(?=\{)")


def _lark_json_schemas(source: str) -> Iterator[Any]:
    """The JSON schemas a Lark grammar inlines with `%json {...}` (tool-call grammars do);
    text that does not parse as JSON is left to llguidance, which refuses it."""
    decoder = json.JSONDecoder()
    for found in _LARK_JSON.finditer(source):
        try:
            yield decoder.raw_decode(source, found.end())[0]
        except (ValueError, RecursionError):
            continue


def _clean(message: str) -> str:
    """First lines of llguidance's message (it appends parser state dumps), its own option
    names put as ours."""
    text = " ".join(message.strip().split("\n<state>")[0].split())[:600]
    return text.replace("Enable 'coerce_one_of' option to approximate oneOf with anyOf",
                        "(branches no value can match twice); pass strict=False to generate it as anyOf "
                        "and validate the output against the oneOf afterwards")


def _unimplemented_keyword(message: str) -> str | None:
    # 'Unimplemented keys: ["uniqueItems"]'
    if "Unimplemented keys: [" in message:
        rest = message.split("Unimplemented keys: [", 1)[1]
        return rest.split("]", 1)[0].split(",")[0].strip().strip('"') or None
    return None


def fill_job(
    matchers: Sequence[LLGuidanceMatcher], rows: Sequence[int], bitmask: torch.Tensor, threads: int
) -> tuple[Callable[[], None] | None, None]:
    """Fill many rows at once with llguidance's thread pool: `run` is one native call (Rust,
    outside the GIL) that may run on another thread; terminated rows are written here."""
    live = []
    for m, r in zip(matchers, rows, strict=True):
        if m.is_terminated():
            m.fill_bitmask(bitmask, r)
        else:
            live.append((m.ll_matcher, r))
    if not live:
        return None, None
    _check_bitmask(bitmask, max(r for _, r in live))
    executor, ptr, words, n = _executor(threads), bitmask.data_ptr(), bitmask.shape[1], bitmask.shape[0]
    return (lambda: executor.unsafe_compute_mask_ptr(live, ptr, words * 4, n)), None


def _check_bitmask(bitmask: torch.Tensor, row: int) -> None:
    """llguidance writes through a raw pointer (what `llguidance.torch` does too; that module
    is not imported because it compiles a torch kernel at import, which takes seconds), so check first."""
    import torch

    if not (
        bitmask.dtype == torch.int32
        and bitmask.device.type == "cpu"
        and bitmask.dim() == 2
        and bitmask.is_contiguous()
        and 0 <= row < bitmask.shape[0]
    ):
        raise ValueError(
            f"bitmask must be a contiguous CPU int32 [rows, words] tensor with row {row} in range, "
            f"got {tuple(bitmask.shape)} {bitmask.dtype} on {bitmask.device}"
        )


_EXECUTORS: dict[int, llguidance.LLExecutor] = {}


def _executor(threads: int) -> llguidance.LLExecutor:
    if threads not in _EXECUTORS:
        _EXECUTORS[threads] = llguidance.LLExecutor(threads if threads > 0 else None)
    return _EXECUTORS[threads]
