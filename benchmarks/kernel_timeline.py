"""A decode step's CUDA kernels as torch.profiler saw them, and one layer's share of them
(benchmarks/profile_layers.py for dense models, benchmarks/profile_moe.py for a mixture of
experts).

A kernel is `(start_us, end_us, name)`. A layer is the stretch between two launches of a
marker kernel (one that runs once a layer); its kernels are averaged over the stretches of the
most common length, each with the idle gap before it. Under programmatic dependent launch a
kernel starts while the one before drains, so gaps can be negative and spans overlap: a
kernel's span includes its wait, and the spans add up to more than the layer's period.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from structgen.engine.request import Request
from structgen.sampling import SamplingParams

Kernel = tuple[float, float, str]


def profiled_steps(engine: Any, batch: int, steps: int, prompt_tokens: int) -> tuple[float, list[Kernel]]:
    """(ms a decode step on the wall clock, the kernels of `steps` more under the profiler) for
    `batch` requests of a `prompt_tokens`-token prompt that none of the steps finishes, after a
    prefill and warm-up; the requests are aborted after."""
    prompt = [100 + i for i in range(prompt_tokens)]
    reqs = [Request(prompt, SamplingParams(max_tokens=2 * steps + 16)) for _ in range(batch)]
    for r in reqs:
        engine.add_request(r)
    for _ in range(8):  # prefill and warm-up steps
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    for r in reqs:
        engine.abort(r)
    return ms, cuda_kernels(prof)


def cuda_kernels(prof: Any) -> list[Kernel]:
    """The CUDA kernels (and copies) of a finished `torch.profiler.profile`, in launch order."""
    return sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])


def layer_marker(kernels: list[Kernel], launches: int) -> str | None:
    """The first kernel, in launch order, whose name runs exactly `launches` times (layers times
    profiled steps): it opens each layer's stretch. None where no kernel does."""
    counts = collections.Counter(name for _, _, name in kernels)
    return next((name for _, _, name in kernels if counts[name] == launches), None)


def one_layer(kernels: list[Kernel], is_marker: Callable[[str], bool]) -> dict[str, Any]:
    """A layer's kernels, marker to marker: mean µs of each, the gap before it, the period from
    one marker to the next, and how many stretches were averaged."""
    marks = [i for i, k in enumerate(kernels) if is_marker(k[2])]
    spans = list(zip(marks, marks[1:], strict=False))
    if not spans:
        return {"kernels": [], "us": 0.0, "kernel_us": 0.0, "spans": 0, "note": "no marker kernels profiled"}
    length = statistics.mode(b - a for a, b in spans)
    spans = [(a, b) for a, b in spans if b - a == length]
    rows = []
    for j in range(length):
        runs = [kernels[a + j] for a, _ in spans]
        gaps = [kernels[a + j][0] - kernels[a + j - 1][1] for a, _ in spans if a + j > 0]
        rows.append({"name": runs[0][2], "us": statistics.mean(e - s for s, e, _ in runs),
                     "gap_us": statistics.mean(gaps) if gaps else 0.0})
    period = statistics.mean(kernels[b][0] - kernels[a][0] for a, b in spans)
    return {"kernels": rows, "us": period, "kernel_us": sum(r["us"] for r in rows), "spans": len(spans)}


def step_level(kernels: list[Kernel], launches: int, steps: int, top: int = 8) -> list[dict[str, Any]]:
    """The kernels that run fewer than `launches` times (outside the layers: embedding, LM head,
    sampling, copies), by µs a step, the `top` largest."""
    counts = collections.Counter(name for _, _, name in kernels)
    per_step: collections.Counter[str] = collections.Counter()
    for s, e, name in kernels:
        if counts[name] < launches:
            per_step[name] += (e - s) / steps
    return [{"name": name, "us": us} for name, us in per_step.most_common(top)]
