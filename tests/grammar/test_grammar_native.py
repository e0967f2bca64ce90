"""grammar.native: xgrammar mask fills on a pool of native threads (csrc/grammar_step.cpp),
checked against xgrammar's own fills on real JSON matchers of the default tokenizer."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from pydantic import BaseModel

from structgen.grammar import GrammarCompiler, allocate_bitmask, fill_bitmasks, native
from structgen.types import to_constraint


class Person(BaseModel):
    name: str
    age: int
    city: str
    tags: list[str]


INSTANCE = json.dumps({"name": "Ada Lovelace", "age": 36, "city": "London", "tags": ["maths", "poetry"]},
                      separators=(", ", ": "))


@pytest.fixture
def pool():
    """The process's native pool with 3 threads (two workers) for the test; the CI machine's
    default is one, where the backend does not use it."""
    p = native.load()
    assert p is not None, "the native library must build on the test machines (g++ and tvm-ffi's headers)"
    before = p.threads
    p.set_threads(3)
    yield p
    p.set_threads(before)


@pytest.fixture
def compiled(tokenizer, grammar_compiler):
    return GrammarCompiler(tokenizer, grammar_compiler.vocab_size, [tokenizer.eos_token_id],
                           backend="xgrammar").compile(to_constraint(Person))


def spread(compiled, tokenizer, n: int) -> list:
    """n matchers along a valid output, row i at token i * len / n of it."""
    ids = tokenizer.encode(INSTANCE, add_special_tokens=False)
    out = []
    for i in range(n):
        m = compiled.matcher()
        for t in ids[: (i * len(ids)) // n]:
            assert m.accept_token(t)
        out.append(m)
    return out


def test_native_fill_equals_xgrammars(pool, compiled, tokenizer, grammar_compiler):
    matchers = spread(compiled, tokenizer, 24)
    vocab = grammar_compiler.vocab_size
    want = allocate_bitmask(24, vocab, host_only=True)
    for i, m in enumerate(matchers):
        m.xgr_matcher.fill_next_token_bitmask(want, i)
    rows = [(7 * i) % 29 for i in range(24)]  # scattered rows of a larger buffer
    got = torch.full((29, want.shape[1]), 12345, dtype=torch.int32)
    pool.fill([m._handle for m in matchers], got, rows)
    for i, r in enumerate(rows):
        assert got[r].equal(want[i]), f"row {r} (matcher {i}) differs"
    untouched = sorted(set(range(29)) - set(rows))
    assert (got[untouched] == 12345).all()


def test_batch_fill_through_the_backend_uses_the_pool(pool, compiled, tokenizer, grammar_compiler):
    """`fill_bitmasks` (what the engine calls) with a pool of several threads: equal to each
    matcher's own fill, terminated rows (stop tokens only) included."""
    matchers = spread(compiled, tokenizer, 12)
    done = compiled.matcher()
    assert done.accept_tokens(tokenizer.encode(INSTANCE, add_special_tokens=False) + [tokenizer.eos_token_id])
    assert done.is_terminated()
    matchers.append(done)
    vocab = grammar_compiler.vocab_size
    rows = list(reversed(range(13)))
    batch = allocate_bitmask(13, vocab).fill_(0)
    fill_bitmasks(matchers, batch, rows)
    for m, r in zip(matchers, rows, strict=True):
        single = allocate_bitmask(1, vocab)
        m.fill_bitmask(single, 0)
        assert batch[r].equal(single[0])


def test_padded_vocabulary_rows_are_zeroed_past_the_tokenizer(pool, tokenizer):
    exact, padded = len(tokenizer), 128256
    grammar = GrammarCompiler(tokenizer, padded, [tokenizer.eos_token_id], backend="xgrammar")
    matchers = spread(grammar.compile(to_constraint(Person)), tokenizer, 6)
    want = allocate_bitmask(6, exact, host_only=True)
    for i, m in enumerate(matchers):
        m.xgr_matcher.fill_next_token_bitmask(want, i)
    got = allocate_bitmask(6, padded, host_only=True).fill_(-1)
    fill_bitmasks(matchers, got, list(range(6)))
    words = want.shape[1]
    assert got[:, :words].equal(want) and not got[:, words:].any()


