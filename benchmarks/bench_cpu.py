"""CPU benchmark of the default model at batch 1: start-up of `LLM()` cold (GGUF converted into
an empty cache) and warm, the converted cache's size, ms per generated token (free text and a
JSON schema) and time to first token for a 50-token prompt, for structgen with its weights kept
quantized (the default: prompts' products on 16-bit activations), the same with its prompts'
products on int8 activations ("structgen-int8") and on fp32 ones ("structgen-fp32act",
`EngineTuning(prompt_activations=...)`), and with its weights de-quantized to fp32
(`EngineTuning(quantized_weights=False)`, the old path),
beside llama.cpp (llama-cpp-python, when installed) and transformers eager `generate` (with and
without xgrammar / Outlines) on the same GGUF, prompt tokens, threads and greedy decoding.

Quality of the quantized path (fp32 activations) against the fp32-de-quantized one, and of the
16-bit and int8 activations against fp32 ones: greedy agreement over 32 tokens on a handful of prompts, and the perplexity
of both on a fixed text (benchmarks/eval_quantized.py runs 50 prompts).

Every system is timed the same way: wall time of one whole generation (prefill included, no
prefix cache) divided by its new tokens, after a warm-up generation. Free text runs a fixed number of tokens
(stop tokens off); the JSON rows run until the schema's grammar completes.

    python -m benchmarks.bench_cpu --threads 2                  # a few minutes on 2 cores
    python -m benchmarks.bench_cpu --threads 2 --no-cold --no-transformers
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import print_table, write_results
from structgen.engine.config import EngineConfig, EngineTuning
from structgen.engine.request import Request
from structgen.engine.sampler import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False,
}
PROMPT = "Extract the person as JSON: Ana Lopes is 31 years old, lives in Lisbon and likes tea and chess."
TTFT_TOKENS = 50
START = "import time; t = time.perf_counter(); import structgen; structgen.LLM(); print(time.perf_counter() - t)"
QUALITY_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash map is.",
    "Give three tips for learning a language.", "Describe a cat in one sentence.",
    "What is 12 times 7?", "Name the planets of the solar system.", "Write a short thank-you note.",
]
PERPLEXITY_TEXT = (
    "The printing press, developed in the fifteenth century, changed how knowledge spread across "
    "Europe. Before it, books were copied by hand, which made them rare and expensive. Within a few "
    "decades, printed books became common, literacy rose, and ideas travelled faster than ever. "
    "Scholars could compare the same text in different cities, errors were easier to find, and new "
    "fields of study grew around the exchange of printed work."
)


def start_time(cache: str | None) -> float:
    """Seconds for `import structgen; LLM()` in a fresh process (cache: STRUCTGEN_CACHE)."""
    env = dict(os.environ, **({"STRUCTGEN_CACHE": cache} if cache else {}))
    out = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def ours(llm: Any, prompt_ids: list[int], tokens: int, grammar: Any) -> dict[str, Any]:
    eng = llm.engine
    stop = frozenset(eng.stop_token_ids) if grammar is not None else frozenset()

    def run() -> Request:
        req = Request(prompt_ids, SamplingParams(max_tokens=tokens, jump_forward=False),
                      grammar.matcher() if grammar is not None else None, stop)
        eng.run([req])
        return req

    run()
    t0 = time.perf_counter()
    req = run()
    wall = time.perf_counter() - t0
    decode_ms = 1e3 * req.stats.decode_s / max(req.num_output - 1, 1)
    return {"ms_per_token": 1e3 * wall / req.num_output, "decode_ms_per_step": decode_ms,
            "tokens": req.num_output, "text": llm.tokenizer.decode(req.output_ids)[:80]}


def time_to_first_token(llm: Any, prompt_ids: list[int], repeats: int = 5) -> float:
    """Best of `repeats` wall times (ms) of a one-token generation: prefill + one step."""
    best = float("inf")
    for i in range(repeats + 1):
        req = Request(prompt_ids, SamplingParams(max_tokens=1), None, frozenset())
        t0 = time.perf_counter()
        llm.engine.run([req])
        if i:  # the first is a warm-up
            best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def greedy_outputs(llm: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    reqs = [Request(p, SamplingParams(max_tokens=tokens), None, frozenset()) for p in prompts]
    llm.engine.run(reqs)
    return [r.output_ids for r in reqs]


@torch.inference_mode()
def perplexity(llm: Any, ids: list[int]) -> float:
    """exp(mean next-token NLL) of `ids` under the engine's model, in one forward."""
    from structgen.engine.model_runner import ExtendSeq

    logits = llm.engine.runner.extend([ExtendSeq(0, 0, ids, num_logits=len(ids))])
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:], device=logits.device))
    return float(torch.exp(nll))


