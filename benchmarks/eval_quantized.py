"""Quality of the quantized weight formats against the float model they come from (issue 35):
greedy agreement over 32 tokens on 50 prompts and the perplexity delta on a fixed text, per
format, for the default model (SmolLM2-135M, shipped as a Q4_1 GGUF).

- the reference: the GGUF de-quantized to float (fp32 on CPU, bf16 on CUDA);
- "fp8" / "int4": those float weights quantized at load (`EngineConfig(quantization=...)`),
  run through the Triton kernels on CUDA and their torch reference on CPU;
- "gguf-packed": the GGUF's own blocks kept packed (CPU: the native kernels with fp32
  activations, `EngineTuning(prompt_activations="fp32")`; CUDA: `EngineTuning(gguf_packed_on_cuda=True)`,
  the int4 / int8 kernels);
- "gguf-packed-int16", "gguf-packed-int8" (CPU): the same with the products of several rows on
  16-bit (the default) or int8 activations; also compared with "gguf-packed" (`vs_fp32_activations`).

Quantization changes outputs, so nothing here is asserted; a format whose agreement falls far
below the others' or whose perplexity rises by more than a few percent has a bug to look for.

    python -m benchmarks.eval_quantized [--device cpu|cuda] [--prompts 50] [--tokens 32] [--formats a,b]

Writes benchmarks/results/eval_quantized-<device>-<date>.json (and a copy under $OUT if set).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_cpu import PERPLEXITY_TEXT, greedy_outputs, perplexity
from benchmarks.common import print_table, write_results
from structgen import LLM
from structgen.engine.config import EngineConfig, EngineTuning
from structgen.engine.models.llama import ModelShape

TASKS = ("Explain in two sentences", "Write a short poem about", "List three facts about",
         "Describe to a child", "Give one tip about")
TOPICS = ("the ocean", "photosynthesis", "the moon", "bread baking", "prime numbers", "volcanoes",
          "the printing press", "honey bees", "rainbows", "chess")


def prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """`count` chat prompts (task x topic), in the model's chat template."""
    texts = [f"{task} {topic}." for task, topic in itertools.product(TASKS, TOPICS)][:count]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                           add_generation_prompt=True), add_special_tokens=False)
            for t in texts]


def formats(device: str) -> dict[str, EngineConfig]:
    """The reference (first) and each quantized format's engine configuration on `device`."""
    dtype = "float32" if device == "cpu" else "bfloat16"
    base = {"device": device, "dtype": dtype, "max_batch_size": 16, "max_seq_len": 512}
    configs = {"float": EngineConfig(**base, tuning=EngineTuning(quantized_weights=False)),
               "gguf-packed": EngineConfig(**base, tuning=EngineTuning(gguf_packed_on_cuda=device != "cpu",
                                                                        prompt_activations="fp32"))}
    if device == "cpu":
        for activations in ("int16", "int8"):
            configs[f"gguf-packed-{activations}"] = EngineConfig(
                **base, tuning=EngineTuning(prompt_activations=activations))
    return {**configs, "fp8": EngineConfig(**base, quantization="fp8"),
            "int4": EngineConfig(**base, quantization="int4")}


def agreement(ours: list[list[int]], ref: list[list[int]], tokens: int) -> dict[str, float]:
    """Identical continuations and the mean share of tokens before the first difference."""
    prefix = [next((i for i, (a, b) in enumerate(zip(s, t, strict=False)) if a != b), min(len(s), len(t)))
              for s, t in zip(ours, ref, strict=True)]
    return {"identical": sum(s == t for s, t in zip(ours, ref, strict=True)),
            "mean_common_prefix": sum(prefix) / len(prefix), "agreement": sum(prefix) / len(prefix) / tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--formats", default="", help="comma-separated subset of the formats after the float reference")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    outputs_of: dict[str, list[list[int]]] = {}
    ref_ppl = float("nan")
    chosen = set(args.formats.split(",")) if args.formats else None
    for name, config in formats(args.device).items():
        if chosen is not None and name != "float" and name not in chosen:
            continue
        llm = LLM(config=config)
        ids = prompts(llm.tokenizer, args.prompts)
        outputs = greedy_outputs(llm, ids, args.tokens)
        ppl = perplexity(llm, llm.tokenizer.encode(PERPLEXITY_TEXT, add_special_tokens=False))
        if name == "float":
            ref_ppl = ppl
        outputs_of[name] = outputs
        match = agreement(outputs, outputs_of["float"], args.tokens)
        if name in ("gguf-packed-int16", "gguf-packed-int8") and "gguf-packed" in outputs_of:
            fp32 = rows[[r["system"] for r in rows].index("structgen-gguf-packed")]
            match["vs_fp32_activations"] = {**agreement(outputs, outputs_of["gguf-packed"], args.tokens),
                                            "perplexity_delta": ppl - fp32["perplexity"]}
        rows.append({"system": f"structgen-{name}", "model": "smollm2-135m", "metric": "greedy_agreement",
                     "value": match["agreement"], **match, "prompts": len(ids), "tokens": args.tokens,
                     "perplexity": ppl, "perplexity_float": ref_ppl, "perplexity_delta": ppl - ref_ppl,
                     "weight_bytes": ModelShape.of(llm.engine.runner.model).weight_bytes})
        print(rows[-1], flush=True)
        del llm
    print_table([{k: r[k] for k in ("system", "value", "identical", "mean_common_prefix", "perplexity",
                                    "perplexity_delta")} for r in rows])
    path = write_results("eval_quantized", rows, extra={"note": "greedy, chat-templated prompts; the float "
                                                         "reference is the GGUF de-quantized"})
    print("wrote", path)
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)


if __name__ == "__main__":
    main()
