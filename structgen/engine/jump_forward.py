"""Jump-forward decoding: append the text a grammar forces (`{"name": "`, `", "age": `, closing
braces) without a forward pass per token, tokenised the way the model would have tokenised it.

Forced text cannot simply be encoded on its own and appended. Two boundaries need care:

- **Start.** The last sampled token and the forced text may merge: the model sampled `"` and
  the grammar forces `, "age": `, but the model itself writes `",` as one token. So the tail of
  the output is backed off a few tokens, the tail text + forced text is re-encoded in one
  piece, the grammar matcher is rolled back to the first differing token and re-advanced with
  the new tokens, and the request is truncated there (its KV cache follows; the last sampled
  token is not cached yet, earlier tail tokens are simply recomputed in the same forward).
- **End.** The last forced token may be the start of a longer token the model could choose:
  forcing ` "` before a string value rules out ` "(`; forcing ` ` before a number rules out
  ` -`. Trailing tokens that some grammar-allowed token extends are held back (as llguidance's
  `chop_tokens` does), so the model picks between the short and the long token itself.
  That choice would cost a pass of its own, and the model mostly picks the held-back token
  (` "`: 88 of 89 times on MaskBench; after a held-back ` ` it mostly picks ` "`). So the
  request gets that token as a one-token guess (`Request.guess`): the step that runs the
  forced text also runs the guess as one more row and samples at both; where the model's
  token at the first is the guess, the second row's token is the next one, sampled after the
  right text. The model still picks every token itself, from the same distribution (with a
  seed, the same tokens). Only a token the grammar allows that forces nothing after it.

The re-encoding is checked twice: its bytes must equal the text (tokenizers that normalise or
add prefix spaces fail this), and the matcher must accept it. If the matcher rejects a token,
the longest accepted prefix is kept when it still covers the sampled text and adds forced text;
otherwise the forced text is tried encoded alone after the untouched sampled tokens (not when
the hold-back below took every forced token: alone it ends in the same token), and failing
that nothing is jumped. A jump that does not happen leaves the matcher and the request
exactly as they were.

At batch 1 on CUDA the host would wait for every jump while the device idles, so the engine
rehearses: while the device computes a step, `rehearse` works out (and undoes) the jump after
each token likely to trigger one, and after the device the hook only replays the outcome for
the token sampled, checked to be from the same grammar state and forced text.

The forced tokens are appended as pending tokens; the scheduler runs every pending token of a
request in one `extend`, batched with the other requests' decode steps, taking logits at the
last position only.
"""

from __future__ import annotations

import bisect
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from structgen.engine.closing import BudgetCloser
from structgen.engine.garbage_collection import untracked_ints
from structgen.grammar.backends.base import (
    FORCED_TEXT_MAX_BYTES,
    HostMaskRow,
    allowed_ids,
    control_token_ids,
    count_allowed,
    token_bytes,
)

if TYPE_CHECKING:
    from structgen.engine.engine import Engine
    from structgen.engine.request import Request
    from structgen.grammar.backends.base import CompiledGrammar

MAX_BACKOFF = 4  # output tokens re-encoded with the forced text; merges span one pre-token
# Hold-back asks "does the grammar allow any longer token starting with this one?". Up to this
# many candidates are tried one by one (accept + rollback: one probe is cheap); more take one
# mask fill (far dearer, and on the critical path of a jump step) unless a sample is allowed.
PROBE_EXTENSIONS = 32
PROBE_SAMPLE = 8  # with more candidates, this many (spread over them) are tried before the mask
# Re-encodings kept (`JumpForward._encode`): a schema's jumps re-encode the same few tails and
# keys over and over; the cache starts afresh when full.
ENCODINGS_KEPT = 4096
OPENINGS_KEPT = 16  # first jumps kept per grammar (one per budget left for it)
# What one attempt at a jump did. After HELD_BACK the forced text alone is not tried: its last
# token is the one just held back, in the same grammar state (on MaskBench replays every such
# retry, 67 of 67, was held back again, each a second encode + advance on the critical path).
JUMPED, HELD_BACK, FAILED = "jumped", "held back", "failed"
# Rehearsal (`JumpForward.rehearse`): every allowed token where at most this many are, else up
# to REHEARSE_MAX of the tokens that made the grammar force text most often. One rehearsal costs
# about what the hook does after the device (an encode, an advance, a rollback).
REHEARSE_ALL = 8
REHEARSE_MAX = 4
# A held-back token ending in one of these is guessed with a quote after it where that is one
# token the grammar takes (` "`, ` {"`, ` ["`), then, after `[`, with a brace (` [{`): what the
# model and the schemas' own instances mostly write next (`_propose`).
OPENERS = (b" ", b"\n", b"\t", b"{", b"[")
# A jump's outcome: (start, c, kept, held): the request's tokens from `start + c` on become
# `kept[c:]`; `held` is the first held-back token (the guess's basis), or None. With `kept`
# empty nothing jumps and only `held` is left.
Plan = tuple[int, int, list[int], int | None]


