"""Continuous batching keeps rows independent: cancelling one request, or its grammar failing,
never changes what the others generate; seeded sampling does not depend on the batch.

Real default model on the CPU (float32), real tokenizer, a tiny JSON schema compiled by the
real grammar backend. Decode steps go through `ModelRunner.decode` (the seam the CUDA graphs
use), mixed steps through `extend`, so both paths are covered.
"""

from __future__ import annotations

import pytest

from structgen.engine.config import EngineConfig
from structgen.engine.engine import Engine
from structgen.engine.models.loader import load_model_config
from structgen.engine.request import Request
from structgen.engine.sampler import SamplingParams
from structgen.errors import EngineError

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PROMPTS = ["Describe a person as JSON.", "Tell me about the sea.", "Give a fictional customer."]


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    cfg = load_model_config(model_dir)
    ec = EngineConfig(device="cpu", max_batch_size=4, max_seq_len=512, prefill_chunk_tokens=32, jump_forward=False)
    return Engine(cfg, ec, model_dir)


@pytest.fixture(scope="module")
def grammar(tokenizer, engine):
    from structgen.grammar import GrammarCompiler
    from structgen.types import JsonSchema, to_constraint

    compiler = GrammarCompiler(tokenizer, engine.vocab_size, sorted(engine.stop_token_ids))
    return compiler.compile(to_constraint(JsonSchema(SCHEMA)))


def ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


class FaultyMatcher:
    """A real matcher that breaks on purpose after `fail_after` masks (fault injection; the
    engine under test is real). `mode`: "fill" raises from fill_bitmask, "reject" makes
    accept_token refuse the sampled token."""

    backend = "faulty"  # not a real backend: the batch filler calls it row by row

    def __init__(self, inner, fail_after: int, mode: str):
        self.inner, self.fail_after, self.mode, self.fills = inner, fail_after, mode, 0

    def fill_bitmask(self, bitmask, row):
        self.fills += 1
        if self.mode == "fill" and self.fills > self.fail_after:
            raise RuntimeError("grammar exploded")
        self.inner.fill_bitmask(bitmask, row)

    def accept_token(self, tid):
        if self.mode == "reject" and self.fills > self.fail_after:
            return False
        return self.inner.accept_token(tid)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def make(tokenizer, engine, grammar, i: int, **kw) -> Request:
    """Request i: rows 0 and 2 are JSON-constrained, row 1 is free text."""
    matcher = grammar.matcher() if i != 1 else None
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 14), **kw)
    return Request(ids(tokenizer, PROMPTS[i]), params, matcher, frozenset(engine.stop_token_ids))


def solo(tokenizer, engine, grammar, i: int) -> list[int]:
    req = make(tokenizer, engine, grammar, i)
    engine.run([req])
    return req.output_ids


def test_cancel_and_failing_grammars_spare_other_rows(engine, grammar, tokenizer):
    alone = [solo(tokenizer, engine, grammar, i) for i in range(3)]

    # Cancel row 1 mid-decode.
    reqs = [make(tokenizer, engine, grammar, i) for i in range(3)]
    for r in reqs:
        engine.add_request(r)
    for _ in range(5):
        engine.step()
    engine.abort(reqs[1])
    while not all(r.finished for r in reqs):
        engine.step()
    assert reqs[1].finish_reason == "abort"
    assert [reqs[0].output_ids, reqs[2].output_ids] == [alone[0], alone[2]]

    # Row 0's grammar raises while its mask is computed, then row 0 of another batch rejects
    # the token it was given: each fails alone.
    for mode in ("fill", "reject"):
        reqs = [make(tokenizer, engine, grammar, i) for i in range(3)]
        reqs[0].matcher = FaultyMatcher(reqs[0].matcher, fail_after=3, mode=mode)
        engine.run(reqs)
        assert reqs[0].finish_reason == "error" and isinstance(reqs[0].error, EngineError)
        assert [reqs[1].output_ids, reqs[2].output_ids] == [alone[1], alone[2]]
    assert engine.runner.kv.free_slots == engine.runner.kv.num_slots


