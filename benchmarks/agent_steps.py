"""Engine step times of bench_serving's agent workload against its short-prompt twin, on the
real device, split into steps that run prompt rows (a new turn's tail past the cached
catalogue) and decode-only steps.

On the stubbed device (`profile_host --serving --workload agent`) the agent's host work per
step equals the short prompt's and costs about 0.2 ms more per request, so a TTFT or TPOT gap
on the GPU lies in the device steps: this shows which kind of step grows with the catalogue.

    python -m benchmarks.agent_steps --requests 200 --rate 100 --out /tmp/agent_steps.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_serving import ServingRequest, agent_workload, inprocess_runner
from benchmarks.common import maskbench_dir


class StepKinds:
    """Wraps `engine.step`: the wall time of each step and whether it ran prompt rows (a
    request's cached tokens grew while it still had prompt tokens to run)."""

    def __init__(self, engine: Any):
        self.engine, self._step = engine, engine.step
        self.prompt_ms: list[float] = []
        self.decode_ms: list[float] = []
        engine.step = self.step

    def step(self) -> Any:
        scheduler = self.engine.scheduler
        pending = [(r, r.num_cached) for r in (*scheduler.running, *scheduler.waiting) if r.num_cached < r.num_prompt]
        t = time.perf_counter()
        try:
            return self._step()
        finally:
            ms = 1e3 * (time.perf_counter() - t)
            (self.prompt_ms if any(r.num_cached > c for r, c in pending) else self.decode_ms).append(ms)


async def drive(run: Any, requests: list[ServingRequest], rate: float | None) -> list[float]:
    """Each request's TTFT: one at a time (`rate` None) or as Poisson arrivals at `rate`/s."""
    if rate is None:
        return [(await run(r)).ttft_s for r in requests]
    gaps = np.random.default_rng(0).exponential(1 / rate, len(requests))
    tasks = []
    for req, gap in zip(requests, gaps, strict=True):
        tasks.append(asyncio.create_task(run(req)))
        await asyncio.sleep(float(gap))
    return [o.ttft_s for o in await asyncio.gather(*tasks)]


def _p50(values: list[float]) -> float | None:
    return round(float(np.median(values)), 2) if values else None


def measure(llm: Any, workload: str, n: int, rate: float | None, max_tokens: int) -> dict[str, Any]:
    requests = agent_workload(n, maskbench_dir(), llm.tokenizer, catalogue=workload == "agent")
    run = inprocess_runner(llm, max_tokens)
    asyncio.run(drive(run, requests[:4], None))  # the catalogue's pages cached, graphs warm
    kinds = StepKinds(llm.engine)
    try:
        ttft = asyncio.run(drive(run, requests, rate))
    finally:
        llm.engine.step = kinds._step
    return {"workload": workload, "arrival": "serial" if rate is None else f"{rate:g}/s",
            "ttft_p50_ms": _p50([1e3 * t for t in ttft]), "prompt_steps": len(kinds.prompt_ms),
            "prompt_step_p50_ms": _p50(kinds.prompt_ms), "decode_steps": len(kinds.decode_ms),
            "decode_step_p50_ms": _p50(kinds.decode_ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=100.0, help="Poisson arrivals per second (besides one at a time)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the rows here as JSON")
    args = ap.parse_args()
    from structgen import LLM
    from structgen.engine.config import EngineConfig

    cfg = EngineConfig(max_batch_size=256, max_seq_len=4096, **({"device": args.device} if args.device else {}))
    rows = []
    with LLM(config=cfg) as llm:
        for workload in ("agent", "agent-short"):
            for rate in (None, args.rate):
                rows.append(measure(llm, workload, args.requests, rate, args.max_tokens))
                print(rows[-1], flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
