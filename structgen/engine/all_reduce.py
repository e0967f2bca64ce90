"""The all-reduce of a decode step's activations over GPUs of one host, in one kernel.

A tensor-parallel decode step all-reduces a few kilobytes twice a layer, and NCCL's ring
costs several round trips for each. Here every rank copies its part into a buffer the other
GPUs map (PyTorch's symmetric memory), the ranks meet on a device-side barrier, and each
sums all the parts itself (`symm_mem.one_shot_all_reduce_copy_out`, a kernel CUDA graphs
capture). Large tensors (a prompt's rows), ranks on several hosts, GPUs without peer access
and CPU runs keep NCCL / gloo (docs/performance.md, "Tensor parallelism").
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger("structgen.engine")

# Largest tensor summed in one shot; past it the one-shot kernel's reads of every peer's part
# cost more than NCCL's ring (docs/performance.md, "Tensor parallelism").
ONE_SHOT_MAX_BYTES = 512 * 1024
ALIGN = 16  # the kernel's vector width: a part's address and size must be multiples


class OneShotAllReduce:
    """The one-shot sum over a symmetric buffer that every rank of the default group mapped
    (building it is a collective), of tensors that fit it (`fits`)."""

    def __init__(self, buffer: torch.Tensor):
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        symm_mem.rendezvous(buffer, self.group_name)
        self.buffer = buffer

    @staticmethod
    def buffer_for(device: torch.device, dtype: torch.dtype, rank_count: int) -> torch.Tensor | None:
        """This rank's symmetric buffer, or None where the one-shot path cannot run here (the
        ranks then agree on NCCL before any of them maps a buffer)."""
        if not _can_map_peers(device, rank_count):
            return None
        from torch.distributed import _symmetric_memory as symm_mem

        try:
            return symm_mem.empty(ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        except RuntimeError as e:
            log.warning("no symmetric memory on %s (%s); tensor parallelism keeps NCCL", device, e)
            return None

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.dtype == self.buffer.dtype and x.is_contiguous() and 0 < x.numel() <= self.buffer.numel()
                and nbytes % ALIGN == 0 and x.data_ptr() % ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, as a new tensor (each rank adds the parts in rank
        order, so every rank holds the same bits)."""
        out = torch.empty_like(x)
        part = self.buffer[: x.numel()].view(x.shape)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(part, x, "sum", self.group_name, out)
        return out


def _can_map_peers(device: torch.device, rank_count: int) -> bool:
    """Whether this rank's GPU can map every other rank's: all ranks on this host (spawned by
    the engine, or a torchrun launch of one host), peer access between their GPUs, and a torch
    with the one-shot kernel."""
    if device.type != "cuda" or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return False
    local = int(os.environ.get("LOCAL_WORLD_SIZE", rank_count))
    if local != rank_count or rank_count > torch.cuda.device_count():
        return False
    here = device.index if device.index is not None else torch.cuda.current_device()
    return all(torch.cuda.can_device_access_peer(here, other) for other in range(rank_count) if other != here)