def test_seeded_sampling_does_not_depend_on_the_batch(engine, grammar, tokenizer):
    def seeded() -> Request:
        return make(tokenizer, engine, grammar, 0, temperature=0.8, seed=11)

    alone = seeded()
    engine.run([alone])
    # Same request joining a running batch: its steps are now mixed (others prefill) or
    # batched decode steps, its noise seeds the same.
    others = [make(tokenizer, engine, grammar, i) for i in (1, 2)]
    for r in others:
        engine.add_request(r)
    engine.step()
    again = seeded()
    engine.add_request(again)
    while not all(r.finished for r in (again, *others)):
        engine.step()
    assert again.output_ids == alone.output_ids
    different = make(tokenizer, engine, grammar, 0, temperature=0.8, seed=12)
    engine.run([different])
    assert different.output_ids != alone.output_ids


def test_decodes_plainly_predicts_jumps_and_stops_without_moving_the_grammar(engine, grammar, tokenizer):
    """The check that gates a late pre-launched forward (cuda_graphs.py `confirm_next`): a
    token inside a string keeps decoding plainly; a closing quote makes the grammar force
    `, "age": ` (a jump), a stop token ends the request; the matcher is left untouched."""
    req = make(tokenizer, engine, grammar, 0)
    req.jump_forward = True
    for t in tokenizer.encode('{"name": "Ann', add_special_tokens=False):
        assert req.matcher.accept_token(t)
    inside = tokenizer.encode("e", add_special_tokens=False)
    close = tokenizer.encode('"', add_special_tokens=False)
    assert len(inside) == len(close) == 1
    stop = min(engine.stop_token_ids)
    assert engine._decodes_plainly([req], inside)
    assert not engine._decodes_plainly([req], close)
    assert not engine._decodes_plainly([req], [stop])
    other = make(tokenizer, engine, grammar, 1)  # free text: only stop tokens and max_tokens matter
    assert engine._decodes_plainly([other, req], [inside[0], inside[0]])
    assert not engine._decodes_plainly([other, req], [inside[0], close[0]])
    assert req.matcher.jump_forward_string() == ""  # still inside the string: nothing moved
    assert req.matcher.accept_token(close[0]) and req.matcher.jump_forward_string().startswith(",")
    # After `"age":` the grammar forces a lone space, which jump-forward holds back (` 4`
    # extends it): that step decodes plainly.
    later = make(tokenizer, engine, grammar, 2)
    later.jump_forward = True
    *head, colon = tokenizer.encode('{"name": "Ann", "age":', add_special_tokens=False)
    for t in head:
        assert later.matcher.accept_token(t)
    assert engine._decodes_plainly([later], [colon])


def test_decodes_plainly_expects_a_lone_extendable_token_to_be_held_back(engine, tokenizer):
    """After `"a",` in an array of strings the grammar forces ` "`, one token that longer
    ones extend (` "(`): the jump-forward hook holds it back whole, so the check that gates
    the pre-launched forward predicts a plain decode, and the hook indeed declines."""
    from structgen.grammar import GrammarCompiler
    from structgen.grammar.jump_forward import JumpForward
    from structgen.types import JsonSchema, to_constraint

    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["tags"], "additionalProperties": False}
    compiler = GrammarCompiler(tokenizer, engine.vocab_size, sorted(engine.stop_token_ids))
    grammar = compiler.compile(to_constraint(JsonSchema(schema)))
    req = Request(ids(tokenizer, "Tags as JSON."), SamplingParams(max_tokens=40), grammar.matcher(),
                  frozenset(engine.stop_token_ids))
    req.jump_forward = True
    *head, comma = tokenizer.encode('{"tags": ["a",', add_special_tokens=False)
    for t in head:
        assert req.matcher.accept_token(t)
    hook, previous = JumpForward(tokenizer, engine.vocab_size, engine.stop_token_ids), engine.jump_forward_hook
    engine.jump_forward_hook = None
    assert not engine._decodes_plainly([req], [comma])  # no hook: any forced text vetoes
    engine.jump_forward_hook = hook
    try:
        assert engine._decodes_plainly([req], [comma])
        assert req.matcher.accept_token(comma) and req.matcher.jump_forward_string() == ' "'
        assert hook.holds_back(' "') and not hook.holds_back(', "name": ')
        req.token_ids.extend([*head, comma])  # the hook re-encodes the request's tail
        before = list(req.token_ids)
        hook(engine, req)
        assert req.token_ids == before  # declined: nothing appended
    finally:
        engine.jump_forward_hook = previous
