"""What an LLM leaves behind, on the real default model (CPU): closed (`close()` or `with`), it
keeps no thread or file descriptor, so a process that creates many holds no more than after
its first; dropped unclosed, it is freed at once and its engine thread ends; closed, it refuses
work with an error that says so, and its compiles in flight end."""

from __future__ import annotations

import asyncio
import gc
import os
import weakref
from typing import TypedDict

import pytest
from pydantic import BaseModel

import structgen
from structgen.errors import RequestCancelledError, StructgenError
from tests.dropped_llms import settle_dropped_llms

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONFIG = {"max_batch_size": 2, "max_seq_len": 256}
PROMPT = "Give an item as JSON."
# Threads or descriptors a process-wide library pool (torch's, the tokenizers') may start
# late: a fixed allowance, where a leak grows with every LLM.
SLACK = 2


class Item(BaseModel):
    name: str
    count: int


class Point(TypedDict):
    x: int
    y: int


def _threads() -> int:
    """The process's OS threads, native pools' included (which `threading` does not see)."""
    return len(os.listdir("/proc/self/task"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _use(llm: structgen.LLM) -> None:
    """A sync request, and an async one whose new grammar compiles on the compiler's pool."""
    llm.generate(Item, PROMPT, max_tokens=24)
    asyncio.run(llm.agenerate(Point, PROMPT, max_tokens=24))


def test_closed_llms_leave_no_threads_or_file_descriptors_behind():
    kept = []  # closed LLMs still referenced (a notebook's history, a suite's fixtures)
    with structgen.LLM(config=CONFIG) as llm:  # the process-wide pools start here
        _use(llm)
    kept.append(llm)
    threads, fds = _threads(), _fds()
    for i in range(5):
        if i % 2:
            with structgen.LLM(config=CONFIG) as llm:
                _use(llm)
        else:
            llm = structgen.LLM(config=CONFIG)
            _use(llm)
            llm.close()
        kept.append(llm)
        assert _threads() <= threads + SLACK, f"after {i + 1} more LLMs closed"
        assert _fds() <= fds + SLACK, f"after {i + 1} more LLMs closed"


def test_a_dropped_llm_is_freed_at_once_and_its_engine_thread_ends():
    llm = structgen.LLM(config=CONFIG)
    _use(llm)
    thread, engine = llm.loop._thread, weakref.ref(llm.engine)
    assert thread is not None and thread.is_alive()
    gc.disable()  # freed by reference counting alone: no cycle waits for the collector
    try:
        del llm
        thread.join(10)
    finally:
        gc.enable()
    assert not thread.is_alive()
    gc.collect()
    assert engine() is None


def test_a_closed_llm_refuses_work_and_closes_again_harmlessly():
    llm = structgen.LLM(config=CONFIG)
    llm.close()
    llm.close()
    with llm:
        pass
    with pytest.raises(StructgenError, match="closed"):
        llm.generate(Item, PROMPT, max_tokens=24)
    with pytest.raises(StructgenError, match="closed"):
        asyncio.run(llm.agenerate(Item, PROMPT, max_tokens=24))
    with pytest.raises(StructgenError, match="closed"):
        llm.grammars.submit(Point)


def test_closing_ends_the_compiles_in_flight():
    llm = structgen.LLM(config=CONFIG)
    futures = [llm.grammars.submit({"type": "object", "properties": {f"field{i}": {"type": "integer"}}})
               for i in range(20)]
    llm.close()
    assert all(f.done() for f in futures)  # no caller is left waiting
    assert any(isinstance(f.exception(), RequestCancelledError) for f in futures)


def test_the_grammar_pool_is_not_resized_under_another_llm(caplog):
    # A resize frees the process-wide pool while another LLM's steps may be filling on it.
    from structgen.grammar import native

    pool = native.load()
    if pool is None:
        pytest.skip("the native grammar pool does not build on this host")
    settle_dropped_llms()  # dropped LLMs release the pool as their engines close
    shared = native.pool_has_users()  # an LLM of this test session still alive: never resized here
    before = pool.threads
    with structgen.LLM(config={**CONFIG, "tuning": {"grammar_threads": before + 1}}) as first:
        size = pool.threads
        assert size == (before if shared else before + 1)
        with caplog.at_level("WARNING", logger="structgen.grammar"), \
                structgen.LLM(config={**CONFIG, "tuning": {"grammar_threads": size + 1}}) as second:
            assert pool.threads == size and f"keeps its {size} threads while another LLM" in caplog.text
            assert isinstance(second.generate(Item, PROMPT, max_tokens=24), Item)
        _use(first)
    if not shared:  # alone now: resized
        with structgen.LLM(config={**CONFIG, "tuning": {"grammar_threads": size + 1}}):
            assert pool.threads == size + 1


def test_a_closed_llm_still_referenced_holds_no_model_memory():
    # A notebook's output history keeps a closed LLM alive: its weights and KV cache must not be.
    llm = structgen.LLM(config=CONFIG)
    _use(llm)
    weight = weakref.ref(next(llm.engine.runner.model.parameters()))
    kv = weakref.ref(llm.engine.runner.kv)
    llm.close()
    gc.collect()
    assert weight() is None and kv() is None
    llm.close()  # again: harmless
