"""Constraints a hostile or careless client can send: refused at compile time with the right
error, quickly, or generated within bounded memory; and `GrammarCompiler.submit`'s pool.

Real tokenizer, real backends and the real default model on CPU (fixtures in conftest.py).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Annotated

import pydantic
import pytest

from structgen import LLM, JsonSchema
from structgen.engine.config import EngineConfig
from structgen.errors import (
    ConstraintTooLargeError,
    IncompleteOutputError,
    InvalidConstraintError,
    UnsatisfiableConstraintError,
    UnsupportedSchemaError,
)
from structgen.grammar import GrammarCompiler
from structgen.grammar.backends.base import FORCED_TEXT_MAX_BYTES, allocate_bitmask
from structgen.schema.json_format import JSON_SEPARATORS
from structgen.schema.keywords import llguidance_crash_issues
from structgen.schema.limits import ConstraintLimits
from structgen.types import CFG, Constraint, Regex, to_constraint

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


def test_an_untyped_self_requiring_schema_is_refused_saying_how_it_was_read(grammar_compiler):
    """Without "type", JSON Schema would take any non-object (`5`); the grammar reads the
    schema as an object, and the message says so beside the usual fix."""
    untyped = {"properties": {"self": {"$ref": "#"}}, "required": ["self"]}
    message = refused(grammar_compiler, JsonSchema(untyped), UnsatisfiableConstraintError)
    assert "'self'" in message and 'no "type"' in message and "non-object" in message
    typed = refused(grammar_compiler, JsonSchema({**untyped, "type": "object"}), UnsatisfiableConstraintError)
    assert "'self'" in typed and 'no "type"' not in typed


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


def test_a_schema_only_llguidance_reads_and_that_matches_nothing_is_refused_not_failed(
        grammar_compiler, monkeypatch):
    """A `$ref` that resolves to itself, with no content: xgrammar 0.2.9 cannot read it
    ("Circular $ref chain"), so the termination check is skipped and llguidance compiles it;
    its fresh matcher then stops before any token (NoExtensionBias). That is a constraint
    nothing can satisfy (a 400 from the server), not an engine failure (a 500, which the
    server fuzz found). Forced here whatever xgrammar's version reads."""
    from structgen.grammar import compiler as compiler_module

    monkeypatch.setattr(compiler_module, "analyse", lambda constraint: None)
    nested = {"$defs": {"d": {"$defs": {"d": {"type": "string"}}, "$ref": "#/$defs/d"}}, "$ref": "#/$defs/d"}
    with pytest.raises(UnsatisfiableConstraintError) as caught:
        grammar_compiler.compile(Constraint("json_schema", json.dumps(nested)), backend="llguidance")
    assert "matches nothing" in str(caught.value) and "llguidance found no first token" in str(caught.value)
    # where xgrammar refused it first (as 0.2.9 does), its plainer reason comes along
    circular = "xgrammar cannot compile JSON schema: Circular $ref chain with no schema content"

    def refuse(constraint):
        raise InvalidConstraintError(circular)

    monkeypatch.setattr(grammar_compiler.adapter("xgrammar"), "compile", refuse)
    with pytest.raises(UnsatisfiableConstraintError) as caught:
        grammar_compiler.compile(Constraint("json_schema", json.dumps(nested)))
    assert "matches nothing" in str(caught.value) and f"xgrammar refused it: {circular}" in str(caught.value)
    # the schema layer names the loop before any compile (the compiler's check is for what it misses)
    with pytest.raises(InvalidConstraintError, match=r"\$ref chain at # \(#/\$defs/d -> #/\$defs/d\)"):
        to_constraint(JsonSchema(nested))