def quality(quantized: Any, dequantized: Any) -> dict[str, Any]:
    """Greedy agreement over 32 tokens and the perplexity delta of `quantized` against its reference
    `dequantized` (quantized vs fp32 weights, or int8 vs fp32 activations)."""
    tok = quantized.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for p in QUALITY_PROMPTS]
    a, b = greedy_outputs(quantized, prompts, 32), greedy_outputs(dequantized, prompts, 32)
    common = [next((i for i, (x, y) in enumerate(zip(s, t, strict=False)) if x != y), min(len(s), len(t))) for s, t in zip(a, b, strict=True)]
    text_ids = tok.encode(PERPLEXITY_TEXT, add_special_tokens=False)
    ppl_q, ppl_f = perplexity(quantized, text_ids), perplexity(dequantized, text_ids)
    return {"prompts": len(prompts), "tokens": 32, "identical": sum(s == t for s, t in zip(a, b, strict=True)),
            "mean_common_prefix": sum(common) / len(common), "perplexity_quantized": ppl_q,
            "perplexity_fp32": ppl_f, "perplexity_delta": ppl_q - ppl_f, "text_tokens": len(text_ids)}


def structgen_rows(llm: Any, system: str, prompt_ids: list[int], ttft_ids: list[int], tokens: int) -> list[dict[str, Any]]:
    from structgen import JsonSchema

    grammar = llm.compile(JsonSchema(SCHEMA))
    rows = []
    for constrained in (False, True):
        r = ours(llm, prompt_ids, tokens if not constrained else 128, grammar if constrained else None)
        rows.append({"system": system, "model": "smollm2-135m", "batch": 1, "constrained": constrained,
                     "metric": "ms_per_token", "value": r["ms_per_token"], **r})
        print(rows[-1], flush=True)
    rows.append({"system": system, "model": "smollm2-135m", "batch": 1, "constrained": False,
                 "metric": "ttft_ms", "value": time_to_first_token(llm, ttft_ids), "prompt_tokens": len(ttft_ids)})
    print(rows[-1], flush=True)
    return rows


def llamacpp_rows(threads: int, prompt_ids: list[int], ttft_ids: list[int], tokens: int, json_tokens: int,
                  stop_ids: list[int]) -> list[dict[str, Any]]:
    from benchmarks import peer_llamacpp
    from structgen.engine.models.loader import default_gguf_path

    why = peer_llamacpp.available()
    if why is not None:
        print(f"llama.cpp peer skipped: {why}")
        return []
    peer = peer_llamacpp.LlamaCppPeer(default_gguf_path(), threads)
    base = {"system": "llama.cpp", "model": "smollm2-135m", "batch": 1}
    free = peer.generate(prompt_ids, tokens, ban_tokens=tuple(stop_ids))
    schema = peer.generate(prompt_ids, json_tokens, schema=SCHEMA)
    first = peer.generate(ttft_ids, 1)
    rows = [{**base, "constrained": False, "metric": "ms_per_token", "value": free["ms_per_token"], **free},
            {**base, "constrained": True, "metric": "ms_per_token", "value": schema["ms_per_token"], **schema},
            {**base, "constrained": False, "metric": "ttft_ms", "value": first["ttft_ms"], "prompt_tokens": len(ttft_ids)}]
    for r in rows:
        print(r, flush=True)
    return rows


