"""Decode-step benchmark: ms per decode step of our engine (CUDA graphs, grammar mask inside,
mask filling overlapped with the forward) against transformers eager `generate`, with and
without xgrammar's HF logits processor, on the same device, weights and prompts.

Models: SmolLM2-135M-Instruct and Gemma 3 270M (real weights; Gemma's 262k vocabulary is the
mask-fill stress case), random-weight Llama-3.2-1B, Llama-3.1-8B and Qwen3-8B shapes, and the
Qwen3-30B-A3B mixture-of-experts shape (its floor counts the 8 experts a token is routed to,
not all 128). Batches 1, 8, 64; unconstrained and constrained by a typical JSON schema (a record
of six fields). Only full pure-decode steps are timed: each round prefills the batch, skips
two steps, and times steps until the first request finishes; rounds repeat until `--steps`
steps are timed. Also: the HBM floor (decode weight bytes over measured copy bandwidth),
tokens/s of 64 concurrent JSON requests end to end through `LLM.acomplete`, and a
self-check that greedy outputs are identical with graphs on and off.

    python -m benchmarks.bench_decode                       # everything (on the GPU)
    python -m benchmarks.bench_decode --models llama-8b-shape --batches 1 --no-peers
    python -m benchmarks.bench_decode --models qwen3-8b-shape,qwen3-30b-a3b-shape --batches 1,8
    python -m benchmarks.bench_decode --models gemma-3-270m --batches 1,64

Tensor parallelism (`--tensor-parallel 1,2`: each model at each size, on that many GPUs of
this host; rows carry `tensor_parallel`, and their floor is the weight bytes over N times the
measured copy bandwidth: each GPU reads its 1/N share):

    python -m benchmarks.bench_decode --models llama-8b-shape --tensor-parallel 1,2 --batches 1,64 --no-peers
    python -m benchmarks.bench_decode --models llama-70b-shape --tensor-parallel 4 --batches 1,16,64 --no-peers

Each tensor-parallel row also says what rank 0 built (`rank0_weight_gb` against the whole
model's `model_weight_gb`: each rank draws only its shard's random weights, on its GPU), each
GPU's memory in use once the engine is up, and the engine's build time. `--cpu` runs the
tensor-parallel rows on the CPU (gloo, `tiny-llama-shape`): a dry run of the code path whose
times mean nothing (scripts/device/multi_gpu.sh --dry-run).
    python -m benchmarks.bench_decode --models llama-8b-shape,llama-8b-shape-fp8,llama-8b-shape-int4 --batches 1,64 --no-peers
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    decode_weight_bytes,
    fits_two_copies,
    hbm_floor_ms,
    hf_param_shapes,
    measure_copy_bandwidth_gbps,
    model_config,
    print_table,
    random_weights,
    write_results,
)
from structgen.engine.closing import FIRST_CHECK_WINDOW
from structgen.engine.config import EngineConfig, EngineTuning
from structgen.engine.engine import Engine
from structgen.engine.request import Request
from structgen.grammar import native
from structgen.grammar.prefetch import MIN_ROWS, MaskPrefetcher
from structgen.sampling import SamplingParams

MODELS = ("smollm2-135m", "gemma-3-270m", "llama-1b-shape", "llama-8b-shape", "qwen3-8b-shape", "qwen3-30b-a3b-shape")
REAL_MODELS = {"smollm2-135m": None, "gemma-3-270m": "gemma-3-270m"}  # name -> resolve_model argument
# A typical extraction record: strings, an integer, a boolean and a list.
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                   "active": {"type": "boolean"}},
    "required": ["name", "age", "city", "email", "tags", "active"],
}
PROMPT = "Write a JSON record for a fictional person: name, age, city, email, a few tags, active."
E2E_SCHEMA = {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                     "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}
# Quantized shapes (issue 35): random weights drawn and quantized at load
# (`EngineConfig(quantization=...)`), each row's floor from the packed bytes a step reads and
# `bf16_floor_ms` beside it. Llama-70B's float weights fit no single GPU: it runs quantized only.
QUANTIZED_MODELS = ("llama-8b-shape-fp8", "llama-8b-shape-int4", "llama-70b-shape-fp8", "llama-70b-shape-int4")


def quantization_of(model: str) -> str | None:
    """"fp8" / "int4" for a quantized shape's name, else None."""
    return model.rpartition("-")[2] if model.endswith(("-shape-fp8", "-shape-int4")) else None


