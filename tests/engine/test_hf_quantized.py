"""Quantized checkpoints for the GPU kernels, run on the CPU through their torch reference:
tiny AWQ / GPTQ / FP8 checkpoints written here by each format's documented packing decode
exactly like the same model with the weights they stand for in float32; GGUF blocks map to
`PackedWeight`s that de-quantize to gguf-py's values; variants the kernels cannot run are
refused with the fix in the message."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from structgen.engine.config import EngineConfig, EngineTuning, ModelConfig
from structgen.engine.engine import Engine
from structgen.engine.kernels import cpu_quant
from structgen.engine.models.packed import PackedLinear, PackedWeight, from_gguf
from structgen.engine.request import Request
from structgen.engine.sampler import SamplingParams
from structgen.errors import InvalidParameterError, ModelLoadError

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "vocab_size": 512, "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "tie_word_embeddings": False,
          "bos_token_id": 1, "eos_token_id": 2}
PROJECTIONS = {"self_attn.q_proj": (128, 128), "self_attn.k_proj": (64, 128), "self_attn.v_proj": (64, 128),
               "self_attn.o_proj": (128, 128), "mlp.gate_proj": (256, 128), "mlp.up_proj": (256, 128),
               "mlp.down_proj": (128, 256)}
GROUP = 32
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column AWQ_PACK_ORDER[i]
PROMPTS = [[1, 17, 300, 42, 9], [1, 5, 5, 480]]


def words(nibbles: np.ndarray) -> torch.Tensor:
    """int32 words of `[..., 8]` nibbles, nibble i at bits 4i."""
    v = (nibbles.astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32)
    return torch.from_numpy(v.view(np.int32).copy())


def awq_tensors(q: np.ndarray, z: np.ndarray, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM packing of codes q [out, in], zeros z and scales s [out, groups]."""
    qt, zt = q.T, z.T  # [in, out], [groups, out]
    pack = lambda a: words(a.reshape(a.shape[0], -1, 8)[..., AWQ_PACK_ORDER])  # noqa: E731
    return {"qweight": pack(qt), "qzeros": pack(zt), "scales": s.T.contiguous()}


