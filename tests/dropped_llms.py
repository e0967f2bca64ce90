"""Waiting out the LLMs earlier tests dropped unclosed, for tests that read process-wide state
(the native grammar pool's users) those LLMs still hold."""

from __future__ import annotations

import gc
import threading
import time


def settle_dropped_llms(timeout_s: float = 5.0, steady_s: float = 0.3) -> None:
    """Collect dropped LLMs (their finalizers close their engines, at once or as their loop
    threads end, a step later at most) and wait until the engine threads stop ending."""
    gc.collect()
    deadline, count, steady_since = time.monotonic() + timeout_s, -1, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - steady_since < steady_s:
        alive = sum(t.name == "structgen-engine" for t in threading.enumerate())
        if alive != count:
            count, steady_since = alive, time.monotonic()
        time.sleep(0.02)
