"""Reasoning models: a think section before the constrained answer.

A request that reasons (`SamplingParams.reasoning`, or left None, a tokenizer whose chat
template has think tags) runs in two phases. While it thinks, its grammar matcher is parked in
its `ReasoningPhase` and the request is unconstrained (`Request.matcher` is None), so every
decode path (eager steps, the CUDA graphs, speculation) samples it without a mask, as free
text. The phase ends where the output spells the closing tag, where the model samples a stop
token, where its thinking loops (with loop guards on), or where its reasoning budget is spent;
the closing tag is then appended without sampling, as jump-forward appends forced text. From
the closing tag on, the matcher is the request's again and the grammar applies.

The reasoning budget is `max_reasoning_tokens` (default: half of `max_tokens`), and never more
than `max_tokens` leaves after the answer's reserve: the closing tag, the shortest completion
of the answer's grammar (completion_search.py) and closing's margin, so the answer still ends
whole (engine/closing.py).

Tags are matched as text: a tokenizer with `<think>` as a special token spells it in one
token, one without (SmolLM2) in several, and a sampled token may carry text past the tag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from structgen.engine.closing import CLOSING_MARGIN, LOOP_CHECK_EVERY, BudgetCloser, find_loop
from structgen.engine.completion_search import SEARCH_MAX_FILLS

if TYPE_CHECKING:
    from structgen.engine.request import Request
    from structgen.grammar import GrammarMatcher

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"
# The reasoning budget where a request names none: this share of max_tokens.
DEFAULT_REASONING_SHARE = 0.5
# Tokens decoded at the output's tail to find a closing tag spelt in several tokens.
_TAIL_SLACK = 4


@dataclass(frozen=True)
class ThinkTags:
    """The think tags as this tokenizer spells them."""

    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    close_enders: frozenset[int]  # tokens whose text holds the closing tag's last character

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int) -> ThinkTags:
        """Special tokens where the tokenizer has them (the encoding then yields their ids),
        else the tags' text tokens."""
        last = CLOSE_TAG[-1]
        names = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
        enders = frozenset(i for i, name in enumerate(names) if name is not None and last in name)
        return cls(tuple(tokenizer.encode(OPEN_TAG, add_special_tokens=False)),
                   tuple(tokenizer.encode(CLOSE_TAG, add_special_tokens=False)), enders)


