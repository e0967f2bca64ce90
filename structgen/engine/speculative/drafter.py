"""The `Drafter` protocol: anything that guesses a request's next tokens.

A drafter only proposes; the `Speculator` decides what the target model keeps. Proposals are
treated as point masses (the drafter's own probabilities are never asked for), which keeps
verification exact for *any* drafter, deterministic or not: a proposal `d` is accepted with
probability p_target(d), and on rejection the target samples from its distribution with `d`
removed. So a user's drafter can be any object with a `propose` method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from structgen.engine.request import Request


@runtime_checkable
class Drafter(Protocol):
    """Proposes up to `k` next tokens for a request.

    Required: `propose`. Optional (the speculator calls them when present):
    - `propose_batch(reqs, ks) -> list[list[int]]`: draft for many requests at once (a draft
      model runs one batched forward per draft position instead of one per request);
    - `candidates(req, k) -> Iterable[list[int]]`: alternative drafts, best first (a generator is
      fine: it is read only until a draft the grammar takes whole), from
      which grammar-aware drafting keeps the one the grammar allows furthest;
    - `on_verified(req, num_drafted, num_accepted)`: the target's verdict on the last draft;
    - `release(req)`: the request finished; drop any state kept for it;
    - `use_tokenizer(tokenizer)`: called once by `LLM` with the model's tokenizer.
    - `host_only = True`: proposing makes no GPU calls, so the speculator may draft the next
      step while the device waits and launch its verify forward at once (speculator.py
      `_plan_next`); a drafter that runs forwards of its own must not say so.
    """

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to `k` guessed token ids following `req.token_ids` (may be empty)."""
        ...


def propose_all(drafter: Drafter, reqs: list[Request], ks: list[int]) -> list[list[int]]:
    """Drafts for every request, batched when the drafter can batch."""
    batch = getattr(drafter, "propose_batch", None)
    if batch is not None:
        return [list(d) for d in batch(reqs, ks)]
    return [list(drafter.propose(r, k))[:k] if k > 0 else [] for r, k in zip(reqs, ks, strict=True)]


def notify_verified(drafter: Drafter, req: Request, num_drafted: int, num_accepted: int) -> None:
    hook = getattr(drafter, "on_verified", None)
    if hook is not None:
        hook(req, num_drafted, num_accepted)


def release(drafter: Drafter, req: Request) -> None:
    hook = getattr(drafter, "release", None)
    if hook is not None:
        hook(req)
