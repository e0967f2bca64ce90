"""Grammars on the real SmolLM2 tokenizer, with both backends: acceptance, matcher state
(rollback, stop tokens, jump-forward), bitmasks, the cache, backend choice, errors, and the
keyword table re-checked against the installed libraries."""

from __future__ import annotations

import json
import time

import pydantic
import pytest

from structgen.errors import InvalidConstraintError, UnsupportedSchemaError
from structgen.grammar import (
    GrammarCompiler,
    allocate_bitmask,
    candidate_backends,
    dump_json,
    fill_bitmasks,
)
from structgen.schema.keywords import ENFORCED, IGNORED, KEYWORDS, find_issues
from structgen.types import CFG, Choice, Constraint, JsonSchema, Regex, to_constraint

BACKENDS = ("xgrammar", "llguidance")


class Person(pydantic.BaseModel):
    name: str
    age: int = pydantic.Field(ge=0, le=150)
    tags: list[str] = []


PERSON = Person(name="Ada", age=36, tags=["math"])


def allowed(bitmask, row: int, vocab_size: int) -> set[int]:
    words = bitmask[row].tolist()
    return {i for i in range(vocab_size) if (words[i // 32] >> (i % 32)) & 1}


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_schema_accepts_exactly_the_canonical_format(grammar_compiler, backend):
    g = grammar_compiler.compile(to_constraint(Person), backend=backend)
    assert g.backend == backend
    good = dump_json(PERSON.model_dump())
    assert good == '{"name": "Ada", "age": 36, "tags": ["math"]}'
    assert g.accepts(good)
    for bad in (
        '{"name":"Ada","age":36,"tags":[]}',  # other separators: whitespace is fixed
        '{"name": "Ada", "age": 36, "tags": [] }',
        '{"age": 36, "name": "Ada", "tags": []}',  # property order follows the schema
        '{"name": "Ada", "age": 151, "tags": []}',
        '{"name": "Ada", "age": 36, "tags": [], "extra": 1}',  # model schemas are closed
        '{"name": "Ada", "age": 36',
    ):
        assert not g.accepts(bad), bad


@pytest.mark.parametrize("backend", BACKENDS)
def test_matcher_walk_stop_and_rollback(grammar_compiler, tokenizer, backend):
    g = grammar_compiler.compile(to_constraint(Person), backend=backend)
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode(dump_json(PERSON.model_dump()))
    m = g.matcher()
    assert not m.accept_token(eos)  # cannot stop before the object is complete
    assert not m.accept_token(tokenizer.encode("[")[0])  # rejected tokens leave no trace
    assert m.accept_tokens(ids) == len(ids)
    assert m.is_completed() and not m.is_terminated()
    assert m.accept_token(eos) and m.is_terminated() and m.jump_forward_string() == ""
    assert not m.accept_token(ids[0])  # nothing after the stop token
    m.rollback(1)  # undo the stop token
    assert not m.is_terminated() and m.is_completed()
    m.rollback(3)
    assert not m.is_completed()
    assert m.accept_tokens(ids[-3:]) == 3 and m.is_completed()
    m.rollback(len(ids))  # back to the start (the engine rolls back dozens of draft tokens)
    assert m.jump_forward_string() == '{"name": "'
    m.reset()
    assert m.accept_tokens(ids[:2] + [tokenizer.encode("[")[0]] + ids[2:]) == 2  # "{"name" then "["


@pytest.mark.parametrize("backend", BACKENDS)
def test_accepts_and_probes_equal_one_token_at_a_time(grammar_compiler, tokenizer, backend):
    """`accept_tokens` and `first_accepted` (the backends' fast loops) against the base class's
    token-by-token `accept_token`: the same counts, the same first accepted token, the same state
    after (mask, forced text, completion), through a rejected token and a stop token."""
    from structgen.grammar.backends.base import GrammarMatcher

    g = grammar_compiler.compile(to_constraint(Person), backend=backend)
    eos, bracket = tokenizer.eos_token_id, tokenizer.encode("[")[0]
    ids = tokenizer.encode(dump_json(PERSON.model_dump()))
    fast, slow = g.matcher(), g.matcher()
    masks = allocate_bitmask(2, tokenizer.vocab_size)

    def same_state() -> None:
        fast.fill_bitmask(masks, 0)
        slow.fill_bitmask(masks, 1)
        assert masks[0].tolist() == masks[1].tolist()
        assert fast.jump_forward_string() == slow.jump_forward_string()
        assert (fast.is_completed(), fast.is_terminated()) == (slow.is_completed(), slow.is_terminated())

    probes = [bracket, eos, *ids[:8], *tokenizer.encode(' "a')]
    for i, tid in enumerate(ids):
        assert fast.first_accepted(probes) == GrammarMatcher.first_accepted(slow, probes), i
        same_state()
        assert fast.accept_tokens([tid]) == GrammarMatcher.accept_tokens(slow, [tid]) == 1
    same_state()
    fast.rollback(len(ids))
    slow.rollback(len(ids))
    for seq, taken in ((ids[:3] + [bracket] + ids[3:], 3), (ids[3:], len(ids) - 3), ([eos, ids[0]], 1)):
        assert fast.accept_tokens(seq) == GrammarMatcher.accept_tokens(slow, seq) == taken
        same_state()
    assert fast.is_terminated() and fast.first_accepted(probes) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_host_mask_row_sees_when_only_a_stop_token_may_follow(grammar_compiler, tokenizer, backend):
    """The finish check's question, on a real matcher (a complete object whose grammar allows
    only the stop token next, then one that may go on) and on masks written by hand: a stop
    token alone, beside another token, and beside bits past the vocabulary (padding ids)."""
    from structgen.grammar.backends.base import HostMaskRow

    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    row = HostMaskRow(vocab, [eos])
    m = grammar_compiler.compile(to_constraint(Person), backend=backend).matcher()
    ids = tokenizer.encode(dump_json(PERSON.model_dump()))
    assert m.accept_tokens(ids) == len(ids) and m.is_completed()
    assert row.only_stop(m)
    m.rollback(1)  # before the closing brace: more keys may follow
    assert not row.only_stop(m)
    assert eos not in allowed(row.tensor, 0, vocab)  # the row holds that fill

    size = vocab - 5  # a vocabulary ending inside a word of the row
    assert size % 32

    class Written:  # a matcher that allows the given ids, and every id past the vocabulary
        def __init__(self, ids):
            self.ids = ids

        def fill_bitmask(self, bitmask, index):
            bitmask[index] = 0
            for t in [*self.ids, *range(size, 32 * bitmask.shape[1])]:
                bitmask[index, t // 32] |= (1 << (t % 32)) - (1 << 32 if t % 32 == 31 else 0)

    padded = HostMaskRow(size, [eos])
    assert padded.only_stop(Written([eos])) and not padded.only_stop(Written([eos, 7]))
    assert not padded.only_stop(Written([size - 1])) and padded.only_stop(Written([]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_jump_forward_string_follows_the_schema(grammar_compiler, tokenizer, backend):
    g = grammar_compiler.compile(to_constraint(Person), backend=backend)
    m = g.matcher()
    forced = m.jump_forward_string()
    assert forced == '{"name": "'
    assert m.accept_tokens(tokenizer.encode(forced + "Ada")) > 0
    assert m.jump_forward_string() == ""  # the name may go on
    m.accept_tokens(tokenizer.encode('", '))
    assert m.jump_forward_string() == '"age": '


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitmask_matches_accept_token(grammar_compiler, tokenizer, backend):
    vocab = grammar_compiler.vocab_size
    g = grammar_compiler.compile(to_constraint(Choice(["yes", "no", "maybe"])), backend=backend)
    m = g.matcher()
    bitmask = allocate_bitmask(2, vocab)
    assert bitmask.shape == (2, (vocab + 31) // 32) and str(bitmask.dtype) == "torch.int32"
    m.fill_bitmask(bitmask, 1)
    ok = allowed(bitmask, 1, vocab)
    assert ok and tokenizer.encode("yes")[0] in ok and tokenizer.encode("no")[0] in ok
    assert tokenizer.eos_token_id not in ok and tokenizer.encode("[")[0] not in ok
    assert allowed(bitmask, 0, vocab) == set(range(vocab))  # other rows untouched
    for tid in sorted(ok)[:20]:  # every allowed token is accepted
        assert m.accept_token(tid)
        m.rollback(1)
    m.accept_tokens(tokenizer.encode("maybe"))
    m.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0, vocab) == {tokenizer.eos_token_id}  # only the stop token
    m.accept_token(tokenizer.eos_token_id)
    m.fill_bitmask(bitmask, 0)  # a terminated matcher still fills (stop tokens only)
    assert allowed(bitmask, 0, vocab) == {tokenizer.eos_token_id}


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_vocab_larger_than_tokenizer(model_dir, tokenizer, backend):
    vocab = len(tokenizer) + 64  # padded lm_head: the extra ids must never be allowed
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id], backend=backend)
    m = compiler.compile(to_constraint(str)).matcher()
    bitmask = allocate_bitmask(1, vocab)
    m.fill_bitmask(bitmask, 0)
    ok = allowed(bitmask, 0, vocab)
    assert len(ok) > 40000 and max(ok) < len(tokenizer)
    assert not m.accept_token(vocab - 1)


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
def test_warm_up_builds_what_the_first_compiles_would(tokenizer, backend):
    from structgen.schema import charsets

    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], backend=backend)
    assert compiler._backends == {}  # built on first use, unless warmed up
    charsets.category.cache_clear()
    compiler.warm_up()
    assert set(compiler._backends) == ({"xgrammar", "llguidance"} if backend == "auto" else {"llguidance"})
    assert charsets.category.cache_info().currsize == 3  # \d, \w and \s
    adapters = dict(compiler._backends)
    compiler.compile(to_constraint(Person))
    assert compiler._backends == adapters  # the same adapters serve the compiles


def test_fill_bitmasks_batch_equals_one_by_one(grammar_compiler, tokenizer):
    vocab = grammar_compiler.vocab_size
    constraints = [to_constraint(Person), to_constraint(int), to_constraint(Choice(["a", "b"]))]
    matchers = [
        grammar_compiler.compile(c, backend=b).matcher() for c in constraints for b in BACKENDS
    ]
    for m in matchers[:2]:
        m.accept_tokens(tokenizer.encode('{"name": "A'))
    rows = [5, 0, 3, 1, 4, 2]
    batch = allocate_bitmask(6, vocab)
    fill_bitmasks(matchers, batch, rows, threads=2)
    for m, r in zip(matchers, rows, strict=True):
        single = allocate_bitmask(1, vocab)
        m.fill_bitmask(single, 0)
        assert batch[r].equal(single[0])


def test_xgrammar_matcher_calls_keep_the_gil_and_batch_fills_let_it_go(grammar_compiler, tokenizer):
    """A microsecond call that lets the GIL go waits for it back while another thread runs
    Python: the backend makes xgrammar's per-matcher calls keep it; the batch fills, which
    run on worker threads for milliseconds, still release it."""
    from xgrammar.tvm_ffi_binding import _ffi_api

    from structgen.grammar.backends.xgrammar import GIL_KEEPING_METHODS

    m = grammar_compiler.compile(to_constraint(Person), backend="xgrammar").matcher()
    single = {f.name: f.func.release_gil for f in _ffi_api.GrammarMatcher.__tvm_ffi_type_info__.methods}
    batch = {f.name: f.func.release_gil for f in _ffi_api.BatchGrammarMatcher.__tvm_ffi_type_info__.methods}
    assert {name: single[name] for name in GIL_KEEPING_METHODS} == dict.fromkeys(GIL_KEEPING_METHODS, False)
    assert batch["batch_fill_next_token_bitmask"] is True
    # and the calls still work: a walk, a rollback, the forced text and a fill
    ids = tokenizer.encode('{"name": "A', add_special_tokens=False)
    assert m.accept_tokens(ids) == len(ids)
    m.rollback(len(ids))
    assert m.jump_forward_string() == '{"name": "'
    bitmask = allocate_bitmask(1, grammar_compiler.vocab_size)
    m.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0, grammar_compiler.vocab_size)


def test_regex_grammar_and_text_constraints(grammar_compiler):
    for backend in BACKENDS:
        date = grammar_compiler.compile(to_constraint(Regex(r"\d{4}-\d{2}-\d{2}")), backend=backend)
        assert date.accepts("2024-01-31") and not date.accepts("2024-1-31")
        num = grammar_compiler.compile(to_constraint(int), backend=backend)
        assert num.accepts("-120") and not num.accepts("012") and not num.accepts("1.5")
        ebnf = grammar_compiler.compile(
            to_constraint(CFG('root ::= "(" root ")" | "x"')), backend=backend
        )
        assert ebnf.accepts("((x))") and not ebnf.accepts("((x)")  # not regular: a real CFG
        lark = grammar_compiler.compile(
            to_constraint(CFG('start: "(" start ")" | "x"', syntax="lark")), backend=backend
        )
        assert lark.accepts("((x))") and not lark.accepts("(x))")
        text = grammar_compiler.compile(to_constraint(str), backend=backend)
        assert text.accepts("anything\n goes ✓") and text.accepts("")
        choice = grammar_compiler.compile(to_constraint(Choice(["a.b", "c|d"])), backend=backend)
        assert choice.accepts("c|d") and not choice.accepts("axb")


def test_cache_hit_is_cheap_and_shared(grammar_compiler):
    c = to_constraint(Person)
    auto = grammar_compiler.compile(c)
    assert grammar_compiler.compile(to_constraint(Person)) is auto  # equal keys hit
    assert grammar_compiler.compile(c, backend=auto.backend) is auto  # auto and explicit share
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        grammar_compiler.compile(c)
    per_hit = (time.perf_counter() - t0) / n
    assert per_hit < 100e-6, f"cache hit took {per_hit * 1e6:.1f} us"


def test_auto_picks_a_backend_that_enforces_everything(grammar_compiler):
    closed = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "additionalProperties": False,
    }
    simple = to_constraint(JsonSchema(closed))
    assert candidate_backends(simple) == ["xgrammar", "llguidance"]
    assert grammar_compiler.compile(simple).backend == "xgrammar"
    # both enforce an open object, but xgrammar compiles it slowly: llguidance first
    del closed["additionalProperties"]
    assert candidate_backends(to_constraint(JsonSchema(closed))) == ["llguidance", "xgrammar"]
    # xgrammar ignores allOf: only llguidance enforces this one
    both = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"type": "string"}}, "required": ["b"]},
        ]
    }
    c = to_constraint(JsonSchema(both))
    assert candidate_backends(c) == ["llguidance"]
    g = grammar_compiler.compile(c)
    assert g.backend == "llguidance"
    assert g.accepts('{"a": 1, "b": "x"}') and not g.accepts('{"a": 1}')
    with pytest.raises(UnsupportedSchemaError) as e:
        grammar_compiler.compile(c, backend="xgrammar")
    assert e.value.keyword == "allOf" and e.value.path == "#"
    # propertyNames: llguidance refuses it, xgrammar enforces it
    names = to_constraint(JsonSchema({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}))
    g = grammar_compiler.compile(names)
    assert g.backend == "xgrammar" and g.accepts('{"ab": 1}') and not g.accepts('{"A1": 1}')


