"""The interface every grammar backend implements, and the token bitmask they share.

The engine only ever talks to these three classes: a `GrammarBackend` turns a `Constraint` into
a `CompiledGrammar` (expensive, cached by `GrammarCompiler`), which hands out one cheap
`GrammarMatcher` per request. The bitmask layout is xgrammar's: an int32 tensor of shape
`[rows, ceil(vocab_size / 32)]`, bit `i % 32` of word `i // 32` set when token `i` is allowed.
llguidance fills the same layout, so one sampler kernel serves both backends.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported lazily so `structgen.grammar` stays cheap to import
    import torch

    from structgen.types import Constraint


def control_token_ids(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int] = ()) -> set[int]:
    """Ids that are control tokens, never text: the stop tokens, the tokenizer's special ids and
    its added tokens marked special (SmolLM2's `<|im_start|>`, `<repo_name>`, ...; Llama 3's
    reserved tokens). Every backend keeps these out of grammar text, so a JSON string cannot
    hold `<|im_start|>`; added tokens not marked special (Qwen's `<tool_call>`) stay text.
    `all_special_ids` alone misses most of them on transformers 5."""
    ids = set(stop_token_ids) | set(getattr(tokenizer, "all_special_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids |= {i for i, t in added.items() if getattr(t, "special", False)}
    return {i for i in ids if 0 <= i < vocab_size}


@functools.lru_cache(maxsize=4)
def token_bytes(tokenizer: Any, vocab_size: int) -> tuple[bytes, ...]:
    """The byte string of every token id below `vocab_size` (b"" for ids the tokenizer lacks).

    Read from xgrammar's `TokenizerInfo`, which knows how every tokenizer family (byte-level
    BPE, SentencePiece with byte fallback, tiktoken) spells its tokens; jump-forward and both
    backends share one table, since building it is a noticeable part of loading a model."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    tokens = [bytes(t) for t in info.decoded_vocab][:vocab_size]
    return tuple(tokens + [b""] * (vocab_size - len(tokens)))


# What became of a matcher that was handed a sampled token (`grammar.accept_tokens`), as bits:
# it took the token; it was a stop token (terminated); the output is a complete match; the
# grammar forces text next (checked on request); its next mask was filled; it raised (the
# other bits then say nothing). The values are csrc/grammar_step.cpp's.
ACCEPTED, TERMINATED, COMPLETED, JUMPS, FILLED, FAILED = 1, 2, 4, 8, 16, 32
# The most forced text one jump-forward question returns: forced text can be arbitrarily long
# (a 20,000-character const, a grammar that doubles its text per rule), and jump-forward takes
# it in pieces of at most this size, one per step.
FORCED_TEXT_MAX_BYTES = 4096


def truncate_utf8(text: str, max_bytes: int) -> str:
    """`text` cut to at most `max_bytes` UTF-8 bytes, at a character boundary."""
    if len(text) * 4 <= max_bytes:  # short enough whatever its characters
        return text
    return text.encode("utf-8", errors="surrogatepass")[: max(0, max_bytes)].decode("utf-8", errors="ignore")


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words per bitmask row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, *, host_only: bool = False) -> torch.Tensor:
    """Allocate a CPU int32 bitmask `[rows, ceil(vocab_size / 32)]` with every token allowed.

    `vocab_size` is the MODEL's vocabulary (its lm_head rows), which may exceed the tokenizer's;
    matchers clear the bits of ids the tokenizer does not have. The tensor is pinned when CUDA
    is available so the per-step host-to-device copy can be asynchronous, unless `host_only`
    (a mask only read on the host: a process's first pinned allocation is slow, and would be
    paid by whichever request needed the mask first).
    """
    import torch

    shape = (rows, bitmask_words(vocab_size))
    pin = not host_only and torch.cuda.is_available()
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)


