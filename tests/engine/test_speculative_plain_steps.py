"""A speculative engine's steps without drafts are the plain engine's steps: an engine built
with `EngineConfig.speculative` runs jump-forward's guess rows in them as the plain engine does,
and a verify step never leaves a guess behind for a later step (real default model, CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from structgen.api import LLM, _stop_token_ids
from structgen.engine.config import EngineConfig, SpeculativeConfig
from structgen.engine.engine import Engine
from structgen.engine.models.loader import load_model_config
from structgen.engine.request import Request
from structgen.engine.speculative.speculator import Speculator
from structgen.grammar.prefetch import MaskPrefetcher
from structgen.sampling import SamplingParams
from structgen.types import JsonSchema

SOURCE = "Maria Gonzalez is a 34 year old software engineer living in Barcelona."
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PROMPT = f"Extract the person as JSON with keys name, age, city.\n\nText: {SOURCE}"


@pytest.fixture(scope="module")
def llm(model_dir, tokenizer) -> LLM:
    """An engine built as users build one with speculation: `EngineConfig.speculative` set,
    steps of more than one request left to the plain step."""
    cfg = EngineConfig(device="cpu", max_batch_size=4, max_seq_len=1024,
                       speculative=SpeculativeConfig(num_draft_tokens=3, max_requests=1))
    engine = Engine(load_model_config(model_dir), cfg, model_dir)
    engine.stop_token_ids = _stop_token_ids(tokenizer, engine.model_config.eos_token_id)
    return LLM.from_engine(engine, tokenizer, "smollm2-135m")


def json_requests(llm: LLM, n: int, max_tokens: int) -> list[Request]:
    grammar = llm.compile(JsonSchema(SCHEMA))
    ids = llm.encode_prompt(PROMPT)
    return [Request(ids, SamplingParams(max_tokens=max_tokens, jump_forward=True), grammar.matcher(),
                    frozenset(llm.engine.stop_token_ids)) for _ in range(n)]


def test_plain_steps_of_a_speculative_engine_run_guess_rows_and_keep_outputs(llm):
    """Two requests (more than `max_requests`) run plain steps only; there, as in the plain
    engine, forced text's held-back token runs as a guess row (counted as drafted), and the
    outputs are the plain engine's token for token."""
    eng, spec = llm.engine, llm.engine.speculator
    eng.speculator = None
    try:
        base = eng.run(json_requests(llm, 2, 48))
    finally:
        eng.speculator = spec
    got = eng.run(json_requests(llm, 2, 48))
    assert [r.output_ids for r in got] == [r.output_ids for r in base]
    assert all(r.finish_reason == "stop" for r in got)
    assert all(r.stats.verify_steps == 0 and r.stats.drafted_tokens > 0 for r in got)
    assert [r.stats.forward_passes for r in got] == [r.stats.forward_passes for r in base]


def test_a_verify_step_drops_the_guess_it_did_not_run(llm):
    """A request given a guess by forced text whose next step is a verify step (which runs no
    guess row) leaves it without a guess, so no later plain step runs that token at a position
    it was not proposed for; the output is still the plain engine's."""
    eng, spec = llm.engine, llm.engine.speculator
    eng.speculator = None
    try:
        base = eng.run(json_requests(llm, 1, 48))[0]
        req = json_requests(llm, 1, 48)[0]
        eng.add_request(req)
        while req.guess is None and not req.finished:  # plain steps up to forced text's guess
            eng.step()
    finally:
        eng.speculator = spec
    assert req.guess is not None
    spec.adaptive = False  # the next step drafts, whatever this machine's timings
    try:
        forced = req.stats.forced_tokens
        eng.step()
        assert req.stats.verify_steps == 1
        assert req.stats.forced_tokens == forced  # no new forced text, so no new guess
        assert req.guess is None
        while not req.finished:
            eng.step()
    finally:
        spec.adaptive = True
    assert req.output_ids == base.output_ids


class CheckedPrefetcher(MaskPrefetcher):
    """The mask prefetch on every plain step, however few rows, counting the prefetched
    matchers that someone used while their fill was in flight (their `version` moved before
    `take` or `wait`): a race with the worker filling them."""

    def __init__(self) -> None:
        super().__init__(1, min_rows=1, min_fill_s=0.0)
        self.raced = 0

    def _count_raced(self) -> None:
        if self._pending is not None:
            self.raced += sum(m.version != v for _, m, v in self._pending.rows.values())

    def take(self, bitmask, rows):
        self._count_raced()
        return super().take(bitmask, rows)

    def wait(self) -> None:
        self._count_raced()
        super().wait()


def test_the_mask_prefetch_beside_drafting_steps_keeps_outputs(llm):
    """With the mask prefetch on (an engine built with speculation keeps it for its plain
    steps; here it fills every plain step's next masks on a worker, however few rows), three
    JSON requests of different lengths run plain steps and the policy's drafting steps, which
    let the prefetch finish before they walk the matchers (no matcher used while its fill was
    in flight): plain decoding's outputs, with prefetched masks used and drafts verified."""
    eng, spec = llm.engine, llm.engine.speculator
    tuning = eng.config.tuning
    eng.config.tuning = replace(tuning, mask_prefetch="on")
    try:
        assert eng._mask_prefetcher() is not None  # not dropped for speculation
    finally:
        eng.config.tuning = tuning
    budgets = [16, 40, 28]

    def run(speculator: Speculator | None) -> tuple[list[Request], CheckedPrefetcher]:
        saved, eng.prefetcher = eng.prefetcher, CheckedPrefetcher()
        eng.speculator = speculator
        try:
            reqs = [r for n in budgets for r in json_requests(llm, 1, n)]
            return eng.run(reqs), eng.prefetcher
        finally:
            eng.prefetcher.close()
            eng.prefetcher, eng.speculator = saved, spec

    base, _ = run(None)
    drafting = Speculator(eng, SpeculativeConfig(num_draft_tokens=3, max_requests=0))
    drafting.use_tokenizer(llm.tokenizer)
    got, prefetcher = run(drafting)
    assert [r.output_ids for r in got] == [r.output_ids for r in base]
    assert prefetcher.served > 0 and sum(r.stats.verify_steps for r in got) > 0
    assert prefetcher.raced == 0
