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

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, self.in_features).float()
        if x2.shape[0] > cpu_quant.MAX_KERNEL_ROWS:
            products = [x2 @ p.dequantize().T for p in self.parts]
            y = products[0] if len(products) == 1 else torch.cat(products, dim=-1)
        else:
            y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
            start = 0
            for p in self.parts:
                rows = p.shape[0]
                self.kernels.matmul(x2, p.packed, p.qtype, p.cols, out=y[:, start:start + rows])
                start += rows
        if self.bias is not None:
            y += self.bias
        return y.reshape(*lead, self.out_features).to(dtype)


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


def cat_rows(values: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | list[QuantizedWeight]:
    """Weights stacked by rows (q/k/v into qkv): quantized parts stay quantized; a mix of
    float and quantized tensors is de-quantized to the float ones' dtype."""
    if all(isinstance(v, QuantizedWeight) for v in values):
        return stack_rows(values)
    floats = [v for v in values if isinstance(v, torch.Tensor)]
    return torch.cat([v if isinstance(v, torch.Tensor) else v.dequantize().to(floats[0].dtype) for v in values])


def adopt_linear(owner: nn.Module, attr: str, weight: torch.Tensor | QuantizedWeight | list[QuantizedWeight]) -> None:
    """Give the `nn.Linear` at `owner.attr` its checkpoint weight: a tensor is assigned (cast to
    the layer's dtype and device), a quantized one replaces the layer by a `QuantizedLinear`
    that keeps its bias."""
    linear = getattr(owner, attr)
    parts = [weight] if isinstance(weight, QuantizedWeight) else weight
    shape = (sum(p.shape[0] for p in parts), parts[0].cols) if isinstance(parts, list) else tuple(weight.shape)
    if shape != tuple(linear.weight.shape):
        raise ModelLoadError(f"weight shape {shape} != expected {tuple(linear.weight.shape)}; "
                             f"the checkpoint does not match config.json")
    if isinstance(parts, list):
        setattr(owner, attr, QuantizedLinear(parts, linear.bias.data if linear.bias is not None else None))
    else:
        linear.weight.data = weight.to(device=linear.weight.device, dtype=linear.weight.dtype)