def gptq_tensors(q: np.ndarray, z: np.ndarray, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoGPTQ's packing (checkpoint_format "gptq": zeros stored minus one)."""
    qt, zt = q.T, (z.T - 1) & 0xF
    qweight = words(qt.reshape(-1, 8, qt.shape[1]).transpose(0, 2, 1)).contiguous()
    return {"qweight": qweight, "qzeros": words(zt.reshape(zt.shape[0], -1, 8)), "scales": s.T.contiguous(),
            "g_idx": torch.arange(q.shape[1], dtype=torch.int32) // GROUP}


def quantized_checkpoint(method: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the checkpoint's tensors in `method`'s format, the same model's float32 tensors)."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    h, v = CONFIG["hidden_size"], CONFIG["vocab_size"]
    base = {"model.embed_tokens.weight": torch.randn(v, h, generator=g), "lm_head.weight": torch.randn(v, h, generator=g) * 0.1,
            "model.norm.weight": torch.ones(h)}
    stored, floats = dict(base), dict(base)
    for layer in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            stored[p + norm + ".weight"] = floats[p + norm + ".weight"] = torch.ones(h)
        for name, (rows, cols) in PROJECTIONS.items():
            if method == "fp8":
                # clamped first: before 2.12 torch casts a value past 464 to NaN, not 448
                codes = (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
                scale = torch.rand(rows, 1, generator=g) * 1e-3
                stored |= {p + name + ".weight": codes, p + name + ".weight_scale": scale}
                floats[p + name + ".weight"] = codes.float() * scale
                continue
            q = rng.integers(0, 16, (rows, cols))
            z = rng.integers(0, 16, (rows, cols // GROUP))
            s = torch.from_numpy(rng.uniform(0.002, 0.02, (rows, cols // GROUP))).half()
            tensors = (awq_tensors if method == "awq" else gptq_tensors)(q, z, s)
            stored |= {p + name + "." + k: t for k, t in tensors.items()}
            w = (torch.from_numpy(q) - torch.from_numpy(z).repeat_interleave(GROUP, 1)).float()
            floats[p + name + ".weight"] = w * s.float().repeat_interleave(GROUP, 1)
    return stored, floats


QUANT_CONFIGS = {"awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
                 "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False},
                 "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"}}


def write_dir(path: Path, tensors: dict[str, torch.Tensor], quantization: dict | None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {**CONFIG, **({"quantization_config": quantization} if quantization else {})}
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def greedy(model_dir: Path, **engine: object) -> tuple[Engine, list[list[int]]]:
    cfg = ModelConfig.from_file(model_dir / "config.json")
    eng = Engine(cfg, EngineConfig(device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64, **engine), model_dir)
    reqs = [Request(p, SamplingParams(max_tokens=8)) for p in PROMPTS]
    eng.run(reqs)
    return eng, [r.output_ids for r in reqs]


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8"])
def test_quantized_checkpoint_decodes_like_its_float_weights(tmp_path: Path, method: str) -> None:
    stored, floats = quantized_checkpoint(method)
    eng, tokens = greedy(write_dir(tmp_path / method, stored, QUANT_CONFIGS[method]))
    layer = eng.runner.model.layers[1]
    assert isinstance(layer.mlp.gate_up_proj, PackedLinear) and isinstance(layer.self_attn.qkv_proj, PackedLinear)
    assert layer.mlp.down_proj.weight_packed.code == ("fp8" if method == "fp8" else "int4")
    _, expected = greedy(write_dir(tmp_path / "float", floats, None))
    assert tokens == expected
    assert len(set(tokens[0])) > 1  # the prompt's continuation is not one token repeated


def test_quantized_checkpoint_dequantizes_where_packed_weights_are_off(tmp_path: Path) -> None:
    stored, floats = quantized_checkpoint("awq", seed=1)
    eng, tokens = greedy(write_dir(tmp_path / "awq", stored, QUANT_CONFIGS["awq"]),
                         tuning=EngineTuning(quantized_weights=False))
    assert isinstance(eng.runner.model.layers[0].mlp.down_proj, torch.nn.Linear)
    assert tokens == greedy(write_dir(tmp_path / "float", floats, None))[1]


@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_float_checkpoint_quantized_at_load_keeps_its_outputs_close(tmp_path: Path, method: str) -> None:
    from structgen.engine.model_runner import ExtendSeq

    _, floats = quantized_checkpoint("fp8", seed=2)
    model_dir = write_dir(tmp_path / "float", floats, None)
    runs = [greedy(model_dir, quantization=q)[0] for q in (None, method)]
    down = runs[1].runner.model.layers[0].mlp.down_proj
    assert isinstance(down, PackedLinear) and down.weight_packed.code == method
    assert down.weight_bytes < down.in_features * down.out_features * (2 if method == "fp8" else 1)
    logits = [e.runner.extend([ExtendSeq(0, 0, PROMPTS[0], num_logits=5)]) for e in runs]
    assert torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=-1).min() > 0.99


def test_default_gguf_model_quantized_at_load_takes_the_method(model_dir: Path) -> None:
    """The default model's Q4_1 blocks are de-quantized, then quantized to FP8: the projections
    are FP8 `PackedLinear`s (not left in their GGUF blocks), and greedy decoding still runs."""
    from structgen.engine.models.loader import load_model_config

    eng = Engine(load_model_config(model_dir), EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64,
                                                            quantization="fp8"), model_dir)
    layer = eng.runner.model.layers[0]
    assert isinstance(layer.mlp.down_proj, PackedLinear) and layer.mlp.down_proj.weight_packed.code == "fp8"
    assert layer.self_attn.qkv_proj.weight_packed.code == "fp8"
    req = Request([1, 9690, 198, 2683, 314], SamplingParams(max_tokens=3))
    eng.run([req])
    assert len(req.output_ids) == 3


def test_random_weights_quantized_at_load_leave_no_float_projection() -> None:
    """Random weights with `quantization` (the benchmarks' big shapes) are drawn and quantized
    one projection at a time; the rest of the model is materialized afterwards."""
    from structgen.engine.models.llama import ModelShape

    cfg = ModelConfig.from_dict(CONFIG)
    eng = Engine(cfg, EngineConfig(device="cpu", max_batch_size=2, max_seq_len=64, quantization="int4"), None)
    model = eng.runner.model
    assert not any(p.is_meta for p in model.parameters()) and not model.rope.cos.is_meta
    assert not any(isinstance(m, torch.nn.Linear) for layer in model.layers for m in layer.modules())
    float_shape = ModelShape.of(Engine(cfg, EngineConfig(device="cpu", max_batch_size=2, max_seq_len=64), None).runner.model)
    assert ModelShape.of(model).params == float_shape.params
    assert ModelShape.of(model).weight_bytes < float_shape.weight_bytes
    req = Request(PROMPTS[0], SamplingParams(max_tokens=4))
    eng.run([req])
    assert len(req.output_ids) == 4


def test_fp8_checkpoint_with_a_nan_code_is_refused(tmp_path: Path) -> None:
    """One NaN code (e4m3fn has no infinity: an unclamped cast of a value past 464 gives NaN,
    in torch before 2.12 too) would make every logit NaN; the loader names the layer."""
    stored, _ = quantized_checkpoint("fp8")
    codes = stored["model.layers.0.mlp.gate_proj.weight"].view(torch.uint8).clone()
    codes[3, 5] = 0xFF
    stored["model.layers.0.mlp.gate_proj.weight"] = codes.view(torch.float8_e4m3fn)
    with pytest.raises(ModelLoadError, match="layers.0.mlp.gate_proj.weight holds NaN FP8 codes"):
        greedy(write_dir(tmp_path, stored, QUANT_CONFIGS["fp8"]))


def test_unknown_load_quantization_is_refused() -> None:
    with pytest.raises(InvalidParameterError, match="'fp8' or 'int4'"):
        EngineConfig(quantization="int3")


@pytest.mark.parametrize("change,message", [
    ({"bits": 8}, "8-bit AWQ is not supported"),
    ({"version": "gemv"}, "version 'gemv' is not supported"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
])
def test_unsupported_quantization_variants_are_refused(tmp_path: Path, change: dict, message: str) -> None:
    stored, _ = quantized_checkpoint("awq")
    with pytest.raises(ModelLoadError, match=message):
        greedy(write_dir(tmp_path, stored, {**QUANT_CONFIGS["awq"], **change}))


def test_act_order_gptq_is_refused_with_the_fix(tmp_path: Path) -> None:
    stored, _ = quantized_checkpoint("gptq")
    name = "model.layers.0.mlp.up_proj.g_idx"
    stored[name] = stored[name][torch.randperm(len(stored[name]), generator=torch.Generator().manual_seed(0))]
    with pytest.raises(ModelLoadError, match="act-order GPTQ.*desc_act=false"):
        greedy(write_dir(tmp_path, stored, {**QUANT_CONFIGS["gptq"], "desc_act": True}))


def test_default_model_gguf_weights_map_to_packed_weights_exactly(model_dir: Path) -> None:
    """The default model's GGUF blocks (Q4_1 projections, Q8_0 embedding) as the GPU's int4 /
    int8 weights de-quantize to gguf-py's values bit for bit."""
    from safetensors import safe_open

    from structgen.engine.models.loader import packed_formats

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as st:
        formats = packed_formats(st.metadata())
        for name in ("model.layers.3.mlp.down_proj.weight", "model.embed_tokens.weight"):
            qtype, cols = formats[name]
            blocks = st.get_tensor(name)
            weight = from_gguf(qtype, blocks, cols)
            assert weight.code == {"Q4_1": "int4", "Q8_0": "int8"}[qtype]
            assert torch.equal(weight.dequantize(), cpu_quant.dequantize_reference(blocks, qtype))


@pytest.mark.slow
def test_default_model_with_gpu_packed_weights_decodes_like_dequantized(model_dir: Path) -> None:
    """The default model's weights loaded as the GPU would (int4 / int8 `PackedWeight`s), run
    through the torch reference, decode like its weights de-quantized to float32."""
    from structgen.engine.models.loader import load_model_config, load_weights

    cfg = load_model_config(model_dir)
    engines = [Engine(cfg, EngineConfig(device="cpu", max_batch_size=2, max_seq_len=128,
                                        tuning=EngineTuning(quantized_weights=False)), model_dir) for _ in range(2)]
    weights = load_weights(model_dir, torch.float32, "cpu", keep_quantized=True)
    packed = {n: from_gguf(w.qtype, w.packed, w.cols) if not isinstance(w, torch.Tensor) else w
              for n, w in weights.items()}
    assert all(isinstance(w, (PackedWeight, torch.Tensor)) for w in packed.values())
    engines[1].runner.model.load_hf_weights(packed)
    assert isinstance(engines[1].runner.model.lm_head, PackedLinear)  # tied to the int8 embedding
    outputs = []
    for e in engines:
        reqs = [Request(p, SamplingParams(max_tokens=8)) for p in PROMPTS]
        e.run(reqs)
        outputs.append([r.output_ids for r in reqs])
    assert outputs[0] == outputs[1]


def test_packed_weights_loaded_after_the_kernels_were_chosen_turn_the_fused_projections_off():
    """Fused projections read a float W: a model whose kernels were chosen (`use_fused_kernels`)
    before packed weights replaced its projections must not take them (it once did, and
    failed on `PackedLinear.weight` under Triton's CPU interpreter)."""
    from structgen.engine.config import ModelConfig
    from structgen.engine.models.llama import FUSED_ROWS, LlamaModel, skip_init
    from structgen.engine.models.packed import PackedLinear, quantize_int4

    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with skip_init(torch.float32):
        model = LlamaModel(cfg, 32)
    model.use_fused_kernels(True)
    assert [layer.fused_rows for layer in model.layers] == [FUSED_ROWS, FUSED_ROWS]
    g = torch.Generator().manual_seed(0)
    shapes = {"q": (64, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64), "gate": (128, 64), "up": (128, 64),
              "down": (64, 128)}
    weights: dict = {"model.embed_tokens.weight": torch.randn(64, 64, generator=g), "model.norm.weight": torch.ones(64)}
    for i in range(2):
        p = f"model.layers.{i}."
        for name, shape in shapes.items():
            kind = "mlp" if name in ("gate", "up", "down") else "self_attn"
            weights[f"{p}{kind}.{name}_proj.weight"] = quantize_int4(torch.randn(*shape, generator=g))
        weights[p + "input_layernorm.weight"] = weights[p + "post_attention_layernorm.weight"] = torch.ones(64)
    model.load_hf_weights(weights)
    assert isinstance(model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert [layer.fused_rows for layer in model.layers] == [0, 0]
    assert model.fused  # the other kernels stay on
