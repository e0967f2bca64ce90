"""The Triton kernels (decode attention, fused element-wise ops, masked sampling) against their
torch definitions, and CUDA-graph decoding against eager decoding.

GPU tests: they skip without CUDA. With `TRITON_INTERPRET=1` the kernel tests also run on the
CPU through Triton's interpreter (in float32/float16: the interpreter mis-computes bf16 dots),
which is how they were debugged without a GPU; the CUDA-graph tests need a real device.
Inputs are fresh random data; outputs are poisoned with NaN first where a kernel must write
every element.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA (or TRITON_INTERPRET=1)"),
]
DEVICE = torch.device("cuda" if CUDA else "cpu")
LOW = torch.bfloat16 if CUDA else torch.float16  # the model dtype these kernels run in
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")


@pytest.fixture(autouse=True)
def per_row_count_kernels() -> Iterator[None]:
    """The kernels' usual mode (an engine built earlier in this process may have switched the
    process-wide batch-invariant mode on); the `invariant` fixture switches it on."""
    from structgen.engine.kernels import batch_invariant, use_batch_invariant

    before = batch_invariant()
    use_batch_invariant(False)
    yield
    use_batch_invariant(before)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any()
    return float((out - ref).norm() / ref.norm())


# ----------------------------------------------------------------------------- decode attention


def paged(k: torch.Tensor, v: torch.Tensor, page: int, g: torch.Generator
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-slot caches [slots, max_len, kv_heads, D] as a page pool in shuffled page order
    (page 0 and one spare page hold NaN) and its page table [slots, max_len / page]."""
    slots, max_len = k.shape[:2]
    per_slot = max_len // page
    table = (torch.randperm(slots * per_slot + 1, generator=g)[: slots * per_slot] + 1).view(slots, per_slot)
    pool_k = torch.full((slots * per_slot + 2, page, *k.shape[2:]), float("nan"), dtype=k.dtype, device=k.device)
    pool_v = pool_k.clone()
    pool_k[table.flatten().to(k.device)] = k.reshape(slots * per_slot, page, *k.shape[2:])
    pool_v[table.flatten().to(k.device)] = v.reshape(slots * per_slot, page, *k.shape[2:])
    return pool_k, pool_v, table.to(k.device)


@pytest.mark.parametrize(
    "batch,heads,kv_heads,dim,max_len",
    [(1, 9, 3, 64, 256), (3, 9, 3, 64, 704), (5, 32, 8, 128, 2048), (64, 32, 8, 64, 512), (2, 4, 4, 64, 96)],
)
@pytest.mark.parametrize("dtype", [torch.float32, LOW])
def test_decode_attention_matches_reference(batch, heads, kv_heads, dim, max_len, dtype):
    from structgen.engine.kernels.decode_attention import (
        decode_attention,
        decode_attention_reference,
    )

    g = torch.Generator().manual_seed(batch * 1000 + max_len)
    slots_total = batch + 3
    k = torch.randn(slots_total, max_len, kv_heads, dim, generator=g).to(DEVICE, dtype)
    v = torch.randn(slots_total, max_len, kv_heads, dim, generator=g).to(DEVICE, dtype)
    q = torch.randn(batch, heads, dim, generator=g).to(DEVICE, dtype)
    slots = torch.randperm(slots_total, generator=g)[:batch].to(DEVICE)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    lens[0] = 1  # a sequence that sees only its own token
    if batch > 1:
        lens[1] = max_len  # and one that fills its pages
    lens = lens.to(DEVICE)
    for slot, n in zip(slots.tolist(), lens.tolist(), strict=True):  # never read past a length
        k[slot, n:] = float("nan")
        v[slot, n:] = float("nan")
    k, v, table = paged(k, v, 16, g)
    out = decode_attention(q, k, v, table, slots, lens)
    ref = decode_attention_reference(q, k, v, table, slots, lens)
    tol = 1e-4 if dtype == torch.float32 and not CUDA else 1e-2  # CUDA float32 dots run in tf32
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("window", [1, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, LOW])
def test_decode_attention_with_a_sliding_window_reads_only_the_last_keys(window, dtype):
    """Gemma 3's sliding layers: the kernel reads the last `window` keys of each context and
    nothing before them (NaN there would show), short contexts whole."""
    from structgen.engine.kernels.decode_attention import (
        decode_attention,
        decode_attention_reference,
    )

    g = torch.Generator().manual_seed(window)
    batch, heads, kv_heads, dim, max_len = 4, 4, 1, 256, 704
    k = torch.randn(batch + 1, max_len, kv_heads, dim, generator=g).to(DEVICE, dtype)
    v = torch.randn(batch + 1, max_len, kv_heads, dim, generator=g).to(DEVICE, dtype)
    q = torch.randn(batch, heads, dim, generator=g).to(DEVICE, dtype)
    slots = torch.arange(batch, device=DEVICE)
    lens = torch.tensor([1, window, window + 37, max_len], device=DEVICE)
    for slot, n in enumerate(lens.tolist()):
        k[slot, n:] = v[slot, n:] = float("nan")  # past the length
        k[slot, : max(0, n - window)] = v[slot, : max(0, n - window)] = float("nan")  # before the window
    k, v, table = paged(k, v, 16, g)
    out = decode_attention(q, k, v, table, slots, lens, window=window)
    ref = decode_attention_reference(q, k, v, table, slots, lens, window=window)
    tol = 1e-4 if dtype == torch.float32 and not CUDA else 1e-2
    assert rel_err(out, ref) < tol


# The cascade (`prefix_len`): rows of several sequences whose first pages are the same pages.
# Layouts: (rows of each sequence, each sequence's last context length), after `prefix_pages`
# shared pages of 16 keys.
CASCADE_LAYOUTS = {
    "decode rows": ([1] * 12, [330, 321, 400, 500, 333, 350, 420, 390, 321, 480, 360, 345]),  # 321: just past
    "prompt tails": ([1, 25, 7, 25, 3, 12], [340, 380, 420, 345, 330, 500]),
    "two long rows": ([1, 2], [700, 330]),  # few rows: each walks its own keys in several splits
    "a burst's tails": ([25] * 12, [350 + 3 * i for i in range(12)]),  # enough rows for one split on a GPU too
}


def shared_prefix_rows(rows: list[int], ctx: list[int], prefix_pages: int, kv_heads: int, dim: int,
                       dtype: torch.dtype, g: torch.Generator, page: int = 16):
    """(k pool, v pool, page table, slots, context lengths): sequence i holds the same first
    `prefix_pages` pages as every other, then pages of its own in shuffled order, and runs
    rows[i] rows, its last positions up to ctx[i] (each row attends up to itself). Pool rows
    no row may read (page 0, past a sequence's length in its own pages) hold NaN."""
    per_seq = max(-(-n // page) for n in ctx)
    own = [per_seq - prefix_pages] * len(rows)
    order = torch.randperm(prefix_pages + sum(own), generator=g) + 1
    table = torch.zeros(len(rows), per_seq, dtype=torch.long)
    table[:, :prefix_pages] = order[:prefix_pages]
    table[:, prefix_pages:] = order[prefix_pages:].view(len(rows), -1)
    k = torch.randn(len(order) + 2, page, kv_heads, dim, generator=g)
    v = torch.randn(len(order) + 2, page, kv_heads, dim, generator=g)
    k[0] = v[0] = float("nan")
    for i, n in enumerate(ctx):  # past each sequence's length, in its own pages
        past = torch.arange(max(n, prefix_pages * page), per_seq * page)
        rows_past = table[i, past // page] * page + past % page
        k.view(-1, kv_heads, dim)[rows_past] = v.view(-1, kv_heads, dim)[rows_past] = float("nan")
    slots = torch.tensor([i for i, r in enumerate(rows) for _ in range(r)])
    lens = torch.tensor([n - r + 1 + j for r, n in zip(rows, ctx, strict=True) for j in range(r)])
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype), table.to(DEVICE), slots.to(DEVICE), lens.to(DEVICE)


@pytest.mark.parametrize("layout", list(CASCADE_LAYOUTS))
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 64), (4, 1, 256)])
def test_cascade_over_a_shared_prefix_matches_the_reference(layout, heads, kv_heads, dim):
    """Rows of several sequences sharing their first 20 pages (decode rows, one of them just
    past the prefix; prompt tails of 1 to 25 rows; two rows whose own keys take several
    splits, 300 rows that take one), GQA groups 3, 4 and Gemma 3's: the output
    with a prefix of no page, one page or all 20 is the reference attention, and with none it
    is the plain kernel's."""
    from structgen.engine.kernels.decode_attention import (
        decode_attention,
        decode_attention_reference,
    )

    g = torch.Generator().manual_seed(heads + len(layout))
    k, v, table, slots, lens = shared_prefix_rows(*CASCADE_LAYOUTS[layout], 20, kv_heads, dim, LOW, g)
    q = torch.randn(len(slots), heads, dim, generator=g).to(DEVICE, LOW)
    ref = decode_attention_reference(q, k, v, table, slots, lens)
    plain = decode_attention(q, k, v, table, slots, lens)
    for prefix in (0, 16, 320):
        out = decode_attention(q, k, v, table, slots, lens, prefix_len=torch.tensor([prefix], device=DEVICE))
        assert rel_err(out, ref) < 1e-2, prefix
        if prefix == 0:  # the same sums; on CUDA the merge's wider reduction may round a bf16 ulp apart
            assert rel_err(out, plain) < (1e-3 if CUDA else 1e-6)


