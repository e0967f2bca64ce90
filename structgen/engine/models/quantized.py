"""Weights kept in a GGUF block format, and the layers that multiply by them on the CPU.

A `QuantizedWeight` is a weight matrix as its packed blocks (uint8 `[rows, row_bytes]`, the
GGUF layout) with its format and logical column count. `QuantizedLinear` and
`QuantizedEmbedding` stand in for `nn.Linear` / `nn.Embedding` where a model's weight is one:
activations are fp32, the product de-quantizes inside the kernel (kernels/cpu_quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from structgen.engine.kernels import cpu_quant
from structgen.engine.models import packed
from structgen.engine.models.packed import PackedWeight
from structgen.errors import ModelLoadError


@dataclass(frozen=True)
class QuantizedWeight:
    """A `[rows, cols]` weight stored as GGUF blocks of format `qtype` (one row per `packed` row)."""

    qtype: str
    packed: torch.Tensor
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight: by the native kernel where it builds, else by the reference."""
        kernels = cpu_quant.load()
        if kernels is not None:
            return kernels.dequantize(self.packed, self.qtype, self.cols)
        return cpu_quant.dequantize_reference(self.packed, self.qtype)


def _kernels_missing() -> ModelLoadError:
    return ModelLoadError("quantized weights need the native CPU kernels, which did not build here "
                          "(see the warning above); install g++ or pass EngineConfig(tuning=EngineTuning(quantized_weights=False))")


def stack_rows(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Row-concatenation of weights (fused q/k/v, gate/up): neighbours of one format are merged
    into one packed tensor; a mixed checkpoint keeps one part per format run."""
    out: list[QuantizedWeight] = []
    for p in parts:
        if out and out[-1].qtype == p.qtype and out[-1].cols == p.cols:
            out[-1] = QuantizedWeight(p.qtype, torch.cat([out[-1].packed, p.packed]), p.cols)
        else:
            out.append(p)
    return out


class QuantizedLinear(nn.Module):
    """`y = x @ W.T (+ bias)` for W given as row blocks of quantized weights."""

    def __init__(self, parts: list[QuantizedWeight], bias: torch.Tensor | None = None):
        super().__init__()
        if len({p.cols for p in parts}) != 1:
            raise ModelLoadError("the row blocks of a fused projection have different column counts; "
                                 "the checkpoint does not match config.json")
        self.parts = stack_rows(parts)
        self.in_features = self.parts[0].cols
        self.out_features = sum(p.shape[0] for p in self.parts)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.kernels = cpu_quant.load()
        if self.kernels is None:
            raise _kernels_missing()
        self.activations: cpu_quant.IntegerActivations | None = None  # use_integer_activations

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, self.in_features).float()
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        start = 0
        for p in self.parts:
            out = y[:, start:start + p.shape[0]]
            if x2.shape[0] > cpu_quant.MAX_KERNEL_ROWS and not self._integer(p, x2.shape[0]):
                torch.matmul(x2, p.dequantize().T, out=out)
            else:
                self.kernels.matmul(x2, p.packed, p.qtype, p.cols, out=out, activations=self.activations)
            start += p.shape[0]
        if self.bias is not None:
            y += self.bias
        return y.reshape(*lead, self.out_features).to(dtype)

    def _integer(self, part: QuantizedWeight, rows: int) -> bool:
        """Whether a product of `rows` rows with `part` runs on integer activations."""
        return (self.activations is not None and self.activations.min_rows <= rows
                and part.qtype in cpu_quant.INT8_FORMATS and self.kernels.int8_level > 0)


def use_integer_activations(model: nn.Module, activations: cpu_quant.IntegerActivations | None) -> None:
    """What the CPU products of several rows multiply (`EngineTuning.prompt_activations`; None:
    fp32): every `QuantizedLinear` of `model` but its LM head, and the model's native CPU step
    where it has one (`cpu_activations`, read when the step is built). The LM head runs the
    rows that sample (a step's decode rows, a prompt's last one), which stay on fp32 however
    many share the step."""
    head = getattr(model, "lm_head", None)
    for m in model.modules():
        if isinstance(m, QuantizedLinear) and m is not head:
            m.activations = activations
    if hasattr(model, "cpu_activations"):
        model.cpu_activations = activations


class QuantizedEmbedding(nn.Module):
    """Rows of a quantized weight, de-quantized on lookup (the weight stays packed)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.weight = weight
        self.dtype = dtype
        self.kernels = cpu_quant.load()
        if self.kernels is None:
            raise _kernels_missing()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = self.kernels.dequantize_rows(w.packed, w.qtype, w.cols, ids.reshape(-1))
        return rows.reshape(*ids.shape, w.cols).to(self.dtype)


AnyWeight = torch.Tensor | QuantizedWeight | PackedWeight
QUANTIZED_LINEARS = (QuantizedLinear, packed.PackedLinear)  # the layers `ModelShape` counts by packed bytes


def cat_rows(values: list[AnyWeight]) -> torch.Tensor | list[QuantizedWeight] | PackedWeight:
    """Weights stacked by rows (q/k/v into qkv): quantized parts of one kind stay quantized;
    a mix (or GPU parts of different formats) is de-quantized to the float ones' dtype."""
    if all(isinstance(v, QuantizedWeight) for v in values):
        return stack_rows(values)
    if all(isinstance(v, PackedWeight) for v in values):
        stacked = packed.stack_rows(values)
        if stacked is not None:
            return stacked
    floats = [v for v in values if isinstance(v, torch.Tensor)]
    dtype = floats[0].dtype if floats else torch.get_default_dtype()
    return torch.cat([v if isinstance(v, torch.Tensor) else _dequantized(v, dtype) for v in values])


def _dequantized(weight: QuantizedWeight | PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(weight, PackedWeight):
        return weight.dequantize(dtype)
    return weight.dequantize().to(dtype)


def quantized_embedding(weight: QuantizedWeight | PackedWeight, dtype: torch.dtype) -> nn.Module:
    """The embedding layer that looks rows up in a quantized weight."""
    if isinstance(weight, PackedWeight):
        return packed.PackedEmbedding(weight, dtype)
    return QuantizedEmbedding(weight, dtype)


def adopt_linear(owner: nn.Module, attr: str, weight: AnyWeight | list[QuantizedWeight]) -> None:
    """Give the `nn.Linear` at `owner.attr` its checkpoint weight: a tensor is assigned (cast to
    the layer's dtype and device), a quantized one replaces the layer by a `QuantizedLinear`
    (GGUF blocks, CPU) or a `PackedLinear` (models/packed.py) that keeps its bias."""
    linear = getattr(owner, attr)
    parts = [weight] if isinstance(weight, QuantizedWeight) else weight
    if isinstance(parts, list):
        shape = (sum(p.shape[0] for p in parts), parts[0].cols)
    else:
        shape = tuple(weight.shape)
    if shape != tuple(linear.weight.shape):
        raise ModelLoadError(f"weight shape {shape} != expected {tuple(linear.weight.shape)}; "
                             f"the checkpoint does not match config.json")
    bias = getattr(linear, "bias", None)  # nn.Embedding (a tied head's table) has none
    bias = None if bias is None else bias.data
    if isinstance(parts, list):
        setattr(owner, attr, QuantizedLinear(parts, bias))
    elif isinstance(weight, PackedWeight):
        setattr(owner, attr, packed.PackedLinear(weight, bias))
    else:
        linear.weight.data = weight.to(device=linear.weight.device, dtype=linear.weight.dtype)