@dataclass
class Rehearsal:
    """Outcomes worked out before the token was sampled: for each rehearsed token, the
    forced text after it and the jump `JumpForward._decide` made of it (None: nothing jumps).
    Valid while the matcher has taken exactly one token since (`version` + 1)."""

    req: Request
    version: int
    plans: dict[int, tuple[bytes, Plan | None]]


class VocabBytes:
    """The byte string of every token id, plus "which tokens extend this one" lookups.

    The bytes are `backends.base.token_bytes` (shared with the llguidance adapter).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, exclude: set[int]):
        self.tokens = token_bytes(tokenizer, vocab_size)
        self.special = set(exclude) | control_token_ids(tokenizer, vocab_size)
        # A list per token, of ints and bytes only: untracked, as a full collection would
        # otherwise walk every entry (engine/garbage_collection.py).
        self._lengths = untracked_ints([len(b) for b in self.tokens])
        self.longest = max(self._lengths, default=1)  # bytes of the longest token
        order = sorted((b, i) for i, b in enumerate(self.tokens) if b and i not in self.special)
        self._sorted = untracked_ints([b for b, _ in order])
        self._sorted_ids = np.array([i for _, i in order], dtype=np.int64)
        self._extensions: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def token_id(self, data: bytes) -> int | None:
        """The (non-special) token whose bytes are exactly `data`, if any (the lowest id where
        several spell it)."""
        i = bisect.bisect_left(self._sorted, data)
        return int(self._sorted_ids[i]) if i < len(self._sorted) and self._sorted[i] == data else None

    def join(self, ids: list[int]) -> bytes:
        return b"".join([self.tokens[t] for t in ids])

    def length(self, ids: list[int]) -> int:
        return sum(map(self._lengths.__getitem__, ids))

    def bitmask_of(self, ids: np.ndarray) -> np.ndarray:
        """Packed bitmask (uint32 words, the grammar bitmask layout) of token ids (int64)."""
        words = np.zeros((len(self.tokens) + 31) // 32, dtype=np.uint32)
        np.bitwise_or.at(words, ids >> 5, (np.uint32(1) << (ids & 31)).astype(np.uint32))
        return words

    def extensions(self, tid: int) -> np.ndarray:
        """Packed bitmask (uint32 words, the grammar bitmask layout) of the tokens whose bytes
        start with token `tid`'s bytes and are longer; cached per token."""
        return self._extension_entry(tid)[0]

    def extension_ids(self, tid: int) -> np.ndarray:
        """The same tokens as ids (int64, ascending by bytes)."""
        return self._extension_entry(tid)[1]

    def consistent_with(self, text: bytes) -> np.ndarray:
        """The tokens (ids, int64) that keep an output on `text`: those spelling a prefix of
        it, and those starting with all of it (engine/repair.py bans them)."""
        spans = [(bisect.bisect_left(self._sorted, text[:k]), bisect.bisect_right(self._sorted, text[:k]))
                 for k in range(1, min(len(text), self.longest + 1))]
        spans.append((bisect.bisect_left(self._sorted, text),
                      bisect.bisect_left(self._sorted, _successor(text)) if text.strip(b"\xff") else len(self._sorted)))
        return np.concatenate([self._sorted_ids[lo:hi] for lo, hi in spans]) if text else self._sorted_ids[:0]

    def _extension_entry(self, tid: int) -> tuple[np.ndarray, np.ndarray]:
        entry = self._extensions.get(tid)
        if entry is None:
            prefix = self.tokens[tid]
            lo = bisect.bisect_right(self._sorted, prefix)  # skips `prefix` itself
            hi = (
                bisect.bisect_left(self._sorted, _successor(prefix))
                if prefix.strip(b"\xff")
                else len(self._sorted)
            )
            ids = self._sorted_ids[lo:hi]
            entry = self._extensions[tid] = (self.bitmask_of(ids), ids)
        return entry


