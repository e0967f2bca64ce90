"""Speculative decoding (structgen/engine/speculative/): lossless for greedy requests on the real
default model, distribution-preserving for sampled ones, and the drafters on their own."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch

from structgen.api import LLM
from structgen.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from structgen.engine.engine import Engine
from structgen.engine.models.loader import load_model_config
from structgen.engine.request import GenerationStats, Request
from structgen.engine.sampler import apply_bitmask_
from structgen.engine.speculative.ngram import NgramDrafter, NgramIndex
from structgen.engine.speculative.speculator import Speculator
from structgen.engine.speculative.verify import accept_draft
from structgen.errors import InvalidParameterError
from structgen.grammar import GrammarCompiler, allocate_bitmask
from structgen.sampling import SamplingParams
from structgen.types import Choice, JsonSchema, to_constraint

SOURCE = (
    "Maria Gonzalez is a 34 year old software engineer living in Barcelona. "
    "Her employee id is EMP-20931 and her email is maria.gonzalez@example.com."
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "email": {"type": "string"},
    },
    "required": ["name", "age", "city", "email"],
    "additionalProperties": False,
}
PROMPT = f"Extract the person as JSON with keys name, age, city, email.\n\nText: {SOURCE}"


@pytest.fixture(scope="module")
def llm(model_dir, tokenizer) -> LLM:
    """The real default model on CPU; each test swaps `engine.speculator` in and out."""
    cfg = EngineConfig(device="cpu", max_batch_size=4, max_seq_len=1024)
    from structgen.api import _stop_token_ids

    model_config = load_model_config(model_dir)
    engine = Engine(model_config, cfg, model_dir, stop_token_ids=_stop_token_ids(tokenizer, model_config.eos_token_id))
    return LLM.from_engine(engine, tokenizer, "smollm2-135m")


def speculate(llm: LLM, spec: SpeculativeConfig | None) -> None:
    llm.engine.speculator = None if spec is None else Speculator(llm.engine, spec)


def complete(llm: LLM, spec: SpeculativeConfig | None, output_type, prompt: str, fixed: bool = False, **kw):
    """`llm.complete` with `spec`; `fixed`: every step drafts its budget (no draft policy, whose
    choices follow how long steps take on this machine now)."""
    speculate(llm, spec)
    if fixed:
        llm.engine.speculator.adaptive = False
    try:
        return llm.complete(output_type, prompt, **kw)
    finally:
        speculate(llm, None)


def submit_all(llm: LLM, ids: list[list[int]], max_tokens: list[int]) -> list[Request]:
    """Greedy requests of these prompts run together to the end, through the LLM's own
    engine loop: once an earlier test started it, a direct `engine.run` would step the engine
    from two threads at once."""
    reqs = [Request(p, SamplingParams(max_tokens=n), stop_token_ids=frozenset(llm.engine.stop_token_ids))
            for p, n in zip(ids, max_tokens, strict=True)]
    for future in [llm.loop.submit(r) for r in reqs]:
        future.result(timeout=300)
    return reqs


def test_greedy_constrained_output_is_unchanged(llm):
    """The same tokens with and without speculation (n-gram, with and without grammar-aware
    drafting, jump-forward on), and the drafts really were used."""
    base = complete(llm, None, JsonSchema(SCHEMA), PROMPT, max_tokens=80)
    for aware in (True, False):
        spec = SpeculativeConfig(num_draft_tokens=4, grammar_aware=aware)
        out = complete(llm, spec, JsonSchema(SCHEMA), PROMPT, fixed=True, max_tokens=80)
        assert out.token_ids == base.token_ids, f"grammar_aware={aware}"
        assert out.value == base.value
        s = out.stats
        assert s.drafted_tokens > 0 and s.accepted_tokens > 0
        assert s.mean_acceptance_length == (s.accepted_tokens + s.verify_steps) / s.verify_steps > 1.0
        assert s.forward_passes < base.stats.forward_passes
    assert llm.engine.runner.kv.pages.free_slots == llm.engine.runner.kv.num_slots


def test_where_no_draft_pays_steps_run_as_plain_decode_steps(llm):
    """Requests at a batch where the policy finds that drafts cost more than they emit (every
    bucket past the plain step's rows priced at ten plain steps) run the engine's plain decode
    steps, not verify steps without drafts: the plain outputs, half the passes or fewer as
    verify steps (the prompts' steps still are), and the plain steps are timed for the policy.
    Two requests, and a lone one: its steps stay verify steps only where it was given drafts."""
    prompts = [llm.encode_prompt(p) for p in (PROMPT, f"Summarise in one sentence: {SOURCE}")]

    def run(spec: SpeculativeConfig | None, ids: list[list[int]]) -> list[Request]:
        speculate(llm, spec)
        if spec is not None:
            rows = len(ids)  # a plain step's rows; a step of more is a verify step
            for bucket, seconds in ((rows, 1.0), (2 * rows, 10.0), (4 * rows, 10.0)):
                for _ in range(2):  # a bucket's first is dropped
                    llm.engine.speculator.policy.record_step(bucket, seconds, drafts=bucket - rows)
        try:
            return submit_all(llm, ids, [30] * len(ids))
        finally:
            if spec is not None:
                run.policy = llm.engine.speculator.policy
            speculate(llm, None)

    for ids in (prompts, prompts[:1]):
        base = run(None, ids)
        got = run(SpeculativeConfig(num_draft_tokens=3), ids)
        assert [r.output_ids for r in got] == [r.output_ids for r in base]
        for r in got:
            assert r.stats.verify_steps <= r.stats.forward_passes // 2  # every pass was one before
        assert run.policy.plain.seconds[len(ids)] < 1.0  # plain steps replaced the made-up cost


class CountingNgramDrafter(NgramDrafter):
    """The n-gram drafter, counting the requests it is asked to draft for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: Counter[int] = Counter()  # request id -> steps it was asked about

    def candidates(self, req: Request, k: int):
        self.asked[req.id] += 1
        return super().candidates(req, k)


def test_steps_without_drafts_ask_the_drafter_about_nobody(llm):
    """Where the draft policy gives nobody drafts (every verify bucket measured at ten plain
    steps), a speculative engine's steps do no per-request drafting work: the drafter is asked
    about no request, and most steps do not weigh drafts at all (a choice of no drafts stands
    for its plain bucket); the outputs are plain decoding's, without a verify step."""
    prompts = [llm.encode_prompt(p) for p in (PROMPT, f"Summarise in one sentence: {SOURCE}")]
    speculate(llm, None)
    base = submit_all(llm, prompts, [24, 24])
    drafter = CountingNgramDrafter()
    speculate(llm, SpeculativeConfig(method="custom", drafter=drafter, num_draft_tokens=3, max_requests=0))
    policy = llm.engine.speculator.policy
    # 2 rows: a plain step; a verify step of every bucket either request could draft to (a lone
    # request's one draft is bucket 2), at ten plain steps
    for bucket, seconds, drafts in ((2, 1.0, 0), (2, 10.0, 1), (4, 10.0, 2), (8, 10.0, 6)):
        for _ in range(2):  # a bucket's first is dropped
            policy.record_step(bucket, seconds, drafts=drafts)
    try:
        got = submit_all(llm, prompts, [24, 24])
    finally:
        speculate(llm, None)
    assert [r.output_ids for r in got] == [r.output_ids for r in base]
    assert all(r.stats.verify_steps <= 1 and r.stats.forward_passes > 15 for r in got)
    assert policy.decisions["plain"] >= 15 and not drafter.asked
    assert policy.weighed <= policy.decisions.total() // 3


class WindowDrafter:
    """Proposes a known output (`reference`), every token wrong at output positions
    [lo, hi); records the output position of each verified draft and what it kept."""

    host_only = True

    def __init__(self, reference: list[int], lo: int, hi: int) -> None:
        self.reference, self.lo, self.hi = reference, lo, hi
        self.verified: list[tuple[int, int]] = []  # (output position, accepted)

    def propose(self, req: Request, k: int) -> list[int]:
        n = req.num_output
        return [t + 1 if self.lo <= n + j < self.hi else t for j, t in enumerate(self.reference[n : n + k])]

    def on_verified(self, req: Request, drafted: int, accepted: int) -> None:
        self.verified.append((req.num_output, accepted))


def test_drafting_resumes_after_a_stretch_the_drafter_gets_wrong(llm):
    """A drafter wrong for output tokens 6-21 and right elsewhere: drafting stops in the wrong
    stretch (its acceptance falls) and resumes after it, because the drafts it is not given
    are checked against the tokens the request emits; outputs equal plain decoding's. Step
    costs are fixed (a verify step of 4 rows 1.3x a plain one) so acceptance alone decides."""
    ids = [llm.encode_prompt(PROMPT)]
    speculate(llm, None)
    base = submit_all(llm, ids, [48])[0]
    drafter = WindowDrafter(base.output_ids, 6, 22)
    speculate(llm, SpeculativeConfig(method="custom", drafter=drafter, num_draft_tokens=3))
    policy = llm.engine.speculator.policy
    for bucket, seconds, drafts in ((1, 1.0, 0), (2, 1.0, 0), (2, 1.25, 1), (4, 1.3, 3)):
        for _ in range(2):  # a bucket's first is dropped
            policy.record_step(bucket, seconds, drafts)
    policy.record_step = lambda *args, **kw: None
    policy._realized_loss = lambda *args: False  # wall time on this machine decides nothing
    try:
        got = submit_all(llm, ids, [48])[0]
    finally:
        speculate(llm, None)
    assert got.output_ids == base.output_ids
    positions = [n for n, _ in drafter.verified]
    assert any(6 <= n < 22 for n in positions)  # drafted into the wrong stretch, and stopped:
    assert sum(6 <= n < 22 for n in positions) < 10
    assert sum(accepted for n, accepted in drafter.verified if n >= 22) >= 8  # then drafted again


def test_steps_of_more_requests_than_max_requests_run_without_speculation(llm):
    """A step of more requests than `SpeculativeConfig.max_requests` is the engine's plain step:
    a short request that runs only beside two others never sees a verify step (its prompt's
    step would be one), and outputs equal plain decoding's; the limit off (0), it does."""
    prompts = [llm.encode_prompt(p) for p in (PROMPT, f"Summarise in one sentence: {SOURCE}", f"Who is this? {SOURCE}")]
    budgets = [6, 24, 24]
    speculate(llm, None)
    base = submit_all(llm, prompts, budgets)
    for cap, verified in ((2, False), (0, True)):
        speculate(llm, SpeculativeConfig(num_draft_tokens=3, max_requests=cap))
        try:
            got = submit_all(llm, prompts, budgets)
        finally:
            speculate(llm, None)
        assert [r.output_ids for r in got] == [r.output_ids for r in base]
        assert (got[0].stats.verify_steps > 0) == verified, f"max_requests={cap}"


FSTAB_ENTRY = {"type": "object", "properties": {
    "device": {"type": "string"}, "mount_point": {"type": "string"}, "file_system_type": {"type": "string"},
    "options": {"type": "string"}, "dump": {"type": "string", "pattern": "^[0-1]$"},
    "pass": {"type": "string", "pattern": "^[0-2]$"}},
    "required": ["device", "mount_point", "file_system_type", "options", "dump", "pass"]}
FSTAB = {"type": "object", "required": ["/"], "properties": {"/": FSTAB_ENTRY},
         "patternProperties": {"^(/[^/]+)+$": FSTAB_ENTRY}, "additionalProperties": False}
FSTAB_RECORD = {
    "/": {"device": "/dev/sda1", "mount_point": "/", "file_system_type": "ext4", "options": "defaults",
          "dump": "0", "pass": "1"},
    "/home": {"device": "/dev/sda2", "mount_point": "/home", "file_system_type": "ext4", "options": "defaults",
              "dump": "0", "pass": "2"},
    "/var": {"device": "UUID=2e9e4e8b-08c0-4c7c-8d7d-2b5f65cc8cd0", "mount_point": "/var", "file_system_type": "xfs",
             "options": "noatime,nodiratime", "dump": "0", "pass": "2"}}


def test_an_output_closed_at_its_budget_is_the_same_with_speculation(llm):
    """Budget closing checks the output at scheduled lengths; jump-forward's forced text stops
    short of the next one, so every check lands on the same token whether steps add one token,
    forced text or a verify step's drafts, and the output is closed at the same point (MaskBench
    JME's fstab schema: forced text had carried plain decoding one token past a check, whose
    later schedule then closed the two runs at different fields)."""
    prompt = f"Write this record as JSON.\nSchema: {json.dumps(FSTAB)}\nRecord: {json.dumps(FSTAB_RECORD)}"
    base = complete(llm, None, JsonSchema(FSTAB), prompt, max_tokens=96)
    spec = complete(llm, SpeculativeConfig(num_draft_tokens=3), JsonSchema(FSTAB), prompt, fixed=True, max_tokens=96)
    assert "budget_closing" in base.stats.guards_fired and base.stats.forced_tokens > 0
    assert spec.stats.accepted_tokens > 0
    assert spec.token_ids == base.token_ids


def test_an_output_closed_for_repeating_is_the_same_with_speculation(llm, maskbench_dir):
    """The loop guard looks at the output every LOOP_CHECK_EVERY tokens; jump-forward's forced
    text stops short of the next check, as it does of a budget check, so checks fall on the
    same tokens whether steps add one token, forced text or a verify step's drafts. MaskBench
    JME_1 in bench_speculative's extraction prompt repeats a field until the guard closes it:
    with speculation it was closed a repetition later (plain decoding's forced text had run
    past a check, which moved every later one)."""
    from benchmarks.bench_speculative import extraction_prompt

    rows = [json.loads(line) for line in (maskbench_dir / "JME.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r["id"] == "JME_1")
    instance = next(t["data"] for t in row["tests"] if t["valid"] and isinstance(t["data"], dict) and t["data"])
    prompt, schema = extraction_prompt(row["schema"], instance), JsonSchema(row["schema"])
    base = complete(llm, None, schema, prompt, max_tokens=256)
    spec = complete(llm, SpeculativeConfig(num_draft_tokens=3), schema, prompt, fixed=True, max_tokens=256)
    assert "repetition" in base.stats.guards_fired and spec.stats.accepted_tokens > 0
    assert spec.token_ids == base.token_ids


def test_greedy_unconstrained_output_is_unchanged(llm):
    """Plain text, batched: every request keeps its greedy tokens, stop tokens included."""
    prompts = [
        "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
        f"Summarise in one sentence: {SOURCE}",
    ]
    ids = [llm.encode_prompt(p) for p in prompts]

    def run(spec):
        speculate(llm, spec)
        if spec is not None:  # every step drafts its budget (the policy follows this machine's timings)
            llm.engine.speculator.adaptive = False
        reqs = submit_all(llm, ids, [40] * len(ids))
        speculate(llm, None)
        return reqs

    base = run(None)
    spec = run(SpeculativeConfig(num_draft_tokens=3, ngram_max=3))
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in base]
    assert sum(r.stats.accepted_tokens for r in spec) > 0


def test_the_draft_policy_over_a_shrinking_batch_keeps_greedy_outputs(llm):
    """Three requests of different lengths (the batch walks down from three rows to one) with
    the draft policy choosing per step between plain steps, trials of verify buckets and
    drafts that pay: the plain engine's outputs, whatever this machine's timings make it pick."""
    prompts = ["Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
               f"Summarise in one sentence: {SOURCE}", PROMPT]
    ids, lengths = [llm.encode_prompt(p) for p in prompts], [12, 32, 20]
    base = submit_all(llm, ids, lengths)
    speculate(llm, SpeculativeConfig(num_draft_tokens=3))
    try:
        got = submit_all(llm, ids, lengths)
        decisions = llm.engine.speculator.policy.decisions
    finally:
        speculate(llm, None)
    assert [r.output_ids for r in got] == [r.output_ids for r in base]
    assert decisions["untimed"] >= 2 and decisions["trial"] >= 1  # plain steps timed, then a bucket tried
    assert sum(r.stats.drafted_tokens for r in got) > 0


@pytest.mark.slow
def test_self_draft_is_lossless(llm):
    """The target's first layers as a draft model, its logits masked by the grammar."""
    base = complete(llm, None, JsonSchema(SCHEMA), PROMPT, max_tokens=80)
    spec = SpeculativeConfig(method="self_draft", self_draft_layers=6, num_draft_tokens=3)
    out = complete(llm, spec, JsonSchema(SCHEMA), PROMPT, fixed=True, max_tokens=80)
    assert out.token_ids == base.token_ids
    assert out.stats.drafted_tokens > 0


def test_self_draft_on_a_tiny_model_is_lossless():
    """The early-exit draft (the target's first layers, sharing its modules) through the
    whole speculative loop on a small random model: greedy outputs equal the target's alone.
    Fast, unlike the real-model test above, so CI runs the self-draft code path."""
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=[])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (4, 9)]

    def outputs(spec: SpeculativeConfig | None) -> tuple[list[list[int]], Engine, int]:
        eng = Engine(cfg, EngineConfig(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=64,
                                       speculative=spec), None, stop_token_ids=set())
        torch.manual_seed(0)
        eng.runner.model.init_random_weights(std=0.1)
        reqs = [Request(p, SamplingParams(max_tokens=16)) for p in prompts]
        eng.run(reqs)
        assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
        return [r.output_ids for r in reqs], eng, sum(r.stats.drafted_tokens for r in reqs)

    base, _, _ = outputs(None)
    spec_out, eng, drafted = outputs(SpeculativeConfig(method="self_draft", self_draft_layers=2, num_draft_tokens=3))
    assert drafted > 0
    assert spec_out == base
    assert eng.speculator.drafter.model.lm_head is eng.runner.model.lm_head


def test_seeded_sampling_is_unchanged(llm):
    """Sampling noise is keyed by (seed, position), so a seeded request draws the same
    tokens whether or not a draft covered the position."""
    kw = dict(max_tokens=60, temperature=0.8, seed=11)
    base = complete(llm, None, JsonSchema(SCHEMA), PROMPT, **kw)
    out = complete(llm, SpeculativeConfig(num_draft_tokens=3), JsonSchema(SCHEMA), PROMPT, **kw)
    assert out.token_ids == base.token_ids


class RandomGuess:
    """A user drafter: proposes the rest of a random complete output (drawn from `weights`),
    or random junk; its guesses never depend on the target's random draws."""

    def __init__(self, outputs: list[tuple[int, ...]], weights: list[float], junk: list[int], seed: int = 0):
        self.outputs, self.weights, self.junk = outputs, weights, junk
        self.rng = random.Random(seed)

    def propose(self, req: Request, k: int) -> list[int]:
        if self.rng.random() < 0.25:
            return [self.rng.choice(self.junk) for _ in range(k)]
        out = tuple(req.output_ids)
        guess = self.rng.choices(self.outputs, self.weights)[0]
        return list(guess[len(out) : len(out) + k]) if guess[: len(out)] == out else []


def exact_distribution(engine: Engine, prompt: list[int], matcher, stop: set[int], temperature: float) -> dict[tuple, float]:
    """P(output tokens) of masked sampling without speculation, by walking every path."""
    model = engine.runner.model
    out: dict[tuple, float] = {}

    def logits_after(ids: list[int]) -> torch.Tensor:
        from structgen.engine.attention import AttentionBatch

        pages = engine.runner.kv.pages
        slot = pages.allocate_slot()
        try:
            assert pages.cover(slot, len(ids))
            hidden = model(torch.tensor(ids), AttentionBatch.build([(slot, 0, len(ids))], pages), engine.runner.kv)
        finally:
            pages.release_slot(slot)
        return model.logits(hidden[-1:]).float()

    def walk(prefix: list[int], prob: float) -> None:
        mask = allocate_bitmask(1, engine.vocab_size)
        matcher.fill_bitmask(mask, 0)
        p = torch.softmax(apply_bitmask_(logits_after(prompt + prefix), mask)[0] / temperature, -1)
        for tok in p.nonzero().flatten().tolist():
            q = prob * float(p[tok])
            if tok in stop:
                out[tuple(prefix)] = out.get(tuple(prefix), 0.0) + q
                continue
            assert matcher.accept_token(tok)
            if matcher.is_completed() and engine._only_stop_allowed(matcher):
                out[tuple(prefix + [tok])] = out.get(tuple(prefix + [tok]), 0.0) + q
            else:
                walk(prefix + [tok], q)
            matcher.rollback(1)

    with torch.inference_mode():
        walk([], 1.0)
    return out


@pytest.mark.parametrize("aware", [True, False])
def test_rejection_sampling_keeps_the_distribution(tokenizer, aware):
    """Many samples with a random user drafter on a tiny random-weight model match the
    exactly computed masked target distribution (chi-square, far tail)."""
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    stop = {tokenizer.eos_token_id}
    grammar = GrammarCompiler(tokenizer, cfg.vocab_size, sorted(stop)).compile(to_constraint(Choice(["red", "blue", "cyan"])))
    # Unseeded requests: noise from the engine's generator, so every variant draws afresh.
    engine = Engine(cfg, EngineConfig(device="cpu", max_batch_size=64, max_seq_len=64, seed=7), None, stop)
    engine.runner.model.init_random_weights(std=0.4, seed=3)
    prompt = tokenizer.encode("Pick a colour:", add_special_tokens=False)
    exact = exact_distribution(engine, prompt, grammar.matcher(), stop, temperature=1.0)
    assert abs(sum(exact.values()) - 1) < 1e-4
    # The drafter guesses from a flattened version of the true distribution: often right, often not.
    outputs = sorted(exact)
    weights = [exact[o] ** 0.5 for o in outputs]
    junk = sorted({t for o in outputs for t in o})
    drafter = RandomGuess(outputs, weights, junk)
    engine.speculator = Speculator(engine, SpeculativeConfig(method="custom", drafter=drafter, grammar_aware=aware))
    engine.speculator.adaptive = False  # every step drafts (the policy follows this machine's timings)

    n = 600
    reqs = [Request(prompt, SamplingParams(max_tokens=8, temperature=1.0), grammar.matcher(), frozenset(stop))
            for _ in range(n)]
    engine.run(reqs)
    counts = Counter(tuple(r.output_ids) for r in reqs)
    assert set(counts) <= set(exact), "sampled an output the masked target cannot produce"
    assert sum(r.stats.accepted_tokens for r in reqs) > n // 2  # drafts were accepted...
    assert sum(r.stats.drafted_tokens - r.stats.accepted_tokens for r in reqs) > n // 4  # ...and rejected
    # Chi-square over outcomes expected >= 5 times, the rest pooled in one bin.
    big = [o for o, p in exact.items() if p * n >= 5]
    rest_p = 1 - sum(exact[o] for o in big)
    cells = [(counts.get(o, 0), exact[o] * n) for o in big]
    if rest_p * n >= 5:
        cells.append((n - sum(c for c, _ in cells), rest_p * n))
    chi2 = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    assert df >= 3
    print(f"chi2={chi2:.1f} df={df}")
    assert chi2 < df + 6 * math.sqrt(2 * df), f"chi2={chi2:.1f} for {df} degrees of freedom"


class Misbehaving:
    """A user drafter that proposes ids outside the vocabulary, then raises."""

    def __init__(self):
        self.calls = 0

    def propose(self, req: Request, k: int) -> list[int]:
        self.calls += 1
        if self.calls % 2:
            return [1, -5, 10**9][:k]
        raise RuntimeError("drafter bug")


def run_with_drafter(drafter, max_tokens: int) -> tuple[Engine, list[Request], list[Request]]:
    """Two greedy requests on a small random model, without speculation and then with
    `drafter` as a custom drafter: (engine, requests without, requests with)."""
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=[])
    ec = EngineConfig(device="cpu", max_batch_size=2, max_seq_len=16 + 2 * max_tokens)
    eng = Engine(cfg, ec, None, set())
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    base = [Request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    eng.run(base)
    eng.speculator = Speculator(eng, SpeculativeConfig(method="custom", drafter=drafter))
    eng.speculator.adaptive = False  # the drafter is asked every step, whatever steps cost here
    reqs = [Request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    eng.run(reqs)
    return eng, base, reqs


def test_a_broken_user_drafter_costs_only_its_drafts():
    eng, base, reqs = run_with_drafter(Misbehaving(), max_tokens=10)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in base]
    assert all(r.finish_reason == "length" for r in reqs)
    assert eng.speculator.drafter.calls > 4
    assert eng.speculator.disabled is None  # 10 steps: fewer failures in a row than the limit


class AlwaysFails:
    def __init__(self):
        self.calls = 0

    def propose(self, req: Request, k: int) -> list[int]:
        self.calls += 1
        raise RuntimeError("drafter bug")


def test_a_drafter_failing_every_step_is_switched_off():
    from structgen.engine.speculative.speculator import MAX_FAILURES_IN_A_ROW

    drafter = AlwaysFails()
    eng, base, reqs = run_with_drafter(drafter, max_tokens=40)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in base]
    assert drafter.calls == MAX_FAILURES_IN_A_ROW  # one call per step (propose_all), then off
    assert eng.speculator.drafter_failures == MAX_FAILURES_IN_A_ROW
    assert "AlwaysFails" in eng.speculator.disabled and "drafter bug" in eng.speculator.disabled


