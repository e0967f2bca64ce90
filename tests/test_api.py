"""End to end through the public API on the real default model (CPU): every kind of output
type comes back typed and validated, with both grammar backends; truncation is an error;
chat prompts, batches, streams and the module-level shortcut work."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import signal
import threading
import time
import warnings
from enum import Enum
from typing import Annotated, Literal, TypedDict

import pytest
from pydantic import BaseModel, Field

import structgen
from structgen.engine.config import EngineConfig

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Address(BaseModel):
    street: str
    city: str
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):
    name: str
    age: int = Field(ge=0, le=130)
    email: str
    address: Address
    tags: list[str] = Field(max_length=3)
    member: bool


class Sentiment(Enum):
    positive = "positive"
    negative = "negative"
    neutral = "neutral"


@dataclasses.dataclass
class City:
    name: str
    population: int


class Point(TypedDict):
    x: int
    y: int


CUSTOMER_PROMPT = (
    "Extract the customer as JSON: John Smith, 42 years old, john.smith@example.com, lives at "
    "12 Oak Street, Springfield 62704. Tags: vip, newsletter. He is a member."
)
ARITH_EBNF = 'root ::= num (" " op " " num)*\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
ARITH_LARK = 'start: NUM (" " OP " " NUM)*\nNUM: /[1-9][0-9]?/\nOP: "+" | "-" | "*"'
ARITH_RE = r"[1-9][0-9]?( [+\-*] [1-9][0-9]?)*"


@pytest.fixture(scope="module")
def llm(model_dir) -> structgen.LLM:
    """The shared default LLM (backend "auto"): also what `structgen.generate` uses."""
    from structgen.api import default_llm

    return default_llm()


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend_llm(request, model_dir) -> structgen.LLM:
    return structgen.LLM(backend=request.param, config=EngineConfig(device="cpu", max_seq_len=1024))


def test_pydantic_model_both_backends(backend_llm):
    done = backend_llm.complete(Customer, CUSTOMER_PROMPT, max_tokens=200)
    assert isinstance(done.value, Customer)
    assert Customer.model_validate_json(done.text) == done.value
    assert re.fullmatch(r"[0-9]{5}", done.value.address.zip) and len(done.value.tags) <= 3
    s = done.stats
    assert s.prompt_tokens > 20 and s.output_tokens == len(done.token_ids) > 10
    assert 0 < s.forward_passes <= s.output_tokens and s.ttft_s > 0 and s.decode_s > 0


@pytest.mark.parametrize("syntax", ["ebnf", "lark"])
def test_cfg_output_parses_with_the_grammar(backend_llm, syntax):
    grammar = structgen.CFG(ARITH_EBNF if syntax == "ebnf" else ARITH_LARK)
    text = backend_llm.generate(grammar, "Write a short arithmetic expression such as 3 + 4 * 2.", max_tokens=40)
    assert re.fullmatch(ARITH_RE, text), text
    assert backend_llm.compile(grammar).accepts(text)
    assert eval(text) == eval(text)  # noqa: S307 - digits and operators only, checked above


def test_regex_choice_and_scalars(backend_llm):
    phone = backend_llm.generate(structgen.Regex(r"\(\d{3}\) \d{3}-\d{4}"), "Write a US phone number.")
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone)
    colour = backend_llm.generate(structgen.Choice(["red", "green", "blue"]), "Name a primary colour of light.")
    assert colour in ("red", "green", "blue")
    assert isinstance(backend_llm.generate(int, "How many legs does a spider have?"), int)
    assert isinstance(backend_llm.generate(bool, "Is the sky blue? Answer true or false."), bool)


def test_a_constraint_the_vocabulary_cannot_spell_is_the_callers_error(backend_llm):
    # SmolLM2 has no token holding the byte 0xF1 that starts U+40000: after "0" xgrammar's mask
    # is empty and llguidance's allows a token its matcher then refuses. Both are a dead end
    # of the constraint, named as such, and the engine goes on serving.
    with pytest.raises(structgen.UnsatisfiableConstraintError, match="vocabulary"):
        backend_llm.generate(structgen.Choice(["0\U00040000"]), "0", max_tokens=8)
    assert backend_llm.generate(structgen.Choice(["yes", "no"]), "0", max_tokens=8) in ("yes", "no")


def test_enum_literal_dataclass_typeddict(llm):
    assert isinstance(llm.generate(Sentiment, "Review: 'Loved it, will buy again.' Sentiment?"), Sentiment)
    assert llm.generate(Literal["yes", "no"], "Is Paris in France? Answer yes or no.") in ("yes", "no")
    city = llm.generate(City, "Give the largest city of Japan and its population as JSON.", max_tokens=60)
    assert isinstance(city, City) and isinstance(city.population, int)
    point = llm.generate(Point, "A point on the grid as JSON with x and y.", max_tokens=40)
    assert isinstance(point, dict) and set(point) == {"x", "y"} and all(isinstance(v, int) for v in point.values())


def test_json_schema_dict(llm):
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"},
                                                         "minItems": 2, "maxItems": 3}},
              "required": ["items"]}
    value = llm.generate(structgen.JsonSchema(schema), "List two or three fruits as JSON.", max_tokens=60)
    assert 2 <= len(value["items"]) <= 3 and all(isinstance(x, str) for x in value["items"])


def test_truncation_is_an_error_with_the_partial_text(llm):
    with pytest.raises(structgen.IncompleteOutputError) as e:
        llm.generate(Customer, CUSTOMER_PROMPT, max_tokens=6)
    assert e.value.partial_text.startswith("{") and len(e.value.token_ids) == 6
    assert e.value.stats is not None and e.value.stats.output_tokens == 6


def test_chat_messages_batch_and_module_shortcut(llm):
    messages = [{"role": "system", "content": "You extract data as JSON."},
                {"role": "user", "content": CUSTOMER_PROMPT}]
    assert isinstance(llm.generate(Customer, messages, max_tokens=200), Customer)
    cities = llm.generate_batch(City, [f"Give {c} and its population as JSON." for c in ("Oslo", "Lima", "Perth")],
                                max_tokens=60)
    assert len(cities) == 3 and all(isinstance(c, City) for c in cities)
    assert isinstance(structgen.generate(Sentiment, "Review: 'Terrible.' Sentiment?"), Sentiment)


def test_a_batch_tokenizes_its_prompts_together_as_each_alone_and_refuses_as_one_would(llm):
    """`complete_batch` tokenizes its rendered prompts in one call: every kind of prompt gets the
    ids and the greedy output it gets alone, and a bad prompt fails the batch with its own error."""
    from structgen.arguments import EncodedPrompt

    prompts = [f"Give {c} and its population as JSON." for c in ("Oslo", "Lima")]
    prompts += [[{"role": "system", "content": "You answer in JSON."}, {"role": "user", "content": "Perth?"}],
                EncodedPrompt(tuple(llm.encode_prompt("Quito and its population as JSON.")))]
    batch = llm.complete_batch(City, prompts, max_tokens=40, temperature=0.0)
    alone = [llm.complete(City, p, max_tokens=40, temperature=0.0) for p in prompts]
    assert [c.stats.prompt_tokens for c in batch] == [len(llm.encode_prompt(p) if not isinstance(p, EncodedPrompt)
                                                         else p.token_ids) for p in prompts]
    if llm.engine.device.type == "cpu":  # on a GPU a batch's bf16 rows may tip a greedy near-tie
        assert [c.text for c in batch] == [c.text for c in alone]  # (batch_invariant=True rules that out)
    with pytest.raises(structgen.PromptTooLongError):
        llm.complete_batch(City, [prompts[0], "word " * (llm.engine.max_seq_len * 8)], max_tokens=8)


def test_a_burst_renders_its_chat_prompts_in_one_template_call_and_a_failing_one_fails_alone(llm, monkeypatch):
    """The prompts of one async burst: chat prompts without tools go through the chat template
    in one call, and each gets the ids it gets alone; where the template fails on one of them,
    that caller gets its error and the others their ids."""
    prompts = ["Oslo?", [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Lima?"}],
               "a raw prompt", "Perth? (the template fails here)"]
    calls = [(prompts[0], None, None), (prompts[1], None, None), (prompts[2], False, None), (prompts[3], None, None)]
    alone = [llm.encode_prompt(p, chat=c) for p, c, _ in calls[:3]]
    template = llm.tokenizer.apply_chat_template
    batches = []

    def failing(conversations, **kw):
        batches.append(len(conversations))
        if any("fails" in m["content"] for c in conversations for m in c):
            raise ValueError("the template fails on this one")
        return template(conversations, **kw)

    monkeypatch.setattr(llm.tokenizer, "apply_chat_template", failing)
    outcomes = llm._encode_prompts(calls)
    assert [ids for ids, _ in outcomes[:3]] == alone and [e for _, e in outcomes[:3]] == [None] * 3
    assert outcomes[3][0] is None and "the template fails" in str(outcomes[3][1])
    assert batches == [3, 1, 1, 1]  # the chat prompts together, then each alone after the failure
    batches.clear()
    assert [ids for ids, _ in llm._encode_prompts(calls[:3])] == alone and batches == [2]


def test_compile_accepts(llm):
    grammar = llm.compile(Customer)
    good = ('{"name": "A", "age": 3, "email": "a@b.c", "address": {"street": "s", "city": "c", '
            '"zip": "12345"}, "tags": [], "member": true}')
    assert grammar.accepts(good)
    assert not grammar.accepts(good.replace('"12345"', '"1234"'))  # zip pattern
    assert not grammar.accepts(good[:-1])  # incomplete
    assert llm.compile(Customer) is grammar  # cached


def test_stream_reassembles_and_errors_surface(llm):
    parts = list(llm.stream(Customer, CUSTOMER_PROMPT, max_tokens=200))
    assert len(parts) > 3
    Customer.model_validate_json("".join(parts))
    too_long = "word " * (llm.engine.max_seq_len + 10)
    with pytest.raises(structgen.PromptTooLongError):
        list(llm.stream(Customer, too_long))

    async def consume() -> None:
        async for _ in llm.astream(Customer, too_long):
            pass

    with pytest.raises(structgen.PromptTooLongError):
        asyncio.run(asyncio.wait_for(consume(), timeout=60))


def test_a_value_complete_exactly_at_max_tokens_finishes_stop(llm):
    done = llm.complete(Literal["yes", "no"], "Is Paris in France? Answer yes or no.", max_tokens=1)
    assert done.value in ("yes", "no") and done.finish_reason == "stop" and len(done.token_ids) == 1


def test_free_text_at_max_tokens_comes_back_cut_off(llm):
    done = llm.complete(str, "Write a long poem about the sea.", max_tokens=3)
    assert done.finish_reason == "length" and len(done.token_ids) == 3 and done.value == done.text != ""
    assert llm.generate(str, "Write a long poem about the sea.", max_tokens=3) == done.text


def test_a_set_is_generated_as_an_array_whose_repeats_pydantic_merges(llm):
    class Fruits(BaseModel):
        fruits: set[str]

    assert isinstance(llm.generate(set[str], "List three fruits as a JSON array.", max_tokens=30), set)
    done = llm.complete(Fruits, "List three fruits as JSON.", max_tokens=40)
    assert isinstance(done.value.fruits, set) and not done.relaxed


def test_strict_false_generates_what_no_backend_enforces(llm):
    two_or_more = Annotated[set[str], Field(min_length=2)]  # repeats could leave it short: uniqueItems stays
    with pytest.raises(structgen.UnsupportedSchemaError, match="strict=False"):
        llm.generate(two_or_more, "List three fruits as a JSON array.", max_tokens=30)
    done = llm.complete(two_or_more, "List three fruits as a JSON array.", max_tokens=30, strict=False)
    assert isinstance(done.value, set) and done.relaxed == ("uniqueItems at #",)
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                        "maxItems": 2, "uniqueItems": True}}, "required": ["tags"]}
    value = llm.complete(schema, "Two tags for a blog post about cats, as JSON.", max_tokens=40, strict=False)
    assert len(set(value.value["tags"])) == len(value.value["tags"]) <= 2  # validated: the whole schema
    assert value.relaxed == ("uniqueItems at #/properties/tags",)


def test_a_plain_dict_is_a_json_schema(llm):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert isinstance(llm.generate(schema, "A JSON object with n = 3.", max_tokens=20)["n"], int)
    assert llm.compile(schema) is llm.compile(structgen.JsonSchema(schema))  # one cached grammar


def test_async_callers_of_one_schema_build_it_once_and_get_what_sync_callers_get(llm):
    schema = {"type": "object", "properties": {"tier": {"enum": ["gold", "silver", "bronze"]}}, "required": ["tier"]}
    prompts = [f"Customer {name} is on the {tier} tier. As JSON." for name, tier in
               (("Ada", "gold"), ("Bo", "silver"), ("Cy", "bronze"), ("Di", "gold"))]
    builds = []
    build = llm._constraint

    def counted(*args):
        builds.append(args[0])
        return build(*args)

    async def burst() -> list:
        return await asyncio.gather(*(llm.agenerate(dict(schema), p, max_tokens=12) for p in prompts))

    llm._constraint = counted
    try:
        got = asyncio.run(burst())
        again = asyncio.run(burst())
    finally:
        del llm._constraint
    assert len(builds) == 1  # one worker-thread build for the burst; the next burst finds it built
    assert got == again == [llm.generate(schema, p, max_tokens=12) for p in prompts]


def test_a_schema_that_fails_to_build_fails_each_async_caller_every_time(llm):
    schema = {"type": "integer", "minimum": 5, "maximum": 1}

    async def burst() -> list:
        return await asyncio.gather(*(llm.agenerate(schema, "A number.") for _ in range(3)), return_exceptions=True)

    for _ in range(2):  # a failed build is not kept: the second burst fails as the first did
        errors = asyncio.run(burst())
        assert all(isinstance(e, structgen.UnsatisfiableConstraintError) for e in errors), errors
        assert "minimum" in str(errors[0])


def test_an_async_caller_with_a_bad_schema_and_a_bad_prompt_hears_of_the_schema_and_others_are_unharmed(llm):
    # (its prompt is tokenized while the grammar builds; the grammar's error comes first)
    bad_schema = {"type": "integer", "minimum": 5, "maximum": 1}
    good = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    async def burst() -> list:
        return await asyncio.gather(llm.agenerate(bad_schema, "  "), llm.agenerate(good, "  "),
                                    llm.agenerate(good, "A JSON object with n = 3.", max_tokens=20),
                                    return_exceptions=True)

    schema_error, prompt_error, value = asyncio.run(burst())
    assert isinstance(schema_error, structgen.UnsatisfiableConstraintError)
    assert isinstance(prompt_error, structgen.InvalidParameterError) and "prompt is empty" in str(prompt_error)
    assert value == llm.generate(good, "A JSON object with n = 3.", max_tokens=20)


_tool_calls: list[int] = []


def _a_tool_function(x: int) -> int:
    _tool_calls.append(x)  # (pydantic would call a function given as the output type)
    return x


@pytest.mark.parametrize(("output_type", "prompt", "kw", "error", "fix"), [
    (Customer(name="A", age=1, email="e", address=Address(street="s", city="c", zip="12345"), tags=[], member=True),
     "p", {}, structgen.UnsupportedTypeError, "pass the class itself"),
    ("Extract the customer", Customer, {}, structgen.UnsupportedTypeError, "type first and the prompt second"),
    ("not a type", "p", {}, structgen.UnsupportedTypeError, "strings are not read as types"),
    (int, None, {}, structgen.InvalidParameterError, "prompt is None"),
    (int, "  ", {}, structgen.InvalidParameterError, "prompt is empty"),
    (int, [], {}, structgen.InvalidParameterError, "empty list of messages"),
    (int, [{"role": "robot", "content": "hi"}], {}, structgen.InvalidParameterError, "use one of system"),
    (int, [{"role": "user"}], {}, structgen.InvalidParameterError, "has no 'content'"),
    (int, "p", {"max_new_tokens": 5}, structgen.InvalidParameterError, "did you mean max_tokens"),
    (int, "p", {"temprature": 0.5}, structgen.InvalidParameterError, "did you mean temperature"),
    (int, "p", {"seed": 2**63}, structgen.InvalidParameterError, "seed must be between 0 and"),
    (int, "bad \ud800 text", {}, structgen.InvalidParameterError, "lone surrogate"),
    (int, "p", {"temperature": float("inf")}, structgen.InvalidParameterError, "temperature must be >= 0.0 and <= 100.0"),
    (int, "p", {"temperature": 1e39}, structgen.InvalidParameterError, "temperature must be >= 0.0 and <= 100.0"),
    (lambda: 1, "p", {}, structgen.UnsupportedTypeError, "not a type; for the model to call it use llm.call"),
    (_a_tool_function, "p", {}, structgen.UnsupportedTypeError, "llm.call(prompt, [_a_tool_function])"),
    (int, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     structgen.InvalidParameterError, "content part of type 'image_url'; only text parts"),
])  # fmt: skip
def test_mistakes_raise_a_structgen_error_that_names_the_fix(llm, output_type, prompt, kw, error, fix):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a string output type must not be evaluated (SyntaxWarning)
        with pytest.raises(error, match=re.escape(fix)):
            llm.generate(output_type, prompt, **kw)
    assert _tool_calls == []  # a function given as the output type is refused, not run


def test_openai_content_parts_are_read_as_their_text(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Is the sky blue? "},
                                          {"type": "text", "text": "Answer yes or no."}]}]
    joined = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    assert llm.encode_prompt(parts) == llm.encode_prompt(joined)
    assert llm.generate(Literal["yes", "no"], parts) == llm.generate(Literal["yes", "no"], joined)


def test_accepts_takes_text_and_names_the_fix_for_a_value(llm):
    grammar = llm.compile(int)
    assert grammar.accepts("42") and not grammar.accepts("4x")
    with pytest.raises(TypeError, match=re.escape("pass its JSON text (json.dumps(value))")):
        grammar.accepts(None)


def test_a_prompt_far_over_the_context_is_refused_before_tokenizing(llm):
    huge = "word " * 2_000_000  # 10 MB: tokenizing it would take seconds
    start = time.perf_counter()
    with pytest.raises(structgen.PromptTooLongError, match="characters"):
        llm.generate(str, huge)
    assert time.perf_counter() - start < 1.0


LETTERS = structgen.Regex("[a-z ]{3000}")  # never complete within max_tokens: decodes until aborted


def _wait_all_slots_free(llm: structgen.LLM, timeout_s: float) -> float:
    kv, start = llm.engine.runner.kv, time.perf_counter()
    while kv.pages.free_slots != kv.num_slots and time.perf_counter() - start < timeout_s:
        time.sleep(0.01)
    assert kv.pages.free_slots == kv.num_slots and not llm.engine.has_work()
    return time.perf_counter() - start


def test_leaving_a_sync_stream_early_aborts_the_request(llm):
    stream = llm.stream(LETTERS, "Write letters.", max_tokens=400)
    assert next(stream)
    stream.close()
    _wait_all_slots_free(llm, timeout_s=1.0)
    for _ in llm.stream(LETTERS, "Write letters.", max_tokens=400):
        break
    _wait_all_slots_free(llm, timeout_s=1.0)  # the generator left behind is collected and aborts


def test_ctrl_c_in_generate_aborts_the_request(llm):
    # Python's Ctrl-C handler, also where the suite runs as a background job (whose shell
    # ignores SIGINT, and then `interrupt_main` does nothing).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupted, main = threading.Event(), threading.main_thread().ident

    def interrupt_once_decoding() -> None:
        # Interrupt once the request has output tokens (not merely queued): a loaded machine
        # may take seconds to get there.
        deadline = time.perf_counter() + 60
        while time.perf_counter() < deadline:
            if any(r.num_output > 0 for r in list(llm.engine.scheduler.running)):
                interrupted.set()
                signal.pthread_kill(main, signal.SIGINT)  # a real Ctrl-C: it wakes a blocked wait
                return
            time.sleep(0.005)

    threading.Thread(target=interrupt_once_decoding, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(LETTERS, "Write letters.", max_tokens=400)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupted.is_set()
    _wait_all_slots_free(llm, timeout_s=1.0)


def test_llm_is_a_context_manager_and_close_stops_the_engine(model_dir):
    with structgen.LLM(config=EngineConfig(device="cpu", max_seq_len=256)) as local:
        assert local.generate(Literal["yes", "no"], "Is water wet?", max_tokens=2) in ("yes", "no")
        thread = local.loop._thread
    assert thread is not None and not thread.is_alive()
    local.close()  # idempotent
    with pytest.raises(structgen.StructgenError, match="closed"):
        local.generate(int, "One number.")


@pytest.mark.parametrize("wrap", [dict, structgen.JsonSchema], ids=["dict", "JsonSchema"])
def test_a_schema_over_the_compilers_size_limits_is_refused_before_it_is_built(llm, wrap):
    """A 20,000-value enum is over the default compiler's limit: refused by the iterative size
    check, not after normalizing it (which costs a hundred times more, per distinct schema:
    what a hostile client sends over and over)."""
    schema = wrap({"enum": [f"value-{i}" for i in range(20_000)]})
    started = time.perf_counter()
    with pytest.raises(structgen.ConstraintTooLargeError, match="max_enum_values=10,000"):
        llm.generate(schema, "Pick one.", max_tokens=4)
    assert time.perf_counter() - started < 0.05


THINK_PROMPT = "Think inside <think></think> tags first, then give the point (1, 2) as JSON."


def test_reasoning_through_every_entry_point(llm):
    """reasoning=True reaches the engine from the batch methods, the async ones and the module
    shortcut; each value is typed, `.reasoning` holds the thinking apart from `.text`."""
    kw = {"max_tokens": 40, "reasoning": True, "max_reasoning_tokens": 8}
    batch = llm.complete_batch(Point, [THINK_PROMPT, THINK_PROMPT], **kw)
    assert all(c.reasoning and "<think>" not in c.text and c.value == batch[0].value for c in batch)
    assert llm.generate_batch(Point, [THINK_PROMPT], **kw) == [batch[0].value]
    assert asyncio.run(llm.acomplete(Point, THINK_PROMPT, **kw)).reasoning == batch[0].reasoning
    assert asyncio.run(llm.agenerate(Point, THINK_PROMPT, **kw)) == batch[0].value
    assert structgen.generate(Point, THINK_PROMPT, **kw) == batch[0].value


def test_streams_yield_reasoning_deltas_then_the_answer(llm):
    kw = {"max_tokens": 40, "reasoning": True, "max_reasoning_tokens": 8}
    done = llm.complete(Point, THINK_PROMPT, **kw)
    deltas = list(llm.stream(Point, THINK_PROMPT, **kw))
    kinds = [isinstance(d, structgen.ReasoningDelta) for d in deltas]
    assert kinds[0] and not kinds[-1] and kinds == sorted(kinds, reverse=True)  # thinking first
    assert "".join(d for d in deltas if isinstance(d, structgen.ReasoningDelta)) == done.reasoning
    assert "".join(d for d in deltas if not isinstance(d, structgen.ReasoningDelta)) == done.text

    async def consume():
        stream = llm.astream(Point, THINK_PROMPT, **kw)
        pieces = [d async for d in stream]
        return pieces, stream.completion

    pieces, completion = asyncio.run(asyncio.wait_for(consume(), timeout=60))
    # The same text of each kind, thinking first; where pieces break depends on how many engine
    # steps pass between the consumer's wake-ups.
    async_kinds = [isinstance(d, structgen.ReasoningDelta) for d in pieces]
    assert async_kinds == sorted(async_kinds, reverse=True) and async_kinds[0] and not async_kinds[-1]
    for reasoning in (True, False):
        assert ("".join(d for d in pieces if isinstance(d, structgen.ReasoningDelta) == reasoning)
                == "".join(d for d in deltas if isinstance(d, structgen.ReasoningDelta) == reasoning))
    assert completion.reasoning == done.reasoning
    partial = llm.stream(Point, THINK_PROMPT, partial=True, **kw)
    snapshots = list(partial)  # the snapshots follow the answer only
    assert snapshots[-1].done and snapshots[-1].value == done.value
    assert partial.completion.reasoning == done.reasoning
