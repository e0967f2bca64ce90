"""Tiny GGUF files written as llama.cpp's converter writes them, for the conversion tests
(test_families, test_phi3, test_moe): a transformers config's shape as metadata, a small
SentencePiece-style vocabulary, and float32 tensors under gguf-py's own names."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# <unk> <s> </s>, the 256 byte tokens, then 253 word pieces scored by rank
TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [f"\u2581w{i}" for i in range(253)]


@contextmanager
def gguf_writer(out: Path, arch: str, cfg: Any, *, head_dim: int | None = None) -> Iterator[Any]:
    """A `gguf.GGUFWriter` for `arch` holding `cfg`'s shape (and `head_dim` as key/value length
    where given) and the small vocabulary; the caller adds its own metadata and tensors inside
    the block, and the file is written when it ends."""
    import gguf

    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(253)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * 253)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    yield w
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tensor_names(arch: str, layers: int) -> Any:
    """gguf-py's map from HF tensor names to llama.cpp's for `arch`."""
    import gguf

    return gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), layers)


def greedy_tokens_both_ways(model_dir: Path, reference: Any, prompt: list[int], steps: int = 16) -> tuple[list[int], list[int]]:
    """(our engine's greedy tokens from the converted `model_dir`, transformers' from
    `reference`), on the CPU: what a conversion test compares."""
    import torch

    from structgen.engine.config import EngineConfig
    from structgen.engine.engine import Engine
    from structgen.engine.models.loader import load_model_config
    from structgen.engine.request import Request
    from structgen.sampling import SamplingParams

    engine = Engine(load_model_config(model_dir), EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64),
                    model_dir)
    req = Request(prompt, SamplingParams(max_tokens=steps))
    engine.run([req])
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return req.output_ids, out[0, len(prompt):].tolist()