def test_best_effort_when_strict_is_off(grammar_compiler):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(UnsupportedSchemaError):
        grammar_compiler.compile(Constraint("json_schema", json.dumps(schema)))
    g = grammar_compiler.compile(to_constraint(JsonSchema(schema), strict=False))
    assert g.accepts("[1, 2]")


def test_backend_errors_are_structgen_errors(grammar_compiler):
    lookbehind = to_constraint(Regex(r"(?<=a)b"))  # Python accepts it, no backend does
    with pytest.raises(InvalidConstraintError, match="lookbehind|look-around|Regex"):
        grammar_compiler.compile(lookbehind)
    with pytest.raises(InvalidConstraintError, match="lookaround"):
        grammar_compiler.compile(to_constraint(Regex(r"(?!a)\w")), backend="xgrammar")
    for backend in BACKENDS:
        with pytest.raises(InvalidConstraintError):
            grammar_compiler.compile(
                to_constraint(CFG("root ::= (", syntax="ebnf")), backend=backend
            )
        with pytest.raises(InvalidConstraintError):
            grammar_compiler.compile(to_constraint(CFG("start: undefined_rule")), backend=backend)
    with pytest.raises(ValueError, match="unknown grammar backend"):
        grammar_compiler.compile(to_constraint(int), backend="outlines")


