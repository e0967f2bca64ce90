"""Constraints a hostile or careless client can send: refused at compile time with the right
error, quickly, or generated within bounded memory; and `GrammarCompiler.submit`'s pool.

Real tokenizer, real backends and the real default model on CPU (fixtures in conftest.py).
"""

from __future__ import annotations

import json
import resource
import time
from concurrent.futures import CancelledError

import pytest

from structgen import LLM, JsonSchema
from structgen.engine.config import EngineConfig
from structgen.errors import (
    ConstraintTooLargeError,
    IncompleteOutputError,
    UnsatisfiableConstraintError,
)
from structgen.grammar import GrammarCompiler
from structgen.grammar.backends.base import FORCED_TEXT_MAX_BYTES
from structgen.grammar.json_format import JSON_SEPARATORS
from structgen.grammar.limits import ConstraintLimits
from structgen.types import CFG, Regex, to_constraint

SELF_REQUIRED = {
    "$defs": {
        "n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}
    },
    "$ref": "#/$defs/n",
}
# A oneOf whose branches are proved disjoint pairwise: seconds of Python-side normalization.
SLOW_ONE_OF = {
    "oneOf": [
        {"type": "object", "properties": {"k": {"const": i}, "v": {"type": "string", "pattern": f"^a{i}b+$"}},
         "required": ["k"]}
        for i in range(300)
    ]
}


def refused(compiler: GrammarCompiler, output_type: object, error: type[Exception]) -> str:
    """Compile `output_type`, expect `error` within two seconds, return its message."""
    start = time.perf_counter()
    with pytest.raises(error) as caught:
        compiler.compile(to_constraint(output_type))
    assert time.perf_counter() - start < 2.0
    return str(caught.value)


@pytest.fixture(scope="module")
def compiler_for(model_dir, tokenizer):
    """Builds a GrammarCompiler for the default model with the given keyword arguments."""
    from structgen.engine.models.loader import load_model_config

    vocab_size = load_model_config(model_dir).vocab_size
    return lambda **kw: GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id], **kw)


# -- no finite output: refused at compile time -------------------------------------------------
def test_a_schema_whose_required_property_refers_back_to_itself_is_refused_naming_it(grammar_compiler):
    message = refused(grammar_compiler, JsonSchema(SELF_REQUIRED), UnsatisfiableConstraintError)
    assert "'next'" in message and "#/$defs/n" in message and "optional" in message


def test_the_same_schema_with_an_optional_property_compiles(grammar_compiler):
    optional = json.loads(json.dumps(SELF_REQUIRED))
    del optional["$defs"]["n"]["required"]
    instance = json.dumps({"next": {"next": {}}}, separators=JSON_SEPARATORS)
    assert grammar_compiler.compile(to_constraint(JsonSchema(optional))).accepts(instance)


@pytest.mark.parametrize(
    ("grammar", "syntax", "rule"),
    [
        ('root ::= "ab" root', "ebnf", "'root'"),
        ('root ::= root "a"', "ebnf", "'root'"),
        ('root ::= "x" | "a" loop\nloop ::= "b" loop', "ebnf", "'loop'"),
        ('start: "ab" start', "lark", "'root'"),
    ],
)
def test_a_grammar_rule_without_a_base_case_is_refused_naming_the_rule(grammar_compiler, grammar, syntax, rule):
    message = refused(grammar_compiler, CFG(grammar, syntax=syntax), UnsatisfiableConstraintError)
    assert f"{rule}" in message and "never finishes" in message and "base case" in message


def test_a_regex_that_matches_nothing_is_refused(grammar_compiler):
    message = refused(grammar_compiler, Regex(r"[^\s\S]"), UnsatisfiableConstraintError)
    assert "matches no string" in message


# -- size limits, before any recursive work ---------------------------------------------------
def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_nested_300_deep_is_refused_by_the_depth_limit_not_a_recursion_error(as_text):
    schema = nested_arrays(300)
    start = time.perf_counter()
    with pytest.raises(ConstraintTooLargeError, match="max_depth=64"):
        to_constraint(JsonSchema(json.dumps(schema) if as_text else schema))
    assert time.perf_counter() - start < 1.0


def test_a_schema_nested_60_deep_compiles(grammar_compiler):
    grammar = grammar_compiler.compile(to_constraint(JsonSchema(nested_arrays(60))))
    assert grammar.accepts(json.dumps(json.loads("[" * 60 + "1" + "]" * 60), separators=JSON_SEPARATORS))


def test_an_enum_over_the_limit_is_refused_naming_the_limit_and_how_to_raise_it(grammar_compiler):
    values = [f"value-{i}" for i in range(20_000)]
    message = refused(grammar_compiler, JsonSchema({"enum": values}), ConstraintTooLargeError)
    assert "20,000" in message and "max_enum_values=10,000" in message and "ConstraintLimits" in message


def test_a_9000_value_enum_is_built_and_compiled_in_seconds(grammar_compiler):
    start = time.perf_counter()
    grammar = grammar_compiler.compile(to_constraint(JsonSchema({"enum": [f"value-{i}" for i in range(9_000)]})))
    assert time.perf_counter() - start < 8.0
    assert grammar.accepts('"value-8999"') and not grammar.accepts('"value-9000"')


