"""Mixture of experts against transformers' Qwen3MoeForCausalLM (and MixtralForCausalLM) on tiny
random-weight checkpoints (CPU, float32): top-2 of 8 experts with renormalised weights, a dense
layer among sparse ones, Qwen3's q/k norms; the grouped Triton expert kernel against the torch
reference; and the same checkpoint as a llama.cpp `qwen3moe` GGUF."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

import pytest
import torch
from llama_cpp_gguf import gguf_writer, tensor_names

from structgen.engine.config import EngineConfig, ModelConfig
from structgen.engine.engine import Engine
from structgen.engine.models.loader import load_model_config
from structgen.engine.request import Request
from structgen.sampling import SamplingParams

STEPS = 32
PROMPTS = [[1, 17, 301, 45, 9, 88, 120, 7, 33, 250, 61, 5], [1, 400, 3, 77]]
KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def tiny_qwen3_moe(path: Path, **overrides) -> tuple[Path, torch.nn.Module]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    settings = {"vocab_size": 512, "norm_topk_prob": True, "mlp_only_layers": [1], "bos_token_id": 1,
                "eos_token_id": None, **overrides}
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=256, **settings)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # routers far from uniform, so a wrong top-k changes the tokens
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name or "gate.weight" in name else 0.08)
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))


def reference_greedy(model: torch.nn.Module, prompt: list[int], steps: int = STEPS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_config_reads_the_experts_and_the_dense_layer(tiny_moe):
    cfg = load_model_config(tiny_moe[0])
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True] and cfg.norm_topk_prob


def test_greedy_tokens_and_logits_equal_transformers(tiny_moe, greedy_and_logits_match_transformers):
    """32 greedy steps of two prompts batched and prefilled in chunks of 5, a dense layer
    between sparse ones: transformers' tokens and logits."""
    greedy_and_logits_match_transformers(*tiny_moe, PROMPTS, STEPS)


@pytest.mark.slow
def test_routing_without_renormalised_weights_equals_transformers(tmp_path, greedy_and_logits_match_transformers):
    """norm_topk_prob false: the experts' outputs are weighted by the raw softmax probabilities."""
    greedy_and_logits_match_transformers(*tiny_qwen3_moe(tmp_path, norm_topk_prob=False), PROMPTS, STEPS)


def test_a_random_weight_moe_engine_needs_no_files(tiny_moe):
    """Benchmarks build shapes without checkpoints: the experts (kept off memory until weights
    come) are drawn in place and a step runs."""
    engine = Engine(load_model_config(tiny_moe[0]), EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64))
    experts = engine.runner.model.layers[0].mlp.gate_up
    assert experts.device.type == "cpu" and float(experts.detach().std()) > 0.01
    req = Request(PROMPTS[1], SamplingParams(max_tokens=4))
    engine.run([req])
    assert len(req.output_ids) == 4


def test_llm_on_a_moe_folder_returns_a_valid_typed_value(tmp_path, model_dir):
    """`LLM(folder)` on a Qwen3-MoE directory with the default model's tokenizer: a constrained
    generation (random weights, so only validity is asserted) returns one of the literals."""
    import shutil

    from structgen import LLM

    path, _ = tiny_qwen3_moe(tmp_path, vocab_size=49152, eos_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, path / name)
    with LLM(path, config=EngineConfig(device="cpu", max_batch_size=1, max_seq_len=128)) as llm:
        assert llm.generate(Literal["red", "green", "blue"], "Pick a colour.", max_tokens=8) in ("red", "green", "blue")


def tiny_mixtral(path: Path) -> tuple[Path, torch.nn.Module]:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=256, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name or "gate.weight" in name else 0.08)
    model.save_pretrained(path)
    return path, model


def test_mixtral_equals_transformers(tmp_path, greedy_and_logits_match_transformers):
    greedy_and_logits_match_transformers(*tiny_mixtral(tmp_path), PROMPTS, STEPS)


