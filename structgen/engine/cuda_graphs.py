"""Decode steps as CUDA graphs, with the grammar mask and the sampler inside.

A decode step of a small model is hundreds of tiny kernels; launched one by one from Python
the CPU cannot keep up with the GPU. `DecodeGraphs` captures, for each batch size in
`EngineTuning.cuda_graph_batch_sizes` (a bucket), two graphs over static buffers:

- forward: token ids, positions, slots, context lengths (and the KV page table, a static
  buffer of its own: page_table.py) -> LM-head logits;
- sample: logits + grammar bitmask (rows whose has-mask flag is 0 skip it) + temperature +
  per-row Philox seeds -> one token per row (greedy, or Gumbel-max for temperature > 0); then
  it rewrites the metadata to the predicted next step, one row per sequence: the sequence's
  last row this step, its sampled token as input, position + 1. So the next forward can start
  before the host has seen the tokens, also after a step that ran several rows of a sequence
  (jump-forward text).

One step, as `run` issues it:

    GPU:  [forward i]............[sample i][forward i+1, pre-launched]..........[sample i+1]
    CPU:   fill masks i, copy ->  wait i | advance matchers, schedule, fill masks i+1, copy

The grammar masks of step i are filled on the CPU while forward i runs (the matchers were
advanced with step i-1's tokens) and copied on a side stream ordered by CUDA events; the one
host sync per step is reading the sampled tokens. With `run(..., predict_next=True)` (the
engine's decode steps, where every row is its own sequence) forward i+1 is launched right
behind sample i and kept only if step i+1 turns out to be exactly the predicted one (same
sequences and slots, positions + 1, the sampled tokens as inputs); otherwise it is discarded,
which is harmless: it only wrote K/V one position past each sequence's length (whose page the
scheduler reserves ahead), which is rewritten before it is read. A sequence's rows must be
adjacent with consecutive positions (forced tokens); callers whose rows share a slot for
another reason (speculative verification runs one row per draft token, all sampled) must not
ask for it.

Where the next step is often *not* the predicted one (jump-forward: a sampled `"` makes the
grammar force `, "age": `, so the next step runs those tokens instead), launching blind costs a
whole wasted forward on the device before the real one. `run(..., plan_next=f)` asks instead,
once the host has read the tokens: `f(tokens)` (the engine advances its requests right there,
jump-forward included) returns the next step's rows, or None when it cannot know them, and
their forward (the predicted one, or rows of forced text from a staging buffer of their own)
is launched before the host goes back to scheduling. The device idles for the sync, that
advance and the launch. A graph run or skipped on the host's verdict would save only part of
the launch, and measured no faster, so the plain launch is used; at batch 1 the token gate
(`enable_token_gate`) lets the device itself decide instead (docs/performance.md,
"Jump-forward"). Any other forward over the same cache (`ModelRunner.extend`) drops the
prediction.

A batch is padded up to its bucket: padding rows decode token 0 at position 0 of the KV
cache's scratch slot (whose pages are all the scratch page) and their outputs are ignored.
With `capture=False` the same step functions run eagerly on the same buffers (to check this
module without a GPU, under Triton's interpreter).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from structgen.engine.attention import CASCADE_MIN_ROWS, AttentionBatch, cascade_prefix
from structgen.engine.graph_metadata import (  # the rows of the metadata buffer
    CARRIED,
    GUESS,
    HAS_MASK,
    IDS,
    LENS,
    LIVE,
    NEXT,
    POSITIONS,
    PREFIX,
    SEEDS,
    SLOTS,
)
from structgen.engine.kernels.sampling import sample_tokens
from structgen.engine.sampler import mask_padding_

if TYPE_CHECKING:
    from structgen.engine.decode_step import DecodeStep
    from structgen.engine.guided_loop import GuidedLoop
    from structgen.engine.model_runner import ExtendSeq, ModelRunner
    from structgen.engine.parallel import TensorParallel

StepRows = tuple[list[int], list[int], list[int]]  # a step's rows: (token ids, positions, slots)


def step_rows(rows: list[ExtendSeq]) -> StepRows:
    """Rows as (token ids, positions, slots), a row per token: a run of n tokens (a prompt
    chunk, forced text) is n rows at consecutive positions of its slot."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for s in rows:
        tokens = s.token_ids
        if len(tokens) == 1:
            ids.append(tokens[0])
            positions.append(s.start)
            slots.append(s.slot)
        else:
            ids += tokens
            positions += range(s.start, s.start + len(tokens))
            slots += [s.slot] * len(tokens)
    return ids, positions, slots


