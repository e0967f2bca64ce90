"""Write a plain HF folder (bf16 safetensors, config, tokenizer, chat template) of a structgen model, so a
peer engine that cannot read our converted GGUF's packed blocks serves the same weights:

    python3 scripts/device/export_float.py /tmp/smollm2-hf          # the default model
    python3 scripts/device/export_float.py OUT_DIR --model gemma-3-270m
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from structgen.engine.models.loader import load_weights, resolve_model

COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
          "special_tokens_map.json")


def export(model: str | None, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    src = resolve_model(model, progress=False)
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: t.contiguous() for name, t in load_weights(src, dtype, "cpu").items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    print(export(args.model, args.out))