def test_cascade_reads_the_prefix_once_through_the_first_rows_pages():
    """With a prefix, a row reads its keys before it only through row 0's pages (the prefix
    programs'): other rows' table entries there point at NaN, and the output is still the
    reference's over the shared pages. A row whose context ends inside the prefix (a graph's
    padding row) attends to its own keys as without one."""
    from structgen.engine.kernels.decode_attention import (
        decode_attention,
        decode_attention_reference,
    )

    g = torch.Generator().manual_seed(7)
    k, v, table, slots, lens = shared_prefix_rows([1, 25, 4, 1], [400, 360, 330, 10], 20, 3, 64, torch.float32, g)
    q = torch.randn(len(slots), 9, 64, generator=g).to(DEVICE)
    ref = decode_attention_reference(q, k, v, table, slots, lens)
    blind = table.clone()
    blind[1:3, :20] = 0  # page 0 holds NaN
    out = decode_attention(q, k, v, blind, slots, lens, prefix_len=torch.tensor([320], device=DEVICE))
    tol = 1e-4 if not CUDA else 1e-2
    assert rel_err(out, ref) < tol


# ----------------------------------------------------------------------------- fused element-wise


def test_rms_norm_matches_torch():
    from structgen.engine.kernels.fused import rms_norm
    from structgen.engine.models.llama import RMSNorm

    norm = RMSNorm(576, 1e-5).to(DEVICE, LOW)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = torch.randn(7, 576, device=DEVICE).to(LOW)
    r = torch.randn(7, 576, device=DEVICE).to(LOW)
    with torch.inference_mode():
        out, _ = rms_norm(x, norm.weight, 1e-5)
        assert rel_err(out, norm(x)) < 1e-2
        out, res = rms_norm(x, norm.weight, 1e-5, r)
        assert torch.equal(res, x + r)
        assert rel_err(out, norm(x + r)) < 1e-2