def _successor(prefix: bytes) -> bytes:
    """The smallest byte string greater than every string that starts with `prefix`."""
    head = prefix.rstrip(b"\xff")
    return head[:-1] + bytes([head[-1] + 1])


class JumpForward:
    """The engine's jump-forward hook: `hook(engine, req)` after a sampled token was accepted
    (and once when a request is added, so the schema's opening rides along with the prefill)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: set[int],
        vocab: VocabBytes | None = None,
        max_backoff: int = MAX_BACKOFF,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = set(stop_token_ids)
        self.max_backoff = max_backoff
        self.vocab = vocab or VocabBytes(tokenizer, vocab_size, self.stop_token_ids)
        # The Rust `tokenizers.Tokenizer` behind a fast HF tokenizer: much cheaper per call.
        self._fast = getattr(tokenizer, "backend_tokenizer", None)
        self._mask_row = HostMaskRow(vocab_size, self.stop_token_ids)  # `_allowed`'s and `_only_stop`'s row
        self._encoded: dict[bytes, tuple[int, ...] | None] = {}  # `_encode`'s answers by text
        # Per token, an extension the grammar allowed last time it was asked (`_allows_extension`):
        # tried first, it mostly answers with one accept instead of a sample or a mask fill.
        self._allowed_before: dict[int, int] = {}
        self._probe_lists: dict[int, tuple[bool, list[int]]] = {}  # `_probes`' answers by token
        self._candidates: dict[int, list[int]] = {}  # `_guess_candidates`' answers by token
        # Per grammar, its first jump's forced text and outcome by the room left for it
        # (`_remember_opening`); weakly, so an evicted grammar takes its entries with it.
        self._openings: weakref.WeakKeyDictionary[CompiledGrammar, dict[int, tuple[bytes, Plan | None]]] = (
            weakref.WeakKeyDictionary())
        self._triggers: Counter[int] = Counter()  # sampled tokens after which text was forced
        self._rehearsal: Rehearsal | None = None
        self._only_stop_at: tuple[Any, int] | None = None  # `_only_stop`'s matcher and version
        self._only_stop_answer = False
        self.guesses = True  # propose held-back tokens as guesses (tests turn it off)
        # Work out jumps while the device computes a batch-1 step (`rehearse`); benchmarks and
        # tests turn it off to time or compare the engine without it.
        self.rehearses = True

    def __call__(self, engine: Engine, req: Request) -> None:
        """Append the text `req`'s grammar forces now, if any, then run the loop checks it ran
        over (`BudgetCloser.after_forced_text`, before anything else may end the output or
        move a check) and propose the held-back token as the next step's guess."""
        forced = req.stats.forced_tokens
        plan = self._jump(req)
        if plan is None:
            return
        _, _, kept, held = plan
        if req.stats.forced_tokens > forced:
            engine.closer.after_forced_text(req, req.stats.forced_tokens - forced)
        if kept and not req.finished:  # (a loop check may have closed it)
            self._maybe_finish(req)
        self._propose(req, held)

    def _jump(self, req: Request) -> Plan | None:
        """Decide (or replay a rehearsed decision) and splice the jump; the plan applied."""
        m = req.matcher
        if m is None or req.finished or m.is_terminated():
            return None
        rehearsal, self._rehearsal = self._rehearsal, None
        room = req.num_prompt + BudgetCloser.forced_text_end(req) - len(req.token_ids)  # tokens a jump may add
        max_bytes = self.forced_bytes_limit(room)
        if max_bytes <= 0:
            return None
        try:
            forced = m.jump_forward_string(max_bytes)
        except UnicodeDecodeError:  # forced bytes end inside a character: nothing to encode
            return None
        if not forced:
            return None
        text = forced.encode("utf-8")
        if rehearsal is not None and rehearsal.req is req and rehearsal.version + 1 == m.version:
            # The matcher took one token (the sampled one) since the rehearsal: where that
            # token was rehearsed, only the rehearsed outcome is left to replay.
            rehearsed = rehearsal.plans.get(req.token_ids[-1], False)
            if rehearsed is not False and rehearsed[0] == text and self._replay(req, rehearsed[1]):
                return rehearsed[1]
        opening = m.version == 0 and len(req.token_ids) == req.grammar_start and m.grammar is not None
        if opening:  # the grammar's first jump: its outcome was worked out for an earlier request
            known = self._openings.get(m.grammar, {}).get(room)
            if known is not None and known[0] == text:
                plan = None if known[1] is None else (len(req.token_ids), *known[1][1:])
                if self._replay(req, plan):
                    return plan
        plan = self._decide(m, req.token_ids, req.grammar_start, len(req.token_ids) + room, text)
        if opening:
            self._remember_opening(m.grammar, room, text, plan)
        if plan is not None:
            self._apply(req, *plan[:3])
        return plan

    def _remember_opening(self, grammar: CompiledGrammar, room: int, text: bytes, plan: Plan | None) -> None:
        """Keep a grammar's first jump: from a fresh matcher with nothing taken, the outcome
        depends on the grammar and the tokens the budget leaves it (`room`) only, so the
        other requests of a burst with that grammar replay it instead of deciding it again
        (a re-encoding and hold-back probes each, on the way to their first token). Checked
        on replay against the forced text asked for, as the rehearsals are."""
        openings = self._openings.setdefault(grammar, {})
        if len(openings) >= OPENINGS_KEPT:  # budgets that vary request by request
            openings.clear()
        openings[room] = (text, None if plan is None else (0, *plan[1:]))

    def forced_bytes_limit(self, tokens_left: int) -> int:
        """The most forced text worth asking for with `tokens_left` tokens of budget: what
        that many of the longest token spell, at most `FORCED_TEXT_MAX_BYTES` (forced text
        can be unbounded; the rest is asked for a step later)."""
        return max(0, min(FORCED_TEXT_MAX_BYTES, tokens_left * self.vocab.longest))

    def _decide(self, m: Any, ids: list[int], grammar_start: int, limit: int, forced: bytes) -> Plan | None:
        """What the hook does with `forced` after `ids` (the matcher took `ids[grammar_start:]`;
        `limit`: the length max_tokens allows): (start, c, kept, held), the jump, with
        the matcher rolled back to `ids[:start + c]` and advanced by `kept[c:]`, or with `kept`
        empty when every forced token was held back; None: nothing jumps and nothing was held
        back. The matcher is as it was where nothing jumps."""
        if limit - len(ids) <= 0:
            return None
        k = min(self.max_backoff, len(ids) - grammar_start)
        alone = self._held_back_alone(m, ids, len(ids) - grammar_start, forced)
        if alone is not None:
            return len(ids), 0, [], alone
        outcome, c, kept, held = self._splice(m, ids, limit, forced, k)
        if outcome == FAILED and k > 0:  # the merged re-encoding failed: try the forced text alone
            k = 0
            outcome, c, kept, held = self._splice(m, ids, limit, forced, 0)
        if outcome == HELD_BACK:
            return len(ids), 0, [], held
        return (len(ids) - k, c, kept, held) if outcome == JUMPED else None

    def _apply(self, req: Request, start: int, c: int, kept: list[int]) -> None:
        """Splice a decided jump into the request (the matcher has it already)."""
        if not kept:
            return
        old = len(req.token_ids) - start
        if req.num_output:
            self._triggers[req.token_ids[-1]] += 1
        req.truncate(start + c)
        replaced = max(0, min(old, len(kept)) - c)  # re-spelled sampled text, not forced
        if replaced:
            req.append(kept[c : c + replaced])
        if len(kept) > c + replaced:
            req.append(kept[c + replaced :], forced=True)

    # -- the held-back token as a guess ---------------------------------------------------------
    def _propose(self, req: Request, held: int | None) -> None:
        """Give `req` the held-back token as a guess for its next step, or a longer one
        (`OPENERS`): after a held-back ` ` (`":` then a value, mostly a string) the model
        picked ` "` 48 times in 62 on MaskBench and ` ` 8 times; the schemas' own instances
        go on from ` {` with ` {"` 19 times in 19 and from ` [` with ` [{` or ` ["` 21 in 21.
        Only a token the grammar takes now, that forces no text after it and cannot end the
        output, with room for it and one more token before the request's next check
        (`BudgetCloser.room_for`: a guess must not be the token that closes it). A function of the
        request alone, so outputs do not depend on what ran before (on a GPU a guess row
        moves the step's numerics)."""
        if held is None or not self.guesses or req.finished or not BudgetCloser.room_for(req, 2):
            return
        m = req.matcher
        for d in self._guess_candidates(held):
            if not m.accept_token(d):
                continue
            try:
                ok = not m.is_terminated() and not m.is_completed() and not m.jump_forward_string()
            except UnicodeDecodeError:
                ok = False
            finally:
                m.rollback(1)
            if ok:
                req.guess = d
                return

    def _guess_candidates(self, held: int) -> list[int]:
        """The guesses `_propose` tries for a held-back token, the longer ones first, special tokens
        left out; a function of the token, kept per token."""
        candidates = self._candidates.get(held)
        if candidates is None:
            text = self.vocab.tokens[held]
            longer = [text + b'"'] if text[-1:] in OPENERS else []
            if text[-1:] == b"[":
                longer.append(text + b"{")
            found = [t for t in (self.vocab.token_id(b) for b in longer) if t is not None] + [held]
            candidates = self._candidates[held] = [t for t in found if t not in self.vocab.special]
        return candidates

    def _held_back_alone(self, m: Any, ids: list[int], num_output: int, forced: bytes) -> int | None:
        """Whether `forced` is one token that hold-back would take back anyway: it starts with
        a space (so no tokenizer here joins it to the sampled text; the re-encoding would end
        in that token) and the grammar allows a longer token starting with it (` ` after `":`,
        ` "` after `",` when the next key is open). Then nothing jumps, and this answers
        without the re-encoding (slow right after a wait for the device: the tokenizer's
        tables are cold), which the undone jump used to pay on the device's critical path.
        Returns that token, or None."""
        if not forced.startswith(b" ") or not num_output:
            return None
        tid = self.vocab.token_id(forced)
        if tid is None:
            return None
        if self.vocab.tokens[ids[-1]][-1:].isspace():
            return None  # the sampled text ends in whitespace: the space may join it
        return tid if self._allows_extension(m, tid) else None

    # -- one attempt --------------------------------------------------------------------------
    def _splice(self, m: Any, ids: list[int], limit: int, forced: bytes, k: int
                ) -> tuple[str, int, list[int], int | None]:
        """Re-encode the last `k` of `ids` + `forced` and advance the matcher through the
        result, at most up to `limit` tokens in all. Returns (JUMPED, c, kept, held): the
        matcher rolled back to `ids[:len(ids) - k + c]` and advanced by `kept[c:]`, `held` the
        first token held back (or None); or, with the matcher untouched, HELD_BACK when every
        forced token was held back, FAILED when the re-encoding or the grammar got in the way."""
        start = len(ids) - k
        old = ids[start:]
        old_bytes = self.vocab.join(old)
        new = self._encode(old_bytes + forced)
        if new is None:
            return FAILED, 0, [], None
        c, shared = 0, min(len(old), len(new))  # tokens shared with the old tail stay (and stay cached)
        while c < shared and old[c] == new[c]:
            c += 1
        if c < len(old):
            m.rollback(len(old) - c)
        accepted = m.accept_tokens(new[c : limit - start])
        kept = new[: c + accepted]
        covers = self.vocab.length(kept) > len(old_bytes)
        whole, kept = kept, self._hold_back(m, kept, c, len(old_bytes))
        held = whole[len(kept)] if len(kept) < len(whole) else None
        if self.vocab.length(kept) <= len(old_bytes):  # no forced byte survived: undo
            self._restore(m, len(kept) - c, old[c:])
            return (HELD_BACK, 0, [], held) if covers else (FAILED, 0, [], None)
        return JUMPED, c, kept, held

    @staticmethod
    def _restore(m: Any, taken: int, old: list[int]) -> None:
        """Undo a splice: roll back the `taken` new tokens and re-take the `old` ones."""
        m.rollback(taken)
        if m.accept_tokens(old) != len(old):  # pragma: no cover - the matcher just accepted them
            raise RuntimeError("grammar matcher could not restore its state after jump-forward")

    # -- rehearsal: the jump worked out while the device computes ------------------------------
    def rehearse(self, req: Request, allowed: np.ndarray, done: Callable[[], bool], guess: int | None = None) -> None:
        """Work out, for the tokens likeliest to make the grammar force text (`_likely`) among
        those `allowed` (the mask of the step now on the device), what the hook would do after
        each, and undo it. Called while the device computes that step, at batch 1, with
        `done()` saying whether it has finished (then this stops: it would delay the step).
        After the device, the hook only replays the outcome for the token sampled (`_replay`),
        instead of re-encoding and probing on the device's critical path (docs/performance.md,
        "Jump-forward"). `guess`: the step runs this guess, and `allowed` is its
        row's mask: the tokens rehearsed are those after the guess, valid where the model
        picks the guess."""
        self._rehearsal = None
        m = req.matcher
        if m is None or req.finished or m.is_terminated():
            return
        if guess is not None and not m.accept_token(guess):
            return
        plans: dict[int, tuple[bytes, Plan | None]] = {}
        ids = [*req.token_ids, *([] if guess is None else [guess]), 0]
        try:
            for t in self._likely(allowed):
                if done():
                    break
                if not m.accept_token(t):
                    continue
                try:
                    if m.is_terminated():
                        continue
                    try:
                        limit = self.forced_bytes_limit(req.num_prompt + BudgetCloser.forced_text_end(req) - len(ids))
                        text = m.jump_forward_string(limit).encode("utf-8")
                    except UnicodeDecodeError:
                        continue
                    if not text:
                        continue
                    ids[-1] = t
                    plan = self._decide(m, ids, req.grammar_start, req.num_prompt + BudgetCloser.forced_text_end(req), text)
                    if plan is not None and plan[2]:
                        start, c, kept, _ = plan
                        self._restore(m, len(kept) - c, ids[start + c :])
                    plans[t] = (text, plan)
                finally:
                    m.rollback(1)
        finally:
            if guess is not None:
                m.rollback(1)
        if plans:  # the version once the engine has taken the guess back in
            self._rehearsal = Rehearsal(req, m.version + (guess is not None), plans)

    def _likely(self, allowed: np.ndarray) -> list[int]:
        """The tokens to rehearse: every one allowed where few are (a key, a keyword, a
        number's end), else those that made the grammar force text most often so far and
        are allowed now (on MaskBench `",`, `"},`, then key prefixes such as `cor`). With 4
        of those, 138 of 186 jumps' tokens were rehearsed (the model's own outputs on 16
        schemas, CPU, once the counts had warmed up; 143 with 6 or 8)."""
        if count_allowed(allowed) <= REHEARSE_ALL:
            return [t for t in allowed_ids(allowed).tolist() if t not in self.vocab.special]
        likely = []
        for t, _ in self._triggers.most_common(4 * REHEARSE_MAX):
            if allowed[t >> 5] >> (t & 31) & 1:
                likely.append(t)
                if len(likely) == REHEARSE_MAX:
                    break
        return likely

    def _replay(self, req: Request, plan: Plan | None) -> bool:
        """Apply a rehearsed outcome; False (nothing changed) if the grammar now disagrees."""
        if plan is None or not plan[2]:
            return True
        start, c, kept, _ = plan
        m, old = req.matcher, req.token_ids[start:]
        if c < len(old):
            m.rollback(len(old) - c)
        taken = m.accept_tokens(kept[c:])
        if taken != len(kept) - c:  # pragma: no cover - the rehearsal took the same tokens
            self._restore(m, taken, old[c:])
            return False
        self._apply(req, start, c, kept)
        return True

    def _encode(self, text: bytes) -> list[int] | None:
        """Token ids spelling exactly `text`, or None (not UTF-8, or the tokenizer changes it);
        remembered by text, as the tokenizer answers a text the same every time."""
        if text in self._encoded:
            ids = self._encoded[text]
            return None if ids is None else list(ids)
        if len(self._encoded) >= ENCODINGS_KEPT:
            self._encoded.clear()
        ids = self._encode_now(text)
        self._encoded[text] = None if ids is None else tuple(ids)
        return ids

    def _encode_now(self, text: bytes) -> list[int] | None:
        """`_encode` without the cache: the tokenizer's answer."""
        try:
            s = text.decode("utf-8")
        except UnicodeDecodeError:
            return None
        ids = self._fast.encode(s, add_special_tokens=False).ids if self._fast is not None else None
        if ids is None or any(t in self.vocab.special for t in ids):
            # The slow path never turns text like "<|im_end|>" inside a JSON string into the
            # special token.
            ids = self.tokenizer(s, add_special_tokens=False, split_special_tokens=True)[
                "input_ids"
            ]
        if not ids or any(t >= self.vocab_size for t in ids) or self.vocab.join(ids) != text:
            return None
        return ids

    def _hold_back(self, m: Any, kept: list[int], c: int, old_len: int) -> list[int]:
        """Drop trailing forced tokens that a grammar-allowed longer token extends: the model
        must be free to choose ` "(` where the forced text ends in ` "`. Never drops into the
        sampled text (`old_len` bytes). Where the forced text completes the grammar and only a
        stop token may follow, no byte can follow its last token, so no longer token can
        either: the finish check after the jump (`_only_stop`) answers with its one mask fill,
        instead of rolling back and probing the last token's extensions (`"}` has dozens)."""
        if m.is_completed() and self._only_stop(m):
            return kept
        length = self.vocab.length(kept)
        while len(kept) > c:
            last = kept[-1]
            if length - len(self.vocab.tokens[last]) < old_len:
                break
            if not len(self.vocab.extension_ids(last)):
                break
            m.rollback(1)
            if not self._allows_extension(m, last):
                if not m.accept_token(last):  # pragma: no cover - it was just accepted
                    raise RuntimeError(
                        "grammar matcher could not restore its state after jump-forward"
                    )
                break
            kept = kept[:-1]
            length -= len(self.vocab.tokens[last])
        return kept

    def _allows_extension(self, m: Any, tid: int) -> bool:
        """Does the grammar, in its current state, allow a token that extends token `tid`?"""
        before = self._allowed_before.get(tid)
        if before is not None and m.first_accepted((before,)) is not None:
            return True
        few, probes = self._probes(tid)
        # Many extensions (a space has ~32,000 in SmolLM2's vocabulary): a spread sample first,
        # as free text allows nearly all of them; the mask decides only when it is refused.
        t = m.first_accepted(probes)
        if t is not None:
            self._allowed_before[tid] = t
            return True
        if few:
            return False
        words = np.bitwise_and(self._allowed(m), self.vocab.extensions(tid))
        hit = np.flatnonzero(words)
        if not len(hit):
            return False
        w = int(hit[0])
        self._allowed_before[tid] = 32 * w + (int(words[w]) & -int(words[w])).bit_length() - 1
        return True

    def _probes(self, tid: int) -> tuple[bool, list[int]]:
        """Whether token `tid` has few extensions, and the ones `_allows_extension` tries one by
        one (all of few, else a spread sample); kept per token as a list, built once."""
        entry = self._probe_lists.get(tid)
        if entry is None:
            ids = self.vocab.extension_ids(tid)
            few = len(ids) <= PROBE_EXTENSIONS
            entry = self._probe_lists[tid] = (few, (ids if few else ids[:: -(-len(ids) // PROBE_SAMPLE)]).tolist())
        return entry

    def _allowed(self, m: Any) -> np.ndarray:
        """The matcher's allowed-token bitmask as uint32 words (a view of a reused buffer)."""
        return self._mask_row.fill(m)

    # -- after the jump ---------------------------------------------------------------------------
    def _maybe_finish(self, req: Request) -> None:
        """A jump can complete the grammar (a closing brace) or reach max_tokens: finish now
        rather than spend a forward that could only sample the stop token."""
        m = req.matcher
        req.finish_if_done(m.is_completed(), lambda: self._only_stop(m))

    def _only_stop(self, m: Any) -> bool:
        """Whether `m` allows only stop tokens next: one mask fill, its answer kept while the
        matcher stays at this version (the hold-back and the finish check of a jump ask both)."""
        if self._only_stop_at != (m, m.version):
            self._only_stop_answer = self._mask_row.only_stop(m)
            self._only_stop_at = (m, m.version)
        return self._only_stop_answer


# Tokens with none of these bytes, sampled where the grammar allows this many tokens or more
# (inside a JSON string, not a number, keyword or enum), are taken not to make the grammar force
# text: the device runs the next forward without waiting for the host (`quiet_tokens`). A wrong
# guess costs one forward, never a wrong output (the host still decides what runs).
LOUD_BYTES = b'"\\{}[],:'
QUIET_MIN_ALLOWED = 1024


def quiet_tokens(vocab: VocabBytes) -> np.ndarray:
    """uint32 bitmask words (the grammar bitmask layout) of the tokens with none of
    `LOUD_BYTES`, special tokens and empty ones excluded."""
    loud = set(LOUD_BYTES)
    return vocab.bitmask_of(np.array(
        [i for i, b in enumerate(vocab.tokens) if b and i not in vocab.special and not loud & set(b)], dtype=np.int64))


__all__ = ["JumpForward", "VocabBytes"]
