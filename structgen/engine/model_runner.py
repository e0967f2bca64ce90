"""ModelRunner: owns the model weights and KV cache on one device and runs the engine's one
primitive, `extend`: for each sequence, push its next k >= 1 tokens through the model at the
positions after its cached prefix and return logits for the positions asked for. Prefill
chunks, decode tokens, jump-forward text and draft tokens to verify are all `extend` calls.

`decode` is the fast path of the commonest step, one new token per sequence: it samples on
the device under the grammar masks and returns tokens, through CUDA graphs (cuda_graphs.py)
on CUDA and through `extend` + the same sampling rule elsewhere."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from structgen.engine.attention import AttentionBatch
from structgen.engine.config import EngineConfig, ModelConfig, device_batch_size
from structgen.engine.kernels import batch_invariant, triton_enabled, use_batch_invariant
from structgen.engine.kv_cache import PAGE_SIZE, KVCache
from structgen.engine.models.llama import skip_init
from structgen.engine.page_table import PageTable
from structgen.engine.sampler import mask_padding_
from structgen.errors import InvalidParameterError

log = logging.getLogger("structgen.engine")

if TYPE_CHECKING:
    from structgen.engine.decode_step import DecodeStep
    from structgen.engine.guided_loop import LoopStep
    from structgen.engine.parallel import TensorParallel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# With prompts in the decode graphs, graphs up to this many rows are captured however few the
# KV slots: the largest graph caps a step's prompt tokens.
PREFILL_ROWS = 256
# Set in a child forked after a model ran here: its torch runs on one thread (`_guard_forks`).
_FORKED_AFTER_A_MODEL = False


@dataclass(slots=True)  # a step builds one a request (a decode step of 256 requests: 256)
class ExtendSeq:
    slot: int
    start: int  # position of the first new token (= tokens already cached)
    token_ids: list[int]
    num_logits: int = 1  # logits for the last `num_logits` new tokens


def batch_size_on(config: EngineConfig, device: torch.device) -> int:
    """Requests decoded at once on `device`: `config.max_batch_size`, or where None
    `device_batch_size` of its memory."""
    if config.max_batch_size is not None:
        return config.max_batch_size
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return device_batch_size(memory)


def pick_device(config: EngineConfig) -> torch.device:
    """The configured device where this host has it (`InvalidParameterError` naming those it
    has otherwise), else CUDA if available, else the CPU."""
    if not config.device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # EngineConfig checked the name: "cpu", "cuda" or "cuda:N". N is read here, not by torch,
    # which keeps a device index in 8 bits: torch.device("cuda:4096") is cuda:0.
    kind, _, number = config.device.partition(":")
    index = int(number) if number else None
    if kind == "cuda" and not _cuda_has(index):
        seen = f"torch sees {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "torch sees no CUDA GPU"
        raise InvalidParameterError(f"EngineConfig.device={config.device!r}, but {seen} on this host; pass one of "
                                    f"{', '.join(map(repr, available_devices()))} (or None for the default)")
    return torch.device(kind, index)


def _cuda_has(index: int | None) -> bool:
    return torch.cuda.is_available() and (index or 0) < torch.cuda.device_count()


def available_devices() -> list[str]:
    """The `EngineConfig.device` values this host can run: "cpu" and each visible GPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu"] + (["cuda"] + [f"cuda:{i}" for i in range(gpus)] if gpus else [])


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype:
        return _DTYPES[config.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, model_dir: Path | None = None,
                 text_vocab_size: int | None = None, tensor_parallel: TensorParallel | None = None):
        self.model_config = model_config
        self.config = config
        # This rank's share of the model under tensor parallelism (engine/parallel.py): its
        # model and KV cache are built from `rank_config`, its heads only.
        self.tensor_parallel = tensor_parallel
        self.rank_config = model_config if tensor_parallel is None else tensor_parallel.shard_config(model_config)
        # The tokenizer's vocabulary (tokenizer_conformance.py); logits past it are masked.
        self.text_vocab_size = text_vocab_size or model_config.vocab_size
        self.device = pick_device(config) if tensor_parallel is None else tensor_parallel.device
        self.max_batch_size = batch_size_on(config, self.device)
        self.dtype = pick_dtype(config, self.device)
        self.max_seq_len = min(config.max_seq_len, model_config.max_position_embeddings)
        self._check_sizes()  # before anything is allocated
        _guard_forks()
        if _FORKED_AFTER_A_MODEL:
            log.warning("this process is a fork of one that ran a model, so torch runs on one thread here (its "
                        "thread pool does not pass to a fork); to use every core, fork before creating any "
                        "LLM (gunicorn without --preload), or start processes with multiprocessing's 'spawn'")
        use_batch_invariant(config.batch_invariant)  # before the model picks its kernels
        self.model = self._build_model(model_dir)
        num_pages = self._num_pages()
        if tensor_parallel is not None:  # every rank the same pages, so the same page decisions
            num_pages = tensor_parallel.smallest(num_pages)
            tensor_parallel.prepare_peer_sum(self.dtype, model_config.hidden_size,
                                             config.tuning.tensor_parallel_all_reduce)
        pages = PageTable(num_pages, PAGE_SIZE, self.max_batch_size, self.max_seq_len, self.device,
                          prefix_caching=self._prefix_caching())
        self.kv = KVCache(self.rank_config, pages, self.dtype, self.device)
        if tensor_parallel is not None:
            tensor_parallel.pages = pages
        self.forward_passes = 0
        # The Triton kernels (and so the graphs, which use them) take power-of-two head sizes;
        # others (Phi-3-mini's 96) run eagerly through torch and SDPA.
        self.head_dim_fits_kernels = model_config.head_dim & (model_config.head_dim - 1) == 0
        self.model.use_fused_kernels(triton_enabled(self.device) and self.head_dim_fits_kernels)
        if self.device.type == "cpu":
            from structgen.engine.kernels.cpu_quant import PROMPT_ACTIVATIONS
            from structgen.engine.models.quantized import use_integer_activations

            # Integer activations round a row differently by the step's row count.
            chosen = "fp32" if config.batch_invariant else config.tuning.prompt_activations
            use_integer_activations(self.model, PROMPT_ACTIVATIONS[chosen])
        self.graphs = None  # DecodeGraphs once captured (CUDA + use_cuda_graphs)
        self._eager_bitmask: torch.Tensor | None = None  # the eager decode path's mask rows
        self._token_gate: tuple | None = None  # (quiet tokens, min allowed) once asked for
        if self.device.type == "cuda" and config.use_cuda_graphs and triton_enabled(self.device) and self.head_dim_fits_kernels:
            self.capture_decode_graphs()

    def _build_model(self, model_dir: Path | None) -> torch.nn.Module:
        from structgen.engine.models.registry import model_class

        cls = model_class(self.model_config)
        tp = self.tensor_parallel
        if model_dir is None and self.config.quantization:
            return self._random_quantized_model(cls).eval()
        with skip_init(self.dtype), self.device:
            model = cls(self.rank_config, max_positions=self.max_seq_len)
            if tp is not None:
                from structgen.engine.models.sharding import apply_tensor_parallel

                apply_tensor_parallel(model, tp)
        if model_dir is None:
            model.init_random_weights(seed=0 if tp is None else tp.rank)
        else:
            from structgen.engine.models.loader import load_weights

            # Packed weights stay packed (not under tensor parallelism: packed layers do not split).
            packed = getattr(cls, "takes_packed_weights", False) and self.config.tuning.quantized_weights and tp is None
            weights = load_weights(model_dir, dtype=self.dtype, device=self.device, keep_quantized=packed,
                                   gguf_packed_on_cuda=self.config.tuning.gguf_packed_on_cuda,
                                   shard=None if tp is None else tp.weight_shard())
            if self.config.quantization:
                weights = self._quantize_at_load(weights, packed)
            model.load_hf_weights(weights)
        return model.eval()

    def _quantize_at_load(self, weights: dict, packed: bool) -> dict:
        """`EngineConfig.quantization`: the float projections quantized (models/hf_quantized.py)."""
        from structgen.engine.models.hf_quantized import quantize_linear_weights
        from structgen.errors import ModelLoadError

        if not packed:
            raise ModelLoadError(f"EngineConfig(quantization={self.config.quantization!r}) needs a Llama-family "
                                 f"model and EngineTuning(quantized_weights=True); "
                                 f"{self.model_config.architecture} loads float weights only: pass quantization=None")
        return quantize_linear_weights(weights, self.config.quantization)

    def _random_quantized_model(self, cls: type) -> torch.nn.Module:
        """Random weights of the real shapes (speed work), the decoder's projections quantized
        as each is drawn: the model is laid out on the meta device first, so a model whose
        float weights would not fit the device (Llama-70B's shape) fits quantized."""
        from torch import nn

        from structgen.engine.models.llama import RotaryEmbedding
        from structgen.engine.models.packed import QUANTIZERS
        from structgen.engine.models.quantized import adopt_linear
        from structgen.errors import ModelLoadError

        if not getattr(cls, "takes_packed_weights", False):
            raise ModelLoadError(f"EngineConfig(quantization=...) runs Llama-family models; "
                                 f"{self.model_config.architecture} loads float weights only: pass quantization=None")
        with skip_init(self.dtype), torch.device("meta"):
            model = cls(self.model_config, max_positions=self.max_seq_len)
        quantize = QUANTIZERS[self.config.quantization]
        gen = torch.Generator(device=self.device).manual_seed(0)
        for layer in model.layers:
            for owner in (layer.self_attn, layer.mlp):
                for attr, child in list(owner.named_children()):
                    if isinstance(child, nn.Linear):
                        w = torch.empty(child.weight.shape, dtype=self.dtype, device=self.device)
                        adopt_linear(owner, attr, quantize(w.normal_(0.0, 0.02, generator=gen)))
        model.to_empty(device=self.device)  # what stays float: embedding, norms, LM head, biases
        model.init_random_weights()
        model.rope = RotaryEmbedding(self.model_config, self.max_seq_len).to(self.device)
        return model

    def _num_pages(self) -> int:
        """Pages of the KV pool, the scratch page included: `kv_cache_tokens` where set, else
        a full context for every request, but no more than `kv_cache_memory_fraction` of the
        free memory holds (GPU memory on CUDA; on the CPU the memory available to processes:
        the pool's pages cost memory once used, and the prefix cache keeps them, so a CPU
        server's resident size grew toward the whole pool, 12 GB for SmolLM2's defaults)."""
        from structgen.errors import EngineError

        per_seq = -(-self.max_seq_len // PAGE_SIZE)
        full = self.max_batch_size * per_seq
        fraction = self.config.kv_cache_memory_fraction
        if self.config.kv_cache_tokens is not None:
            fit, source = self.config.kv_cache_tokens // PAGE_SIZE, f"kv_cache_tokens={self.config.kv_cache_tokens}"
        else:
            free, where = _free_memory(self.device)
            if free is None:
                return full + 1
            fit = min(full, int(free * fraction) // KVCache.bytes_per_page(self.rank_config, PAGE_SIZE, self.dtype))
            source = f"kv_cache_memory_fraction={fraction} of free {where}"
        if fit < per_seq:
            raise EngineError(f"the KV cache holds {fit} pages of {PAGE_SIZE} tokens ({source}), fewer than one "
                              f"context of max_seq_len={self.max_seq_len} needs ({per_seq}); lower max_seq_len "
                              "or give the cache more room")
        return fit + 1

    def _check_sizes(self) -> None:
        """Refuse a `max_batch_size` whose per-request tables, or a `kv_cache_tokens` whose KV
        pool, cannot fit this host before anything is allocated: the allocation's own failure
        (a bare MemoryError, or terabytes asked of the OS) names no setting to lower."""
        slots = self.max_batch_size
        host_free, where = _free_memory(torch.device("cpu"))
        per_slot = self._bytes_per_slot()
        if host_free is not None and slots * per_slot > host_free:
            raise InvalidParameterError(
                f"EngineConfig.max_batch_size={slots} needs {_size(slots * per_slot)} of per-request tables "
                f"({_size(per_slot)} a request at max_seq_len={self.max_seq_len}), more than the {_size(host_free)} "
                f"of free {where}; at most about {host_free // per_slot:,} requests fit: lower max_batch_size "
                "(requests past it wait in a queue)")
        tokens = self.config.kv_cache_tokens
        if tokens is None:
            return
        per_page = KVCache.bytes_per_page(self.rank_config, PAGE_SIZE, self.dtype)
        need = (tokens // PAGE_SIZE + 1) * per_page
        room, what = self._kv_room()
        if room is not None and need > room:
            raise InvalidParameterError(
                f"EngineConfig.kv_cache_tokens={tokens} needs a KV pool of {_size(need)} "
                f"({_size(per_page // PAGE_SIZE)} a token for this model in {str(self.dtype).removeprefix('torch.')}), "
                f"more than the {_size(room)} of {what}; at most about {room // per_page * PAGE_SIZE:,} tokens "
                "fit: lower kv_cache_tokens, or leave it None to size the pool from kv_cache_memory_fraction")

    def _bytes_per_slot(self) -> int:
        """Memory a KV slot's own tables take however many pages it uses: its page-table row
        (and its device copy on CUDA) and its rows of the eager grammar mask."""
        pages = -(-self.max_seq_len // PAGE_SIZE)
        mask_words = -(-self.model_config.vocab_size // 32)
        return pages * 8 * (2 if self.device.type == "cuda" else 1) + mask_words * 4

    def _kv_room(self) -> tuple[int | None, str]:
        """What an explicit KV pool may take: free GPU memory on CUDA (it is allocated at once);
        on the CPU the host's total memory, since its untouched pages cost nothing until used."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0], "free GPU memory"
        total = _meminfo("MemTotal")
        return total, "memory on this host (MemTotal)"

    def _prefix_caching(self) -> bool:
        """Whether pages are shared through the prefix cache: as configured, but not with a
        draft model, whose own cache would need the prompts the target skips."""
        spec = self.config.speculative
        return self.config.prefix_caching and (spec is None or spec.method not in ("draft_model", "self_draft"))

    @torch.inference_mode()
    def extend(self, seqs: list[ExtendSeq]) -> torch.Tensor:
        """Run the new tokens of every sequence; return float32 logits [sum(num_logits), vocab]."""
        if self.graphs is not None:
            self.graphs.discard_ahead()  # this forward changes what a pre-launched one assumed
        self._cover(seqs)  # before the workers are told: they follow rank 0's page table
        if self.tensor_parallel is None:
            return self._extend(seqs)
        with self.tensor_parallel.extending(seqs):  # the worker ranks run the same forward
            return self._extend(seqs)

    def _cover(self, seqs: list[ExtendSeq]) -> None:
        """Pages for every token of the forward (a tensor-parallel worker takes none: it
        adopts rank 0's table)."""
        if self.tensor_parallel is not None and self.tensor_parallel.rank > 0:
            return
        for s in seqs:
            if not self.kv.pages.cover(s.slot, s.start + len(s.token_ids)):
                from structgen.errors import EngineError

                raise EngineError("the KV cache has no free page for this forward; the scheduler reserves them")

    def _extend(self, seqs: list[ExtendSeq]) -> torch.Tensor:
        flat: list[int] = []
        logit_rows: list[int] = []
        for s in seqs:
            flat.extend(s.token_ids)
            logit_rows.extend(range(len(flat) - s.num_logits, len(flat)))
        pages = self.kv.pages
        spans = [(s.slot, s.start, len(s.token_ids)) for s in seqs]
        if batch_invariant() and self._use_decode_kernel([]):  # every token attends as its own row
            spans = [(slot, start + j, 1) for slot, start, n in spans for j in range(n)]
        batch = AttentionBatch.build(spans, pages, decode_kernel=self._use_decode_kernel(spans),
                                     cascade=self.config.tuning.cascade_attention)
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

            self._eager_bitmask = allocate_bitmask(max(rows, self.max_batch_size), self.model_config.vocab_size)
        return self._eager_bitmask

    def capture_decode_graphs(self, capture: bool = True) -> None:
        """Capture decode graphs at the configured sizes a step can use: rows are requests
        plus their forced or draft tokens, so sizes up to the first >= 4x the slot count, and
        with `prefill_in_graphs` (a prompt is a row per token) at least up to PREFILL_ROWS: the
        largest graph is a step's token budget, which a burst of prompts fills."""
        from structgen.engine.cuda_graphs import DecodeGraphs

        sizes = sorted(self.config.tuning.cuda_graph_batch_sizes)
        rows = 4 * self.kv.num_slots  # a step's rows: requests x (1 + forced or draft tokens)
        if self.config.tuning.prefill_in_graphs:
            rows = max(rows, PREFILL_ROWS)
        keep = [b for b in sizes if b < rows] + [b for b in sizes if b >= rows][:1]
        if keep:
            self.graphs = DecodeGraphs(self, tuple(keep), capture=capture, tensor_parallel=self.tensor_parallel,
                                       cascade=self.config.tuning.cascade_attention)
            log.info("captured decode graphs for batch sizes %s", keep)
            if self.tensor_parallel is not None:
                self.tensor_parallel.graph_holders.append(self)
            if self._token_gate is not None:
                self.graphs.enable_token_gate(*self._token_gate)

    def release_memory(self) -> None:
        """Drop the graphs, the model and the KV cache (the engine is closed: nothing runs a
        forward again); idempotent."""
        self.release_graphs()
        self.__dict__.pop("model", None)
        self.__dict__.pop("kv", None)

    def release_graphs(self) -> None:
        """Destroy the decode graphs (a split engine leaving its NCCL groups); forwards run
        eagerly afterwards."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def set_token_gate(self, quiet: np.ndarray, min_allowed: int) -> None:
        """Jump-forward at batch 1: let the device run the next forward at once after tokens
        in `quiet` sampled in wide grammar states (cuda_graphs.py, `enable_token_gate`), now
        and in graphs captured later. A no-op without graphs or the CUDA extension."""
        self._token_gate = (quiet, min_allowed)
        if self.graphs is not None:
            self.graphs.enable_token_gate(quiet, min_allowed)

    def run_guided(self, first: LoopStep, bucket: int, max_steps: int,
                   running: dict[int, tuple[int, int]] | None = None) -> int:
        """Run `first` and the steps its `take` plans in the capturable mode's loop
        (guided_loop.py) over `bucket` rows; returns how many steps ran. `running`: slot ->
        (most rows a step, last position now) of the requests the loop's steps may run, in
        `first` or joining later (a request in `first` reserves at least its rows there)."""
        loop = self.graphs.guided_loop(bucket)
        max_steps = self._reserve_pages(first, max_steps, running or {})
        before = loop.steps
        try:
            return loop.run(first, max_steps)
        finally:  # a failed run still ran its steps
            self.forward_passes += loop.steps - before
            self.graphs.steps += loop.steps - before

    def _reserve_pages(self, first: LoopStep, max_steps: int, running: dict[int, tuple[int, int]]) -> int:
        """Pages for the positions a guided loop of `max_steps` steps like `first`, with the
        `running` requests' rows, may reach (its steps are planned in host callbacks, which
        cannot copy a page table; a step reaching past them ends the run); where the pool
        cannot hold them, the loop runs one step."""
        pages = self.kv.pages
        in_first: dict[int, tuple[int, int]] = {}  # slot -> (its rows in `first`, last position)
        for slot, pos in zip(first.slots, first.positions, strict=True):
            rows, last = in_first.get(slot, (0, 0))
            in_first[slot] = (rows + 1, max(last, pos))
        ends = dict(running)  # slot -> (rows a step, last position)
        for slot, (rows, last) in in_first.items():
            most, now = ends.get(slot, (0, 0))
            ends[slot] = (max(most, rows), max(now, last))
        if not all(pages.cover(slot, last + 1 + max_steps * rows) for slot, (rows, last) in ends.items()):
            max_steps = 1
        pages.sync()
        return max_steps

    @torch.inference_mode()
    def decode(self, step: DecodeStep) -> list[int]:
        """One decode step that returns tokens instead of logits: every row of `step` has
        exactly one new token, sampled as `step` says under its grammar mask (decode_step.py).
        Through the decode graphs where a captured size fits (`step`'s other phases run there),
        else an eager `extend` and the same sampling rule."""
        if self.graphs is not None and self.graphs.bucket(step.num_rows) is not None:
            self.forward_passes += 1
            return self.graphs.run(step)
        from structgen.engine.sampler import sample_tokens_reference

        seqs = [ExtendSeq(s.slot, s.start + j, [t]) for s in step.rows for j, t in enumerate(s.token_ids)]
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


def _free_memory(device: torch.device) -> tuple[int | None, str]:
    """Bytes the KV pool may draw on: free GPU memory, or the memory the OS says is available
    to new allocations (Linux `MemAvailable`; None where unknown: the pool is then not capped)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], "GPU memory"
    available = _meminfo("MemAvailable")
    return (available, "memory (MemAvailable)") if available is not None else (None, "")


def _meminfo(key: str) -> int | None:
    """Bytes of a Linux /proc/meminfo line (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _size(n: int) -> str:
    """Bytes for a message: 1.5 GiB, 20.9 TiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    return f"{n} B"


@functools.cache
def _guard_forks() -> None:
    """Once a model is built in this process, a child forked from it runs torch on one thread:
    torch's CPU thread pool (OpenMP) does not pass to a fork, and the child's first parallel
    op would wait for the parent's threads forever (PyTorch's DataLoader workers and the
    tokenizers library go single-threaded in a forked child too)."""
    os.register_at_fork(after_in_child=_one_torch_thread)


def _one_torch_thread() -> None:
    global _FORKED_AFTER_A_MODEL
    torch.set_num_threads(1)
    _FORKED_AFTER_A_MODEL = True
