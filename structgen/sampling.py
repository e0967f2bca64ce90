"""What a request asks of decoding: `SamplingParams`, checked when built so that a bad value is
the caller's `InvalidParameterError` naming the field, never an engine failure."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from structgen.errors import InvalidParameterError


@dataclass
class SamplingParams:
    """Per-request decoding parameters. `temperature=0` is greedy (the default: structured
    outputs are usually wanted deterministic)."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    jump_forward: bool | None = None  # None: the engine's default
    # A constrained output nearing max_tokens is closed (strings end, arrays and objects
    # close) so it ends whole; engine/closing.py.
    close_at_budget: bool = True
    # A constrained output that keeps repeating one pattern (digits, a phrase, an array item)
    # is closed early, and unbounded integers in JSON schemas get a sane digit count.
    loop_guards: bool = True
    # Reasoning models (engine/reasoning.py): think freely between <think> and </think>, then
    # the grammar applies. None: on where the chat template has think tags.
    reasoning: bool | None = None
    # The most think tokens (None: half of max_tokens); the answer's shortest completion is
    # kept out of it, so the answer still ends whole.
    max_reasoning_tokens: int | None = None
    # Where a validator rejects a field of the finished output, roll back to that field and
    # decode it again, at most this many times per field (structgen/repair.py); 0: never.
    repair: int = 0

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, 1, None)
        check_number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        check_number("top_p", self.top_p, 0.0, 1.0, open_low=True)
        check_int("top_k", self.top_k, 0, None)
        check_int("repair", self.repair, 0, None)
        if self.seed is not None:
            check_int("seed", self.seed, 0, MAX_SEED)
        if self.jump_forward is not None and not isinstance(self.jump_forward, bool):
            raise InvalidParameterError(
                f"jump_forward must be True, False or None, got {self.jump_forward!r}"
            )
        for name in ("close_at_budget", "loop_guards"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self._check_reasoning()

    def _check_reasoning(self) -> None:
        if self.reasoning is not None and not isinstance(self.reasoning, bool):
            raise InvalidParameterError(
                f"reasoning must be True, False or None (None: on where the chat template has think "
                f"tags), got {self.reasoning!r}"
            )
        if self.max_reasoning_tokens is None:
            return
        if isinstance(self.max_reasoning_tokens, bool) or not isinstance(self.max_reasoning_tokens, numbers.Integral) \
                or self.max_reasoning_tokens < 0:
            raise InvalidParameterError(
                f"max_reasoning_tokens must be an integer >= 0 (0: answer without thinking), got "
                f"{self.max_reasoning_tokens!r}; or leave it None for half of max_tokens"
            )
        if self.reasoning is False:
            raise InvalidParameterError(
                "max_reasoning_tokens bounds the think section, which reasoning=False turns off; "
                "pass reasoning=True (or None) or leave max_reasoning_tokens out"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_SEED = 2**63 - 1  # seeds are int64 on the device
# Past a few units the draw is already all but uniform over the tokens the grammar allows;
# far past it (1e39 overflows float32) the scaled logits become NaN and sampling breaks.
MAX_TEMPERATURE = 100.0


def check_int(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidParameterError(f"{name} must be an integer, got {value!r}")
    number = int(value)
    if number < low or (high is not None and number > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise InvalidParameterError(f"{name} must be {bound}, got {value}")


def check_number(name: str, value: object, low: float, high: float | None, open_low: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise InvalidParameterError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if number < low or (open_low and number == low) or (high is not None and number > high):
        lower = f"> {low}" if open_low else f">= {low}"
        bound = f"{lower} and <= {high}" if high is not None else lower
        raise InvalidParameterError(f"{name} must be {bound}, got {value}")