def packed_floor_ms(engine: Engine, bandwidth: float) -> float:
    """The floor of the model as loaded: its packed projections plus the float rest."""
    from structgen.engine.models.llama import ModelShape

    return hbm_floor_ms(ModelShape.of(engine.runner.model).weight_bytes, bandwidth)


def batch_floor_ms(cfg, batch: int, bandwidth: float) -> float:
    """The floor of a step of `batch` sequences: a mixture of experts reads the distinct experts
    its tokens are routed to (uniformly at random, as random weights route them: about 126 of
    Qwen3-30B-A3B's 128 at batch 64), not the `num_experts_per_tok` of one token."""
    nbytes = decode_weight_bytes(cfg, torch.bfloat16)
    if cfg.num_experts:
        k, n = cfg.num_experts_per_tok, cfg.num_experts
        extra = n * (1 - (1 - k / n) ** batch) - k
        sparse = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        nbytes += round(sparse * extra * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2)
    return hbm_floor_ms(nbytes, bandwidth)


NAMES = ["Ana", "Bo", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana"]
CITIES = ["Lisbon", "Oslo", "Lima", "Osaka", "Nairobi", "Quito", "Perth", "Riga"]


def tiny_llama_shape() -> Any:
    """A two-layer Llama of Llama-1B's layout, small enough for the CPU (dry runs)."""
    return dataclasses.replace(model_config("llama-1b"), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=49152,
                               tie_word_embeddings=False)


def load(model: str, tok_dir: Path | None) -> tuple[Any, Any, Path | None, set[int]]:
    """(ModelConfig, tokenizer, weights dir or None for random weights, stop ids)."""
    from structgen.engine.models.loader import load_model_config, load_tokenizer, resolve_model

    if model in REAL_MODELS:
        d = resolve_model(REAL_MODELS[model], progress=False)
        cfg = load_model_config(d)
        return cfg, load_tokenizer(d), d, set(cfg.eos_token_id)
    cfg = tiny_llama_shape() if model == "tiny-llama-shape" else model_config(model.split("-shape")[0])
    tok = load_tokenizer(tok_dir or resolve_model(None, progress=False))
    return cfg, tok, None, set(cfg.eos_token_id)


def build_engine(cfg, model_dir: Path | None, stop: set[int], graphs: bool, prefill_in_graphs: bool = True,
                 tensor_parallel: int = 1, quantization: str | None = None,
                 batch_invariant: bool = False) -> Engine:
    if tensor_parallel > 1:
        # Every rank captures its graphs while it is built, with its own random shard
        # (`init_random_weights`): the worker ranks could not follow a later capture.
        ec = EngineConfig(max_batch_size=64, max_seq_len=1024, jump_forward=False, use_cuda_graphs=graphs,
                          batch_invariant=batch_invariant, tuning=EngineTuning(prefill_in_graphs=prefill_in_graphs),
                          tensor_parallel=tensor_parallel)
        return Engine(cfg, ec, model_dir, stop_token_ids=stop)
    ec = EngineConfig(max_batch_size=64, max_seq_len=1024, jump_forward=False, use_cuda_graphs=False,
                      quantization=quantization, batch_invariant=batch_invariant,
                      tuning=EngineTuning(prefill_in_graphs=prefill_in_graphs))
    engine = Engine(cfg, ec, model_dir, stop_token_ids=stop)
    if model_dir is None and quantization is None and fits_two_copies(cfg, engine.runner.dtype, engine.device):
        # the peers' random weights (benchmarks.common), copied in place; a model too large
        # for two copies keeps the random weights it was built with
        engine.runner.model.load_hf_weights(random_weights(cfg, engine.runner.dtype, engine.device, seed=0))
        gc.collect()
        torch.cuda.empty_cache()  # before capture: nothing a graph uses may be released after it
    engine.config.use_cuda_graphs = graphs
    if graphs:
        engine.runner.capture_decode_graphs()
    return engine


def chat(tokenizer, text: str) -> str:
    """The prompt as text: through the chat template, or, for a base model without one (Gemma 3
    270M), the raw text behind the tokenizer's BOS, so encoding it without special tokens
    (here and in the peers) gives the same ids either way."""
    if not tokenizer.chat_template:
        return (tokenizer.bos_token or "") + text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def time_decode(engine: Engine, prompt_ids: list[int], batch: int, grammar, steps: int,
                repeats: int = 3) -> dict[str, Any]:
    """ms per pure decode step with `batch` requests all alive and sampling (stop tokens off
    for free text; constrained rows end with their grammar, which ends a round).

    One untimed pass first: the first masked step at a batch size captures its sampler graph
    and warms the grammar library's caches (a one-off ~150 ms that read as +400 % over 48
    steps of SmolLM2). Then `repeats` timed passes of `steps` steps; the median is reported.

    Where the engine tunes its mask prefetch (`mask_prefetch="auto"`) the untimed steps go on
    until the tuner has chosen (at most ~400 steps): its trials run half their steps in the
    slower mode, which a serving engine pays once per 1024 steps of a shape, not per pass."""
    _decode_steps(engine, prompt_ids, batch, grammar, 8)
    tuner = engine.prefetcher.tuner if engine.prefetcher is not None else None
    if tuner is not None and grammar is not None and batch >= MIN_ROWS:
        for _ in range(8):
            if tuner.holding:
                break
            _decode_steps(engine, prompt_ids, batch, grammar, steps)
    passes = [_decode_steps(engine, prompt_ids, batch, grammar, steps) for _ in range(repeats)]
    ms = [p[0] for p in passes]
    return {"value": statistics.median(ms), "passes_ms": [round(v, 4) for v in ms],
            "steps": steps, "rounds": sum(p[1] for p in passes)}


def _decode_steps(engine: Engine, prompt_ids: list[int], batch: int, grammar,
                  steps: int) -> tuple[float, int]:
    """(ms per step over `steps` timed decode steps, rounds of requests it took)."""
    elapsed, timed, rounds = 0.0, 0, 0
    while timed < steps and rounds < 50:
        rounds += 1
        reqs = [Request(prompt_ids, SamplingParams(max_tokens=steps + 16 + FIRST_CHECK_WINDOW),
                        grammar.matcher() if grammar is not None else None,
                        frozenset(engine.stop_token_ids) if grammar is not None else frozenset())
                for _ in range(batch)]
        for r in reqs:
            engine.add_request(r)
        while any(r.num_output == 0 for r in reqs):
            engine.step()
        for _ in range(2):  # the first decode step after a prefill cannot be pre-launched
            engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while timed < steps and all(not r.finished for r in reqs):
            engine.step()
            timed += 1
        elapsed += time.perf_counter() - t0
        for r in reqs:
            engine.abort(r)
    return elapsed * 1e3 / max(timed, 1), rounds


def self_check(cfg, model_dir, stop, tokenizer, grammar) -> dict[str, Any]:
    """Greedy outputs with graphs on == graphs off (free text and JSON rows; a full bucket
    of 8 and a batch of 3 padded to 4), decoding from the same eager prefill: prompts run
    through the graphs round differently in bf16 (bench_prefill), which is not what this
    checks."""
    prompts = [tokenizer.encode(chat(tokenizer, f"Describe {n} from {c}."), add_special_tokens=False)
               for n, c in zip(NAMES, CITIES, strict=True)]
    outs = {}
    for graphs in (True, False):
        engine = build_engine(cfg, model_dir, stop, graphs, prefill_in_graphs=False)
        runs = []
        for batch in (prompts, prompts[:3]):
            reqs = [Request(p, SamplingParams(max_tokens=40), grammar.matcher() if i % 2 else None,
                            frozenset(stop)) for i, p in enumerate(batch)]
            engine.run(reqs)
            runs.append([r.output_ids for r in reqs])
        outs[graphs] = runs
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    same = outs[True] == outs[False]
    rows_differing = sum(a != b for ra, rb in zip(outs[True], outs[False], strict=True)
                         for a, b in zip(ra, rb, strict=True))
    return {"graphs_equal_eager": same, "rows_differing": rows_differing}


def tensor_parallel_rows(model: str, cfg, model_dir: Path | None, stop: set[int], prompt_ids: list[int], grammar,
                         batches: list[int], size: int, bandwidth: float, steps: int) -> tuple[list[dict], float]:
    """ms per decode step, free and constrained, with the model split over `size` GPUs;
    returns the rows and their floor: the weight bytes over `size` times the copy bandwidth
    (each GPU reads its share at once)."""
    floor = hbm_floor_ms(decode_weight_bytes(cfg, torch.bfloat16), bandwidth) / size
    t_build = time.perf_counter()
    engine = build_engine(cfg, model_dir, stop, graphs=torch.cuda.is_available(), tensor_parallel=size)
    built = {"build_s": round(time.perf_counter() - t_build, 1), **shard_check(engine, cfg, size)}
    print(f"[{model} TP {size}] built: {built}", flush=True)
    rows = []
    try:
        for batch in batches:
            for constrained in (False, True):
                r = time_decode(engine, prompt_ids, batch, grammar if constrained else None, steps)
                rows.append({"system": f"structgen-tp{size}", "model": model, "batch": batch,
                             "constrained": constrained, "metric": "ms_per_step", "tensor_parallel": size,
                             **r, "floor_ms": floor, **built})
                print(rows[-1], flush=True)
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return rows, floor


def shard_check(engine: Engine, cfg, size: int) -> dict[str, Any]:
    """What rank 0 holds against the whole model (its share is 1/size, plus the padded
    vocabulary rows), and each GPU's memory in use as the driver reports it."""
    import subprocess

    mine = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    whole = sum(math.prod(shape) for shape in hf_param_shapes(cfg).values()) * engine.runner.dtype.itemsize
    out: dict[str, Any] = {"rank0_weight_gb": round(mine / 1e9, 2), "model_weight_gb": round(whole / 1e9, 2),
                           "rank0_holds_only_its_shard": mine <= 1.02 * whole / size + 2 * cfg.hidden_size * 4}
    if engine.device.type == "cuda":
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20, check=True)
            out["gpu_used_gb"] = [round(int(v) / 1024, 1) for v in smi.stdout.split()]
        except (OSError, subprocess.SubprocessError, ValueError):
            out["gpu_used_gb"] = None
    return out