def set_only_tokens(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Write a row (of a CPU bitmask) that allows exactly `token_ids` (used once a matcher has
    terminated). numpy, not torch indexing: a third of the cost here, and no torch CPU ops."""
    words = bitmask.numpy().view(np.uint32)
    words[row] = 0
    for tid in token_ids:
        word, bit = divmod(tid, 32)
        if word < words.shape[1]:
            words[row, word] |= np.uint32(1 << bit)


class HostMaskRow:
    """A host-only bitmask row kept with its uint32 view, for asking what a matcher allows
    next outside a batch fill (jump-forward, finish checks). numpy on purpose: torch's CPU ops
    start its thread pool for a 49k-bit unpack, milliseconds on a many-core host; and the view
    is made once, as making it costs more than the check."""

    def __init__(self, vocab_size: int, stop_token_ids: Iterable[int]):
        self.tensor = allocate_bitmask(1, vocab_size, host_only=True)
        self.words: np.ndarray = self.tensor.numpy().view(np.uint32)[0]
        # Every token of the vocabulary but the stop tokens: what `only_stop` finds nothing of.
        self._others = np.full(bitmask_words(vocab_size), 0xFFFFFFFF, dtype=np.uint32)
        if vocab_size % 32:
            self._others[-1] = np.uint32((1 << (vocab_size % 32)) - 1)
        for t in stop_token_ids:
            if 0 <= t < vocab_size:
                self._others[t >> 5] &= ~np.uint32(1 << (t & 31))
        self._scratch = np.empty_like(self._others)

    def fill(self, matcher: GrammarMatcher) -> np.ndarray:
        """`matcher`'s allowed tokens as uint32 words (this row's view: valid until the next fill)."""
        matcher.fill_bitmask(self.tensor, 0)
        return self.words

    def only_stop(self, matcher: GrammarMatcher) -> bool:
        """Whether `matcher` allows nothing but stop tokens next (bits past the vocabulary
        ignored): one fill, one vectorised AND."""
        return not np.bitwise_and(self.fill(matcher), self._others, out=self._scratch).any()


_BYTE_BITS = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)


def count_allowed(words: np.ndarray) -> int:
    """How many tokens a bitmask row (its uint32 view) allows."""
    if hasattr(np, "bitwise_count"):  # numpy 2
        return int(np.bitwise_count(words).sum())
    return int(_BYTE_BITS[words.view(np.uint8)].sum())


def allowed_ids(words: np.ndarray) -> np.ndarray:
    """The token ids a bitmask row (its uint32 view) allows, ascending."""
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))


def would_accept(matcher: GrammarMatcher, token: int) -> bool:
    """Whether `matcher` accepts `token` now; the matcher is left as it was."""
    if not matcher.accept_token(token):
        return False
    matcher.rollback(1)
    return True


class GrammarMatcher(ABC):
    """Per-request grammar state: which tokens may come next, given the tokens so far.

    Not thread-safe: one matcher belongs to one request and is driven by one thread at a time.
    Different matchers may be used from different threads (see `structgen.grammar.batch`).
    """

    backend: str = ""
    # Bumped by every call that may change the state (accept, rollback, reset): a mask filled
    # earlier (grammar/prefetch.py) is still this matcher's mask while the version is unchanged.
    version: int = 0
    # The compiled grammar that made this matcher (`CompiledGrammar.matcher`): with the tokens
    # taken since, it names the matcher's state (engine/completion_cache.py keys on it).
    grammar: CompiledGrammar | None = None

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it.

        A stop token is accepted only where the grammar may end; it terminates the matcher.
        """

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance token by token until one is rejected; return how many were accepted
        (the engine uses this to verify speculative draft tokens)."""
        for n, tid in enumerate(token_ids):
            if not self.accept_token(tid):
                return n
        return len(token_ids)

    def first_accepted(self, token_ids: Sequence[int]) -> int | None:
        """The first of `token_ids` the grammar accepts now, or None; the state is left as it
        was (jump-forward's hold-back asks this of a token's extensions)."""
        for tid in token_ids:
            if self.accept_token(tid):
                self.rollback(1)
                return tid
        return None

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (CPU int32, see module doc).

        After termination the row allows only the stop tokens, so a finished request left in a
        batch cannot crash the step."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (including a stop token)."""

    @abstractmethod
    def jump_forward_string(self, max_bytes: int = FORCED_TEXT_MAX_BYTES) -> str:
        """The text the grammar forces from here ("" if none), its first `max_bytes` UTF-8
        bytes at most (cut at a character boundary); does not change state."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token has been accepted."""

    def error(self) -> str | None:
        """Why the matcher can go no further, where its library says (llguidance keeps an
        error state); None otherwise. Error messages about a rejected token quote it."""
        return None

    @abstractmethod
    def is_completed(self) -> bool:
        """True if the grammar may end here (a stop token would be accepted), or has ended."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the initial state (no tokens accepted)."""


class CompiledGrammar(ABC):
    """A constraint compiled against one tokenizer by one backend; immutable and shareable
    between threads and requests."""

    def __init__(self, backend: str, constraint: Constraint, forced_text_bounded: bool = True):
        self.backend = backend
        self.constraint = constraint
        # False where grammar/termination.py found no small bound on the text the grammar can
        # force: a backend whose jump-forward question cannot be stopped then forces nothing.
        self.forced_text_bounded = forced_text_bounded

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (cheap: microseconds)."""

    def accepts(self, text: str) -> bool:
        """Is `text` a complete output of this grammar? (Tests and evaluation use it.)"""
        if not isinstance(text, str):
            raise TypeError(f"accepts() takes an output's text, a str, got {type(text).__name__}; "
                            "for a value, pass its JSON text (json.dumps(value))")
        return self._accepts_text(text)

    @abstractmethod
    def _accepts_text(self, text: str) -> bool:
        """`accepts` once `text` is known to be a str."""

    def __repr__(self) -> str:
        return (
            f"CompiledGrammar(backend={self.backend!r}, constraint={self.constraint.description!r})"
        )


class GrammarBackend(ABC):
    """Adapter around one grammar library for one tokenizer.

    Backends compile exactly what they are given; deciding whether a backend enforces every
    keyword of a schema is `GrammarCompiler`'s job (see `structgen.schema.keywords`).
    """

    name: str = ""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)

    @abstractmethod
    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile `constraint`; raise `InvalidConstraintError` / `UnsupportedSchemaError`
        (never a library exception) when the backend cannot."""
