"""Every engine setting is checked when its dataclass is built: a bad value is an
InvalidParameterError naming the field, never a raw error at load or at the first call; what a
setting can consume (threads, memory, processes) is bounded, and what this host lacks is
refused when the engine is built, before anything is allocated."""

from __future__ import annotations

import threading

import pytest
import torch

from structgen.engine.config import (
    MAX_GRAMMAR_THREADS,
    EngineConfig,
    EngineTuning,
    ModelConfig,
    SpeculativeConfig,
    device_batch_size,
)
from structgen.engine.engine import Engine
from structgen.errors import InvalidParameterError, StructgenError
from structgen.grammar import GrammarCompiler, native

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=32, eos_token_id=[])


@pytest.mark.parametrize(("field", "value"), [
    ("dtype", "float64"), ("dtype", "int8"), ("dtype", 16),
    ("device", "gpu"), ("device", "mps"), ("device", "cuda:x"), ("device", 0),
    ("max_seq_len", -5), ("max_seq_len", 0), ("max_seq_len", 1), ("max_seq_len", None), ("max_seq_len", 2.5),
    ("max_batch_size", 0), ("max_batch_size", -1), ("max_batch_size", "8"),
    ("max_batch_size", 2.5), ("max_batch_size", True),
    ("kv_cache_tokens", 0), ("kv_cache_tokens", "1000"),
    ("kv_cache_memory_fraction", "0.5"), ("kv_cache_memory_fraction", 5.0), ("kv_cache_memory_fraction", 0.0),
    ("kv_cache_memory_fraction", -0.1), ("kv_cache_memory_fraction", float("nan")),
    ("prefill_chunk_tokens", 0), ("prefill_chunk_tokens", -1),
    ("use_cuda_graphs", "yes"), ("jump_forward", "no"), ("batch_invariant", 1), ("prefix_caching", None),
    ("seed", "abc"), ("seed", -1), ("seed", 2**64),
    ("tensor_parallel", "2"), ("tensor_parallel", 0), ("tensor_parallel", 10**6),
    ("speculative", "lookup"), ("speculative", 3),
    ("tuning", "fast"), ("tuning", 3),
    ("quantization", "int3"),
])
def test_a_bad_engine_config_value_is_refused_naming_the_field(field, value):
    with pytest.raises(InvalidParameterError, match=field) as caught:
        EngineConfig(**{field: value})
    assert repr(value)[:8] in str(caught.value) or str(value)[:8] in str(caught.value)


@pytest.mark.parametrize(("field", "value"), [
    ("grammar_threads", -1), ("grammar_threads", "4"), ("grammar_threads", MAX_GRAMMAR_THREADS + 1),
    ("grammar_threads", 100_000), ("grammar_threads", 2.0),
    ("cuda_graph_batch_sizes", ()), ("cuda_graph_batch_sizes", (1, 0)), ("cuda_graph_batch_sizes", "1,2"),
    ("cuda_graph_batch_sizes", 8),
    ("prefill_in_graphs", "no"), ("cascade_attention", 0), ("capturable_guided", None),
    ("quantized_weights", "true"), ("gguf_packed_on_cuda", 1), ("hold_full_collections", "off"),
    ("mask_prefetch", "yes"), ("tensor_parallel_all_reduce", "gloo"), ("prompt_activations", "int4"),
])
def test_a_bad_tuning_value_is_refused_naming_the_field(field, value):
    with pytest.raises(InvalidParameterError, match=field):
        EngineTuning(**{field: value})


@pytest.mark.parametrize(("field", "value"), [
    ("method", "eagle"), ("num_draft_tokens", "3"), ("num_draft_tokens", 0), ("num_draft_tokens", 10**6),
    ("max_requests", -1), ("max_requests", "8"), ("ngram_min", 0), ("ngram_max", "4"), ("ngram_max", 10**6),
    ("self_draft_layers", 0), ("grammar_aware", "no"), ("ngram_shared", 1), ("draft_model", 5),
])
def test_a_bad_speculative_value_is_refused_naming_the_field(field, value):
    with pytest.raises(InvalidParameterError, match=field):
        SpeculativeConfig(**{field: value})


@pytest.mark.parametrize(("alias", "name"), [
    ("fp16", "float16"), ("half", "float16"), ("float16", "float16"), ("FP16", "float16"),
    ("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp32", "float32"), ("float32", "float32"),
])
def test_dtype_aliases_become_the_torch_name(alias, name):
    assert EngineConfig(dtype=alias).dtype == name


@pytest.mark.parametrize(("given", "name"), [("CPU", "cpu"), (" cpu ", "cpu"), ("cuda", "cuda"), ("CUDA:1", "cuda:1")])
def test_device_names_are_taken_case_insensitively(given, name):
    assert EngineConfig(device=given).device == name


