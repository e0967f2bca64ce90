"""Peers we measure side by side with structgen: HF transformers `generate` (eager PyTorch, no
compile, greedy), alone, with xgrammar's HF logits processor, and with Outlines' (its own
outlines-core index, through `outlines.from_transformers`; optional: skipped where Outlines is
not installed).

Both run on the same device, prompts and weights as ours: `load_hf_model` takes the resolved
model directory (real SmolLM2) or a shape name, whose random weights come from
`benchmarks.common.random_weights` with the same seed our engine is given.

Smoke run (CPU here, CUDA on the device): `python -m benchmarks.peers [--device cuda]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import SHAPES, model_config, print_table, random_weights


@dataclass
class PeerRun:
    """One timed `generate` call. At batch 1, ms_per_step is ms per output token."""

    system: str
    batch: int
    steps: int  # generated positions per row (includes a row's padding after it stopped)
    wall_ms: float
    ms_per_step: float
    output_ids: list[list[int]] = field(repr=False)
    texts: list[str] = field(default_factory=list)


def load_hf_model(model: str | Path, dtype: torch.dtype, device: str | torch.device, *,
                  seed: int = 0, attn_implementation: str = "sdpa") -> Any:
    """A transformers causal LM: an HF directory with weights, or a SHAPES name whose random
    weights are built on `device` (never on disk) exactly as our engine gets them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(device)
    if isinstance(model, str) and model.removesuffix("-shape") in SHAPES:
        shape = model.removesuffix("-shape")
        cfg = model_config(shape)
        from benchmarks.common import fits_two_copies, hf_config

        settings = hf_config(shape)
        hf_cfg = AutoConfig.for_model(settings.pop("model_type"), **settings)
        # Build directly on the device in the target dtype, then overwrite HF's own init with
        # the shared random weights; meta + to_empty would leave rotary buffers uninitialised.
        with torch.device(device), _no_init_weights():
            m = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation=attn_implementation)
        if not fits_two_copies(cfg, dtype, device):  # drawn in place, as our engine then does
            with torch.no_grad():
                for name, p in m.named_parameters():
                    if "norm" in name:
                        p.fill_(1.0)
                    else:
                        p.normal_(0.0, 0.02)
            return m.eval()
        missing, unexpected = m.load_state_dict(random_weights(cfg, dtype, device, seed=seed), strict=False)
        assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
        if cfg.tie_word_embeddings:
            m.tie_weights()
        return m.eval()
    from structgen.engine.models.loader import load_transformers_model

    m = load_transformers_model(model, dtype)  # a converted GGUF's weights are stored packed
    m.config._attn_implementation = attn_implementation
    return m.to(device).eval()


def _no_init_weights() -> Any:
    """transformers' switch that skips random init (we overwrite every weight anyway)."""
    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights  # transformers 4
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def compile_xgrammar(tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *,
                     json_schema: dict | str | None = None, regex: str | None = None,
                     ebnf: str | None = None) -> Any:
    """An xgrammar CompiledGrammar for exactly one of json_schema / regex / ebnf.

    `vocab_size` is the model's (the logits width), which may exceed the tokenizer's.
    """
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    compiler = xgr.GrammarCompiler(info)
    if json_schema is not None:
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        return compiler.compile_json_schema(text)
    if regex is not None:
        return compiler.compile_regex(regex)
    if ebnf is not None:
        return compiler.compile_grammar(ebnf)
    raise ValueError("give one of json_schema, regex, ebnf")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def outlines_json(model: Any, tokenizer: Any, schema: dict) -> Any:
    """Outlines' JSON-schema logits processor for this HF model, its index built here (outside
    any timing, as xgrammar's compile is), or None where Outlines is not installed. Pass it to
    `transformers_generate(outlines_processor=...)`."""
    try:
        import outlines
        from outlines.types import JsonSchema
    except ImportError:
        return None
    generator = outlines.Generator(outlines.from_transformers(model, tokenizer), JsonSchema(json.dumps(schema)))
    return generator.logits_processor