# One probe per keyword-table claim: (keyword, schema, a valid instance, an invalid instance).
# ENFORCED must accept the first and reject the second; IGNORED must be flagged by
# find_issues; a clean refusal is fine either way. When a library upgrade changes a
# behaviour, this says which row to edit.
PROBES = [
    ("minimum", {"type": "integer", "minimum": 5}, 7, 3),
    ("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 5}, 4.5, 5),
    ("multipleOf", {"type": "integer", "multipleOf": 3}, 9, 10),
    ("multipleOf", {"type": "integer", "minimum": 0, "multipleOf": 12}, 24, 25),
    ("minLength", {"type": "string", "minLength": 3}, "abc", "ab"),
    ("maxLength", {"type": "string", "maxLength": 3}, "abc", "abcd"),
    ("pattern", {"type": "string", "pattern": "^a+$"}, "aa", "ab"),
    ("format", {"type": "string", "format": "date"}, "2024-01-31", "2024-1-31"),
    ("enum", {"enum": ["x", 1]}, 1, 2),
    ("const", {"const": "x"}, "x", "y"),
    ("minItems", {"type": "array", "minItems": 2}, [1, 2], [1]),
    ("maxItems", {"type": "array", "maxItems": 1}, [1], [1, 2]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "string"}]}, ["a", 1], [1]),
    ("uniqueItems", {"type": "array", "uniqueItems": True}, [1, 2], [1, 1]),
    ("contains", {"type": "array", "contains": {"type": "string"}}, [1, "a"], [1, 2]),
    ("required", {"type": "object", "properties": {"a": {}}, "required": ["a"]}, {"a": 1}, {}),
    ("additionalProperties", {"type": "object", "additionalProperties": {"type": "integer"}}, {"a": 1}, {"a": "x"}),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}}, {"ab": 1}, {"xy": 1}),
    ("minProperties", {"type": "object", "minProperties": 1}, {"a": 1}, {}),
    ("maxProperties", {"type": "object", "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1}),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False}, {"a": 1}, {"a": 1, "b": 2}),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, 4, 2),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "a", None),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 2}]}, 1, 3),
    ("not", {"type": "integer", "not": {"multipleOf": 3}}, 2, 3),
    ("if", {"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}}, 6, 7),
    ("$ref", {"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p"}, 1, "a"),
]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keyword, schema, valid, invalid", PROBES, ids=[p[0] for p in PROBES])
def test_keyword_table_matches_the_library(
    grammar_compiler, backend, keyword, schema, valid, invalid
):
    status = KEYWORDS[keyword][BACKENDS.index(backend)]
    issues = find_issues(schema, backend)
    raw = Constraint("json_schema", json.dumps(schema), description=keyword)
    try:
        # the adapter alone, bypassing the table (which GrammarCompiler applies)
        g = grammar_compiler.adapter(backend).compile(raw)
    except (InvalidConstraintError, UnsupportedSchemaError):
        return  # a clean refusal is always safe: "auto" moves on to the next backend
    accepts_invalid = invalid is not None and g.accepts(dump_json(invalid))
    if status == ENFORCED and not issues:
        assert g.accepts(dump_json(valid)), f"{backend} rejects a valid instance for '{keyword}'"
        assert not accepts_invalid, f"{backend} ignores '{keyword}': mark it IGNORED in KEYWORDS"
    elif status == IGNORED:
        assert issues, f"'{keyword}' is IGNORED for {backend} but find_issues does not flag it"


def test_padded_vocab_masks_equal_the_tokenizer_sized_ones(tokenizer):
    """A 128k-row LM head with this 49k tokenizer (the random-weight benchmark shapes): the
    xgrammar adapter fills only the tokenizer's words (through a strided view) and zeroes the
    rest, single and batched, over a buffer holding garbage from an earlier step."""
    exact, padded = len(tokenizer), 128256
    grammars = {v: GrammarCompiler(tokenizer, v, [tokenizer.eos_token_id], backend="xgrammar") for v in (exact, padded)}
    matchers = {v: [g.compile(to_constraint(Person)).matcher() for _ in range(3)] for v, g in grammars.items()}
    for v in matchers:
        for m in matchers[v]:
            m.accept_tokens(tokenizer.encode('{"name": "A'))
    want = allocate_bitmask(3, exact)
    fill_bitmasks(matchers[exact], want, [0, 1, 2], threads=1)
    for batched in (False, True):
        got = allocate_bitmask(3, padded).fill_(-1)
        if batched:
            fill_bitmasks(matchers[padded], got, [2, 0, 1], threads=2)
        else:
            for r, m in zip([2, 0, 1], matchers[padded], strict=True):
                m.fill_bitmask(got, r)
        assert got[:, : want.shape[1]].equal(want) and not got[:, want.shape[1] :].any()
    assert not matchers[padded][0].accept_token(padded - 1)


def test_llguidance_matcher_reports_its_error_state(tokenizer):
    """llguidance keeps an error state (a token consumed without the try_ guard); `error()` says
    what it is, so an engine error about a rejected token can quote the library's reason."""
    from structgen.grammar import GrammarCompiler
    from structgen.types import JsonSchema, to_constraint

    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], backend="llguidance")
    m = compiler.compile(to_constraint(JsonSchema({"type": "integer"}))).matcher()
    assert m.backend == "llguidance" and m.error() is None
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert not m.accept_token(letter) and m.error() is None  # the guarded path leaves no error
    m.ll_matcher.consume_token(letter)
    assert m.error()


def test_llguidance_never_takes_a_stop_token_for_text(tokenizer, monkeypatch):
    """Where the tokenizer does not list its stop token among `all_special_ids` (seen on the
    GPU machine's transformers: MaskBench Kubernetes kb_0 sampled `<|im_end|>` inside a JSON
    string, which llguidance's mask allowed as the text "<|im_end|>" while the adapter took it
    as the stop token and rejected it), llguidance must still treat the stop token as special:
    disallowed inside a string, allowed once the value is complete."""
    from structgen.grammar import GrammarCompiler
    from structgen.types import JsonSchema, to_constraint

    eos = tokenizer.eos_token_id
    monkeypatch.setattr(type(tokenizer), "all_special_ids", property(lambda self: []))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [eos], backend="llguidance")
    m = compiler.compile(to_constraint(JsonSchema({"type": "string"}))).matcher()
    mask = allocate_bitmask(1, len(tokenizer), host_only=True)
    assert m.accept_tokens(tokenizer.encode('"ab', add_special_tokens=False)) == 2
    m.fill_bitmask(mask, 0)
    assert eos not in allowed(mask, 0, len(tokenizer))
    assert not m.accept_token(eos) and m.accept_token(tokenizer.encode('"', add_special_tokens=False)[0])
    m.fill_bitmask(mask, 0)
    assert allowed(mask, 0, len(tokenizer)) == {eos} and m.accept_token(eos) and m.is_terminated()


