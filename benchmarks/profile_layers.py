"""Where a dense model's decode step goes, kernel by kernel: one layer's kernels of a
graph-replayed step under torch.profiler, per model, beside the step's floor.

Models take bench_decode's names of random-weight shapes (`llama-8b-shape`, and `-fp8` /
`-int4` for weights quantized at load). For each: ms a step on the wall clock against the floor
of its weights as loaded (bench_decode's `packed_floor_ms`), kernels a step, one layer's
kernels in launch order with the gap before each (benchmarks/kernel_timeline.py: a layer runs
from one launch of its first once-a-layer kernel to the next), the layer's period, what the
step spends outside the layers, and the step-level kernels (embedding, LM head, sampling) by
time. Under dependent launches a kernel's span includes its wait for the one before, so the
spans add up to more than the period; the period and the step are what to compare.

    python -m benchmarks.profile_layers --models llama-8b-shape,llama-8b-shape-fp8,llama-8b-shape-int4
    python -m benchmarks.profile_layers --models llama-8b-shape-int4 --batch 4 --no-write
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.bench_decode import build_engine, packed_floor_ms, quantization_of
from benchmarks.common import measure_copy_bandwidth_gbps, model_config, write_results
from benchmarks.kernel_timeline import layer_marker, one_layer, profiled_steps, step_level

PROMPT_TOKENS = 50


def profile_model(model: str, batch: int, steps: int, bandwidth: float) -> dict[str, Any]:
    """One model's step time, floor and layer profile at `batch` rows (see the module doc)."""
    cfg = model_config(model.split("-shape")[0])
    engine = build_engine(cfg, None, set(), graphs=True, quantization=quantization_of(model))
    floor = packed_floor_ms(engine, bandwidth)
    ms, kernels = profiled_steps(engine, batch, steps, PROMPT_TOKENS)
    engine.close()
    launches = cfg.num_hidden_layers * steps
    marker = layer_marker(kernels, launches)
    layer = one_layer(kernels, lambda name: name == marker)
    return {"model": model, "batch": batch, "ms_per_step": ms, "floor_ms": floor, "x_floor": ms / floor,
            "kernels_per_step": len(kernels) / steps, "layer": layer,
            "outside_layers_us": ms * 1e3 - cfg.num_hidden_layers * layer["us"],
            "step_level": step_level(kernels, launches, steps)}


def report(row: dict[str, Any]) -> None:
    layer = row["layer"]
    print(f"\n{row['model']}, batch {row['batch']}: {row['ms_per_step']:.3f} ms/step, floor {row['floor_ms']:.3f} "
          f"({row['x_floor']:.2f}x), {row['kernels_per_step']:.0f} kernels a step, {len(layer['kernels'])} a layer")
    for k in layer["kernels"]:
        print(f"  {k['us']:7.2f} us  gap {k['gap_us']:6.2f}  {k['name'][:100]}")
    print(f"  layer period {layer['us']:.1f} us (kernel spans {layer['kernel_us']:.1f}); outside the layers "
          f"{row['outside_layers_us']:.0f} us a step")
    for k in row["step_level"]:
        print(f"  step-level {k['us']:7.2f} us  {k['name'][:100]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-8b-shape,llama-8b-shape-fp8,llama-8b-shape-int4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_layers times CUDA kernels; run it on a GPU machine")
    bandwidth = measure_copy_bandwidth_gbps()
    print(f"copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    rows = []
    for model in args.models.split(","):
        rows.append(profile_model(model, args.batch, args.steps, bandwidth))
        report(rows[-1])
        torch.cuda.empty_cache()
    if not args.no_write:
        path = write_results("profile_layers", rows, {r["model"]: r["floor_ms"] for r in rows},
                             {"copy_bandwidth_gbps": bandwidth, "steps": args.steps,
                              "prompt_tokens": PROMPT_TOKENS, "settings": "random weights, CUDA graphs, greedy"})
        print("wrote", path)


if __name__ == "__main__":
    main()
