"""The real default model on CUDA, end to end: constrained JSON through the decode graphs
(with and without jump-forward, one request and a batch) must finish with valid output and no
row errors, and greedy outputs must match the eager path's. Needs the model on the device
(scripts/device/README.md)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from structgen.engine.config import EngineConfig, EngineTuning
from structgen.engine.engine import Engine
from structgen.engine.kernels import use_batch_invariant
from structgen.engine.models.loader import load_model_config
from structgen.engine.request import Request
from structgen.grammar import GrammarCompiler
from structgen.sampling import SamplingParams
from structgen.types import CFG, JsonSchema, Regex, to_constraint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,  # closed: a 135M model may otherwise add keys until max_tokens
}
PEOPLE = [("Ana", 31, "Lisbon"), ("Bo", 45, "Oslo"), ("Chen", 27, "Lima"), ("Dara", 52, "Osaka"),
          ("Eli", 38, "Nairobi"), ("Fatima", 61, "Quito"), ("Gus", 19, "Perth"), ("Hana", 33, "Riga")]


@pytest.fixture(scope="module")
def setup(model_dir, tokenizer):
    cfg = load_model_config(model_dir)
    stop = set(cfg.eos_token_id) | {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    grammar = GrammarCompiler(tokenizer, cfg.vocab_size, sorted(stop)).compile(to_constraint(JsonSchema(SCHEMA)))
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Extract as JSON: {n} is {a} and lives in {c}; likes tea."}],
        tokenize=True, add_generation_prompt=True) for n, a, c in PEOPLE]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    return cfg, stop, grammar, prompts


def run(setup, model_dir, tokenizer, graphs: bool, jump_forward: bool, batch: int,
        prefill_in_graphs: bool = False) -> list[Request]:
    """Greedy JSON requests; prompts run eagerly unless `prefill_in_graphs` (so graphs vs
    eager compares decoding from the same prefill: bf16 kernels differ between the two prefill
    paths, and a 135M model's near-ties then send some greedy outputs elsewhere)."""
    cfg, stop, grammar, prompts = setup
    ec = EngineConfig(device="cuda", max_batch_size=16, max_seq_len=1024, use_cuda_graphs=graphs,
                      jump_forward=jump_forward,
                      tuning=EngineTuning(prefill_in_graphs=prefill_in_graphs))
    engine = Engine(cfg, ec, model_dir, stop_token_ids=stop)
    engine.use_tokenizer(tokenizer)
    reqs = [Request(p, SamplingParams(max_tokens=96), grammar.matcher(), frozenset(stop)) for p in prompts[:batch]]
    engine.run(reqs)
    return reqs


@pytest.mark.parametrize("jump_forward", [False, True])
@pytest.mark.parametrize("batch", [1, 8])
def test_constrained_json_through_graphs_is_valid_and_equals_eager(setup, model_dir, tokenizer, jump_forward, batch):
    got = {g: run(setup, model_dir, tokenizer, g, jump_forward, batch) for g in (True, False)}
    for g, reqs in got.items():
        for r in reqs:
            text = tokenizer.decode(r.output_ids)
            # Greedy, a 135M model can loop inside a free string ("Lasías-Lasías-..."; which
            # row does moves with bf16 rounding, e.g. the attention kernel): that ends at
            # max_tokens, a model property. Errors never pass, and what stops is valid.
            assert r.finish_reason in ("stop", "length"), (g, r.finish_reason, r.error, text)
            if r.finish_reason == "stop":
                jsonschema.validate(json.loads(text), SCHEMA)
        assert sum(r.finish_reason == "stop" for r in reqs) >= (batch + 1) // 2, [
            tokenizer.decode(r.output_ids) for r in reqs
        ]
    same = sum(a.output_ids == b.output_ids for a, b in zip(got[True], got[False], strict=True))
    assert same >= batch - 1, f"graphs vs eager: only {same} of {batch} outputs identical"  # bf16 near-ties aside


def test_prompts_in_graphs_give_valid_json(setup, model_dir, tokenizer):
    """The default engine: prompts through the decode graphs (`prefill_in_graphs`), jump-forward
    on, 8 requests at once. No errors, what stops is valid, and most outputs stop (greedy, a
    135M model may loop inside a free string until max_tokens; on 2026-11-25 the single
    request of the batch-1 graphs-vs-eager test did so with this prefill, not without)."""
    reqs = run(setup, model_dir, tokenizer, True, True, 8, prefill_in_graphs=True)
    assert all(r.finish_reason in ("stop", "length") for r in reqs), [(r.finish_reason, r.error) for r in reqs]
    for r in reqs:
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(tokenizer.decode(r.output_ids)), SCHEMA)
    assert sum(r.finish_reason == "stop" for r in reqs) >= 4, [tokenizer.decode(r.output_ids) for r in reqs]