# -- schemas that crashed a native compiler: compiled in a child process ----------------------
# Each compile runs in its own interpreter, so a regression fails the test instead of killing
# pytest with the process. The child prints, per (backend, strict), "compiled" or the
# StructgenError class and keyword; anything else (a crash, another exception) fails.
COMPILE_IN_CHILD = """
import json, sys
from structgen.engine.models.loader import load_model_config, load_tokenizer
from structgen.errors import StructgenError
from structgen.grammar import GrammarCompiler
from structgen.types import CFG, JsonSchema, to_constraint

model_dir, kind, text = sys.argv[1], sys.argv[2], sys.stdin.read()
output = JsonSchema(json.loads(text)) if kind == "json" else CFG(text, syntax="lark")
tokenizer = load_tokenizer(model_dir)
vocab_size = load_model_config(model_dir).vocab_size
for backend in ("auto", "llguidance"):
    for strict in (True, False):
        compiler = GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id])
        try:
            compiler.compile(to_constraint(output, strict=strict), backend)
            print(backend, strict, "compiled", flush=True)
        except StructgenError as e:
            print(backend, strict, type(e).__name__, getattr(e, "keyword", None), flush=True)
"""
REPO_ROOT = Path(__file__).resolve().parents[2]
INT64_MIN = -(2**63)
# Found by a fuzzer: normalizing oneOf intersects {"enum": [-1e308]} with an integer type;
# llguidance saturates that integer range to [-2**63, -2**63] and recursed without end.
ONE_OF_HUGE_NEGATIVE_ENUM = {
    "oneOf": [
        {"type": "object", "properties": {"self": {"$ref": "#"}, "x": {"type": "string", "pattern": "true"}}},
        {"type": "object", "properties": {"self": {"$ref": "#"}, "x": {"enum": [-1e308]}}},
    ]
}
HOSTILE_INTEGER_SCHEMAS = {
    "oneOf-enum-1e308": ONE_OF_HUGE_NEGATIVE_ENUM,
    "const-int64-min": {"type": "object", "properties": {"n": {"const": INT64_MIN}}},
    "integer-range-below-int64": {"type": "integer", "minimum": -1e20, "maximum": -1e19},
    "allOf-bounds-below-int64": {"allOf": [{"type": "integer", "exclusiveMaximum": -1e20}, {"minimum": -1e21}]},
}


def compile_in_child(model_dir: Path, kind: str, text: str) -> dict[tuple[str, bool], str]:
    """{(backend, strict): outcome} from compiling a JSON schema or Lark grammar `text` in a
    fresh interpreter."""
    child = subprocess.run(
        [sys.executable, "-c", COMPILE_IN_CHILD, str(model_dir), kind],
        input=text, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, f"the compile died (exit {child.returncode}): {child.stderr[-2000:]}"
    outcomes = {}
    for line in child.stdout.splitlines():
        backend, strict, outcome = line.split(" ", 2)
        outcomes[(backend, strict == "True")] = outcome
    assert len(outcomes) == 4, child.stdout
    return outcomes


@pytest.mark.parametrize("schema", HOSTILE_INTEGER_SCHEMAS.values(), ids=HOSTILE_INTEGER_SCHEMAS)
def test_an_integer_at_or_below_int64_min_never_crashes_and_llguidance_refuses_it_naming_the_keyword(
    model_dir, schema
):
    outcomes = compile_in_child(model_dir, "json", json.dumps(schema))
    error, keyword = outcomes[("llguidance", True)].split()
    assert error == "UnsupportedSchemaError", outcomes
    assert keyword in ("allOf", "const", "enum", "minimum", "maximum", "exclusiveMaximum"), outcomes
    # strict=False may instead leave the keyword out of the grammar (validated afterwards)
    relaxed = outcomes[("llguidance", False)]
    assert relaxed == "compiled" or relaxed.split()[0] == "UnsupportedSchemaError", outcomes


def test_a_tool_whose_parameters_hold_int64_min_never_crashes_the_tool_grammar(model_dir):
    from structgen.tool_format import auto_grammar

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"const": INT64_MIN}}, "required": ["n"]}}}  # fmt: skip
    outcomes = compile_in_child(model_dir, "lark", auto_grammar([tool], parallel=False))
    assert outcomes[("llguidance", True)] == "UnsupportedSchemaError const", outcomes


