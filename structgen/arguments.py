"""What a caller passes to a generation method, checked before any model work: the prompt
(text or chat messages) and the keyword arguments. Mistakes raise `InvalidParameterError`
naming what to pass instead."""

from __future__ import annotations

import difflib
import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

from structgen.errors import InvalidParameterError, PromptTooLongError
from structgen.sampling import SamplingParams

F = TypeVar("F", bound=Callable[..., Any])

ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# Keyword arguments other libraries use, and what to pass here instead.
_KEYWORD_HINTS = {
    "max_new_tokens": "max_tokens",
    "max_length": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "num_predict": "max_tokens",
    "n_predict": "max_tokens",
    "do_sample": "temperature (> 0 samples, 0 is greedy)",
    "random_seed": "seed",
    "random_state": "seed",
    "response_format": "the output type as the first argument",
    "schema": "the output type (a type, or a JSON-schema dict) as the first argument",
    "output_type": "the output type as the first positional argument",
    "messages": "the messages as the prompt (second positional argument)",
    "stream": "llm.stream(...) or llm.astream(...) for text deltas",
}


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of every generation method (`LLM.generate`, `complete`, ...).

    max_tokens: most tokens to generate (default 512).
    temperature: 0 is greedy (the default); higher samples more freely.
    top_p: nucleus sampling mass, 0 < top_p <= 1.
    top_k: sample among the k most likely tokens (0: no cut).
    seed: reproducible sampling, 0 .. 2**63-1.
    jump_forward: append text the grammar forces without sampling it (None: engine default).
    close_at_budget: a constrained output nearing max_tokens is closed so it ends whole.
    loop_guards: a constrained output that keeps repeating one pattern is closed early.
    reasoning: think between <think> tags first, then answer (None: from the chat template).
    max_reasoning_tokens: the most think tokens (None: half of max_tokens).
    repair: decode a field a validator rejects again, at most this many times per field.
    strict: False relaxes JSON-schema keywords no backend enforces (validated afterwards).
    chat: False sends a string prompt as raw text instead of through the chat template.
    tools: OpenAI-style tool definitions for the chat template.
    params: a ready `SamplingParams` instead of the sampling keywords.
    """

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    jump_forward: bool | None
    close_at_budget: bool
    loop_guards: bool
    reasoning: bool | None
    max_reasoning_tokens: int | None
    repair: int
    strict: bool
    chat: bool | None
    tools: list[dict[str, Any]] | None
    params: SamplingParams | None


DEFAULTS = SamplingParams()  # the defaults of the sampling keywords


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt already rendered and tokenized (`LLM.encode_prompt`), passed in place of its
    text or messages: a caller that needed the token ids first (the server counts them to
    check the context) hands them on instead of having them tokenized again."""

    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Options:
    """The checked keyword arguments of one call."""

    params: SamplingParams
    strict: bool = True
    chat: bool | None = None
    tools: list[dict[str, Any]] | None = None

    @classmethod
    def of(
        cls, max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
        jump_forward: bool | None, strict: bool, chat: bool | None,
        tools: list[dict[str, Any]] | None, params: SamplingParams | None,
        close_at_budget: bool = True, loop_guards: bool = True, reasoning: bool | None = None,
        max_reasoning_tokens: int | None = None, repair: int = 0,
    ) -> Options:  # fmt: skip
        sampling = SamplingParams(max_tokens, temperature, top_p, top_k, seed, jump_forward, close_at_budget, loop_guards,
                                  reasoning=reasoning, max_reasoning_tokens=max_reasoning_tokens, repair=repair)
        if params is None:
            params = sampling
        elif not isinstance(params, SamplingParams):
            raise InvalidParameterError(f"params must be a SamplingParams, got {type(params).__name__}")
        elif sampling != DEFAULTS:
            raise InvalidParameterError(
                "pass either params=SamplingParams(...) or sampling keywords (max_tokens, "
                "temperature, ...), not both"
            )
        if not isinstance(strict, bool):
            raise InvalidParameterError(f"strict must be True or False, got {strict!r}")
        if chat is not None and not isinstance(chat, bool):
            raise InvalidParameterError(f"chat must be True, False or None, got {chat!r}")
        return cls(params, strict, chat, tools)