def test_cancel_and_join_between_planned_steps_spare_the_other_rows(setup, model_dir, tokenizer):
    """With jump-forward, each decode step launches the next step's forward from the engine's
    own plan (cuda_graphs.py `plan_next`). A request cancelled or added between steps makes
    that plan wrong; the discarded forward only wrote K/V past each row's length, so the other
    rows finish valid and as they would have without the cancel and the join (bf16 near-ties
    aside), and every KV slot comes back."""
    cfg, stop, grammar, prompts = setup
    ec = EngineConfig(device="cuda", max_batch_size=16, max_seq_len=1024, jump_forward=True)
    engine = Engine(cfg, ec, model_dir, stop_token_ids=stop)
    engine.use_tokenizer(tokenizer)

    def make(i: int) -> Request:
        return Request(prompts[i], SamplingParams(max_tokens=96), grammar.matcher(), frozenset(stop))

    base = engine.run([make(i) for i in range(4)])
    used_before = engine.runner.graphs.steps_ahead
    reqs = [make(i) for i in range(4)]
    for r in reqs:
        engine.add_request(r)
    for _ in range(6):
        engine.step()
    engine.abort(reqs[1])
    late = make(4)
    engine.add_request(late)
    for _ in range(3):
        engine.step()
    engine.abort(reqs[3])
    while not all(r.finished for r in (*reqs, late)):
        engine.step()
    assert [reqs[1].finish_reason, reqs[3].finish_reason] == ["abort", "abort"]
    for r in (reqs[0], reqs[2], late):
        text = tokenizer.decode(r.output_ids)
        assert r.finish_reason in ("stop", "length"), (r.finish_reason, r.error, text)
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
    assert sum(reqs[i].output_ids == base[i].output_ids for i in (0, 2)) >= 1
    assert engine.runner.graphs.steps_ahead > used_before  # planned forwards were used
    assert engine.runner.kv.pages.free_slots == engine.runner.kv.num_slots


def batch1_engine(setup, model_dir, tokenizer) -> Engine:
    """A CUDA engine with jump-forward installed, for requests run one at a time. Without
    prefix caching: a prompt run again would prefill only its tail, a batch shape that may
    round differently in bf16 (outside the batch-invariant mode), and these tests compare
    runs of the same prompts."""
    cfg, stop, _, _ = setup
    ec = EngineConfig(device="cuda", max_batch_size=16, max_seq_len=1024, jump_forward=True, prefix_caching=False,
                      tuning=EngineTuning(prefill_in_graphs=False))
    engine = Engine(cfg, ec, model_dir, stop_token_ids=stop)
    engine.use_tokenizer(tokenizer)
    return engine


def batch1_outputs(engine: Engine, setup, tokenizer) -> list[list[int]]:
    """Four JSON requests run one after another (batch 1); each must be valid."""
    _, stop, grammar, prompts = setup
    reqs = [Request(p, SamplingParams(max_tokens=96), grammar.matcher(), frozenset(stop)) for p in prompts[:4]]
    for r in reqs:
        engine.run([r])
        assert r.finish_reason == "stop", r.error
        jsonschema.validate(json.loads(tokenizer.decode(r.output_ids, skip_special_tokens=True)), SCHEMA)
    return [r.output_ids for r in reqs]


def test_token_gate_runs_forwards_early_and_changes_no_output(setup, model_dir, tokenizer):
    """Jump-forward at batch 1 with the device-decided gate (the next forward runs at once after
    a quiet token inside a string) gives the outputs of the host-decided launch."""
    engine = batch1_engine(setup, model_dir, tokenizer)
    graphs = engine.runner.graphs
    assert graphs.token_gate is not None, "the CUDA extension must build on the GPU machine"
    outs = {}
    for gate in (True, False):
        graphs.use_token_gate = gate
        outs[gate] = batch1_outputs(engine, setup, tokenizer)
    assert outs[True] == outs[False]
    assert graphs.gate_runs > 20 and graphs.gate_wasted <= graphs.gate_runs // 4, (graphs.gate_runs, graphs.gate_wasted)


def test_rehearsed_jumps_change_no_output(setup, model_dir, tokenizer, monkeypatch):
    """Jump-forward at batch 1 with the jumps rehearsed while the device computes gives the
    outputs of the hook deciding after the device, and the hook did replay rehearsals (how
    many depends on the card: a rehearsal is replayed where the host finished it before the
    step's forward did; 8 or more on H100s, 3 on an H200)."""
    from structgen.engine.jump_forward import JumpForward

    engine = batch1_engine(setup, model_dir, tokenizer)
    replayed = []
    real = JumpForward._replay
    monkeypatch.setattr(JumpForward, "_replay", lambda self, req, plan: replayed.append(plan) or real(self, req, plan))
    outs = {}
    for rehearse in (True, False):
        engine.jump_forward_hook.rehearses = rehearse
        outs[rehearse] = batch1_outputs(engine, setup, tokenizer)
        if rehearse:
            jumps = sum(p is not None for p in replayed)
            assert jumps >= 1, f"{jumps} jumps replayed from rehearsals ({len(replayed)} replays)"
    assert outs[True] == outs[False]


