"""HF checkpoints stored quantized (AWQ, GPTQ, FP8), read into `PackedWeight`s.

Which format a directory holds is its config.json's `quantization_config`; `read_config`
checks it once and refuses the variants the kernels cannot run, saying what to load instead.
`pack_checkpoint` then replaces each layer's stored tensors by one `PackedWeight` under the
layer's `.weight` name:

- AWQ (GEMM packing): `qweight` int32 `[in, out / 8]`, `qzeros` int32 `[groups, out / 8]`,
  nibbles in the order 0, 2, 4, 6, 1, 3, 5, 7 of the 8 columns; `scales` `[groups, out]`;
  `w = (q - z) * s`.
- GPTQ: `qweight` int32 `[in / 8, out]` (8 input rows per word, in order), `qzeros` like AWQ's
  but in order and stored minus one (`checkpoint_format` "gptq"; "gptq_v2" stores them as is),
  `g_idx` the group of each input row, which must be the plain `row // group_size`.
- FP8: `weight` float8_e4m3fn `[out, in]` and `weight_scale` (or `weight_scale_inv`, the same
  multiplier under DeepSeek's name): one scale, one per output channel, or one per block of
  `weight_block_size`.

`quantize_linear_weights` quantizes a float checkpoint's projections at load instead
(`EngineConfig(quantization="fp8" | "int4")`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from structgen.engine.models.packed import QUANTIZERS, PackedWeight, int4_weight, unpack_nibbles
from structgen.errors import ModelLoadError

AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble that holds each of 8 consecutive columns
SCALE_SUFFIXES = (".scales", ".weight_scale", ".weight_scale_inv", ".input_scale")


@dataclass(frozen=True)
class QuantizationConfig:
    """What config.json's `quantization_config` says, checked: the method and its layout."""

    method: str  # "awq" | "gptq" | "fp8"
    group_size: int = 0  # columns per scale (int4); 0: the whole row
    zeros_minus_one: bool = False  # GPTQ v1 stores each zero point minus one
    block: tuple[int, int] | None = None  # FP8 scale blocks (rows, columns)


def read_config(config: dict[str, Any]) -> QuantizationConfig | None:
    """The checked quantization of a config.json dict; None for a float checkpoint."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method in ("awq", "gptq"):
        return _int4_config(method, qc)
    if method in ("fp8", "fbgemm_fp8"):
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ModelLoadError(f"FP8 format {qc['fmt']!r} is not supported; structgen runs e4m3 FP8 "
                                 "checkpoints (quantize the float model at load: EngineConfig(quantization='fp8'))")
        block = qc.get("weight_block_size")
        return QuantizationConfig("fp8", block=tuple(block) if block else None)
    raise ModelLoadError(f"quantization method {method!r} is not supported; structgen loads AWQ and GPTQ "
                         "(4-bit) and FP8 checkpoints, or a float checkpoint quantized at load with "
                         "EngineConfig(quantization='fp8' or 'int4')")


def _int4_config(method: str, qc: dict[str, Any]) -> QuantizationConfig:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ModelLoadError(f"{bits}-bit {method.upper()} is not supported; structgen runs 4-bit {method.upper()} "
                             "checkpoints (or load the float model with EngineConfig(quantization='fp8'))")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        if str(qc.get("version", "gemm")).lower() != "gemm":
            raise ModelLoadError(f"AWQ version {qc['version']!r} is not supported; structgen reads AWQ's GEMM "
                                 "packing (version 'gemm', the AutoAWQ default)")
        if not qc.get("zero_point", True):
            raise ModelLoadError("AWQ without zero points is not supported; use a checkpoint quantized "
                                 "with zero_point=true (the AutoAWQ default)")
        return QuantizationConfig("awq", group_size=group)
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"GPTQ checkpoint format {fmt!r} is not supported; structgen reads 'gptq' and "
                             "'gptq_v2'")
    return QuantizationConfig("gptq", group_size=group, zeros_minus_one=fmt == "gptq")


def stored_as_is(name: str, t: torch.Tensor) -> bool:
    """Tensors of a quantized checkpoint that keep their stored dtype (codes and scales)."""
    return t.dtype == torch.float8_e4m3fn or name.endswith(SCALE_SUFFIXES)


def pack_checkpoint(weights: dict[str, Any], qc: QuantizationConfig) -> dict[str, Any]:
    """`weights` with each quantized layer's tensors replaced by a `PackedWeight` at `.weight`."""
    if qc.method == "fp8":
        layers = [n.removesuffix(".weight") for n, t in weights.items()
                  if n.endswith(".weight") and isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn]
        pack = _fp8_layer
    else:
        layers = [n.removesuffix(".qweight") for n in weights if n.endswith(".qweight")]
        pack = _awq_layer if qc.method == "awq" else _gptq_layer
    for layer in layers:
        weights[f"{layer}.weight"] = pack(weights, layer, qc)
    return {n: t for n, t in weights.items() if not n.endswith((".input_scale", ".g_idx"))}


