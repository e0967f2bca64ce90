"""Masked sampling: grammar bitmask, then greedy or temperature / top-k / top-p.

Temperature sampling is Gumbel-max (`argmax(logits / T + G)`), with each row's noise keyed by
a seed derived from (request seed, token position): a seeded request samples the same tokens
whatever it is batched with and whether its step ran eagerly or as a CUDA graph. On CUDA the
draw is the fused Triton kernel `kernels/sampling.py` (the graph uses the same kernel); on
the CPU it is `sample_tokens_reference`, the same rule written in torch."""

from __future__ import annotations

import torch

from structgen.sampling import SamplingParams


def mask_padding_(logits: torch.Tensor, text_vocab_size: int) -> torch.Tensor:
    """Rule out the logits past the tokenizer's last id (a padded LM head): no token has
    them, so even free text must never sample one. In place; returns `logits`."""
    if text_vocab_size < logits.shape[-1]:
        logits[..., text_vocab_size:] = float("-inf")
    return logits


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack an int32 [rows, ceil(V/32)] bitmask (bit set = allowed) to bool [rows, V]."""
    shifts = _BIT_SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set disallowed logits to -inf in place. `logits` [rows, V], `bitmask` [rows, W]."""
    allowed = bitmask_to_bool(bitmask, logits.shape[-1])
    return logits.masked_fill_(~allowed, float("-inf"))


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row's logits [V] with everything outside top-k / the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token that crosses p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


_MASK64 = (1 << 64) - 1


def step_seed(seed: int, position: int) -> int:
    """A well-mixed 63-bit seed for the noise of token `position` of a request seeded `seed`
    (splitmix64 finaliser), so neighbouring positions and seeds draw unrelated noise."""
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def sample_tokens_reference(
    logits: torch.Tensor, bitmask: torch.Tensor | None, has_mask: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """The torch definition of `kernels.sampling.sample_tokens` (same arguments): greedy rows
    are exact; temperature rows draw their uniforms from torch's CPU generator instead of
    Philox, so they follow the same distribution but not the same stream."""
    x = logits.float().clone()
    if bitmask is not None and bool(has_mask.any()):
        rows = has_mask.nonzero().flatten()
        x[rows] = apply_bitmask_(x[rows], bitmask[rows].to(x.device))
    temps, row_seeds = temperature.tolist(), seeds.tolist()
    for i, t in enumerate(temps):
        if t > 0:
            u = torch.rand(x.shape[1], generator=torch.Generator().manual_seed(row_seeds[i]))
            x[i] = x[i] / t - torch.log(-torch.log(u.to(x.device)))
    return torch.argmax(x, dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]) -> torch.Tensor:
    """Pick one token per row of already-masked `logits` [rows, V] -> [rows] (long).
    `seeds`: each row's noise seed (ignored for greedy rows); see `step_seed`."""
    if all(p.greedy for p in params):
        return torch.argmax(logits, dim=-1)
    cut = [i for i, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1.0)]
    if cut:
        logits = logits.clone()  # a normal tensor: the forward's output may be an inference tensor
        for i in cut:
            logits[i] = filter_top_k_top_p(logits[i], params[i].top_k, params[i].top_p)
    dev = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    seed_t = torch.tensor(seeds, dtype=torch.int64, device=dev)
    no_mask = torch.zeros(len(params), dtype=torch.int32, device=dev)
    from structgen.engine.kernels import triton_enabled

    if triton_enabled(dev):
        from structgen.engine.kernels.sampling import sample_tokens

        dummy = torch.zeros(1, 1, dtype=torch.int32, device=dev)  # never read: no row has a mask
        return sample_tokens(logits.contiguous(), dummy, no_mask, temperature, seed_t)
    return sample_tokens_reference(logits, None, no_mask, temperature, seed_t)
