"""The model runner against the transformers reference, and the engine's request handling,
on the real default model (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from structgen.engine.config import EngineConfig
from structgen.engine.engine import Engine
from structgen.engine.models.loader import load_model_config
from structgen.engine.request import Request
from structgen.errors import InvalidParameterError, PromptTooLongError
from structgen.sampling import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    cfg = load_model_config(model_dir)
    return Engine(cfg, EngineConfig(device="cpu", max_batch_size=4, max_seq_len=1024, prefill_chunk_tokens=16), model_dir)


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    reqs = [Request(p, SamplingParams(max_tokens=n)) for p in prompts]
    engine.run(reqs)
    return [r.output_ids for r in reqs]


def test_greedy_tokens_equal_transformers(engine, model_dir, tokenizer):
    """Our runner (fused projections, slot cache, chunked prefill, weights kept quantized on
    the CPU) must produce exactly the reference model's greedy tokens for the same weights
    (transformers', de-quantized to float32) and prompt."""
    from structgen.engine.models.loader import load_transformers_model

    ref = load_transformers_model(model_dir, torch.float32)
    ids = chat_ids(tokenizer, PROMPTS[2])
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    ours = greedy(engine, [ids], 40)[0]
    assert len(expected) == 40
    assert ours == expected


def test_batched_equals_single(engine, tokenizer):
    """Continuous batching + chunked prefill must not change any request's tokens."""
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    together = greedy(engine, prompts, 16)
    alone = [greedy(engine, [p], 16)[0] for p in prompts]
    assert together == alone
    assert engine.runner.kv.pages.free_slots == engine.runner.kv.num_slots  # every slot came back


def test_seeded_sampling_is_reproducible(engine, tokenizer):
    ids = chat_ids(tokenizer, PROMPTS[1])
    runs = []
    for _ in range(2):
        r = Request(ids, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=7))
        engine.run([r])
        runs.append(r.output_ids)
    assert runs[0] == runs[1]
    other = Request(ids, SamplingParams(max_tokens=12, temperature=0.9, seed=8))
    engine.run([other])
    assert other.output_ids != runs[0]


def test_prompt_too_long_is_rejected_before_running(engine):
    req = Request(list(range(1000)), SamplingParams(max_tokens=100))
    with pytest.raises(PromptTooLongError, match="exceeds the context of 1024"):
        engine.add_request(req)
    assert not engine.has_work()


def test_abort_frees_slot_and_spares_others(engine, tokenizer):
    a = Request(chat_ids(tokenizer, PROMPTS[0]), SamplingParams(max_tokens=12))
    b = Request(chat_ids(tokenizer, PROMPTS[1]), SamplingParams(max_tokens=12))
    engine.add_request(a)
    engine.add_request(b)
    engine.step()
    engine.abort(a)
    while not b.finished:
        engine.step()
    assert a.finish_reason == "abort" and b.finish_reason == "length"
    assert b.output_ids == greedy(engine, [chat_ids(tokenizer, PROMPTS[1])], 12)[0]
    assert engine.runner.kv.pages.free_slots == engine.runner.kv.num_slots


def test_a_request_without_progress_updates_is_told_only_of_its_finish(engine, tokenizer):
    """A caller that waits for the whole output (`progress_updates` False) hears from the engine
    once, finished; beside it a streaming request hears of every step, with the same tokens."""
    ids = chat_ids(tokenizer, PROMPTS[0])
    heard: dict[str, list[bool]] = {"whole": [], "stream": []}
    whole = Request(ids, SamplingParams(max_tokens=8), on_update=lambda r: heard["whole"].append(r.finished))
    whole.progress_updates = False
    stream = Request(ids, SamplingParams(max_tokens=8), on_update=lambda r: heard["stream"].append(r.finished))
    engine.run([whole, stream])
    assert heard["whole"] == [True]
    assert len(heard["stream"]) > 1 and heard["stream"][-1] and not any(heard["stream"][:-1])
    assert whole.output_ids == stream.output_ids and whole.finish_reason == stream.finish_reason == "length"


