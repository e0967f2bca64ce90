"""Exception types. Every failure a user can cause maps to one of these, with a message that
says what to change; nothing else should escape the public API."""

from __future__ import annotations

from typing import Any


class StructgenError(Exception):
    """Base class of every error structgen raises on purpose."""


class UnsupportedSchemaError(StructgenError):
    """A schema/type uses a feature no grammar backend can enforce (names the keyword and path)."""

    def __init__(self, message: str, *, keyword: str | None = None, path: str | None = None):
        super().__init__(message)
        self.keyword = keyword
        self.path = path


class InvalidConstraintError(StructgenError):
    """A regex, grammar or schema is malformed (names the position where known)."""


class UnsatisfiableConstraintError(InvalidConstraintError):
    """A schema, regex or grammar admits no finite output at all (an empty language): e.g.
    `minimum > maximum`, a required property that refers back to its own object, or the EBNF
    `root ::= "ab" root`. The message names the part that cannot be satisfied."""


class ConstraintTooLargeError(InvalidConstraintError):
    """A schema, regex or grammar is over a size limit (bytes, enum length, nesting depth) or
    took longer to compile than the compiler's time budget; names the limit and its value.

    Where the limit is a setting (`limit`: a `ConstraintLimits` field or "compile_timeout"),
    the message is `problem`, then `remedy` (what to change in the constraint), then how an
    `LLM` raises it; a server names its own flag instead (structgen_server/errors.py)."""

    def __init__(self, problem: str, *, limit: str | None = None, remedy: str = "make it smaller"):
        raise_it = f" or raise the limit: {LIMIT_SETTINGS[limit]}" if limit else ""
        super().__init__(f"{problem}; {remedy}{raise_it}" if limit else problem)
        self.problem, self.limit, self.remedy = problem, limit, remedy


# How an `LLM`'s user raises each limit a ConstraintTooLargeError names.
LIMIT_SETTINGS = {
    "max_source_bytes": "LLM(..., limits=ConstraintLimits(max_source_bytes=...))",
    "max_depth": "LLM(..., limits=ConstraintLimits(max_depth=...))",
    "max_enum_values": "LLM(..., limits=ConstraintLimits(max_enum_values=...))",
    "compile_timeout": "LLM(..., compile_timeout=...) (seconds)",
}


class UnsupportedTypeError(StructgenError):
    """An output type that cannot be turned into a constraint (e.g. an arbitrary class)."""


class IncompleteOutputError(StructgenError):
    """Generation stopped (max_tokens, cancellation) before the grammar was complete."""

    def __init__(
        self, message: str, *, partial_text: str = "", token_ids: list[int] | None = None, stats: Any = None
    ):
        super().__init__(message)
        self.partial_text = partial_text
        self.token_ids = list(token_ids or [])
        self.stats = stats  # GenerationStats of the truncated request (usage accounting)


class OutputValidationError(StructgenError):
    """Decoded text did not validate against the requested type: a validator the grammar
    cannot enforce rejected it, or a constraint was enforced only partly. With `repair=N`,
    `attempts` holds every output tried (`structgen.repair.RepairAttempt`: text and error)
    and `stats` the request's GenerationStats (usage accounting; None where no request ran)."""

    def __init__(self, message: str, *, text: str = "", attempts: list[Any] | None = None, stats: Any = None):
        super().__init__(message)
        self.text = text
        self.attempts = list(attempts or [])
        self.stats = stats


class ModelNotFoundError(StructgenError):
    """The model path/name does not resolve to local weights (says how to install them)."""


class ModelLoadError(StructgenError):
    """Weights exist but cannot be read (unsupported architecture, quantisation, corrupt file)."""


class PromptTooLongError(StructgenError):
    """Prompt plus max_tokens does not fit the model's context or the KV cache."""


class RequestCancelledError(StructgenError):
    """The request was cancelled before it finished."""


class EngineError(StructgenError):
    """An internal failure in one request's processing; other requests are unaffected."""


class InvalidParameterError(StructgenError, ValueError):
    """A sampling or request parameter is out of range (names the parameter)."""


class CompilerBusyError(StructgenError):
    """The grammar compiler's queue is full (too many different constraints compiling at once);
    retry shortly. Servers answer 503."""


class EngineBusyError(StructgenError):
    """The engine's queue is full (`EngineConfig.max_waiting` requests wait for a slot); retry
    shortly. Servers answer 503 with Retry-After."""


class ToolTimeoutError(StructgenError, TimeoutError):
    """A tool did not return within its timeout (`run_tools(tool_timeout=...)`,
    `ToolCall.invoke(timeout=...)`); an async tool is cancelled, a sync one left to finish."""


class StructgenWarning(UserWarning):
    """Something structgen accepted but that is probably not what was meant (e.g. an unknown
    JSON-Schema keyword, which validators ignore); the message names the likely intent."""
