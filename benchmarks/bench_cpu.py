"""CPU benchmark (issue 2's closing figures): start-up time of `LLM()` cold (GGUF converted
into an empty cache) and warm (cache hit), and ms per generated token of our runner against
transformers eager `generate` (with and without xgrammar's logits processor), same weights,
dtype (float32), prompt and greedy decoding, at batch 1.

Both sides are timed the same way: wall time of one whole generation (prefill included)
divided by its new tokens, after a warm-up generation. Free text runs a fixed number of
tokens (stop tokens off); the JSON rows run until the schema's grammar completes.

    python -m benchmarks.bench_cpu                  # ~3 min on 2 cores
    python -m benchmarks.bench_cpu --no-cold        # skip the 20-30 s cold conversion
    python -m benchmarks.bench_cpu --model gemma-3-270m --no-cold
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from benchmarks.common import print_table, write_results
from structgen.engine.config import EngineConfig
from structgen.engine.request import Request
from structgen.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False,
}
PROMPT = "Extract the person as JSON: Ana Lopes is 31 years old, lives in Lisbon and likes tea and chess."
START = "import time; t = time.perf_counter(); import structgen; structgen.LLM({model!r}); print(time.perf_counter() - t)"


def start_time(cache: str | None, model: str | None) -> float:
    """Seconds for `import structgen; LLM(model)` in a fresh process (cache: STRUCTGEN_CACHE)."""
    env = dict(os.environ, **({"STRUCTGEN_CACHE": cache} if cache else {}))
    out = subprocess.run([sys.executable, "-c", START.format(model=model)], env=env, capture_output=True,
                         text=True, check=True)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--model", default=None, help="what LLM() takes (default: SmolLM2-135M), e.g. gemma-3-270m")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from benchmarks.bench_decode import chat
    from benchmarks.peers import (
        compile_xgrammar,
        load_hf_model,
        outlines_json,
        transformers_generate,
    )
    from structgen import LLM, JsonSchema

    extra: dict[str, Any] = {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "prompt": PROMPT,
                             "model": args.model or "smollm2-135m"}
    if not args.no_cold:
        with tempfile.TemporaryDirectory() as cache:
            extra["cold_start_s"] = start_time(cache, args.model)
    extra["warm_start_s"] = start_time(None, args.model)
    print(f"LLM() start: cold {extra.get('cold_start_s', float('nan')):.1f} s, warm {extra['warm_start_s']:.1f} s")

    llm = LLM(args.model, config=EngineConfig(device="cpu", dtype="float32", max_seq_len=1024))
    extra["tokenizer_check_s"] = llm.tokenizer_report.seconds
    tok = llm.tokenizer
    text = chat(tok, PROMPT)
    prompt_ids = tok.encode(text, add_special_tokens=False)
    grammar = llm.compile(JsonSchema(SCHEMA))
    rows: list[dict[str, Any]] = []
    for constrained in (False, True):
        r = ours(llm, prompt_ids, args.tokens if not constrained else 128, grammar if constrained else None)
        rows.append({"system": "structgen", "constrained": constrained, **r})
        print(rows[-1], flush=True)

    from structgen.engine.models.loader import resolve_model

    hf = load_hf_model(resolve_model(args.model, progress=False), torch.float32, "cpu")
    stop = sorted(llm.engine.stop_token_ids)
    xg = compile_xgrammar(tok, llm.engine.vocab_size, stop, json_schema=SCHEMA)
    for constrained in (False, True):
        n = args.tokens if not constrained else rows[1]["tokens"]
        run = transformers_generate(hf, tok, text, n, compiled_grammar=xg if constrained else None,
                                    ignore_eos=not constrained)
        rows.append({"system": run.system, "constrained": constrained, "ms_per_token": run.ms_per_step,
                     "tokens": run.steps, "text": run.texts[0][:80]})
        print(rows[-1], flush=True)
    processor = outlines_json(hf, tok, SCHEMA)
    if processor is not None:
        run = transformers_generate(hf, tok, text, rows[1]["tokens"], outlines_processor=processor)
        rows.append({"system": run.system, "constrained": True, "ms_per_token": run.ms_per_step,
                     "tokens": run.steps, "text": run.texts[0][:80]})
        print(rows[-1], flush=True)
    print_table([{k: r.get(k) for k in ("system", "constrained", "tokens", "ms_per_token", "decode_ms_per_step")}
                 for r in rows])
    for constrained in (False, True):
        a = next(r for r in rows if r["system"] == "structgen" and r["constrained"] == constrained)
        for b in (r for r in rows if r["system"] != "structgen" and r["constrained"] == constrained):
            print(f"{'JSON' if constrained else 'free'}: ours {a['ms_per_token']:.1f} ms/token vs {b['system']} "
                  f"{b['ms_per_token']:.1f} ({b['ms_per_token'] / a['ms_per_token']:.2f}x)")
    if not args.no_write:
        name = "runner" if args.model is None else f"runner-{args.model}"
        print("wrote", write_results(name, rows, extra=extra))


if __name__ == "__main__":
    main()
