#!/usr/bin/env bash
# Issue 34 on one 4-GPU host (nvidia-h100-x4), in one call of at most 9 minutes:
#   a. the GPU tests of tensor parallelism: TP=2 greedy output == TP=1, the peer sum against
#      NCCL and against its torch definition (test_tensor_parallel.py, test_peer_sum.py);
#   d. DP=2 against one replica on a JSON serving workload, 0 lost requests (bench_replicas);
#      a and d run side by side, a on GPUs 0-1 and d on GPUs 2-3, before the timed decode rows;
#   b. Llama-8B shape at TP 1, 2, 4, batch 1 and 64, free and JSON, with floors (bench_decode);
#   c. Llama-70B shape at TP 4, batch 1, 16, 64 (random weights drawn per shard on each GPU;
#      rows carry rank 0's weight bytes and each GPU's memory in use), merged into b's rows.
# Each piece runs under its own `timeout`, capped by what is left of the call's budget, and
# leaves its results under $OUT as soon as it ends, so a hang loses only that piece.
#
#     bash scripts/device/multi_gpu.sh             # on the device (after the default model's
#                                                  # two-call GGUF carry, scripts/device/README.md)
#     bash scripts/device/multi_gpu.sh --dry-run   # here, on the CPU: gloo, tiny shapes
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
BUDGET_S=${BUDGET_S:-525}
PIECE_PATTERN="passed|failed|error|x floor|faster|grammar overhead|built:|DP [0-9]+ vs|Error"
source scripts/device/pieces.sh "$@"  # DRY, OUT, SUMMARY; `piece` and `left`
if [[ $DRY == 0 ]]; then
  source scripts/device/setup.sh || exit 1
  export NCCL_NVLS_ENABLE=0
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader >> "$SUMMARY"
fi

if [[ $DRY == 1 ]]; then
  PYTEST=(python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_tensor_parallel.py -k "greedy or closing")
  DP=(python3 -m benchmarks.bench_replicas --device cpu --replicas 2 --requests 4 --max-tokens 16
      --max-batch-size 4 --no-write)
  TP_SMALL=(python3 -m benchmarks.bench_decode --cpu --models tiny-llama-shape --tensor-parallel 1,2
            --batches 1,4 --steps 4 --no-peers --no-write)
  TP_LARGE=(python3 -m benchmarks.bench_decode --cpu --models tiny-llama-shape --tensor-parallel 2
            --batches 1,4 --steps 4 --no-peers --no-write)
else
  PYTEST=(python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_tensor_parallel.py tests/engine/test_peer_sum.py)
  DP=(python3 -m benchmarks.bench_replicas --replicas 2 --requests 256 --max-tokens 128)
  TP_SMALL=(python3 -m benchmarks.bench_decode --models llama-8b-shape --tensor-parallel 1,2,4
            --batches 1,64 --steps 32 --no-peers --no-write)
  TP_LARGE=(python3 -m benchmarks.bench_decode --models llama-70b-shape --tensor-parallel 4
            --batches 1,16,64 --steps 32 --no-peers --name decode_tp)
  # The default model converted once, before two processes would convert it side by side.
  piece "prepare: the default model" 60 "$OUT/pytest.txt" \
    python3 -c "from structgen.engine.models.loader import resolve_model; print(resolve_model(None, progress=False))"
fi

# a and d side by side on disjoint GPUs.
CUDA_VISIBLE_DEVICES=0,1 piece "a: TP=2 == TP=1 (NCCL, graphs)" 150 "$OUT/pytest.txt" "${PYTEST[@]}" &
A_PID=$!
CUDA_VISIBLE_DEVICES=2,3 piece "d: DP=2 vs 1 replica" 160 "$OUT/bench_dp.log" "${DP[@]}" --dump "$OUT/dp.json"
wait "$A_PID"
keep 'replicas-*.json'

piece "b: Llama-8B shape TP 1/2/4" 170 "$OUT/bench_tp.log" "${TP_SMALL[@]}" --dump "$OUT/tp_decode.json"
piece "c: Llama-70B shape TP 4" 170 "$OUT/bench_tp.log" "${TP_LARGE[@]}" \
  --merge "$OUT/tp_decode.json" --dump "$OUT/tp_decode.json"
keep 'decode_tp-*.json'

echo "== total ${SECONDS}s" >> "$SUMMARY"
cat "$SUMMARY"
