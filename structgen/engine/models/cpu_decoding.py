"""Which steps run as the native CPU step (kernels/cpu_decode.py), and its inputs from a
model's projections, KV cache and attention batch; which layers are eligible is the model's own
business (`LlamaModel.cpu_decoder`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from structgen.engine.attention import AttentionBatch
from structgen.engine.kernels import batch_invariant
from structgen.engine.kernels.cpu_decode import DecodeRows, PackedMatrix
from structgen.engine.kv_cache import KVCache
from structgen.engine.models.quantized import QuantizedLinear

if TYPE_CHECKING:
    from structgen.engine.models.llama import RotaryEmbedding


# Steps of more rows run the torch layers, whose products de-quantize each weight once for
# torch's GEMM: past about this many rows that beats the packed kernel (docs/performance.md).
MAX_NATIVE_ROWS = 64
# The native step attends row by row: over contexts past LONG_CONTEXT keys a step of many rows
# (a prompt's tail after a long cached prefix) runs faster through SDPA in the torch layers,
# while a lone decode row, or a request's drafts to verify, still runs faster natively
# (docs/performance.md, "Quantized weights on the CPU").
LONG_CONTEXT = 2_048
FEW_ROWS = 4  # a decode row and three drafts to verify: the same path as the decode rows alone
# A sequence's run of this many new tokens in one step is a prompt's chunk (a request's drafts to
# verify are fewer), whose products may multiply integer activations (`prompt_rows`).
PROMPT_RUN = 16


def runs_natively(hidden: torch.Tensor, batch: AttentionBatch) -> bool:
    """A step of a few rows (decode rows, drafts to verify, a short prompt) on the CPU, outside
    the batch-invariant mode (where a row's numbers must not depend on the kind of step), whose
    contexts are within LONG_CONTEXT keys or whose rows are FEW_ROWS at most."""
    rows = hidden.shape[0]
    if hidden.device.type != "cpu" or rows > MAX_NATIVE_ROWS or batch_invariant():
        return False
    return rows <= FEW_ROWS or batch.max_ctx <= LONG_CONTEXT


def packed_matrix(linear: torch.nn.Module) -> PackedMatrix | None:
    """A projection's weight as the native decoder takes it; None unless packed in one format run."""
    if not isinstance(linear, QuantizedLinear) or len(linear.parts) != 1:
        return None
    part = linear.parts[0]
    bias = None if linear.bias is None else linear.bias.data
    return PackedMatrix(part.packed, part.qtype, part.cols, bias)


def prompt_rows(batch: AttentionBatch) -> torch.Tensor:
    """The rows (bool [n]) of sequences running PROMPT_RUN new tokens or more in this step: a
    prompt's chunk. Only their products may round activations to integers, so a decode row, or
    a request's drafts to verify, computes the same numbers whatever runs beside it."""
    n = batch.positions.shape[0]
    seq = torch.arange(n) if batch.max_q == 1 else batch.pad_index // batch.max_q
    return torch.bincount(seq)[seq] >= PROMPT_RUN


def decode_rows(batch: AttentionBatch, rope: RotaryEmbedding, kv: KVCache) -> DecodeRows:
    """The native step's view of a batch: each row's sequence from its padded index."""
    slots = batch.slots if batch.max_q == 1 else batch.slots[batch.pad_index // batch.max_q]
    return DecodeRows(batch.positions, batch.token_slots, slots, batch.page_table, kv.pages.page_size,
                      rope.cos, rope.sin)
