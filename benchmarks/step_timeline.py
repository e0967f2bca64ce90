"""Where a serving burst's engine time goes, step by step, on the real device: each
`Engine.step` timed on the wall clock and on its thread's CPU clock, with the requests and
rows it ran, its prompt tokens, and whether its forward had been launched ahead
(`CudaGraphs.steps_ahead`). `bench_serving --paired ... --timeline` prints one summary line a
warm burst: when the engine's first step started (the front's share of the TTFT), the prompt
steps, and the steps grouped by how many requests they ran (the tail of a burst, where a few
long outputs run at small batch, shows there).

On the lent H200 it showed that a warm burst's steps are host-bound end to end: their CPU time
equals their wall time, the tail's steps are launched ahead all the same, and a step of 16-64
requests takes 1.1-2.5 ms against bench_decode's 0.5-1.0 (docs/performance.md, "Serving under
load")."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

# Upper bounds of the request-count groups of `StepTimeline.summary`.
GROUPS = (4, 16, 64, 128, 256, 1 << 30)


@dataclass(frozen=True)
class StepRecord:
    start: float  # perf_counter at the step's start
    wall_s: float
    cpu_s: float  # the engine thread's CPU time in the step (a CUDA wait that spins counts too)
    requests: int
    rows: int  # tokens run: prompt chunks and forced text ride as extra rows
    prompt_tokens: int
    ahead: bool  # a decode-graph step whose forward was launched before the step began


class StepTimeline:
    """Records every step of `engine` from now on (wrappers on the instance: install it while
    the engine is idle); `reset` starts a new burst, `summary` describes it, `close` takes the
    wrappers off."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.steps: list[StepRecord] = []
        self.started = time.perf_counter()
        self._batch: list[tuple[Any, int]] = []
        self._schedule = engine.scheduler.schedule
        self._step = engine.step
        engine.scheduler.schedule = self.schedule
        engine.step = self.step

    def reset(self) -> None:
        self.steps, self.started = [], time.perf_counter()

    def close(self) -> None:
        del self.engine.scheduler.schedule, self.engine.step  # the class's methods again

    def schedule(self, token_budget: int | None = None) -> list[tuple[Any, int]]:
        self._batch = self._schedule(token_budget=token_budget)
        return self._batch

    def step(self) -> Any:
        graphs = self.engine.runner.graphs
        ahead_before = graphs.steps_ahead if graphs is not None else 0
        self._batch = []
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._step()
        finally:
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
            batch = self._batch
            # (num_cached is counted after the step: a request still in its prompt before it)
            prompt = sum(n for r, n in batch if r.num_cached - n < r.num_prompt)
            ahead = graphs is not None and graphs.steps_ahead > ahead_before
            self.steps.append(StepRecord(start, wall, cpu, len(batch), sum(n for _, n in batch), prompt, ahead))

    def summary(self) -> dict[str, Any]:
        """The burst since `reset`: its first step's start, its prompt steps, and per group of
        request counts (`GROUPS`, "<=N") the steps, their total and median wall ms, their CPU
        share and how many ran a forward launched ahead."""
        steps = self.steps
        out: dict[str, Any] = {"steps": len(steps),
                               "first_step_ms": round(1e3 * (steps[0].start - self.started), 1) if steps else None,
                               "prompt_steps": sum(1 for s in steps if s.prompt_tokens),
                               "prompt_steps_ms": round(1e3 * sum(s.wall_s for s in steps if s.prompt_tokens), 1)}
        groups: dict[int, list[StepRecord]] = {}
        for s in steps:
            if not s.prompt_tokens:
                groups.setdefault(next(g for g in GROUPS if s.requests <= g), []).append(s)
        for bound, group in sorted(groups.items()):
            wall = sum(s.wall_s for s in group)
            out[f"<={bound}" if bound < GROUPS[-1] else f">{GROUPS[-2]}"] = {
                "steps": len(group), "ms": round(1e3 * wall, 1),
                "median_ms": round(1e3 * statistics.median(s.wall_s for s in group), 2),
                "cpu_share": round(sum(s.cpu_s for s in group) / wall, 2) if wall else None,
                "ahead": sum(s.ahead for s in group)}
        return out
