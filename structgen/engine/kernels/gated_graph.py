"""A captured CUDA graph launched before the host has decided whether it should run.

    gate = GatedGraph(graph)       # graph: torch.cuda.CUDAGraph(keep_graph=True), captured
    gate.launch()                  # queued now, behind whatever the stream already holds
    ...                            # host work: sync, look at results
    gate.decide(go)                # the device runs the body only if go
    ...
    gate.ran()                     # after a later sync: did the last launch run its body?

Why: the decode loop launches the next step's forward before it has seen the sampled tokens
so the GPU never waits for the host; a wrong guess (jump-forward text, a finished request)
wastes that whole forward, and launching only after looking puts the graph launch itself on
the critical path. Here the launch happens early and the device waits, spinning on a pinned
host word, for the verdict alone (csrc/gate.cu, a CUDA conditional node around a child copy
of the graph).

`TokenGate` is the same node with a verdict the device reaches alone (the sampled token and
its grammar mask); the decode graphs use it for jump-forward at batch 1.

The decode graphs no longer use `GatedGraph`: once the host plans the next step itself, the gate
saves only a graph launch and measured no faster there (docs/kernels.md, "Gated graphs"). It
stays for the capturable mode of docs/kernels.md.

Rules: every `launch` must be followed by exactly one `decide` (wrap the host work in
try/finally); a launch left undecided runs nothing after `timeout_s`, which `ran()` then
reports, and blocks the stream until then. Needs the csrc extension (`available()`).
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


class GatedGraph:
    def __init__(self, graph: torch.cuda.CUDAGraph, timeout_s: float = 2.0):
        self._ext = csrc_ext.load()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._outcome = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._launches_dev = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._flag_np, self._outcome_np = self._flag.numpy(), self._outcome.numpy()
        self._graph = graph  # owns the body's buffers; the child copy points at them
        self._exec = self._ext.gate_build(
            graph.raw_cuda_graph(), self._flag.data_ptr(), self._launches_dev.data_ptr(),
            self._outcome.data_ptr(), int(timeout_s * 1e9),
        )
        self.launches = 0
        self._pending = False

    def launch(self) -> None:
        assert not self._pending, "GatedGraph.launch: the previous launch was never decided"
        self.launches += 1
        self._pending = True
        self._ext.graph_launch(self._exec, torch.cuda.current_stream(self.device).cuda_stream)

    def decide(self, go: bool) -> None:
        """The verdict for the last launch; the device sees it within microseconds."""
        assert self._pending, "GatedGraph.decide without a launch"
        self._flag_np[0] = 2 * self.launches + int(go)
        self._pending = False

    def ran(self, launch: int | None = None) -> bool:
        """Whether launch number `launch` (default: the last) ran its body: False if it was
        skipped, or if its gate gave up waiting before a `decide(True)`. Read it once the
        stream has passed that gate and before the next launch is decided (the gate of each
        launch overwrites the outcome word)."""
        k = self.launches if launch is None else launch
        return int(self._outcome_np[0]) == 2 * k + 1

    def __del__(self) -> None:
        exec_, ext = getattr(self, "_exec", None), getattr(self, "_ext", None)
        if exec_ and ext is not None:
            try:
                if self._pending:  # never leave the device spinning on a dead gate
                    self.decide(False)
                ext.gate_destroy(exec_)
            except Exception:  # interpreter teardown: CUDA may already be gone
                pass


class TokenGate:
    """A captured graph behind a gate the device decides from a step's sampled token
    (csrc/gate.cu, `token_gate_kernel`): the body runs when the sampled row (its index read from
    `row` on the device) is a grammar row (`has_mask`) and its token is in `quiet` (uint32 words,
    the bitmask layout), and where `check` (int64 row, token) names a row, the token sampled
    there is that token (the step ran a draft after that row: the last row counts only where
    the model picked the draft). `went(token)` is the same test on the host.

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


__all__ = ["GatedGraph", "TokenGate", "available"]
