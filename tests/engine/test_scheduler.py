"""Fair admission: one group's fan-out of many generations shares free KV slots with another
group's single request instead of queueing it behind all of them. Real default model on CPU,
real tokenizer, a batch of two so admission order decides who waits."""

from __future__ import annotations

import pytest
import torch

from structgen.engine.config import EngineConfig
from structgen.engine.engine import Engine
from structgen.engine.models.loader import load_model_config
from structgen.engine.request import Request, request_client, request_group
from structgen.sampling import SamplingParams

FAN_OUT = 10


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    cfg = load_model_config(model_dir)
    ec = EngineConfig(device="cpu", max_batch_size=2, max_seq_len=256, jump_forward=False)
    return Engine(cfg, ec, model_dir)


def finish_steps(engine: Engine, requests: list[Request]) -> dict[int, int]:
    """Request id -> the engine step it finished in."""
    for r in requests:
        engine.add_request(r)
    steps: dict[int, int] = {}
    step = 0
    while engine.has_work():
        step += 1
        steps.update({r.id: step for r in engine.step() if r.finished})
    return steps


@pytest.mark.parametrize(("crowd_group", "crowd_client", "single_group", "single_client"), [
    ("fan-out", None, "single", None),  # one request's fan-out of generations, in process
    ("http-{i}", "10.0.0.1", "http-single", "10.0.0.2"),  # one client's flood of HTTP requests
    ("fan-out", "10.0.0.1", "single", "10.0.0.1"),  # a fan-out and a single request of one client
], ids=["groups", "clients", "groups-of-one-client"])  # fmt: skip
def test_a_single_request_is_not_starved_by_a_crowd(engine: Engine, tokenizer, crowd_group: str,
                                                     crowd_client: str | None, single_group: str,
                                                     single_client: str | None) -> None:
    """Two slots: the single request takes the first slot that frees up, so it finishes with
    the second pair of the crowd's generations (first come, first served: after all ten).
    Fairness between groups alone would queue another client's request behind a flood."""
    prompt = tokenizer.encode("Count to ten:", add_special_tokens=False)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    crowd = [Request(prompt, params, group=crowd_group.format(i=i), client=crowd_client) for i in range(FAN_OUT)]
    single = Request(prompt, params, group=single_group, client=single_client)
    steps = finish_steps(engine, [*crowd, single])
    assert len(steps) == FAN_OUT + 1
    crowd_ends = sorted(steps[r.id] for r in crowd)
    assert steps[single.id] <= crowd_ends[3] < crowd_ends[-1]


def test_requests_without_a_group_are_first_come_first_served(engine: Engine, tokenizer) -> None:
    prompt = tokenizer.encode("Count to ten:", add_special_tokens=False)
    requests = [Request(prompt, SamplingParams(max_tokens=4, temperature=0.0)) for _ in range(5)]
    assert {r.group for r in requests} == {None}
    steps = finish_steps(engine, requests)
    in_order = [steps[r.id] for r in requests]
    assert in_order == sorted(in_order) and in_order[0] < in_order[-1]


def test_the_group_comes_from_the_context_when_not_passed() -> None:
    token = request_group.set("http-1")
    try:
        assert Request([1, 2], SamplingParams()).group == "http-1"
        assert Request([1, 2], SamplingParams(), group="explicit").group == "explicit"
    finally:
        request_group.reset(token)
    assert Request([1, 2], SamplingParams()).group is None
    token = request_client.set("10.0.0.1")
    try:
        assert Request([1, 2], SamplingParams()).client == "10.0.0.1"
    finally:
        request_client.reset(token)
    assert Request([1, 2], SamplingParams()).client is None


def prefilled(count: int):
    """A scheduler of 8 slots, 8 tokens a step, and `count` requests whose prompts have run."""
    from structgen.engine.page_table import PageTable
    from structgen.engine.scheduler import Scheduler

    sched = Scheduler(PageTable(64, 4, 8, 64, torch.device("cpu")), max_batch_size=8, chunk_tokens=8)
    decoders = [Request([1, 2, 3], SamplingParams(max_tokens=20)) for _ in range(count)]
    for r in decoders:
        sched.add(r)
    while any(r.num_cached < r.num_prompt for r in decoders):  # their prompts
        for r, n in sched.schedule():
            r.num_cached += n
    return sched, decoders


