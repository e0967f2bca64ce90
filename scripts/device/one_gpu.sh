#!/usr/bin/env bash
# The one-GPU measurements of the open issues, in one call of at most 10 minutes, most wanted
# first (call 2 of the two-call GGUF carry, scripts/device/README.md, with .carry/mbs):
#   a. GPU tests of the real model through the graphs: constrained JSON == eager, speculation
#      == plain greedy on 20 JME prompts, graph verify == eager;
#   b. issue 32's targets, both modes (bench_speculative --targets);
#   c. issue 30: 256 requests of one schema at once, cold then warm (bench_serving json-one),
#      and the agent workload against its short-prompt twin, one at a time and Poisson;
#   d. regressions and issue 35: bench_decode, SmolLM2 batch 1/64 and Llama-8B int4 / FP8;
#   e. issue 32 item 2: the verify forward launched ahead against launched late, batch 1;
#   f. issue 30: the agent workload's engine steps, prompt steps apart from decode-only ones.
# PIECES="b d" runs only those pieces.
# Each piece runs under its own timeout (scripts/device/pieces.sh) and leaves its log and
# results files under $OUT as soon as it ends.
#
#     export STRUCTGEN_COMMIT=<short hash, computed here>; bash scripts/device/one_gpu.sh
#     bash scripts/device/one_gpu.sh --dry-run     # here, on the CPU: tiny runs of each piece
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
BUDGET_S=${BUDGET_S:-560}
PIECE_PATTERN="passed|failed|error|Error|x floor|grammar overhead|^False|^True|json-one|agent|identical|^structgen-"
source scripts/device/pieces.sh "$@"  # DRY, OUT, SUMMARY; `piece` and `left`
LOG="$OUT/run.log"  # every piece's output (few files: only about 8 come back from $OUT)
if [[ -d .carry/mbs ]]; then  # MaskBench, for the JME prompts and schemas
  mkdir -p /tmp/sh/data && cp -r .carry/mbs /tmp/sh/data/maskbench
  export STRUCTGEN_SHARED=/tmp/sh
fi

if [[ $DRY == 1 ]]; then
  TESTS=(python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_speculative_policy.py tests/engine/test_scheduler.py)
  SPEC=(python3 -m benchmarks.bench_speculative --targets --limit 2 --target-batches 2 --modes default
        --max-tokens 24 --device cpu --no-write)
  JSON_ONE=(python3 -m benchmarks.bench_serving --workloads json-one --modes inprocess --arrivals closed
            --requests 4 --max-tokens 24 --device cpu --no-bound --no-write)
  AGENT=(python3 -m benchmarks.bench_serving --workloads agent,agent-short --modes inprocess --arrivals serial
         --requests 2 --max-tokens 16 --device cpu --no-bound --no-write)
  DECODE=(python3 -m benchmarks.bench_decode --cpu --models tiny-llama-shape --batches 1 --steps 4 --no-peers --no-write)
  LATE=(python3 -m benchmarks.bench_speculative --limit 1 --methods ngram --jump-forward on --max-tokens 16
        --device cpu --no-write)
  STEPS=(python3 -m benchmarks.agent_steps --requests 3 --max-tokens 8 --device cpu)
else
  source scripts/device/setup.sh > /tmp/setup.log 2>&1 || exit 1
  nvidia-smi --query-gpu=name --format=csv,noheader >> "$SUMMARY"
  TESTS=(python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_cuda_graphs.py
         tests/engine/test_speculative_graphs.py)
  SPEC=(python3 -m benchmarks.bench_speculative --targets --target-batches-invariant --target-rounds 3)
  JSON_ONE=(python3 -m benchmarks.bench_serving --workloads json-one --modes inprocess --arrivals closed,closed
            --requests 256 --max-tokens 128)
  AGENT=(python3 -m benchmarks.bench_serving --workloads agent,agent-short --modes inprocess,http
         --arrivals serial,100 --requests 200 --max-tokens 64)
  DECODE=(python3 -m benchmarks.bench_decode --models smollm2-135m,llama-8b-shape-int4,llama-8b-shape-fp8
          --batches 1,64 --steps 32 --no-peers)
  LATE=(python3 -m benchmarks.bench_speculative --limit 8 --methods ngram --jump-forward on)
  STEPS=(python3 -m benchmarks.agent_steps --requests 200 --out "$OUT/agent_steps.json")
fi
want() { [[ " ${PIECES:-a b c d e f} " == *" $1 "* ]]; }  # PIECES="b d": only those

want a && piece "a: GPU tests" 150 "$LOG" "${TESTS[@]}"
want b && piece "b: speculation targets" 150 "$LOG" "${SPEC[@]}" && keep 'speculative_targets-*.json'
if want c; then
  piece "c: json-one, 256 at once, cold then warm" 130 "$LOG" "${JSON_ONE[@]}"
  keep 'serving-*.json' && mv -f "$OUT"/serving-*.json "$OUT/serving-json-one.json" 2>/dev/null
  piece "c: agent against agent-short" 110 "$LOG" "${AGENT[@]}"
  keep 'serving-*.json'
fi
want d && piece "d: decode steps" 150 "$LOG" "${DECODE[@]}" && keep 'decode-*.json'
want e && piece "e: verify forward launched ahead or late" 100 "$LOG" "${LATE[@]}" && keep 'speculative-*.json'
want f && piece "f: agent steps" 100 "$LOG" "${STEPS[@]}"

echo "== total ${SECONDS}s" >> "$SUMMARY"
cat "$SUMMARY"
