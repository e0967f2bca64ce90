"""The OpenAI wire format: request and response bodies of `/v1/chat/completions`,
`/v1/completions` and `/v1/models`, as pydantic models.

Requests validate here (types and ranges) so that a malformed body becomes a 400 naming the
field before anything reaches the engine. Integers and booleans are strict, as OpenAI's are
(`"stream": "yes"` and `"max_tokens": true` are 400s, not coerced). Unknown fields are accepted,
as vLLM does, because clients pass engine-specific extras through `extra_body`, except one that
looks like a misspelled constraint field (`misspelled_constraint_field`), which would
otherwise silently give free text. The structured-output extensions
other servers accept (vLLM's `guided_*` and `structured_outputs`, SGLang's `regex`/`ebnf`,
`response_format` types `regex`/`grammar`/`choice`) are declared here too; `constraints.py`
turns them into one structgen output type.
"""

from __future__ import annotations

import difflib
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from structgen.sampling import MAX_SEED

# OpenAI's `seed` is any int64, but the engine takes 0..MAX_SEED: checked here so the 400 names `seed`
SEED_RANGE = (0, MAX_SEED)
# The reasoning budgets (max_reasoning_tokens) of OpenAI's reasoning_effort levels: Gemini's
# OpenAI-compatible API thinks this long at low, medium and high, so a client tuned against a
# hosted reasoning model gets about the thinking it expects (minimal: half of low).
REASONING_EFFORT_TOKENS = {"minimal": 512, "low": 1024, "medium": 8192, "high": 24576}
REASONING_EFFORT_HELP = (
    'OpenAI\'s reasoning effort, on a model that reasons: "none" turns reasoning off; '
    + ", ".join(f'"{level}" thinks for at most {tokens} tokens' for level, tokens in REASONING_EFFORT_TOKENS.items())
    + " (and never past what max_tokens leaves after the answer's room), as max_reasoning_tokens would. "
    "A model whose chat template does not think refuses a level unless `reasoning` is true."
)

# --------------------------------------------------------------------------- requests


class _Lenient(BaseModel):
    """Ignore fields we do not know (clients send vendor extras); keep the ones we do strict."""

    model_config = ConfigDict(extra="ignore")


class JsonSchemaFormat(_Lenient):
    """`response_format.json_schema`: a named schema; `strict` is accepted, and always enforced."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ResponseFormat(_Lenient):
    """`response_format`: OpenAI's `text` / `json_object` / `json_schema`, plus the
    extension types `regex`, `grammar` (alias `ebnf`/`lark`) and `choice`."""

    type: Literal["text", "json_object", "json_schema", "regex", "grammar", "ebnf", "lark", "choice"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None  # for type "regex" (also accepted as `pattern`)
    pattern: str | None = None
    grammar: str | None = None  # for types "grammar"/"ebnf"/"lark"
    syntax: Literal["auto", "ebnf", "lark"] | None = None
    choices: list[str] | None = None  # for type "choice" (also accepted as `choice`)
    choice: list[str] | None = None


class StructuredOutputs(_Lenient):
    """vLLM >= 0.10's `structured_outputs` object: exactly one of these fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class FunctionDefinition(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDefinition(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(_Lenient):
    name: str
    arguments: str


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    """One message of the conversation; content may be a string or OpenAI content parts."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The message's text, with content parts joined (only text parts are supported:
        see `unsupported_part`)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)

    def unsupported_part(self) -> tuple[int, str] | None:
        """(index, type) of the first content part that is not text, if any."""
        if isinstance(self.content, list):
            for i, part in enumerate(self.content):
                if part.type != "text":
                    return i, part.type
        return None


class StreamOptions(_Lenient):
    """`include_usage` as OpenAI's; `include_partial` (structgen, JSON outputs): each chunk's
    choice carries `partial`, the output parsed so far (see docs/guide/streaming-async.md)."""

    include_usage: StrictBool = False
    include_partial: StrictBool = False


# the fields that choose the output's constraint: a near miss of one of these is refused
CONSTRAINT_FIELDS = (
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structured_outputs", "regex", "ebnf", "grammar", "choice", "json_schema", "tools", "tool_choice",
)  # fmt: skip


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions: sampling, limits and the extensions.
    Unknown fields are kept in `model_extra` so that near misses can be named."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    # OpenAI's newer name of max_tokens (chat only there); honoured on /v1/completions too, since
    # a client sending it asks for that budget and falling back to the default would break it
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, strict=True)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, strict=True)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # extension; 0 or -1 = off (vLLM uses -1)
    n: StrictInt = Field(default=1, ge=1, le=16)
    seed: StrictInt | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, strict=True)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, strict=True)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # structured-output extensions (vLLM names, SGLang names, vLLM >= 0.10's object)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    regex: str | None = None
    ebnf: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_schema: dict[str, Any] | str | None = None  # SGLang: top-level schema text
    jump_forward: StrictBool | None = None  # structgen: per-request override of the engine default
    # structgen: budget-aware closing and loop guards (SamplingParams), on unless turned off
    close_at_budget: StrictBool = True
    loop_guards: StrictBool = True
    # structgen: reasoning models (SamplingParams); the thinking comes back as reasoning_content
    reasoning: StrictBool | None = None
    max_reasoning_tokens: StrictInt | None = Field(default=None, ge=0)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        default=None, description=REASONING_EFFORT_HELP)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and (len(v) > 4 or any(not s for s in v)):
            raise ValueError("stop takes at most 4 non-empty strings")
        if v == "":
            raise ValueError("stop must be a non-empty string")
        return v

    def token_limit(self) -> int | None:
        """The output budget asked for (planning refuses max_tokens and max_completion_tokens
        that differ)."""
        return self.max_completion_tokens or self.max_tokens

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def misspelled_constraint_field(self) -> tuple[str, str] | None:
        """(unknown field, the constraint field it most likely meant), e.g. ("response_fromat",
        "response_format"); None when no unknown field is that close to one."""
        known = [f for f in CONSTRAINT_FIELDS if f in type(self).model_fields]
        for name in self.model_extra or {}:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            if close:
                return name, close[0]
        return None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # OpenAI's range; >0 is refused


class CompletionRequest(SamplingFields):
    prompt: str | list[str] = Field(min_length=1)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)  # OpenAI's range; any is refused

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking (as DeepSeek and vLLM send it)
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "structgen"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