def transformers_rows(llm: Any, text: str, tokens: int, json_tokens: int) -> list[dict[str, Any]]:
    from benchmarks.peers import (
        compile_xgrammar,
        load_hf_model,
        outlines_json,
        transformers_generate,
    )
    from structgen.engine.models.loader import resolve_model

    tok = llm.tokenizer
    hf = load_hf_model(resolve_model(None, progress=False), torch.float32, "cpu")
    stop = sorted(llm.engine.stop_token_ids)
    xg = compile_xgrammar(tok, llm.engine.vocab_size, stop, json_schema=SCHEMA)
    rows = []
    for constrained in (False, True):
        run = transformers_generate(hf, tok, text, json_tokens if constrained else tokens,
                                    compiled_grammar=xg if constrained else None, ignore_eos=not constrained)
        rows.append({"system": run.system, "model": "smollm2-135m", "batch": 1, "constrained": constrained,
                     "metric": "ms_per_token", "value": run.ms_per_step, "tokens": run.steps, "text": run.texts[0][:80]})
        print(rows[-1], flush=True)
    processor = outlines_json(hf, tok, SCHEMA)
    if processor is not None:
        run = transformers_generate(hf, tok, text, json_tokens, outlines_processor=processor)
        rows.append({"system": run.system, "model": "smollm2-135m", "batch": 1, "constrained": True,
                     "metric": "ms_per_token", "value": run.ms_per_step, "tokens": run.steps, "text": run.texts[0][:80]})
        print(rows[-1], flush=True)
    return rows


def cache_megabytes() -> float:
    from structgen.engine.models.loader import resolve_model

    return sum(p.stat().st_size for p in Path(resolve_model(None, progress=False)).iterdir()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2, help="threads of every system (0: torch's default)")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers peers")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from structgen import LLM

    extra: dict[str, Any] = {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "prompt": PROMPT,
                             "load_average": os.getloadavg()[0]}
    if not args.no_cold:
        with tempfile.TemporaryDirectory() as cache:
            extra["cold_start_s"] = start_time(cache)
    extra["warm_start_s"] = start_time(None)
    extra["converted_cache_mb"] = cache_megabytes()
    print(f"LLM() start: cold {extra.get('cold_start_s', float('nan')):.1f} s, warm {extra['warm_start_s']:.1f} s; "
          f"converted cache {extra['converted_cache_mb']:.0f} MB")

    # No prefix cache: every timed run prefills its whole prompt, as llama.cpp's peer does (it
    # resets its context before each run), and the TTFT repeats do not hit the warm-up's pages.
    tunings = {"structgen": EngineTuning(), "structgen-int8": EngineTuning(prompt_activations="int8"),
               "structgen-fp32act": EngineTuning(prompt_activations="fp32"),
               "structgen-fp32": EngineTuning(quantized_weights=False)}
    llms = {name: LLM(config=EngineConfig(device="cpu", dtype="float32", max_seq_len=1024, prefix_caching=False,
                                          tuning=tuning))
            for name, tuning in tunings.items()}
    tok = llms["structgen"].tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(text, add_special_tokens=False)
    ttft_ids = tok.encode(" ".join([PERPLEXITY_TEXT] * 2), add_special_tokens=False)[:TTFT_TOKENS]
    rows = [r for name, llm in llms.items() for r in structgen_rows(llm, name, prompt_ids, ttft_ids, args.tokens)]
    json_tokens = rows[1]["tokens"]
    rows += llamacpp_rows(torch.get_num_threads(), prompt_ids, ttft_ids, args.tokens, json_tokens,
                          sorted(llms["structgen"].engine.stop_token_ids))
    if not args.no_transformers:
        rows += transformers_rows(llms["structgen"], text, args.tokens, json_tokens)
    extra["quality"] = quality(llms["structgen-fp32act"], llms["structgen-fp32"])
    extra["quality_int16"] = quality(llms["structgen"], llms["structgen-fp32act"])
    extra["quality_int8"] = quality(llms["structgen-int8"], llms["structgen-fp32act"])
    for key, what in (("quality", "quantized vs fp32-de-quantized"), ("quality_int16", "16-bit vs fp32 activations"),
                      ("quality_int8", "int8 vs fp32 activations")):
        print(f"quality ({what}):", extra[key])
    print_table([{k: r.get(k) for k in ("system", "constrained", "metric", "value", "tokens")} for r in rows])
    if not args.no_write:
        print("wrote", write_results("cpu", rows, extra=extra))


if __name__ == "__main__":
    main()
