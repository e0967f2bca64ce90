"""Continuous batching keeps rows independent: cancelling one request, or its grammar failing,
never changes what the others generate; seeded sampling does not depend on the batch.

Real default model on the CPU (float32), real tokenizer, a tiny JSON schema compiled by the
real grammar backend. Decode steps go through `ModelRunner.decode` (the seam the CUDA graphs
use), mixed steps through `extend`, so both paths are covered.
"""

from __future__ import annotations

import sys

import pytest

from structgen.engine.config import EngineConfig, EngineTuning, ModelConfig
from structgen.engine.engine import Engine
from structgen.engine.models.loader import load_model_config
from structgen.engine.request import Request
from structgen.errors import EngineError, UnsatisfiableConstraintError
from structgen.grammar.backends.base import ACCEPTED, FAILED
from structgen.grammar.prefetch import MIN_FILL_S
from structgen.sampling import SamplingParams

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
    accept_token refuse every token (`FAULT_ERRORS`), "accept" makes it raise, "guess-rollback"
    makes rolling a jump-forward guess back raise (as llguidance does where a pattern's lexer
    grows too complex)."""

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
        if self.mode == "accept" and self.fills > self.fail_after:
            self.raised_in = engine_path(sys._getframe(1))  # which engine path asked
            raise RuntimeError("grammar exploded while accepting")
        return self.inner.accept_token(tid)

    def rollback(self, n):
        caller = sys._getframe(1).f_code.co_name
        if self.mode == "guess-rollback" and self.fills > self.fail_after and caller == "fill_guess_rows":
            self.raised_in = caller
            raise EngineError("grammar rollback of 1 tokens failed: lexer error: too many expressions constructed")
        return self.inner.rollback(n)

    def __getattr__(self, name):
        return getattr(self.inner, name)


# What each fault finishes its request with: a matcher that refuses every token reads as a dead
# end of the constraint where its mask allowed few tokens (all probed), else as a disagreement.
FAULT_ERRORS = {"fill": EngineError, "reject": (EngineError, UnsatisfiableConstraintError), "accept": EngineError,
                "guess-rollback": EngineError}


def engine_path(frame) -> tuple[str, ...]:
    """The engine methods on the stack, innermost first (tokens reach matchers through
    grammar.batch)."""
    names = []
    while frame is not None:
        if frame.f_globals.get("__name__") == "structgen.engine.engine":
            names.append(frame.f_code.co_name)
        frame = frame.f_back
    return tuple(names)


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
        assert reqs[0].finish_reason == "error" and isinstance(reqs[0].error, FAULT_ERRORS[mode])
        assert [reqs[1].output_ids, reqs[2].output_ids] == [alone[1], alone[2]]
    assert engine.runner.kv.pages.free_slots == engine.runner.kv.num_slots


def test_a_finished_request_is_announced_before_the_rest_of_its_step(engine, grammar, tokenizer):
    """A request that finishes in a step tells its caller at once, before the requests after
    it in the step take their tokens in (an async caller's answer does not wait for the rest
    of a long step); its slot is freed after, and the others' outputs are as without it."""
    alone = solo(tokenizer, engine, grammar, 2)
    short, other = make(tokenizer, engine, grammar, 0, max_tokens=4), make(tokenizer, engine, grammar, 2)
    seen: list[tuple[int, bool]] = []  # at the announcement: the other's output length, the slot held
    short.progress_updates = False
    short.on_update = lambda req: seen.append((other.num_output, req.slot is not None))
    for r in (short, other):
        engine.add_request(r)
    while not short.finished:
        before = other.num_output
        engine.step()
    assert seen == [(before, True)] and other.num_output > before and short.slot is None
    while not other.finished:
        engine.step()
    assert other.output_ids == alone


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


