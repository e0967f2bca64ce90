"""Jump-forward decoding on the real tokenizer, real grammars (both backends) and the real
default model on CPU.

Two kinds of test: the hook driven directly on a request whose "sampled" tokens we choose
(boundary cases: quote + comma, a forced closing quote, text the tokenizer would turn into a
special token, a tokenizer that changes text), and whole generations with jump-forward on and
off (validity on shared MaskBench schemas, fewer forward passes, the on/off switches).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from structgen import LLM, JsonSchema
from structgen.engine.config import EngineConfig
from structgen.engine.jump_forward import HELD_BACK, JumpForward
from structgen.engine.request import Request
from structgen.errors import IncompleteOutputError, UnsupportedSchemaError
from structgen.sampling import SamplingParams
from structgen.types import to_constraint

BACKENDS = ["xgrammar", "llguidance"]
VENDORED_MASKBENCH = Path(__file__).resolve().parents[1] / "data" / "maskbench"  # a few records of the corpus
TWO_STRINGS = {
    "type": "object",
    "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(config=EngineConfig(device="cpu", max_batch_size=4, max_seq_len=1024))


def sampled(llm: LLM, schema: dict, text: str, backend: str, max_tokens: int = 64) -> Request:
    """A request whose matcher has accepted `text` tokenised canonically, as if sampled."""
    grammar = llm.grammars.compile(to_constraint(JsonSchema(schema)), backend=backend)
    req = Request([1], SamplingParams(max_tokens=max_tokens), grammar.matcher(), frozenset(llm.engine.stop_token_ids))
    for t in llm.tokenizer.encode(text, add_special_tokens=False):
        assert req.matcher.accept_token(t)
        req.append([t])
    return req


def text_of(llm: LLM, req: Request) -> str:
    return llm.tokenizer.decode(req.output_ids)


def assert_matcher_consistent(llm: LLM, req: Request, schema: dict, backend: str) -> None:
    """The rolled-back-and-re-advanced matcher must be where a fresh one fed the final tokens is."""
    from structgen.grammar import allocate_bitmask

    fresh = llm.grammars.compile(to_constraint(JsonSchema(schema)), backend=backend).matcher()
    assert fresh.accept_tokens(req.output_ids) == len(req.output_ids)
    a, b = allocate_bitmask(1, llm.engine.vocab_size), allocate_bitmask(1, llm.engine.vocab_size)
    req.matcher.fill_bitmask(a, 0)
    fresh.fill_bitmask(b, 0)
    assert (a == b).all()
    assert req.matcher.jump_forward_string() == fresh.jump_forward_string()


# -- the hook on chosen tokens --------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_quote_comma_boundary_is_retokenized(llm, backend):
    """The model sampled `"` alone; the grammar forces `, "b": `. The model itself writes `",`
    as one token, so the `"` must be re-spelled, not left with `,` appended after it."""
    req = sampled(llm, TWO_STRINGS, '{"a": "x', backend)
    quote = llm.tokenizer.convert_tokens_to_ids('"')
    assert req.matcher.accept_token(quote)
    req.append([quote])
    llm.engine.jump_forward_hook(llm.engine, req)
    text = text_of(llm, req)
    # ` "` is held back: the model may want ` "(` or ` "$` for b's value.
    assert text == '{"a": "x", "b":'
    assert req.output_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert llm.tokenizer.convert_ids_to_tokens(req.output_ids[-4:]) == ['",', 'Ġ"', "b", '":']
    assert req.stats.forced_tokens == 3  # `",` replaces the sampled `"`; ` "`, `b`, `":` are forced
    assert_matcher_consistent(llm, req, TWO_STRINGS, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grammars_first_jump_is_decided_once_and_replayed_as_decided(llm, backend, monkeypatch):
    """Every request of a grammar starts in the same state, so its first jump (`{"a": "`,
    the ` "` held back as a guess) is decided for the first request and replayed for the next
    ones with as much budget left: each ends where the deciding one did. A request whose
    budget leaves less room decides again."""
    engine = llm.engine
    hook = JumpForward(llm.tokenizer, engine.vocab_size, engine.stop_token_ids, vocab=engine.jump_forward_hook.vocab)
    decided = []
    real = hook._decide
    monkeypatch.setattr(hook, "_decide", lambda *args: decided.append(1) or real(*args))
    first, second = sampled(llm, TWO_STRINGS, "", backend), sampled(llm, TWO_STRINGS, "", backend)
    assert first.matcher.grammar is second.matcher.grammar
    hook(engine, first)
    hook(engine, second)
    assert len(decided) == 1
    assert text_of(llm, second) == text_of(llm, first) == '{"a":'
    assert (second.token_ids, second.stats.forced_tokens, second.guess) == (
        first.token_ids, first.stats.forced_tokens, first.guess)
    assert second.guess is not None
    assert_matcher_consistent(llm, second, TWO_STRINGS, backend)
    tight = sampled(llm, TWO_STRINGS, "", backend, max_tokens=2)
    hook(engine, tight)
    assert len(decided) == 2
    assert_matcher_consistent(llm, tight, TWO_STRINGS, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_closing_quote_merges_and_finishes(llm, backend):
    """The string's last character reached: the grammar forces `"}`. It must merge with nothing
    it should not, end in the model's own `"}` token, and finish the request without another
    forward. (xgrammar takes no length-bounded string, keywords.py: a pattern bounds it there.)"""
    code = {"type": "string", "maxLength": 3} if backend == "llguidance" else {"type": "string", "pattern": "^[a-z]{0,3}$"}
    schema = {"type": "object", "properties": {"code": code}, "required": ["code"], "additionalProperties": False}
    req = sampled(llm, schema, '{"code": "abc', backend)
    llm.engine.jump_forward_hook(llm.engine, req)
    assert text_of(llm, req) == '{"code": "abc"}'
    assert llm.tokenizer.convert_ids_to_tokens(req.output_ids[-2:]) == ["abc", '"}']
    assert req.finished and req.finish_reason == "stop"
    assert req.stats.forced_tokens == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_jump_that_completes_the_output_fills_one_mask_and_probes_nothing(llm, backend, monkeypatch):
    """The enum's rest and the closing brace are forced. The last forced token `"}` has longer
    tokens (`"},`, `"}}` ...), but after it only a stop token may follow: it is kept without
    probing any of them, and the request finishes on the same one mask fill."""
    schema = {"type": "object", "properties": {"tier": {"enum": ["bronze", "silver"]}},
              "required": ["tier"], "additionalProperties": False}
    req = sampled(llm, schema, '{"tier": "b', backend)
    hook = llm.engine.jump_forward_hook
    assert len(hook.vocab.extension_ids(token(llm, '"}'))) > 0
    fills, probes = [], []
    row = hook._mask_row  # every mask jump-forward fills goes through it
    real_fill, real_first = row.fill, req.matcher.first_accepted
    monkeypatch.setattr(row, "fill", lambda m: fills.append(1) or real_fill(m))
    monkeypatch.setattr(req.matcher, "first_accepted", lambda ids: probes.append(ids) or real_first(ids))
    hook(llm.engine, req)
    assert text_of(llm, req) == '{"tier": "bronze"}'
    assert llm.tokenizer.convert_ids_to_tokens(req.output_ids[-1:]) == ['"}']
    assert req.finished and req.finish_reason == "stop"
    assert (len(fills), probes) == (1, [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_string_that_must_be_closed_after_forced_text(llm, backend):
    """enum ["cm", "cms"]: the grammar forces `{"unit": "cm` and leaves `"` vs `s"` open.
    `cm` is held back (the model may want the single token `cms`), and the model can still
    close the string: `"}` is allowed next."""
    schema = {"type": "object", "properties": {"unit": {"enum": ["cm", "cms"]}},
              "required": ["unit"], "additionalProperties": False}
    req = sampled(llm, schema, "", backend)
    llm.engine.jump_forward_hook(llm.engine, req)
    assert text_of(llm, req) == '{"unit": "'
    for close in ('cm"}', 'cms"}'):
        ids = llm.tokenizer.encode(close, add_special_tokens=False)
        assert req.matcher.accept_tokens(ids) == len(ids)
        req.matcher.rollback(len(ids))


@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_text_held_back_whole_is_tried_once(llm, backend, monkeypatch):
    """The next array item must be a string: the grammar forces ` "`, which the model may
    extend (` "(`), so it is held back and nothing is jumped. A lone forced token starting
    with a space is held back without re-encoding anything (`_held_back_alone`), and that
    answer is the one the re-encoding reaches; after it, ` "` alone is not tried either (it
    would end in the same held-back token)."""
    schema = {"type": "object", "properties": {"t": {"type": "array", "items": {"type": "string"}}},
              "required": ["t"], "additionalProperties": False}
    req = sampled(llm, schema, '{"t": ["a",', backend)
    assert req.matcher.jump_forward_string() == ' "'
    hook = llm.engine.jump_forward_hook
    attempts = []
    real = hook._splice
    monkeypatch.setattr(hook, "_splice", lambda m, ids, limit, forced, k: attempts.append(k) or real(m, ids, limit, forced, k))
    before = list(req.output_ids)
    hook(llm.engine, req)
    assert attempts == []  # answered before any re-encoding
    assert req.output_ids == before and req.stats.forced_tokens == 0
    assert real(req.matcher, req.token_ids, 1000, b' "', 4)[0] == HELD_BACK  # the re-encoding's own answer, once
    assert req.output_ids == before and req.stats.forced_tokens == 0
    assert_matcher_consistent(llm, req, schema, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_special_token_text_inside_forced_string(llm, backend):
    """Forced text spelling `<|im_end|>` must be encoded as plain text, never as the stop token."""
    schema = {"type": "object", "properties": {"k": {"const": "a<|im_end|>b"}}, "required": ["k"],
              "additionalProperties": False}
    req = sampled(llm, schema, "", backend)
    llm.engine.jump_forward_hook(llm.engine, req)
    assert text_of(llm, req) == '{"k": "a<|im_end|>b"}'
    assert not set(req.output_ids) & llm.engine.stop_token_ids
    assert req.finished and req.finish_reason == "stop"


RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "items": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                              "ok": {"type": "boolean"}},
                                             "required": ["id", "ok"], "additionalProperties": False}},
    },
    "required": ["name", "age", "role", "tags", "items"],
    "additionalProperties": False,
}
RECORD_TEXT = ('{"name": "Ann Lee", "age": 42, "role": "admin", "tags": ["x", "y z"], '
               '"items": [{"id": 1, "ok": true}, {"id": 23, "ok": false}]}')


@pytest.mark.parametrize("backend", BACKENDS)
def test_rehearsed_jumps_equal_the_hooks_own(llm, backend, monkeypatch):
    """Two requests write the same output token by token, the way the engine takes sampled
    tokens; before each token, one of them rehearses the step's likely tokens (as the engine
    does at batch 1 while the device computes). After every step both hold the same tokens
    (forced ones included) and their grammars the same state, and the rehearsed request's
    hook replayed rehearsals instead of deciding afresh."""
    from structgen.grammar import allocate_bitmask

    hook = llm.engine.jump_forward_hook
    decided, replayed = [], []
    real_decide, real_replay = hook._decide, hook._replay
    monkeypatch.setattr(hook, "_decide", lambda *a: decided.append(1) or real_decide(*a))
    monkeypatch.setattr(hook, "_replay", lambda req, plan: replayed.append(plan) or real_replay(req, plan))
    mask = allocate_bitmask(1, llm.engine.vocab_size, host_only=True)
    words = mask[0].numpy().view("uint32")
    rehearsed, plain = sampled(llm, RECORD, "", backend), sampled(llm, RECORD, "", backend)
    for req in (rehearsed, plain):
        hook(llm.engine, req)  # the opening `{"name": "` rides with the prompt
    steps, quote = 0, llm.tokenizer.encode('"', add_special_tokens=False)[0]
    while not rehearsed.finished and len(text_of(llm, rehearsed)) < len(RECORD_TEXT):
        rest = RECORD_TEXT[len(text_of(llm, rehearsed)):]
        tok = llm.tokenizer.encode(rest, add_special_tokens=False)[0]
        if llm.tokenizer.decode([tok]) in ('",', '"]'):  # the model may close with `"` alone:
            tok = quote  # then the re-encoding merges it with the forced text and re-spells it
        for req in (rehearsed, plain):
            if req is rehearsed:
                req.matcher.fill_bitmask(mask, 0)
                version = req.matcher.version
                hook.rehearse(req, words.copy(), lambda: True)  # the device finished: nothing done
                assert req.matcher.version == version and hook._rehearsal is None
                hook.rehearse(req, words.copy(), lambda: False)
                n = len(decided)
            assert req.matcher.accept_token(tok)
            req.append([tok])
            hook(llm.engine, req)
            if req is rehearsed and replayed and replayed[-1] is not None and len(decided) == n:
                steps += 1  # a jump replayed, no decision taken after the token
        assert rehearsed.token_ids == plain.token_ids
        assert rehearsed.stats.forced_tokens == plain.stats.forced_tokens
        assert rehearsed.finished == plain.finished
    assert text_of(llm, rehearsed) == RECORD_TEXT and rehearsed.matcher.is_completed()
    assert rehearsed.stats.forced_tokens > 10
    assert steps >= 4, f"only {steps} jumps replayed from rehearsals"
    for req in (rehearsed, plain):
        assert_matcher_consistent(llm, req, RECORD, backend)


def write_token_by_token(llm: LLM, hook: JumpForward, text: str, backend: str) -> tuple[Request, list[tuple]]:
    """A request that writes `text` of RECORD the way the engine takes sampled tokens, with
    `hook` after each (closing quotes sampled alone, so re-encodings merge them); returns it
    and, after every token, its tokens, forced-token count and whether it finished."""
    req = sampled(llm, RECORD, "", backend)
    hook(llm.engine, req)  # the opening `{"name": "` rides with the prompt
    quote, trace = llm.tokenizer.encode('"', add_special_tokens=False)[0], []
    while not req.finished and len(text_of(llm, req)) < len(text):
        tok = llm.tokenizer.encode(text[len(text_of(llm, req)):], add_special_tokens=False)[0]
        if llm.tokenizer.decode([tok]) in ('",', '"]'):
            tok = quote
        assert req.matcher.accept_token(tok)
        req.append([tok])
        hook(llm.engine, req)
        trace.append((list(req.token_ids), req.stats.forced_tokens, req.finished))
    assert text_of(llm, req) == text
    return req, trace


@pytest.mark.parametrize("backend", BACKENDS)
def test_remembered_re_encodings_jump_as_the_tokenizer_would(llm, backend, monkeypatch):
    """A hook that has seen a schema's jumps answers their re-encodings from memory (no
    tokenizer call the second time through); every step of a second output, with other
    values, still holds the tokens and grammar state of a hook that asks the tokenizer each
    time."""
    def fresh() -> JumpForward:
        hook = JumpForward(llm.tokenizer, llm.engine.vocab_size, llm.engine.stop_token_ids,
                           vocab=llm.engine.jump_forward_hook.vocab)
        hook.guesses = False
        return hook

    other = RECORD_TEXT.replace("Ann Lee", "Bo").replace("42", "7").replace('"y z"', '"w"')
    remembering, asking = fresh(), fresh()
    monkeypatch.setattr(asking, "_encode", asking._encode_now)  # the tokenizer, every time
    write_token_by_token(llm, remembering, RECORD_TEXT, backend)
    asked: list[bytes] = []
    real_encode_now = remembering._encode_now
    monkeypatch.setattr(remembering, "_encode_now", lambda text: asked.append(text) or real_encode_now(text))
    write_token_by_token(llm, remembering, RECORD_TEXT, backend)
    assert not asked  # the same output again: every re-encoding remembered
    req, trace = write_token_by_token(llm, remembering, other, backend)
    ref, ref_trace = write_token_by_token(llm, asking, other, backend)
    assert len(remembering._encoded) > len(asked) > 0  # some remembered, some new
    assert trace == ref_trace
    assert req.stats.forced_tokens > 10
    for r in (req, ref):
        assert_matcher_consistent(llm, r, RECORD, backend)


def test_fast_grammar_loops_jump_as_one_token_at_a_time(llm, monkeypatch):
    """xgrammar's fast `accept_tokens` and `first_accepted` (the jumps' splices and hold-back
    probes) leave every step of an output as the base class's token-by-token loops do: the
    same tokens, forced tokens, guesses and remembered extensions."""
    from structgen.grammar.backends.base import GrammarMatcher
    from structgen.grammar.backends.xgrammar import XGrammarMatcher

    def write(text: str) -> tuple[list[tuple], list[int | None], dict[int, int]]:
        hook = JumpForward(llm.tokenizer, llm.engine.vocab_size, llm.engine.stop_token_ids,
                           vocab=llm.engine.jump_forward_hook.vocab)
        guesses: list[int | None] = []

        def guessing_hook(engine, req: Request) -> None:
            req.guess = None
            hook(engine, req)
            guesses.append(req.guess)

        _, trace = write_token_by_token(llm, guessing_hook, text, "xgrammar")
        return trace, guesses, dict(hook._allowed_before)

    other = RECORD_TEXT.replace("Ann Lee", "Bo").replace("42", "7")
    fast = [write(t) for t in (RECORD_TEXT, other)]
    monkeypatch.setattr(XGrammarMatcher, "accept_tokens", GrammarMatcher.accept_tokens)
    monkeypatch.setattr(XGrammarMatcher, "first_accepted", GrammarMatcher.first_accepted)
    slow = [write(t) for t in (RECORD_TEXT, other)]
    assert fast == slow
    assert any(g is not None for g in fast[0][1]) and fast[0][2]  # guesses and probes did happen


def test_rows_taken_plainly_beside_jumping_rows_change_nothing(llm, monkeypatch):
    """In a batch where some rows jump, the rows that only append their token skip the rest
    of `Engine._advance` (`_takes_plainly`): outputs, finish reasons and forced tokens equal
    those of an engine that advances every row in full (seeded sampling, budgets that cut
    some outputs off)."""
    from structgen.engine.engine import Engine

    grammar = llm.grammars.compile(to_constraint(JsonSchema(RECORD)))
    prompt = llm.tokenizer.encode("A user record as JSON:", add_special_tokens=False)
    stop = frozenset(llm.engine.stop_token_ids)
    plainly: list[bool] = []
    real = Engine._takes_plainly

    def run() -> list[tuple]:
        reqs = [Request(list(prompt), SamplingParams(max_tokens=n, temperature=0.8, seed=s), grammar.matcher(), stop)
                for n, s in ((24, 1), (40, 2), (12, 3), (40, 4))]
        llm.engine.run(reqs)
        return [(r.output_ids, r.finish_reason, r.stats.forced_tokens) for r in reqs]

    monkeypatch.setattr(Engine, "_takes_plainly", staticmethod(lambda *a: plainly.append(real(*a)) or plainly[-1]))
    shortcut = run()
    assert sum(plainly) > 10 and not all(plainly)  # rows of both kinds
    monkeypatch.setattr(Engine, "_takes_plainly", staticmethod(lambda *a: False))
    assert run() == shortcut
    assert any(forced for _, _, forced in shortcut) and any(why == "length" for _, why, _ in shortcut)


# -- held-back tokens as guesses -----------------------------------------------------------------
def token(llm: LLM, text: str) -> int:
    (tid,) = llm.tokenizer.encode(text, add_special_tokens=False)
    return tid


@pytest.mark.parametrize("backend", BACKENDS)
def test_held_back_token_is_the_guess(llm, backend):
    """The held-back ` "` (the quote + comma case above) becomes the request's guess, and so
    does a lone forced ` "` held back whole (the next array item). Proposing it leaves the
    grammar where it was. No guess with guesses off, or without room for the guess and one
    more token under max_tokens."""
    hook = llm.engine.jump_forward_hook
    quote, space_quote = token(llm, '"'), token(llm, ' "')
    req = sampled(llm, TWO_STRINGS, '{"a": "x', backend)
    assert req.matcher.accept_token(quote)
    req.append([quote])
    hook(llm.engine, req)
    assert text_of(llm, req) == '{"a": "x", "b":'
    assert req.guess == space_quote
    assert_matcher_consistent(llm, req, TWO_STRINGS, backend)

    array = {"type": "object", "properties": {"t": {"type": "array", "items": {"type": "string"}}},
             "required": ["t"], "additionalProperties": False}
    req = sampled(llm, array, '{"t": ["a",', backend)
    hook(llm.engine, req)
    assert req.stats.forced_tokens == 0 and req.guess == space_quote
    assert_matcher_consistent(llm, req, array, backend)

    hook.guesses = False
    try:
        req = sampled(llm, array, '{"t": ["a",', backend)
        hook(llm.engine, req)
        assert req.guess is None
    finally:
        hook.guesses = True
    req = sampled(llm, array, '{"t": ["a",', backend, max_tokens=7)  # 6 output tokens: room for one
    hook(llm.engine, req)
    assert req.num_output == 6 and req.guess is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_held_back_space_guesses_a_quote_where_a_string_may_follow(llm, backend):
    """After `{"v"` the grammar forces `: `, and the ` ` is held back (a string or a number may
    follow). Where a string may follow, the guess is ` "` (what the model mostly picks there);
    where only an integer may, the ` ` itself. The same request always gets the same guess
    (no history: the first and the third ask agree)."""
    space, space_quote = token(llm, " "), token(llm, ' "')
    either = {"type": "object", "properties": {"v": {"type": ["string", "integer"]}}, "required": ["v"],
              "additionalProperties": False}
    number = {**either, "properties": {"v": {"type": "integer"}}}

    def guess(schema: dict) -> int | None:
        req = sampled(llm, schema, '{"v"', backend)
        llm.engine.jump_forward_hook(llm.engine, req)
        assert text_of(llm, req) == '{"v":'
        assert_matcher_consistent(llm, req, schema, backend)
        return req.guess

    assert guess(either) == space_quote
    assert guess(number) == space
    assert guess(either) == space_quote


@pytest.mark.parametrize("backend", BACKENDS)
def test_held_back_opening_guesses_what_follows_it(llm, backend):
    """A held-back ` {` or ` [` is guessed with what the grammar lets follow in one token:
    ` {"` (a key), ` ["` (a string item), ` [{` (an object item)."""
    def guess(items: dict | None, value: dict | None = None) -> str:
        prop = value or {"type": "array", "items": items}
        schema = {"type": "object", "properties": {"t": prop}, "required": ["t"], "additionalProperties": False}
        req = sampled(llm, schema, '{"t"', backend)
        llm.engine.jump_forward_hook(llm.engine, req)
        assert text_of(llm, req) == '{"t":'
        return llm.tokenizer.decode([req.guess])

    assert guess({"type": "string"}) == ' ["'
    assert guess({"type": "object", "properties": {"a": {"type": "string"}}}) == " [{"
    assert guess(None, {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}) == ' {"'


@pytest.mark.parametrize("backend", BACKENDS)
def test_jump_rehearsed_after_a_guess_is_replayed(llm, backend, monkeypatch):
    """A step that runs a guess rehearses the tokens after the guess (its row's mask). Where
    the model picks the guess and then `"` (b left empty), the hook replays the rehearsed
    jump (`",` re-spelled, ` "c":` forced) and ends where a hook deciding afresh ends; where
    the model picks another token than the guess, the rehearsal is not used."""
    from structgen.engine.jump_forward import JumpForward
    from structgen.grammar import allocate_bitmask

    three = {"type": "object", "properties": {k: {"type": "string"} for k in "abc"}, "required": list("abc"),
             "additionalProperties": False}
    vocab = llm.engine.jump_forward_hook.vocab
    hooks = [JumpForward(llm.tokenizer, llm.engine.vocab_size, llm.engine.stop_token_ids, vocab=vocab)
             for _ in range(2)]
    quote = token(llm, '"')
    mask = allocate_bitmask(1, llm.engine.vocab_size, host_only=True)
    replayed = []
    real_replay = hooks[0]._replay
    monkeypatch.setattr(hooks[0], "_replay", lambda req, plan: replayed.append(plan) or real_replay(req, plan))
    reqs = []
    for hook in hooks:
        req = sampled(llm, three, '{"a": "x', backend)
        assert req.matcher.accept_token(quote)
        req.append([quote])
        hook(llm.engine, req)  # `", "b":` with ` "` held back: the guess
        assert req.guess == token(llm, ' "')
        reqs.append(req)
    rehearsed, fresh = reqs
    guess = rehearsed.guess
    m = rehearsed.matcher
    assert m.accept_token(guess)
    m.fill_bitmask(mask, 0)
    m.rollback(1)
    hooks[0].rehearse(rehearsed, mask[0].numpy().view("uint32").copy(), lambda: False, guess)
    assert quote in hooks[0]._rehearsal.plans
    for req, hook in zip(reqs, hooks, strict=True):  # the engine takes the guess, then `"`
        for t in (guess, quote):
            assert req.matcher.accept_token(t)
            req.append([t])
        hook(llm.engine, req)
    assert replayed and replayed[-1] is not None and replayed[-1][2]
    assert rehearsed.token_ids == fresh.token_ids
    assert text_of(llm, rehearsed) == '{"a": "x", "b": "", "c":'
    assert_matcher_consistent(llm, rehearsed, three, backend)

    other = sampled(llm, three, '{"a": "x", "b":', backend)  # the model did not pick the guess
    assert other.matcher.accept_token(guess)
    other.matcher.fill_bitmask(mask, 0)
    other.matcher.rollback(1)
    hooks[0].rehearse(other, mask[0].numpy().view("uint32").copy(), lambda: False, guess)
    assert other.matcher.accept_token(token(llm, ' ""'))
    other.append([token(llm, ' ""')])
    n = len(replayed)
    hooks[0](llm.engine, other)
    assert len(replayed) == n  # decided afresh
    assert text_of(llm, other) == '{"a": "x", "b": "", "c":'
    assert_matcher_consistent(llm, other, three, backend)


def test_guesses_keep_the_outputs_and_save_passes(llm):
    """Real model: with held-back guesses the outputs are those without, token for token,
    greedy and with a seeded temperature, alone and in a batch (the batch mixes steps with
    forced text, which run as extends on the CPU, and decode steps whose guess is their only
    extra row). Guesses were run; the model picked most, not all (` "` is guessed before a
    value that may be a string or a number: here both come); each one picked saved a pass."""
    hook = llm.engine.jump_forward_hook
    row = jme_rows(1)[0]
    instance = next(t["data"] for t in row["tests"] if t["valid"])
    either = {"type": "object", "properties": {"v": {"type": ["string", "integer"]}, "w": {"type": ["string", "integer"]}},
              "required": ["v", "w"], "additionalProperties": False}
    jobs = [
        (JsonSchema(either), ["v = 3, w = 4", "v is the word apple and w is the word pear"], {}),
        (JsonSchema(row["schema"]), [extraction_prompt(instance)], {}),
        (JsonSchema(TWO_STRINGS), ["a is red and b is blue"], {"temperature": 0.8, "seed": 7}),
        (JsonSchema(TWO_STRINGS), ["a is one, b is two", "a: sun, b: moon", "a and b: two birds"], {}),
    ]
    runs = {}
    try:
        for guesses in (True, False):
            hook.guesses = guesses
            runs[guesses] = [llm.complete_batch(output, prompts, max_tokens=96, **kw) for output, prompts, kw in jobs]
    finally:
        hook.guesses = True
    on = [c for batch in runs[True] for c in batch]
    off = [c for batch in runs[False] for c in batch]
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    assert all(c.finish_reason == "stop" for c in on)
    guessed, accepted = sum(c.stats.drafted_tokens for c in on), sum(c.stats.accepted_tokens for c in on)
    assert guessed >= 8 and guessed // 2 <= accepted < guessed, (guessed, accepted)
    assert sum(c.stats.drafted_tokens for c in off) == 0
    passes_on, passes_off = sum(c.stats.forward_passes for c in on), sum(c.stats.forward_passes for c in off)
    assert passes_off - passes_on == accepted  # a pass saved for each guess picked, no other change


class PrefixSpaceTokenizer:
    """A real tokenizer that, like SentencePiece ones, adds a leading space to every encode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.all_special_ids = tokenizer.all_special_ids
        self.backend_tokenizer = None

    def __call__(self, text: str, **kw):
        return self.tokenizer(" " + text, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_tokenizer_that_changes_text_means_no_jump(llm):
    """When no encoding spells the text exactly, nothing is appended and the matcher and the
    request are left exactly as they were."""
    installed = llm.engine.jump_forward_hook
    hook = JumpForward(PrefixSpaceTokenizer(llm.tokenizer), llm.engine.vocab_size, llm.engine.stop_token_ids,
                       vocab=installed.vocab)
    req = sampled(llm, TWO_STRINGS, '{"a": "x"', "xgrammar")
    before = list(req.output_ids)
    hook(llm.engine, req)
    assert req.output_ids == before and req.stats.forced_tokens == 0 and not req.finished
    assert req.matcher.jump_forward_string() == ', "b": "'
    assert_matcher_consistent(llm, req, TWO_STRINGS, "xgrammar")


# -- whole generations ------------------------------------------------------------------------
def extraction_prompt(instance: dict) -> str:
    facts = "; ".join(f"{k}: {json.dumps(v)}" for k, v in instance.items())
    return f"Extract the record as JSON. Facts: {facts}"


def jme_rows(n: int) -> list[dict]:
    rows = [json.loads(line) for line in (VENDORED_MASKBENCH / "JME.jsonl").read_text().splitlines()]
    return [r for r in rows if any(t["valid"] for t in r["tests"])][:n]


def run_both(llm: LLM, schema: dict, prompt: str, max_tokens: int = 160, backend: str | None = None):
    """(completion with jump-forward, completion without); None if the schema is unsupported
    or either run is cut by max_tokens (a small model can loop on open objects)."""
    output = JsonSchema(schema)
    if backend is not None:
        llm.grammars.backend = backend
    try:
        on = llm.complete(output, prompt, max_tokens=max_tokens)
        off = llm.complete(output, prompt, max_tokens=max_tokens, jump_forward=False)
    except (UnsupportedSchemaError, IncompleteOutputError):
        return None
    finally:
        llm.grammars.backend = "auto"
    return on, off


def test_whole_output_forced_finishes_without_a_forward(llm):
    schema = {"type": "object", "properties": {"kind": {"const": "point"}}, "required": ["kind"],
              "additionalProperties": False}
    c = llm.complete(JsonSchema(schema), "Say something.")
    assert c.value == {"kind": "point"} and c.finish_reason == "stop"
    assert c.stats.forward_passes == 0 and c.stats.forced_tokens == c.stats.output_tokens


def test_max_tokens_caps_forced_text(llm):
    schema = {"type": "object", "properties": {"kind": {"const": "a fairly long constant string"}},
              "required": ["kind"], "additionalProperties": False}
    with pytest.raises(IncompleteOutputError) as info:
        llm.complete(JsonSchema(schema), "Say something.", max_tokens=4)
    assert len(info.value.token_ids) == 4


def test_extraction_valid_with_fewer_forward_passes(llm):
    """Two JME extraction schemas: valid output (Constraint.parse validates it), forced tokens,
    and fewer forward passes per output token than without jump-forward."""
    compared = 0
    for row in jme_rows(4):
        instance = next(t["data"] for t in row["tests"] if t["valid"])
        result = run_both(llm, row["schema"], extraction_prompt(instance), max_tokens=64)
        if result is None:
            continue
        on, off = result
        compared += 1
        assert on.stats.forced_tokens > 0
        assert off.stats.forced_tokens == 0
        per_token_on = on.stats.forward_passes / on.stats.output_tokens
        per_token_off = off.stats.forward_passes / off.stats.output_tokens
        assert per_token_on < 0.8 * per_token_off, (row["id"], on.stats, off.stats)
        if compared == 2:
            break
    assert compared == 2


def test_jump_forward_off_globally_and_in_batches(llm):
    output = JsonSchema(TWO_STRINGS)
    prompts = ["a is red and b is blue", "a is one, b is two", "a: sun, b: moon"]
    batch = llm.complete_batch(output, prompts, max_tokens=40)
    assert all(c.stats.forced_tokens > 0 for c in batch)
    llm.engine.config.jump_forward = False
    try:
        plain = llm.complete_batch(output, prompts, max_tokens=40)
        forced_on_request = llm.complete(output, prompts[0], max_tokens=40, jump_forward=True)
    finally:
        llm.engine.config.jump_forward = True
    assert all(c.stats.forced_tokens == 0 for c in plain)
    assert forced_on_request.stats.forced_tokens > 0
    assert sum(c.stats.forward_passes for c in batch) < sum(c.stats.forward_passes for c in plain)


def test_stream_with_jump_forward_matches_complete(llm):
    prompt = "a is red and b is blue"
    text = "".join(llm.stream(JsonSchema(TWO_STRINGS), prompt, max_tokens=40))
    assert text == llm.complete(JsonSchema(TWO_STRINGS), prompt, max_tokens=40).text


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("category,n", [("JME", 8), ("Kubernetes", 3), ("Github_easy", 3)])
def test_maskbench_schemas_valid_with_jump_forward(llm, maskbench_dir, backend, category, n):
    """Object-heavy shared schemas: every jump-forward output is valid for its schema."""
    rows = [json.loads(line) for line in (maskbench_dir / f"{category}.jsonl").read_text().splitlines()]
    done = 0
    for row in rows:
        valid = [t["data"] for t in row["tests"] if t["valid"] and isinstance(t["data"], dict)]
        if not valid or not isinstance(row["schema"], dict):
            continue
        result = run_both(llm, row["schema"], extraction_prompt(valid[0]), max_tokens=256, backend=backend)
        if result is None:
            continue
        on, _ = result
        assert on.finish_reason == "stop"
        done += 1
        if done == n:
            break
    assert done == n