def test_prompts_keep_a_share_of_the_step_while_decode_rows_take_turns() -> None:
    from structgen.engine.scheduler import PROMPT_SHARE

    sched, decoders = prefilled(6)
    for r in decoders:
        r.append([5])  # each sampled its first token: one decode row a step from here
    prompt = Request(list(range(10, 30)), SamplingParams(max_tokens=4))
    sched.add(prompt)
    ran: list[set[int]] = []
    for _ in range(3):
        batch = sched.schedule()
        decode_rows = [r for r, _ in batch if r is not prompt]
        prompt_tokens = sum(n for r, n in batch if r is prompt)
        assert len(decode_rows) == 8 - int(8 * PROMPT_SHARE) and prompt_tokens == int(8 * PROMPT_SHARE)
        ran.append({r.id for r in decode_rows})
        for r, n in batch:
            r.num_cached += n
            if r is not prompt:
                r.append([5])
    assert ran[0] | ran[1] == {r.id for r in decoders}  # every decode row ran within two steps


def test_a_request_decodes_after_the_prompts_that_were_waiting_before_its_first_token() -> None:
    """A burst's early requests yield the step to the burst's prompts (their time to first
    token), but only to prompts that arrived before their own first token: a prompt that
    arrives later gets the share of the step decode rows leave it, so no stream of new
    prompts can stall a decoding request for longer than the older prompts take."""
    from structgen.engine.scheduler import PROMPT_SHARE

    sched, decoders = prefilled(4)
    older = Request(list(range(10, 34)), SamplingParams(max_tokens=4))  # of the burst: 24 tokens, 3 steps
    for r in decoders:
        r.append([5])  # their first tokens, after `older` arrived
    newer = Request(list(range(40, 64)), SamplingParams(max_tokens=4))
    sched.add(older)
    sched.add(newer)
    steps = []
    for _ in range(9):
        batch = sched.schedule()
        steps.append(([n for r, n in batch if r is older], [n for r, n in batch if r is newer],
                      sum(r in decoders for r, _ in batch)))
        for r, n in batch:
            r.num_cached += n
            if r.num_cached >= r.num_prompt:
                r.append([5])
    assert [d for _, _, d in steps[:3]] == [0, 0, 0]  # while `older` prefills, the decoders yield
    assert sum(sum(o) for o, _, _ in steps[:3]) == older.num_prompt
    shared = 8 - int(8 * PROMPT_SHARE)
    assert [d for _, n, d in steps[3:] if n] == [shared] * len([n for _, n, _ in steps[3:] if n])
    assert sum(sum(n) for _, n, _ in steps) == newer.num_prompt  # ... then share the step with `newer`


def test_a_preempted_request_recomputing_its_tokens_holds_no_decoder_up() -> None:
    """Only prompts still waiting for their first token take the step from decoding requests:
    a request preempted after its first token (memory pressure) recomputes beside them, so
    repeated preemptions cannot stall every request that decodes."""
    sched, decoders = prefilled(3)
    old = Request(list(range(10, 20)), SamplingParams(max_tokens=4))  # 10 tokens: 2 full pages of 4
    sched.add(old)
    while old.num_cached < old.num_prompt:
        for r, n in sched.schedule():
            r.num_cached += n
    for r in [old, *decoders]:
        r.append([5])  # first tokens, the decoders' after `old` arrived
    sched.preempt(old)
    batch = sched.schedule()
    assert old in [r for r, _ in batch] and old.num_cached < old.num_prompt  # recomputing what no page kept
    assert sum(r in decoders for r, _ in batch) == len(decoders)