@torch.inference_mode()
def transformers_generate(model: Any, tokenizer: Any, prompts: str | list[str], max_new_tokens: int, *,
                          compiled_grammar: Any = None, outlines_processor: Any = None, ignore_eos: bool = False,
                          warmup: bool = True) -> PeerRun:
    """Greedy `model.generate` over already formatted prompts (apply the chat template first).

    With `compiled_grammar`, each call gets a fresh `xgrammar.contrib.hf.LogitsProcessor`
    (they are single-use); with `outlines_processor` (`outlines_json`), Outlines' processor,
    reset before each call as its `Generator` does. `ignore_eos` forces exactly max_new_tokens
    (random-weight models); do not combine it with a grammar, which ends at its stop token.
    """
    from transformers import LogitsProcessorList

    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    device = model.device
    tokenizer.padding_side = "left"  # decoder-only batches pad on the left
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    eos = model.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    def run(n: int) -> torch.Tensor:
        procs = LogitsProcessorList()
        if compiled_grammar is not None:
            from xgrammar.contrib.hf import LogitsProcessor

            procs.append(LogitsProcessor(compiled_grammar))
        if outlines_processor is not None:
            outlines_processor.reset()
            procs.append(outlines_processor)
        return model.generate(**enc, max_new_tokens=n, do_sample=False, logits_processor=procs,
                              min_new_tokens=n if ignore_eos else 0, pad_token_id=pad,
                              temperature=None, top_p=None, top_k=None)

    if warmup:
        # On CUDA the first generate over a set of lengths is slow (H100: 107.6 ms a step, then
        # 21.9; most likely SDPA's cuDNN kernel building a graph per new key length). A 4-token
        # warm-up left the first timed run paying every step: bench_decode read transformers'
        # free decoding at 50-76 ms/step against 15-37 with xgrammar, timed second. Warm over
        # every length timed (docs/performance.md, "Peers").
        run(max_new_tokens if device.type == "cuda" else min(4, max_new_tokens))
    _sync(device)
    t0 = time.perf_counter()
    out = run(max_new_tokens)
    _sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3
    new = out[:, enc["input_ids"].shape[1]:]
    steps = new.shape[1]
    system = ("transformers+xgrammar" if compiled_grammar is not None
              else "transformers+outlines" if outlines_processor is not None else "transformers")
    return PeerRun(system=system, batch=len(prompts), steps=steps, wall_ms=wall_ms,
                   ms_per_step=wall_ms / max(steps, 1), output_ids=new.tolist(),
                   texts=tokenizer.batch_decode(new, skip_special_tokens=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="HF dir / .gguf (default SmolLM2) or a shape name")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()

    from structgen.engine.models.loader import load_model_config, load_tokenizer, resolve_model

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = args.model is not None and args.model.removesuffix("-shape") in SHAPES
    tok_dir = resolve_model(None if shape else args.model, progress=False)
    tokenizer = load_tokenizer(tok_dir)
    vocab = model_config(args.model.removesuffix("-shape")).vocab_size if shape else load_model_config(tok_dir).vocab_size
    t0 = time.perf_counter()
    model = load_hf_model(args.model if shape else tok_dir, dtype, device)
    print(f"loaded {args.model or tok_dir.name} on {device} ({dtype}) in {time.perf_counter() - t0:.1f}s")

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Give a JSON object with the name and age of a fictional person."}],
        tokenize=False, add_generation_prompt=True)
    grammar = compile_xgrammar(tokenizer, vocab, [2], json_schema=schema)
    runs = [transformers_generate(model, tokenizer, prompt, args.max_new_tokens, ignore_eos=shape),
            transformers_generate(model, tokenizer, prompt, args.max_new_tokens, compiled_grammar=grammar)]
    processor = outlines_json(model, tokenizer, schema)
    if processor is not None:
        runs.append(transformers_generate(model, tokenizer, prompt, args.max_new_tokens, outlines_processor=processor))
    print_table([{"system": r.system, "batch": r.batch, "steps": r.steps, "wall_ms": r.wall_ms,
                  "ms_per_step": r.ms_per_step} for r in runs])
    for r in runs:
        print(f"{r.system}: {r.texts[0]!r}")
    if not shape:
        json.loads(runs[1].texts[0])  # the constrained output must parse


if __name__ == "__main__":
    main()
