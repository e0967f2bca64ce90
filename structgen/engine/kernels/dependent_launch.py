"""Programmatic dependent launch (PDL): each kernel of a step starts while the one before it
drains, instead of after it.

Between two kernels of a CUDA graph the GPU sits idle while the first one's last blocks finish
and the second one's blocks are launched and ramp up; a decode step of a large model is a few
hundred kernels, so that idle time is several percent of it (docs/performance.md, "Decode step
at batch 1"). On Hopper and later a kernel launched with PDL may start as soon as every block
of the one before it has signalled that it may (`gdc_launch_dependents`); it then waits
(`gdc_wait`) until that kernel has finished and its writes are visible. Every kernel here
calls `wait_for_inputs` before it reads anything another kernel wrote or writes anything
another kernel reads, so the order of the step is unchanged; the projections first issue the
loads of their first chunk of weights, which no kernel writes, so those bytes arrive while the
kernel before them finishes.

A kernel takes a `PDL: tl.constexpr` argument and is launched with `**launch_args(device,
rows)`. Only steps of up to MAX_ROWS rows take it: there every projection is one of our
kernels, so the whole layer is a chain of them; larger steps' projections run on cuBLAS, which
does not take part, and there the dependent launches cost a little instead (docs/performance.md,
"Decode step at batch 1"). The switch is process-wide (`use_dependent_launch`), on by default
where the GPU has it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - a Triton without PDL: the kernels never call them
    gdc_launch_dependents = gdc_wait = None

MAX_ROWS = 16  # kernels/gemv.py's MAX_ROWS: the most rows our projection kernels take
_enabled = True


def use_dependent_launch(enabled: bool) -> None:
    """Switch programmatic dependent launch on or off for kernels launched from now on (graphs
    already captured keep what they were captured with)."""
    global _enabled
    _enabled = bool(enabled)


@functools.cache
def _supported(device_index: int) -> bool:
    """Hopper or later, and a Triton that exposes the grid-dependency instructions."""
    return gdc_wait is not None and torch.cuda.get_device_capability(device_index)[0] >= 9


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels launched on `device` now take programmatic dependent launch."""
    return _enabled and device.type == "cuda" and _supported(device.index or 0)


def launch_args(device: torch.device, rows: int) -> dict[str, bool]:
    """The keyword arguments of a launch of `rows` rows (tokens, sequences) on `device`: the
    kernel's `PDL` constexpr, and Triton's `launch_pdl` where it is on."""
    if rows <= MAX_ROWS and dependent_launch(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the kernel before this one has finished (its writes visible), then let the
    kernel after this one start launching. A no-op without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
