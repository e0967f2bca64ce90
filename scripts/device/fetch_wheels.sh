#!/usr/bin/env bash
# Download the Python 3.12 x86-64 wheels the lent GPU machine lacks: it has torch/transformers/
# triton but no network and none of our grammar/schema/GGUF deps. (The device image is Ubuntu
# 24.04, glibc 2.39: manylinux up to 2_35 is safe there.) Versions are pinned to what is
# installed on THIS machine, so both sides run the same code. Run here, never on the device.
#
#   .whl/        what structgen needs (grammar backends, validation, GGUF reading, the server
#                stack); carried by every call that imports structgen, beside a GGUF half from
#                split_model.sh, so it must stay under 12 MiB (a call carries 64 MiB, the repo
#                itself about 3.5).
#   .whl-client/ the official `openai` client and its HTTP stack's newer deps (the server tests' and
#                bench_serving's), carried
#                by the call with the second GGUF half: beside the first it does not fit.
#   .whl-peers/  Outlines and its deps, a peer the benchmarks time beside us; carried only by
#                calls that time peers (random-weight shapes: no GGUF half in those calls).
# setup.sh installs whichever of the two a call carries.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

# Packages the device image already has at a compatible version (numpy, pyyaml, requests, tqdm,
# anyio, h11, click, annotated-doc, jinja2) are left out; typing-extensions and attrs are
# carried because pydantic and jsonschema need versions newer than some images hold.
CORE=(
  xgrammar apache-tvm-ffi llguidance
  pydantic pydantic-core annotated-types typing-inspection typing-extensions
  jsonschema jsonschema-specifications referencing rpds-py attrs
  gguf
  fastapi starlette uvicorn opentelemetry-api
  jiter httpx httpcore httpx2 httpcore2 sniffio  # the client's dependencies (small)
)
# openai's own HTTP stack (httpx2) needs truststore, idna >= 3.18 and anyio >= 4.10, which the
# device image lacks or has older: without them `openai.OpenAI()` fails as it is built.
CLIENT=(openai truststore idna anyio h11 httptools)  # httptools: the server's HTTP/1.1 parser (no room in .whl)
PEERS=(outlines outlines-core genson diskcache cloudpickle pillow)

fetch() {  # fetch DEST MAX_MIB PACKAGE...
  local dest=$1 max=$2 name version total dups
  shift 2
  local pins=()
  for name in "$@"; do
    version=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    pins+=("$name==$version")
  done
  rm -rf "$dest" && mkdir -p "$dest"
  $PY -m pip download -q --no-deps --only-binary=:all: -d "$dest" \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 \
    "${pins[@]}"
  # One wheel per package: two versions of one name stop the whole install on the device.
  dups=$(ls "$dest"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
  if [[ -n "$dups" ]]; then echo "duplicate wheels in $dest: $dups" >&2; exit 1; fi
  ls -l "$dest"/*.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $NF}' | sort -k3
  total=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
  printf '%s: %.2f MiB in %d wheels\n' "$dest" "$(echo "$total / 1048576" | bc -l)" "$(ls "$dest"/*.whl | wc -l)"
  if (( total > max * 1048576 )); then
    echo "$dest exceeds $max MiB: it would not fit in one 64 MiB call beside what it travels with" >&2
    exit 1
  fi
}

fetch .whl 12 "${CORE[@]}"
fetch .whl-client 4 "${CLIENT[@]}"
fetch .whl-peers 30 "${PEERS[@]}"
