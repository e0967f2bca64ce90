"""Shared benchmark plumbing: result files, tables, the memory-bandwidth floor, model shapes.

Benchmarks are scripts (run from the repo root as `python -m benchmarks.<name>`), not tests.
Results follow /work/shared/BENCHMARKS.md: one JSON per benchmark, device and day.

Random-weight models of real shapes (`llama-1b-shape`, `llama-8b-shape`, `qwen3-8b-shape`,
the mixture of experts `qwen3-30b-a3b-shape`) let us measure speed on sizes we cannot ship. Their weights are generated directly on the device by
`random_weights`, so an 8B model never touches disk; `random_llama_dir` writes only the small
files (config.json, tokenizer) that loaders and peers expect.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from structgen.engine.config import ModelConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

# HF config.json values of the real models. The random-shape models reuse the SmolLM2
# tokenizer (49152 tokens) with the real vocab width (128256): grammar bitmasks and the
# lm_head follow config.vocab_size; ids past the tokenizer decode to "" and are never allowed
# by a grammar. bos/eos are SmolLM2's so chat templates and stop tokens work unchanged.
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "rope_theta": 100000.0, "rope_scaling": None, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    },
    "llama-1b": {  # Llama-3.2-1B
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    },
    "llama-8b": {  # Llama-3.1-8B
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    },
    "qwen3-8b": {  # Qwen3-8B: q/k norms
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {  # Qwen3-30B-A3B: 128 experts, 8 per token, every layer sparse
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    },
    "llama-70b": {  # Llama-3.1-70B: its float weights fit no single GPU (tensor-parallel or quantized rows)
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    },
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json")


# ----------------------------------------------------------------------------- results


def maskbench_dir() -> Path:
    """`$STRUCTGEN_SHARED/data/maskbench`, by default `<repo>/../shared/data/maskbench`."""
    shared = os.environ.get("STRUCTGEN_SHARED") or Path(__file__).resolve().parents[2] / "shared"
    return Path(shared) / "data" / "maskbench"


def device_name() -> str:
    """torch.cuda.get_device_name() on a GPU machine, else "cpu"."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def host() -> dict[str, Any]:
    """The CPU the figures came from (its model name as the kernel reports it, and its family and
    model numbers: a VM's name can be a bare "AMD EPYC" whichever core generation it runs on)
    and its cores: CPU figures, and host-bound GPU ones, move with it (two 2-core VMs gave 4.25
    and 7.3 ms a token to the same commit)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():  # the first processor's fields only
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:  # not Linux
        import platform

        fields["model name"] = platform.processor()
    info: dict[str, Any] = {"cpu": fields.get("model name", ""), "cores": os.cpu_count()}
    if "cpu family" in fields:
        info["family_model"] = f"{fields['cpu family']}/{fields.get('model', '?')}"
    return info


def host_speed_ms(loops: int = 200_000) -> float:
    """Milliseconds of a fixed pure-Python loop: how fast one core of this host runs the
    interpreter right now. On the lent GPU hosts (KVM guests, no steal reported) it read 11 or
    20 ms from one serving burst to the next, and host-bound figures move with it; a benchmark
    records it beside them so a slow figure can be told from a slow moment
    (docs/performance.md, "Serving under load")."""
    start = time.perf_counter()
    total = 0
    for k in range(loops):
        total += k * k
    return round(1e3 * (time.perf_counter() - start), 2)


def git_commit() -> str:
    """HEAD of this checkout; the device's copy has no .git, so STRUCTGEN_COMMIT overrides."""
    if os.environ.get("STRUCTGEN_COMMIT"):
        return os.environ["STRUCTGEN_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def slug(text: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def write_results(
    benchmark: str,
    rows: list[dict[str, Any]],
    floors: dict[str, float] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `benchmarks/results/<benchmark>-<device-slug>-<YYYYMMDD>.json` and return its path.

    `extra` keys are added at the top level (settings, bandwidth, notes); they cannot replace
    the standard keys. A second run on the same day and device overwrites the file.
    """
    now = datetime.now(timezone.utc)
    device = device_name()
    doc: dict[str, Any] = {
        "benchmark": benchmark,
        "device": device,
        "date": now.strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "host": host(),
        "floors": dict(floors or {}),
        "rows": rows,
    }
    for k, v in (extra or {}).items():
        doc.setdefault(k, v)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{benchmark}-{slug(device)}-{now.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def print_table(rows: list[dict[str, Any]]) -> None:
    """Print rows as aligned columns (union of keys, first-seen order; floats to 4 digits)."""
    if not rows:
        print("(no rows)")
        return
    cols: list[str] = []
    for r in rows:
        cols.extend(k for k in r if k not in cols)

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


# ----------------------------------------------------------------------------- floors


def measure_copy_bandwidth_gbps(device: str | torch.device | None = None, nbytes: int = 1 << 30,
                                iters: int = 20) -> float:
    """Achievable memory bandwidth in GB/s (1e9), counting bytes read plus bytes written.

    On CUDA: a device-to-device copy of `nbytes`, timed with CUDA events after warm-up (an
    H100 gives about 3000). On CPU: a memcpy of 256 MiB timed with perf_counter, a rough bound.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        nbytes = min(nbytes, 256 << 20)
        iters = min(iters, 5)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    return 2 * nbytes * iters / seconds / 1e9


def hbm_floor_ms(weight_bytes: int, bandwidth_gbps: float) -> float:
    """Lower bound on one decode step: every weight is read once at the measured bandwidth."""
    return weight_bytes / (bandwidth_gbps * 1e9) * 1e3


# ----------------------------------------------------------------------------- model shapes


def hf_config(shape: str) -> dict[str, Any]:
    """The HF config.json dict of a shape in SHAPES (bos/eos of the SmolLM2 tokenizer)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, **SHAPES[shape],
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def fits_two_copies(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> bool:
    """Whether the model and a `random_weights` dict of it fit on `device` at once; a model
    that does not (the MoE shape on one GPU) draws its random weights in place instead, so it
    and its peer hold different weights of the same shapes (speed only; outputs differ)."""
    size = sum(_numel(s) for s in hf_param_shapes(cfg).values()) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cuda":
        return True
    return 2 * size < torch.cuda.mem_get_info(device)[1] * 0.85


def model_config(shape: str) -> ModelConfig:
    """ModelConfig of a shape, for building the engine without any files."""
    return ModelConfig.from_dict(hf_config(shape))


def hf_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the HF checkpoint layout, by name (no lm_head when tied); a sparse
    layer's experts stacked as transformers 5 names them."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    experts, expert_inter = cfg.num_experts, cfg.moe_intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
        })
        if cfg.is_moe_layer(i):
            shapes.update({p + "mlp.gate.weight": (experts, h),
                           p + "mlp.experts.gate_up_proj": (experts, 2 * expert_inter, h),
                           p + "mlp.experts.down_proj": (experts, h, expert_inter)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter)})
        if cfg.attention_bias:
            shapes.update({p + f"self_attn.{n}_proj.bias": (d,) for n, d in (("q", q), ("k", kv), ("v", kv))})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def decode_weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step of one sequence reads: everything but the embedding
    table (a gather of a few rows), plus the lm_head, which a tied model reads from that same
    table; of a sparse layer's experts only the `num_experts_per_tok` its token is routed to
    (the active-weight floor; larger batches touch more experts)."""
    n = 0
    for name, shape in hf_param_shapes(cfg).items():
        if name == "model.embed_tokens.weight":
            continue
        n += _numel(shape) * cfg.num_experts_per_tok // shape[0] if ".mlp.experts." in name else _numel(shape)
    if cfg.tie_word_embeddings:
        n += cfg.vocab_size * cfg.hidden_size
    return n * torch.empty((), dtype=dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@torch.no_grad()
def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, *,
                   std: float = 0.02, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-named weights generated on `device` (norms are ones, the rest N(0, std)).

    Deterministic for a seed and device, so our engine and a peer can be handed the very same
    model: `LlamaModel.load_hf_weights(w)` / `hf_model.load_state_dict(w, strict=False)`.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in hf_param_shapes(cfg).items():
        if "norm" in name:
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape, dtype=dtype, device=device)
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
            out[name] = t.normal_(0.0, std, generator=gen)
    return out


def random_llama_dir(shape: str, dtype: torch.dtype = torch.bfloat16, *, weights: bool = False,
                     root: Path | None = None) -> Path:
    """An HF directory for `shape`: config.json + the SmolLM2 tokenizer files.

    With `weights=True` it also writes random `model.safetensors` (refused above 4 GiB: big
    models get their weights from `random_weights` on the device instead). Without weights the
    directory serves `load_model_config`/`load_tokenizer` and peers' `from_config`.
    """
    from safetensors.torch import save_file

    from structgen.engine.models.loader import default_cache_dir, resolve_model

    cfg_dict = {**hf_config(shape), "torch_dtype": str(dtype).removeprefix("torch.")}
    out = Path(root) if root is not None else default_cache_dir().parent / "bench" / f"{shape}-shape"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    src = resolve_model(progress=False)
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    st = out / "model.safetensors"
    if weights:
        cfg = ModelConfig.from_dict(cfg_dict)
        size = sum(_numel(s) for s in hf_param_shapes(cfg).values()) * torch.empty((), dtype=dtype).element_size()
        if size > 4 << 30:
            raise ValueError(f"{shape} weights are {size / 2**30:.1f} GiB; use random_weights() on the device")
        save_file({k: v.contiguous() for k, v in random_weights(cfg, dtype, "cpu").items()}, str(st))
    elif st.exists():
        st.unlink()  # never leave weights that do not match a rewritten config
    return out
