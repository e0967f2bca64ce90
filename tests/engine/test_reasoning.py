"""Reasoning models (structgen/engine/reasoning.py) on the default model and its real tokenizer:
the model thinks unconstrained between think tags, then the grammar applies; the reasoning
budget forces the closing tag and keeps the answer's room; a chat template with think tags
turns reasoning on by itself; reasoning=False changes nothing."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from pydantic import BaseModel

from structgen import LLM, InvalidParameterError, SamplingParams
from structgen.engine.closing import BudgetCloser
from structgen.engine.config import EngineConfig, EngineTuning
from structgen.engine.engine import Engine
from structgen.engine.reasoning import CLOSE_TAG, OPEN_TAG, Reasoner, ThinkTags
from structgen.engine.request import Request


class City(BaseModel):
    name: str
    country: str


PROMPT = ("Think step by step inside <think></think> tags, then answer as JSON. "
          "Which city is the capital of France?")


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    from structgen.api import default_llm

    return default_llm()


def test_reasoning_request_thinks_then_returns_a_valid_typed_value(llm):
    c = llm.complete(City, PROMPT, max_tokens=80, reasoning=True, max_reasoning_tokens=24)
    assert isinstance(c.value, City)
    assert c.finish_reason == "stop"
    assert c.reasoning and c.reasoning.strip()
    assert CLOSE_TAG not in c.reasoning and OPEN_TAG not in c.text
    assert City.model_validate_json(c.text) == c.value
    assert llm.tokenizer.decode(c.token_ids) == c.text


def test_the_model_closing_its_think_section_starts_the_answer(llm):
    prompt = ("Think inside <think></think> tags first, repeat the question twice. "
              "Which city is the capital of France?")
    c = llm.complete(City, prompt, max_tokens=80, reasoning=True, max_reasoning_tokens=40)
    assert c.reasoning.strip() and isinstance(c.value, City)
    assert not any(g.startswith("reasoning_") for g in c.stats.guards_fired)  # no forced close
    assert c.stats.output_tokens < 40


def test_reasoning_budget_forces_the_close_and_keeps_room_for_the_answer(llm):
    # The budget asks for more thinking than max_tokens has: the answer's room is kept anyway.
    c = llm.complete(City, PROMPT, max_tokens=40, reasoning=True, max_reasoning_tokens=1000)
    assert isinstance(c.value, City) and c.finish_reason == "stop"
    assert "reasoning_budget" in c.stats.guards_fired
    assert c.stats.output_tokens <= 40
    assert c.reasoning


def test_zero_reasoning_tokens_answers_at_once(llm):
    c = llm.complete(City, PROMPT, max_tokens=40, reasoning=True, max_reasoning_tokens=0)
    assert c.reasoning == "" and isinstance(c.value, City)


def test_reasoning_off_changes_nothing(llm):
    plain = llm.complete(City, PROMPT, max_tokens=40)
    off = llm.complete(City, PROMPT, max_tokens=40, reasoning=False)
    assert plain.reasoning is None and off.reasoning is None
    assert off.text == plain.text and off.token_ids == plain.token_ids


def test_free_text_answer_after_thinking(llm):
    c = llm.complete(str, PROMPT, max_tokens=24, reasoning=True, max_reasoning_tokens=8)
    assert c.reasoning and c.value == c.text and OPEN_TAG not in c.text


def _mixed_batch(llm: LLM) -> list:
    """Four requests at once, every other one thinking: thinking rows sample unmasked beside
    constrained rows in the same decode steps."""
    async def run() -> list:
        return list(await asyncio.gather(*(
            llm.acomplete(City, PROMPT, max_tokens=48, reasoning=i % 2 == 0,
                          max_reasoning_tokens=16 if i % 2 == 0 else None)
            for i in range(4))))

    done = asyncio.run(run())
    for i, c in enumerate(done):
        assert isinstance(c.value, City) and c.finish_reason == "stop"
        assert (c.reasoning is not None) == (i % 2 == 0)
    return done


def test_thinking_rows_beside_constrained_rows_in_one_batch(llm):
    done = _mixed_batch(llm)
    assert done[0].text == done[2].text and done[1].text == done[3].text  # greedy: rows alike


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_thinking_rows_through_the_cuda_graphs_equal_eager(model_dir, tokenizer, llm):
    from structgen.engine.models.loader import load_model_config

    got = {}
    for graphs in (True, False):
        config = EngineConfig(device="cuda", max_batch_size=8, max_seq_len=512, use_cuda_graphs=graphs,
                              tuning=EngineTuning(prefill_in_graphs=False))
        engine = Engine(load_model_config(model_dir), config, model_dir, stop_token_ids=llm.engine.stop_token_ids)
        with LLM.from_engine(engine, tokenizer, f"graphs={graphs}") as on_gpu:
            got[graphs] = _mixed_batch(on_gpu)
    same = sum(a.text == b.text and a.reasoning == b.reasoning for a, b in zip(got[True], got[False], strict=True))
    assert same >= 3, "graphs vs eager differ beyond a bf16 near-tie"


def _thinking_request(llm: LLM, **params: object) -> Request:
    matcher = llm.compile(City).matcher()
    prompt = llm.encode_prompt(PROMPT)
    req = Request(prompt, SamplingParams(max_tokens=64, reasoning=True, **params), matcher,
                  frozenset(llm.engine.stop_token_ids))
    llm.engine.reasoner.admit(req)
    return req


def test_closing_tag_spelt_in_several_tokens_starts_the_answer(llm):
    reasoner = llm.engine.reasoner
    assert len(reasoner.tags.close_ids) > 1  # SmolLM2 has no think tokens
    req = _thinking_request(llm)
    assert req.thinking and req.matcher is None
    assert llm.tokenizer.decode(req.output_ids) == OPEN_TAG  # the prompt did not open it
    # The last token carries text past the tag (">."): the tag is respelt, the rest dropped.
    spelt = llm.tokenizer.encode("Paris, surely.</think", add_special_tokens=False)
    for tok in [*spelt, llm.tokenizer.convert_tokens_to_ids(">.")]:
        assert req.thinking
        req.append([tok])
        reasoner.after_token(req)
    assert not req.thinking and req.matcher is not None
    phase = req.reasoning
    assert llm.tokenizer.decode(phase.reasoning_ids(req.output_ids)) == "Paris, surely."
    assert req.output_ids[phase.end :] == list(reasoner.tags.close_ids)
    assert phase.answer_ids(req.output_ids) == [] and phase.forced_close == ""


def test_stop_token_while_thinking_ends_the_thinking_not_the_request(llm):
    reasoner = llm.engine.reasoner
    req = _thinking_request(llm)
    assert not req.ends_at(llm.tokenizer.eos_token_id, terminated=False)
    req.append([llm.tokenizer.encode("Hm", add_special_tokens=False)[0], llm.tokenizer.eos_token_id])
    reasoner.after_token(req)
    assert not req.thinking and req.reasoning.forced_close == "stop"
    assert llm.tokenizer.eos_token_id not in req.output_ids
    assert req.output_ids[-len(reasoner.tags.close_ids):] == list(reasoner.tags.close_ids)


def test_chat_template_with_think_tags_turns_reasoning_on(thinking_llm):
    llm = thinking_llm
    assert llm.engine.reasoner.template_thinks
    req = _thinking_request(llm)
    assert req.num_output == 0  # the template opened the think section: no tag appended
    c = llm.complete(City, "Which city is the capital of France?", max_tokens=48, max_reasoning_tokens=16)
    assert c.reasoning and isinstance(c.value, City)
    off = llm.complete(City, "Which city is the capital of France?", max_tokens=48, reasoning=False)
    assert off.reasoning is None and isinstance(off.value, City)


@pytest.mark.parametrize(("params", "fix"), [
    ({"max_reasoning_tokens": -1}, "integer >= 0"),
    ({"max_reasoning_tokens": 1.5}, "integer >= 0"),
    ({"reasoning": "yes"}, "True, False or None"),
    ({"reasoning": False, "max_reasoning_tokens": 8}, "pass reasoning=True"),
    # the default model's template does not think: a budget alone was silently ignored
    ({"max_reasoning_tokens": 8}, "does not reason by itself.*pass reasoning=True with it"),
])
def test_bad_reasoning_parameters_name_the_fix(llm, params, fix):
    with pytest.raises(InvalidParameterError, match=fix):
        llm.complete(City, PROMPT, max_tokens=8, **params)


def test_reasoner_without_think_tags_in_the_template_stays_off(tokenizer):
    reasoner = Reasoner(BudgetCloser())
    reasoner.use_tokenizer(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    assert not reasoner.template_thinks


def test_think_tags_that_are_special_tokens_are_one_token_each(tokenizer):
    spelt = ThinkTags.of(tokenizer, len(tokenizer))
    assert len(spelt.open_ids) > 1 and len(spelt.close_ids) > 1  # SmolLM2: the tags' text
    special = copy.deepcopy(tokenizer)
    special.add_special_tokens({"additional_special_tokens": [OPEN_TAG, CLOSE_TAG]})
    tags = ThinkTags.of(special, len(special))
    assert tags.open_ids == (special.convert_tokens_to_ids(OPEN_TAG),)
    assert tags.close_ids == (special.convert_tokens_to_ids(CLOSE_TAG),) and tags.close_ids[0] in tags.close_enders