def test_rope_and_cache_matches_torch():
    from structgen.engine.config import ModelConfig
    from structgen.engine.kernels.fused import rope_and_cache
    from structgen.engine.models.llama import RotaryEmbedding

    cfg = ModelConfig(num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    rope = RotaryEmbedding(cfg, 512).to(DEVICE)
    n, q_size, kv_size = 6, 9 * 64, 3 * 64
    qkv = torch.randn(n, q_size + 2 * kv_size, device=DEVICE).to(LOW)
    positions = torch.tensor([0, 1, 17, 200, 511, 3], device=DEVICE)
    token_slots = torch.tensor([0, 1, 40, 17, 511, 38], device=DEVICE)  # cache rows of a [32, 16] pool
    kc = torch.full((32, 16, 3, 64), float("nan"), device=DEVICE).to(LOW)
    vc = kc.clone()
    q = rope_and_cache(qkv, positions, token_slots, rope.cos, rope.sin, kc, vc, 9, 3, 64)
    q_ref, k_ref, v_ref = qkv.split([q_size, kv_size, kv_size], dim=-1)
    assert rel_err(q, rope(q_ref.reshape(n, 9, 64), positions)) < 1e-2
    assert rel_err(kc.view(-1, 3, 64)[token_slots], rope(k_ref.reshape(n, 3, 64), positions)) < 1e-2
    assert torch.equal(vc.view(-1, 3, 64)[token_slots], v_ref.reshape(n, 3, 64))


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values lie between a and b (same-sign values)."""
    as_int = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    return (a.view(as_int).long() - b.view(as_int).long()).abs()


@pytest.mark.parametrize("dtype", [torch.float32, LOW])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_rope_and_cache_with_head_norms_matches_torch(family, dtype):
    """Qwen3's per-head q/k RMSNorm and Gemma 3's `(1 + w)` form, folded into the RoPE + KV
    write kernel, give the torch path's norm-then-rotate: bit for bit almost everywhere in the
    16-bit model dtype; in float32, where the kernel's sum order and 1/sqrt differ from torch's,
    the norm itself (position 0: cos 1, sin 0) within a few ulps (more on the GPU, whose Triton
    sqrt and division are approximate) and every rotated head within as many ulps of its
    largest normed element."""
    from structgen.engine.config import ModelConfig
    from structgen.engine.kernels.fused import HeadNorms, rope_and_cache
    from structgen.engine.models.gemma3 import GemmaRMSNorm
    from structgen.engine.models.llama import RMSNorm, RotaryEmbedding

    heads, kv_heads, dim = (8, 2, 128) if family == "qwen3" else (4, 1, 256)
    norm_type, weight_mean = (RMSNorm, 1.0) if family == "qwen3" else (GemmaRMSNorm, 0.0)
    rope = RotaryEmbedding(ModelConfig(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim), 512)
    rope = rope.to(DEVICE)
    q_norm, k_norm = norm_type(dim, 1e-6).to(DEVICE, dtype), norm_type(dim, 1e-6).to(DEVICE, dtype)
    g = torch.Generator().manual_seed(dim)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(dim, generator=g) * 0.3 + weight_mean)
        k_norm.weight.copy_(torch.randn(dim, generator=g) * 0.3 + weight_mean)
    n, q_size, kv_size = 6, heads * dim, kv_heads * dim
    qkv = (torch.randn(n, q_size + 2 * kv_size, generator=g) * 3).to(DEVICE, dtype)
    positions = torch.tensor([0, 0, 17, 200, 511, 3], device=DEVICE)
    token_slots = torch.tensor([0, 1, 40, 17, 511, 38], device=DEVICE)
    kc = torch.full((32, 16, kv_heads, dim), float("nan"), device=DEVICE).to(dtype)
    vc = kc.clone()
    norms = HeadNorms(q_norm.weight, k_norm.weight, 1e-6, unit_offset=family == "gemma3")
    with torch.inference_mode():
        q = rope_and_cache(qkv, positions, token_slots, rope.cos, rope.sin, kc, vc, heads, kv_heads, dim, norms)
        q_in, k_in, v_in = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q_normed, k_normed = q_norm(q_in.reshape(n, heads, dim)), k_norm(k_in.reshape(n, kv_heads, dim))
    eps, at_zero, ulps = torch.finfo(dtype).eps, positions == 0, 8 if CUDA else 4
    for out, normed in ((q, q_normed), (kc.view(-1, kv_heads, dim)[token_slots], k_normed)):
        ref = rope(normed, positions)
        if dtype == torch.float32:
            assert ulps_apart(out[at_zero], normed[at_zero]).max() <= ulps
        else:
            # On a GPU the norm's float32 sum and 1/sqrt round apart from torch's (approximate
            # sqrt and division), which moves a bf16 rounding in about one element in ten.
            assert (out == ref).float().mean() > (0.85 if CUDA else 0.99)
        err = (out.float() - ref.float()).abs().amax(-1)
        assert (err <= ulps * eps * normed.float().abs().amax(-1)).all()
    assert torch.equal(vc.view(-1, kv_heads, dim)[token_slots], v_in.reshape(n, kv_heads, dim))


def test_silu_mul_matches_torch():
    import torch.nn.functional as F

    from structgen.engine.kernels.fused import silu_mul

    x = torch.randn(5, 2 * 1536, device=DEVICE).to(LOW)
    gate, up = x.split(1536, dim=-1)
    assert rel_err(silu_mul(x), F.silu(gate) * up) < 1e-2


def test_gemma_norm_and_geglu_match_torch():
    """Gemma's `(1 + w)` RMSNorm (with and without the residual add) and tanh-GELU(gate) * up."""
    import torch.nn.functional as F

    from structgen.engine.kernels.fused import gelu_tanh_mul, rms_norm
    from structgen.engine.models.gemma3 import GemmaRMSNorm

    norm = GemmaRMSNorm(640, 1e-6).to(DEVICE, LOW)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
    x = torch.randn(7, 640, device=DEVICE).to(LOW)
    r = torch.randn(7, 640, device=DEVICE).to(LOW)
    with torch.inference_mode():
        assert rel_err(rms_norm(x, norm.weight, 1e-6, unit_offset=True)[0], norm(x)) < 1e-2
        out, res = rms_norm(x, norm.weight, 1e-6, r, unit_offset=True)
        assert torch.equal(res, x + r) and rel_err(out, norm(x + r)) < 1e-2
    g = torch.randn(5, 2 * 2048, device=DEVICE).to(LOW) * 3
    gate, up = g.split(2048, dim=-1)
    assert rel_err(gelu_tanh_mul(g), F.gelu(gate, approximate="tanh") * up) < 1e-2


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (100, 300), (256, 2048), (2056, 2048)])
def test_gemv_matches_linear(n, k):
    """Every block shape `plan` may pick, in every form, for 1-16 rows (K not a multiple of
    the chunk included: 300, 576 and 1536 against 1024-wide chunks)."""
    import torch.nn.functional as F

    from structgen.engine.kernels.gemv import CONFIGS, DOT, MULTI_ROW, gemv

    w = (torch.randn(n, k, device=DEVICE) * 0.05).to(LOW)
    b = torch.randn(n, device=DEVICE).to(LOW)
    for rows in (1, 2, 3, 4, 7, 16):
        x = torch.randn(rows, k, device=DEVICE).to(LOW)
        blocks = [*CONFIGS, *(c._replace(form="late") for c in CONFIGS)] if rows == 1 else [*DOT]
        if 1 < rows <= 4:
            blocks += MULTI_ROW
        for block in blocks:
            assert rel_err(gemv(x, w, block=block), F.linear(x, w)) < 1e-2, (rows, block)
            assert rel_err(gemv(x, w, b, block=block), F.linear(x, w, b)) < 1e-2, (rows, block)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_silu_gemv_matches_the_unfused_stages(rows, with_residual):
    """rmsnorm(x + r) -> gate_up -> silu(gate) * up in one kernel, against the three torch
    stages it replaces; the residual stream comes back bit-exact."""
    import torch.nn.functional as F

    from structgen.engine.kernels.fused_gemv import CONFIGS, norm_silu_gemv
    from structgen.engine.models.llama import RMSNorm

    k, inter = 576, 1536
    norm = RMSNorm(k, 1e-5).to(DEVICE, LOW)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    w = (torch.randn(2 * inter, k, device=DEVICE) * 0.05).to(LOW)
    x = torch.randn(rows, k, device=DEVICE).to(LOW)
    r = torch.randn(rows, k, device=DEVICE).to(LOW) if with_residual else None
    summed = x + r if with_residual else x
    with torch.no_grad():
        gate, up = F.linear(norm(summed), w).split(inter, dim=-1)
    ref = F.silu(gate) * up
    for cfg in (CONFIGS[0], CONFIGS[2]):  # 4 and 8 features a program
        with torch.inference_mode():
            out, res = norm_silu_gemv(x, w, norm.weight, 1e-5, r, cfg=cfg)
        assert out.shape == (rows, inter)
        assert rel_err(out, ref) < 2e-2
        assert torch.equal(res, summed)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_qkv_rope_gemv_matches_the_unfused_stages(rows, bias):
    """rmsnorm -> qkv (+ bias) -> RoPE on q and k -> k, v into the cache, in one kernel,
    against the torch stages; cache entries other rows own are left alone."""
    import torch.nn.functional as F

    from structgen.engine.config import ModelConfig
    from structgen.engine.kernels.fused_gemv import CONFIGS, norm_qkv_rope_gemv
    from structgen.engine.models.llama import RMSNorm, RotaryEmbedding

    heads, kv_heads, dim, hidden = 6, 2, 64, 384
    cfg = ModelConfig(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim)
    rope = RotaryEmbedding(cfg, 256).to(DEVICE)
    norm = RMSNorm(hidden, 1e-5).to(DEVICE, LOW)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    q_size, kv_size = heads * dim, kv_heads * dim
    w = (torch.randn(q_size + 2 * kv_size, hidden, device=DEVICE) * 0.05).to(LOW)
    b = torch.randn(q_size + 2 * kv_size, device=DEVICE).to(LOW) if bias else None
    x = torch.randn(rows, hidden, device=DEVICE).to(LOW)
    r = torch.randn(rows, hidden, device=DEVICE).to(LOW)
    positions = torch.tensor([5, 200, 17, 0][:rows], device=DEVICE)
    slots = torch.tensor([1, 0, 2, 3][:rows], device=DEVICE)
    with torch.no_grad():
        qkv = F.linear(norm(x + r), w, b)
    q_ref, k_ref, v_ref = qkv.split([q_size, kv_size, kv_size], dim=-1)
    for block in (CONFIGS[0], CONFIGS[2]):
        kc = torch.full((64, 16, kv_heads, dim), float("nan"), device=DEVICE).to(LOW)  # a pool of 64 pages
        vc = kc.clone()
        token_slots = slots * 256 + positions  # cache rows
        with torch.inference_mode():
            q, res = norm_qkv_rope_gemv(x, w, b, norm.weight, 1e-5, r, positions, token_slots, rope.cos, rope.sin,
                                        kc, vc, heads, kv_heads, dim, cfg=block)
        assert torch.equal(res, x + r)
        assert rel_err(q, rope(q_ref.reshape(rows, heads, dim), positions)) < 2e-2
        k_rows, v_rows = kc.view(-1, kv_heads, dim), vc.view(-1, kv_heads, dim)
        assert rel_err(k_rows[token_slots], rope(k_ref.reshape(rows, kv_heads, dim), positions)) < 2e-2
        assert rel_err(v_rows[token_slots], v_ref.reshape(rows, kv_heads, dim)) < 2e-2
        written = torch.zeros(64 * 16, dtype=torch.bool, device=DEVICE)
        written[token_slots] = True
        assert k_rows[~written].isnan().all() and v_rows[~written].isnan().all()


