"""Where a mixture-of-experts decode step goes, on the Qwen3-30B-A3B shape (random weights).

Two parts, one GPU run:

1. The expert kernels alone, each launch timed cold (L2 flushed) for every candidate launch
   shape (`kernels/moe.fastest_tiles`, the timing the engine does once per shape), at 1, 2, 4,
   8 and 64 tokens, beside the GB/s of the expert bytes it reads (the distinct experts the
   tokens are routed to); and the router (projection + softmax/top-k) and a whole sparse
   feed-forward at one token.
2. The decode step of a `--layers`-layer model of the real shape through the CUDA graphs,
   under torch.profiler: one layer's kernels in launch order (a layer is the stretch between
   two router kernels), each kernel's mean time over the middle layers and the idle gap before
   it, and the step's time against the weight bytes a step reads (its floor at the copy
   bandwidth). Once per `--variants`: "fused", a sparse layer's norms inside the kernels after
   them at few rows (models/moe.py, `sparse_fused_rows`: 8 kernels a layer at one row, 9
   where the qkv timing keeps RoPE apart, `fused_gemv.SPLIT`), and
   "unfused", each norm its own kernel (11), in that order, a fresh engine each.

    python -m benchmarks.profile_moe                      # both parts, --layers 8, both variants
    python -m benchmarks.profile_moe --skip-sweep --batches 1 --steps 50   # fused against unfused
    python -m benchmarks.profile_moe --skip-step --tokens 1,8
    python -m benchmarks.profile_moe --out /tmp/moe.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    decode_weight_bytes,
    hbm_floor_ms,
    hf_config,
    measure_copy_bandwidth_gbps,
)
from benchmarks.kernel_timeline import one_layer, profiled_steps
from structgen.engine.config import EngineConfig, ModelConfig
from structgen.engine.kernels.gemv import time_cold
from structgen.engine.kernels.moe import PAIR_MAX, fastest_tiles
from structgen.engine.models.llama import FUSED_ROWS

SHAPE = "qwen3-30b-a3b"
# Step-profile variants: the most rows of a step that run the norms inside the projections.
VARIANTS = {"fused": FUSED_ROWS, "unfused": 0}


def shape_config(layers: int | None = None) -> ModelConfig:
    """The MoE shape's config, with `layers` layers where given."""
    d = hf_config(SHAPE)
    return ModelConfig.from_dict(d if layers is None else {**d, "num_hidden_layers": layers})


def expected_experts(tokens: int, top_k: int, num_experts: int) -> float:
    """Distinct experts `tokens` tokens routed to uniformly at random touch on average."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def kernel_sweep(cfg: ModelConfig, tokens_list: list[int], bandwidth: float) -> list[dict[str, Any]]:
    """Every candidate's cold ms and GB/s per expert kernel, per token count."""
    experts, hidden, inter, top_k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    per_expert = {"gate_up": gate_up[0].numel() * 2, "down": down[0].numel() * 2}
    rows = []
    for tokens in tokens_list:
        pairs = tokens * top_k <= PAIR_MAX
        best, times = fastest_tiles(tokens, top_k, gate_up, down, pairs)
        touched = expected_experts(tokens, top_k, experts)
        for kernel, by_tiles in times.items():
            nbytes = touched * per_expert[kernel]
            for tiles, ms in sorted(by_tiles.items(), key=lambda kv: kv[1]):
                rows.append({"tokens": tokens, "path": "pairs" if pairs else "sorted", "kernel": kernel,
                             "tiles": list(tiles), "ms": round(ms, 5), "gb_per_s": round(nbytes / ms / 1e6),
                             "floor_ms": round(nbytes / bandwidth / 1e6, 5), "chosen": tiles == getattr(best, kernel)})
                print(f"tokens {tokens:3d} {rows[-1]['path']:6s} {kernel:7s} {tiles} {ms * 1e3:8.1f} us "
                      f"{rows[-1]['gb_per_s']:5d} GB/s (floor {rows[-1]['floor_ms'] * 1e3:.1f} us)"
                      f"{'  <- chosen' if rows[-1]['chosen'] else ''}", flush=True)
    del gate_up, down
    torch.cuda.empty_cache()
    return rows


