"""The torch definition of the fused mask op (`kernels/mask_apply.py`) against independent
references: xgrammar's own CPU `apply_token_bitmask_inplace` for the plain mask, and a
per-token Python loop for flags, d2t, temperature and argmax. Fresh random inputs (never
zeros); these pin down the meaning the CUDA and Triton kernels are compared to on the GPU
(tests/engine/test_csrc.py)."""

from __future__ import annotations

import math

import pytest
import torch

from structgen.engine.kernels.mask_apply import apply_token_bitmask, apply_token_bitmask_reference


def random_case(rows: int, vocab: int, seed: int, words: int | None = None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    words = words if words is not None else (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    return g, logits, bitmask


def loop_reference(logits, bitmask, flags=None, d2t=None, temperature=None):
    """Token by token, in float64 Python: (written values [rows][V], argmax target ids [rows])."""
    rows, vocab = logits.shape
    words = bitmask.shape[1]
    x, bm = logits.double().tolist(), bitmask.tolist()
    values, best = [], []
    for r in range(rows):
        row, arg, top = [], 0, -math.inf
        for j in range(vocab):
            t = int(d2t[j]) if d2t is not None else j
            ok = 0 <= t < words * 32 and (bm[r][t // 32] >> (t % 32)) & 1
            if flags is not None and not flags[r]:
                ok = True
            v = x[r][j] if ok else -math.inf
            if v > top:  # the argmax is taken before the temperature divide
                top, arg = v, j
            if temperature is not None and temperature[r] > 0:
                v = v / float(temperature[r])
            row.append(v)
        values.append(row)
        best.append(int(d2t[arg]) if d2t is not None else arg)
    return torch.tensor(values, dtype=torch.float64), best


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 4096), (5, 1000), (3, 49152)])
def test_mask_matches_xgrammar_cpu(rows, vocab, dtype):
    xgr = pytest.importorskip("xgrammar")
    _, logits, bitmask = random_case(rows, vocab, seed=rows * 7 + vocab, dtype=dtype)
    ours, theirs = logits.clone(), logits.clone()
    assert apply_token_bitmask(ours, bitmask, backend="torch") is None
    if dtype == torch.float32:  # xgrammar's CPU kernel takes float32 only
        xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, backend="cpu")
    else:
        t32 = theirs.float()
        xgr.apply_token_bitmask_inplace(t32, bitmask, vocab_size=vocab, backend="cpu")
        theirs = t32.to(dtype)
    assert torch.equal(ours, theirs)
    masked = torch.isinf(ours)
    assert 0.3 < masked.float().mean() < 0.7  # random words: about half the tokens masked
    assert torch.equal(ours[~masked], logits[~masked])


@pytest.mark.parametrize("flag_dtype", [torch.int32, torch.bool])
def test_flags_d2t_temperature_argmax_match_loop(flag_dtype):
    g, logits, bitmask = random_case(4, 300, seed=3, words=12)  # mask covers 384 target ids
    flags = torch.tensor([1, 0, 1, 1]).to(flag_dtype)
    d2t = torch.randperm(400, generator=g)[:300]  # some ids past the mask: never allowed
    temperature = torch.tensor([0.5, 2.0, 0.0, 1.7])
    want_values, want_best = loop_reference(logits, bitmask, flags.tolist(), d2t.tolist(), temperature.tolist())
    x = logits.clone()
    got = apply_token_bitmask(x, bitmask, row_flags=flags, d2t=d2t, temperature=temperature,
                              argmax=True, backend="torch")
    assert got.tolist() == want_best
    torch.testing.assert_close(x.double(), want_values.float().double(), rtol=0, atol=0)
    assert not torch.isinf(x[1]).any()  # the unflagged row kept every token
    assert torch.isinf(x[0][d2t >= 384]).all()


def test_write_false_leaves_logits_and_ties_go_low():
    _, logits, bitmask = random_case(2, 200, seed=5)
    bitmask.fill_(-1)
    logits[0, 17] = logits[0, 150] = 100.0  # a tie: the lower index wins, like torch.argmax
    logits[1, 3] = float("nan")  # NaN never wins
    logits[1, 60] = 50.0
    before = logits.clone()
    out = torch.full((2,), -7, dtype=torch.int64)
    res = apply_token_bitmask(logits, bitmask, out=out, write=False, backend="torch")
    assert res is out and out.tolist() == [17, 60]
    assert torch.equal(logits.nan_to_num(1.0), before.nan_to_num(1.0))


def test_fully_masked_row_and_short_mask():
    _, logits, bitmask = random_case(2, 100, seed=9, words=2)  # mask covers 64 of 100 tokens
    bitmask[0] = 0
    bitmask[1] = -1
    best = apply_token_bitmask(logits, bitmask, argmax=True, backend="torch")
    assert torch.isinf(logits[0]).all() and best[0] == 0  # torch.argmax's answer on all -inf
    assert torch.isinf(logits[1, 64:]).all() and not torch.isinf(logits[1, :64]).any()
    assert 0 <= best[1] < 64


def test_reference_is_the_op():
    _, logits, bitmask = random_case(3, 64, seed=1)
    a, b = logits.clone(), logits.clone()
    apply_token_bitmask(a, bitmask, backend="torch")
    apply_token_bitmask_reference(b, bitmask)
    assert torch.equal(a, b)


def test_bad_arguments_say_what_to_change():
    _, logits, bitmask = random_case(2, 64, seed=2)
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask(logits, bitmask.long())
    with pytest.raises(ValueError, match="temperature"):
        apply_token_bitmask(logits, bitmask, temperature=torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="unit stride"):
        apply_token_bitmask(logits.t(), bitmask)
    with pytest.raises(ValueError, match="unknown backend"):
        apply_token_bitmask(logits, bitmask, backend="nope")
