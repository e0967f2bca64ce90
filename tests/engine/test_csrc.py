"""The CUDA extension (`csrc/`): the fused mask kernel against the torch definition and the
Triton path (and xgrammar's kernels where installed), inside CUDA graphs too; host callbacks
eagerly and captured; the deadlock-free rules; and a 10,000-replay stress run in a child
process with a timeout, so a hang fails the test instead of hanging the suite.

GPU tests: skipped without CUDA. On a CUDA machine a failed build is a failure, not a skip.
Inputs are fresh random data; outputs are poisoned before each run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = "cuda"


@pytest.fixture(scope="module")
def ext():
    from structgen.engine.kernels import csrc_ext

    return csrc_ext.load()  # builds on first use; raises (fails) if it cannot


def case(rows, vocab, dtype, seed, words=None):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(DEV, dtype)
    words = words if words is not None else (vocab + 31) // 32
    bm = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    return g, logits, bm.to(DEV)


def run_all(logits, bm, **kw):
    """Each backend on its own copy: {backend: (logits after, argmax or None)}."""
    from structgen.engine.kernels.mask_apply import apply_token_bitmask

    res = {}
    for backend in ("torch", "triton", "cuda"):
        x = logits.clone()
        out = torch.full((logits.shape[0],), -5, dtype=torch.int64, device=DEV) if kw.get("argmax") else None
        args = {k: v for k, v in kw.items() if k != "argmax"}
        got = apply_token_bitmask(x, bm, out=out, backend=backend, **args)
        res[backend] = (x, got)
    torch.cuda.synchronize()
    return res


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
# (300, 49155): unaligned rows, scalar path; (512, 151936): four vectors per thread.
@pytest.mark.parametrize("rows,vocab", [(1, 151936), (7, 49152), (64, 128256), (3, 1003), (300, 49155), (512, 151936)])
def test_mask_kernel_matches_torch_and_triton(ext, rows, vocab, dtype):
    _, logits, bm = case(rows, vocab, dtype, seed=rows + vocab)
    res = run_all(logits, bm)
    ref = res["torch"][0]
    assert torch.isinf(ref).float().mean().item() > 0.3
    for backend in ("triton", "cuda"):
        assert torch.equal(res[backend][0], ref), backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flag_dtype", [torch.int32, torch.bool])
@pytest.mark.parametrize("rows,vocab", [(1, 32000), (9, 49152), (33, 1003), (200, 49152)])
def test_fused_flags_d2t_temperature_argmax(ext, rows, vocab, dtype, flag_dtype):
    g, logits, bm = case(rows, vocab, dtype, seed=3 * rows + vocab, words=(vocab + 31) // 32 + 8)
    flags = (torch.rand(rows, generator=g) < 0.7).to(flag_dtype).to(DEV)
    d2t = torch.randperm(vocab + 300, generator=g)[:vocab].to(DEV)  # some ids past the mask
    temperature = torch.rand(rows, generator=g) * 2
    temperature[0] = 0.0  # a greedy row: no division
    temperature = temperature.to(DEV)
    for use_d2t in (False, True):
        kw = dict(row_flags=flags, temperature=temperature, argmax=True)
        if use_d2t:
            kw["d2t"] = d2t.int() if dtype == torch.float32 else d2t
        res = run_all(logits, bm, **kw)
        ref_x, ref_best = res["torch"]
        for backend in ("triton", "cuda"):
            x, best = res[backend]
            assert torch.equal(best, ref_best), (backend, use_d2t)
            assert torch.equal(x, ref_x), (backend, use_d2t)


def test_argmax_only_reads(ext):
    from structgen.engine.kernels.mask_apply import (
        apply_token_bitmask,
        apply_token_bitmask_reference,
    )

    _, logits, bm = case(16, 128256, torch.bfloat16, seed=11)
    before = logits.clone()
    best = apply_token_bitmask(logits, bm, argmax=True, write=False, backend="cuda")
    want = apply_token_bitmask_reference(logits.clone(), bm, argmax=True)
    assert torch.equal(logits, before) and torch.equal(best, want)


def test_matches_xgrammar_kernels(ext):
    xgr = pytest.importorskip("xgrammar")
    from structgen.engine.kernels.mask_apply import apply_token_bitmask

    _, logits, bm = case(8, 128256, torch.float32, seed=21)
    ours = logits.clone()
    apply_token_bitmask(ours, bm, backend="cuda")
    for backend in ("cuda", "triton"):
        theirs = logits.clone()
        xgr.apply_token_bitmask_inplace(theirs, bm, vocab_size=128256, backend=backend)
        assert torch.equal(ours, theirs), backend


def test_mask_kernel_in_a_graph_replays_with_new_data(ext):
    from structgen.engine.kernels.mask_apply import (
        apply_token_bitmask,
        apply_token_bitmask_reference,
    )

    rows, vocab = 4, 49152
    _, logits, bm = case(rows, vocab, torch.bfloat16, seed=1)
    temp = torch.tensor([0.0, 0.7, 1.0, 2.5], device=DEV)
    flags = torch.tensor([1, 1, 0, 1], dtype=torch.int32, device=DEV)
    out = torch.full((rows,), -1, dtype=torch.int64, device=DEV)
    kw = dict(row_flags=flags, temperature=temp, out=out, backend="cuda")
    apply_token_bitmask(logits.clone(), bm, **kw)  # warm-up allocates the workspace
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        apply_token_bitmask(logits, bm, **kw)
    for seed in range(2, 6):  # new inputs into the same buffers, then replay
        _, fresh, fresh_bm = case(rows, vocab, torch.bfloat16, seed=seed)
        logits.copy_(fresh)
        bm.copy_(fresh_bm)
        out.fill_(-1)
        g.replay()
        want_x = fresh.clone()
        want = apply_token_bitmask_reference(want_x, fresh_bm, row_flags=flags, temperature=temp, argmax=True)
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(logits, want_x)


# ----------------------------------------------------------------------------- host callbacks


def test_eager_callback_runs_once_off_the_main_thread_and_frees_its_block(ext):
    from structgen.engine.kernels import hostfunc as hf

    seen = []
    payload = object()
    base = sys.getrefcount(payload)

    @hf.hostfunc
    def record(tag, obj):
        seen.append((tag, obj is payload, threading.current_thread() is threading.main_thread(), hf.in_callback()))

    captured_before = ext.captured_count()
    torch.cuda._sleep(1_000_000)  # the callback must wait for GPU work ahead of it
    assert record.launch("a", payload) == 0
    hf.synchronize()
    assert seen == [("a", True, False, True)]
    assert ext.captured_count() == captured_before
    assert sys.getrefcount(payload) == base  # the argument block let go of its references
    assert not hf.in_callback()


def test_callback_error_is_raised_on_the_main_thread(ext):
    from structgen.engine.kernels import hostfunc as hf

    @hf.hostfunc
    def boom(x):
        raise ValueError(f"bad {x}")

    boom.launch(3)
    with pytest.raises(hf.HostCallbackError, match="bad 3") as info:
        hf.synchronize()
    assert isinstance(info.value.__cause__, ValueError)
    hf.synchronize()  # reported once


def test_captured_callbacks_replay_in_order_with_snapshots(ext):
    """Rule 3: the host runs ahead (no sync between replays) and mutates live state; each
    callback still sees its own iteration's snapshot, in order, and the GPU work between
    callbacks stays ordered with them."""
    from structgen.engine.kernels import hostfunc as hf

    snaps: hf.SnapshotQueue[tuple[int, int]] = hf.SnapshotQueue()
    seen: list[tuple[int, int]] = []

    @hf.hostfunc
    def step():
        seen.append(snaps.pop())

    counter = torch.zeros(1, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    live = {"step": -1, "tokens": 0}
    before = ext.captured_count()
    with torch.cuda.graph(g, stream=s):
        counter.add_(1)
        block = step.launch(stream=s)
    assert block != 0 and ext.captured_count() == before + 1
    for i in range(200):
        live["step"], live["tokens"] = i, live["tokens"] + i  # the live state moves on
        snaps.push((live["step"], live["tokens"]))
        hf.replay(g)
    hf.synchronize()
    assert seen == [(i, i * (i + 1) // 2) for i in range(200)]
    assert counter.item() == 200 and len(snaps) == 0
    del g
    assert hf.release(block) and ext.captured_count() == before
    assert not hf.release(block)


STRESS = """
import sys, threading, time
sys.path.insert(0, {root!r})
import torch
from structgen.engine.kernels import hostfunc as hf
from structgen.engine.kernels.mask_apply import apply_token_bitmask