def test_settings_may_be_written_as_plain_data():
    config = EngineConfig.coerce({"device": "cpu", "tuning": {"grammar_threads": 2},
                                  "speculative": {"method": "ngram", "num_draft_tokens": 4}})
    assert config.device == "cpu" and config.tuning == EngineTuning(grammar_threads=2)
    assert config.speculative == SpeculativeConfig(num_draft_tokens=4)
    assert EngineConfig(speculative="ngram").speculative == SpeculativeConfig()
    assert EngineConfig(tuning=None).tuning == EngineTuning()  # None: the defaults
    assert EngineConfig.coerce(None) == EngineConfig()
    with pytest.raises(InvalidParameterError, match="no field 'grammar_thread'; did you mean 'grammar_threads'"):
        EngineConfig(tuning={"grammar_thread": 2})
    with pytest.raises(InvalidParameterError, match="did you mean 'max_batch_size'"):
        EngineConfig.coerce({"max_batch": 8})
    with pytest.raises(InvalidParameterError, match=r"config must be EngineConfig\(...\) or a dict"):
        EngineConfig.coerce("cpu")


def test_valid_bounds_are_accepted():
    config = EngineConfig(max_seq_len=2, max_batch_size=1, kv_cache_memory_fraction=1.0, prefill_chunk_tokens=1,
                          seed=0, kv_cache_tokens=1, tuning=EngineTuning(grammar_threads=MAX_GRAMMAR_THREADS,
                                                                         cuda_graph_batch_sizes=[1, 2]))
    assert config.tuning.cuda_graph_batch_sizes == (1, 2)
    assert SpeculativeConfig(num_draft_tokens=64, ngram_max=64).num_draft_tokens == 64


@pytest.mark.parametrize("backend", ["xgrammer", None, "XGrammar", 3])
def test_an_unknown_backend_is_refused_before_the_model_loads(backend, monkeypatch):
    import structgen
    from structgen.engine.models import loader

    def no_load(*_: object) -> None:
        raise AssertionError("the model was loaded before the backend was checked")

    monkeypatch.setattr(loader, "resolve_model", no_load)
    with pytest.raises(InvalidParameterError, match="unknown grammar backend") as caught:
        structgen.LLM(backend=backend)
    if backend == "xgrammer":
        assert "did you mean 'xgrammar'" in str(caught.value)


def test_a_config_dict_with_a_bad_value_is_refused_before_the_model_loads(monkeypatch):
    import structgen
    from structgen.engine.models import loader

    monkeypatch.setattr(loader, "resolve_model", lambda *_: pytest.fail("loaded"))
    with pytest.raises(InvalidParameterError, match="max_batch_size"):
        structgen.LLM(config={"max_batch_size": 0})


def _build(**fields: object) -> Engine:
    return Engine(TINY, EngineConfig(**fields), None, stop_token_ids=set())


@pytest.mark.parametrize("device", ["cuda", "cuda:7", "cuda:4096"])
def test_a_gpu_this_host_lacks_is_refused_at_build_naming_the_devices(device):
    if torch.cuda.is_available() and device != "cuda:4096":
        pytest.skip("this host has a GPU")
    with pytest.raises(InvalidParameterError, match=r"EngineConfig.device=.*pass one of 'cpu'"):
        _build(device=device)


@pytest.mark.parametrize("device", ["cuda:1", "cuda:256", "cuda:4096"])
def test_a_gpu_index_past_the_hosts_is_refused_however_large(monkeypatch, device):
    # torch keeps a device index in 8 bits (torch.device("cuda:4096") is cuda:0), so a
    # one-GPU host once built "cuda:4096" on its first GPU
    import torch

    from structgen.engine.model_runner import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InvalidParameterError, match=r"torch sees 1 GPU\(s\).*pass one of 'cpu', 'cuda', 'cuda:0'"):
        pick_device(EngineConfig(device=device))
    assert pick_device(EngineConfig(device="cuda:0")) == torch.device("cuda", 0)


@pytest.mark.parametrize(("field", "value", "names"), [
    ("max_batch_size", 10**9, "per-request tables"),
    ("kv_cache_tokens", 10**12, "KV pool"),
])
def test_a_size_this_host_cannot_hold_is_refused_before_allocating(field, value, names, monkeypatch):
    from structgen.engine import model_runner

    def no_model(*_: object) -> None:
        raise AssertionError("the model was built before the sizes were checked")

    monkeypatch.setattr(model_runner.ModelRunner, "_build_model", no_model)
    with pytest.raises(StructgenError, match=rf"{field}={value} needs .*{names}.*at most about") as caught:
        _build(device="cpu", **{field: value})
    assert isinstance(caught.value, InvalidParameterError)


def test_a_size_that_fits_still_builds():
    engine = _build(device="cpu", max_batch_size=4, max_seq_len=64, kv_cache_tokens=4096)
    assert engine.runner.kv.pages.num_slots == 4


@pytest.mark.parametrize(("memory_gib", "slots"), [(None, 64), (16, 256), (69, 256), (80, 1024), (141, 1024)])
def test_the_default_batch_size_follows_the_device(memory_gib, slots):
    assert device_batch_size(None if memory_gib is None else memory_gib * 2**30) == slots


