"""Budget-aware closing and the loop guard (structgen/engine/closing.py) on the default model:
outputs near max_tokens end whole, loops are closed early and reported, and a budget that no
completion fits still raises, naming the completion's length."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import BaseModel

from structgen import CFG, LLM, IncompleteOutputError, JsonSchema
from structgen.engine.closing import BudgetCloser, find_loop
from structgen.engine.config import EngineConfig
from structgen.engine.request import Request
from structgen.grammar.digit_bounds import INTEGER_BOUND, bound_integers
from structgen.sampling import SamplingParams
from structgen.types import to_constraint


class Ticket(BaseModel):
    title: str
    description: str
    priority: int


class City(BaseModel):
    name: str
    population_millions: float


CITY_PROMPT = "Describe a huge city, with its population in millions written in full digits."


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(config=EngineConfig(device="cpu", max_batch_size=4, max_seq_len=512))


def run(llm: LLM, output_type: object, prompt: str, backend: str, **params: object) -> tuple[Request, object]:
    """Generate under `backend`'s grammar; the request and its parsed value."""
    constraint = to_constraint(output_type)
    matcher = llm.grammars.compile(constraint, backend=backend).matcher()
    req = Request(llm.encode_prompt(prompt), SamplingParams(**params), matcher, frozenset(llm.engine.stop_token_ids))
    llm.loop.submit(req).result(timeout=120)
    assert req.finish_reason == "stop", (req.finish_reason, req.error, llm.tokenizer.decode(req.output_ids))
    return req, constraint.parse(llm.tokenizer.decode(req.output_ids))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_list_of_ints_at_a_small_budget_ends_whole(llm: LLM, backend: str) -> None:
    req, value = run(llm, list[int], "List the numbers from 1 to 100.", backend, max_tokens=20)
    assert isinstance(value, list) and all(isinstance(v, int) for v in value) and len(value) >= 3
    assert req.num_output <= 20 and "budget_closing" in req.stats.guards_fired


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_an_ebnf_digit_repetition_ends_at_a_small_budget(llm: LLM, backend: str) -> None:
    req, value = run(llm, CFG("root ::= [0-9]+"), "Write one followed by fifty zeros.", backend, max_tokens=12)
    assert value.isdigit() and req.num_output <= 12


def test_a_long_str_field_at_a_tight_budget_closes_into_a_valid_model(llm: LLM) -> None:
    c = llm.complete(Ticket, "Write a support ticket with a very long, detailed description.", max_tokens=30,
                     temperature=1.0, seed=1)
    assert isinstance(c.value, Ticket) and c.finish_reason == "stop" and c.stats.output_tokens <= 30
    assert c.stats.guards_fired == ["budget_closing"] and c.stats.closed_tokens > 0


def test_closing_turned_off_leaves_the_output_cut_off(llm: LLM) -> None:
    with pytest.raises(IncompleteOutputError) as e:
        llm.complete(Ticket, "Write a support ticket with a very long, detailed description.", max_tokens=30,
                     temperature=1.0, seed=1, close_at_budget=False, loop_guards=False)
    assert len(e.value.token_ids) == 30 and e.value.stats.guards_fired == []


def test_a_budget_below_the_shortest_completion_raises_naming_its_length(llm: LLM) -> None:
    with pytest.raises(IncompleteOutputError) as e:
        llm.complete(Ticket, "Write a ticket.", max_tokens=5)
    needed = e.value.stats.shortest_completion
    assert needed is not None and needed > 0
    assert f"the shortest completion from there needed {needed} more token(s)" in str(e.value)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_looping_number_is_closed_early_and_reported(llm: LLM, backend: str) -> None:
    req, value = run(llm, City, CITY_PROMPT, backend, max_tokens=60)
    assert isinstance(value, City) and req.num_output < 50
    assert req.stats.guards_fired == ["repetition"] and req.stats.loop.strip().isdigit()


def test_with_loop_guards_off_the_error_names_the_loop_and_the_bound_to_add(llm: LLM) -> None:
    with pytest.raises(IncompleteOutputError) as e:
        llm.complete(City, CITY_PROMPT, max_tokens=40, close_at_budget=False, loop_guards=False)
    message = str(e.value)
    assert "the output looped, repeating" in message and "le=" in message and "maximum" in message
    assert "raise max_tokens" not in message and e.value.stats.guards_fired == []


def test_find_loop_finds_the_period_of_a_repeating_tail() -> None:
    assert find_loop([5, 6, 7] + [1] * 16) is None  # a run of 15 repeats: under the threshold
    assert find_loop([5, 6, 7] + [1] * 17) == 1
    item = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert find_loop([1, 2] + item * 4) == 10
    assert find_loop([1, 2] + item * 3) is None
    assert find_loop(list(range(200))) is None


