"""The capturable guided decoding mode: a run of graph steps whose host work (taking the
sampled tokens in, planning the next step, filling its grammar masks) runs as CUDA host
callbacks inside each step's graph, so the host neither waits for a step nor launches the next.

One captured graph per bucket (`GuidedLoop`), over the decode graphs' buffers:

    main:  [H2D staged rows] [forward ...........] [sample] [D2H tokens] [take: host callback]
    side:          \\-> [fill: host callback] [H2D mask] -/

`take` gets the step's sampled tokens from pinned memory, hands them to the engine (accept,
advance, jump-forward, finish) and returns the next step, which it stages in pinned memory for
the next replay's copies. The host thread queues replays two deep and waits with the GIL
released (kernels/hostfunc.py: `replay`, `wait_event`), so both callbacks get the GIL at once.
A step that ends the run (a request finished, someone waits to be admitted, the next step needs
more rows than the bucket, the budget of steps is spent) stages an empty step: a replay already
queued behind it runs padding rows only and its callbacks do nothing.

Why: this is the TensorRT-LLM/XGrammar design for guided speculative decoding. Here it can save
only what the launch and the host's wake-up cost, and measured slower than the usual path
(docs/performance.md, "Speculative decoding"; docs/kernels.md): the engine's own path already
launches the next forward right after taking the tokens in (`plan_next`), and a host callback
does the same Python work on the critical path. It stays opt-in
(`EngineTuning.capturable_guided`), for the speculative step with a host-side drafter.

Rules the callbacks follow (kernels/hostfunc.py): no CUDA calls in `take` or `fill` (engine
bookkeeping, grammar matchers, tokenizer and `on_update` callbacks only); per-step state is
handed from one callback to the next through `self._step`, which only callbacks touch while a
run is in flight (stream order runs take(i) -> fill(i+1) -> take(i+1)).

With `capture=False` the same steps run eagerly on the same buffers (CPU, Triton interpreter),
so the engine logic around the loop is testable without a GPU.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from structgen.engine.graph_metadata import HAS_MASK, IDS, LENS, LIVE, NEXT, POSITIONS, SEEDS, SLOTS

if TYPE_CHECKING:
    from structgen.engine.cuda_graphs import DecodeGraphs

log = logging.getLogger("structgen.engine")

DEPTH = 2  # replays queued ahead: the next one is always there when a step's callback returns


@dataclass
class LoopStep:
    """One step of a run: its one-token rows and their sampling, and what to do with the
    sampled tokens. `fill(host_bitmask)` fills the rows with `has_mask` of an int32 [n, W]
    tensor; `take(tokens, plan)` hands the n sampled tokens to the engine and, when `plan`,
    returns the next step (None: the run ends here)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    temperatures: list[float]
    seeds: list[int]
    has_mask: list[bool]
    fill: Callable[[torch.Tensor], None]
    take: Callable[[list[int], bool], LoopStep | None]