def test_a_default_config_takes_the_devices_batch_size_and_a_set_one_is_kept(monkeypatch):
    from structgen.engine import model_runner

    assert EngineConfig().max_batch_size is None  # the user's choice stays as given
    assert _build(device="cpu", max_seq_len=64).runner.kv.pages.num_slots == 64
    h200 = type("Properties", (), {"total_memory": 141 * 2**30})()
    monkeypatch.setattr(model_runner.torch.cuda, "get_device_properties", lambda device: h200)
    assert model_runner.batch_size_on(EngineConfig(), torch.device("cuda", 0)) == 1024
    assert model_runner.batch_size_on(EngineConfig(max_batch_size=8), torch.device("cuda", 0)) == 8


def test_a_replica_is_started_with_the_batch_size_only_where_one_was_given():
    from structgen.cli import _replica_args, build_parser

    args = build_parser().parse_args(["serve"])
    assert args.max_batch_size is None and "--max-batch-size" not in _replica_args(args)
    args = build_parser().parse_args(["serve", "--max-batch-size", "32"])
    assert _replica_args(args)[_replica_args(args).index("--max-batch-size") + 1] == "32"


def test_a_replica_is_started_with_the_servers_constraint_limits():
    from structgen.cli import _replica_args, build_parser

    flags = ["--max-constraint-bytes", "2000", "--max-constraint-depth", "9", "--max-enum-values", "70000",
             "--compile-timeout", "2.5"]
    replica = build_parser().parse_args(["serve", *_replica_args(build_parser().parse_args(["serve", *flags]))])
    assert (replica.max_constraint_bytes, replica.max_constraint_depth, replica.max_enum_values,
            replica.compile_timeout) == (2000, 9, 70000, 2.5)


def test_every_limit_a_server_client_is_told_to_ask_for_is_a_serve_flag_that_sets_it():
    """structgen_server/errors.py names a `structgen serve` flag for each settable limit: each
    is a real flag, and it sets that limit."""
    from structgen.cli import build_parser
    from structgen.errors import LIMIT_SETTINGS
    from structgen_server.errors import SERVE_FLAGS

    assert set(SERVE_FLAGS) == set(LIMIT_SETTINGS)
    for limit, flag in SERVE_FLAGS.items():
        args = build_parser().parse_args(["serve", flag, "7"])
        attr = {"max_source_bytes": "max_constraint_bytes", "max_depth": "max_constraint_depth"}.get(limit, limit)
        assert getattr(args, attr) == 7, flag


def test_more_tensor_parallel_ranks_than_the_host_runs_are_refused_before_any_process_starts():
    with pytest.raises(InvalidParameterError, match="tensor_parallel=64 spawns a process per rank"):
        _build(device="cpu", tensor_parallel=64)


def test_grammar_threads_past_the_host_limit_are_refused_before_any_thread_starts():
    limit = native.thread_limit()
    assert 4 <= limit <= MAX_GRAMMAR_THREADS
    before = threading.active_count()
    tuning = EngineTuning(grammar_threads=min(limit + 1, MAX_GRAMMAR_THREADS))
    if tuning.grammar_threads > limit:
        with pytest.raises(InvalidParameterError, match=r"grammar_threads=\d+ is more grammar threads .* at most"):
            _build(device="cpu", max_batch_size=2, max_seq_len=64, tuning=tuning)
    assert threading.active_count() == before
    pool = native.load()
    if pool is not None:
        with pytest.raises(InvalidParameterError, match="at most"):
            pool.set_threads(MAX_GRAMMAR_THREADS + 1)


@pytest.mark.parametrize("value", ["abc", "0", "-3", "2.5", "100000"])
def test_a_bad_grammar_threads_variable_is_refused_naming_it(value, monkeypatch):
    monkeypatch.setenv("STRUCTGEN_GRAMMAR_THREADS", value)
    with pytest.raises(InvalidParameterError, match=r"\$STRUCTGEN_GRAMMAR_THREADS"):
        native.default_threads()
    with pytest.raises(InvalidParameterError, match=r"\$STRUCTGEN_GRAMMAR_THREADS"):
        _build(device="cpu", max_batch_size=2, max_seq_len=64)


def test_a_good_grammar_threads_variable_sizes_the_auto_pool(monkeypatch):
    monkeypatch.setenv("STRUCTGEN_GRAMMAR_THREADS", " 2 ")
    assert native.default_threads() == 2


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"threads": 10**5}, "threads"), ({"threads": -1}, "threads"), ({"workers": 0}, "workers"),
    ({"workers": 10**4}, "workers"), ({"workers": "2"}, "workers"), ({"max_queued": 0}, "max_queued"),
    ({"cache_size": -1}, "cache_size"), ({"compile_timeout": -1}, "compile_timeout"),
    ({"backend": "llguidence"}, "did you mean 'llguidance'"),
])
def test_the_grammar_compiler_bounds_its_threads_and_queues(kwargs, field):
    with pytest.raises(InvalidParameterError, match=field):
        GrammarCompiler(object(), 512, [0], **kwargs)