def test_held_back_guesses_through_the_graphs_change_no_output(setup, model_dir, tokenizer):
    """Held-back tokens run as guesses (one more row of the decode graphs, sampled under the
    grammar's mask after it): at batch 1 and 8 the outputs equal those without guesses, the
    model picked guesses, and each one picked saved a pass. In the batch-invariant mode: a
    guess row moves a step to a larger bucket, whose kernels otherwise round a row differently
    (a 135M model's greedy near-ties in bf16 then part a few outputs, more or fewer as each
    process's timed GEMV shapes fall)."""
    cfg, stop, grammar, prompts = setup
    ec = EngineConfig(device="cuda", max_batch_size=16, max_seq_len=1024, jump_forward=True, prefix_caching=False,
                      batch_invariant=True, tuning=EngineTuning(prefill_in_graphs=False))
    engine = Engine(cfg, ec, model_dir, stop_token_ids=stop)
    engine.use_tokenizer(tokenizer)
    hook = engine.jump_forward_hook
    got = {}
    try:
        for guesses in (True, False):
            hook.guesses = guesses
            alone = [Request(p, SamplingParams(max_tokens=96), grammar.matcher(), frozenset(stop)) for p in prompts[:4]]
            for r in alone:
                engine.run([r])
            batch = [Request(p, SamplingParams(max_tokens=96), grammar.matcher(), frozenset(stop)) for p in prompts[:8]]
            engine.run(batch)
            got[guesses] = alone + batch
    finally:
        use_batch_invariant(False)
    on, off = got[True], got[False]
    assert all(r.finish_reason in ("stop", "length") for r in on), [(r.finish_reason, r.error) for r in on]
    assert [r.output_ids for r in on] == [r.output_ids for r in off]
    accepted = sum(a.stats.accepted_tokens for a in on)
    assert accepted >= 8, (accepted, sum(a.stats.drafted_tokens for a in on))
    assert sum(b.stats.forward_passes - a.stats.forward_passes for a, b in zip(on, off, strict=True)) == accepted


# Constraint kinds besides JSON, with a prompt each; every grammar forces text along the way.
KINDS = [
    (Regex(r"Order #[0-9]{3}, status: (shipped|pending|lost)\."), "Write the status line of order 123, which was shipped."),
    (CFG('root ::= "name=" [a-z]+ "; age=" [0-9]+ ";"'), "Write name and age of ana, 31, as name=...; age=...;"),
    (CFG('start: "name=" NAME "; age=" AGE ";"\nNAME: /[a-z]+/\nAGE: /[0-9]+/'), "Write name and age of bo, 45."),
]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_every_constraint_kind_jumps_through_the_graphs(setup, model_dir, tokenizer, backend):
    """Jump-forward on the GPU for a regex, an EBNF and a Lark grammar and a JSON schema, on
    each backend, at batch 1 through the decode graphs: every output is a complete match of its
    grammar with text forced into it, and the device-side shortcuts (the token gate, rehearsed
    jumps) change no output."""
    cfg, stop, _, prompts = setup
    engine = batch1_engine(setup, model_dir, tokenizer)
    compiler = GrammarCompiler(tokenizer, cfg.vocab_size, sorted(stop), backend=backend)

    def chat(text: str) -> list[int]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        return ids if isinstance(ids, list) else ids["input_ids"]

    cases = [(compiler.compile(to_constraint(c)), chat(p)) for c, p in KINDS]
    cases.append((compiler.compile(to_constraint(JsonSchema(SCHEMA))), prompts[0]))
    outs = {}
    for fast in (True, False):
        engine.jump_forward_hook.rehearses = engine.runner.graphs.use_token_gate = fast
        outs[fast] = []
        for grammar, prompt in cases:
            r = Request(prompt, SamplingParams(max_tokens=64), grammar.matcher(), frozenset(stop))
            engine.run([r])
            text = tokenizer.decode(r.output_ids, skip_special_tokens=True)
            assert r.finish_reason == "stop" and grammar.accepts(text), (backend, r.finish_reason, r.error, text)
            assert r.stats.forced_tokens > 0, (backend, text)
            outs[fast].append(r.output_ids)
    assert outs[True] == outs[False]