def test_a_burst_whose_decoders_yield_to_its_prompts_gives_each_request_its_output_alone(
        model_dir, tokenizer, grammar_compiler) -> None:
    """Real model, real grammar, greedy: a burst of JSON requests whose prompts take several
    steps (small prefill chunks), so the first to decode yield to the others' prompts, gives
    every request the output it gets running alone."""
    from structgen.engine.models.loader import load_model_config
    from structgen.types import JsonSchema, to_constraint

    grammar = grammar_compiler.compile(to_constraint(JsonSchema(
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
         "required": ["name", "age"]})))
    engine = Engine(load_model_config(model_dir), EngineConfig(device="cpu", max_batch_size=4, max_seq_len=256,
                                                               prefill_chunk_tokens=24), model_dir)
    stop = frozenset({tokenizer.eos_token_id})
    prompts = [tokenizer.encode(f"{who} is {age} years old. As JSON:", add_special_tokens=False)
               for who, age in (("Ada", 36), ("Grace Hopper", 85), ("Alan", 41), ("Edsger Dijkstra", 72))]

    def new(prompt: list[int]) -> Request:
        return Request(list(prompt), SamplingParams(max_tokens=24, temperature=0.0), grammar.matcher(), stop)

    burst = [new(p) for p in prompts]
    yielded = []
    schedule = engine.scheduler.schedule

    def watched(token_budget=None):
        batch = schedule(token_budget)
        ran = {r.id for r, _ in batch}
        yielded.append(any(r.num_cached >= r.num_prompt and r.id not in ran for r in engine.scheduler.running))
        return batch

    engine.scheduler.schedule = watched
    engine.run(burst)
    engine.scheduler.schedule = schedule
    assert any(yielded)  # some request decoded only after the others' prompts
    alone = [engine.run([new(p)])[0] for p in prompts]
    assert [r.output_ids for r in burst] == [r.output_ids for r in alone]
    assert all(r.finish_reason == "stop" for r in burst)


def test_decode_rows_with_forced_tokens_stay_within_the_step_budget_and_take_turns() -> None:
    """The step budget is the largest decode graph: a step of more rows would run eagerly, so
    requests whose forced tokens would overflow it run first in the next step."""
    from structgen.engine.page_table import PageTable
    from structgen.engine.scheduler import Scheduler

    pages = PageTable(128, 4, 8, 64, torch.device("cpu"))
    sched = Scheduler(pages, max_batch_size=8, chunk_tokens=64)
    decoders = [Request([1, 2, 3], SamplingParams(max_tokens=20)) for _ in range(8)]
    for r in decoders:
        sched.add(r)
    for r, n in sched.schedule(token_budget=64):  # their prompts, in one step
        r.num_cached += n
    for i, r in enumerate(decoders):
        r.append([5] if i % 2 else [5, 6, 7])  # four of them with two forced tokens after the sampled one
    ran: list[set[int]] = []
    for _ in range(3):
        batch = sched.schedule(token_budget=8)
        assert sum(n for _, n in batch) <= 8 and batch
        ran.append({r.id for r, _ in batch})
        for r, n in batch:
            r.num_cached += n
            r.append([5])
    assert ran[0] | ran[1] == {r.id for r in decoders}  # every request ran within two steps
    assert len(sched.schedule()) == 8  # without a budget: every request, forced tokens and all


def _page_state(sched, index: dict[int, int]) -> tuple:
    """What a fit can change: each running request's (by its `index`) slot and cached tokens,
    who waits, every slot's pages and keyed pages, the free pages and the host table."""
    pages = sched.pages
    return ([(index[r.id], r.slot, r.num_cached) for r in sched.running], [index[r.id] for r in sched.waiting],
            [pages.slot_pages(s) for s in range(pages.num_slots + 1)], [list(k) for k in pages._keyed], sorted(pages._free_pages),
            list(pages.settled), pages.free_pages, pages.host.tolist())