@pytest.mark.parametrize("rows", [1, 3])
def test_norm_qkv_rope_gemv_with_head_norms_matches_the_unfused_stages(rows):
    """Qwen3's layout: rmsnorm -> qkv -> per-head q/k norms -> RoPE -> k, v into the cache, in
    one kernel whose programs each own a whole head, against the torch stages, for every
    chunk shape the device may time (some longer than K), and in the two launches it is timed
    against (`SPLIT`); other rows' cache entries are left alone."""
    import torch.nn.functional as F

    from structgen.engine.config import ModelConfig
    from structgen.engine.kernels.fused import HeadNorms
    from structgen.engine.kernels.fused_gemv import HEAD_CONFIGS, SPLIT, norm_qkv_rope_gemv
    from structgen.engine.models.llama import RMSNorm, RotaryEmbedding

    heads, kv_heads, dim, hidden = 4, 2, 128, 192  # Qwen3's head size
    cfg = ModelConfig(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim)
    rope = RotaryEmbedding(cfg, 256).to(DEVICE)
    norm, q_norm, k_norm = (RMSNorm(n, 1e-6).to(DEVICE, LOW) for n in (hidden, dim, dim))
    with torch.no_grad():
        for n in (norm, q_norm, k_norm):
            n.weight.normal_(1.0, 0.3)
    q_size, kv_size = heads * dim, kv_heads * dim
    w = (torch.randn(q_size + 2 * kv_size, hidden, device=DEVICE) * 0.05).to(LOW)
    x = torch.randn(rows, hidden, device=DEVICE).to(LOW)
    r = torch.randn(rows, hidden, device=DEVICE).to(LOW)
    positions = torch.tensor([5, 200, 17][:rows], device=DEVICE)
    token_slots = torch.tensor([1, 0, 2][:rows], device=DEVICE) * 256 + positions  # cache rows
    with torch.no_grad():
        q_ref, k_ref, v_ref = F.linear(norm(x + r), w).split([q_size, kv_size, kv_size], dim=-1)
        q_ref = rope(q_norm(q_ref.reshape(rows, heads, dim)), positions)
        k_ref = rope(k_norm(k_ref.reshape(rows, kv_heads, dim)), positions)
    norms = HeadNorms(q_norm.weight, k_norm.weight, 1e-6)
    for block in [(dim // 2, *c) for c in HEAD_CONFIGS] + [SPLIT]:
        kc = torch.full((64, 16, kv_heads, dim), float("nan"), device=DEVICE).to(LOW)  # a pool of 64 pages
        vc = kc.clone()
        with torch.inference_mode():
            q, res = norm_qkv_rope_gemv(x, w, None, norm.weight, 1e-6, r, positions, token_slots,
                                        rope.cos, rope.sin, kc, vc, heads, kv_heads, dim, cfg=block,
                                        head_norms=norms)
        assert torch.equal(res, x + r)
        assert rel_err(q, q_ref) < 2e-2, block
        k_rows, v_rows = kc.view(-1, kv_heads, dim), vc.view(-1, kv_heads, dim)
        assert rel_err(k_rows[token_slots], k_ref) < 2e-2, block
        assert rel_err(v_rows[token_slots], v_ref.reshape(rows, kv_heads, dim)) < 2e-2, block
        written = torch.zeros(64 * 16, dtype=torch.bool, device=DEVICE)
        written[token_slots] = True
        assert k_rows[~written].isnan().all() and v_rows[~written].isnan().all()


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("features", [128, 8, 12])
def test_norm_gemv_matches_norm_then_linear(rows, features):
    """rmsnorm(x + r) @ W.T (+ bias) with the residual stream written once, for a router's row
    counts: 128 experts, 8 (a program owns 4 rows and their partners) and 12 (a narrower
    block, 2)."""
    import torch.nn.functional as F

    from structgen.engine.kernels.fused_gemv import norm_gemv
    from structgen.engine.models.llama import RMSNorm

    hidden = 576
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, LOW)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    w = (torch.randn(features, hidden, device=DEVICE) * 0.05).to(LOW)
    x = torch.randn(rows, hidden, device=DEVICE).to(LOW)
    r = torch.randn(rows, hidden, device=DEVICE).to(LOW)
    with torch.no_grad():
        ref = F.linear(norm(x + r), w)
    b = torch.randn(features, device=DEVICE).to(LOW)
    with torch.inference_mode():
        out, res = norm_gemv(x, w, norm.weight, 1e-6, r)
        alone, same = norm_gemv(x, w, norm.weight, 1e-6, bias=b)
    assert out.shape == (rows, features) and torch.equal(res, x + r)
    assert rel_err(out, ref) < 2e-2
    with torch.no_grad():
        assert rel_err(alone, F.linear(norm(x), w, b)) < 2e-2 and same is x


def test_fused_projections_are_kept_to_the_shapes_they_win_on():
    """`max_rows`: up to 4 rows for small models, 1 row for mid-sized ones, never for an 8B
    shape or where no block width divides the intermediate size or half a head; the model
    takes that rule layer by layer, up to FUSED_ROWS rows unless asked for more."""
    from structgen.engine.config import ModelConfig
    from structgen.engine.kernels.fused_gemv import MAX_ROWS, max_rows
    from structgen.engine.models.llama import FUSED_ROWS, LlamaModel, skip_init

    def gate_up(hidden: int, inter: int) -> torch.Tensor:
        return torch.empty(2 * inter, hidden, device="meta")

    assert max_rows(gate_up(576, 1536), 64) == MAX_ROWS  # SmolLM2-135M
    assert max_rows(gate_up(2048, 8192), 64) == 1  # Llama-3.2-1B
    assert max_rows(gate_up(4096, 14336), 128) == 0  # Llama-3.1-8B
    assert max_rows(gate_up(576, 1530), 64) == 0  # 1530 = 2 x 765: no block width divides it
    assert max_rows(gate_up(576, 1536), 36) == 0  # half a head of 18
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with skip_init(LOW):
        model = LlamaModel(cfg, 32)
    model.use_fused_kernels(True)
    assert [layer.fused_rows for layer in model.layers] == [FUSED_ROWS, FUSED_ROWS] == [2, 2]
    model.use_fused_kernels(True, projection_rows=MAX_ROWS)
    assert [layer.fused_rows for layer in model.layers] == [MAX_ROWS, MAX_ROWS]
    model.use_fused_kernels(True, projection_rows=1)
    assert [layer.fused_rows for layer in model.layers] == [1, 1]
    model.use_fused_kernels(False)
    assert [layer.fused_rows for layer in model.layers] == [0, 0]


def test_fused_layers_match_the_unfused_model():
    """A whole decode step (a few rows) through the fused projections gives the logits of the
    unfused path, for a GQA model with and without attention bias."""
    from structgen.engine.attention import AttentionBatch
    from structgen.engine.config import ModelConfig
    from structgen.engine.kv_cache import PAGE_SIZE, KVCache
    from structgen.engine.models.llama import LlamaModel, skip_init
    from structgen.engine.page_table import PageTable

    for bias in (False, True):
        cfg = ModelConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_bias=bias)
        with skip_init(LOW):
            model = LlamaModel(cfg, 128).to(DEVICE)
        model.init_random_weights(std=0.05)
        logits = []
        for fused in (False, True):
            model.use_fused_kernels(fused)
            pages = PageTable(3 * 128 // PAGE_SIZE + 1, PAGE_SIZE, 3, 128, DEVICE)
            assert pages.cover(1, 10)
            kv = KVCache(cfg, pages, dtype=LOW, device=DEVICE)
            with torch.inference_mode():
                model(torch.arange(1, 9, device=DEVICE), AttentionBatch.build([(1, 0, 8)], pages), kv)
                step = AttentionBatch.build([(1, 8, 2)], pages)  # two rows: forced text
                logits.append(model.logits(model(torch.tensor([7, 9], device=DEVICE), step, kv)))
        assert rel_err(logits[1], logits[0]) < 3e-2


@needs_cuda
def test_timed_gemv_plan_is_cached_and_falls_back_inside_a_capture():
    """`gemv.plan`: one row of a small matrix keeps the fixed rule (the default block shape);
    one row of a large matrix and 2-16 rows of any are timed once per power-of-two row count
    against cuBLAS and the answer kept; 17 rows take cuBLAS; inside a graph capture an untimed
    matrix takes cuBLAS instead of timing; `project` computes the same product whichever way
    it goes."""
    import torch.nn as nn

    from structgen.engine.kernels import gemv
    from structgen.engine.models.llama import project

    small = nn.Linear(576, 960, bias=True, device=DEVICE, dtype=LOW)
    assert gemv.plan(1, small.weight) == gemv.DEFAULT and gemv.plan(17, small.weight) is None
    large = nn.Linear(2048, 3072, bias=False, device=DEVICE, dtype=LOW)
    first = gemv.plan(1, large.weight)
    assert first is None or (first.form == "late" and first._replace(form="chunk") in gemv.CONFIGS)
    assert gemv.plan(1, large.weight) == first  # cached: timed once
    for lin in (small, large):
        two = gemv.plan(2, lin.weight)
        assert two is None or two in (*gemv.MULTI_ROW, *gemv.DOT)
        assert gemv.plan(5, lin.weight) in (None, *gemv.DOT)  # timed as 8 rows
        assert gemv._plans.remembers((8, tuple(lin.weight.shape), str(LOW)), lin.weight.device)
        for rows in (1, 2, 4, 5, 16, 17):
            x = torch.randn(rows, lin.in_features, device=DEVICE).to(LOW)
            assert rel_err(project(lin, x, True), lin(x)) < 1e-2
    untimed = torch.empty(4104, 2048, device=DEVICE, dtype=LOW)  # (a shape no other test times)
    g, buf = torch.cuda.CUDAGraph(), torch.zeros(8, device=DEVICE)
    with torch.cuda.graph(g):
        inside = gemv.plan(1, untimed)
        buf.add_(1)  # a graph needs a node
    assert inside is None
    assert not gemv._plans.remembers((1, (4104, 2048), str(LOW)), untimed.device)


# ----------------------------------------------------------------------------- sampling


def _random_mask(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    from structgen.grammar import allocate_bitmask

    allowed = torch.rand(rows, vocab, generator=g) < 0.05
    allowed[:, 7] = True  # never empty
    mask = allocate_bitmask(rows, vocab).zero_()
    for r in range(rows):
        for t in allowed[r].nonzero().flatten().tolist():
            w, b = divmod(t, 32)
            val = (int(mask[r, w]) & 0xFFFFFFFF) | (1 << b)
            mask[r, w] = val - (1 << 32) if val >= 1 << 31 else val
    return mask


@pytest.mark.parametrize("vocab", [49152, 5000])
def test_sample_tokens_greedy_matches_reference(vocab):
    from structgen.engine.kernels.sampling import sample_tokens
    from structgen.engine.sampler import sample_tokens_reference

    g = torch.Generator().manual_seed(vocab)
    rows = 6
    logits = torch.randn(rows, vocab, generator=g).to(DEVICE, LOW)
    logits[5, 100:110] = logits[5].max()  # a tie: the lowest id wins, as in torch.argmax
    mask = _random_mask(rows, vocab, g)
    has = torch.tensor([1, 0, 1, 0, 1, 0], dtype=torch.int32)
    temp = torch.zeros(rows)
    seeds = torch.arange(rows)
    args = (mask.to(DEVICE), has.to(DEVICE), temp.to(DEVICE), seeds.to(DEVICE))
    out = sample_tokens(logits, *args)
    ref = sample_tokens_reference(logits, *args)
    assert out.tolist() == ref.tolist()


def test_sample_tokens_temperature_is_seeded_and_masked():
    from structgen.engine.kernels.sampling import sample_tokens

    vocab, rows = 5000, 8
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, vocab, generator=g).to(DEVICE)
    mask = _random_mask(rows, vocab, g)
    has = torch.ones(rows, dtype=torch.int32, device=DEVICE)
    temp = torch.full((rows,), 1.0, device=DEVICE)
    seeds = torch.tensor([5, 5, 6, 7, 8, 9, 10, 11], device=DEVICE)
    same_logits = logits.clone()
    same_logits[1] = logits[0]
    mask[1] = mask[0]
    a = sample_tokens(same_logits, mask.to(DEVICE), has, temp, seeds).tolist()
    b = sample_tokens(same_logits, mask.to(DEVICE), has, temp, seeds).tolist()
    assert a == b and a[0] == a[1]  # same seed + same row = same token
    from structgen.engine.sampler import bitmask_to_bool

    ok = bitmask_to_bool(mask, vocab)
    assert all(ok[r, t] for r, t in enumerate(a))


def test_sample_tokens_follows_softmax():
    """Gumbel-max over many seeds draws from softmax(logits / T)."""
    from structgen.engine.kernels.sampling import sample_tokens

    vocab, draws = 8, 4000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2])
    temp = 0.7
    rows = logits.repeat(draws, 1).to(DEVICE)
    mask = torch.zeros(draws, 1, dtype=torch.int32, device=DEVICE)
    out = sample_tokens(
        rows, mask, torch.zeros(draws, dtype=torch.int32, device=DEVICE),
        torch.full((draws,), temp, device=DEVICE), torch.arange(draws, device=DEVICE) * 7919 + 3,
    )
    freq = torch.bincount(out.cpu(), minlength=vocab).double() / draws
    expect = torch.softmax(logits.double() / temp, 0)
    assert (freq - expect).abs().max() < 0.03


