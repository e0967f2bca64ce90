"""The native CPU decode step (kernels/cpu_decode.py) against the model's torch layers: the
default model, packed, one decode token for each of two sequences of different lengths, with and
without a sliding window; logits, the greedy token and the K/V written to the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structgen.engine.attention import AttentionBatch
from structgen.engine.config import EngineConfig
from structgen.engine.engine import Engine
from structgen.engine.model_runner import ExtendSeq

PROMPTS = ["What is the capital of France?", "Give me a JSON object with a name and an age. Keep it short."]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    from structgen.engine.models.loader import load_model_config

    return Engine(load_model_config(model_dir), EngineConfig(device="cpu", max_batch_size=4, max_seq_len=256), model_dir)


@torch.inference_mode()
def torch_layers_logits(engine: Engine, spans: list[tuple[int, int, int]], tokens: list[int]) -> torch.Tensor:
    """The decode step through the model's torch layers (what `LlamaModel.forward` runs for
    any other step)."""
    runner = engine.runner
    model, kv = runner.model, runner.kv
    batch = AttentionBatch.build(spans, kv.pages)
    x, residual = model.embed_tokens(torch.tensor(tokens)), None
    for layer in model.layers:
        x, residual = layer.forward_residual(x, residual, model.rope, batch, kv)
    return model.logits(model.norm.add_forward(x, residual)[0])


@pytest.mark.parametrize("window", [0, 6], ids=["full", "sliding-window"])
def test_native_decode_step_equals_the_torch_layers(engine: Engine, tokenizer, window: int) -> None:
    runner = engine.runner
    model, kv = runner.model, runner.kv
    for layer in model.layers:
        layer.self_attn.window = window or None
    model._cpu_decoder = None  # the decoder takes each layer's window when it is built
    assert model.cpu_decoder(kv) is not None
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    slots = [kv.pages.allocate_slot() for _ in ids]
    for slot, p in zip(slots, ids, strict=True):
        runner.extend([ExtendSeq(slot, 0, p, num_logits=1)])
    tokens = [tokenizer.encode(" Paris", add_special_tokens=False)[0], tokenizer.encode("{", add_special_tokens=False)[0]]
    spans = [(slot, len(p), 1) for slot, p in zip(slots, ids, strict=True)]
    reference = torch_layers_logits(engine, spans, tokens)
    rows = [int(kv.pages.token_slots(slot, start, 1)[0]) for slot, start, _ in spans]
    k_ref = torch.stack([kv.k[i].view(-1, *kv.k[i].shape[2:])[rows].clone() for i in (0, len(model.layers) - 1)])
    native = runner.extend([ExtendSeq(slot, start, [t], num_logits=1) for (slot, start, _), t in zip(spans, tokens, strict=True)])
    k_native = torch.stack([kv.k[i].view(-1, *kv.k[i].shape[2:])[rows] for i in (0, len(model.layers) - 1)])
    torch.testing.assert_close(native, reference, rtol=0, atol=2e-3)
    assert torch.equal(native.argmax(-1), reference.argmax(-1))
    torch.testing.assert_close(k_native, k_ref, rtol=0, atol=1e-4)
    for slot in slots:
        kv.pages.release_slot(slot)