@pytest.mark.parametrize("backend", BACKENDS)
def test_control_tokens_are_never_text(grammar_compiler, tokenizer, backend):
    """SmolLM2's added special tokens (`<|im_start|>`, `<repo_name>`, `<|endoftext|>`, ...)
    are control tokens: no backend allows one inside a JSON string, though both allow the
    same characters spelled as text; `<|im_end|>`, the stop token, only ends the output.
    Before, xgrammar allowed all of them in strings, llguidance all but the listed specials."""
    from structgen.grammar.backends.base import control_token_ids

    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    control = control_token_ids(tokenizer, vocab, [eos])
    assert {0, 1, 3, 16, eos} <= control and len(control) == 17  # SmolLM2's 17 added tokens
    m = grammar_compiler.compile(to_constraint(JsonSchema({"type": "string"})), backend=backend).matcher()
    mask = allocate_bitmask(1, vocab, host_only=True)
    assert m.accept_tokens(tokenizer.encode('"ab', add_special_tokens=False)) == 2
    m.fill_bitmask(mask, 0)
    ok = allowed(mask, 0, vocab)
    assert not ok & control and len(ok) > 40_000
    assert tokenizer.convert_tokens_to_ids("<") in ok
    for t in (1, 3):  # the matcher refuses them too, and stays usable
        assert not m.accept_token(t)
    # The same text as characters is fine: a value may say "<repo_name>".
    text = tokenizer("<repo_name>\"", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert not set(text) & control
    assert m.accept_tokens(text) == len(text) and m.is_completed()
