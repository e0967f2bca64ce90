"""The tokenizer check at load (engine/tokenizer_conformance.py) on the real default tokenizer,
and on copies of it broken the ways that would make grammar masks silently wrong: each is
refused with its reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from structgen.engine.config import EngineConfig, ModelConfig
from structgen.engine.engine import Engine
from structgen.engine.model_runner import ExtendSeq
from structgen.engine.models.loader import load_tokenizer
from structgen.engine.request import Request
from structgen.engine.tokenizer_conformance import check_tokenizer
from structgen.errors import ModelLoadError
from structgen.sampling import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def broken_copy(model_dir: Path, tmp_path: Path, edit_tokenizer=None, edit_config=None):
    """The default model's tokenizer files in `tmp_path`, with tokenizer.json / tokenizer_config
    changed by the given functions, loaded as structgen loads a model's tokenizer."""
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, tmp_path / name)
    for name, edit in (("tokenizer.json", edit_tokenizer), ("tokenizer_config.json", edit_config)):
        if edit is not None:
            data = json.loads((tmp_path / name).read_text(encoding="utf-8"))
            edit(data)
            (tmp_path / name).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return load_tokenizer(tmp_path)


def test_the_default_tokenizer_passes(tokenizer):
    report = check_tokenizer(tokenizer, 49152, [tokenizer.eos_token_id])
    assert report.text_vocab_size == 49152 and not report.padded
    assert report.has_chat_template and report.control_tokens >= 2


def test_a_turn_marker_not_marked_special_is_refused(model_dir, tmp_path):
    """A template whose turn marker (`<issue_start>`, an added token) is not marked special: a
    grammar would allow the marker inside a JSON string."""
    def unmark(added_tokens):
        for added in added_tokens:
            if added["content"] == "<issue_start>":
                added["special"] = False

    tok = broken_copy(model_dir, tmp_path, lambda tj: unmark(tj["added_tokens"]),
                      lambda tc: unmark(tc.get("added_tokens_decoder", {}).values()))
    tok.chat_template = "{% for m in messages %}<issue_start>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ModelLoadError, match=r"writes '<issue_start>', which the tokenizer does not mark special"):
        check_tokenizer(tok, 49152, [tok.eos_token_id])


@pytest.mark.slow
def test_a_normalizer_that_changes_text_is_refused(model_dir, tmp_path):
    """A lowercasing normalizer: the tokens the model writes no longer spell the grammar's text."""
    tok = broken_copy(model_dir, tmp_path, lambda tj: tj.update(normalizer={"type": "Lowercase"}))
    with pytest.raises(ModelLoadError, match="does not round-trip text.*original tokenizer.json"):
        check_tokenizer(tok, 49152, [tok.eos_token_id])


@pytest.mark.slow
def test_a_decoder_the_byte_table_disagrees_with_is_refused(model_dir, tmp_path):
    """A decoder that writes every token's bytes differently from what the table says."""
    decoder = {"type": "Sequence", "decoders": [{"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                                  "use_regex": True}, {"type": "Replace", "pattern": {"String": "e"},
                                                                       "content": "3"}]}
    tok = broken_copy(model_dir, tmp_path, lambda tj: tj.update(decoder=decoder))
    with pytest.raises(ModelLoadError, match="tokens' bytes disagree between the tokenizer and the grammar"):
        check_tokenizer(tok, 49152, [tok.eos_token_id])


@pytest.mark.slow
def test_a_chat_template_that_cannot_render_is_refused(model_dir, tmp_path):
    template = "{{ raise_exception('broken on purpose') }}"
    tok = broken_copy(model_dir, tmp_path)
    tok.chat_template = template
    with pytest.raises(ModelLoadError, match="chat template fails to render.*broken on purpose"):
        check_tokenizer(tok, 49152, [tok.eos_token_id])


def test_a_stop_token_outside_the_model_is_refused(tokenizer):
    with pytest.raises(ModelLoadError, match="stop token id 60000 is outside the model's 49152 logits"):
        check_tokenizer(tokenizer, 49152, [60000])


def test_padded_logits_are_never_sampled(tokenizer):
    """A model 64 rows wider than its tokenizer, whose padding rows would win every step: the
    check reports the padding, and the engine masks those logits, so even unconstrained
    sampling never picks one."""
    report = check_tokenizer(tokenizer, 49152 + 64, [tokenizer.eos_token_id])
    assert report.padded and report.text_vocab_size == 49152
    cfg = ModelConfig(vocab_size=49152 + 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, eos_token_id=[0])
    engine = Engine(cfg, EngineConfig(device="cpu", max_batch_size=1, max_seq_len=256), None,
                    text_vocab_size=report.text_vocab_size)
    torch.nn.init.normal_(engine.runner.model.lm_head.weight[49152:], 5.0)  # padding rows would win
    logits = engine.runner.extend([ExtendSeq(0, 0, [1, 2, 3])])
    assert torch.isinf(logits[0, 49152:]).all() and torch.isfinite(logits[0, :49152]).all()
    req = Request([1, 2, 3], SamplingParams(max_tokens=4, temperature=1.0, seed=1))
    engine.run([req])
    assert req.output_ids and max(req.output_ids) < 49152