def run_burst(sched, prompts: list[list[int]], tokenizer, steps: int = 60, refit_always: bool = False) -> list:
    """Each step's batch and page state of a burst of `prompts` (12 output tokens each) under
    a token budget of 12, with a forward that maps pages ahead of the newest waiting prompt
    (as the decode graphs do); `refit_always`: `_fit_running`'s shortcut memory cleared before
    every step."""
    reqs = [Request(list(p), SamplingParams(max_tokens=12)) for p in prompts]
    index = {r.id: i for i, r in enumerate(reqs)}
    for r in reqs:
        sched.add(r)
    states = []
    for _ in range(steps):
        if refit_always:
            sched._fitted.clear()  # the shortcut's memory gone: every request is fitted again
        batch = sched.schedule(token_budget=12)
        states.append(([(index[r.id], n) for r, n in batch], _page_state(sched, index)))
        for r, n in batch:
            r.num_cached += n
            if r.num_cached >= r.num_prompt:
                r.append([tokenizer.encode(" x", add_special_tokens=False)[0]])
                if r.num_output >= r.params.max_tokens:
                    r.finish("length")
                    sched.remove(r)
        ran = {r.id for r, _ in batch}
        waiting = [r for r in sched.running if r.num_cached < r.num_prompt and r.id not in ran]
        if waiting:  # a forward mapping positions ahead of the newest waiting prompt
            sched.pages.cover(waiting[-1].slot, len(waiting[-1].token_ids) + 8)
    return states


def test_prompts_waiting_for_their_turn_are_fitted_as_if_fitted_anew_every_step(tokenizer) -> None:
    """`_fit_running` skips a prompt whose cached tokens, length and pages are as it left them:
    a burst of real prompts sharing their start (published pages, a waiting request's prompt
    in flight), a token budget that leaves most prompts waiting for steps, a forward that maps
    pages ahead of a waiting prompt (as the decode graphs do) and a pool small enough to
    preempt give every step the same batch and page table as a scheduler that refits every
    request every step."""
    from structgen.engine.page_table import PageTable
    from structgen.engine.scheduler import Scheduler

    system = "You are a careful assistant that answers with one JSON object describing the person. "
    prompts = [tokenizer.encode(system + f"Person number {i} lives in city {i * 7}.", add_special_tokens=False)
               for i in range(12)]
    runs = [run_burst(Scheduler(PageTable(48, 4, 12, 128, torch.device("cpu")), max_batch_size=12, chunk_tokens=64),
                      prompts, tokenizer, refit_always=refit_always) for refit_always in (False, True)]
    assert sum(1 for batch, _ in runs[0] if batch) > 20  # the burst ran through many steps
    assert runs[0] == runs[1]


def test_admission_waits_for_a_shared_prompt_start_in_flight_as_comparing_every_running_prompt_does(tokenizer) -> None:
    """`PrefillingPrefixes` looks a waiting prompt's next pages up among the prompts being
    prefilled: a burst of real prompts that share starts of 0 to 5 pages with each other
    (some in flight, some published, slots and pages short enough to admit over many steps)
    gets every step the batch and page table it gets from comparing the waiting prompt with
    every running prompt page by page."""
    from structgen.engine.page_table import PageTable
    from structgen.engine.scheduler import MIN_SHARED_PAGES, Scheduler

    class EveryRunningPrompt(Scheduler):
        def _prefix_in_flight(self, req, cached, in_flight) -> bool:
            size, prompt = self.pages.page_size, req.token_ids
            for other in self.running:
                if other.num_cached >= other.num_prompt:
                    continue
                theirs, shared, end = other.token_ids, cached, min(req.num_prompt, other.num_prompt)
                while shared + size <= end and prompt[shared : shared + size] == theirs[shared : shared + size]:
                    shared += size
                if shared - cached >= MIN_SHARED_PAGES * size:
                    return True
            return False

    starts = ["You are a careful assistant. Answer with JSON. ", "You are a careful assistant. ", "Hello. ",
              "You are a careful assistant. Answer with JSON. Be brief and exact in every field. "]
    prompts = [tokenizer.encode(starts[i % 4] + f"Person {i} lives in city {i * 7}.", add_special_tokens=False)
               for i in range(16)]
    waited = []

    class Counted(Scheduler):
        def _prefix_in_flight(self, req, cached, in_flight) -> bool:
            waited.append(super()._prefix_in_flight(req, cached, in_flight))
            return waited[-1]

    runs = [run_burst(cls(PageTable(64, 4, 6, 128, torch.device("cpu")), max_batch_size=6, chunk_tokens=64),
                      prompts, tokenizer, steps=90) for cls in (Counted, EveryRunningPrompt)]
    assert runs[0] == runs[1]
    assert any(waited) and not all(waited)  # prompts waited for a start in flight, and were admitted
    assert not runs[0][-1][1][0]  # every request ran to its end
