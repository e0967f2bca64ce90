"""The acceptance rule: which draft tokens the target keeps.

A request with draft d_1..d_m is verified at m + 1 positions: position j is the next token
after the pending tokens and d_1..d_j. The target *samples* one token t_j at every position,
each from its own masked (and temperature / top-k / top-p filtered) distribution p_j, the way
the non-speculative sampler would; the drafts are kept while t_j == d_{j+1}, and the first t_j
that differs (or t_m after a fully accepted draft: the bonus token) is emitted too:

    emitted = d_1..d_a, t_a        a = the first j with t_j != d_{j+1} (or m)

For greedy requests t_j is the masked argmax, so this is exact-match acceptance and the
output is token for token what greedy decoding without speculation emits.

For sampled requests it is rejection sampling with a point-mass draft distribution, carried
out with one draw per position: the draft d is accepted with probability P(t = d) = p(d), and
when it is rejected the emitted token is t conditioned on t != d, i.e. drawn from p with d
removed and renormalised. So every emitted token is distributed exactly as p_j given the
accepted prefix: the output has the target's distribution for *any* drafter whose proposals do
not depend on the target's random draws (n-gram lookup, a draft model's argmax, a user's
guess). Because the draws use the engine's per-(seed, position) noise, a seeded request even
samples the same tokens with and without speculation.
"""

from __future__ import annotations


def accept_draft(target_tokens: list[int], draft: list[int]) -> list[int]:
    """The emitted tokens: the accepted draft prefix plus the target's own next token.
    `target_tokens` holds the target's token at each of the len(draft) + 1 positions."""
    out: list[int] = []
    for j, d in enumerate(draft):
        out.append(target_tokens[j])
        if target_tokens[j] != d:
            return out
    out.append(target_tokens[len(draft)])
    return out