class Big(BaseModel):
    value: int


def test_an_unbounded_integer_stops_at_the_digit_bound_and_is_reported(llm: LLM) -> None:
    c = llm.complete(Big, "Write one followed by forty zeros.", max_tokens=40)
    assert abs(c.value.value) <= INTEGER_BOUND and "integer_digits" in c.stats.guards_fired
    off = llm.complete(Big, "Write one followed by forty zeros.", max_tokens=40, loop_guards=False)
    assert abs(off.value.value) > INTEGER_BOUND and "integer_digits" not in off.stats.guards_fired


def test_the_digit_bound_leaves_bounded_integers_and_other_types_alone() -> None:
    schema = {"type": "object", "properties": {
        "free": {"type": "integer"}, "low": {"type": "integer", "minimum": 0},
        "grid": {"type": "integer", "multipleOf": 5}, "x": {"type": "number"},
        "ids": {"type": "array", "items": {"type": ["integer", "null"]}}}}
    bounded = json.loads(bound_integers(to_constraint(JsonSchema(schema))).source)["properties"]
    assert (bounded["free"]["minimum"], bounded["free"]["maximum"]) == (-INTEGER_BOUND, INTEGER_BOUND)
    assert bounded["low"]["minimum"] == 0 and bounded["low"]["maximum"] == INTEGER_BOUND
    assert "maximum" not in bounded["grid"] and "maximum" not in bounded["x"]
    assert bounded["ids"]["items"]["maximum"] == INTEGER_BOUND
    regex = to_constraint(int)
    assert bound_integers(regex) is regex


class Scientist(BaseModel):
    name: str
    city: str
    country: str


def test_an_item_opened_past_the_budget_is_dropped_and_the_list_closed_before_it(llm: LLM) -> None:
    prompt = ("Give a JSON list of five famous people, each with name, city and country: Einstein from Ulm, "
              "Germany; Curie from Warsaw, Poland; Newton from Woolsthorpe, England; Darwin from Shrewsbury, "
              "England; Tesla from Smiljan, Croatia.")
    c = llm.complete(list[Scientist], prompt, max_tokens=40)
    assert c.finish_reason == "stop" and len(c.value) >= 1 and all(isinstance(p, Scientist) for p in c.value)
    assert c.stats.dropped_tokens > 0 and c.stats.guards_fired == ["budget_closing"]
    assert c.stats.output_tokens <= 40


