"""Full garbage collections held off while an engine has work (engine/garbage_collection.py):
the oldest generation's threshold is raised during the work and restored after it, and the
cyclic garbage that reached the oldest generation meanwhile is collected once the engine is
idle (or every FULL_COLLECTION_EVERY_S of work), so a hold never leaks."""

from __future__ import annotations

import gc
import sys
import time
import weakref

import pytest

from structgen.engine import garbage_collection
from structgen.engine.config import EngineConfig, EngineTuning
from structgen.engine.engine import Engine
from structgen.engine.garbage_collection import HELD_THRESHOLD, FullCollectionHold
from structgen.engine.loop import EngineLoop
from structgen.engine.models.loader import load_model_config
from structgen.engine.request import Request
from structgen.sampling import SamplingParams

pytestmark = pytest.mark.skipif(sys.version_info >= (3, 14), reason="CPython 3.14 collects its old generation "
                                "incrementally: these checks are of 3.10-3.13's generations")


class Node:
    """A weakly referenceable object for cycles."""

    def __init__(self) -> None:
        self.other: Node | None = None


def cycle_in_oldest_generation() -> weakref.ref:
    """A reference cycle nobody refers to, moved into the oldest generation, with that
    generation's collection due (more young collections since the last full one than the
    threshold of 10 `default_thresholds` sets): only a full collection frees it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    gc.collect(1)  # reachable still: it survives into the oldest generation
    del a, b
    for _ in range(12):  # (held: never a full collection)
        gc.collect(1)
    return ref


@pytest.fixture
def default_thresholds():
    # An engine loop left by an earlier test may still hold the process-wide hold; its
    # release, landing mid-test, would restore the threshold this test's own hold raised.
    assert wait_for(lambda: not garbage_collection.FULL_COLLECTIONS.held), "an engine loop still holds full collections"
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def wait_for(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return False


def test_holds_nest_and_the_last_release_collects_what_the_hold_kept(default_thresholds) -> None:
    hold = FullCollectionHold()
    hold.acquire()
    hold.acquire()
    assert gc.get_threshold() == (700, 10, HELD_THRESHOLD)
    ref = cycle_in_oldest_generation()
    assert ref() is not None  # young collections do not reach it
    hold.release()
    assert gc.get_threshold()[2] == HELD_THRESHOLD and ref() is not None  # one holder left
    hold.release()
    assert gc.get_threshold() == (700, 10, 10)
    assert ref() is None
    hold.release()  # one release too many changes nothing
    assert gc.get_threshold() == (700, 10, 10) and not hold.held


def test_a_threshold_set_during_a_hold_stands_and_nothing_is_held_with_collection_off(default_thresholds) -> None:
    hold = FullCollectionHold()
    hold.acquire()
    gc.set_threshold(500, 5, 7)  # the application's own choice, while held
    hold.release()
    assert gc.get_threshold() == (500, 5, 7)
    gc.disable()
    try:
        hold.acquire()
        assert gc.get_threshold() == (500, 5, 7) and not hold.held
        hold.release()
    finally:
        gc.enable()


def test_work_without_a_pause_still_runs_a_full_collection_every_interval(default_thresholds, monkeypatch) -> None:
    hold = FullCollectionHold()
    hold.acquire()
    try:
        ref = cycle_in_oldest_generation()
        hold.at_step()  # within the interval: held
        assert ref() is not None
        monkeypatch.setattr(garbage_collection, "FULL_COLLECTION_EVERY_S", 0.0)
        hold.at_step()
        assert ref() is None
        assert gc.get_threshold()[2] == HELD_THRESHOLD  # and still held
    finally:
        hold.release()


@pytest.mark.parametrize("holds", [True, False])
def test_an_engine_loop_holds_full_collections_while_it_has_work(model_dir, default_thresholds, holds) -> None:
    """A real engine (one layer, CPU) through its loop: during its steps the oldest
    generation's threshold is held (with `hold_full_collections`), and a cycle that reached
    the oldest generation during the work is freed once the loop is idle."""
    cfg = load_model_config(model_dir)
    cfg.num_hidden_layers = 1
    ec = EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64,
                      tuning=EngineTuning(hold_full_collections=holds))
    loop = EngineLoop(Engine(cfg, ec))
    seen: list[int] = []
    refs: list[weakref.ref] = []

    def on_update(req: Request) -> None:
        seen.append(gc.get_threshold()[2])
        if not refs:
            refs.append(cycle_in_oldest_generation())

    try:
        req = Request([1, 2, 3, 4], SamplingParams(max_tokens=6, temperature=0.0), on_update=on_update)
        loop.submit(req).result(timeout=60)
        assert seen and set(seen) == ({HELD_THRESHOLD} if holds else {10})
        assert wait_for(lambda: gc.get_threshold() == (700, 10, 10))
        if holds:  # (without the hold, CPython's own rule decides when)
            assert wait_for(lambda: refs[0]() is None)
    finally:
        loop.close()


def test_a_request_soon_after_the_last_keeps_the_full_collection_held(model_dir, default_thresholds,
                                                                     monkeypatch) -> None:
    """Out of work, the loop lets the held full collection run only after a pause without
    requests (`IDLE_BEFORE_COLLECTION_S`): a request that comes sooner finds it still held, so
    back-to-back bursts do not wait for it; after the pause it runs."""
    from structgen.engine import loop as engine_loop

    monkeypatch.setattr(engine_loop, "IDLE_BEFORE_COLLECTION_S", 2.0)
    releases: list[float] = []
    release = FullCollectionHold.release
    monkeypatch.setattr(FullCollectionHold, "release", lambda self: (releases.append(time.monotonic()), release(self)))
    cfg = load_model_config(model_dir)
    cfg.num_hidden_layers = 1
    loop = EngineLoop(Engine(cfg, EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64)))
    try:
        for _ in range(2):
            loop.submit(Request([1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0.0))).result(timeout=60)
            assert releases == [] and gc.get_threshold()[2] == HELD_THRESHOLD
        done = time.monotonic()
        assert wait_for(lambda: releases != [])
        assert releases[0] - done > 1.0 and gc.get_threshold() == (700, 10, 10)
    finally:
        loop.close()


def test_a_finished_request_is_freed_without_the_cyclic_collector(model_dir) -> None:
    """The loop's future holds a finished request, and the request no longer holds the loop's
    callback: once its caller lets go, reference counting frees it (and its matcher, stats
    and prompt), so a burst leaves no cycles for a full collection to find."""
    cfg = load_model_config(model_dir)
    cfg.num_hidden_layers = 1
    loop = EngineLoop(Engine(cfg, EngineConfig(device="cpu", max_batch_size=2, max_seq_len=64)))
    try:
        heard: list[bool] = []
        req = Request([1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0.0),
                      on_update=lambda r: heard.append(r.finished))
        future = loop.submit(req)
        assert future.result(timeout=60) is req and heard[-1] and req.on_update is None
        ref = weakref.ref(req)
        gc.disable()
        try:
            del req, future
            assert wait_for(lambda: ref() is None)  # (the loop thread may still be in the step's end)
        finally:
            gc.enable()
    finally:
        loop.close()