class GuidedLoop:
    def __init__(self, graphs: DecodeGraphs, bucket: int, capture: bool = True):
        assert bucket in graphs.batch_sizes, f"bucket {bucket} is not a captured decode size"
        self.graphs, self.bucket, self.capture = graphs, bucket, capture
        pin = graphs.device.type == "cuda"
        words = graphs.bitmask.shape[1]
        # Pinned staging the graph copies from / to; callbacks write it through numpy views.
        self.stage_meta = torch.zeros(tuple(graphs.host_meta.shape), dtype=torch.int64, pin_memory=pin)
        self.stage_temperature = torch.zeros(graphs.max_batch_size, dtype=torch.float32, pin_memory=pin)
        self.stage_bitmask = torch.zeros(bucket, words, dtype=torch.int32, pin_memory=pin)
        self.stage_tokens = torch.zeros(bucket, dtype=torch.int64, pin_memory=pin)
        self._meta_np, self._temp_np = self.stage_meta.numpy(), self.stage_temperature.numpy()
        self._tokens_np = self.stage_tokens.numpy()
        self._step: LoopStep | None = None  # the step the next replay runs; None: padding only
        self._left = 0  # steps the run may still take
        self.stopped = True
        self.steps = 0  # steps run (tokens taken), over all runs
        self.error: BaseException | None = None  # what ended the last run, if a callback raised
        self._stage(None)
        self.graph: torch.cuda.CUDAGraph | None = None
        if capture:
            from structgen.engine.kernels import hostfunc

            # Their captured argument blocks live as long as the process (hostfunc frees them at
            # exit): a loop is kept for as long as its decode graphs.
            self._fill_cb = hostfunc.hostfunc(self._on_fill)
            self._take_cb = hostfunc.hostfunc(self._on_tokens)
            self._capture()

    # -- staging ------------------------------------------------------------------------------
    def _stage(self, step: LoopStep | None) -> None:
        """Write `step`'s rows (None: none) into the pinned staging, padding the rest."""
        g, meta = self.graphs, self._meta_np
        n = 0 if step is None else len(step.token_ids)
        meta[:, n:] = 0
        meta[SLOTS, n:] = g.kv.scratch_slot
        meta[LENS, n:] = 1
        meta[NEXT, :] = g.pad_column  # the sampler's prediction of the next step is not used
        self._temp_np[n:] = 0.0
        if step is None:
            return
        meta[IDS, :n] = step.token_ids
        meta[POSITIONS, :n] = step.positions
        meta[SLOTS, :n] = step.slots
        meta[LENS, :n] = [p + 1 for p in step.positions]
        meta[SEEDS, :n] = step.seeds
        meta[HAS_MASK, :n] = step.has_mask
        meta[LIVE, :n] = 1
        self._temp_np[:n] = step.temperatures

    # -- the callbacks ------------------------------------------------------------------------
    def _on_fill(self) -> None:
        step = self._step
        if step is not None and any(step.has_mask):
            step.fill(self.stage_bitmask[: len(step.token_ids)])

    def _on_tokens(self) -> None:
        step = self._step
        if step is None:  # a padding replay queued behind the end of the run
            return
        self.steps += 1
        self._left -= 1
        tokens = self._tokens_np[: len(step.token_ids)].tolist()
        nxt = None
        try:
            nxt = step.take(tokens, self._left > 0)
            if nxt is not None and not (0 < len(nxt.token_ids) <= self.bucket and self._mapped(nxt)):
                nxt = None  # the engine's own path runs it (its schedule maps the pages first)
        except BaseException as exc:  # noqa: BLE001 - a callback has no caller to raise into
            log.exception("a guided loop step failed")
            self.error, nxt = exc, None
        self._step = nxt
        self._stage(nxt)
        if nxt is None:
            self.stopped = True

    def _mapped(self, step: LoopStep) -> bool:
        """Whether every row of `step` lies in the pages its request holds. A run maps no
        pages (its callbacks make no CUDA calls, so no page table copy): the runner reserves
        them before it starts (`ModelRunner.run_guided`), and a step reaching past them ends
        the run rather than write the scratch page and read it back as the request's K/V."""
        return self.graphs.kv.pages.maps(np.asarray(step.slots), np.asarray(step.positions))

    # -- capture and run ----------------------------------------------------------------------
    @torch.inference_mode()
    def _capture(self) -> None:
        from structgen.engine.kernels import hostfunc as hf

        g, n = self.graphs, self.bucket
        ready, masked = torch.cuda.Event(), torch.cuda.Event()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=g.pool):
            main = torch.cuda.current_stream()
            g.meta.copy_(self.stage_meta, non_blocking=True)
            g.temperature.copy_(self.stage_temperature, non_blocking=True)
            ready.record(main)
            with torch.cuda.stream(g.copy_stream):
                g.copy_stream.wait_event(ready)
                self._fill_cb.launch(stream=g.copy_stream)
                g.bitmask[:n].copy_(self.stage_bitmask, non_blocking=True)
                masked.record(g.copy_stream)
            logits = g._forward(n)
            main.wait_event(masked)
            g._sample(n, logits)
            self.stage_tokens.copy_(g.tokens[:n], non_blocking=True)
            self._take_cb.launch(stream=main)
        torch.cuda.synchronize(g.device)
        hf.raise_pending()
        self.graph, self._logits = graph, logits
        self._events = [torch.cuda.Event() for _ in range(DEPTH)]

    def release(self) -> None:
        """Destroy the captured graph (DecodeGraphs.release)."""
        if self.graph is not None:
            self.graph.reset()
            self.graph = None

    def run(self, first: LoopStep, max_steps: int) -> int:
        """Run `first` and the steps its `take` plans, at most `max_steps`; returns how many
        ran. Raises what a callback raised, after the run has drained."""
        assert 0 < len(first.token_ids) <= self.bucket
        self._step, self._left, self.stopped, self.error = first, max_steps, False, None
        self._stage(first)
        start = self.steps
        if not self.capture:
            while not self.stopped:
                self._eager_step()
        else:
            self._run_graphs(max_steps)
        if self.error is not None:
            raise self.error
        return self.steps - start

    def _run_graphs(self, max_steps: int) -> None:
        from structgen.engine.kernels import hostfunc as hf

        queued: deque[torch.cuda.Event] = deque()
        launched = 0
        while True:
            while not self.stopped and len(queued) < DEPTH and launched < max_steps:
                hf.replay(self.graph)  # GIL released: the running step's callbacks may need it
                ev = self._events[launched % DEPTH]
                ev.record()
                queued.append(ev)
                launched += 1
            if not queued:
                return
            hf.wait_event(queued.popleft())
            if self.stopped:
                while queued:
                    hf.wait_event(queued.popleft())
                return

    @torch.inference_mode()
    def _eager_step(self) -> None:
        g, n = self.graphs, self.bucket
        g.meta.copy_(self.stage_meta)
        g.temperature.copy_(self.stage_temperature)
        self._on_fill()
        g.bitmask[:n].copy_(self.stage_bitmask)
        g._sample(n, g._forward(n))
        self.stage_tokens.copy_(g.tokens[:n])
        self._on_tokens()


__all__ = ["GuidedLoop", "LoopStep"]
