"""EngineConfig holds the user's choices; EngineTuning the knobs, among them the one setting for
the grammar work's threads."""

from __future__ import annotations

import pytest

import structgen
from structgen.engine.config import EngineConfig, EngineTuning, ModelConfig
from structgen.engine.engine import Engine
from structgen.errors import InvalidParameterError
from structgen.grammar import GrammarThreads, native
from tests.dropped_llms import settle_dropped_llms

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=32, eos_token_id=[])


def test_user_fields_construct_by_keyword_and_tuning_sits_apart():
    config = structgen.EngineConfig(device="cpu", dtype="float32", max_batch_size=8, max_seq_len=256,
                                    kv_cache_memory_fraction=0.4, prefill_chunk_tokens=64, use_cuda_graphs=False,
                                    jump_forward=False, seed=3, speculative=None)
    assert config.tuning == structgen.EngineTuning()
    assert config.tuning is not EngineConfig().tuning  # each config its own
    with pytest.raises(InvalidParameterError, match=r"tuning=EngineTuning\(prefill_in_graphs=...\)"):
        EngineConfig(prefill_in_graphs=False)  # a knob, not a user field
    with pytest.raises(InvalidParameterError, match="grammar_threads"):
        EngineConfig(grammar_workers=2)
    with pytest.raises(InvalidParameterError, match="always on"):
        EngineConfig(token_gate=False)
    with pytest.raises(InvalidParameterError, match="no field 'no_such_field'"):
        EngineConfig(no_such_field=1)
    with pytest.raises(InvalidParameterError, match="grammar_threads"):
        EngineTuning(grammar_threads=-1)


def test_auto_grammar_threads_size_each_part_for_its_work(monkeypatch):
    monkeypatch.delenv("STRUCTGEN_GRAMMAR_THREADS", raising=False)
    auto = GrammarThreads.resolve(0)
    assert auto.pool == native.default_threads()
    assert (auto.xgrammar, auto.prefetch) == (1, 2) and auto.llguidance == min(4, auto.pool)
    monkeypatch.setenv("STRUCTGEN_GRAMMAR_THREADS", "6")  # overrides the auto pool size only
    assert GrammarThreads.resolve(0) == GrammarThreads(pool=6, xgrammar=1, llguidance=4, prefetch=2)
    assert GrammarThreads.resolve(3) == GrammarThreads(pool=3, xgrammar=3, llguidance=3, prefetch=3)


def test_one_grammar_threads_setting_sizes_the_native_pool_and_the_prefetch():
    settle_dropped_llms()
    pool = native.load()
    before = pool.threads if pool is not None else 0
    shared = native.pool_has_users()  # another engine of this test session fills on it: kept as is
    tuning = EngineTuning(grammar_threads=3, mask_prefetch="on")
    engine = Engine(TINY, EngineConfig(device="cpu", max_batch_size=2, max_seq_len=64, tuning=tuning),
                    None, stop_token_ids=set())
    try:
        assert engine.grammar_threads == GrammarThreads.resolve(3)
        assert engine.prefetcher is not None and engine.prefetcher.threads == 3
        if pool is not None:
            assert pool.threads == (before if shared else 3)
    finally:
        engine.prefetcher.close()
        if pool is not None:
            pool.set_threads(before)


def test_batch_invariance_is_on_by_default_and_the_cli_turns_it_off():
    from structgen.cli import _engine_config, build_parser

    assert not EngineConfig().batch_invariant
    serve = build_parser().parse_args(["serve", "--batch-invariant"])
    assert _engine_config(serve).batch_invariant is True
    assert _engine_config(build_parser().parse_args(["serve"])).batch_invariant is False
