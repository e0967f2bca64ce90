"""A Llama-family step of a few rows (a decode step, drafts to verify, a short prompt) on the
CPU as one native call (`sgq_decode_layers` in `structgen/csrc/quant_matmul.cpp`): every
layer's norms, packed products, RoPE, KV write, attention over the paged cache, SiLU * up and
residual adds, in one OpenMP region.

A CPU decode step of a small model is bound by the host cost of the ~50 small torch ops each of
its layers runs, not by its weights; here a layer costs a few barriers instead. The torch
layers stay the reference: the tests compare a step through `CpuDecoder` with the model's own
forward on the same cache.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import torch

from structgen.engine.kernels.cpu_quant import FORMATS, IntegerActivations, QuantKernels

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("pad", ctypes.c_int32), ("w", _ptr), ("rows", _i64),
                ("cols", _i64), ("row_bytes", _i64), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("attn_norm", _ptr), ("mlp_norm", _ptr), ("k_cache", _ptr), ("v_cache", _ptr),
                ("window", _i64)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("inter", _i64), ("eps", ctypes.c_float), ("pad", ctypes.c_int32)]


class _Rows(ctypes.Structure):
    _fields_ = [("n", _i64), ("positions", _ptr), ("token_slots", _ptr), ("slots", _ptr),
                ("page_table", _ptr), ("table_stride", _i64), ("page_size", _i64), ("cos", _ptr),
                ("sin", _ptr)]


@dataclass(frozen=True)
class PackedMatrix:
    """A weight `[rows, cols]` as GGUF blocks (`packed`, uint8 `[rows, row_bytes]`), with an
    optional fp32 bias."""

    packed: torch.Tensor
    qtype: str
    cols: int
    bias: torch.Tensor | None = None


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One layer: fused qkv and gate_up projections, fp32 norm weights and its fp32 KV cache
    pools (`[pages, page_size, kv_heads, head_dim]`); `window` 0 for full attention."""

    qkv: PackedMatrix
    o: PackedMatrix
    gate_up: PackedMatrix
    down: PackedMatrix
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    window: int = 0


@dataclass(frozen=True)
class DecodeRows:
    """A step's new tokens, one row each (int64 CPU tensors): position, cache row and the
    page-table row of its sequence; each attends to its sequence's keys up to its position, so
    several rows of one sequence (drafts to verify, a short prompt) are causal among themselves.
    With the page table and the RoPE tables (fp32 `[positions, head_dim]`, rotate-half layout)."""

    positions: torch.Tensor
    token_slots: torch.Tensor
    slots: torch.Tensor
    page_table: torch.Tensor
    page_size: int
    cos: torch.Tensor
    sin: torch.Tensor

    def reordered(self, order: torch.Tensor) -> DecodeRows:
        """These rows in `order` (row i of the result is row order[i])."""
        return replace(self, positions=self.positions[order].contiguous(),
                       token_slots=self.token_slots[order].contiguous(), slots=self.slots[order].contiguous())


def _linear(m: PackedMatrix) -> _Linear:
    bias = None if m.bias is None else m.bias.data_ptr()
    return _Linear(FORMATS[m.qtype], 0, m.packed.data_ptr(), m.packed.shape[0], m.cols, m.packed.stride(0), bias)


class CpuDecoder:
    """The decoder layers of one model over one KV cache, run as a decode step in place on the
    residual stream. Holds the tensors whose addresses the native side keeps."""

    def __init__(self, kernels: QuantKernels, shape: DecoderShape, layers: list[DecoderLayerWeights],
                 activations: IntegerActivations | None = None):
        for layer in layers:
            for t in (layer.attn_norm, layer.mlp_norm, layer.k_cache, layer.v_cache):
                if t.dtype != torch.float32 or not t.is_contiguous():
                    raise ValueError("the CPU decoder takes contiguous fp32 norms and KV caches")
        # What steps of several rows multiply (QuantKernels.matmul); None: fp32 activations.
        self._kernels, self._layers, self._activations = kernels, layers, activations
        self._shape = _Shape(shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate,
                             shape.eps, 0)
        self._specs = (_Layer * len(layers))(*[
            _Layer(_linear(w.qkv), _linear(w.o), _linear(w.gate_up), _linear(w.down), w.attn_norm.data_ptr(),
                   w.mlp_norm.data_ptr(), w.k_cache.data_ptr(), w.v_cache.data_ptr(), w.window)
            for w in layers])

    def run(self, hidden: torch.Tensor, rows: DecodeRows, threads: int = 0,
            integer_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`hidden` ([n, hidden] fp32, contiguous), the residual stream of the step's rows after
        the embedding, becomes the last layer's output stream; k and v of every layer go to the
        cache. `integer_rows` (bool [n]; None: all) says which rows' products may multiply
        integer activations (the decoder's `activations`); the others' stay fp32 in any step."""
        if hidden.dtype != torch.float32 or not hidden.is_contiguous():
            raise ValueError("the CPU decoder runs on a contiguous fp32 residual stream")
        longs = (rows.positions, rows.token_slots, rows.slots)
        if any(t.dtype != torch.int64 or not t.is_contiguous() for t in (*longs, rows.page_table)):
            raise ValueError("the CPU decoder's row tensors are contiguous int64")
        lead, order = hidden.shape[0], None
        if integer_rows is not None and self._activations is not None:  # fp32 activations: no reorder
            lead = int(integer_rows.sum())
            if 0 < lead < hidden.shape[0]:  # the native side takes the integer rows first
                order = torch.cat([integer_rows.nonzero().flatten(), (~integer_rows).nonzero().flatten()])
                hidden, rows = hidden[order].contiguous(), rows.reordered(order)
        self._run(hidden, rows, threads, lead)
        if order is None:
            return hidden
        restored = torch.empty_like(hidden)
        restored[order] = hidden
        return restored

    def _run(self, hidden: torch.Tensor, rows: DecodeRows, threads: int, lead: int) -> None:
        spec = _Rows(hidden.shape[0], rows.positions.data_ptr(), rows.token_slots.data_ptr(), rows.slots.data_ptr(),
                     rows.page_table.data_ptr(), rows.page_table.stride(0), rows.page_size, rows.cos.data_ptr(),
                     rows.sin.data_ptr())
        rc = self._kernels.decode_layers(ctypes.byref(self._shape), self._specs, len(self._layers),
                                         ctypes.byref(spec), hidden.data_ptr(),
                                         threads or torch.get_num_threads(), self._activations, lead)
        if rc != 0:
            raise ValueError("a layer's weight format or shape is not one the CPU decoder runs")