def template_thinks(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes think tags (Qwen3, DeepSeek-R1 style)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and OPEN_TAG in template and CLOSE_TAG in template


@dataclass
class ReasoningPhase:
    """One request's think section; indices count output tokens."""

    matcher: GrammarMatcher | None  # the answer's grammar, parked while the request thinks
    jump_forward: bool  # whether the answer uses jump-forward
    start: int  # the first think token (after the opening tag)
    budget: int  # the most think tokens
    end: int | None = None  # where the closing tag starts, once the thinking ended
    answer_start: int | None = None  # the first answer token (after the closing tag)
    forced_close: str = ""  # why the closing tag was appended: "budget", "stop", "repetition"

    @property
    def thinking(self) -> bool:
        return self.answer_start is None

    def reasoning_ids(self, output_ids: list[int]) -> list[int]:
        return output_ids[self.start : self.end]

    def answer_ids(self, output_ids: list[int]) -> list[int]:
        return output_ids[self.answer_start :] if self.answer_start is not None else []


class Reasoner:
    """Starts and ends requests' think sections; the engine calls `admit` when it queues a
    request and `after_token` after each token a thinking request takes."""

    def __init__(self, closer: BudgetCloser):
        self.closer = closer  # its search sizes the answer's reserve; it re-admits the answer
        self.tokenizer: Any = None
        self.tags: ThinkTags | None = None
        self.template_thinks = False
        self.stop_token_ids: frozenset[int] = frozenset()

    def use_tokenizer(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.tags = ThinkTags.of(tokenizer, vocab_size)
        self.template_thinks = template_thinks(tokenizer)
        self.stop_token_ids = frozenset(stop_token_ids)

    def reasons(self, req: Request) -> bool:
        wanted = req.params.reasoning
        return self.tags is not None and (self.template_thinks if wanted is None else wanted)

    def admit(self, req: Request) -> None:
        """A request that reasons starts thinking: its matcher is parked, the opening tag is
        appended unless the prompt ends with it. A prompt that ends with the closing tag (the
        template turned thinking off) has no think section, nor has a request whose max_tokens
        cannot hold the two tags and a token of answer."""
        if not self.reasons(req) or req.params.max_tokens <= len(self.tags.open_ids) + len(self.tags.close_ids):
            return
        tail = self._text(req.token_ids[max(0, req.num_prompt - len(self.tags.close_ids) - _TAIL_SLACK) : req.num_prompt])
        if tail.rstrip().endswith(CLOSE_TAG):
            return
        if not tail.rstrip().endswith(OPEN_TAG):
            req.append(list(self.tags.open_ids), forced=True)
        p = req.params
        share = p.max_reasoning_tokens if p.max_reasoning_tokens is not None else int(p.max_tokens * DEFAULT_REASONING_SHARE)
        budget = max(0, min(share, p.max_tokens - req.num_output - self._answer_reserve(req)))
        req.reasoning = ReasoningPhase(req.matcher, req.jump_forward, req.num_output, budget)
        req.matcher, req.jump_forward = None, False
        if budget == 0:
            self._close(req, "budget")

    def _answer_reserve(self, req: Request) -> int:
        """Output tokens kept for the answer: the closing tag and the grammar's shortest
        completion plus closing's margin (free text: the tag and one token)."""
        search = self.closer.search
        if req.matcher is None or search is None:
            return len(self.tags.close_ids) + 1
        plan = search.shortest(req.matcher, SEARCH_MAX_FILLS)
        return len(self.tags.close_ids) + (len(plan) if plan is not None else SEARCH_MAX_FILLS) + CLOSING_MARGIN

    def after_token(self, req: Request) -> None:
        """The thinking request took a token: end its thinking where the token spelt the
        closing tag, was a stop token, or spent the budget, or where the thinking loops."""
        phase = req.reasoning
        last = req.token_ids[-1]
        if last in self.stop_token_ids:
            req.truncate(len(req.token_ids) - 1)  # the model wants to end: the answer comes first
            self._close(req, "stop")
        elif last in self.tags.close_enders and self._closed_by_model(req):
            return
        elif req.num_output - phase.start >= phase.budget:
            self._close(req, "budget")
        elif (req.params.loop_guards and (req.num_output - phase.start) % LOOP_CHECK_EVERY == 0
              and find_loop(phase.reasoning_ids(req.output_ids)) is not None):
            self._close(req, "repetition")

    def _closed_by_model(self, req: Request) -> bool:
        """Where the output's tail spells the closing tag, the answer starts after it (text a
        token carried past the tag is dropped, the tag respelt as the tokenizer spells it)."""
        phase = req.reasoning
        n = min(req.num_output - phase.start, len(self.tags.close_ids) + _TAIL_SLACK)
        tail_ids = req.token_ids[len(req.token_ids) - n :]
        text = self._text(tail_ids)
        at = text.find(CLOSE_TAG)
        if at < 0:
            return False
        if tail_ids[-len(self.tags.close_ids) :] != list(self.tags.close_ids) or not text.endswith(CLOSE_TAG):
            req.truncate(len(req.token_ids) - n)
            if text[:at]:
                req.append(self.tokenizer.encode(text[:at], add_special_tokens=False))
            req.append(list(self.tags.close_ids))
        self._start_answer(req)
        return True

    def _close(self, req: Request, why: str) -> None:
        req.reasoning.forced_close = why
        if why != "stop":  # the budget or the loop guard cut the thinking short
            req.stats.guards_fired.append(f"reasoning_{why}")
        req.append(list(self.tags.close_ids), forced=True)
        self._start_answer(req)

    def _start_answer(self, req: Request) -> None:
        phase = req.reasoning
        phase.end, phase.answer_start = req.num_output - len(self.tags.close_ids), req.num_output
        req.matcher, req.jump_forward = phase.matcher, phase.jump_forward
        self.closer.admit(req)  # the answer's budget checks

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


__all__ = ["CLOSE_TAG", "OPEN_TAG", "ReasoningPhase", "Reasoner", "ThinkTags", "template_thinks"]