def test_decode_rows_lay_a_request_out_a_row_per_token():
    """A step's rows as the decode graphs stage them: a request's pending tokens (a prompt
    chunk, forced text) are one run, laid out a row per token at consecutive positions of its
    slot; its guess is the row after its sampled row, which is its last pending token's (a
    prompt chunk that stops short samples nothing)."""
    from types import SimpleNamespace

    from structgen.engine.cuda_graphs import step_rows

    chunk = SimpleNamespace(slot=3, num_cached=2, token_ids=[10, 11, 12, 13, 14, 15], guess=None)
    forced = SimpleNamespace(slot=1, num_cached=5, token_ids=[0, 1, 2, 3, 4, 20, 21, 22], guess=23)
    plain = SimpleNamespace(slot=0, num_cached=4, token_ids=[0, 1, 2, 3, 30], guess=None)
    rows, sampled = Engine._decode_rows([(chunk, 2), (forced, 3), (plain, 1)])
    assert step_rows(rows) == ([12, 13, 20, 21, 22, 23, 30], [2, 3, 5, 6, 7, 8, 4], [3, 3, 1, 1, 1, 1, 0])
    assert sampled == [None, 4, 6]


def test_planned_decode_steps_are_the_steps_the_engine_runs(engine, grammar, tokenizer):
    """With jump-forward, a decode step takes its sampled tokens in (advance, jump) inside the
    runner's `plan_next` callback, before the next forward is launched, and returns the next
    step's rows, forced text included, so the CUDA graphs launch that forward early
    (cuda_graphs.py). Through the runner seam on the CPU: every plan equals the rows of the
    next decode step, and outputs equal a run that never plans. Without graphs forced text runs
    as an extend step, so here the step after a jump is planned as None (not a decode step);
    the GPU tests cover planned forced rows."""
    from structgen.engine.jump_forward import JumpForward

    real = engine.runner.decode
    steps: list[tuple[list, list | None]] = []  # (rows run, rows planned for the next step)

    def planning_decode(step):
        tokens = real(step)
        step.before_wait(lambda: False)  # batch 1: jumps rehearsed as if the device still computed
        planned = None
        if step.plans_next:
            rows = step.plan_next(tokens)
            planned = None if rows is None else [(s.slot, s.start, s.token_ids) for s in rows]
        steps.append(([(s.slot, s.start, s.token_ids) for s in step.rows], planned))
        return tokens

    def outputs() -> list[list[int]]:
        reqs = [make(tokenizer, engine, grammar, i, max_tokens=30, jump_forward=True) for i in range(3)]
        engine.run(reqs)
        solo = make(tokenizer, engine, grammar, 2, max_tokens=40, jump_forward=True)
        engine.run([solo])  # batch 1: the jumps are rehearsed
        reqs.append(solo)
        assert all(r.finish_reason in ("stop", "length") for r in reqs)
        assert sum(r.stats.forced_tokens for r in reqs) > 0  # jumps happened
        return [r.output_ids for r in reqs]

    previous = engine.jump_forward_hook
    engine.jump_forward_hook = hook = JumpForward(tokenizer, engine.vocab_size, engine.stop_token_ids)
    replayed = []
    real_replay = hook._replay
    hook._replay = lambda req, plan: replayed.append(plan) or real_replay(req, plan)
    try:
        unplanned = outputs()
        engine.runner.decode = planning_decode
        planned = outputs()
    finally:
        del engine.runner.decode  # back to the class's method
        engine.jump_forward_hook = previous
    assert planned == unplanned
    assert any(p is not None for p in replayed)  # and some of its jumps were rehearsals replayed
    plans = [(plan, steps[k + 1][0] if k + 1 < len(steps) else None) for k, (_, plan) in enumerate(steps)]
    made = [(plan, ran) for plan, ran in plans if plan is not None]
    assert len(made) >= 10
    assert all(plan == ran for plan, ran in made)
    assert any(plan is None for _, plan in steps[:-1])  # after a jump: an extend step comes