# ----------------------------------------------------------------------------- CUDA graphs


def _tiny_engine(use_graphs: bool, **kw):
    from structgen.engine.config import EngineConfig, EngineTuning, ModelConfig
    from structgen.engine.engine import Engine

    cfg = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32, eos_token_id=[])
    ec = EngineConfig(device="cuda", dtype="float32", max_batch_size=16, max_seq_len=512,
                      use_cuda_graphs=use_graphs, tuning=EngineTuning(cuda_graph_batch_sizes=(1, 2, 4, 8, 16)), **kw)
    return Engine(cfg, ec, model_dir=None, stop_token_ids=set())


@needs_cuda
def test_cuda_graph_decode_equals_eager():
    """Greedy tokens are the same with graphs on and off, for batches that fill a bucket and
    batches padded up to one (3 -> 4, 11 -> 16); seeded sampling too."""
    from structgen.engine.request import Request
    from structgen.sampling import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (int(n),), generator=g).tolist() for n in torch.randint(3, 60, (11,), generator=g)]
    outputs = {}
    for graphs in (True, False):
        eng = _tiny_engine(graphs)
        assert (eng.runner.graphs is not None) == graphs
        runs = []
        alone = Request(prompts[0], SamplingParams(max_tokens=12))  # bucket 1: the GEMV path
        eng.run([alone])
        runs.append([alone.output_ids])
        for batch in (prompts[:1], prompts[:3], prompts[:4], prompts):
            reqs = [Request(p, SamplingParams(max_tokens=12)) for p in batch]
            reqs.append(Request(batch[0], SamplingParams(max_tokens=12, temperature=0.8, seed=3)))
            eng.run(reqs)
            runs.append([r.output_ids for r in reqs])
        outputs[graphs] = runs
        del eng
        torch.cuda.empty_cache()
    assert outputs[True] == outputs[False]
    for run in outputs[True][1:]:  # the seeded request samples the same whatever its batch
        assert run[-1] == outputs[True][1][-1]


@needs_cuda
def test_dependent_launch_changes_no_output():
    """Kernels that start while the one before them drains (programmatic dependent launch,
    Hopper and later) give every token that launches in stream order give, through the graphs:
    each waits for its inputs before it reads them."""
    from structgen.engine.kernels.dependent_launch import dependent_launch, use_dependent_launch
    from structgen.engine.request import Request
    from structgen.sampling import SamplingParams

    if not dependent_launch(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs a Hopper or later GPU")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 4096, (int(n),), generator=g).tolist() for n in torch.randint(3, 60, (6,), generator=g)]
    outputs = {}
    try:
        for pdl in (True, False):
            use_dependent_launch(pdl)
            eng = _tiny_engine(True)
            reqs = [Request(p, SamplingParams(max_tokens=16)) for p in prompts]
            alone = Request(prompts[0], SamplingParams(max_tokens=16))
            eng.run(reqs)
            eng.run([alone])
            outputs[pdl] = [r.output_ids for r in (*reqs, alone)]
            del eng
            torch.cuda.empty_cache()
    finally:
        use_dependent_launch(True)
    assert outputs[True] == outputs[False]


def test_prelaunched_forward_after_multi_row_steps_equals_launching_late():
    """Steps that run several rows of one sequence (jump-forward text) still pre-launch the
    next step's forward (one row per sequence, gathered inside the sampler); where the next
    step is the predicted one it is used, elsewhere discarded, and every sampled token equals
    a run that never pre-launches. A planner (`plan_next`, the engine's advance) that names
    the next step's rows gets their forward launched early even when forced text makes them
    differ from the prediction. Runs on the CPU under TRITON_INTERPRET=1 (graphs eager)."""
    from structgen.engine.config import EngineConfig, ModelConfig
    from structgen.engine.cuda_graphs import DecodeGraphs
    from structgen.engine.decode_step import DecodeStep
    from structgen.engine.model_runner import ExtendSeq, ModelRunner

    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=[])
    ec = EngineConfig(device=str(DEVICE), dtype="float32", max_batch_size=4, max_seq_len=64, use_cuda_graphs=False)
    runner = ModelRunner(cfg, ec)
    g = torch.Generator().manual_seed(1)
    prompts = {0: torch.randint(0, 512, (5,), generator=g).tolist(), 1: torch.randint(0, 512, (7,), generator=g).tolist()}
    forced = torch.randint(0, 512, (3,), generator=g).tolist()
    allowed = torch.zeros(16, dtype=torch.int32)  # a mask allowing tokens 0..31 only
    allowed[0] = -1

    def fill(bitmask: torch.Tensor) -> None:
        bitmask.zero_()
        bitmask[:, :16] = allowed

    def decode_run(prelaunch: bool, planner=None) -> tuple[list[list[int]], int]:
        runner.graphs = DecodeGraphs(runner, (1, 2, 4, 8), capture=CUDA, prelaunch=prelaunch)
        runner.extend([ExtendSeq(0, 0, prompts[0]), ExtendSeq(1, 0, prompts[1][:-1])])
        seqs = {0: prompts[0] + forced, 1: list(prompts[1])}  # slot 0 starts with three forced tokens
        cached = {0: len(prompts[0]), 1: len(prompts[1]) - 1}
        state = {"step": 0, "taken": False}

        def take(toks: list[int]) -> None:  # a step's tokens, then forced text after some
            for s, t in zip((0, 1), toks, strict=True):
                seqs[s].append(t)
            seqs[0] += forced[:2] if state["step"] == 2 else []
            seqs[1] += forced[:1] if state["step"] == 3 else []
            state["taken"] = True

        def rows_now() -> list[ExtendSeq]:
            return [ExtendSeq(s, cached[s] + j, [t]) for s in (0, 1) for j, t in enumerate(seqs[s][cached[s]:])]

        class Step(DecodeStep):  # each sequence's last row sampled under the mask; the planner plans
            def fill_masks(self, bitmask: torch.Tensor) -> None:
                fill(bitmask)

            def plan_next(self, toks: list[int]) -> list[ExtendSeq] | None:  # every row's token
                take([toks[i] for i, masked in enumerate(self.has_mask) if masked])
                return planner(state["step"], rows_now())

        out = []
        for step in range(6):
            state.update(step=step, taken=False)
            rows = rows_now()
            cached.update({s: len(seqs[s]) for s in (0, 1)})
            n = len(rows)
            last = [i for i in range(n) if i == n - 1 or rows[i + 1].slot != rows[i].slot]
            step = Step(rows, [0.0] * n, [0] * n, [i in last for i in range(n)], predict_next=True,
                        plans_next=planner is not None)
            tokens = runner.decode(step)
            out.append(tokens)
            if not state["taken"]:
                take([tokens[i] for i in last])
        return out, runner.graphs.steps_ahead

    late, used_late = decode_run(prelaunch=False)
    early, used_early = decode_run(prelaunch=True)
    assert used_late == 0
    assert used_early == 3  # steps 1, 2 and 5 follow a step whose rows were all predicted
    assert early == late
    planned, used_planned = decode_run(prelaunch=True, planner=lambda step, rows: rows)
    assert used_planned == 5  # forced text too: every step after the first was launched early
    assert planned == late
    partly, used_partly = decode_run(prelaunch=True, planner=lambda step, rows: None if step == 1 else rows)
    assert used_partly == 4  # no plan after step 1: step 2's forward launched late
    assert partly == late
    assert all(t < 32 for step in early for t in step[-1:])