def test_a_raising_matcher_is_reported_and_the_others_filled(pool, compiled, tokenizer, grammar_compiler):
    matchers = spread(compiled, tokenizer, 5)
    stopped = compiled.matcher().xgr_matcher  # xgrammar raises when asked for a terminated mask
    assert stopped.accept_string(INSTANCE) and stopped.accept_token(tokenizer.eos_token_id)
    handles = [m._handle for m in matchers[:2]] + [native.handle(stopped)] + [m._handle for m in matchers[2:]]
    vocab = grammar_compiler.vocab_size
    got = allocate_bitmask(6, vocab, host_only=True).fill_(7)
    with pytest.raises(native.NativeGrammarError, match="1 of 6 mask rows failed"):
        pool.fill(handles, got, list(range(6)))
    assert (got[2] == 7).all()  # the failed row is left as it was
    for row, m in zip([0, 1, 3, 4, 5], matchers, strict=True):
        single = allocate_bitmask(1, vocab, host_only=True)
        m.fill_bitmask(single, 0)
        assert got[row].equal(single[0])
    pool.fill(handles[:2], got, [0, 1])  # the pool is still usable, the error consumed


def test_calls_from_several_threads_at_once(pool, compiled, tokenizer, grammar_compiler):
    """The prefetch's workers may fill their chunks at the same time: one call has the pool,
    the others fill on their own thread. Disjoint matchers, many rounds, every mask right."""
    vocab = grammar_compiler.vocab_size
    groups = [spread(compiled, tokenizer, 16) for _ in range(4)]
    want = []
    for g in groups:
        w = allocate_bitmask(16, vocab, host_only=True)
        for i, m in enumerate(g):
            m.xgr_matcher.fill_next_token_bitmask(w, i)
        want.append(w)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        got = allocate_bitmask(16, vocab, host_only=True)
        handles = [m._handle for m in groups[k]]
        try:
            for _ in range(50):
                got.fill_(0)
                pool.fill(handles, got, list(range(16)))
                assert got.equal(want[k])
        except BaseException as exc:  # reported on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_a_bad_bitmask_is_refused_before_any_native_call(pool, compiled, tokenizer):
    handles = [m._handle for m in spread(compiled, tokenizer, 2)]
    with pytest.raises(ValueError, match="int32"):
        pool.fill(handles, torch.zeros(2, 1536, dtype=torch.int64), [0, 1])
    with pytest.raises(ValueError, match="contiguous rows"):
        pool.fill(handles, torch.zeros(1536, 2, dtype=torch.int32).t(), [0, 1])


def test_unavailable_without_the_library(monkeypatch):
    monkeypatch.setenv("STRUCTGEN_DISABLE_NATIVE", "1")
    native.load.cache_clear()
    try:
        assert native.load() is None
    finally:
        monkeypatch.delenv("STRUCTGEN_DISABLE_NATIVE")
        native.load.cache_clear()
    assert native.load() is not None


def test_a_forked_child_fills_on_its_own_thread(pool, compiled, tokenizer, grammar_compiler):
    """A child forked while the pool runs has none of its workers: it still fills correctly."""
    import multiprocessing as mp

    matchers = spread(compiled, tokenizer, 8)
    vocab = grammar_compiler.vocab_size
    want = allocate_bitmask(8, vocab, host_only=True)
    pool.fill([m._handle for m in matchers], want, list(range(8)))

    def child(q) -> None:
        got = allocate_bitmask(8, vocab, host_only=True).fill_(0)
        native.load().fill([m._handle for m in matchers], got, list(range(8)))
        q.put(bool(got.equal(want)))

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    assert q.get(timeout=60) is True
    p.join(timeout=60)
    assert p.exitcode == 0


def test_engine_outputs_are_the_same_with_the_pool(pool, model_dir, tokenizer):
    """The engine's decode steps with masks filled on the pool (3 threads here) produce the
    tokens they produce with xgrammar's own batch fill (the pool at one thread)."""
    from structgen.engine.config import EngineConfig
    from structgen.engine.engine import Engine
    from structgen.engine.models.loader import load_model_config
    from structgen.engine.request import Request
    from structgen.sampling import SamplingParams

    cfg = load_model_config(model_dir)
    engine = Engine(cfg, EngineConfig(device="cpu", max_batch_size=4, max_seq_len=512, jump_forward=False), model_dir)
    grammar = GrammarCompiler(tokenizer, engine.vocab_size, sorted(engine.stop_token_ids),
                              backend="xgrammar").compile(to_constraint(Person))
    prompts = ["Describe a person as JSON.", "Tell me about the sea.", "Give a fictional customer."]

    def outputs() -> list[list[int]]:
        reqs = []
        for i, text in enumerate(prompts):
            chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
            reqs.append(Request(tokenizer.encode(chat, add_special_tokens=False), SamplingParams(max_tokens=16),
                                grammar.matcher() if i != 1 else None, frozenset(engine.stop_token_ids)))
        engine.run(reqs)
        assert not any(r.finish_reason == "error" for r in reqs)
        return [r.output_ids for r in reqs]

    calls, prefilled = [], []
    fill, not_prefilled = pool.fill, engine._not_prefilled

    def count(bitmask, rows):
        left = not_prefilled(bitmask, rows)
        prefilled.append(len(rows) - len(left))
        return left

    pool.fill = lambda *a, **kw: (calls.append(len(a[0])), fill(*a, **kw))[1]
    engine._not_prefilled = count
    try:
        on_pool = outputs()
    finally:
        del pool.fill, engine._not_prefilled
    assert calls and max(calls) == 2  # the two JSON rows, filled on the pool (prefill steps)
    # Decode steps found both rows' masks filled as the last step's tokens were taken in.
    assert prefilled.count(2) >= 10
    pool.set_threads(1)
    assert outputs() == on_pool