def test_a_grammar_that_cannot_roll_back_fails_only_its_request(engine, grammar, tokenizer):
    """Jump-forward's guess rows take the guess into the matcher and roll it back; where a
    matcher raises on the rollback its request fails alone, and the batch's other rows
    (jump-forward on) generate what they generate alone."""
    from structgen.engine.jump_forward import JumpForward

    previous = engine.jump_forward_hook
    engine.jump_forward_hook = JumpForward(tokenizer, engine.vocab_size, engine.stop_token_ids)
    try:
        alone = []
        for i in (1, 2):
            req = make(tokenizer, engine, grammar, i, max_tokens=30, jump_forward=True)
            engine.run([req])
            alone.append(req.output_ids)
        reqs = [make(tokenizer, engine, grammar, i, max_tokens=30, jump_forward=True) for i in range(3)]
        reqs[0].matcher = faulty = FaultyMatcher(reqs[0].matcher, fail_after=2, mode="guess-rollback")
        engine.run(reqs)
    finally:
        engine.jump_forward_hook = previous
    assert getattr(faulty, "raised_in", None) == "fill_guess_rows"
    assert reqs[0].finish_reason == "error" and "rollback" in str(reqs[0].error)
    assert [reqs[1].output_ids, reqs[2].output_ids] == alone
    assert engine.runner.kv.pages.free_slots == engine.runner.kv.num_slots


def test_failed_rehearsal_fails_only_its_request(engine, grammar, tokenizer):
    """A rehearsal that raises may leave its request's matcher mid-way: that request ends with
    an error naming it, and the engine serves the next request as before."""
    from structgen.engine.jump_forward import JumpForward

    class BrokenRehearsal(JumpForward):
        def rehearse(self, req, allowed, done, guess=None):
            raise RuntimeError("boom")

    real = engine.runner.decode

    def decode(step):
        tokens = real(step)
        step.before_wait(lambda: False)  # as the graphs call it, between the sampler and the wait
        if step.plans_next:
            step.plan_next(tokens)
        return tokens

    previous = engine.jump_forward_hook
    engine.runner.decode = decode
    try:
        engine.jump_forward_hook = BrokenRehearsal(tokenizer, engine.vocab_size, engine.stop_token_ids)
        failed = make(tokenizer, engine, grammar, 0, max_tokens=20, jump_forward=True)
        engine.run([failed])
        engine.jump_forward_hook = previous
        fine = make(tokenizer, engine, grammar, 0, max_tokens=20, jump_forward=True)
        engine.run([fine])
    finally:
        del engine.runner.decode
        engine.jump_forward_hook = previous
    assert failed.finish_reason == "error" and "rehearsal failed: boom" in str(failed.error)
    assert fine.finish_reason in ("stop", "length") and fine.num_output > 0
    assert engine.runner.kv.pages.free_slots == engine.runner.kv.num_slots


def test_prefetched_masks_change_nothing(engine, grammar, tokenizer):
    """The next step's masks are filled on worker threads while the engine does its
    bookkeeping (grammar/prefetch.py): outputs equal those of an engine that fills every mask
    on the spot, and the prefetched rows are really the ones used."""
    from structgen.grammar import native
    from structgen.grammar.prefetch import MaskPrefetcher

    default = engine.prefetcher
    if native.pool_in_use():  # masks are filled inline on grammar.native's pool instead
        assert default is None
    else:  # on by default, tuned (EngineTuning.mask_prefetch="auto"): off until timing says it pays
        assert default is not None and default.tuner is not None and not default.tuner.enabled
    # Two JSON rows here; by default it waits for 32 whose masks took 0.3 ms or more to fill.
    engine.prefetcher = MaskPrefetcher(2, min_rows=1, min_fill_s=0.0)

    def outputs() -> list[list[int]]:
        reqs = [make(tokenizer, engine, grammar, i, max_tokens=20) for i in range(3)]
        engine.run(reqs)
        return [r.output_ids for r in reqs]

    try:
        with_prefetch = outputs()
        assert engine.prefetcher.served >= 20  # two JSON rows, most of their steps
    finally:
        engine.prefetcher.close()
        engine.prefetcher = None
    try:
        assert outputs() == with_prefetch
    finally:
        engine.prefetcher = default


