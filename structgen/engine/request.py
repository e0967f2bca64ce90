"""Per-request state. A `Request` owns its tokens, grammar matcher, KV slot (its row of the KV
page table, while it runs) and statistics; everything else about it (pending tokens, output
text) is derived from those."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from structgen.engine.garbage_collection import untracked_ints
from structgen.sampling import SamplingParams

if TYPE_CHECKING:
    from structgen.engine.reasoning import ReasoningPhase
    from structgen.engine.repair import OutputValidator, RejectedText
    from structgen.grammar import GrammarMatcher

_ids = itertools.count()

# The admission group of requests created in this context when none is passed (the server sets
# one per HTTP request; the scheduler shares free slots fairly between groups). None: the one
# group all in-process callers share.
request_group: ContextVar[Hashable | None] = ContextVar("structgen_request_group", default=None)
# Whom they are for, likewise (the server: the client's network address): the scheduler is fair
# between clients first, then between one client's groups, and a full queue makes room for a
# client that holds less than its share (loop.py). None: this process's own callers.
request_client: ContextVar[Hashable | None] = ContextVar("structgen_request_client", default=None)


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    forward_passes: int = 0  # model steps this request took part in
    ttft_s: float = 0.0  # arrival -> first output token
    decode_s: float = 0.0  # first output token -> finish
    forced_tokens: int = 0  # appended by jump-forward without sampling
    drafted_tokens: int = 0  # proposed by a drafter, or guessed by jump-forward
    accepted_tokens: int = 0  # drafted tokens the target accepted
    verify_steps: int = 0  # forward passes that sampled under speculation (with or without a draft)
    # engine/closing.py: tokens appended to close the output, and which guards fired
    # ("budget_closing": max_tokens was near; "repetition": the output looped).
    closed_tokens: int = 0
    guards_fired: list[str] = field(default_factory=list)
    loop: str = ""  # the text the output was found repeating, if it was
    shortest_completion: int | None = None  # cut off at max_tokens: tokens a completion still needed
    dropped_tokens: int = 0  # generated, then dropped to close where a completion still fitted
    # engine/repair.py: fields a validator rejected and that were decoded again, and the
    # tokens those rollbacks dropped (decoded once more: the repair's extra tokens).
    repairs: int = 0
    repair_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache, not prefilled
    preemptions: int = 0  # times its KV pages were taken back and its tokens recomputed later

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens sampled per verify step (accepted drafts + the target's own token), as in the
        speculative-decoding literature; jump-forward tokens are not counted (they need no
        step of their own either way). 1.0 without speculation."""
        if not self.verify_steps:
            return 1.0
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["mean_acceptance_length"] = self.mean_acceptance_length
        return d