def test_accept_tokens_on_the_pool_equals_row_by_row(pool, compiled, tokenizer, grammar_compiler):
    """`grammar.accept_tokens` through the pool (one native call: accept, the state's bits,
    the next mask) says what each matcher says from Python, and fills the masks they fill:
    rows along a valid output, one that takes the stop token, one given a token it rejects."""
    from structgen.grammar import accept_one, accept_tokens
    from structgen.grammar.backends.base import ACCEPTED, COMPLETED, FILLED, JUMPS, TERMINATED

    ids = tokenizer.encode(INSTANCE, add_special_tokens=False)
    n = 20
    native_ms, python_ms = spread(compiled, tokenizer, n), spread(compiled, tokenizer, n)
    tokens = [ids[(i * len(ids)) // n] for i in range(n)]
    for ms in (native_ms, python_ms):  # row n: the whole output, then the stop token
        done = compiled.matcher()
        assert done.accept_tokens(ids)
        ms.append(done)
        ms.append(compiled.matcher())  # row n + 1: a JSON object cannot start with the stop token
    tokens += [tokenizer.eos_token_id, tokenizer.eos_token_id]
    vocab = grammar_compiler.vocab_size
    got = allocate_bitmask(n + 2, vocab, host_only=True).fill_(7)
    rows = list(reversed(range(n + 2)))
    versions = [m.version for m in native_ms]
    status, errors = accept_tokens(native_ms, tokens, check_jump=True, bitmask=got, rows=rows)
    assert not errors
    want = [accept_one(m, t, check_jump=True) for m, t in zip(python_ms, tokens, strict=True)]
    assert [st & ~FILLED for st in status] == want
    assert want[n] == ACCEPTED | TERMINATED and want[n + 1] == 0
    assert any(st & JUMPS for st in want) and any(not st & JUMPS for st in want[:n])
    assert not any(st & COMPLETED for st in want[:n])
    assert [m.version for m in native_ms] == [v + 1 for v in versions]
    assert native_ms[n].is_terminated() and not native_ms[n + 1].is_terminated()
    for i, (m, st) in enumerate(zip(python_ms, status, strict=True)):
        r = rows[i]
        if st & TERMINATED or not st & ACCEPTED:
            assert not st & FILLED and (got[r] == 7).all()  # no next mask: the row is untouched
            continue
        assert st & FILLED
        single = allocate_bitmask(1, vocab, host_only=True)
        m.fill_bitmask(single, 0)
        assert got[r].equal(single[0]), f"row {r} (matcher {i})"


class Wrapped:
    """A matcher of no known backend (delegating to a real one): taken row by row."""

    backend = "wrapped"

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_accept_tokens_mixes_pool_and_row_by_row_matchers(pool, compiled, tokenizer):
    """xgrammar matchers go to the pool, others (and their exceptions) row by row; statuses
    come back in the batch's order."""
    from structgen.grammar import accept_one, accept_tokens

    ids = tokenizer.encode(INSTANCE, add_special_tokens=False)
    n = 18
    tokens = [ids[(i * len(ids)) // n] for i in range(n)]
    want = [accept_one(m, t) for m, t in zip(spread(compiled, tokenizer, n), tokens, strict=True)]
    ms = spread(compiled, tokenizer, n)
    ms[3], ms[10] = Wrapped(ms[3]), Wrapped(ms[10])

    def explode(tid):
        raise RuntimeError("grammar exploded")

    ms[10].accept_token = explode  # row 10 raises: its error comes back at its index
    status, errors = accept_tokens(ms, tokens)
    assert list(errors) == [10] and "exploded" in str(errors[10])
    assert status[:10] + status[11:] == want[:10] + want[11:]
