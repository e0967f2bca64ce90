#!/usr/bin/env bash
# Download, into .whl/ (gitignored), the Python 3.12 x86-64 wheels the lent GPU machine lacks:
# it has torch/transformers/triton but no network and none of our grammar/schema/GGUF deps.
# (The device image is Ubuntu 24.04, glibc 2.39: manylinux up to 2_35 is safe there.)
# Versions are pinned to what is installed on THIS machine, so both sides run the same code.
# Every call to the device that needs them carries `.whl` (64 MiB per call, shared with the
# GGUF half from split_model.sh; this set stays around 20 MiB). Run here, never on the device.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DEST=.whl

# Grammar backends, validation, GGUF reading, and the small server stack. Packages the device
# image already has at a compatible version (numpy, pyyaml, requests, tqdm, anyio, h11, click,
# annotated-doc, jinja2) are left out; typing-extensions and attrs are carried because pydantic
# and jsonschema need versions newer than some images hold.
PACKAGES=(
  xgrammar apache-tvm-ffi llguidance
  pydantic pydantic-core annotated-types typing-inspection typing-extensions
  jsonschema jsonschema-specifications referencing rpds-py attrs
  gguf
  fastapi starlette uvicorn opentelemetry-api
)

pins=()
for name in "${PACKAGES[@]}"; do
  version=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  pins+=("$name==$version")
done

rm -rf "$DEST" && mkdir -p "$DEST"
$PY -m pip download -q --no-deps --only-binary=:all: -d "$DEST" \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 \
  "${pins[@]}"

# One wheel per package: two versions of one name stop the whole install on the device.
dups=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [[ -n "$dups" ]]; then echo "duplicate wheels: $dups" >&2; exit 1; fi

ls -l "$DEST"/*.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $NF}' | sort -k3
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
printf 'total: %.2f MiB in %d wheels\n' "$(echo "$total / 1048576" | bc -l)" "$(ls "$DEST"/*.whl | wc -l)"
if (( total > 25 * 1048576 )); then
  echo "wheels exceed 25 MiB: the GGUF half (47 MiB) would not fit in one 64 MiB call" >&2
  exit 1
fi