def test_accept_draft_rule():
    assert accept_draft([5, 6, 7], [5, 6]) == [5, 6, 7]  # all accepted + bonus
    assert accept_draft([5, 9, 7], [5, 6]) == [5, 9]  # rejected at the second: correction
    assert accept_draft([4], []) == [4]  # no draft: a plain decode step


def test_ngram_drafter_copies_spans_of_the_prompt(tokenizer):
    ids = tokenizer.encode(f"{SOURCE} Email: maria.gonzalez@", add_special_tokens=False)
    after = ids.index(ids[-1]) + 1  # just after the first "@": the span to copy
    req = Request(ids, SamplingParams())
    drafter = NgramDrafter(n_min=1, n_max=4)
    draft = drafter.propose(req, 4)
    assert draft == ids[after : after + 4]
    assert tokenizer.decode(draft).startswith("example")
    req.append(draft[:2])  # the index follows the growing output
    assert drafter.propose(req, 2) == draft[2:4]
    req.truncate(len(ids))  # and a rollback
    assert drafter.propose(req, 4) == draft
    drafter.release(req)
    assert not drafter.indexes


def test_ngram_index_never_trusts_entries_made_stale_by_a_cut():
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 5, 6, 8]
    index.update(tokens)
    assert list(index.continuations(tokens, [5, 6], 2)) == [[8], [7, 5]]  # latest first, no repeats
    tokens = [5, 6, 7, 5, 9, 6]  # cut back to 4 tokens and regrown differently
    index.update(tokens[:4])
    index.update(tokens)
    assert list(index.continuations(tokens, [5, 6], 2)) == [[7, 5]]  # (5, 6) -> 8 no longer holds
    lazy = index.continuations(tokens, [5], 2)
    assert next(lazy) == [9, 6]  # a generator: later candidates are never computed