class ReplayDrafter:
    """A host-side drafter that proposes a known output (`reference`, by prompt) with every
    4th token corrupted, so verify steps both accept and reject."""

    host_only = True

    def __init__(self) -> None:
        self.reference: dict[tuple[int, ...], list[int]] = {}
        self.calls = 0

    def propose(self, req, k: int) -> list[int]:
        self.calls += 1
        ref, n = self.reference.get(tuple(req.token_ids[: req.num_prompt]), []), req.num_output
        return [(t + 1) % 512 if (n + j) % 4 == 3 else t for j, t in enumerate(ref[n : n + k])]


def test_speculative_prelaunched_verify_equals_launching_late():
    """With a drafter that runs on the host, a verify step takes its sampled tokens in inside
    the graphs' `plan_next`, drafts the next step there and has its forward launched at once
    (speculator.py `_plan_next`). Outputs equal a run that never pre-launches, the planned
    drafts are the ones verified, and most forwards after the first were launched early. Runs
    on the CPU under TRITON_INTERPRET=1 (graphs eager)."""
    from structgen.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
    from structgen.engine.cuda_graphs import DecodeGraphs
    from structgen.engine.engine import Engine
    from structgen.engine.request import Request
    from structgen.sampling import SamplingParams

    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=[])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (6, 11)]

    drafter = ReplayDrafter()

    def run(prelaunch: bool, speculate: bool = True) -> tuple[list[list[int]], int, int]:
        """(outputs, graph steps whose forward was pre-launched, graph steps)."""
        spec = SpeculativeConfig(method="custom", drafter=drafter, num_draft_tokens=3) if speculate else None
        ec = EngineConfig(device=str(DEVICE), dtype="float32", max_batch_size=4, max_seq_len=64,
                          use_cuda_graphs=False, speculative=spec)
        eng = Engine(cfg, ec, model_dir=None, stop_token_ids=set())
        if eng.speculator is not None:  # every step drafts its budget, whatever steps cost here
            eng.speculator.adaptive = False
        eng.runner.model.init_random_weights(std=0.1)
        eng.runner.graphs = DecodeGraphs(eng.runner, (1, 2, 4, 8), capture=CUDA, prelaunch=prelaunch)
        reqs = [Request(p, SamplingParams(max_tokens=30)) for p in prompts]
        drafter.calls = 0
        eng.run(reqs)
        return [r.output_ids for r in reqs], eng.runner.graphs.steps_ahead, eng.runner.graphs.steps

    base, _, _ = run(prelaunch=False, speculate=False)
    drafter.reference = {tuple(p): o for p, o in zip(prompts, base, strict=True)}
    late, ahead_late, _ = run(prelaunch=False)
    calls_late = drafter.calls
    early, ahead_early, steps = run(prelaunch=True)
    assert ahead_late == 0
    assert early == late
    if not CUDA:  # exact on the CPU; on a GPU verify rows may round differently (ties)
        assert late == base
    # All but the first two graph steps: slot 1's prompt, a chunk and then its last token with
    # its drafts, while the scheduler holds slot 0's decoding back for it; no step is planned
    # while a prompt is still prefilling (Scheduler.peek).
    assert steps >= 5 and ahead_early == steps - 2
    assert drafter.calls == calls_late  # planned drafts are the ones verified, not proposed again


def test_capturable_guided_loop_equals_the_engines_path():
    """The capturable mode (guided_loop.py): verify steps run as a loop whose `take` callback
    accepts, drafts and stages the next step. Outputs (greedy, and a seeded sampled request)
    equal the usual path's; most verify steps ran in the loop; a loop stops for a waiting
    caller (`Engine.interrupted`) and for a step with more rows than its bucket, and the
    engine goes on from there. On the CPU under TRITON_INTERPRET=1 (loop steps run eagerly)
    and on the GPU (host callbacks inside the captured graph)."""
    from structgen.engine.config import EngineConfig, EngineTuning, ModelConfig, SpeculativeConfig
    from structgen.engine.engine import Engine
    from structgen.engine.request import Request
    from structgen.sampling import SamplingParams

    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=[])
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (6, 11)]

    drafter = ReplayDrafter()

    def engine(capturable: bool, k: int = 3) -> Engine:
        spec = SpeculativeConfig(method="custom", drafter=drafter, num_draft_tokens=k)
        ec = EngineConfig(device=str(DEVICE), dtype="float32", max_batch_size=4, max_seq_len=96,
                          use_cuda_graphs=False, speculative=spec,
                          tuning=EngineTuning(cuda_graph_batch_sizes=(1, 2, 4, 8, 16), capturable_guided=capturable))
        eng = Engine(cfg, ec, model_dir=None, stop_token_ids=set())
        # Every step drafts its budget: draft lengths chosen by measured step times would
        # differ between the engines, and with them a sampled request's (equally likely) tokens.
        eng.speculator.adaptive = False
        eng.runner.model.init_random_weights(std=0.1)
        eng.runner.capture_decode_graphs(capture=CUDA)
        return eng

    def requests() -> list[Request]:
        return [Request(prompts[0], SamplingParams(max_tokens=40)),
                Request(prompts[1], SamplingParams(max_tokens=40, temperature=0.8, seed=11))]

    base = engine(False)
    drafter.reference = {}
    reference = [r.output_ids for r in base.run(requests())]  # the drafts: this output, corrupted
    drafter.reference = {tuple(p): o for p, o in zip(prompts, reference, strict=True)}
    usual = [r.output_ids for r in engine(False).run(requests())]
    eng = engine(True)
    looped = [r.output_ids for r in eng.run(requests())]
    loops = eng.runner.graphs._loops
    assert looped == usual
    assert list(loops) == [8]  # 2 requests x (1 + 3) rows
    assert loops[8].steps >= 8 and loops[8].steps >= eng.runner.forward_passes - 2  # all but the prompts

    # A waiting caller ends the loop after the step in flight; the engine takes over.
    eng = engine(True)
    calls = []
    eng.interrupted = lambda: calls.append(1) is None and len(calls) >= 2
    reqs = requests()
    for r in reqs:
        eng.add_request(r)
    eng.step()  # the prompts (one graph step)
    before = eng.runner.graphs._loops.get(8)
    eng.step()  # loop: step 1 asks (no), step 2 asks (yes) and stops
    assert eng.runner.graphs._loops[8].steps - (before.steps if before else 0) == 2
    eng.interrupted = lambda: False
    while not all(r.finished for r in reqs):
        eng.step()
    assert [r.output_ids for r in reqs] == usual

    # A step that needs more rows than the loop's bucket ends the run; so do a step past its
    # slot's pages (a run maps none) and a take that raises (after the run, on the caller's thread).
    from structgen.engine.guided_loop import LoopStep

    loop = eng.runner.graphs.guided_loop(2)
    pages = eng.runner.kv.pages
    slot = pages.allocate_slot()
    assert pages.cover(slot, 4)
    taken: list[list[int]] = []

    def step(n: int, then: int) -> LoopStep:
        def take(tokens: list[int], plan: bool) -> LoopStep | None:
            taken.append(tokens)
            if then < 0:
                raise ValueError("broken take")
            return step(then, then - 1 if then > 1 else 3) if plan else None

        return LoopStep([1] * n, list(range(n)), [slot] * n, [0.0] * n, [0] * n, [False] * n, lambda bm: None, take)

    assert loop.run(step(1, 2), 10) == 3 and [len(t) for t in taken] == [1, 2, 1]  # then 3 rows > 2
    taken.clear()
    assert loop.run(step(2, 1), 2) == 2 and [len(t) for t in taken] == [2, 1]  # the budget: 2 steps
    with pytest.raises(ValueError, match="broken take"):
        loop.run(step(1, -1), 10)
    assert loop.stopped
    past = LoopStep([1], [pages.num_mapped(slot)], [slot], [0.0], [0], [False], lambda bm: None, lambda t, plan: None)
    assert loop.run(LoopStep([1], [0], [slot], [0.0], [0], [False], lambda bm: None, lambda t, plan: past), 10) == 1
    pages.release_slot(slot)


