"""`Completion`: one finished generation, the same shape from the local engine (`LLM`) and
from a server (`LLM.remote`), so it lives below both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic

from typing_extensions import TypeVar

if TYPE_CHECKING:
    from structgen.engine.request import GenerationStats  # noqa: F401  (the default of Stats)

T = TypeVar("T")
# The stats' type: the engine's `GenerationStats` in process, `RemoteStats` (None where the
# server does not say) from `LLM.remote`; a default, so `Completion[Invoice]` is the local one.
Stats = TypeVar("Stats", default="GenerationStats")


@dataclass
class Completion(Generic[T, Stats]):
    """One finished generation: the typed, validated `value` and how it was made."""

    value: T
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", or "length" for free text cut off by max_tokens
    stats: Stats
    relaxed: tuple[str, ...] = ()  # strict=False: schema keywords left out of the grammar
    # What a reasoning model wrote in its think section, apart from the answer (`text`,
    # `token_ids`); None where the request did not reason.
    reasoning: str | None = None


class ReasoningDelta(str):
    """A streamed piece of a reasoning model's think section: `stream` and `astream` yield
    these before the answer's text deltas (plain `str`), so `isinstance(delta,
    ReasoningDelta)` tells them apart."""

    __slots__ = ()
