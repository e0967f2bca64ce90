"""ModelRunner: owns the model weights and KV cache on one device and runs the engine's one
primitive, `extend`: for each sequence, push its next k >= 1 tokens through the model at the
positions after its cached prefix and return logits for the positions asked for. Prefill
chunks, decode tokens, jump-forward text and draft tokens to verify are all `extend` calls.

`decode` is the fast path of the commonest step, one new token per sequence: it samples on
the device under the grammar masks and returns tokens, through CUDA graphs (cuda_graphs.py)
on CUDA and through `extend` + the same sampling rule elsewhere."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from structgen.engine.attention import AttentionBatch
from structgen.engine.config import EngineConfig, ModelConfig
from structgen.engine.kernels import batch_invariant, triton_enabled, use_batch_invariant
from structgen.engine.kv_cache import KVCache
from structgen.engine.models.llama import skip_init
from structgen.engine.sampler import mask_padding_

log = logging.getLogger("structgen.engine")

if TYPE_CHECKING:
    from structgen.engine.decode_step import DecodeStep
    from structgen.engine.guided_loop import LoopStep

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ExtendSeq:
    slot: int
    start: int  # position of the first new token (= tokens already cached)
    token_ids: list[int]
    num_logits: int = 1  # logits for the last `num_logits` new tokens


def pick_device(config: EngineConfig) -> torch.device:
    if config.device:
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype:
        return _DTYPES[config.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, model_dir: Path | None = None,
                 text_vocab_size: int | None = None):
        self.model_config = model_config
        self.config = config
        # The tokenizer's vocabulary (tokenizer_conformance.py); logits past it are masked.
        self.text_vocab_size = text_vocab_size or model_config.vocab_size
        self.device = pick_device(config)
        self.dtype = pick_dtype(config, self.device)
        self.max_seq_len = min(config.max_seq_len, model_config.max_position_embeddings)
        use_batch_invariant(config.batch_invariant)  # before the model picks its kernels
        self.model = self._build_model(model_dir)
        self.kv = KVCache(model_config, self._num_slots(), self.max_seq_len, self.dtype, self.device)
        self.forward_passes = 0
        # The Triton kernels (and so the graphs, which use them) take power-of-two head sizes;
        # others (Phi-3-mini's 96) run eagerly through torch and SDPA.
        self.head_dim_fits_kernels = model_config.head_dim & (model_config.head_dim - 1) == 0
        self.model.use_fused_kernels(triton_enabled(self.device) and self.head_dim_fits_kernels)
        self.graphs = None  # DecodeGraphs once captured (CUDA + use_cuda_graphs)
        self._eager_bitmask: torch.Tensor | None = None  # the eager decode path's mask rows
        self._token_gate: tuple | None = None  # (quiet tokens, min allowed) once asked for
        if self.device.type == "cuda" and config.use_cuda_graphs and triton_enabled(self.device) and self.head_dim_fits_kernels:
            self.capture_decode_graphs()

    def _build_model(self, model_dir: Path | None) -> torch.nn.Module:
        from structgen.engine.models.registry import model_class

        cls = model_class(self.model_config)
        with skip_init(self.dtype), self.device:
            model = cls(self.model_config, max_positions=self.max_seq_len)
        if model_dir is None:
            model.init_random_weights()
        else:
            from structgen.engine.models.loader import load_weights

            packed = getattr(cls, "takes_packed_weights", False) and self.keeps_weights_quantized()
            weights = load_weights(model_dir, dtype=self.dtype, device=self.device, keep_quantized=packed)
            model.load_hf_weights(weights)
        return model.eval()

    def keeps_weights_quantized(self) -> bool:
        """Whether packed GGUF weights stay packed: on the CPU where the kernels build, unless
        `EngineTuning.quantized_weights` is off (and for model classes that take them)."""
        if self.device.type != "cpu" or not self.config.tuning.quantized_weights:
            return False
        from structgen.engine.kernels import cpu_quant

        return cpu_quant.load() is not None

    def _num_slots(self) -> int:
        if self.device.type != "cuda":
            return self.config.max_batch_size
        free, _ = torch.cuda.mem_get_info(self.device)
        per_slot = KVCache.bytes_per_slot(self.model_config, self.max_seq_len, self.dtype)
        fit = int(free * self.config.kv_cache_memory_fraction) // per_slot - 1  # - the scratch slot
        if fit < 1:
            from structgen.errors import EngineError

            raise EngineError("not enough GPU memory for one KV slot; lower max_seq_len")
        return max(1, min(self.config.max_batch_size, fit))

    @torch.inference_mode()
    def extend(self, seqs: list[ExtendSeq]) -> torch.Tensor:
        """Run the new tokens of every sequence; return float32 logits [sum(num_logits), vocab]."""
        if self.graphs is not None:
            self.graphs.discard_ahead()  # this forward changes what a pre-launched one assumed
        flat: list[int] = []
        logit_rows: list[int] = []
        for s in seqs:
            flat.extend(s.token_ids)
            logit_rows.extend(range(len(flat) - s.num_logits, len(flat)))
        spans = [(s.slot, s.start, len(s.token_ids)) for s in seqs]
        if batch_invariant() and self._use_decode_kernel([]):  # every token attends as its own row
            spans = [(slot, start + j, 1) for slot, start, n in spans for j in range(n)]
        batch = AttentionBatch.build(spans, self.device, decode_kernel=self._use_decode_kernel(spans))
        input_ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, batch, self.kv)
        if len(logit_rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(logit_rows, dtype=torch.long, device=self.device)]
        self.forward_passes += 1
        return mask_padding_(self.model.logits(hidden), self.text_vocab_size)

    def _use_decode_kernel(self, spans: list[tuple[int, int, int]]) -> bool:
        """Whether the decode attention kernel runs these (slot, start, new tokens) spans."""
        if self.device.type != "cuda" or any(n != 1 for _, _, n in spans):
            return False
        from structgen.engine.kernels import decode_attention_available

        return self.head_dim_fits_kernels and decode_attention_available()

    def mask_buffer(self, rows: int) -> torch.Tensor:
        """The host bitmask (int32 [>= rows, W], pinned on CUDA) whose first `rows` rows a
        decode step of `rows` rows fills: the graphs' staging, or the eager path's own. It
        persists, so masks can be filled into it before the step (`Engine._take_tokens`)."""
        if self.graphs is not None and self.graphs.bucket(rows) is not None:
            return self.graphs.host_bitmask
        if self._eager_bitmask is None or self._eager_bitmask.shape[0] < rows:
            from structgen.grammar.backends.base import allocate_bitmask

            self._eager_bitmask = allocate_bitmask(max(rows, self.config.max_batch_size), self.model_config.vocab_size)
        return self._eager_bitmask

    def capture_decode_graphs(self, capture: bool = True) -> None:
        """Capture decode graphs at the configured sizes a step can use: rows are requests
        plus their forced or draft tokens, so sizes up to the first >= 4x the slot count; all
        of them with `prefill_in_graphs` (a prompt is a row per token)."""
        from structgen.engine.cuda_graphs import DecodeGraphs

        sizes = sorted(self.config.tuning.cuda_graph_batch_sizes)
        rows = 4 * self.kv.num_slots  # a step's rows: requests x (1 + forced or draft tokens)
        keep = sizes if self.config.tuning.prefill_in_graphs else [b for b in sizes if b < rows] + [b for b in sizes if b >= rows][:1]
        if keep:
            self.graphs = DecodeGraphs(self, tuple(keep), capture=capture)
            log.info("captured decode graphs for batch sizes %s", keep)
            if self._token_gate is not None:
                self.graphs.enable_token_gate(*self._token_gate)

    def set_token_gate(self, quiet: np.ndarray, min_allowed: int) -> None:
        """Jump-forward at batch 1: let the device run the next forward at once after tokens
        in `quiet` sampled in wide grammar states (cuda_graphs.py, `enable_token_gate`), now
        and in graphs captured later. A no-op without graphs or the CUDA extension."""
        self._token_gate = (quiet, min_allowed)
        if self.graphs is not None:
            self.graphs.enable_token_gate(quiet, min_allowed)

    def run_guided(self, first: LoopStep, bucket: int, max_steps: int) -> int:
        """Run `first` and the steps its `take` plans in the capturable mode's loop
        (guided_loop.py) over `bucket` rows; returns how many steps ran."""
        loop = self.graphs.guided_loop(bucket)
        before = loop.steps
        try:
            return loop.run(first, max_steps)
        finally:  # a failed run still ran its steps
            self.forward_passes += loop.steps - before
            self.graphs.steps += loop.steps - before

    @torch.inference_mode()
    def decode(self, step: DecodeStep) -> list[int]:
        """One decode step that returns tokens instead of logits: every row of `step` has
        exactly one new token, sampled as `step` says under its grammar mask (decode_step.py).
        Through the decode graphs where a captured size fits (`step`'s other phases run there),
        else an eager `extend` and the same sampling rule."""
        if self.graphs is not None and self.graphs.bucket(len(step.rows)) is not None:
            self.forward_passes += 1
            return self.graphs.run(step)
        from structgen.engine.sampler import sample_tokens_reference

        seqs = step.rows
        logits = self.extend(seqs)
        bitmask = self.mask_buffer(len(seqs))[: len(seqs)]
        if any(step.has_mask):
            step.fill_masks(bitmask)
        dev = self.device
        args = (
            bitmask.to(dev, non_blocking=True),
            torch.tensor(step.has_mask, dtype=torch.int32, device=dev),
            torch.tensor(step.temperatures, dtype=torch.float32, device=dev),
            torch.tensor(step.seeds, dtype=torch.int64, device=dev),
        )
        if triton_enabled(dev):
            from structgen.engine.kernels.sampling import sample_tokens

            return sample_tokens(logits, *args).tolist()
        return sample_tokens_reference(logits, *args).tolist()