def test_prefill_in_graphs_equals_eager_prefill():
    """With `prefill_in_graphs`, prompts run as decode-graph steps, one row per token (each
    row attends to its slot up to its own position), alongside other requests' decode rows,
    in chunks of at most the largest bucket (a 45-token prompt against 32 rows); greedy and
    seeded sampled tokens equal those of eager prefill, and no step runs eagerly.
    Runs on the CPU under TRITON_INTERPRET=1 (graphs eager) and on the GPU."""
    from structgen.engine.config import EngineConfig, EngineTuning, ModelConfig
    from structgen.engine.engine import Engine
    from structgen.engine.request import Request
    from structgen.sampling import SamplingParams

    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=[])
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (5, 13, 9, 3, 45)]
    outputs, graph_steps, eager_steps = {}, {}, {}
    for in_graphs in (True, False):
        ec = EngineConfig(device=str(DEVICE), dtype="float32", max_batch_size=8, max_seq_len=64,
                          use_cuda_graphs=False,
                          tuning=EngineTuning(cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32), prefill_in_graphs=in_graphs))  # buckets up to 4 x 8 slots = 32 rows
        eng = Engine(cfg, ec, model_dir=None, stop_token_ids=set())
        eng.runner.capture_decode_graphs(capture=CUDA)
        reqs = [Request(p, SamplingParams(max_tokens=6)) for p in prompts]
        reqs[3] = Request(prompts[3], SamplingParams(max_tokens=6, temperature=0.9, seed=5))
        for r in reqs[:2]:
            eng.add_request(r)
        eng.step()  # two prompts (5 + 13 rows)
        eng.step()  # their first decode step
        for r in reqs[2:]:
            eng.add_request(r)  # join while the others decode
        while not all(r.finished for r in reqs):
            eng.step()
        outputs[in_graphs] = [r.output_ids for r in reqs]
        graph_steps[in_graphs] = eng.runner.graphs.steps
        eager_steps[in_graphs] = eng.runner.forward_passes - eng.runner.graphs.steps
    assert outputs[True] == outputs[False]
    assert eager_steps[True] == 0 and eager_steps[False] >= 2
    # Both eager prefill steps ran in the graphs, and the 45-token prompt took one step more
    # there: the join step holds 32 rows (2 decode + 9 + 3 + 18), the next one its other 27.
    assert graph_steps[True] == graph_steps[False] + eager_steps[False] + 1


def test_cascade_in_the_graphs_reads_agent_turns_shared_prompt_once_and_changes_no_output(monkeypatch):
    """Nine agent turns sharing a system prompt that a first turn computed (prefix caching):
    their prompt tails and decode steps run in the graphs with its 4 cached pages as the step's
    common prefix (the metadata's PREFIX; the rule's minimum lowered to that, to keep the
    interpreter's run short), and their greedy tokens are those of `cascade_attention=False`,
    whose steps carry none; with captured graphs those steps replay the cascade forward. Runs on the CPU under TRITON_INTERPRET=1 (graphs eager) and on the
    GPU."""
    from structgen.engine import attention
    from structgen.engine.config import EngineConfig, EngineTuning, ModelConfig
    from structgen.engine.engine import Engine
    from structgen.engine.graph_metadata import PREFIX
    from structgen.engine.request import Request
    from structgen.sampling import SamplingParams

    monkeypatch.setattr(attention, "CASCADE_MIN_KEYS", 64)
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, eos_token_id=[])
    g = torch.Generator().manual_seed(4)
    system = torch.randint(0, 512, (70,), generator=g).tolist()  # 4 whole pages
    turns = [system + torch.randint(0, 512, (int(n),), generator=g).tolist() for n in range(3, 12)]
    outputs, prefixes = {}, {}
    for cascade in (True, False):
        ec = EngineConfig(device=str(DEVICE), dtype="float32", max_batch_size=10, max_seq_len=256,
                          use_cuda_graphs=False,
                          tuning=EngineTuning(cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128),
                                              cascade_attention=cascade))
        eng = Engine(cfg, ec, model_dir=None, stop_token_ids=set())
        eng.runner.capture_decode_graphs(capture=CUDA)
        graphs, chose_cascade = eng.runner.graphs, []
        plain_or_cascade = graphs._forward_launch

        def launch_spy(bs: int, prefix: int, pick=plain_or_cascade, graphs=graphs, chose=chose_cascade):
            launch = pick(bs, prefix)
            chose.append(launch is graphs._cascades.get(bs))
            return launch

        monkeypatch.setattr(graphs, "_forward_launch", launch_spy)
        eng.run([Request(system + [1, 2], SamplingParams(max_tokens=1))])  # caches the system prompt
        reqs = [Request(t, SamplingParams(max_tokens=5)) for t in turns]
        for r in reqs:
            eng.add_request(r)
        eng.step()
        assert all(r.num_cached >= 64 for r in reqs)  # each ran only its tail
        seen = {int(eng.runner.graphs.host_meta[PREFIX, 0])}
        while not all(r.finished for r in reqs):
            eng.step()
            seen.add(int(eng.runner.graphs.host_meta[PREFIX, 0]))
        outputs[cascade], prefixes[cascade] = [r.output_ids for r in reqs], seen
        # Captured graphs: a step whose rows share the prefix replays the bucket's cascade
        # forward (eager steps have none: their kernels read PREFIX themselves).
        assert any(chose_cascade) == (cascade and CUDA)
    assert outputs[True] == outputs[False]
    assert prefixes[True] == {64} and prefixes[False] == {0}


# ----------------------------------------------------------------------------- batch invariance
# `kernels.use_batch_invariant`: a row's output does not depend on how many rows share its
# launch or what they hold, bit for bit. Under the interpreter one thing cannot be checked: its
# `tl.dot` is numpy's BLAS, whose result for a row depends on the row's place in the 16-row tile
# (tensor cores' does not). So on the CPU a row is compared with itself at the same place in a
# tile (other rows' contents and the row count changing around it), on CUDA with the row alone.


@pytest.fixture
def invariant(per_row_count_kernels: None) -> None:
    """The batch-invariant mode, for one test (`per_row_count_kernels` restores the mode after)."""
    from structgen.engine.kernels import use_batch_invariant

    use_batch_invariant(True)