def end_to_end(engine: Engine, tokenizer, n: int = 64) -> dict[str, Any]:
    """n concurrent JSON extraction requests through LLM.acomplete (jump-forward on)."""
    from structgen.api import LLM
    from structgen.types import JsonSchema

    engine.config.jump_forward = True
    llm = LLM.from_engine(engine, tokenizer, "SmolLM2-135M-Instruct")
    prompts = [f"Extract the person as JSON: {NAMES[i % 8]} {NAMES[(i // 8) % 8]}son is {20 + i} years "
               f"old and lives in {CITIES[(i * 3) % 8]}." for i in range(n)]
    schema = JsonSchema(E2E_SCHEMA)
    llm.generate(schema, prompts[0], max_tokens=64)  # warm: grammar compile, jump-forward tables

    async def go():
        return await asyncio.gather(*(llm.acomplete(schema, p, max_tokens=64) for p in prompts),
                                    return_exceptions=True)

    t0 = time.perf_counter()
    results = asyncio.run(go())
    wall = time.perf_counter() - t0
    ok = [r for r in results if not isinstance(r, BaseException)]
    tokens = sum(len(r.token_ids) for r in ok)
    engine.config.jump_forward = False
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens, "valid": len(ok), "requests": n,
            "errors": sorted({type(r).__name__ for r in results if isinstance(r, BaseException)})}