def sparse_layer_times(cfg: ModelConfig) -> dict[str, float]:
    """Cold ms at one token of the router (projection + softmax/top-k) and of a whole sparse
    feed-forward (router + both expert kernels), eager launches."""
    from structgen.engine.models.moe import SparseMoE

    moe = SparseMoE(cfg)
    moe.gate.to("cuda", torch.bfloat16)
    moe.materialize()  # the experts beside the router: on the device, in bf16
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    moe.fused = True
    x = torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        moe(x)  # compiles, and times the launch shapes once
        out = {"router_ms": time_cold(lambda: moe.route(x), torch.device("cuda")),
               "sparse_layer_ms": time_cold(lambda: moe(x), torch.device("cuda"))}
    print(f"router {out['router_ms'] * 1e3:.1f} us, sparse feed-forward {out['sparse_layer_ms'] * 1e3:.1f} us "
          "(one token, eager, cold)", flush=True)
    return out


def variant_engine(cfg: ModelConfig, batch: int, variant: str):
    """An engine whose decode graphs are captured with `variant`'s projection rows."""
    from structgen.engine.engine import Engine

    config = EngineConfig(max_batch_size=max(batch, 8), max_seq_len=512, jump_forward=False, use_cuda_graphs=False)
    engine = Engine(cfg, config, stop_token_ids=set())
    engine.runner.model.use_fused_kernels(True, projection_rows=VARIANTS[variant])
    engine.runner.capture_decode_graphs()
    return engine


def step_profile(layers: int, batch: int, steps: int, bandwidth: float, variant: str) -> dict[str, Any]:
    """One layer's kernels in a graph-replayed decode step at `batch` (see the module doc)."""
    cfg = shape_config(layers)
    engine = variant_engine(cfg, batch, variant)
    fused_rows = max(layer.fused_rows for layer in engine.runner.model.layers)
    wall_ms, kernels = profiled_steps(engine, batch, steps, prompt_tokens=32)
    floor = hbm_floor_ms(decode_weight_bytes(cfg, torch.bfloat16), bandwidth)
    out = {"variant": variant, "fused_rows": fused_rows, "batch": batch, "layers": layers, "ms_per_step": wall_ms,
           "floor_ms": floor, "kernels_per_step": len(kernels) / steps, "layer": one_layer(kernels, lambda name: "_route_kernel" in name)}
    print(f"{variant} (norms inside up to {fused_rows} rows), batch {batch}: {wall_ms:.3f} ms/step over {layers} "
          f"layers (floor {floor:.3f} ms, {wall_ms / floor:.2f}x), {out['kernels_per_step']:.0f} kernels a step, "
          f"{len(out['layer']['kernels'])} a layer", flush=True)
    for row in out["layer"]["kernels"]:
        print(f"  {row['us']:7.2f} us  gap {row['gap_us']:5.2f} us  {row['name'][:90]}")
    print(f"  layer: {out['layer']['us']:.1f} us ({out['layer']['kernel_us']:.1f} in kernels)", flush=True)
    engine.close()
    del engine
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,2,4,8,64", help="token counts of the kernel sweep")
    ap.add_argument("--layers", type=int, default=8, help="layers of the profiled model (real shape otherwise)")
    ap.add_argument("--batches", default="1,64", help="decode batches of the step profile")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"step-profile variants, of {', '.join(VARIANTS)}")
    ap.add_argument("--skip-step", action="store_true", help="the kernel sweep only")
    ap.add_argument("--skip-sweep", action="store_true", help="the step profile only")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "profile_moe times the GPU kernels; run it on a CUDA machine"
    bandwidth = measure_copy_bandwidth_gbps()
    cfg = shape_config()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gbps": bandwidth}
    if not args.skip_sweep:
        result["sweep"] = kernel_sweep(cfg, [int(t) for t in args.tokens.split(",")], bandwidth)
        result.update(sparse_layer_times(cfg))
    if not args.skip_step:
        result["steps"] = [step_profile(args.layers, int(b), args.steps, bandwidth, v)
                           for b in args.batches.split(",") for v in args.variants.split(",")]
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1, default=str))
        print("wrote", args.out)


if __name__ == "__main__":
    main()