def checked_keywords(method: F) -> F:
    """Turn an unknown keyword argument into an `InvalidParameterError` that names the one
    meant (`max_new_tokens` -> `max_tokens`) instead of a bare TypeError."""
    accepted = [
        name for name, p in inspect.signature(method).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]  # fmt: skip

    def check(kwargs: dict[str, Any]) -> None:
        for name in kwargs:
            if name not in accepted:
                raise InvalidParameterError(_unknown_keyword(name, method.__name__, accepted))

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def checked_async(*args: Any, **kwargs: Any) -> Any:
            check(kwargs)
            return await method(*args, **kwargs)

        return typing.cast(F, checked_async)

    @functools.wraps(method)
    def checked(*args: Any, **kwargs: Any) -> Any:
        check(kwargs)
        return method(*args, **kwargs)

    return typing.cast(F, checked)


def _unknown_keyword(name: str, method: str, accepted: list[str]) -> str:
    hint = _KEYWORD_HINTS.get(name)
    if hint is None:
        close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
        hint = close[0] if close else None
    advice = f"; did you mean {hint}?" if hint else ""
    return f"{method}() got an unknown keyword argument {name!r}{advice} It takes {', '.join(accepted)}"


def check_prompt(prompt: Any, max_chars: int) -> None:
    """A prompt is non-empty text or a non-empty list of messages with known roles, of at most
    `max_chars` characters (checked before anything reads the whole text), or an
    `EncodedPrompt` of at least one token."""
    if prompt is None:
        raise InvalidParameterError(
            "prompt is None; pass the prompt text, or messages such as "
            "[{'role': 'user', 'content': '...'}], as the second argument"
        )
    if isinstance(prompt, EncodedPrompt):
        if not prompt.token_ids:
            raise InvalidParameterError("the encoded prompt has no tokens; encode a non-empty prompt")
        return
    if isinstance(prompt, str):
        _check_length(len(prompt), max_chars)
        if not prompt.strip():
            raise InvalidParameterError("prompt is empty; pass the text to generate from")
        check_text(prompt, "prompt")
        return
    if isinstance(prompt, dict):
        raise InvalidParameterError("prompt is a single message; pass a list of messages: [message]")
    if isinstance(prompt, type) or typing.get_origin(prompt) is not None:
        raise InvalidParameterError(
            f"the prompt is the type {prompt!r}; the output type comes first and the prompt "
            "second: generate(OutputType, prompt)"
        )
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise InvalidParameterError(
            f"prompt must be a string or a list of messages, got {type(prompt).__name__}"
        )
    if not prompt:
        raise InvalidParameterError("prompt is an empty list of messages; add at least one")
    for i, message in enumerate(prompt):
        _check_message(i, message)
    _check_length(sum(len(str(m.get("content") or "")) for m in with_text_content(prompt)), max_chars)


def _check_length(chars: int, max_chars: int) -> None:
    if chars > max_chars:
        raise PromptTooLongError(
            f"prompt of {chars} characters cannot fit the model's context (at most {max_chars} "
            "characters); shorten the prompt"
        )


def _check_message(i: int, message: Any) -> None:
    if not isinstance(message, dict):
        raise InvalidParameterError(
            f"message {i} is a {type(message).__name__}; each message is a dict such as "
            "{'role': 'user', 'content': '...'}"
        )
    role = message.get("role")
    if role not in ROLES:
        raise InvalidParameterError(
            f"message {i} has role {role!r}; use one of {', '.join(ROLES)}"
        )
    if "content" not in message and not (role == "assistant" and message.get("tool_calls")):
        raise InvalidParameterError(
            f"message {i} ({role}) has no 'content'; add the message text as 'content'"
        )
    content = message.get("content")
    if isinstance(content, list):
        content = _parts_text(i, content)
    if isinstance(content, str):
        check_text(content, f"message {i} content")
    elif content is None and not (role == "assistant" and message.get("tool_calls")):
        raise InvalidParameterError(f"message {i} ({role}) has content None; pass its text")


def with_text_content(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose content is OpenAI content parts (`[{"type": "text", "text": ...}]`) with
    the parts' text joined, as the server reads them: chat templates take text content."""
    return [{**m, "content": _parts_text(i, m["content"])} if isinstance(m.get("content"), list) else m
            for i, m in enumerate(messages)]


def _parts_text(i: int, parts: list[Any]) -> str:
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidParameterError(
                f"message {i} has a content part of type {kind!r}; only text parts "
                "{'type': 'text', 'text': '...'} are supported (or pass the content as a string)")
    return "".join(part["text"] for part in parts)


def check_text(text: str, where: str) -> None:
    """Lone surrogates (half of a UTF-16 pair) cannot be encoded, so no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParameterError(
            f"{where} holds a lone surrogate {text[e.start]!r} at character {e.start}, which is "
            "not valid Unicode text; remove it (or decode the source with errors='replace')"
        ) from None