def alone(x: torch.Tensor, i: int, tile_rows: int) -> torch.Tensor:
    """Row i of `x` run without the others: alone on CUDA; on the CPU at the same place in its
    tile of `tile_rows` rows, the rows before it replaced by other numbers (see above)."""
    if CUDA:
        return x[i : i + 1]
    other = torch.randn(i % tile_rows + 1, x.shape[1]).to(x.device, x.dtype)
    other[-1] = x[i]
    return other


# On CUDA every row count 1..64 and a verify step of 64 sequences (256 rows); the interpreter
# is slow, so there a few counts around the tile edges.
ROW_COUNTS = (*range(1, 65), 100, 256) if CUDA else (1, 3, 16, 17, 64, 65)


# The tilings of `gemv.INVARIANT_TILES` (the test checks the list is complete).
TILINGS = ("rows16", "rows64", "rows64-wide", "rows128", "rows16+64", "rows64+128")


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("n,k,bias", [(40, 96, True), (300, 256, False)])
def test_invariant_gemm_computes_each_row_as_it_would_alone(n, k, bias, tiling):
    """For each tiling: row i of an M-row product equals that row's product alone, for every
    row count the engine launches (one tile, several, past a second tile size), and the
    product is right."""
    import torch.nn.functional as F

    from structgen.engine.kernels.gemv import INVARIANT_TILES, invariant_block, invariant_gemm

    assert set(TILINGS) == set(INVARIANT_TILES)
    tiles = INVARIANT_TILES[tiling]
    if len(tiles.tiles) > 1 and not CUDA:
        pytest.skip("whether two MMA forms sum alike shows on CUDA only (the interpreter's dot is numpy's)")
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(DEVICE, LOW)
    b = torch.randn(n, generator=g).to(DEVICE, LOW) if bias else None
    x = torch.randn(max(ROW_COUNTS), k, generator=g).to(DEVICE, LOW)
    full = invariant_gemm(x, w, b, tiles)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert float((full.double() - ref).norm() / ref.norm()) < 1e-2
    singles = {}
    for m in ROW_COUNTS:
        rows = invariant_gemm(x[:m], w, b, tiles)
        tile_rows = invariant_block(w, m, tiles)[0]
        for i in range(m) if CUDA else sorted({0, m // 2, m - 1}):
            if (i, tile_rows) not in singles:
                singles[i, tile_rows] = invariant_gemm(alone(x, i, tile_rows), w, b, tiles)[-1]
            assert torch.equal(singles[i, tile_rows], rows[i]), (tiling, m, i)


def test_decode_attention_of_a_sequence_is_the_same_in_any_batch(invariant):
    """The split count no longer follows the batch size, and a sequence's attention output is
    the same bits in a batch of 1, 4 or 16 sequences, with and without a sliding window; the
    mode's larger shares of keys per split still compute the right attention."""
    from structgen.engine.kernels.decode_attention import (
        decode_attention,
        decode_attention_reference,
        num_splits_for,
    )

    assert len({num_splits_for(b, 8, 2048, DEVICE) for b in range(1, 65)}) == 1
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, max_len, slots_total = 8, 2, 64, 512, 17
    k = torch.randn(slots_total, max_len, kv_heads, dim, generator=g).to(DEVICE, LOW)
    v = torch.randn(slots_total, max_len, kv_heads, dim, generator=g).to(DEVICE, LOW)
    q = torch.randn(16, heads, dim, generator=g).to(DEVICE, LOW)
    slots = torch.randperm(slots_total, generator=g)[:16].to(DEVICE)
    lens = torch.randint(1, max_len + 1, (16,), generator=g).to(DEVICE)
    k, v, table = paged(k, v, 16, g)
    for window in (0, 100):
        full = decode_attention(q, k, v, table, slots, lens, window)
        assert rel_err(full, decode_attention_reference(q, k, v, table, slots, lens, window)) < 1e-2
        for b in (1, 4):
            part = decode_attention(q[:b], k, v, table, slots[:b], lens[:b], window)
            assert torch.equal(part, full[:b]), (window, b)
        for i in (0, 7, 15):
            one = decode_attention(q[i : i + 1], k, v, table, slots[i : i + 1], lens[i : i + 1], window)
            assert torch.equal(one[0], full[i]), (window, i)


def test_rms_norm_and_sampler_rows_do_not_depend_on_the_batch():
    """The per-row kernels (one program a row): the norm and the masked argmax."""
    from structgen.engine.kernels.fused import rms_norm
    from structgen.engine.kernels.sampling import sample_tokens

    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 576, generator=g).to(DEVICE, LOW)
    r = torch.randn(16, 576, generator=g).to(DEVICE, LOW)
    w = torch.randn(576, generator=g).to(DEVICE, LOW)
    out, res = rms_norm(x, w, 1e-5, r)
    logits = torch.randn(16, 5000, generator=g).to(DEVICE)
    words = (5000 + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (16, words), generator=g, dtype=torch.int32).to(DEVICE)
    flags, temps = torch.ones(16, dtype=torch.int32, device=DEVICE), torch.zeros(16, device=DEVICE)
    seeds = torch.zeros(16, dtype=torch.int64, device=DEVICE)
    tokens = sample_tokens(logits, bitmask, flags, temps, seeds)
    for i in (0, 5, 15):
        one, one_res = rms_norm(x[i : i + 1], w, 1e-5, r[i : i + 1])
        assert torch.equal(one[0], out[i]) and torch.equal(one_res[0], res[i])
        s = slice(i, i + 1)
        assert sample_tokens(logits[s], bitmask[s], flags[s], temps[s], seeds[s])[0] == tokens[i]


# Each family's own layers in the batch-invariant mode: Llama; Qwen3's q/k norms; Gemma 3's
# sandwich and q/k norms (unit offset), GeGLU, sliding window and soft-capped head; Phi-3's
# partial rotary table.
FAMILIES = {
    "llama": {},
    "qwen3": {"qk_norm": True, "attention_bias": True},
    "gemma3": {"architecture": "Gemma3ForCausalLM", "layer_types": ("sliding_attention", "full_attention"),
               "sliding_window": 4, "rope_local_theta": 10000.0, "query_pre_attn_scalar": 24.0,
               "final_logit_softcapping": 30.0, "hidden_act": "gelu_pytorch_tanh"},
    "phi3": {"architecture": "Phi3ForCausalLM", "partial_rotary_factor": 0.75},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_verify_steps_rows_get_the_logits_of_one_row_decode_steps(invariant, family):
    """The whole model in the batch-invariant mode: a token's logits are the same bits whether
    it runs as a one-row decode step or as a row of a four-row step (a verify step's draft
    rows, or jump-forward's forced rows), and the fused norm projections are off."""
    from structgen.engine.attention import AttentionBatch
    from structgen.engine.config import ModelConfig
    from structgen.engine.kv_cache import PAGE_SIZE, KVCache
    from structgen.engine.models.llama import skip_init
    from structgen.engine.models.registry import model_class
    from structgen.engine.page_table import PageTable

    cfg = ModelConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, **FAMILIES[family])
    with skip_init(LOW):
        model = model_class(cfg)(cfg, 64).to(DEVICE)
    model.init_random_weights(std=0.05)
    model.use_fused_kernels(True)
    assert all(getattr(layer, "fused_rows", 0) == 0 for layer in model.layers)
    pages = PageTable(2 * 64 // PAGE_SIZE + 1, PAGE_SIZE, 2, 64, DEVICE)
    assert pages.cover(1, 16)
    kv = KVCache(cfg, pages, dtype=LOW, device=DEVICE)

    def rows(start: int, ids: list[int]) -> torch.Tensor:
        """The logits of `ids` run as one-token rows at positions start.. of slot 1."""
        batch = AttentionBatch.build([(1, start + j, 1) for j in range(len(ids))], pages, decode_kernel=True)
        return model.logits(model(torch.tensor(ids, device=DEVICE), batch, kv))

    draft = [7, 31, 2, 250]
    with torch.inference_mode():
        rows(0, [5, 17, 42, 8, 99])  # the prompt
        verify = rows(5, draft)  # the pending token and three drafts
        steps = [rows(5 + j, [t])[0] for j, t in enumerate(draft)]  # decoded one at a time
    assert torch.equal(verify[0], steps[0])
    # The later rows sit at other places in their tile than a one-row step's row: checked
    # bit for bit on CUDA only (the module docstring).
    for j in range(1, len(draft)):
        assert torch.equal(verify[j], steps[j]) if CUDA else float((verify[j] - steps[j]).abs().max()) < 1e-2