def ref_chain(length: int) -> dict:
    """A schema whose `$ref`s go `length` definitions deep: [[[...1...]]]."""
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(length)}
    return {"$defs": {**defs, f"d{length}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def rule_chain(length: int) -> str:
    """A Lark grammar whose rules go `length` deep, each starting with the next: b a a ... a."""
    rules = "\n".join(f'r{i}: r{i + 1} "a"' for i in range(length))
    return f'start: r0\n{rules}\nr{length}: "b"\n'


@pytest.mark.parametrize(
    ("kind", "text"),
    [("json", json.dumps(ref_chain(3000))), ("lark", rule_chain(3000))],
    ids=["3000-refs", "3000-lark-rules"],
)
def test_a_chain_of_3000_refs_or_rules_compiles_without_overflowing_a_native_stack(model_dir, kind, text):
    outcomes = compile_in_child(model_dir, kind, text)
    assert outcomes[("auto", True)] == outcomes[("llguidance", True)] == "compiled", outcomes


def test_an_integer_range_just_inside_int64_compiles_with_llguidance(grammar_compiler):
    schema = {"type": "integer", "minimum": -9223372036854774000, "maximum": -9223372036854773000}
    assert llguidance_crash_issues(schema) == []
    grammar = grammar_compiler.compile(to_constraint(JsonSchema(schema)), backend="llguidance")
    assert grammar.accepts("-9223372036854773500") and not grammar.accepts("-1")


def test_a_huge_negative_float_is_left_to_llguidance_unless_an_integer_type_is_declared():
    assert llguidance_crash_issues({"type": "number", "enum": [-1e308, 5]}) == []
    found = llguidance_crash_issues({"anyOf": [{"type": "integer"}, {"const": [-1e300]}]})
    assert [(i.keyword, i.path) for i in found] == [("const", "#/anyOf/1")]


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


@pytest.mark.parametrize("keys", [["k" * 10_000], [f"field_{i:04d}" for i in range(300)]], ids=["one long", "many"])
def test_many_characters_of_property_names_compile_in_a_fraction_of_a_second(grammar_compiler, keys):
    """xgrammar's compile takes milliseconds per character of property names (a 10,000-character
    key held a compile worker for minutes, out of the time budget's reach); auto compiles such
    schemas with llguidance instead."""
    schema = JsonSchema({"type": "object", "properties": {k: {"type": "integer"} for k in keys}, "required": keys})
    start = time.perf_counter()
    grammar = grammar_compiler.compile(to_constraint(schema))
    assert grammar.backend == "llguidance" and time.perf_counter() - start < 2.0
    text = "{" + ", ".join(f'"{k}": 1' for k in keys) + "}"
    assert grammar.accepts(text) and not grammar.accepts(text.replace('"k', '"x', 1).replace('"f', '"x', 1))


@pytest.mark.parametrize("output_type", [
    Annotated[int, pydantic.Field(ge=5, le=3)], Annotated[str, pydantic.Field(min_length=5, max_length=2)],
    Annotated[list[int], pydantic.Field(min_length=3, max_length=1)], JsonSchema({"not": {}}),
    JsonSchema({"allOf": [{"type": "string"}, {"type": "integer"}]}),
], ids=["int", "str", "list", "not", "allOf"])  # fmt: skip
def test_a_type_no_value_satisfies_is_refused_as_unsatisfiable_pydantic_or_schema(grammar_compiler, output_type):
    with pytest.raises(UnsatisfiableConstraintError):
        grammar_compiler.compile(to_constraint(output_type))


def test_a_9000_value_enum_is_built_and_compiled_in_seconds(grammar_compiler):
    start = time.perf_counter()
    grammar = grammar_compiler.compile(to_constraint(JsonSchema({"enum": [f"value-{i}" for i in range(9_000)]})))
    assert time.perf_counter() - start < 8.0
    assert grammar.accepts('"value-8999"') and not grammar.accepts('"value-9000"')


@pytest.mark.parametrize(
    ("pattern", "error"),
    [("a{4294967295}", InvalidConstraintError), ("(" * 3000 + "a" + ")" * 3000, ConstraintTooLargeError)],
    ids=["repetition-past-re", "3000-groups"],
)
def test_a_regex_past_pythons_re_limits_is_refused_with_a_structgen_error(pattern, error):
    with pytest.raises(error):
        to_constraint(Regex(pattern))


def test_a_compiler_with_smaller_limits_refuses_larger_text(compiler_for):
    small = compiler_for(limits=ConstraintLimits(max_source_bytes=100))
    with pytest.raises(ConstraintTooLargeError, match="max_source_bytes=100"):
        small.compile(to_constraint(Regex("a" * 200)))


def test_a_compile_over_its_time_budget_is_refused(compiler_for):
    hurried = compiler_for(compile_timeout=1e-9)
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


# A MaskBench schema (Github_easy o21053) whose pattern grows llguidance's lexer past its limit
# a few tokens into the output.
WORDS = r"^$|(^(?:\S+\s+){0,99}\S+$)"
LEXER_HEAVY = {"type": "object", "additionalProperties": False, "required": ["question", "answer"],
               "properties": {name: {"type": "string", "minLength": 1, "maxLength": 5000, "pattern": WORDS}
                              for name in ("question", "answer")}}


def test_a_pattern_too_complex_for_the_lexer_fails_its_request_naming_the_fix(llm):
    """The request fails as the constraint's fault (an HTTP 400, not an internal error), with
    the way out named, and a request beside it in the same batch completes."""
    import asyncio

    async def both():
        return await asyncio.gather(
            llm.agenerate(JsonSchema(LEXER_HEAVY), "Ask and answer a question as JSON.", max_tokens=24),
            llm.agenerate(JsonSchema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
                          "Give a number as JSON.", max_tokens=24),
            return_exceptions=True)

    heavy, plain = asyncio.run(both())
    assert isinstance(heavy, ConstraintTooLargeError), heavy
    assert "lexer" in str(heavy) and "backend='xgrammar'" in str(heavy)
    assert isinstance(plain, dict) and isinstance(plain["n"], int)


def test_a_schema_whose_every_value_is_endless_fails_its_request_as_the_constraints_fault(llm):
    """A required property that refers back to its own object: no finite value fits, and
    llguidance's parser gives up at the first token (found by the server fuzz as an HTTP 500)."""
    endless = {"type": "object", "properties": {"self": {"$ref": "#"}, "x": {"enum": []}}, "required": ["self"],
               "additionalProperties": False}
    with pytest.raises(ConstraintTooLargeError, match="parser") as caught:
        llm.generate(JsonSchema(endless), "Anything.", max_tokens=1)
    assert "make the recursion optional" in str(caught.value)


def test_a_dead_end_inside_a_grammar_fails_its_request_as_the_constraints_fault(grammar_compiler, tokenizer):
    """llguidance compiles a `$ref` loop with nothing on it under a property (the schema layer
    refuses it; built here without that check) and its matcher finds no token once the output
    reaches it: the constraint matches nothing there, a 4xx, not an engine failure (a 500)."""
    loop = {"type": "object", "properties": {"a": {"$ref": "#/$defs/r"}}, "required": ["a"],
            "$defs": {"r": {"$ref": "#/$defs/r"}}}
    matcher = grammar_compiler.compile(Constraint("json_schema", json.dumps(loop)), backend="llguidance").matcher()
    ids = tokenizer.encode('{"a": ', add_special_tokens=False)
    assert matcher.accept_tokens(ids) == len(ids)
    mask = allocate_bitmask(1, grammar_compiler.vocab_size, host_only=True)
    with pytest.raises(UnsatisfiableConstraintError, match="allows no token at this point"):
        matcher.fill_bitmask(mask, 0)


@pytest.mark.parametrize("bounds", [{"minimum": 1e30, "maximum": 1e30 + 5}, {"minimum": 2**64},
                                    {"exclusiveMinimum": 2**63 - 1}])
def test_an_integer_above_64_bits_is_refused_by_every_backend_before_decoding(grammar_compiler, bounds: dict):
    """llguidance saturated such a lower bound to 2**63 - 1 and wrote 9223372036854775807, which
    the bound then refused (a 422 after decoding); xgrammar refuses it at compile."""
    schema = {"type": "integer", **bounds}
    for backend in ("xgrammar", "llguidance", None):
        with pytest.raises(UnsupportedSchemaError):
            grammar_compiler.compile(to_constraint(JsonSchema(schema)), backend=backend)
    within = grammar_compiler.compile(to_constraint(JsonSchema({"type": "integer", "minimum": 2**62, "maximum": 2**62 + 3})))
    assert within.accepts(str(2**62 + 1)) and not within.accepts(str(2**62 + 4))