def reference_continuations(tokens: list[int], classes: list[int] | None, n_min: int, n_max: int,
                            k: int, max_scan: int) -> list[list[int]]:
    """What an n-gram index must yield: a plain search of `tokens` for the suffixes of
    `tokens`, longest first, latest occurrence first, at most `max_scan` each."""
    cls = (lambda t: t) if classes is None else (lambda t: classes[t] if t < len(classes) else t)
    ids = [cls(t) for t in tokens]
    found: list[list[int]] = []
    for n in range(min(n_max, len(ids)), n_min - 1, -1):
        hits = [p for p in range(n, len(ids)) if ids[p - n : p] == ids[len(ids) - n :]]
        for p in reversed(hits[-max_scan:]):
            if tokens[p : p + k] not in found:
                found.append(tokens[p : p + k])
    return found


def test_ngram_index_equals_a_plain_search_through_growth_and_rollbacks():
    """Random token lists (small vocabularies, so n-grams repeat; ids whose bytes overlap
    across token boundaries, e.g. 0 and 256; ids past the class table), grown, cut back and
    regrown between updates: every lookup yields what a plain search of the list finds."""
    rng = random.Random(7)
    classes = [t // 2 for t in range(300)]  # pairs of ids share a class
    for vocab, table in ((6, None), (40, classes), (600, classes)):
        index = NgramIndex(1, 4, table, max_scan=8)
        tokens: list[int] = []
        for _ in range(200):
            if tokens and rng.random() < 0.2:
                del tokens[len(tokens) - rng.randint(1, min(8, len(tokens))) :]  # a rollback
            tokens += [rng.choice((0, 256, 1, 65536, rng.randrange(vocab))) for _ in range(rng.randint(1, 30))]
            index.update(tokens)
            assert list(index.continuations(tokens, tokens, 3)) == reference_continuations(tokens, table, 1, 4, 3, 8)


def test_ngram_matches_across_a_dropped_leading_space(tokenizer):
    """Prose has ` Office` (with a space), the JSON string starts `"Office`: exact ids do not
    match, space classes do, and the continuation is the prose's own tokens."""
    prompt = tokenizer.encode("The ssid is OfficeNetSecure. Answer:", add_special_tokens=False)
    req = Request(prompt, SamplingParams())
    req.append(tokenizer.encode('{"ssid": "Office', add_special_tokens=False))
    assert tokenizer.decode(NgramDrafter(n_min=1, n_max=3).propose(req, 2)) != "NetSec"
    drafter = NgramDrafter(n_min=1, n_max=3)
    drafter.use_tokenizer(tokenizer)
    assert tokenizer.decode(drafter.propose(req, 3)) == "NetSecure"


def test_ngram_shared_pool_drafts_from_finished_outputs(tokenizer):
    done = Request([1, 2, 3], SamplingParams())
    done.append(tokenizer.encode('{"status": "shipped", "carrier": "DHL"}', add_special_tokens=False))
    done.finish("stop")
    fresh = Request(tokenizer.encode('Order 7: {"status": "', add_special_tokens=False), SamplingParams())
    assert NgramDrafter(n_min=2, n_max=4).propose(fresh, 2) == []  # nothing to copy from alone
    drafter = NgramDrafter(n_min=2, n_max=4, shared=True)
    drafter.release(done)  # a finished request's output joins the pool
    text = tokenizer.decode(drafter.propose(fresh, 2))
    assert text and ("shipped".startswith(text) or text.startswith("shipped"))


def test_mean_acceptance_length_counts_tokens_per_verify_step():
    assert GenerationStats().mean_acceptance_length == 1.0
    s = GenerationStats(drafted_tokens=9, accepted_tokens=6, verify_steps=4)
    assert s.mean_acceptance_length == 2.5
    assert s.as_dict()["mean_acceptance_length"] == 2.5


def test_bad_speculative_config_names_the_field():
    with pytest.raises(InvalidParameterError, match="num_draft_tokens"):
        SpeculativeConfig(num_draft_tokens=0)
    with pytest.raises(InvalidParameterError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(InvalidParameterError, match="draft_model"):
        SpeculativeConfig(method="draft_model")
    assert replace(SpeculativeConfig(), num_draft_tokens=5).num_draft_tokens == 5


def test_greedy_reasoning_output_is_unchanged(llm):
    """A thinking request's draft tokens go in until its closing tag; the grammar takes the
    rest (engine/reasoning.py), so speculation keeps the thinking and the answer."""
    prompt = ("Think inside <think></think> tags first, repeat the question twice. "
              "Which city is the capital of France? Answer as JSON.")
    kw = {"max_tokens": 80, "reasoning": True, "max_reasoning_tokens": 40}
    base = complete(llm, None, JsonSchema(SCHEMA), prompt, **kw)
    spec = complete(llm, SpeculativeConfig(num_draft_tokens=3), JsonSchema(SCHEMA), prompt, fixed=True, **kw)
    assert base.reasoning and spec.stats.accepted_tokens > 0
    assert (spec.reasoning, spec.text) == (base.reasoning, base.text)


def test_a_speculator_set_on_a_built_engine_reserves_the_pages_its_drafts_write(llm, monkeypatch):
    """Every row of a verify step lies in a page its request holds before the forward: a
    speculator set on an engine built without SpeculativeConfig (as benchmarks and these
    tests do) makes the scheduler reserve its drafts' positions. It reserved two, and on the
    GPU a draft past them wrote its K/V to the scratch page and read it back."""
    from structgen.engine.speculative.verify_rows import token_rows

    pages, unmapped = llm.engine.runner.kv.pages, []
    real = Speculator._forward_and_sample

    def checked(self, batch, drafts, spans, take):
        rows, _ = token_rows(batch, drafts, spans)
        slots, positions = np.array([r.slot for r in rows]), np.array([r.start for r in rows])
        if not pages.maps(slots, positions):
            unmapped.append(positions.max())
        return real(self, batch, drafts, spans, take)

    monkeypatch.setattr(Speculator, "_forward_and_sample", checked)
    out = complete(llm, SpeculativeConfig(num_draft_tokens=6), JsonSchema(SCHEMA), PROMPT, fixed=True, max_tokens=96)
    assert out.stats.verify_steps > 5 and unmapped == []


def test_a_verify_steps_run_of_tokens_goes_in_as_it_would_token_by_token(llm):
    """emit.py appends a run's plain tokens at once and hands the others to the engine's
    `_advance`: from every position of a real schema's output (and of a choice's, which is
    complete with nothing but a stop token left), every run of 1 to 4 tokens (with and without
    jump-forward; ending at the budget; crossing a budget check; the stop token and a token
    after it; a token the grammar rejects) leaves the request and its matcher as advancing
    it token by token does."""
    from structgen.engine.speculative.emit import emit
    from structgen.grammar import dump_json

    engine, stop = llm.engine, min(llm.engine.stop_token_ids)
    person = {"name": "Maria Gonzalez", "age": 34, "city": "Barcelona", "email": "maria@example.com"}
    outputs = [(llm.compile(JsonSchema(SCHEMA)), dump_json(person, SCHEMA), "}"),
               (llm.compile(Choice(["red", "blue", "cyan"])), "cyan", "z")]
    prompt = llm.encode_prompt(PROMPT)
    mask = allocate_bitmask(1, engine.vocab_size, host_only=True)

    def request(grammar, ids: list[int], start: int, max_tokens: int, jump: bool, close_at: int | None) -> Request:
        req = Request(prompt, SamplingParams(max_tokens=max_tokens), grammar.matcher(), frozenset(engine.stop_token_ids))
        for tok in ids[:start]:
            engine._advance(req, tok, jump_forward=False)
        req.jump_forward = jump
        if close_at is not None:
            req.close_at = close_at
        return req

    def state(req: Request, raised: BaseException | None) -> tuple:
        m = req.matcher
        m.fill_bitmask(mask, 0)
        return (list(req.token_ids), req.finish_reason, req.close_at, req.guess, req.stats.output_tokens,
                req.stats.forced_tokens, m.is_terminated(), mask.clone(), type(raised))

    def advance(req: Request, run: list[int], merged: bool) -> tuple:
        try:
            if merged:
                emit(engine, req, run)
            else:
                for j, tok in enumerate(run):
                    engine._advance(req, tok, jump_forward=j == len(run) - 1)
                    if req.finished:
                        break
        except Exception as exc:
            return state(req, exc)
        return state(req, None)

    cases = 0
    for grammar, text, bad in outputs:
        ids = llm.tokenizer.encode(text, add_special_tokens=False) + [stop]
        rejected = llm.tokenizer.encode(bad, add_special_tokens=False)[0]  # not what the grammar takes there
        runs = [(s, ids[s : s + n]) for s in range(len(ids)) for n in range(1, 5) if s + n <= len(ids)]
        runs += [(len(ids) - 2, ids[-2:] + [ids[0]]), (0, ids[:1] + [rejected])]
        for start, run in runs:
            for jump in (False, True):
                for budget, close_at in ((200, None), (start + len(run), None), (200, start + 2)):
                    if budget - start < len(run) or (close_at is not None and close_at > start + len(run)):
                        continue
                    want = advance(request(grammar, ids, start, budget, jump, close_at), run, merged=False)
                    got = advance(request(grammar, ids, start, budget, jump, close_at), run, merged=True)
                    assert got[:-2] == want[:-2] and torch.equal(got[-2], want[-2]) and got[-1] is want[-1], (
                        text, start, run, jump, budget)
                    cases += 1
    assert cases > 200
