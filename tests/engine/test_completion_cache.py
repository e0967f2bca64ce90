"""Completions shared between requests in one grammar state (structgen/engine/completion_cache.py)
on the default model: a kept completion is exactly what a fresh search finds in that state, for
the limit asked, and requests of one schema share their searches."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from structgen import LLM, JsonSchema
from structgen.engine.closing import BudgetCloser
from structgen.engine.config import EngineConfig
from structgen.engine.request import Request
from structgen.grammar.backends.base import CompiledGrammar
from structgen.sampling import SamplingParams
from structgen.types import to_constraint


class Ticket(BaseModel):
    title: str
    description: str
    priority: int


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(config=EngineConfig(device="cpu", max_batch_size=4, max_seq_len=512))


def at_state(llm: LLM, grammar: CompiledGrammar, text: str) -> Request:
    """A request of `grammar` whose output is `text` (its matcher took it)."""
    req = Request(llm.encode_prompt("Write a ticket."), SamplingParams(max_tokens=64), grammar.matcher())
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert req.matcher.accept_tokens(ids) == len(ids)
    req.append(ids)
    return req


def fresh_search(llm: LLM, closer: BudgetCloser, grammar: CompiledGrammar, text: str, limit: int) -> list[int] | None:
    """The search's answer from a matcher of its own in the state `text` leads to."""
    m = grammar.matcher()
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert m.accept_tokens(ids) == len(ids)
    return closer.search.shortest(m, limit)


def test_a_kept_completion_is_the_fresh_searchs_in_each_state_and_for_each_limit(llm: LLM) -> None:
    """Two schemas, one schema under both backends, two states of one: each is asked twice, in
    an order where a key that missed the grammar, the state or the limit would hand one of
    them another's completion; every answer must equal a fresh search's, and the second
    round must come from the cache."""
    closer = BudgetCloser()
    closer.use_tokenizer(llm.tokenizer, llm.engine.vocab_size, llm.engine.stop_token_ids)
    other = {"type": "object", "properties": {"title": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "string"}, "minItems": 2}}, "required": ["title", "tags"], "additionalProperties": False}
    ticket_xg = llm.grammars.compile(to_constraint(Ticket), backend="xgrammar")
    ticket_ll = llm.grammars.compile(to_constraint(Ticket), backend="llguidance")
    other_xg = llm.grammars.compile(to_constraint(JsonSchema(other)), backend="xgrammar")
    cases = [(ticket_xg, "", 64), (other_xg, "", 64), (ticket_ll, "", 64), (ticket_xg, '{"title": "Lost key', 64),
             (other_xg, '{"title": "Lost key', 64), (ticket_xg, '{"title": "Lost key", "description": "', 64),
             (ticket_xg, "", 8),  # kept as found at 64, too long for 8
             (ticket_xg, '{"title": "A', 3), (ticket_xg, '{"title": "A', 40)]  # kept as none within 3
    answers = []
    for grammar, text, limit in cases:
        got = closer.shortest(at_state(llm, grammar, text), limit)
        assert got == fresh_search(llm, closer, grammar, text, limit), (grammar, text, limit)
        answers.append(got)
    assert answers[6] is None and answers[7] is None and answers[8] is not None
    assert answers[0] != answers[1] and answers[0] != answers[3] != answers[5]
    searches = closer.search.searches
    for (grammar, text, limit), first in zip(cases, answers, strict=True):
        assert closer.shortest(at_state(llm, grammar, text), limit) == first, (grammar, text, limit)
    assert closer.search.searches == searches  # the second round came from the cache


def test_requests_of_one_schema_share_their_searches(llm: LLM) -> None:
    """Four requests of one schema at a small budget each search at admission, in one state:
    one search serves them all. A request whose output agrees with an earlier one's (the same
    greedy prompt) passes only through states already searched: it runs no search at all."""
    closer = llm.engine.closer
    grammar = llm.grammars.compile(to_constraint(Ticket))
    prompts = [f"Write a support ticket about {thing}, with a long description." for thing in
               ("a lost key", "a broken screen", "a late delivery", "a wrong invoice")]
    searches, hits, misses = closer.search.searches, closer.completions.hits, closer.completions.misses
    reqs = [Request(llm.encode_prompt(p), SamplingParams(max_tokens=32), grammar.matcher()) for p in prompts]
    for future in [llm.loop.submit(r) for r in reqs]:
        req = future.result(timeout=120)
        assert req.finish_reason == "stop" and "budget_closing" in req.stats.guards_fired
        assert isinstance(to_constraint(Ticket).parse(llm.tokenizer.decode(req.output_ids)), Ticket)
    assert closer.completions.hits - hits >= len(prompts) - 1  # one admission search for the four
    assert closer.search.searches - searches == closer.completions.misses - misses  # no search but a miss's

    first = Request(llm.encode_prompt(prompts[0]), SamplingParams(max_tokens=32), grammar.matcher())
    llm.loop.submit(first).result(timeout=120)
    searches = closer.search.searches
    again = Request(llm.encode_prompt(prompts[0]), SamplingParams(max_tokens=32), grammar.matcher())
    llm.loop.submit(again).result(timeout=120)
    assert again.output_ids == first.output_ids and "budget_closing" in again.stats.guards_fired
    assert closer.search.searches == searches