def test_prefetch_tuner_keeps_the_faster_mode_on_this_host():
    """`PrefetchTuner` alternates the prefetch off and on in blocks of decode steps, keeps
    whichever mode gave shorter steps of one shape (on must win by min_gain), holds that for
    `hold` steps and then times both again; intervals across a change of shape, or around a
    step it may not time, are not counted, but each shape keeps its times. Step times come
    from a fake clock: each mode's cost is given."""
    from structgen.grammar.prefetch import PrefetchTuner

    def run(tuner: PrefetchTuner, cost: dict[bool, float], steps: int, t: float = 0.0) -> float:
        """Up to `steps` steps of one shape, stopping right after a decision."""
        made = len(tuner.decisions)
        for _ in range(steps):
            tuner.step(t, "b64")
            t += cost[tuner.enabled]
            if len(tuner.decisions) > made:
                break
        return t

    tuner = PrefetchTuner(block=4, samples=6, hold=50)
    assert not tuner.holding
    t = run(tuner, {False: 1.2e-3, True: 1.0e-3}, 40)
    assert tuner.decisions == [True] and tuner.enabled and tuner.holding  # the prefetch was faster here
    t = run(tuner, {False: 1.0e-3, True: 1.0e-3}, 49, t=t)  # held: no new timing
    assert tuner.decisions == [True] and tuner.enabled and tuner.holding
    t = run(tuner, {False: 1.0e-3, True: 1.0e-3}, 1, t=t)
    assert not tuner.holding  # timing both again
    t = run(tuner, {False: 1.0e-3, True: 1.2e-3}, 40, t=t)  # this host, now: the prefetch costs
    assert tuner.decisions == [True, False] and not tuner.enabled

    tuner = PrefetchTuner(block=4, samples=6, hold=50, min_gain=0.05)
    run(tuner, {False: 1.0e-3, True: 0.98e-3}, 40)  # a 2 % gain is not enough
    assert tuner.decisions == [False] and not tuner.enabled

    tuner = PrefetchTuner(block=4, samples=6, hold=50)
    t = 0.0
    for i in range(200):  # a new shape every 9 steps, never seen again: no shape gets 6 + 6
        tuner.step(t, i // 9)
        t += 1e-3 if tuner.enabled else 2e-3
    assert tuner.decisions == []
    tuner = PrefetchTuner(block=4, samples=6, hold=500)
    for i in range(200):  # runs of 5 steps of one shape, cut by steps it may not time
        tuner.step(t, None if i % 5 == 4 else "b64")
        t += 1e-3 if tuner.enabled else 2e-3
    assert tuner.decisions == [True] and tuner.enabled  # the shape's times added up

    tuner = PrefetchTuner(block=4, samples=6, hold=500)
    for i in range(400):  # two shapes taking turns in runs of 7 (requests come and go)
        shape = "b64" if (i // 7) % 2 else "b32"
        tuner.step(t, shape)
        t += (2e-3 if tuner.enabled else 1e-3) * (2 if shape == "b64" else 1)
    assert tuner.decisions == [False] and not tuner.enabled  # here the prefetch costs

    from structgen.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="mask_prefetch"):
        EngineTuning(mask_prefetch="sometimes")


def test_mask_prefetcher_serves_only_unchanged_matchers(engine, grammar, tokenizer):
    """A prefetched row is used only for the same matcher in the same state; rows that moved
    are copied; a matcher that advanced since, or a chunk that raised, is left to the caller."""
    import torch

    from structgen.grammar import allocate_bitmask
    from structgen.grammar.prefetch import MaskPrefetcher

    def advanced(text: str):
        m = grammar.matcher()
        for tid in tokenizer.encode(text, add_special_tokens=False):
            assert m.accept_token(tid)
        return m

    # Two states whose masks differ: inside the name string, and at the age number.
    ms = [advanced('{"name": "Al' if k % 2 else '{"name": "Al", "age": ') for k in range(40)]
    vocab = engine.vocab_size
    expected = allocate_bitmask(len(ms), vocab)
    for k, m in enumerate(ms):
        m.fill_bitmask(expected, k)
    assert not torch.equal(expected[0], expected[1])

    # Fills that have been cheap are left to the caller; costly ones are prefetched.
    pf = MaskPrefetcher(threads=3, min_rows=1)
    target = allocate_bitmask(48, vocab)
    pf.start(target, list(enumerate(ms)))
    assert pf.take(target, list(enumerate(ms))) == list(enumerate(ms)) and pf.started == 0
    for _ in range(10):
        pf.observe(1e-3)
    assert pf.fill_s > MIN_FILL_S
    pf.min_fill_s = 0.0  # from here on, whatever the fills below cost

    # 40 rows: three chunks on three threads.
    target = allocate_bitmask(48, vocab)
    pf.start(target, list(enumerate(ms)))
    assert pf.started == len(ms)
    assert ms[5].accept_token(tokenizer.encode("x", add_special_tokens=False)[0])  # advanced meanwhile
    out = torch.full_like(target, -1)
    rest = pf.take(out, [(k + 1, m) for k, m in enumerate(ms)])  # laid out one row lower
    assert [row for row, _ in rest] == [6]
    assert all(torch.equal(out[k + 1], expected[k]) for k in range(len(ms)) if k != 5)
    assert pf.served == len(ms) - 1

    # The prefetch's own buffer at the same rows: served in place, nothing copied.
    pf.start(target, list(enumerate(ms)))
    assert pf.take(target, list(enumerate(ms[:5]))) == []
    assert torch.equal(target[:5], expected[:5])
    assert pf.take(target, [(0, ms[0])]) == [(0, ms[0])]  # taken already: nothing pending

    class Broken:
        backend, version = "broken", 0

        def fill_bitmask(self, bitmask, row):
            raise RuntimeError("grammar exploded")

    broken = Broken()
    pf.start(target, [(0, broken), (1, ms[1])])  # one chunk, and it raised
    assert pf.take(target, [(0, broken), (1, ms[1])]) == [(0, broken), (1, ms[1])]

    class NotReallyXGrammar:  # preparing its chunk raises, before any thread is involved
        backend, version = "xgrammar", 0

    odd = NotReallyXGrammar()
    pf.start(target, [(0, odd), (1, ms[1])])
    assert pf.take(target, [(0, odd), (1, ms[1])]) == [(0, odd), (1, ms[1])]
    pf.close()


def test_failing_grammars_spare_other_rows_in_planned_steps(engine, grammar, tokenizer):
    """With jump-forward, a decode step takes its tokens in inside the runner's `plan_next`,
    first through the grammar-only check that launches the next forward early
    (`Engine._plain_next_step`). A grammar that rejects its token or raises there still fails
    its own request alone. Through the runner seam on the CPU, as in the planning test above."""
    from structgen.engine.jump_forward import JumpForward

    real = engine.runner.decode

    def planning_decode(step):
        tokens = real(step)
        if step.plans_next:
            step.plan_next(tokens)
        return tokens

    def run(faulty_mode: str | None, fail_after: int = 0) -> list[Request]:
        reqs = [make(tokenizer, engine, grammar, i, max_tokens=20, jump_forward=True) for i in range(3)]
        if faulty_mode:
            reqs[0].matcher = FaultyMatcher(reqs[0].matcher, fail_after=fail_after, mode=faulty_mode)
        engine.run(reqs)
        return reqs

    previous = engine.jump_forward_hook
    engine.jump_forward_hook = JumpForward(tokenizer, engine.vocab_size, engine.stop_token_ids)
    engine.runner.decode = planning_decode
    paths = set()
    try:
        clean = run(None)
        # A seam that breaks (the stub's signature out of date) fails every step in the engine's
        # guard; the comparisons below would then compare failures with failures.
        assert all(r.finish_reason != "error" for r in clean), [str(r.error) for r in clean]
        for mode in ("reject", "accept"):
            for fail_after in (2, 4, 6, 8):  # failing in different steps, planned ones among them
                reqs = run(mode, fail_after)
                assert reqs[0].finish_reason == "error" and isinstance(reqs[0].error, FAULT_ERRORS[mode]), mode
                assert "grammar" in str(reqs[0].error) or "constraint" in str(reqs[0].error), reqs[0].error
                assert all(r.finish_reason != "error" for r in reqs[1:]), mode
                assert [r.output_ids for r in reqs[1:]] == [r.output_ids for r in clean[1:]], mode
                paths.add(getattr(reqs[0].matcher, "raised_in", ()))
    finally:
        del engine.runner.decode
        engine.jump_forward_hook = previous
    assert any("_advance_all" in p for p in paths)  # some failed while the tokens were taken in
    assert engine.runner.kv.pages.free_slots == engine.runner.kv.num_slots

    # The grammar-only check itself: a grammar that raises there (or rejects) makes it give the
    # step back to taking the tokens in, which fails that request alone; nothing is accepted.
    reqs = [make(tokenizer, engine, grammar, i, max_tokens=20, jump_forward=True) for i in (0, 2)]
    for r in reqs:
        engine.add_request(r)
    engine.step()  # both prefilled: each has its sampled token pending
    for mode in ("accept", "reject"):
        reqs[1].matcher = FaultyMatcher(reqs[1].matcher, fail_after=-1, mode=mode)
        before = reqs[0].matcher.version
        toks = [allowed_token(reqs[0].matcher, engine.vocab_size), 0]  # the second fails anyway
        rows, taken, _ = engine._plain_next_step(reqs, toks)
        assert rows is None
        assert taken[0] & ACCEPTED and reqs[0].matcher.version == before + 1
        assert taken[1] == (FAILED if mode == "accept" else 0)  # what taking the tokens in then fails on
        reqs[0].matcher.rollback(1)
        reqs[1].matcher = reqs[1].matcher.inner
    for r in reqs:
        engine.abort(r)


def allowed_token(matcher, vocab_size: int) -> int:
    """The lowest token id `matcher` accepts next (from its own mask)."""
    import numpy as np

    from structgen.grammar import allocate_bitmask

    mask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(mask, 0)
    bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")
    return int(np.flatnonzero(bits)[0])


@pytest.mark.parametrize("slots,in_graphs,largest", [(8, False, 32), (8, True, 256), (64, True, 256),
                                                     (256, True, 1024), (256, False, 1024)])
def test_graphs_are_captured_up_to_four_rows_a_slot_and_a_prompt_budget(slots: int, in_graphs: bool,
                                                                        largest: int) -> None:
    """The default buckets are kept up to 4 rows a KV slot (forced, guessed and draft tokens
    ride as rows) and, with prompts in the graphs, up to at least 256 rows (a step's prompt
    budget), so a burst of prompts on many slots is not cut into 256-token steps."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, eos_token_id=[])
    ec = EngineConfig(device="cpu", dtype="float32", max_batch_size=slots, max_seq_len=16, use_cuda_graphs=False,
                      tuning=EngineTuning(prefill_in_graphs=in_graphs))
    eng = Engine(cfg, ec, model_dir=None, stop_token_ids=set())
    eng.runner.capture_decode_graphs(capture=False)
    assert max(eng.runner.graphs.batch_sizes) == largest
