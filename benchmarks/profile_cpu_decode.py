"""Where a CPU decode step of the default model (packed GGUF weights, batch 1) spends its time:
the engine's whole step, the model's forward through the native decoder (kernels/cpu_decode.py)
and through the torch layers on the same batch, the layers' packed products alone (one call
each, as the torch layers make them), the LM head alone, and the rest of the step (the LM head's
weight read cold, sampling, bookkeeping) by difference. Best of `--repeats`.

Then where the time to the first token of a `--prompt-tokens` prompt goes, with fp32, 16-bit and
int8 activations (`EngineTuning(prompt_activations=...)`): the engine's whole one-token generation,
the model's forward over the prompt (the native step), its layers' packed products alone (one
call per projection, as many rows), the LM head on the last row, and the native step's phases
timed on each of its threads (`QuantKernels.profile_phases`: the tiles of each projection, the
activations' rounding, attention, the element-wise phases, the waits at barriers).

    python -m benchmarks.profile_cpu_decode --threads 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from structgen.engine.attention import AttentionBatch
from structgen.engine.config import EngineConfig, EngineTuning
from structgen.engine.kernels import cpu_quant
from structgen.engine.models.quantized import QuantizedLinear
from structgen.engine.request import Request
from structgen.engine.sampler import SamplingParams

PROMPT = "Extract the person as JSON: Ana Lopes is 31 years old, lives in Lisbon and likes tea and chess."


def best_ms(fn: Callable[[], object], repeats: int, inner: int = 20) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return 1e3 * best


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from structgen import LLM

    llm = LLM(config=EngineConfig(device="cpu", dtype="float32", max_seq_len=1024, prefix_caching=False))
    eng, tok = llm.engine, llm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)
    steps = []
    for _ in range(args.repeats + 1):
        req = Request(ids, SamplingParams(max_tokens=48, jump_forward=False), None, frozenset())
        eng.run([req])
        steps.append(1e3 * req.stats.decode_s / (req.num_output - 1))
    step = min(steps[1:])

    model, kv = eng.runner.model, eng.runner.kv
    slot = kv.pages.allocate_slot()
    kv.pages.cover(slot, len(ids) + 1)
    batch = AttentionBatch.build([(slot, len(ids), 1)], kv.pages)
    token = torch.tensor([ids[-1]])

    def torch_layers() -> torch.Tensor:
        x, residual = model.embed_tokens(token), None
        for layer in model.layers:
            x, residual = layer.forward_residual(x, residual, model.rope, batch, kv)
        return model.norm.add_forward(x, residual)[0]

    native = best_ms(lambda: model(token, batch, kv), args.repeats)
    layers = best_ms(torch_layers, args.repeats)
    linears = [m for name, m in model.named_modules() if isinstance(m, QuantizedLinear) and name != "lm_head"]
    x = {m.in_features: torch.randn(1, m.in_features) for m in linears}
    products = best_ms(lambda: [m(x[m.in_features]) for m in linears], args.repeats)
    head = best_ms(lambda: model.lm_head(x[model.lm_head.in_features]), args.repeats)
    kv.pages.release_slot(slot)
    print(f"threads {torch.get_num_threads()}; ms per decode step (best of {args.repeats}):")
    print(f"  engine step                                   {step:6.2f}")
    print(f"  forward through the native decoder            {native:6.2f}")
    print(f"  forward through the torch layers (old path)   {layers:6.2f}")
    print(f"  the layers' packed products, one call each    {products:6.2f}")
    print(f"  LM head alone (its weight warm in the cache)  {head:6.2f}")
    print(f"  step - native forward - LM head               {step - native - head:6.2f}")
    for activations in ("fp32", "int16", "int8"):
        prompt_profile(LLM(config=EngineConfig(device="cpu", dtype="float32", max_seq_len=1024, prefix_caching=False,
                                               tuning=EngineTuning(prompt_activations=activations))),
                       args.prompt_tokens, args.repeats, activations)


def prompt_profile(llm: object, tokens: int, repeats: int, activations: str) -> None:
    """Where the time to the first token of a `tokens`-token prompt goes."""
    from benchmarks.bench_cpu import PERPLEXITY_TEXT, time_to_first_token

    eng = llm.engine
    model, kv = eng.runner.model, eng.runner.kv
    ids = llm.tokenizer.encode(" ".join([PERPLEXITY_TEXT] * 4), add_special_tokens=False)[:tokens]
    ttft = time_to_first_token(llm, ids, repeats)
    slot = kv.pages.allocate_slot()
    kv.pages.cover(slot, len(ids))
    batch = AttentionBatch.build([(slot, 0, len(ids))], kv.pages)
    prompt = torch.tensor(ids)
    forward = best_ms(lambda: model(prompt, batch, kv), repeats, inner=3)
    phases = [native_phases(lambda: model(prompt, batch, kv), repeats, thread)
              for thread in range(torch.get_num_threads())]
    hidden = model(prompt, batch, kv)
    head = best_ms(lambda: model.logits(hidden[-1:]), repeats)
    kv.pages.release_slot(slot)
    linears = [m for name, m in model.named_modules() if isinstance(m, QuantizedLinear) and name != "lm_head"]
    x = {m.in_features: torch.randn(len(ids), m.in_features) for m in linears}
    kernels, integer = cpu_quant.load(), cpu_quant.PROMPT_ACTIVATIONS[activations]
    products = best_ms(lambda: [kernels.matmul(x[m.in_features], p.packed, p.qtype, p.cols, activations=integer)
                                for m in linears for p in m.parts], repeats, inner=1)
    print(f"{len(ids)}-token prompt, {activations} activations: ms (best of {repeats}):")
    print(f"  time to first token (engine)                  {ttft:6.2f}")
    print(f"  forward over the prompt (native step)         {forward:6.2f}")
    print(f"  the layers' packed products, one call each    {products:6.2f}")
    print(f"  LM head on the last row                       {head:6.2f}")
    print(f"  TTFT - forward - LM head (host, sampling)     {ttft - forward - head:6.2f}")
    totals = " / ".join(f"{sum(p.values()):.2f}" for p in phases)
    print(f"  the native step's phases on each thread (mean of {repeats}; {totals} in all):")
    for name in phases[0]:
        print(f"    {name:<12} " + " ".join(f"{p[name]:6.2f}" for p in phases))


def native_phases(forward: Callable[[], object], repeats: int, thread: int = 0) -> dict[str, float]:
    """ms per call of each phase of the native step on its thread `thread` (`QuantKernels.phase_seconds`),
    mean of `repeats` calls."""
    kernels = cpu_quant.load()
    forward()
    kernels.profile_phases(True, thread)
    for _ in range(repeats):
        forward()
    kernels.profile_phases(False)
    return {name: 1e3 * s / repeats for name, s in kernels.phase_seconds().items()}


if __name__ == "__main__":
    main()
