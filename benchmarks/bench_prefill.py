"""Time to first token: prompts through the decode CUDA graphs (a row per token, chunks of the
largest bucket; `EngineTuning.prefill_in_graphs`, the default) against eager extends, in the
same process on the same prompts.

An eager prefill of a small model is host-bound: hundreds of kernels launched one by one from
Python. Each JSON request here is a MaskBench schema with an extraction prompt (48-400
tokens); TTFT is the wall time from `add_request` to the first sampled token, and the whole
request (32 tokens) is timed too. Rounds alternate the two engines; the first is a warm-up.

    python -m benchmarks.bench_prefill                                   # real SmolLM2
    python -m benchmarks.bench_prefill --weights random --tokenizer-dir DIR [--shape llama-8b]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_jump_forward import CATEGORIES, MASKBENCH, build_llm, load_cases
from benchmarks.common import print_table, write_results
from structgen.engine.request import Request
from structgen.sampling import SamplingParams
from structgen.types import JsonSchema


def time_request(llm: Any, case: Any, max_tokens: int) -> tuple[float, float, list[int]]:
    """(ms to the first sampled token, ms for the whole request, output ids)."""
    eng = llm.engine
    req = Request(case.prompt_ids, SamplingParams(max_tokens=max_tokens),
                  llm.compile(JsonSchema(case.schema)).matcher(), frozenset(eng.stop_token_ids))
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    eng.add_request(req)
    assert not req.finished, "the grammar forced the whole output at add_request: raise --max-tokens"
    while req.num_cached < req.num_prompt and not req.finished:
        eng.step()
    sync()
    t1 = time.perf_counter()
    while not req.finished:
        eng.step()
    sync()
    return 1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t0), req.output_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="real", choices=["real", "random"])
    ap.add_argument("--tokenizer-dir", type=Path, default=None, help="tokenizer + config.json (random weights)")
    ap.add_argument("--shape", default=None, choices=["llama-1b", "llama-8b"])
    ap.add_argument("--data-dir", type=Path, default=MASKBENCH)
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    llms = {}
    for in_graphs in (False, True):
        llms[in_graphs], model = build_llm(args.weights, args.tokenizer_dir, args.device, True, args.shape, in_graphs)
    cases = load_cases(llms[False], args.data_dir, CATEGORIES, args.per_category, 384)
    lengths = sorted(len(c.prompt_ids) for c in cases)
    ttft: dict[bool, list[float]] = {False: [], True: []}
    whole: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list[list[int]]] = {False: [], True: []}
    for rnd in range(1 + args.rounds):
        for in_graphs, llm in llms.items():
            for c in cases:
                first, total, out = time_request(llm, c, args.max_tokens)
                if rnd == 0:
                    outputs[in_graphs].append(out)
                else:
                    ttft[in_graphs].append(first)
                    whole[in_graphs].append(total)
    same = sum(a == b for a, b in zip(outputs[False], outputs[True], strict=True))
    rows, table = [], []
    for in_graphs in (False, True):
        t, w = sorted(ttft[in_graphs]), whole[in_graphs]
        row = {"system": "structgen" if in_graphs else "structgen-eager-prefill", "model": model,
               "prefill_in_graphs": in_graphs, "ttft_ms_median": statistics.median(t),
               "ttft_ms_p90": t[int(0.9 * (len(t) - 1))], "request_ms_median": statistics.median(w),
               "max_tokens": args.max_tokens, "requests": len(t)}
        rows.append(row)
        table.append({"prefill": "graphs" if in_graphs else "eager", "TTFT p50 ms": f"{row['ttft_ms_median']:.2f}",
                      "TTFT p90 ms": f"{row['ttft_ms_p90']:.2f}",
                      f"{args.max_tokens}-token request p50 ms": f"{row['request_ms_median']:.2f}"})
    print(f"{model}: {len(cases)} prompts of {lengths[0]}-{lengths[-1]} tokens; "
          f"outputs equal in {same}/{len(cases)} (bf16 kernels differ between the two paths)")
    print_table(table)
    if not args.no_write:
        extra = {"cases": [c.id for c in cases], "prompt_tokens": lengths, "weights": args.weights,
                 "outputs_equal": f"{same}/{len(cases)}", "rounds": args.rounds}
        name = "prefill" if args.weights == "real" else f"prefill-random-{model}"
        print("wrote", write_results(name, rows, extra=extra))


if __name__ == "__main__":
    main()
