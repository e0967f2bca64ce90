"""A captured CUDA graph behind a gate the device decides after the launch (`TokenGate`).

Why: the decode graphs launch the next step's forward before the host has read the sampled
tokens so the GPU never waits for the host; with jump-forward a sampled token may make the
grammar force text, and the blind forward is then a whole wasted pass. The token gate (a CUDA
conditional node around a child copy of the graph, csrc/gate.cu) lets the device itself decide
from the sampled token, so where it runs the next forward no host is on the critical path.
Needs the csrc extension and CUDA 12.4+ (`available()`).
"""

from __future__ import annotations

import numpy as np
import torch

from structgen.engine.kernels import csrc_ext
from structgen.grammar.backends.base import count_allowed


def available() -> bool:
    """The extension builds here and this CUDA has conditional graph nodes (12.4+)."""
    if not csrc_ext.available():
        return False
    major, minor = (int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    return (major, minor) >= (12, 4)


class TokenGate:
    """A captured graph behind a gate the device decides from a step's sampled token
    (csrc/gate.cu, `token_gate_kernel`): the body runs when the sampled row (its index read from
    `row` on the device) is a grammar row (`has_mask`) and its token is in `quiet` (uint32 words,
    the bitmask layout), and where `check` (int64 row, token) names a row, the token sampled
    there is that token (the step ran a guess after that row: the last row counts only where
    the model picked the guess). `went(token)` is the same test on the host.

    Why: with jump-forward the next forward waited for the host to read the token and rule out
    forced text (sync, check and launch all on the device's critical path; docs/performance.md,
    "Jump-forward"). Inside a JSON string a token without quote or punctuation cannot lead to
    forced text, so the device needs no host to go on. The caller launches it only where the
    grammar state is like that (`wide`: its mask allows many tokens); elsewhere the host decides
    as before."""

    def __init__(self, graph: torch.cuda.CUDAGraph, row: torch.Tensor, tokens: torch.Tensor, has_mask: torch.Tensor,
                 quiet: np.ndarray, min_allowed: int, check: torch.Tensor):
        self._ext = csrc_ext.load()
        self.device = tokens.device
        assert quiet.dtype == np.uint32 and quiet.ndim == 1, "quiet: uint32 bitmask words"
        self._quiet = quiet
        self._quiet_dev = torch.from_numpy(quiet.view(np.int32).copy()).to(self.device)
        self.min_allowed = min_allowed
        self._graph = graph  # owns the body's buffers; the child copy points at them
        self._exec = self._ext.token_gate_build(graph.raw_cuda_graph(), row.data_ptr(), tokens.data_ptr(),
                                                has_mask.data_ptr(), self._quiet_dev.data_ptr(), 32 * len(quiet),
                                                check.data_ptr())

    def wide(self, mask_row: np.ndarray) -> bool:
        """Whether a grammar mask (uint32 words) allows `min_allowed` tokens or more: a state
        where the gate is worth launching."""
        return count_allowed(mask_row) >= self.min_allowed

    def launch(self) -> None:
        self._ext.graph_launch(self._exec, torch.cuda.current_stream(self.device).cuda_stream)

    def went(self, token: int) -> bool:
        """Whether a launch whose grammar row sampled `token` ran its body."""
        return 0 <= token < 32 * len(self._quiet) and bool((self._quiet[token >> 5] >> (token & 31)) & 1)

    def __del__(self) -> None:
        exec_, ext = getattr(self, "_exec", None), getattr(self, "_ext", None)
        if exec_ and ext is not None:
            try:
                ext.gate_destroy(exec_)
            except Exception:  # interpreter teardown: CUDA may already be gone
                pass


__all__ = ["TokenGate", "available"]