N = 10_000
snaps = hf.SnapshotQueue()
seen = []

@hf.hostfunc
def advance():
    i, words = snaps.pop()
    seen.append(i)
    sum(words)  # some CPU work under the GIL, like a matcher advance

x = torch.randn(2, 49152, device="cuda", dtype=torch.bfloat16)
bm = torch.randint(-2**31, 2**31 - 1, (2, 1536), dtype=torch.int32, device="cuda")
out = torch.empty(2, dtype=torch.int64, device="cuda")
apply_token_bitmask(x, bm, out=out, write=False)
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    apply_token_bitmask(x, bm, out=out, write=False)
    advance.launch(stream=s)
    x.mul_(1.0)

stop = False
def busy():  # concurrent Python work on another thread, contending for the GIL
    n = 0
    while not stop:
        n += sum(range(500))
        time.sleep(0)
t = threading.Thread(target=busy); t.start()
t0 = time.perf_counter()
acc = 0
for i in range(N):
    snaps.push((i, list(range(20))))
    hf.replay(g)
    acc += sum(range(300))  # main-thread Python work between launches
    if i % 1000 == 999:
        hf.synchronize()
hf.synchronize()
stop = True; t.join()
assert seen == list(range(N)), (len(seen), seen[:5])
print("STRESS_OK", N, round(time.perf_counter() - t0, 2), hf.stats())
"""


def test_stress_10000_replays_with_callbacks_does_not_hang(ext):
    root = str(Path(__file__).resolve().parents[2])
    try:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(STRESS.format(root=root))],
                              capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"stress run hung (> 240 s): {exc.stdout!r} {exc.stderr!r}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STRESS_OK 10000" in proc.stdout, proc.stdout
    print(proc.stdout.strip())


# ----------------------------------------------------------------------------- token gate


def _counting_graph():
    x = torch.zeros(1, dtype=torch.int64, device=DEV)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        x.add_(1)
    graph.instantiate()
    torch.cuda.synchronize()
    x.zero_()
    return x, graph


def test_token_gate_runs_its_body_on_the_devices_verdict(ext):
    """The body runs iff the sampled row (its index read on the device) has a mask and its
    token is quiet, and, where the check names a row (a draft ran after it), that row sampled
    the check's token; the host's `went` says the same; `wide` counts a mask's allowed tokens."""
    import numpy as np

    from structgen.engine.kernels.gated_graph import TokenGate

    x, graph = _counting_graph()
    words = 64
    row = torch.full((1,), 2, dtype=torch.int64, device=DEV)  # the sampled row: the third
    tokens = torch.zeros(4, dtype=torch.int64, device=DEV)
    has_masks = torch.zeros(4, dtype=torch.int64, device=DEV)
    quiet = np.zeros(words, dtype=np.uint32)
    quiet[1] = 0xFFFF  # tokens 32..47 are quiet
    check = torch.tensor([-1, 0], dtype=torch.int64, device=DEV)
    gate = TokenGate(graph, row, tokens, has_masks, quiet, min_allowed=100, check=check)
    ran = []
    # (sampled token, has mask, draft check: row 1 must have sampled token 9)
    for tok, flag, drafted in [(40, 1, False), (50, 1, False), (40, 0, False), (3000, 1, False), (-1, 1, False),
                               (33, 1, False), (40, 1, True), (40, 1, "picked")]:
        tokens.fill_(7)
        tokens[2] = tok
        has_masks.fill_(1 - flag)  # the other rows say the opposite: only row 2 counts
        has_masks[2] = flag
        check[0] = 1 if drafted else -1
        check[1] = 9
        if drafted == "picked":
            tokens[1] = 9
        before = int(x.item())
        gate.launch()
        torch.cuda.synchronize()
        went = int(x.item()) - before == 1
        assert (gate.went(tok) and flag == 1 and drafted in (False, "picked")) == went, (tok, flag, drafted)
        ran.append(went)
    assert ran == [True, False, False, False, False, True, False, True]
    bits = np.zeros(words * 32, dtype=np.uint8)
    bits[:99] = 1
    assert not gate.wide(np.packbits(bits, bitorder="little").view(np.uint32))
    bits[:100] = 1
    assert gate.wide(np.packbits(bits, bitorder="little").view(np.uint32))