class Request:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        matcher: GrammarMatcher | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
        on_update: Callable[[Request], None] | None = None,
        group: Hashable | None = None,
        validator: OutputValidator | None = None,
        adopt_prompt_ids: bool = False,
        client: Hashable | None = None,
    ):
        self.id = next(_ids)
        self.group = group if group is not None else request_group.get()
        self.client = client if client is not None else request_client.get()
        # Only ever ints: out of the cyclic collector's sight (a long prompt is thousands).
        # `adopt_prompt_ids`: the caller made the list for this request and lets it go (the
        # API's tokenizer output), so it is kept rather than copied: an agent's turn is
        # thousands of ids, a burst of them milliseconds of copying on the event loop.
        self.token_ids: list[int] = untracked_ints(prompt_ids if adopt_prompt_ids else list(prompt_ids))
        # Odd while `truncate` drops tokens, and grown by 2 by each: a reader on another thread
        # that sees the same even count before and after reading the tokens knows that none it
        # read before were dropped since (structgen/api.py `_OutputTokens`).
        self.truncations = 0
        self.num_prompt = len(prompt_ids)
        self.params = params
        self.matcher = matcher
        # The matcher had taken no tokens yet: its state is its grammar's after `answer_ids`.
        self.matcher_from_start = matcher is not None and matcher.version == 0
        self.stop_token_ids = stop_token_ids
        self.on_update = on_update
        # False: `on_update` is called once the request has finished, not after every step
        # (a caller that waits for the whole output: a batch of 256 made 256 calls a step).
        self.progress_updates = True
        self.status = RequestStatus.WAITING
        self.slot: int | None = None
        self.num_cached = 0  # leading tokens whose K/V are in the cache
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
        self.error: BaseException | None = None
        self.jump_forward = False
        # The output length at which engine/closing.py next looks at this request (max_tokens
        # unless a closer admitted it).
        self.close_at = params.max_tokens
        self.budget_check_at = params.max_tokens  # where the closer next searches for a completion
        self.safe_point: int | None = None  # the latest output length a completion was found to fit from
        # Jump-forward's guess (not a speculative draft): a token for the next step that samples
        # to run as one more row, sampled at both rows: where the model picks it at the first,
        # the second row's token comes with it (a pass saved). Jump-forward sets it to the token
        # it held back (engine/jump_forward.py).
        self.guess: int | None = None
        # engine/reasoning.py: the think section before the answer, where the request reasons
        # (its matcher is parked there while it thinks).
        self.reasoning: ReasoningPhase | None = None
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        # Checks a finished output; may send the request back to a field (engine/repair.py).
        self.validator = validator
        self.rejected: list[RejectedText] = []  # text a validator rejected, never written again
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def thinking(self) -> bool:
        """In its think section: unconstrained, and a stop token ends the thinking only."""
        return self.reasoning is not None and self.reasoning.thinking

    @property
    def answer_ids(self) -> list[int]:
        """The output tokens the grammar took: the output after any think section."""
        return self.token_ids[self.grammar_start :]

    @property
    def grammar_start(self) -> int:
        """Index in `token_ids` of the first token the grammar took: the answer's first."""
        answer = self.reasoning.answer_start if self.reasoning is not None else None
        return self.num_prompt + (answer or 0)

    @property
    def num_pending(self) -> int:
        """Tokens not yet run through the model (prompt remainder, last sampled, forced)."""
        return len(self.token_ids) - self.num_cached

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append(self, token_ids: list[int], *, forced: bool = False) -> None:
        if self.first_token_at is None and not forced:
            # The first token the model chose: text forced before any forward (an opening
            # `{"name": "`) is known at once and would make the time to first token ~0.
            self.first_token_at = time.perf_counter()
            self.stats.ttft_s = self.first_token_at - self.arrival
        self.token_ids.extend(token_ids)
        self.stats.output_tokens = self.num_output
        if forced:
            self.stats.forced_tokens += len(token_ids)

    def truncate(self, length: int) -> None:
        """Drop tokens past `length` (re-tokenisation, rejected drafts); the KV cache follows."""
        self.truncations += 1
        del self.token_ids[length:]
        self.truncations += 1
        self.guess = None
        self.num_cached = min(self.num_cached, length)
        self.stats.output_tokens = self.num_output

    def reopen(self, length: int) -> None:
        """Finished, back to running from its first `length` tokens (engine/repair.py): the
        last kept token runs again, so the next step has its logits to sample from."""
        self.truncate(length)
        self.num_cached = min(self.num_cached, length - 1)
        self.status = RequestStatus.RUNNING
        self.finish_reason = None
        self.error = None

    # -- the finish rule: the engine, jump-forward and the speculator all finish requests here --
    @property
    def tokens_left(self) -> int:
        """Output tokens `max_tokens` still allows."""
        return self.params.max_tokens - self.num_output

    def ends_at(self, token: int, terminated: bool) -> bool:
        """Whether sampled `token` ends the output, before it is appended: a constrained
        request's grammar terminated on it (`terminated`), an unconstrained one sampled a
        stop token. Such a token is not kept. While thinking, no token ends the output
        (engine/reasoning.py turns a stop token into the end of the thinking)."""
        if self.reasoning is not None and self.reasoning.thinking:  # (`thinking`, inline: every token)
            return False
        return terminated if self.matcher is not None else token in self.stop_token_ids

    def may_finish_at(self, token: int) -> bool:
        """Whether taking `token` in could finish this request whatever its grammar says: it
        is the last token `max_tokens` allows, or an unconstrained request's stop token."""
        # A grammar decides a constrained request's end (`ends_at` is False for it here).
        return self.tokens_left <= 1 or (self.matcher is None and self.ends_at(token, terminated=False))

    def finish_if_done(self, complete: bool, nothing_follows: Callable[[], bool]) -> bool:
        """After tokens were appended: at `max_tokens` an output the grammar may end with here
        (`complete`) is whole (`stop`), any other output, free text included, is cut off
        (`length`); a complete output after which `nothing_follows()` (the grammar allows only
        stop tokens) ends now (`stop`), sparing the forward that could only sample a stop
        token. Returns whether the request finished."""
        if self.tokens_left <= 0:
            self.finish("stop" if complete else "length")
        elif complete and nothing_follows():
            self.finish("stop")
        return self.finished

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        self.guess = None
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        if self.first_token_at is not None:
            self.stats.decode_s = time.perf_counter() - self.first_token_at