def _put_rows(meta: np.ndarray, n: int, token_ids: list[int], positions: list[int], slots: list[int]) -> None:
    """Write n one-token rows into the metadata rows IDS..LENS of `meta`: live, each attending
    up to its own position."""
    meta[IDS, :n] = token_ids
    meta[POSITIONS, :n] = positions
    meta[SLOTS, :n] = slots
    meta[LIVE, :n] = 1
    np.add(meta[POSITIONS, :n], 1, out=meta[LENS, :n])



@dataclass(frozen=True)
class _Native:
    """The csrc extension and the raw pointers of the step's copies (`DecodeGraphs._use_native`):
    step_copies (meta, temperature: dst, src, bytes each), plan_copy (dst, src, bytes), mask
    (dst, src, bytes a row, side stream, its event), tokens (host dst, device src)."""

    ext: Any
    stream: int
    step_copies: tuple[int, ...]
    plan_copy: tuple[int, int, int]
    mask: tuple[int, int, int, int, int]
    tokens: tuple[int, int]


def _announced(tensor_parallel: TensorParallel, bucket: int, forward: Callable[[], None]) -> None:
    """Launch `forward` on rank 0 once the worker ranks were told to launch theirs."""
    tensor_parallel.announce_graph_forward(bucket)
    forward()


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, batch_sizes: tuple[int, ...], capture: bool = True,
                 prelaunch: bool | None = None, tensor_parallel: TensorParallel | None = None,
                 cascade: bool = True):
        self.model, self.kv, self.device = runner.model, runner.kv, runner.device
        # Under tensor parallelism every rank captures the same graphs; each forward first
        # takes rank 0's step rows, and rank 0 announces every launch (engine/parallel.py).
        self.tensor_parallel = tensor_parallel
        self.text_vocab_size = runner.text_vocab_size
        # Steps set their common prefix (PREFIX, EngineTuning.cascade_attention), and a bucket of
        # CASCADE_MIN_ROWS rows or more also captures a forward that reads it once (`_cascades`):
        # its extra launch costs a 64-row step ~5 % where no prefix is shared. Off under tensor
        # parallelism, whose workers replay the forward rank 0 announces by bucket alone.
        self.cascade = cascade and tensor_parallel is None
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch_size = self.batch_sizes[-1]
        self.capture_graphs = capture
        self.prelaunch = capture if prelaunch is None else prelaunch
        words = (runner.model_config.vocab_size + 31) // 32
        n, dev = self.max_batch_size, self.device
        pin = dev.type == "cuda"
        # Device buffers the graphs read and write; they never move. Metadata has one column
        # more than the largest bucket: a padding column that NEXT points padding rows at.
        self.pad_column = n
        self.meta = torch.zeros(GUESS + 1, n + 1, dtype=torch.int64, device=dev)
        self.temperature = torch.zeros(n, dtype=torch.float32, device=dev)
        self.bitmask = torch.zeros(n, words, dtype=torch.int32, device=dev)
        self.tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        # Pinned host staging, written through numpy views (cheaper than torch indexing).
        self.host_meta = torch.zeros(GUESS + 1, n + 1, dtype=torch.int64, pin_memory=pin)
        self.host_temperature = torch.zeros(n, dtype=torch.float32, pin_memory=pin)
        self.host_bitmask = torch.zeros(n, words, dtype=torch.int32, pin_memory=pin)
        self.host_tokens = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._meta_np = self.host_meta.numpy()
        self._temp_np = self.host_temperature.numpy()
        self._tokens_np = self.host_tokens.numpy()
        # Staging for a planned next step's forward rows (IDS..PREFIX), apart from host_meta: its
        # copy may still be in flight when the next `run` rewrites host_meta.
        self.host_plan = torch.zeros(PREFIX + 1, n + 1, dtype=torch.int64, pin_memory=pin)
        self._plan_np = self.host_plan.numpy()
        # bucket -> (launch forward, launch sampler); the graphs and their logits stay alive here.
        self._steps: dict[int, tuple[Callable[[], None], Callable[[], None]]] = {}
        self._captured: list[object] = []
        self._graph_pairs: dict[int, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = {}
        # bucket -> the cascade forward (graph, launch), writing the plain forward's logits.
        self._cascade_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._cascades: dict[int, Callable[[], None]] = {}
        self._prefix_staged = 0  # the last staged PREFIX: a pre-launched next step keeps it
        self.pool = None  # the graphs' shared memory pool, once captured
        self._loops: dict[int, GuidedLoop] = {}  # the capturable mode's graphs (guided_loop.py)
        # The step whose forward is already queued: (bucket, slots, positions, token ids).
        self._ahead: tuple | None = None
        self.steps = self.steps_ahead = 0  # decode steps run / of those, pre-launched forwards used
        # Jump-forward at batch 1: the next forward behind a gate the device decides
        # (`enable_token_gate`); how often it ran, and how often the host then wanted another.
        self.token_gate = None
        self.use_token_gate = True  # benchmarks time the same engine with and without it
        self.gate_runs = self.gate_wasted = 0
        self._forward_one: torch.cuda.CUDAGraph | None = None  # bucket 1's forward, kept for the gate
        self._bitmask_words = self.host_bitmask.numpy().view(np.uint32)
        # Padding of every column (token 0 at position 0 of the scratch slot, greedy, no mask):
        # rows are laid out by copying from it, one numpy call instead of one per metadata row.
        self._pad = np.zeros_like(self._meta_np)
        self._pad[SLOTS], self._pad[LENS], self._pad[NEXT], self._pad[GUESS] = self.kv.scratch_slot, 1, self.pad_column, -1
        if pin:
            self.copy_stream = torch.cuda.Stream(dev)
            self.mask_copied = torch.cuda.Event()
            self.step_done = torch.cuda.Event()
        self._native = None  # the csrc extension's launches (`_use_native`), once captured
        self._capture_all()
        if tensor_parallel is not None and tensor_parallel.rank == 0:
            self._steps = {bs: (functools.partial(_announced, tensor_parallel, bs, forward), sample)
                           for bs, (forward, sample) in self._steps.items()}

    # -- the step functions the graphs hold -------------------------------------------------
    def _forward(self, bs: int, cascade: bool = False) -> torch.Tensor:
        m, table, page = self.meta, self.kv.pages.table, self.kv.pages.page_size
        if self.tensor_parallel is not None:
            self.tensor_parallel.broadcast_(m)
        slots, positions = m[SLOTS, :bs], m[POSITIONS, :bs]
        batch = AttentionBatch(
            positions=positions, token_slots=table[slots, positions // page] * page + positions % page,
            slots=slots, page_table=table, context_lens=m[LENS, :bs], pad_index=m[POSITIONS, :0], mask=None,
            max_q=1, max_ctx=self.kv.max_seq_len, decode_kernel=True,
            prefix_len=m[PREFIX, :1] if cascade else None,
        )
        hidden = self.model(m[IDS, :bs], batch, self.kv)
        # Model dtype: the sampler reads it without a cast pass.
        return mask_padding_(self.model.head(hidden), self.text_vocab_size)

    def _sample(self, bs: int, logits: torch.Tensor) -> None:
        m, tokens = self.meta, self.tokens[:bs]
        sample_tokens(logits, self.bitmask[:bs], m[HAS_MASK, :bs], self.temperature[:bs], m[SEEDS, :bs], out=tokens)
        # Predict the next step: each live row feeds its token back at the next position, and
        # row j of the next step is this step's row NEXT[j] (a sequence's last row).
        live = m[LIVE, :bs]
        torch.mul(tokens, live, out=m[IDS, :bs])
        m[POSITIONS, :bs].add_(live).clamp_(max=self.kv.max_seq_len - 1)
        m[:CARRIED, :bs] = m[:CARRIED].index_select(1, m[NEXT, :bs])
        torch.add(m[POSITIONS, :bs], 1, out=m[LENS, :bs])

    def _set_padding(self, lo: int, hi: int | None, meta: np.ndarray | None = None) -> None:
        """Rows [lo, hi) of `meta` (default: the step's host_meta): token 0 at position 0 of
        the scratch slot, greedy, no mask."""
        if meta is None:
            self._meta_np[:, lo:hi] = self._pad[:, lo:hi]
            self._temp_np[lo:hi] = 0.0
        else:
            meta[:, lo:hi] = self._pad[: len(meta), lo:hi]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self._set_padding(0, self.max_batch_size + 1)
        self.meta.copy_(self.host_meta)
        self.temperature.copy_(self.host_temperature)
        if not self.capture_graphs:
            for bs in self.batch_sizes:
                self._steps[bs] = self._eager_step(bs)
            return
        pool = self.pool = torch.cuda.graph_pool_handle()  # shared: only one graph runs at a time
        for bs in reversed(self.batch_sizes):  # largest first, so smaller ones fit in its memory
            self._sample(bs, self._forward(bs))  # warm-up: compiles the Triton kernels
            torch.cuda.synchronize(self.device)
            # Bucket 1's forward keeps its graph: a token gate wraps a copy of it.
            forward, sample = torch.cuda.CUDAGraph(keep_graph=bs == 1), torch.cuda.CUDAGraph()
            with torch.cuda.graph(forward, pool=pool):
                logits = self._forward(bs)
            if bs == 1:
                forward.instantiate()
                self._forward_one = forward
            with torch.cuda.graph(sample, pool=pool):
                self._sample(bs, logits)
            self._steps[bs] = (forward.replay, sample.replay)
            if self.cascade and bs >= CASCADE_MIN_ROWS:
                self._capture_cascade(bs, logits, pool)
            self._graph_pairs[bs] = (forward, sample)
            self._captured += [forward, sample, logits]
        torch.cuda.synchronize(self.device)
        self._use_native()

    def _capture_cascade(self, bs: int, logits: torch.Tensor, pool: Any) -> None:
        """Bucket `bs`'s forward with the cascade, into the plain forward's logits (which its
        sampler graph reads)."""
        self._forward(bs, cascade=True)  # warm-up: compiles the prefix kernel
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits.copy_(self._forward(bs, cascade=True))
        self._cascade_graphs[bs] = graph
        self._cascades[bs] = graph.replay

    def _forward_launch(self, bs: int, prefix: int) -> Callable[[], None]:
        """The launch of bucket `bs`'s forward for rows whose common prefix is `prefix` keys:
        the cascade where they share one, else the plain kernels."""
        return self._cascades[bs] if prefix and bs in self._cascades else self._steps[bs][0]

    def _use_native(self) -> None:
        """Launch the captured graphs and do the step's copies through the csrc extension
        (`graph_launch`, `copy_async`, `side_copy`) where it builds: torch's `copy_` and
        `CUDAGraph.replay` are several times slower right after a wait for the device (cold host
        caches), and at batch 1 with jump-forward that launch is on the device's critical path
        (docs/performance.md, "Jump-forward"). Launches go to the stream current now, the
        engine's; replay's RNG re-seeding is skipped, as no graph here draws from torch's
        generator (the sampler's noise comes from its own seeds)."""
        from structgen.engine.kernels import csrc_ext

        if not csrc_ext.available():
            return
        ext, stream = csrc_ext.load(), torch.cuda.current_stream(self.device).cuda_stream
        for bs, (forward, sample) in self._graph_pairs.items():
            fwd, smp = forward.raw_cuda_graph_exec(), sample.raw_cuda_graph_exec()
            self._steps[bs] = (functools.partial(ext.graph_launch, fwd, stream),
                               functools.partial(ext.graph_launch, smp, stream))
        for bs, graph in self._cascade_graphs.items():
            self._cascades[bs] = functools.partial(ext.graph_launch, graph.raw_cuda_graph_exec(), stream)
        self.mask_copied.record()  # torch creates its events lazily: make them exist
        self.step_done.record()
        torch.cuda.synchronize(self.device)
        meta, temp, plan = self.meta, self.temperature, self.host_plan
        self._native = _Native(
            ext, stream,
            step_copies=(meta.data_ptr(), self.host_meta.data_ptr(), meta.numel() * 8,
                         temp.data_ptr(), self.host_temperature.data_ptr(), temp.numel() * 4),
            plan_copy=(meta.data_ptr(), plan.data_ptr(), plan.numel() * 8),
            mask=(self.bitmask.data_ptr(), self.host_bitmask.data_ptr(), self.bitmask.shape[1] * 4,
                  self.copy_stream.cuda_stream, self.mask_copied.cuda_event),
            tokens=(self.host_tokens.data_ptr(), self.tokens.data_ptr()),
        )

    def _eager_step(self, bs: int) -> tuple[Callable[[], None], Callable[[], None]]:
        logits: list[torch.Tensor] = []

        def forward() -> None:  # the cascade kernels read PREFIX (0: the plain result)
            logits[:] = [self._forward(bs, cascade=self.cascade and bs >= CASCADE_MIN_ROWS)]

        def sample() -> None:
            self._sample(bs, logits[0])

        return forward, sample

    # -- one step ------------------------------------------------------------------------------
    def launch_forward(self, bucket: int) -> None:
        """The forward of `bucket` rows, on the rows in the device buffers (a worker rank's
        replay of the forward rank 0 announced)."""
        self._steps[bucket][0]()

    def bucket(self, n: int) -> int | None:
        """The smallest captured batch size >= n (None: run eagerly instead)."""
        i = bisect.bisect_left(self.batch_sizes, n)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def guided_loop(self, bucket: int) -> GuidedLoop:
        """The capturable mode's loop over `bucket` rows (guided_loop.py), captured on first
        use. It replaces whatever forward was launched ahead."""
        loop = self._loops.get(bucket)
        if loop is None:
            from structgen.engine.guided_loop import GuidedLoop

            loop = self._loops[bucket] = GuidedLoop(self, bucket, capture=self.capture_graphs)
        self.discard_ahead()
        return loop

    def enable_token_gate(self, quiet: np.ndarray, min_allowed: int) -> bool:
        """Put batch-1 jump-forward steps' next forward behind a device-decided gate
        (kernels/gated_graph.py, `TokenGate`): `run` launches it where the sampled row's mask
        allows `min_allowed` tokens or more, and the device runs it when the sampled token is in
        `quiet` (uint32 words, the bitmask layout). Returns whether the gate is in use (captured
        graphs, the extension and CUDA 12.4+ needed; not under tensor parallelism, where the
        worker ranks could not follow a forward the device decides to run)."""
        from structgen.engine.kernels import gated_graph

        if self._forward_one is None or not gated_graph.available() or self.tensor_parallel is not None:
            return False
        # The sampled row of a one-sequence step is NEXT[0] (its last row, after forced tokens).
        self.token_gate = gated_graph.TokenGate(self._forward_one, self.meta[NEXT, :1], self.tokens,
                                                self.meta[HAS_MASK], quiet, min_allowed, self.meta[GUESS, :2])
        return True

    @property
    def launched_ahead(self) -> bool:
        """Whether the next step's forward is queued (pre-launched or planned)."""
        return self._ahead is not None

    def release(self) -> None:
        """Destroy every graph (an executing one is freed when it completes); nothing may
        replay them afterwards."""
        self.token_gate = None
        for loop in self._loops.values():
            loop.release()
        for forward, sample in self._graph_pairs.values():
            forward.reset()
            sample.reset()
        for graph in self._cascade_graphs.values():
            graph.reset()
        self._cascade_graphs.clear()
        self._cascades.clear()
        self._loops.clear()
        self._graph_pairs.clear()
        self._steps.clear()
        self._captured.clear()
        self._forward_one = self._ahead = None

    def discard_ahead(self) -> None:
        """Another forward ran (or will): the pre-launched one no longer matches the cache."""
        self._ahead = None

    @torch.inference_mode()
    def run(self, step: DecodeStep) -> list[int]:
        """Decode one token for each of the n rows of `step` (n <= max_batch_size); return the
        n sampled tokens. `step.fill_masks(host_bitmask)` is called while the forward runs and
        must fill row i of the int32 [n, W] host tensor for every i with has_mask[i].
        `step.predict_next`: also launch the next step's forward (see the module docstring);
        only when each sequence's rows are adjacent, with consecutive positions. Where
        `step.plans_next`, `step.plan_next(tokens)`, given the n sampled tokens once they are
        on the host, returns the next step's rows, whose forward is then launched; None:
        launch nothing. With a plan, rows of one sequence may all be sampled (speculative
        verification): the plan, not the blind prediction, says what runs next.
        `step.before_wait(done)`: host work for the time the device still computes this step,
        called (on CUDA) just before the host waits for the sampled tokens; `done()` says
        whether the sampler has finished. `step.guess`: (row, token), the one sequence's last
        row is a guess run after that row: the token gate runs the next forward only where
        the model picked the guess there."""
        token_ids, positions, slots = step_rows(step.rows)
        n = len(token_ids)
        bs = self.bucket(n)
        assert bs is not None, f"batch of {n} exceeds the largest captured size {self.max_batch_size}"
        predicted = self._ahead == (bs, tuple(slots), tuple(positions), tuple(token_ids))
        self._ahead = None
        self.steps += 1
        self.steps_ahead += predicted
        last = self._stage(step, token_ids, positions, slots, bs)
        sample = self._steps[bs][1]
        forward = self._forward_launch(bs, self._prefix_staged)
        cuda = self.device.type == "cuda"
        prelaunch = step.predict_next and self.prelaunch and len(set(slots)) == len(last)
        self.kv.pages.sync()
        self._copy_step(cuda)
        if not predicted:
            forward()
        if any(step.has_mask):
            step.fill_masks(self.host_bitmask[:n])  # CPU work, overlapping the forward
            self._copy_masks(n, cuda)
        sample()
        self._copy_tokens(bs, cuda)
        next_bs = self.bucket(len(last))
        gate = self._gate(step, prelaunch, last)
        if prelaunch and not step.plans_next:
            # step i+1's forward, from the metadata the sampler advanced (this step's PREFIX)
            self._forward_launch(next_bs, self._prefix_staged)()
        elif gate is not None:
            gate.launch()  # the same forward, run or skipped by the device on the sampled token
        if cuda:
            step.before_wait(self.step_done.query)
            self.step_done.synchronize()  # waits for the sampler, not for that forward
        tokens = self._tokens_np[:n].tolist()
        if prelaunch:
            nxt = ([tokens[i] for i in last], [positions[i] + 1 for i in last], [slots[i] for i in last])
            self._launch_next(step, tokens, nxt, next_bs, gate)
        return tokens

    def _stage(self, step: DecodeStep, token_ids: list[int], positions: list[int], slots: list[int],
               bs: int) -> list[int]:
        """Write the step's rows into the host staging, padded up to bucket `bs`; returns each
        sequence's last row."""
        n = len(token_ids)
        self._set_padding(n, bs)
        meta = self._meta_np
        _put_rows(meta, n, token_ids, positions, slots)
        if n < 64:  # each sequence's last row (numpy's fixed cost pays only for many rows)
            last = [i for i in range(n) if i == n - 1 or slots[i + 1] != slots[i]]
        else:
            staged = meta[SLOTS, :n]
            last = [*np.flatnonzero(staged[1:] != staged[:-1]).tolist(), n - 1]
        meta[PREFIX, 0] = self._prefix_staged = self._prefix(meta, n)
        # Row by row: numpy converts a tuple of lists element by element through a generic
        # path, several times slower than one list a row at a step's hundreds of rows.
        meta[SEEDS, :n] = step.seeds
        meta[HAS_MASK, :n] = step.has_mask
        meta[NEXT, : len(last)] = last
        meta[NEXT, len(last) : n] = self.pad_column
        meta[GUESS, :2] = step.guess if step.guess is not None else (-1, 0)
        self._temp_np[:n] = step.temperatures
        return last

    def _prefix(self, meta: np.ndarray, n: int) -> int:
        """The common prefix of the first `n` rows staged in `meta`, which the decode attention
        reads once for all of them (0: none)."""
        return cascade_prefix(self.kv.pages, meta[SLOTS, :n], meta[POSITIONS, :n]) if self.cascade else 0

    def _copy_step(self, cuda: bool) -> None:
        """The staged metadata and temperatures to the device. Whole buffers: one contiguous
        copy each. When the forward is already queued this copy lands behind it and rewrites
        the rows it read with the same values (PREFIX may grow, as fewer sequences can share
        more pages; the one the forward read holds for its rows too)."""
        native = self._native
        if native is not None:
            native.ext.copy_async(*native.step_copies, native.stream)
        else:
            self.meta.copy_(self.host_meta, non_blocking=cuda)
            self.temperature.copy_(self.host_temperature, non_blocking=cuda)

    def _copy_masks(self, n: int, cuda: bool) -> None:
        """The filled host masks of the first `n` rows to the device, before the sampler."""
        native = self._native
        if native is not None:  # as below, in one call
            dst, src, row_bytes, side, event = native.mask
            native.ext.side_copy(dst, src, n * row_bytes, side, event, native.stream)
        elif cuda:
            # The side stream copies the mask while the forward still runs; the sampler
            # waits for the copy, and the copy never overwrites the buffer before the
            # previous step's sampler has read it (its step_done precedes our host sync).
            with torch.cuda.stream(self.copy_stream):
                self.bitmask[:n].copy_(self.host_bitmask[:n], non_blocking=True)
                self.mask_copied.record()
            torch.cuda.current_stream(self.device).wait_event(self.mask_copied)
        else:
            self.bitmask[:n].copy_(self.host_bitmask[:n])

    def _copy_tokens(self, bs: int, cuda: bool) -> None:
        """The sampled tokens to the host, behind the sampler."""
        native = self._native
        if native is not None:
            native.ext.copy_async(*native.tokens, 8 * bs, 0, 0, 0, native.stream)
            self.step_done.record()
        elif cuda:
            self.host_tokens[:bs].copy_(self.tokens[:bs], non_blocking=True)
            self.step_done.record()
        else:
            self.host_tokens[:bs].copy_(self.tokens[:bs])

    def _gate(self, step: DecodeStep, prelaunch: bool, last: list[int]) -> Any:
        """The token gate where this step's next forward goes behind it: one sequence in a
        wide grammar state, whose next step is the bucket-1 forward; else None."""
        gate = self.token_gate
        if (gate is None or not step.plans_next or not step.gate_next or not prelaunch or len(last) != 1
                or not self.use_token_gate
                or not step.has_mask[last[0]] or not gate.wide(self._bitmask_words[last[0]])):
            return None
        return gate

    def _launch_next(self, step: DecodeStep, tokens: list[int], predicted: StepRows, next_bs: int,
                     gate: Any) -> None:
        """After a pre-launching step: launch the next step's forward the host planned, or the
        `predicted` one (each sequence's sampled token at the next position), and note which
        forward is queued."""
        ids, pos, sl = predicted
        guess = step.guess
        if gate is not None and gate.went(ids[0]) and (guess is None or tokens[guess[0]] == guess[1]):
            # The forward is running: the host's plan only decides whether it was wasted.
            self.gate_runs += 1
            planned = self._planned(step, tokens)
            if planned is not None and planned == predicted:
                self._ahead = (next_bs, tuple(sl), tuple(pos), tuple(ids))
                return
            self.gate_wasted += 1
            if planned is not None:
                self._launch_planned(*planned)
            return
        if step.plans_next:
            planned = self._planned(step, tokens)
            if planned is None:
                return
            if planned != predicted:
                self._launch_planned(*planned)  # forced text, or fewer sequences
                return
            self._forward_launch(next_bs, self._prefix_staged)()  # the predicted step: the sampler advanced its metadata
        self._ahead = (next_bs, tuple(sl), tuple(pos), tuple(ids))

    @staticmethod
    def _planned(step: DecodeStep, tokens: list[int]) -> StepRows | None:
        """The next step's rows as `step.plan_next` plans them (None: it does not know)."""
        rows = step.plan_next(tokens)
        return None if rows is None else step_rows(rows)

    def _launch_planned(self, token_ids: list[int], positions: list[int], slots: list[int]) -> None:
        """Launch the forward of a next step the host planned (forced text, fewer sequences):
        its rows go through `host_plan`, so the next `run` can rewrite host_meta at once."""
        n = len(token_ids)
        bs = self.bucket(n)
        pages = self.kv.pages
        ends = dict(zip(slots, positions, strict=True))  # each slot's last row: its rows are adjacent, in order
        if bs is None or n == 0 or not all(pages.cover(s, p + 1) for s, p in ends.items()):
            return  # (no page for forced text: the next schedule makes room first)
        pages.sync()
        plan = self._plan_np  # whole rows (contiguous, one copy), padding from row n on
        self._set_padding(n, None, plan)
        _put_rows(plan, n, token_ids, positions, slots)
        plan[PREFIX, 0] = prefix = self._prefix(plan, n)
        if self._native is not None:
            self._native.ext.copy_async(*self._native.plan_copy, 0, 0, 0, self._native.stream)
        else:
            self.meta[: PREFIX + 1].copy_(self.host_plan, non_blocking=self.device.type == "cuda")
        self._forward_launch(bs, prefix)()
        self._ahead = (bs, tuple(slots), tuple(positions), tuple(token_ids))
