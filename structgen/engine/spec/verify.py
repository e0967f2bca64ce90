"""Acceptance rules: which draft tokens the target keeps, given its (already grammar-masked)
logits at every draft position. Pure functions of tensors, so they are tested on their own.

A request with draft d_1..d_m has m + 1 target rows: row j is the target's next-token
distribution after d_1..d_j. Both rules emit the accepted prefix d_1..d_a plus one token of
the target's own (the correction at the first rejection, or the bonus token after a fully
accepted draft), so every verify step produces between 1 and m + 1 tokens.
"""

from __future__ import annotations

import torch

from structgen.engine.sampler import SamplingParams, filter_top_k_top_p


def accept_greedy(target_tokens: list[int], draft: list[int]) -> list[int]:
    """Exact-match acceptance for greedy requests: keep drafts while they equal the target's
    argmax. `target_tokens` holds the argmax of each of the m + 1 rows. The result is exactly
    what greedy decoding without speculation emits."""
    out: list[int] = []
    for j, d in enumerate(draft):
        out.append(target_tokens[j])
        if target_tokens[j] != d:
            return out
    out.append(target_tokens[len(draft)])
    return out


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the non-speculative sampler draws from, for every row of `logits`
    [rows, V]: temperature, then top-k / top-p, then softmax (the mask is already applied)."""
    rows = [filter_top_k_top_p(row / params.temperature, params.top_k, params.top_p) for row in logits]
    return torch.softmax(torch.stack(rows).float(), dim=-1)


def accept_sampled(probs: torch.Tensor, draft: list[int], generator: torch.Generator | None) -> list[int]:
    """Rejection sampling with a point-mass draft, which keeps the target distribution exactly.

    Draft d is accepted with probability p(d); on rejection the token is drawn from p with d
    removed and renormalised. Then P(emit x) = p(x) for every x: for x = d it is p(d), for
    x != d it is (1 - p(d)) * p(x) / (1 - p(d)). Each position's row is conditioned on the
    accepted prefix, so the whole emitted sequence has the target's distribution. This holds for
    any drafter whose proposal does not depend on the target's random draws (an n-gram lookup,
    a draft model's argmax, a user's guess), because it holds for every fixed d.

    `probs` [m + 1, V] from `target_probs`; one uniform draw per draft token, one categorical
    draw at the end, all from the request's generator.
    """
    m = len(draft)
    if m:
        d = torch.tensor(draft, device=probs.device)
        p_draft = probs[torch.arange(m, device=probs.device), d]
        u = torch.rand(m, device=probs.device, generator=generator)
        rejected = (u >= p_draft).tolist()
        a = rejected.index(True) if True in rejected else m
    else:
        a = 0
    row = probs[a]
    if a < m:
        residual = row.clone()
        residual[draft[a]] = 0.0
        if residual.sum() > 0:  # p(d) == 1 can only be "rejected" by rounding: keep d then
            row = residual
    tok = int(torch.multinomial(row, 1, generator=generator)[0])
    return draft[:a] + [tok]