def test_a_compiler_with_smaller_limits_refuses_larger_text(compiler_for):
    small = compiler_for(limits=ConstraintLimits(max_source_bytes=100))
    with pytest.raises(ConstraintTooLargeError, match="max_source_bytes=100"):
        small.compile(to_constraint(Regex("a" * 200)))


def test_a_compile_over_its_time_budget_is_refused(compiler_for):
    hurried = compiler_for(compile_timeout=0.0)
    with pytest.raises(ConstraintTooLargeError, match="compile time budget"):
        hurried.compile(to_constraint(CFG('root ::= "a" root | "b"')))


# -- submit: the compiler's own pool ------------------------------------------------------------
def test_submit_compiles_on_the_pool_and_shares_a_compile_in_flight(compiler_for):
    compiler = compiler_for(workers=1)
    first = compiler.submit(JsonSchema(json.dumps({"enum": ["a", "b"]})))
    second = compiler.submit(JsonSchema(json.dumps({"enum": ["a", "b"]})))
    assert first.result(timeout=30) is second.result(timeout=30)
    assert compiler.submit(to_constraint(JsonSchema({"enum": ["a", "b"]}))).done()  # a cache hit


def test_submit_hands_compile_errors_to_the_future(compiler_for):
    future = compiler_for().submit(CFG('root ::= "ab" root'))
    with pytest.raises(UnsatisfiableConstraintError):
        future.result(timeout=30)


def test_cancelling_a_running_compile_stops_its_python_work(compiler_for):
    compiler = compiler_for(workers=1)
    slow = compiler.submit(JsonSchema(json.dumps(SLOW_ONE_OF)))
    time.sleep(0.3)  # running now
    start = time.perf_counter()
    assert slow.cancel() and slow.cancelled()
    with pytest.raises(CancelledError):
        slow.result()
    # The single worker is free again soon: the next compile does not wait for the slow one.
    assert compiler.submit(Regex("[ab]+")).result(timeout=30).accepts("ab")
    assert time.perf_counter() - start < 1.5


def test_a_compile_cancelled_by_one_caller_goes_on_for_another(compiler_for):
    compiler = compiler_for(workers=1)
    text = JsonSchema(json.dumps({"type": "array", "items": {"enum": [1, 2]}}))
    leaving, staying = compiler.submit(text), compiler.submit(text)
    leaving.cancel()
    assert staying.result(timeout=30).accepts(json.dumps([1, 2], separators=JSON_SEPARATORS))


def test_a_full_queue_fails_fast(compiler_for):
    from structgen.errors import CompilerBusyError

    compiler = compiler_for(workers=1, max_queued=1)
    busy = compiler.submit(JsonSchema(json.dumps(SLOW_ONE_OF)))
    with pytest.raises(CompilerBusyError, match="max_queued=1"):
        compiler.submit(Regex("[xy]+"))
    busy.cancel()


# -- forced text: bounded per step, generation bounded by max_tokens -----------------------
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(config=EngineConfig(device="cpu", max_batch_size=2, max_seq_len=512))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_forced_text_is_cut_to_the_bytes_asked_for_at_a_character_boundary(grammar_compiler, backend):
    m = grammar_compiler.compile(to_constraint(Regex("é{50}")), backend=backend).matcher()
    assert m.jump_forward_string(7) == "ééé" and m.jump_forward_string() == "é" * 50


def test_llguidance_forced_text_is_asked_for_in_pieces(compiler_for):
    grammar = compiler_for(backend="llguidance").compile(to_constraint(JsonSchema({"const": "x" * 20_000})))
    m = grammar.matcher()
    assert 0 < len(m.jump_forward_string().encode()) <= FORCED_TEXT_MAX_BYTES
    assert len(m.jump_forward_string(10)) == 10


@pytest.mark.parametrize(
    "output_type",
    [
        JsonSchema({"const": "x" * 20_000}),
        # each rule doubles its text: 2**29 forced bytes if followed to the end
        CFG('root ::= "x" a1\n' + "\n".join(f"a{i} ::= a{i + 1} a{i + 1}" for i in range(1, 30)) + '\na30 ::= "y"'),
    ],
)
def test_a_long_forced_text_generates_at_small_max_tokens_without_growing_memory(llm, output_type):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(IncompleteOutputError):
        llm.generate(output_type, "Write it.", max_tokens=16)
    assert time.perf_counter() - start < 20.0
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 300


def test_llguidance_jumps_a_long_const_in_pieces_up_to_max_tokens():
    llm = LLM(backend="llguidance", config=EngineConfig(device="cpu", max_batch_size=2, max_seq_len=512))
    start = time.perf_counter()
    with pytest.raises(IncompleteOutputError) as caught:
        llm.generate(JsonSchema({"const": "x" * 20_000}), "Write it.", max_tokens=40)
    assert time.perf_counter() - start < 20.0
    text = caught.value.partial_text
    assert len(caught.value.token_ids) == 40 and text.startswith('"xxxx') and set(text[1:]) == {"x"}