def llama_cpp_tensor(arch: str, name: str, tensor: torch.Tensor, cfg) -> torch.Tensor:
    """A tensor as llama.cpp's converter stores it: the `llama` architecture's q/k rows in
    interleaved rotary pairs."""
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    kind = name.split(".")[-2]
    if arch != "llama" or kind not in heads:
        return tensor
    rows = tensor.shape[0]
    return tensor.reshape(heads[kind], 2, rows // heads[kind] // 2, -1).swapaxes(1, 2).reshape(tensor.shape)


def write_moe_gguf(model: torch.nn.Module, out: Path, arch: str) -> None:
    """The tiny checkpoint as llama.cpp's converter writes it (`qwen3moe`, or Mixtral as
    `llama`; llama_cpp_gguf.py): gate and up experts stacked apart, and the expert counts."""
    cfg = model.config
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    with gguf_writer(out, arch, cfg, head_dim=head_dim) as w:
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        names = tensor_names(arch, cfg.num_hidden_layers)
        for name, tensor in model.state_dict().items():
            if name.endswith("experts.gate_up_proj"):  # llama.cpp stores the two halves apart
                for half, part in zip(("gate_proj", "up_proj"), tensor.chunk(2, dim=1), strict=True):
                    w.add_tensor(names.get_name(name.replace("gate_up_proj", half)) + ".weight", part.float().numpy())
            else:
                w.add_tensor(names.get_name(name, try_suffixes=(".weight",)) + (".weight" * ("experts" in name)),
                             llama_cpp_tensor(arch, name, tensor, cfg).float().numpy())


@pytest.mark.parametrize("arch", ["qwen3moe", pytest.param("llama", marks=pytest.mark.slow)])
def test_a_moe_gguf_converts_to_the_same_model(tmp_path, arch):
    """llama.cpp's `qwen3moe` GGUF (router, stacked expert tensors, q/k norms, no rotary
    permutation) and its Mixtral (a `llama` GGUF with experts, q/k permuted) convert to
    directories our engine runs with transformers' greedy tokens."""
    from structgen.engine.models.loader import resolve_model

    if arch == "qwen3moe":
        _, ref = tiny_qwen3_moe(tmp_path / "hf", mlp_only_layers=[])
    else:
        _, ref = tiny_mixtral(tmp_path / "hf")
    write_moe_gguf(ref, tmp_path / "tiny-moe.gguf", arch)
    model_dir = resolve_model(tmp_path / "tiny-moe.gguf", cache_dir=tmp_path / "cache", progress=False)
    cfg = load_model_config(model_dir)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.dense_layers) == (
        type(ref).__name__, 8, 2, ())
    engine = Engine(cfg, EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64), model_dir)
    req = Request(PROMPTS[0], SamplingParams(max_tokens=16))
    engine.run([req])
    assert req.output_ids == reference_greedy(ref, PROMPTS[0], 16)


@pytest.mark.skipif(not KERNELS, reason="needs CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("tokens", [1, 3, 40, 300])
def test_grouped_expert_kernel_equals_the_torch_reference(tokens):
    """Decode-sized steps (one GEMV per token and chosen expert) and prefill-sized ones (pairs
    sorted into blocks of 16 or, past 512 pairs, 64 rows per expert), top-2 of 8, float32."""
    from structgen.engine.kernels.moe import grouped_experts
    from structgen.engine.models.moe import experts_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, 64, device=device, generator=g)
    gate_up = torch.randn(8, 2 * 48, 64, device=device, generator=g) * 0.1
    down = torch.randn(8, 64, 48, device=device, generator=g) * 0.1
    probs = torch.randn(tokens, 8, device=device, generator=g).softmax(-1)
    weights, ids = probs.topk(2, dim=-1)
    expected = experts_reference(x, ids, weights, gate_up, down)
    assert torch.allclose(grouped_experts(x, ids, weights, gate_up, down), expected, atol=1e-4, rtol=1e-4)



