#!/usr/bin/env bash
# vLLM 0.20.2 beside us on the device (../shared/peers/vllm.md). Runs ON the device:
#   bash scripts/device/vllm.sh collect          # copy carried .carry/vp/partNN pieces to /tmp/vparts
#   bash scripts/device/vllm.sh install          # once all pieces are there: join, untar, pip into /tmp/vsite
#   bash scripts/device/vllm.sh serve [PORT] [BACKEND]
#                                                # export the default model as bf16 HF, start the server
#                                                # with compact JSON (as ours), wait until it answers
#                                                # (log: /tmp/vllm.log). BACKEND: guidance (default) or
#                                                # xgrammar. With xgrammar, whitespace allowed, 991 of 1,000
#                                                # agent answers ran to max_tokens in whitespace (H100,
#                                                # 2026-11-26); with xgrammar compact, every request failed
#                                                # "grammar rejected tokens [0]" (H200, 2026-11-27; its
#                                                # compact form makes ", " and ": " mandatory, vllm#58067).
#                                                # MaskBench schemas handed to guidance once killed its engine.
#   bash scripts/device/vllm.sh stop
# Here, once: tar cf - -C .carry/vwheels . | split -b 57000000 -d - .carry/vp/part
# (6 pieces; carry one per back-to-back call, e.g. carry [".carry/vp/part00"]).
set -u
cmd=${1:-}
parts=/tmp/vparts site=/tmp/vsite hf=/tmp/smollm2-hf
case "$cmd" in
  collect)
    mkdir -p "$parts"
    for p in .carry/vp/part*; do [[ -f "$p" ]] && cp "$p" "$parts/" && echo "vllm: have $(basename "$p")"; done
    ls "$parts" | wc -l ;;
  install)
    [[ -f "$site/.done" ]] && { echo "vllm: already installed"; exit 0; }
    mkdir -p /tmp/vwheels "$site"
    cat "$parts"/part* | tar xf - -C /tmp/vwheels || { echo "vllm: pieces missing or corrupt"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" /tmp/vwheels/*.whl \
      && touch "$site/.done" && echo "vllm: installed $(ls /tmp/vwheels | wc -l) wheels" ;;
  serve)
    port=${2:-8100} backend=${3:-guidance}
    [[ -f "$hf/config.json" ]] || python3 scripts/device/export_float.py "$hf" || exit 1
    # setsid: the device kills what a call leaves running unless it has its own session, so the
    # server then outlives this call and the next call's benchmark can use it.
    PYTHONPATH=$site VLLM_USE_FLASHINFER_SAMPLER=0 setsid nohup python3 -m vllm.entrypoints.openai.api_server \
      --model "$hf" --served-model-name smollm2 --dtype bfloat16 --max-model-len 4096 \
      --structured-outputs-config "{\"backend\": \"$backend\", \"disable_any_whitespace\": true}" \
      --gpu-memory-utilization 0.45 --port "$port" > /tmp/vllm.log 2>&1 &
    echo $! > /tmp/vllm.pid
    for _ in $(seq 1 150); do
      curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null && { echo "vllm: up on $port"; exit 0; }
      kill -0 "$(cat /tmp/vllm.pid)" 2>/dev/null || { echo "vllm: died"; tail -30 /tmp/vllm.log; exit 1; }
      sleep 1
    done
    echo "vllm: not up after 150 s"; tail -30 /tmp/vllm.log; exit 1 ;;
  stop)
    [[ -f /tmp/vllm.pid ]] && kill "$(cat /tmp/vllm.pid)" 2>/dev/null; rm -f /tmp/vllm.pid ;;
  *) echo "usage: $0 collect|install|serve [PORT]|stop"; exit 2 ;;
esac
