"""Where the wall time of engine steps goes, step kind by step kind: a profiler for the
jump-forward replay (bench_jump_forward's harness), with jump-forward off and on.

Every `Engine.step` is timed on the wall clock and labelled (its kind: prefill, decode, or
extend when forced rows are pending; the kind of the step before it; whether its forward was
already queued when the host got to it). The table groups the labels, so a cost that only one
kind of step pays stands out. On the H100 this found the garbage-collection stalls (prefill
steps 29 ms with jump-forward on against 14 off) and the 8B shape's decode-after-decode and
forced-row penalties (docs/performance.md). No device sync is added between steps: the
engine's own per-step sync is what a caller sees.

A second table (`DeviceGaps`) shows how long the device waits for the host: a CUDA event is
recorded behind each sampler and before each forward launch, and the time between a sampler's
event and the next launch's is the device's idle gap (the host reading the tokens, deciding
what runs next, launching it). The host pieces on that path are timed beside it. On the 8B
shape it put 389-410 ms of a 6.75 s run on slow lent hosts in those gaps, 166 ms on a fast one
(docs/performance.md).

    python -m benchmarks.profile_steps --tokenizer-dir DIR --data-dir DIR            # SmolLM2 shape
    python -m benchmarks.profile_steps --shape llama-8b --tokenizer-dir DIR --data-dir DIR
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_jump_forward import (
    CATEGORIES,
    MASKBENCH,
    ReplayJumpForward,
    batch_replay_fills,
    build_llm,
    load_cases,
    measure,
    step_kind,
)
from structgen.engine.engine import Engine


class StepLabels:
    """Wraps `engine.step` to record (kind, previous kind, pre-launched, ms) per step."""

    def __init__(self, engine: Engine):
        self.engine, self.records, self._previous = engine, [], None
        self._step = engine.step
        engine.step = self._timed_step  # instance attribute: the class is left alone

    def _timed_step(self) -> list:
        e = self.engine
        kind = step_kind(e)
        graphs = e.runner.graphs
        ahead = graphs.steps_ahead if graphs is not None else 0
        t = time.perf_counter()
        out = self._step()
        ms = 1e3 * (time.perf_counter() - t)
        queued = graphs is not None and graphs.steps_ahead > ahead
        self.records.append((kind, self._previous, queued, ms))
        self._previous = kind
        return out

    def table(self) -> list[dict[str, Any]]:
        groups: dict[tuple, list[float]] = defaultdict(list)
        for kind, previous, queued, ms in self.records:
            groups[(kind, previous, queued)].append(ms)
        rows = [{"step": k, "after": p, "prelaunched": q, "n": len(v), "mean_ms": statistics.mean(v),
                 "p50_ms": statistics.median(v), "total_ms": sum(v)} for (k, p, q), v in groups.items()]
        return sorted(rows, key=lambda r: -r["total_ms"])


class DeviceGaps:
    """Events behind each sampler and before each forward launch, and host timings of the
    verdict (`Engine._plain_next_step`), the jump-forward hook and planned launches; `close`
    restores the engine. CUDA graphs only."""

    def __init__(self, engine: Engine):
        g = engine.runner.graphs
        self.engine, self.graphs = engine, g
        self.events: list[tuple[str, torch.cuda.Event]] = []
        self.host: dict[str, list[float]] = defaultdict(list)
        self._saved = (g.step_done, dict(g._steps), engine.jump_forward_hook)
        done, mark = g.step_done, self._mark

        class SamplerDone:  # the graphs record and wait on it; it also marks the log
            def record(self) -> None:
                done.record()
                mark("sampler")

            def synchronize(self) -> None:
                done.synchronize()

            def __getattr__(self, name: str) -> Any:  # query and the rest: the real event's
                return getattr(done, name)

        g.step_done = SamplerDone()
        self._gate = g.token_gate
        if g.token_gate is not None:  # a gated forward counts as launched where the gate is
            g.token_gate = _MarkedGate(g.token_gate, self._mark)
        for bs, (forward, sample) in list(g._steps.items()):
            g._steps[bs] = (self._marked(forward), sample)
        g._launch_planned = self._timed(g._launch_planned, "launch of a planned forward")
        engine._plain_next_step = self._timed(engine._plain_next_step, "verdict (_plain_next_step)")
        hook, host = engine.jump_forward_hook, self.host

        class TimedHook:  # the engine calls it; everything else (vocab, rehearse) is the hook's
            def __call__(self, eng: Engine, req: Any) -> None:
                n, t = len(req.token_ids), time.perf_counter()
                hook(eng, req)
                jumped = "jumped" if len(req.token_ids) != n or req.finished else "nothing jumped"
                host[f"jump-forward hook, {jumped}"].append(time.perf_counter() - t)

            def __getattr__(self, name: str) -> Any:
                return getattr(hook, name)

        engine.jump_forward_hook = TimedHook()

    def _mark(self, what: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.events.append((what, ev))

    def _marked(self, forward: Any) -> Any:
        def launch() -> None:
            self._mark("forward")
            forward()

        return launch

    def _timed(self, fn: Any, what: str) -> Any:
        def timed(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.host[what].append(time.perf_counter() - t)

        return timed

    def close(self) -> None:
        g, e = self.graphs, self.engine
        g.step_done, steps, e.jump_forward_hook = self._saved
        g.token_gate = self._gate
        g._steps.update(steps)
        del g._launch_planned, e._plain_next_step  # back to the classes' methods

    def table(self, wall_s: float) -> list[dict[str, Any]]:
        torch.cuda.synchronize()
        pairs = list(zip(self.events, self.events[1:], strict=False))
        gaps = [1e3 * a.elapsed_time(b) for (x, a), (y, b) in pairs
                if x == "sampler" and y == "forward"]  # us; a pre-launched forward reads ~0
        gated = [1e3 * a.elapsed_time(b) for (x, a), (y, b) in pairs if x == "sampler" and y == "gate"]
        rows = []
        for what, us in [("device idle, sampler -> next forward", gaps),
                         ("sampler -> gate launch (no idle: the gate is queued)", gated),
                         *((k, [1e6 * t for t in v]) for k, v in self.host.items())]:
            if us:
                us = sorted(us)
                rows.append({"what": what, "n": len(us), "p50_us": us[len(us) // 2],
                             "p90_us": us[int(0.9 * len(us))], "mean_us": statistics.mean(us),
                             "total_ms": sum(us) / 1e3, "of_wall_pct": sum(us) / 1e4 / wall_s})
        return rows


class _MarkedGate:
    """A TokenGate whose launches are marked in the event log (as "gate")."""

    def __init__(self, gate: Any, mark: Any):
        self._gate, self._mark = gate, mark

    def launch(self) -> None:
        self._mark("gate")
        self._gate.launch()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gate, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer-dir", type=Path, default=None, help="tokenizer + config.json (random weights)")
    ap.add_argument("--shape", default=None, choices=["llama-1b", "llama-8b"])
    ap.add_argument("--weights", default="random", choices=["real", "random"])
    ap.add_argument("--data-dir", type=Path, default=MASKBENCH)
    ap.add_argument("--mode", default="replay", choices=["replay", "model"],
                    help="replay: the schemas' valid instances, forced token by token; model: the "
                         "model's own outputs (real weights; the token gate fires only here)")
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--device", default=None)
    ap.add_argument("--eager-prefill", action="store_true", help="EngineTuning(prefill_in_graphs=False)")
    args = ap.parse_args()
    from benchmarks.common import print_table

    if args.mode == "model" and args.weights != "real":
        ap.error("--mode model needs --weights real")
    llm, model = build_llm(args.weights, args.tokenizer_dir, args.device, True, args.shape, not args.eager_prefill)
    engine = llm.engine
    if args.mode == "replay":
        engine.jump_forward_hook = ReplayJumpForward(
            llm.tokenizer, engine.vocab_size, engine.stop_token_ids, vocab=engine.jump_forward_hook.vocab
        )
    cases = load_cases(llm, args.data_dir, CATEGORIES, args.per_category, args.max_tokens)
    if args.mode == "replay":
        batch_replay_fills(engine)
    measure(llm, cases, args.mode, True, 1, args.max_tokens)  # warm-up: shapes, caches
    for jf in (False, True):
        measure(llm, cases, args.mode, jf, 1, args.max_tokens)
    for jf in (False, True):
        labels = StepLabels(engine)
        gaps = DeviceGaps(engine) if engine.runner.graphs is not None and engine.device.type == "cuda" else None
        r = measure(llm, cases, args.mode, jf, 1, args.max_tokens)
        del engine.step  # back to the class's method
        if gaps is not None:
            gaps.close()
        # The engine turns a broken step into failed requests, not an exception: a profile of
        # failed requests is no profile (the wrapped event once lacked `query`, and every step failed).
        failed = [c for c, v in r["per_case"].items() if v[2] == "error"]
        if failed:
            raise SystemExit(f"{len(failed)} requests failed while profiled ({', '.join(failed[:3])}, ...)")
        print(f"\n{model}, jump-forward {'on' if jf else 'off'}, batch 1: {len(cases)} requests, "
              f"wall {r['wall_s'] * 1e3:.0f} ms, {r['forward_passes']} passes for {r['tokens']} tokens")
        print_table([{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
                     for row in labels.table()])
        if gaps is not None:
            print_table([{k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}
                         for row in gaps.table(r["wall_s"])])


if __name__ == "__main__":
    main()