def summarize(rows: list[dict[str, Any]], batches: list[int]) -> None:
    """Per model and tensor-parallel size: the grammar overhead at each batch, and at batch 1
    the step time over its floor (and, split, the speedup over one GPU)."""
    steps = {(r["model"], r.get("tensor_parallel", 1), r["batch"], r["constrained"]): r for r in rows
             if r["system"] in ("structgen", "structgen-not-invariant", f"structgen-tp{r.get('tensor_parallel', 1)}")
             and r["metric"] == "ms_per_step"}
    for model, size in sorted({(m, n) for m, n, _, _ in steps}):
        name = model if size == 1 else f"{model} TP {size}"
        for b in batches:
            free, json_ = steps.get((model, size, b, False)), steps.get((model, size, b, True))
            if free is None or json_ is None:
                continue
            line = f"{name} batch {b}: grammar overhead {100 * (json_['value'] / free['value'] - 1):+.1f}%"
            if b == 1:
                line += f", {free['value'] / free['floor_ms']:.2f}x floor"
            elif "batch_floor_ms" in free:  # a mixture of experts: its batch reads more experts
                line += f", {free['value'] / free['batch_floor_ms']:.2f}x its batch's floor"
                one = steps.get((model, 1, 1, False))
                if size > 1 and one is not None:
                    line += f", {one['value'] / free['value']:.2f}x faster than TP 1"
            print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"also {', '.join(QUANTIZED_MODELS)}")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--tensor-parallel", default="1",
                    help="comma-separated tensor-parallel sizes to run each model at (GPUs of this host)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--peer-tokens", type=int, default=32)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="print only (debug runs)")
    ap.add_argument("--name", default="decode",
                    help="the results file's benchmark name (decode_tp: a multi-GPU host's rows, beside the "
                         "same card's one-GPU file)")
    ap.add_argument("--dump", type=Path, default=None, help="also write rows/floors here after each model")
    ap.add_argument("--merge", type=Path, default=None, help="start from rows/floors dumped by an earlier run")
    ap.add_argument("--batch-invariant", choices=("on", "off"), default="off",
                    help="EngineConfig.batch_invariant (process-wide: one setting a run; rows of 'off' are "
                         "named structgen-not-invariant, so --dump/--merge can join two runs)")
    ap.add_argument("--tokenizer-dir", type=Path, default=None,
                    help="SmolLM2 tokenizer files for the random-shape models (when the model is absent)")
    ap.add_argument("--cpu", action="store_true",
                    help="dry run on the CPU (gloo; e.g. --models tiny-llama-shape --tensor-parallel 1,2 --no-peers)")
    args = ap.parse_args()
    assert args.cpu or torch.cuda.is_available(), "bench_decode measures the GPU engine; run it on a CUDA machine"
    from benchmarks.peers import (
        compile_xgrammar,
        load_hf_model,
        outlines_json,
        transformers_generate,
    )
    from structgen.grammar import GrammarCompiler, GrammarThreads
    from structgen.types import JsonSchema, to_constraint

    batches = [int(b) for b in args.batches.split(",")]
    tp_sizes = [int(n) for n in args.tensor_parallel.split(",")]
    assert args.cpu or max(tp_sizes) <= torch.cuda.device_count(), f"--tensor-parallel {max(tp_sizes)} needs that many GPUs"
    bandwidth = measure_copy_bandwidth_gbps()
    rows: list[dict[str, Any]] = []
    floors: dict[str, float] = {}
    extra: dict[str, Any] = {"copy_bandwidth_gbps": bandwidth, "schema": SCHEMA, "steps": args.steps,
                             "settings": "max_seq_len=1024, jump_forward off for ms/step (median of 3 passes after an untimed one), bf16, greedy",
                             "grammar_threads": dataclasses.asdict(GrammarThreads.resolve()),
                             "native_fill_threads": native.load().threads if native.pool_in_use() else 0,
                             "mask_prefetch": EngineTuning().mask_prefetch}
    if args.merge is not None and args.merge.is_file():
        earlier = json.loads(args.merge.read_text())
        rows, floors = earlier["rows"], earlier["floors"]
        extra = {**earlier["extra"], **extra}
    for model in args.models.split(","):
        t_load = time.perf_counter()
        cfg, tok, model_dir, stop = load(model, args.tokenizer_dir)
        floors[model] = hbm_floor_ms(decode_weight_bytes(cfg, torch.bfloat16), bandwidth)
        prompt_ids = tok.encode(chat(tok, PROMPT), add_special_tokens=False)
        grammar = GrammarCompiler(tok, cfg.vocab_size, sorted(stop)).compile(to_constraint(JsonSchema(SCHEMA)))
        if 1 not in tp_sizes:
            continue  # a shape that only fits split (llama-70b-shape)
        invariant = args.batch_invariant == "on"
        engine = build_engine(cfg, model_dir, stop, graphs=not args.cpu, quantization=quantization_of(model),
                              batch_invariant=invariant)
        bf16_floor = floors[model]
        if quantization_of(model):
            floors[model] = packed_floor_ms(engine, bandwidth)
        # The budget closer and loop guards, on as in the product (budgets stay out of reach).
        engine.closer.use_tokenizer(tok, engine.vocab_size, engine.stop_token_ids)
        print(f"[{model}] engine ready in {time.perf_counter() - t_load:.1f}s "
              f"(graphs {engine.runner.graphs.batch_sizes if engine.runner.graphs else None})", flush=True)
        for batch in batches:
            for constrained in (False, True):
                r = time_decode(engine, prompt_ids, batch, grammar if constrained else None, args.steps)
                tuner = engine.prefetcher.tuner if engine.prefetcher is not None else None
                if constrained and batch >= MIN_ROWS and tuner is not None:
                    r["prefetch_decisions"] = list(tuner.decisions)  # what "auto" chose, in order
                rows.append({"system": "structgen" if invariant else "structgen-not-invariant", "model": model,
                             "batch": batch, "constrained": constrained, "batch_invariant": invariant,
                             "metric": "ms_per_step", **r, "floor_ms": floors[model], "bf16_floor_ms": bf16_floor})
                if cfg.num_experts:
                    rows[-1]["batch_floor_ms"] = batch_floor_ms(cfg, batch, bandwidth)
                print(rows[-1], flush=True)
            if batch >= MIN_ROWS:
                # The same JSON steps with the mask prefetch (grammar/prefetch.py) forced on and
                # off; the row above ran with the engine's default (tuned on this host; where
                # grammar.native's pool fills the masks, no prefetch: "off" is the default row).
                default = engine.prefetcher
                for mode in ("on",) if native.pool_in_use() else ("on", "off"):
                    engine.prefetcher = MaskPrefetcher(engine.grammar_threads.prefetch) if mode == "on" else None
                    r = time_decode(engine, prompt_ids, batch, grammar, args.steps)
                    if engine.prefetcher is not None:
                        engine.prefetcher.close()
                    rows.append({"system": f"structgen-prefetch-{mode}", "model": model, "batch": batch,
                                 "constrained": True, "metric": "ms_per_step", **r, "floor_ms": floors[model]})
                    print(rows[-1], flush=True)
                engine.prefetcher = default
                # Mask fills without grammar.native's pool (xgrammar's own batch fill), as on a
                # machine with one thread for it or no compiler.
                if native.pool_in_use():
                    pool = native.load()
                    threads = pool.threads
                    pool.set_threads(1)
                    r = time_decode(engine, prompt_ids, batch, grammar, args.steps)
                    pool.set_threads(threads)
                    rows.append({"system": "structgen-native-off", "model": model, "batch": batch,
                                 "constrained": True, "metric": "ms_per_step", **r, "floor_ms": floors[model]})
                    print(rows[-1], flush=True)
        if model == "smollm2-135m":
            e2e = end_to_end(engine, tok)
            rows.append({"system": "structgen", "model": model, "batch": e2e["requests"], "constrained": True,
                         "metric": "tokens_per_s", "value": e2e["tokens_per_s"],
                         **{k: v for k, v in e2e.items() if k != "tokens_per_s"}})
            print(rows[-1], flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        if model == "smollm2-135m":
            extra["self_check"] = self_check(cfg, model_dir, stop, tok, grammar)
            print("self-check:", extra["self_check"], flush=True)
        if not args.no_peers and quantization_of(model) is None:
            hf = load_hf_model(model_dir if model_dir is not None else model, torch.bfloat16, "cuda", seed=0)
            xg = compile_xgrammar(tok, cfg.vocab_size, sorted(stop), json_schema=SCHEMA)
            outlines = outlines_json(hf, tok, SCHEMA)  # None without Outlines installed
            text = chat(tok, PROMPT)
            if tok.pad_token is None:  # equal prompts never pad; transformers still wants one
                tok.pad_token = tok.eos_token
            for batch in batches:
                for constrained, peer_xg, peer_outlines in ((False, None, None), (True, xg, None), (True, None, outlines)):
                    if constrained and peer_xg is None and peer_outlines is None:
                        continue  # Outlines not installed
                    run = transformers_generate(hf, tok, [text] * batch, args.peer_tokens, compiled_grammar=peer_xg,
                                                outlines_processor=peer_outlines, ignore_eos=not constrained)
                    rows.append({"system": run.system, "model": model, "batch": batch, "constrained": constrained,
                                 "metric": "ms_per_step", "value": run.ms_per_step, "steps": run.steps,
                                 "floor_ms": floors[model]})
                    print(rows[-1], flush=True)
            del hf
            gc.collect()
            torch.cuda.empty_cache()
        if args.dump is not None:
            args.dump.write_text(json.dumps({"rows": rows, "floors": floors, "extra": extra}, default=str))
    # The split sizes after every one-GPU row: on an H100 host a one-GPU engine built after a
    # tensor-parallel one had closed never finished building, and its rows were lost.
    for model in args.models.split(","):
        cfg, tok, model_dir, stop = load(model, args.tokenizer_dir)
        prompt_ids = tok.encode(chat(tok, PROMPT), add_special_tokens=False)
        grammar = GrammarCompiler(tok, cfg.vocab_size, sorted(stop)).compile(to_constraint(JsonSchema(SCHEMA)))
        for size in (n for n in tp_sizes if n > 1):
            tp_rows, floors[f"{model}-tp{size}"] = tensor_parallel_rows(
                model, cfg, model_dir, stop, prompt_ids, grammar, batches, size, bandwidth, args.steps)
            rows += tp_rows
            if args.dump is not None:  # each size's rows kept as soon as they exist
                args.dump.write_text(json.dumps({"rows": rows, "floors": floors, "extra": extra}, default=str))

    table = [{k: r.get(k) for k in ("system", "model", "batch", "constrained", "metric", "value", "floor_ms")}
             for r in rows]
    print(f"\ndevice: {torch.cuda.get_device_name() if not args.cpu else 'cpu'}  copy bandwidth: {bandwidth:.0f} GB/s")
    print_table(table)
    summarize(rows, batches)
    if "self_check" in extra:
        print("self-check (greedy, graphs on == off):", json.dumps(extra["self_check"]))
    if not args.no_write:
        print("wrote", write_results(args.name, rows, floors, extra))


if __name__ == "__main__":
    main()