def _take(weights: dict[str, Any], name: str) -> torch.Tensor:
    if name not in weights:
        raise ModelLoadError(f"quantized weight {name!r} missing from the checkpoint; the files do not match "
                             "config.json's quantization_config")
    return weights.pop(name)


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 `[r, out / 8]` as its `[r, out]` values (nibbles in AWQ's column order)."""
    nib = unpack_nibbles(words)[..., list(AWQ_ORDER)]
    return nib.reshape(words.shape[0], -1)


def _int4_layer(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int, layer: str) -> PackedWeight:
    """codes `[out, in]`, zero points and scales `[groups, out]` (checkpoint order) as a PackedWeight."""
    rows, cols = q.shape
    if scales.shape != (-(-cols // group), rows) or zeros.shape != scales.shape:
        raise ModelLoadError(f"{layer}: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not fit "
                             f"a [{rows}, {cols}] weight in groups of {group}; the files do not match config.json")
    s = scales.float().T
    return int4_weight(q, s, -zeros.T.float() * s, group)


def _awq_layer(weights: dict[str, Any], layer: str, qc: QuantizationConfig) -> PackedWeight:
    q = _awq_columns(_take(weights, f"{layer}.qweight")).T  # [out, in]
    group = qc.group_size if qc.group_size > 0 else q.shape[1]
    zeros = _awq_columns(_take(weights, f"{layer}.qzeros"))
    return _int4_layer(q, zeros, _take(weights, f"{layer}.scales"), group, layer)


def _gptq_layer(weights: dict[str, Any], layer: str, qc: QuantizationConfig) -> PackedWeight:
    words = _take(weights, f"{layer}.qweight")  # [in / 8, out]
    q = unpack_nibbles(words).permute(0, 2, 1).reshape(-1, words.shape[1]).T  # [out, in]
    cols = q.shape[1]
    group = qc.group_size if qc.group_size > 0 else cols
    g_idx = weights.get(f"{layer}.g_idx")
    plain = torch.arange(cols, device=q.device) // group
    if g_idx is not None and not torch.equal(g_idx.to(plain), plain):
        raise ModelLoadError(f"{layer}: act-order GPTQ (desc_act with permuted g_idx) is not supported; use a "
                             "checkpoint quantized with desc_act=false, or an AWQ or FP8 checkpoint")
    zwords = _take(weights, f"{layer}.qzeros")
    zeros = unpack_nibbles(zwords).reshape(zwords.shape[0], -1)
    if qc.zeros_minus_one:
        zeros = (zeros + 1) & 0xF
    return _int4_layer(q, zeros, _take(weights, f"{layer}.scales"), group, layer)


def _fp8_layer(weights: dict[str, Any], layer: str, qc: QuantizationConfig) -> PackedWeight:
    codes = _take(weights, f"{layer}.weight")
    rows, cols = codes.shape
    if bool(((codes.view(torch.uint8) & 0x7F) == 0x7F).any()):  # e4m3fn's only NaN pattern
        raise ModelLoadError(f"{layer}.weight holds NaN FP8 codes, which make every output NaN; the checkpoint "
                             "is corrupt or was cast to e4m3 without clamping to +-448 (re-quantize it, or "
                             "load the float model with EngineConfig(quantization='fp8'))")
    name = f"{layer}.weight_scale" if f"{layer}.weight_scale" in weights else f"{layer}.weight_scale_inv"
    scale = _take(weights, name).float()
    if scale.numel() == 1:
        return PackedWeight("fp8", codes, scale.reshape(1, 1).expand(rows, 1).contiguous(), None, cols, cols)
    if scale.numel() == rows:
        return PackedWeight("fp8", codes, scale.reshape(rows, 1).contiguous(), None, cols, cols)
    if qc.block is not None:
        bn, bk = qc.block
        if scale.shape == (-(-rows // bn), -(-cols // bk)):
            return PackedWeight("fp8", codes, scale.contiguous(), None, cols, bk, bn)
    raise ModelLoadError(f"{name} has shape {tuple(scale.shape)}, which is neither one scale, one per output "
                         f"channel ({rows}) nor one per block of weight_block_size {qc.block}; the files do "
                         "not match config.json")


def quantize_linear_weights(weights: dict[str, Any], method: str) -> dict[str, Any]:
    """A checkpoint's decoder projections (`*_proj.weight` of the layers) quantized to
    `method` ("fp8": per-channel scales; "int4": groups of 128 columns); weights stored
    quantized otherwise (a GGUF's blocks, an AWQ layer) are de-quantized first, so the method
    always applies. The embedding and the LM head stay as they are."""
    from structgen.engine.models.quantized import QuantizedWeight

    quantize = QUANTIZERS[method]
    for name, t in list(weights.items()):
        if ".layers." not in name or not name.endswith("_proj.weight"):
            continue
        if isinstance(t, QuantizedWeight | PackedWeight):
            t = t.dequantize()
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            weights[name] = quantize(t)
    return weights