@pytest.mark.parametrize("kw", [{"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2}])
def test_bad_sampling_params_name_the_parameter(kw):
    with pytest.raises(InvalidParameterError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_the_heap_is_frozen_once_and_dropped_engines_are_still_collected(model_dir):
    """`freeze_heap` takes the import-time heap out of the cyclic collector (full collections
    had stalled the step loop 100+ ms) once per process, before the first engine: an engine
    built later and dropped, a reference cycle with its speculator included, is still freed."""
    import gc
    import weakref

    from structgen.engine.config import SpeculativeConfig

    cfg = load_model_config(model_dir)
    cfg.num_hidden_layers = 1  # a small engine: the weights do not matter here
    ec = EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64, speculative=SpeculativeConfig(method="ngram"))
    engine = Engine(cfg, ec)
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # torch, transformers, ... are out of the collector's sight
    assert engine.speculator.engine is engine  # a cycle: only the collector can free it
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None
    Engine(cfg, ec)  # a second engine does not freeze again
    assert gc.get_freeze_count() == frozen


def test_a_second_thread_gets_a_clear_error_while_the_engine_steps(engine, tokenizer):
    """While one thread is inside a step, another thread's step, add_request or abort is
    refused with an EngineError saying to use the LLM's methods (two threads in the grammar
    matchers at once used to corrupt native memory); the step in progress finishes, and the
    engine serves the other thread once it is free."""
    import threading

    from structgen.errors import EngineError

    inside, release = threading.Event(), threading.Event()
    schedule = engine.scheduler.schedule

    def held_schedule(token_budget=None):
        inside.set()
        release.wait(30)
        return schedule(token_budget=token_budget)

    first = Request(chat_ids(tokenizer, PROMPTS[0]), SamplingParams(max_tokens=4))
    engine.add_request(first)
    engine.scheduler.schedule = held_schedule
    stepping = threading.Thread(target=engine.step)
    try:
        stepping.start()
        assert inside.wait(30)
        other = Request(chat_ids(tokenizer, PROMPTS[1]), SamplingParams(max_tokens=4))
        for call in (engine.step, lambda: engine.add_request(other), lambda: engine.abort(first)):
            with pytest.raises(EngineError, match="another thread.*LLM's methods"):
                call()
        assert not first.finished and other not in engine.scheduler.waiting
    finally:
        release.set()
        stepping.join(30)
        del engine.scheduler.schedule
    assert first.num_cached > 0  # the held step ran its prompt
    engine.run([other])
    while not first.finished:
        engine.step()
    assert len(other.output_ids) == 4 and len(first.output_ids) == 4


def test_the_loop_thread_waits_for_a_direct_step_instead_of_failing(engine, tokenizer):
    """An LLM's loop thread that finds another thread inside the engine waits for it to
    leave, then serves its own requests: nothing fails on either side."""
    import threading

    from structgen.engine.loop import EngineLoop

    loop = EngineLoop(engine)
    try:
        mine = Request(chat_ids(tokenizer, PROMPTS[2]), SamplingParams(max_tokens=4))
        with engine.thread_guard.holding():  # this thread is "stepping" the engine
            future = loop.submit(Request(chat_ids(tokenizer, PROMPTS[0]), SamplingParams(max_tokens=4)))
            engine.add_request(mine)  # (the holder's own calls go through)
            assert not future.done()
            threading.Event().wait(0.2)  # the loop thread is waiting for the engine, not stepping
            assert mine.num_cached == 0 and not future.done()
        served = future.result(timeout=60)
        assert served.finish_reason in ("stop", "length") and served.error is None
        for _ in range(6000):  # the loop thread steps it too (at most a minute)
            if mine.finished:
                break
            threading.Event().wait(0.01)
        assert mine.finished and len(mine.output_ids) == 4
    finally:
        loop.close()