def test_a_draft_postpones_a_loop_check_but_never_a_budget_check() -> None:
    """Jump-forward proposes a two-token draft only with room before the next check that may
    close the output; a loop check waits for it (so the guards cost no drafts), a budget check
    or max_tokens does not."""
    req = Request(list(range(5)), SamplingParams(max_tokens=100))
    req.token_ids += [7] * 40  # 40 output tokens
    req.budget_check_at, req.close_at = 80, 41  # a loop check next
    assert BudgetCloser.room_for(req, 2) and req.close_at == 42
    req.budget_check_at, req.close_at = 41, 41  # a budget check next
    assert not BudgetCloser.room_for(req, 2) and req.close_at == 41
    off = Request(list(range(5)), SamplingParams(max_tokens=41, close_at_budget=False))
    off.token_ids += [7] * 40
    off.close_at = 41  # max_tokens next
    assert not BudgetCloser.room_for(off, 2)
    assert BudgetCloser.room_for(off, 1)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_the_search_ends_a_number_where_more_fields_are_required(llm: LLM, backend: str) -> None:
    """After a number's first digit, more digits are always allowed: the search must end the
    number with a comma (then the forced next key) instead of writing digits forever."""
    schema = {"type": "array", "items": {"type": "object", "additionalProperties": False,
              "properties": {"a": {"type": "number"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
    constraint = to_constraint(JsonSchema(schema))
    m = llm.grammars.compile(constraint, backend=backend).matcher()
    prefix = llm.tokenizer.encode('[{"a": 2', add_special_tokens=False)
    assert m.accept_tokens(prefix) == len(prefix)
    plan = llm.engine.closer.search.shortest(m, 32)
    assert plan is not None and len(plan) <= 12
    value = json.loads(llm.tokenizer.decode(prefix + plan))
    assert value[0]["a"] == 2 and isinstance(value[0]["b"], int)


def test_forced_text_stops_at_the_next_budget_check() -> None:
    """Jump-forward's forced text fills output only up to the token before the next budget
    check, so the closer sees the output before the budget is spent, at a sampled token (as
    in any other step); with closing off, up to max_tokens."""
    req = Request(list(range(5)), SamplingParams(max_tokens=100))
    req.token_ids += [7] * 30
    req.budget_check_at = 40
    assert BudgetCloser.forced_text_end(req) == 39
    req.budget_check_at = 20  # due: it runs at the next token (forced text at the start, say)
    assert BudgetCloser.forced_text_end(req) == 100
    off = Request(list(range(5)), SamplingParams(max_tokens=100, close_at_budget=False))
    off.budget_check_at = 40
    assert BudgetCloser.forced_text_end(off) == 100


def test_the_search_never_returns_a_completion_longer_than_its_limit(llm: LLM) -> None:
    """Forced text can overrun the limit in one go: the search then has no completion within
    it, and the closer must not append one (max_tokens=4 cannot hold this constant)."""
    schema = {"type": "object", "properties": {"kind": {"const": "a fairly long constant string"}},
              "required": ["kind"], "additionalProperties": False}
    m = llm.grammars.compile(to_constraint(JsonSchema(schema))).matcher()
    assert llm.engine.closer.search.shortest(m, 4) is None
    assert len(llm.engine.closer.search.shortest(m, 64) or []) > 4


def test_a_small_budget_drops_back_to_the_start_when_what_opened_cannot_close(llm: LLM) -> None:
    """At max_tokens=48 the first budget check is due at once; the empty output is then noted
    as a point where a completion fits, so an item with a required `uri` field that does not fit
    (MaskBench Github_easy o10318) is dropped and the list closed: complete, never cut off."""
    schema = {"type": "array", "readOnly": True, "items": {
        "type": "object", "additionalProperties": False, "required": ["href", "rel"],
        "properties": {"description": {"type": "string"}, "href": {"type": "string", "format": "uri"},
                       "rel": {"type": "string"}}}}
    prompt = f"Write an example JSON value for this schema: {json.dumps(schema)}"
    c = llm.complete(JsonSchema(schema), prompt, max_tokens=48, temperature=0)
    assert c.finish_reason == "stop" and isinstance(c.value, list)


SCIENTISTS_PROMPT = ("Give a JSON list of five famous people, each with name, city and country: Einstein from Ulm, "
                     "Germany; Curie from Warsaw, Poland; Newton from Woolsthorpe, England; Darwin from "
                     "Shrewsbury, England; Tesla from Smiljan, Croatia.")


def test_a_stream_that_closing_rolls_back_sends_only_text_of_the_final_output(llm: LLM) -> None:
    """Closing drops the item opened past the budget; the stream held that item back, so its
    deltas add up to the final text (sent text cannot be taken back)."""
    stream = llm.stream(list[Scientist], SCIENTISTS_PROMPT, max_tokens=40)
    deltas = []
    while True:
        try:
            deltas.append(next(stream))
        except StopIteration as end:
            c = end.value
            break
    assert c.stats.dropped_tokens > 0 and c.finish_reason == "stop"
    assert "".join(deltas) == c.text


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("field", [{"format": "uri"}, {"format": "email"}, {"format": "time"},
                                   {"format": "duration"}, {"pattern": "^[a-z]+@[a-z]+\\.[a-z]+$"}])
def test_the_search_closes_strings_whose_format_or_pattern_holds_the_quote_back(
        llm: LLM, backend: str, field: dict) -> None:
    """Greedy tokens alone never reach the quote of these strings (`[a-z]+` takes letters
    forever where an `@` must come); the probe finds the few characters that let it come."""
    schema = {"type": "object", "properties": {"v": {"type": "string", **field}}, "required": ["v"]}
    matcher = llm.grammars.compile(to_constraint(JsonSchema(schema)), backend=backend).matcher()
    plan = llm.engine.closer.search.shortest(matcher, 30)
    assert plan is not None and matcher.accept_tokens(plan) == len(plan)
    assert matcher.is_completed()
    value = json.loads(llm.tokenizer.decode(plan))["v"]
    if "pattern" in field:
        assert re.fullmatch(field["pattern"], value)


def test_a_safe_point_that_respelt_tokens_moved_past_an_opened_item_still_closes(llm: LLM, maskbench_dir) -> None:
    """Jump-forward respells `true` + `},` as `true},` after the check that found `}]` fits, so
    the safe point's token count lands after the comma that opens a second item (MaskBench
    Github_easy o23494); the rollback steps back a token more and closes the list."""
    line = next((s for s in (maskbench_dir / "Github_easy.jsonl").read_text().splitlines()
                 if '"Github_easy---o23494"' in s), None)
    if line is None:  # a partial copy of the corpus (the device carries its first lines)
        pytest.skip(f"MaskBench record Github_easy---o23494 is not in {maskbench_dir}")
    schema = json.loads(line)["schema"]
    prompt = ("Extract the record as JSON from this text. [{'childno': 1, 'split': False, 'pause': True, "
              "'relativeangle': 90.0, 'ejectmass': False}, {'childno': 2, 'split': True, 'pause': False, "
              "'relativeangle': -45.0, 'ejectmass': True}, {'childno': 3, 'split': False, 'pause': False, "
              "'relativeangle': 180.0, 'ejectmass': False}]")
    c = llm.complete(JsonSchema(schema), [{"role": "user", "content": prompt}], max_tokens=48)
    assert c.finish_reason == "stop" and c.stats.dropped_tokens > 0 and len(c.value) >= 1


def _feed(llm: LLM, text: str, chunks: list[int]) -> Request:
    """A request whose output is `text`'s tokens, `chunks` of them at a time (1: sampled
    tokens, each followed by the closer's check where one is due; more: forced text, then
    `after_forced_text`), as the engine's steps would bring them."""
    cfg = CFG('root ::= "[" item ("," item)* "]"\nitem ::= [a-z] "-and-some-forced-text"')
    matcher = llm.grammars.compile(to_constraint(cfg)).matcher()
    req = Request(llm.encode_prompt("Items:"), SamplingParams(max_tokens=200), matcher,
                  frozenset(llm.engine.stop_token_ids))
    closer = llm.engine.closer
    closer.admit(req)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    at = 0
    for n in chunks:
        if req.finished or at >= len(ids):
            break
        part = ids[at : at + n]
        at += len(part)
        assert matcher.accept_tokens(part) == len(part)
        req.append(part, forced=n > 1)
        if n > 1:
            closer.after_forced_text(req, len(part))
        elif req.num_output >= req.close_at:
            closer.at_budget(req, matcher.is_completed())
    return req


def test_a_loop_check_that_forced_text_runs_over_closes_where_plain_decoding_would(llm: LLM) -> None:
    """Loop checks sit at every LOOP_CHECK_EVERY output tokens; forced text runs over them
    and each then runs on the output up to its place: a repeating output is closed at the
    same token, with the same tokens, whether they came one a step or in long forced runs."""
    text = "[" + ",".join(["a-and-some-forced-text"] * 12)
    one_by_one = _feed(llm, text, [1] * 400)
    forced_runs = _feed(llm, text, [1, 9, 1, 13, 1, 29, 1, 40, 1, 60, 1, 70])
    assert "repetition" in one_by_one.stats.guards_fired and one_by_one.finished
    assert forced_runs.token_ids == one_by_one.token_ids and forced_runs.finished
    assert forced_runs.num_output < len(llm.tokenizer.encode(text, add_special_tokens=False))  # forced text was cut
    assert json.loads(llm.tokenizer.decode(forced_runs.output_ids).replace("-and-some-forced-text", "").replace(
        "a", '"a"'))  # closed into a whole list


def test_forced_text_over_a_loop_check_stays_where_the_output_does_not_loop(llm: LLM) -> None:
    """A check that finds no loop leaves the forced text whole and moves to the next place."""
    text = "[" + ",".join(f"{c}-and-some-forced-text" for c in "abcdefgh")
    n = len(llm.tokenizer.encode(text, add_special_tokens=False))
    req = _feed(llm, text, [1, n - 1])
    assert not req.finished and req.num_output == n and req.stats.guards_fired == []
    assert req.close_at > req.num_output and req.close_at % 16 == 0


class Person(BaseModel):
    name: str
    age: int


def _stream_all(llm: LLM, output_type: object, prompt: str, **options: object) -> tuple[list[str], object]:
    """The deltas of a typed stream and its completion."""
    stream = llm.stream(output_type, prompt, **options)
    deltas = []
    while True:
        try:
            deltas.append(next(stream))
        except StopIteration as end:
            return deltas, end.value


@pytest.mark.parametrize("max_tokens", [24, 40, 64])
def test_a_typed_stream_at_a_small_budget_sends_its_text_as_it_goes(llm: LLM, max_tokens: int) -> None:
    """A budget at most FIRST_CHECK_WINDOW makes the empty output a safe point, and the stream
    holds back what follows it until a check moves it: a stream's checks come every few
    tokens, so its text comes in several deltas, not all at the end (one delta of the whole
    value before)."""
    deltas, c = _stream_all(llm, Person, "Ada Lovelace is 36 years old.", max_tokens=max_tokens)
    assert c.finish_reason == "stop" and isinstance(c.value, Person)
    assert "".join(deltas) == c.text
    assert len(deltas) >= 3, deltas


@pytest.mark.parametrize("max_tokens", [20, 28, 36, 44])
def test_a_stream_closed_at_a_small_budget_never_takes_back_text(llm: LLM, max_tokens: int) -> None:
    """Closing drops the items opened past the budget; the stream held them back, so its
    deltas add up to the final text, at every small budget."""
    deltas, c = _stream_all(llm, list[Scientist], SCIENTISTS_PROMPT, max_tokens=max_tokens)
    assert c.finish_reason == "stop" and "budget_closing" in c.stats.guards_fired
    assert "".join(deltas) == c.text