def _random_experts(tokens: int, hidden: int, x_scale: float = 1.0):
    """A step's tokens and 8 experts of width 40 (seeded by `tokens`), each token routed to its
    top 3: (device, its generator for more draws, x, gate_up, down, routing weights, expert ids)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=device, generator=g) * x_scale
    gate_up = torch.randn(8, 2 * 40, hidden, device=device, generator=g) * 0.1
    down = torch.randn(8, hidden, 40, device=device, generator=g) * 0.1
    weights, ids = torch.randn(tokens, 8, device=device, generator=g).softmax(-1).topk(3, dim=-1)
    return device, g, x, gate_up, down, weights, ids

@pytest.mark.skipif(not KERNELS, reason="needs CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_every_candidate_tile_shape_equals_the_torch_reference(tokens):
    """Each launch shape the device may time and keep, on sizes no chunk divides (hidden 96,
    expert width 40): the pair kernels (1 and 5 tokens, top-3 of 8, a token's experts summed
    in one program) and the sorted ones (40 tokens), float32."""
    from structgen.engine.kernels.moe import (
        GROUPED,
        PAIR_DOWN,
        PAIR_GATE_UP,
        PAIR_MAX,
        ExpertTiles,
        grouped_experts,
    )
    from structgen.engine.models.moe import experts_reference

    device, _, x, gate_up, down, weights, ids = _random_experts(tokens, 96)
    expected = experts_reference(x, ids, weights, gate_up, down)
    firsts, seconds = (PAIR_GATE_UP, PAIR_DOWN) if tokens * 3 <= PAIR_MAX else (GROUPED, GROUPED)
    shapes = [ExpertTiles(t, seconds[0]) for t in firsts] + [ExpertTiles(firsts[0], t) for t in seconds[1:]]
    for tiles in shapes:
        out = grouped_experts(x, ids, weights, gate_up, down, tiles)
        assert torch.allclose(out, expected, atol=1e-4, rtol=1e-4), tiles


@pytest.mark.skipif(not KERNELS, reason="needs CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("tokens,experts,block_m", [(1, 8, 16), (40, 8, 16), (300, 128, 64), (70, 60, 16)])
def test_alignment_kernel_equals_the_torch_sort(tokens, experts, block_m):
    """The pairs sorted by expert and padded to blocks: the rows and blocks in use equal
    torch's stable sort, with experts left out and a count that is not a power of two."""
    from structgen.engine.kernels.moe import align_by_expert, align_by_expert_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    scores = torch.rand(tokens, experts, device=device, generator=torch.Generator(device=device).manual_seed(tokens))
    ids = scores.topk(2, dim=-1).indices
    ours, expected = align_by_expert(ids, experts, block_m), align_by_expert_reference(ids, experts, block_m)
    total = int(expected.padded_total)
    assert int(ours.padded_total) == total
    assert torch.equal(ours.sorted_pairs[:total], expected.sorted_pairs[:total])
    assert torch.equal(ours.block_experts[: total // block_m], expected.block_experts[: total // block_m])


@pytest.mark.skipif(not KERNELS, reason="needs CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("normalize", [True, False])
def test_route_kernel_equals_softmax_top_k(normalize):
    """The one-launch router: torch's softmax + top-k (+ renormalisation), 128 experts, top 8,
    from bf16 logits: the same experts, weights highest first."""
    from structgen.engine.kernels.moe import route

    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(5, 128, device=device, generator=torch.Generator(device=device).manual_seed(1))
    logits = logits.to(torch.bfloat16) * 4
    weights, ids = route(logits, 8, normalize)
    expected, expected_ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(8, dim=-1)
    if normalize:
        expected = expected / expected.sum(-1, keepdim=True)
    assert torch.equal(ids.sort(-1).values, expected_ids.sort(-1).values)  # bf16 ties come in either order
    assert torch.allclose(weights, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_timed_launch_shapes_compute_the_reference_in_bf16(tokens):
    """Decode-sized steps on Qwen3-30B-A3B's expert shape (16 of its experts, top 8): the
    launch shapes timed on the device (pair kernels at 1 and 8 tokens, sorted blocks at 64)
    are candidates, and compute the float32 torch reference within bf16 rounding."""
    from structgen.engine.kernels.moe import (
        GROUPED,
        PAIR_DOWN,
        PAIR_GATE_UP,
        expert_tiles,
        grouped_experts,
    )
    from structgen.engine.models.moe import experts_reference

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 2048, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(16, 2 * 768, 2048, device="cuda", generator=g) * 0.02).bfloat16()
    down = (torch.randn(16, 2048, 768, device="cuda", generator=g) * 0.02).bfloat16()
    weights, ids = torch.randn(tokens, 16, device="cuda", generator=g).softmax(-1).topk(8, dim=-1)
    tiles = expert_tiles(tokens, 8, gate_up, down)
    pairs = tokens * 8 <= 64
    assert tiles.gate_up in (PAIR_GATE_UP if pairs else GROUPED) and tiles.down in (PAIR_DOWN if pairs else GROUPED)
    out = grouped_experts(x, ids, weights, gate_up, down).float()
    expected = experts_reference(x.float(), ids, weights, gate_up.float(), down.float())
    assert float((out - expected).norm() / expected.norm()) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_in_bf16_match_eager_and_transformers(tiny_moe, bf16_graphs_match_eager_and_transformers):
    """On the device in bf16: greedy tokens through the CUDA graphs (the expert kernels
    captured) equal the eager path's; prefill logits (the grouped kernel over sorted blocks)
    are within bf16 tolerance of transformers' at the median position (bf16 routing flips a
    few near-tied tokens in any two implementations, our torch path on the CPU included)."""
    bf16_graphs_match_eager_and_transformers(*tiny_moe, PROMPTS, STEPS, routed=True)


@pytest.mark.gpu
@pytest.mark.skipif(not KERNELS, reason="needs CUDA (or TRITON_INTERPRET=1)")
def test_decode_graph_steps_equal_transformers_in_float32(tiny_moe, greedy_through_graph_steps):
    """The decode graphs' step (grouped expert kernel, decode attention) in float32:
    transformers' greedy tokens. On the CPU under TRITON_INTERPRET=1 the steps run eagerly."""
    path, ref = tiny_moe
    ours = greedy_through_graph_steps(path, PROMPTS, 20)
    assert ours == [reference_greedy(ref, p, 20) for p in PROMPTS]


@pytest.mark.gpu
@pytest.mark.skipif(not KERNELS, reason="needs CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (3, 96), (5, 96)])
def test_experts_with_the_norm_inside_equal_norm_then_experts(tokens, hidden):
    """The post-attention norm recomputed inside the pair gate_up kernel, for every launch
    shape it may be timed with (hidden 96: no chunk divides it), top-3 of 8, float32: the
    torch norm and then the experts."""
    from structgen.engine.kernels.moe import (
        PAIR_DOWN,
        PAIR_GATE_UP,
        ExpertTiles,
        InputNorm,
        grouped_experts,
    )
    from structgen.engine.models.llama import RMSNorm
    from structgen.engine.models.moe import experts_reference

    device, g, x, gate_up, down, weights, ids = _random_experts(tokens, hidden, x_scale=3.0)
    norm = RMSNorm(hidden, 1e-6).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, device=device, generator=g) * 0.3 + 1.0)
        expected = experts_reference(norm(x), ids, weights, gate_up, down)
    for tiles in PAIR_GATE_UP:
        out = grouped_experts(x, ids, weights, gate_up, down, ExpertTiles(tiles, PAIR_DOWN[0]),
                              norm=InputNorm(norm.weight.detach(), 1e-6))
        assert torch.allclose(out, expected, atol=1e-4, rtol=1e-4), tiles


def tiny_moe_config(qk_norm: bool) -> ModelConfig:
    """Qwen3-MoE's layout (q/k norms, a dense layer between sparse ones) or Mixtral's (neither)."""
    return ModelConfig(architecture="Qwen3MoeForCausalLM" if qk_norm else "MixtralForCausalLM", vocab_size=300,
                       hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, qk_norm=qk_norm, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, dense_layers=(1,) if qk_norm else ())


def decode_logits(model, prompts: list[list[int]], tokens: list[list[int]] | None, steps: int) -> tuple[list, list]:
    """(logits of every decode step, the tokens fed): each prompt prefilled alone, then `steps`
    decode steps of one row per sequence, fed `tokens` (teacher forcing) or else greedy."""
    from structgen.engine.attention import AttentionBatch
    from structgen.engine.kv_cache import PAGE_SIZE, KVCache
    from structgen.engine.page_table import PageTable

    device = model.embed_tokens.weight.device
    pages = PageTable(3 * 128 // PAGE_SIZE + 1, PAGE_SIZE, 3, 128, device)
    kv = KVCache(model.config, pages, dtype=model.embed_tokens.weight.dtype, device=device)
    fed = tokens or [[] for _ in prompts]
    last, out = [], []
    with torch.inference_mode():
        for slot, prompt in enumerate(prompts, start=1):
            assert pages.cover(slot, len(prompt) + steps + 1)
            batch = AttentionBatch.build([(slot, 0, len(prompt))], pages)
            hidden = model(torch.tensor(prompt, device=device), batch, kv)
            last.append(int(model.logits(hidden[-1:]).argmax()))
        for step in range(steps):
            ids = [fed[i][step] if tokens else last[i] for i in range(len(prompts))]
            if not tokens:
                for i, t in enumerate(ids):
                    fed[i].append(t)
            seqs = [(slot, len(p) + step, 1) for slot, p in enumerate(prompts, start=1)]
            batch = AttentionBatch.build(seqs, pages, decode_kernel=True)
            logits = model.logits(model(torch.tensor(ids, device=device), batch, kv))
            out.append(logits)
            last = logits.argmax(-1).tolist()
    return out, fed


def random_moe(qk_norm: bool, dtype: torch.dtype = torch.float32):
    """A random-weight `tiny_moe_config` model on the kernels' device, its routers far from ties
    and its norms far from ones."""
    from structgen.engine.models.llama import skip_init
    from structgen.engine.models.moe import MoeModel, SparseMoE

    with skip_init(dtype), torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = MoeModel(tiny_moe_config(qk_norm), 128)
    model.init_random_weights(std=0.05)
    with torch.no_grad():
        for layer in model.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
            layer.post_attention_layernorm.weight.normal_(1.0, 0.3)
            layer.input_layernorm.weight.normal_(1.0, 0.3)
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not KERNELS, reason="needs CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("rows", [1, 2])
def test_fused_sparse_layers_decode_with_the_unfused_logits(qk_norm, rows):
    """Greedy decoding of a random-weight mixture of experts, one and two rows a step, float32:
    with the norms inside the projections (qkv with q/k norms, RoPE and the KV write; router;
    experts' gate_up) the tokens and the logits of every step are the unfused path's."""
    from structgen.engine.models.moe import SparseMoE

    model = random_moe(qk_norm)
    prompts = [[1, 17, 201, 45, 9, 88, 120, 7], [1, 40, 3]][:rows]
    model.use_fused_kernels(True, projection_rows=0)
    assert all(layer.fused_rows == 0 for layer in model.layers)
    expected, tokens = decode_logits(model, prompts, None, 6)
    model.use_fused_kernels(True)
    sparse = [layer for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    assert sparse and all(layer.fused_rows >= rows for layer in sparse)
    ours, fed = decode_logits(model, prompts, None, 6)
    assert fed == tokens
    for step, (a, b) in enumerate(zip(ours, expected, strict=True)):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_sparse_layers_in_bf16_stay_within_rounding_of_the_unfused_path():
    """In bf16 (the norm scales fp32 dot products instead of x rounded to bf16): fed the
    unfused path's greedy tokens, the fused path's logits are within bf16 rounding of its
    logits at the median step (a token routed otherwise at a near tie moves one step's)."""
    import statistics

    model = random_moe(True, torch.bfloat16)
    prompts = [[1, 17, 201, 45, 9, 88, 120, 7], [1, 40, 3]]
    model.use_fused_kernels(True, projection_rows=0)
    expected, tokens = decode_logits(model, prompts, None, 8)
    model.use_fused_kernels(True)
    ours, _ = decode_logits(model, prompts, tokens, 8)
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(ours, expected, strict=True)]
    assert statistics.median(errors) < 3e-2, errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_fused_sparse_layer_launches_three_kernels_fewer():
    """One decode row through the tiny Qwen3-MoE layout (two sparse layers, one dense):
    folding the two norms into the projections and the q/k norms into qkv leaves each sparse
    layer eight kernels (qkv, attention's two, o, router, top-k, gate_up, down) instead of
    eleven; the dense layer is unchanged."""
    from torch.profiler import ProfilerActivity, profile

    model = random_moe(True)
    counts = {}
    for rows in (0, 4):
        model.use_fused_kernels(True, projection_rows=rows)
        decode_logits(model, [[1, 17, 201, 45, 9]], None, 2)  # compiles and times everything first
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decode_logits(model, [[1, 17, 201, 45, 9]], None, 1)
            torch.cuda.synchronize()
        counts[rows] = sum(e.device_type == torch.autograd.DeviceType.CUDA and "emcpy" not in e.name
                           and "emset" not in e.name for e in prof.events())
    assert counts[0] - counts[4] == 2 * 3, counts


def test_sparse_layers_fuse_their_norms_at_few_rows_only():
    """`sparse_fused_rows`: the Qwen3-30B-A3B shape at one row (its qkv is a mid-sized matrix),
    a tiny one up to four; none when asked for none, in the batch-invariant mode, or where the
    block widths do not divide half a head and no q/k norms make programs own whole heads."""
    pytest.importorskip("triton")
    from structgen.engine.kernels import batch_invariant, use_batch_invariant
    from structgen.engine.kernels.fused_gemv import MAX_ROWS
    from structgen.engine.models.llama import skip_init
    from structgen.engine.models.moe import MoeModel

    def sparse_rows(cfg: ModelConfig, projection_rows: int = MAX_ROWS) -> list[int]:
        with skip_init(torch.bfloat16), torch.device("meta"):
            model = MoeModel(cfg, 64)
        model.use_fused_kernels(True, projection_rows)
        return [layer.fused_rows for i, layer in enumerate(model.layers) if cfg.is_moe_layer(i)]

    qwen3_30b = ModelConfig(architecture="Qwen3MoeForCausalLM", hidden_size=2048, num_hidden_layers=2,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=128, qk_norm=True,
                            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    assert sparse_rows(qwen3_30b) == [1, 1]
    assert sparse_rows(tiny_moe_config(True)) == [MAX_ROWS, MAX_ROWS]
    assert sparse_rows(tiny_moe_config(True), projection_rows=0) == [0, 0]
    odd_heads = dataclasses.replace(tiny_moe_config(False), head_dim=12)
    assert sparse_rows(odd_heads) == [0, 0, 0]  # half a head of 6: 4 and 8 do not divide it
    before = batch_invariant()
    use_batch_invariant(True)
    try:
        assert sparse_rows(tiny_moe_config(True)) == [0, 0]
    finally:
        use_batch_invariant(before)
