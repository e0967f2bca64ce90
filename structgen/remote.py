"""`RemoteLLM`: the `LLM` API (`generate`, `complete`, `generate_batch`, `call`) against any
OpenAI-compatible server — structgen's own, vLLM, SGLang.

The output type becomes a `Constraint` locally, exactly as in-process; JSON types travel as
`response_format={"type": "json_schema", ..., "strict": true}` (every server knows it), regexes,
grammars and choices through the extension fields of the server's dialect. On plain OpenAI
servers (`dialect="openai"`) choices (`Choice`, `Literal`, `Enum`) and scalars travel as a JSON
schema wrapped in an object (`{"value": ...}`, as OpenAI wants an object at the root) and are
unwrapped on return. The reply is parsed and validated locally with `Constraint.parse`, so a
server that ignored the constraint cannot hand back an invalid value: it raises
`OutputValidationError` instead.

Stats are what the server reports (`usage`) and what the client can measure (wall time; time to
first token and decode time when streaming); anything neither knows is `None`.

    llm = structgen.LLM.remote("http://127.0.0.1:8000/v1", "SmolLM2-135M-Instruct")
    invoice = llm.generate(Invoice, "Extract the invoice: ...")
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
import typing
from collections.abc import AsyncIterator, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, overload

import httpx

from structgen import tool_format
from structgen.arguments import checked_keywords
from structgen.completion import Completion, ReasoningDelta
from structgen.errors import (
    CompilerBusyError,
    ConstraintTooLargeError,
    EngineError,
    IncompleteOutputError,
    InvalidConstraintError,
    InvalidParameterError,
    ModelNotFoundError,
    OutputValidationError,
    PromptTooLongError,
    StructgenError,
    UnsatisfiableConstraintError,
    UnsupportedSchemaError,
    UnsupportedTypeError,
)
from structgen.partial import PartialStream, partial_tracker
from structgen.sampling import SamplingParams
from structgen.types import CFG, Choice, Constraint, Regex, to_constraint

if typing.TYPE_CHECKING:
    from structgen.tools import ToolCalls

T = TypeVar("T")

Prompt = str | Sequence[dict[str, Any]]
Dialect = Literal["structgen", "vllm", "sglang", "openai"]

# error `code`s our server sends -> the exception the in-process API would have raised
_ERROR_CODES: dict[str, type[StructgenError]] = {
    "unsupported_schema": UnsupportedSchemaError,
    "unsatisfiable_constraint": UnsatisfiableConstraintError,
    "constraint_too_large": ConstraintTooLargeError,
    "invalid_constraint": InvalidConstraintError,
    "output_validation_failed": OutputValidationError,
    "compiler_busy": CompilerBusyError,
    "unsupported_type": UnsupportedTypeError,
    "invalid_parameter": InvalidParameterError,
    "context_length_exceeded": PromptTooLongError,
    "model_not_found": ModelNotFoundError,
}

# scalar types -> the JSON schema that carries them where regexes cannot travel
_SCALAR_SCHEMAS: dict[type, dict[str, str]] = {bool: {"type": "boolean"}, int: {"type": "integer"}, float: {"type": "number"}}


@dataclass
class RemoteStats:
    """Statistics of one remote generation, the same fields as the engine's `GenerationStats`
    (plus `wall_s`), each `None` where neither the server's `usage` nor the client's clock
    knows it: an unknown is never reported as a zero that looks like a measurement."""

    prompt_tokens: int | None = None  # usage.prompt_tokens
    output_tokens: int | None = None  # usage.completion_tokens
    ttft_s: float | None = None  # request sent -> first text delta (streaming only)
    decode_s: float | None = None  # first text delta -> end of the stream (streaming only)
    wall_s: float | None = None  # request sent -> response complete, measured here
    forward_passes: int | None = None
    forced_tokens: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    verify_steps: int | None = None
    cached_prompt_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """Not reported over HTTP (no server says how many drafted tokens it accepted)."""
        return None

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["mean_acceptance_length"] = self.mean_acceptance_length
        return d


def _no_remote_repair(repair: int) -> None:
    if repair:
        raise InvalidParameterError(
            "repair re-decodes a rejected field with the engine's own grammar state, so it runs "
            "in process only; LLM.remote takes repair=0 (validate and retry on your side)")


@dataclass
class _WireRequest:
    """One request as sent: the endpoint, the JSON body, the constraint the reply is checked
    against, and `unwrap`: how the reply's text maps back to that constraint's text ("" as
    is, "json" a wrapped JSON value, "option" a wrapped choice option)."""

    path: str
    body: dict[str, Any]
    constraint: Constraint
    unwrap: Literal["", "json", "option"] = ""


class RemoteLLM:
    """A model behind an OpenAI-compatible HTTP endpoint.

    Parameters
    ----------
    base_url:
        The server's API root, e.g. "http://127.0.0.1:8000/v1" ("/v1" is appended if missing).
    model:
        The model id the server expects in requests.
    api_key:
        Sent as `Authorization: Bearer <api_key>` when given.
    dialect:
        How non-JSON constraints are sent: "structgen" (`response_format` types
        regex/grammar/choice), "vllm" (`guided_regex`/`guided_grammar`/`guided_choice`),
        "sglang" (top-level `regex`/`ebnf`), "openai" (JSON schemas only: choices, Literal,
        Enum and scalars travel as a JSON schema wrapped in an object; regexes and grammars
        are refused).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        dialect: Dialect = "structgen",
        timeout: float = 600.0,
        max_concurrency: int = 32,
    ):
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.model_name = model
        self.dialect = dialect
        self.max_concurrency = max_concurrency
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._client = httpx.Client(base_url=self.base_url, headers=self._headers, timeout=timeout)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RemoteLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteLLM({self.base_url!r}, {self.model_name!r})"

    # -- generation -------------------------------------------------------------------------
    @overload
    def complete(self, output_type: Regex | CFG, prompt: Prompt, **kw: Any) -> Completion[str, RemoteStats]: ...
    @overload
    def complete(self, output_type: type[T], prompt: Prompt, **kw: Any) -> Completion[T, RemoteStats]: ...
    @overload
    def complete(self, output_type: object, prompt: Prompt, **kw: Any) -> Completion[Any, RemoteStats]: ...
    @checked_keywords
    def complete(
        self,
        output_type: Any,
        prompt: Prompt,
        *,
        max_tokens: int = 512,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        jump_forward: bool | None = None,
        close_at_budget: bool = True,
        loop_guards: bool = True,
        reasoning: bool | None = None,
        max_reasoning_tokens: int | None = None,
        chat: bool | None = None,
        tools: list[dict[str, Any]] | None = None,
        strict: bool = True,
        repair: int = 0,
    ) -> Completion[Any, RemoteStats]:
        """Generate one output of `output_type` on the server; same contract as `LLM.complete`
        (returns a validated value; truncation raises `IncompleteOutputError`, except for `str`,
        which comes back cut with finish_reason "length"). `strict=False` sends the schema
        without the keywords no backend enforces and validates the reply against all of it
        here, as in process (`Completion.relaxed`)."""
        _no_remote_repair(repair)
        wire = self._wire_request(output_type, prompt, chat, tools, strict)
        wire.body.update(self._sampling(max_tokens, temperature, top_p, top_k, seed, jump_forward))
        wire.body.update(self._guards(close_at_budget, loop_guards))
        wire.body.update(self._reasoning(reasoning, max_reasoning_tokens))
        t0 = time.perf_counter()
        resp = self._post(wire.path, wire.body)
        data = resp.json()
        choice = data["choices"][0]
        message = choice.get("message") or {}
        text = (message.get("content") if wire.path == "/chat/completions" else choice.get("text")) or ""
        stats = _usage_stats(data.get("usage"), wall_s=time.perf_counter() - t0)
        return self._finish(wire, text, choice.get("finish_reason"), stats, _reasoning_of(message))

    @overload
    def stream(self, output_type: type[T], prompt: Prompt, *, partial: Literal[True], **kw: Any) -> PartialStream[T]: ...
    @overload
    def stream(self, output_type: object, prompt: Prompt, *, partial: Literal[True], **kw: Any) -> PartialStream[Any]: ...
    @overload
    def stream(
        self, output_type: object, prompt: Prompt, *, partial: Literal[False] = ..., **kw: Any
    ) -> RemoteCompletionStream: ...
    @checked_keywords
    def stream(
        self,
        output_type: Any,
        prompt: Prompt,
        *,
        max_tokens: int = 512,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        jump_forward: bool | None = None,
        close_at_budget: bool = True,
        loop_guards: bool = True,
        reasoning: bool | None = None,
        max_reasoning_tokens: int | None = None,
        chat: bool | None = None,
        tools: list[dict[str, Any]] | None = None,
        strict: bool = True,
        repair: int = 0,
        partial: bool = False,
    ) -> RemoteCompletionStream | PartialStream[Any]:
        """`for delta in llm.stream(...)` (or `async for` over `llm.astream(...)`): text deltas
        from the server's event stream as they arrive; then `.completion`. Raises like
        `complete` when the stream ends. `partial=True` (JSON output types) yields `Partial`
        snapshots instead, parsed and validated here from the text deltas, so any
        OpenAI-compatible server will do."""
        _no_remote_repair(repair)
        wire = self._wire_request(output_type, prompt, chat, tools, strict)
        wire.body.update(self._sampling(max_tokens, temperature, top_p, top_k, seed, jump_forward))
        wire.body.update(self._guards(close_at_budget, loop_guards))
        wire.body.update(self._reasoning(reasoning, max_reasoning_tokens))
        wire.body.update(stream=True, stream_options={"include_usage": True})
        if not partial:
            return RemoteCompletionStream(self, wire)
        if wire.unwrap:
            raise InvalidParameterError(
                "partial=True with dialect='openai' needs an object at the root of the output "
                "type (this one travels wrapped in {\"value\": ...}); use a model, dataclass or "
                "TypedDict, or a server dialect with extensions"
            )
        return PartialStream(partial_tracker(output_type, wire.constraint), RemoteCompletionStream(self, wire))

    # One stream object serves both loops: `async for delta in llm.astream(...)`, then
    # `.completion`, as with `LLM.astream`.
    astream = stream

    @overload
    def generate(self, output_type: Regex | CFG, prompt: Prompt, **kw: Any) -> str: ...
    @overload
    def generate(self, output_type: type[T], prompt: Prompt, **kw: Any) -> T: ...
    @overload
    def generate(self, output_type: object, prompt: Prompt, **kw: Any) -> Any: ...
    def generate(self, output_type: Any, prompt: Prompt, **kw: Any) -> Any:
        """Generate and return just the typed value."""
        return self.complete(output_type, prompt, **kw).value

    @overload
    def complete_batch(
        self, output_type: Regex | CFG, prompts: Sequence[Prompt], **kw: Any) -> list[Completion[str, RemoteStats]]: ...
    @overload
    def complete_batch(
        self, output_type: type[T], prompts: Sequence[Prompt], **kw: Any) -> list[Completion[T, RemoteStats]]: ...
    @overload
    def complete_batch(
        self, output_type: object, prompts: Sequence[Prompt], **kw: Any) -> list[Completion[Any, RemoteStats]]: ...
    def complete_batch(self, output_type: Any, prompts: Sequence[Prompt], **kw: Any) -> list[Completion[Any, RemoteStats]]:
        """Send the prompts concurrently (the server batches them); results in prompt order."""
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(prompts)))) as pool:
            return list(pool.map(lambda p: self.complete(output_type, p, **kw), prompts))

    @overload
    def generate_batch(self, output_type: Regex | CFG, prompts: Sequence[Prompt], **kw: Any) -> list[str]: ...
    @overload
    def generate_batch(self, output_type: type[T], prompts: Sequence[Prompt], **kw: Any) -> list[T]: ...
    @overload
    def generate_batch(self, output_type: object, prompts: Sequence[Prompt], **kw: Any) -> list[Any]: ...
    def generate_batch(self, output_type: Any, prompts: Sequence[Prompt], **kw: Any) -> list[Any]:
        return [c.value for c in self.complete_batch(output_type, prompts, **kw)]

    @overload
    async def acomplete(self, output_type: Regex | CFG, prompt: Prompt, **kw: Any) -> Completion[str, RemoteStats]: ...
    @overload
    async def acomplete(self, output_type: type[T], prompt: Prompt, **kw: Any) -> Completion[T, RemoteStats]: ...
    @overload
    async def acomplete(self, output_type: object, prompt: Prompt, **kw: Any) -> Completion[Any, RemoteStats]: ...
    async def acomplete(self, output_type: Any, prompt: Prompt, **kw: Any) -> Completion[Any, RemoteStats]:
        """`complete` for asyncio (a worker thread per call; httpx's sync client is thread-safe)."""
        return await asyncio.to_thread(lambda: self.complete(output_type, prompt, **kw))

    @overload
    async def agenerate(self, output_type: Regex | CFG, prompt: Prompt, **kw: Any) -> str: ...
    @overload
    async def agenerate(self, output_type: type[T], prompt: Prompt, **kw: Any) -> T: ...
    @overload
    async def agenerate(self, output_type: object, prompt: Prompt, **kw: Any) -> Any: ...
    async def agenerate(self, output_type: Any, prompt: Prompt, **kw: Any) -> Any:
        return (await self.acomplete(output_type, prompt, **kw)).value

    def call(self, prompt: Prompt, tools: Sequence[Any], **kw: Any) -> ToolCalls:
        """Tool calls, as `LLM.call`: see `structgen.tools.call`."""
        from structgen.tools import call

        return call(self, prompt, tools, **kw)

    def models(self) -> list[str]:
        """Ids of the models the server lists."""
        resp = self._client.get("/models")
        self._raise_for_error(resp)
        return [m["id"] for m in resp.json().get("data", [])]

    # -- tools (used by structgen.tools.call) ----------------------------------------------
    def chat_tools(
        self,
        messages: list[dict[str, Any]],
        tools: Sequence[Any],
        *,
        tool_choice: Any,
        parallel_tool_calls: bool,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
    ) -> Any:
        """One tool-calling turn on the server: it renders the tools and constrains the calls;
        arguments are validated again here into each tool's pydantic model."""
        from structgen.tools import ToolCall, ToolCalls

        by_name = {t.name: t for t in tools}
        body: dict[str, Any] = {
            "model": self.model_name,
            "messages": messages,
            "tools": [t.to_openai() for t in tools],
            "tool_choice": tool_choice,
            "parallel_tool_calls": parallel_tool_calls,
            **self._sampling(max_tokens, temperature, top_p, top_k, seed, None),
        }
        data = self._post("/chat/completions", body).json()
        choice = data["choices"][0]
        text = choice["message"].get("content")
        if choice.get("finish_reason") == "length":
            if tool_choice == "none":  # a plain text answer: cut, as `str` is in-process
                return ToolCalls([], text or "", data, "length")
            raise IncompleteOutputError(f"tool call hit max_tokens={max_tokens}; raise max_tokens", partial_text=text or "")
        calls = []
        for tc in choice["message"].get("tool_calls") or []:
            fn = tc["function"]
            tool = by_name.get(fn["name"])
            if tool is None:
                raise OutputValidationError(f"server returned a call of unknown tool {fn['name']!r}", text=json.dumps(tc))
            call_id = tc.get("id") or tool_format.new_call_id()
            calls.append(ToolCall(fn["name"], tool.validate(json.loads(fn["arguments"])), tool, call_id))
        return ToolCalls(calls, None if calls else text, data)

    # -- wire format ------------------------------------------------------------------------
    def _wire_request(
        self, output_type: Any, prompt: Prompt, chat: bool | None, tools: list[dict] | None, strict: bool = True
    ) -> _WireRequest:
        self._check_open()
        if not isinstance(strict, bool):
            raise InvalidParameterError(f"strict must be True or False, got {strict!r}")
        constraint = to_constraint(output_type, strict=strict)
        body: dict[str, Any] = {"model": self.model_name}
        if isinstance(prompt, str) and chat is False:
            path = "/completions"
            body["prompt"] = prompt
        else:
            path = "/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if tools:
                body["tools"], body["tool_choice"] = tools, "none"
        if self.dialect == "openai":
            fields, unwrap = _openai_fields(output_type, constraint)
            body.update(fields)
            return _WireRequest(path, body, constraint, unwrap)
        body.update(self._constraint_fields(output_type, constraint))
        return _WireRequest(path, body, constraint)

    def _constraint_fields(self, output_type: Any, constraint: Constraint) -> dict[str, Any]:
        """The request fields carrying `constraint` in a dialect with structured-output
        extensions (structgen, vLLM, SGLang)."""
        if constraint.kind == "text":
            return {}
        if constraint.kind == "json_schema":
            return _json_schema_format(output_type, json.loads(constraint.source))
        options = None  # a Choice of strings travels as a choice list, anything else as regex
        if isinstance(output_type, Choice) and all(isinstance(o, str) for o in output_type.options):
            options = list(output_type.options)
        if self.dialect == "vllm":
            if options is not None:
                return {"guided_choice": options}
            return {"guided_regex": constraint.source} if constraint.kind == "regex" else {"guided_grammar": constraint.source}
        if self.dialect == "sglang":
            return {"regex": constraint.source} if constraint.kind == "regex" else {"ebnf": constraint.source}
        if options is not None:
            return {"response_format": {"type": "choice", "choices": options}}
        if constraint.kind == "regex":
            return {"response_format": {"type": "regex", "regex": constraint.source}}
        return {"response_format": {"type": "grammar", "grammar": constraint.source, "syntax": constraint.syntax or "auto"}}

    def _sampling(
        self, max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None, jump_forward: bool | None
    ) -> dict[str, Any]:
        # Checked here as in process: a bad value is the caller's InvalidParameterError, not
        # a JSON encoder's ValueError (inf) or a round trip to the server.
        SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                       jump_forward=jump_forward)
        fields: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        if top_k:
            fields["top_k"] = top_k
        if seed is not None:
            fields["seed"] = seed
        if jump_forward is not None and self.dialect == "structgen":
            fields["jump_forward"] = jump_forward
        return fields

    def _guards(self, close_at_budget: bool, loop_guards: bool) -> dict[str, Any]:
        """The structgen server's closing and loop-guard switches, sent where turned off (an
        OpenAI server knows neither)."""
        if self.dialect != "structgen":
            return {}
        return {k: False for k, on in (("close_at_budget", close_at_budget), ("loop_guards", loop_guards)) if not on}

    def _reasoning(self, reasoning: bool | None, max_reasoning_tokens: int | None) -> dict[str, Any]:
        """The structgen server's reasoning fields, sent where set (other servers choose by
        their own reasoning parser; their thinking comes back as `reasoning_content` too)."""
        if self.dialect != "structgen":
            return {}
        fields = {"reasoning": reasoning, "max_reasoning_tokens": max_reasoning_tokens}
        return {k: v for k, v in fields.items() if v is not None}

    def _check_open(self) -> None:
        if self._client.is_closed:
            raise StructgenError("this RemoteLLM is closed; create a new one with structgen.LLM.remote(...)")

    def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        self._check_open()
        try:
            resp = self._client.post(path, json=body)
        except httpx.HTTPError as e:
            raise EngineError(f"cannot reach {self.base_url}: {e}") from e
        self._raise_for_error(resp)
        return resp

    def _finish(self, wire: _WireRequest, text: str, finish_reason: str | None, stats: RemoteStats,
                reasoning: str | None = None) -> Completion[Any, RemoteStats]:
        """The reply as a validated `Completion`; truncation raises as in-process, except for
        free text, which comes back cut with finish_reason "length" (as OpenAI does)."""
        if finish_reason == "length":
            if wire.constraint.kind == "text":
                return Completion(text, text, [], "length", stats, reasoning=reasoning)
            raise IncompleteOutputError(
                "generation hit max_tokens before the output was complete; raise max_tokens",
                partial_text=text,
                stats=stats,
            )
        if wire.unwrap:
            text = _unwrapped_text(text, wire.unwrap)
        return Completion(wire.constraint.parse(text), text, [], finish_reason or "stop", stats,
                          wire.constraint.relaxed, reasoning=reasoning)

    def _raise_for_error(self, resp: httpx.Response) -> None:
        """Raise the structgen exception an error response stands for."""
        if resp.status_code < 400:
            return
        try:
            err = resp.json().get("error") or {}
            message = err.get("message") if isinstance(err, dict) else str(err)
            code = err.get("code") if isinstance(err, dict) else None
        except (ValueError, AttributeError):
            message, code = resp.text[:500], None
        raise self._error(resp.status_code, str(message), code)

    def _error(self, status: int | None, message: str, code: Any) -> StructgenError:
        """The structgen exception for an error the server reported (`status` is None for an
        error event inside a stream, after the response status was sent)."""
        where = f"{self.base_url} returned {status}" if status else f"{self.base_url} stream failed"
        message = f"{where}: {message}"
        cls = _ERROR_CODES.get(str(code))
        if cls is None:
            if status == 404:
                cls = ModelNotFoundError
            elif status and status < 500 and "context length" in message.lower():
                cls = PromptTooLongError
            elif status and status < 500:
                cls = InvalidParameterError
            else:
                cls = EngineError
        return cls(message)


class RemoteCompletionStream:
    """Text deltas of one streamed remote generation: `for delta in stream` (from
    `RemoteLLM.stream`) or `async for delta in stream` (from `RemoteLLM.astream`), then
    `.completion`. Breaking out of the loop closes the connection, which the server takes as a
    cancellation."""

    def __init__(self, llm: RemoteLLM, wire: _WireRequest):
        self._llm, self._wire = llm, wire
        self.completion: Completion[Any, RemoteStats] | None = None
        self._deltas: Generator[str, None, None] | None = None

    def __iter__(self) -> RemoteCompletionStream:
        return self

    def __next__(self) -> str:
        if self._deltas is None:
            self._deltas = self._read()
        return next(self._deltas)

    def __aiter__(self) -> AsyncIterator[str]:
        return self._aread()

    def close(self) -> None:
        """Stop reading a sync stream early and close its connection."""
        if self._deltas is not None:
            self._deltas.close()

    def _read(self) -> Generator[str, None, None]:
        events = _StreamEvents(self._llm, self._wire)
        try:
            with self._llm._client.stream("POST", self._wire.path, json=self._wire.body) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    self._llm._raise_for_error(resp)
                for line in resp.iter_lines():
                    yield from events.feed(line)
        except httpx.HTTPError as e:
            raise EngineError(f"stream from {self._llm.base_url} broke off: {e}") from e
        self.completion = events.completion()

    async def _aread(self) -> AsyncIterator[str]:
        llm = self._llm
        events = _StreamEvents(llm, self._wire)
        try:
            async with httpx.AsyncClient(base_url=llm.base_url, headers=llm._headers, timeout=llm._timeout) as client:
                async with client.stream("POST", self._wire.path, json=self._wire.body) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        llm._raise_for_error(resp)
                    async for line in resp.aiter_lines():
                        for delta in events.feed(line):
                            yield delta
        except httpx.HTTPError as e:
            raise EngineError(f"stream from {llm.base_url} broke off: {e}") from e
        self.completion = events.completion()


@dataclass
class _StreamEvents:
    """Reads a server-sent event stream line by line: the text so far (and the thinking, from
    `reasoning_content` deltas), the finish reason, the usage chunk and the client-side times."""

    llm: RemoteLLM
    wire: _WireRequest
    pieces: list[str] = field(default_factory=list)
    thinking: list[str] | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    sent_at: float = field(default_factory=time.perf_counter)
    first_text_at: float | None = None

    def feed(self, line: str) -> list[str]:
        """The deltas of one event line: `ReasoningDelta`s of thinking, then the answer's text
        (none for other lines and events)."""
        if not line.startswith("data:"):
            return []
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return []
        try:
            event = json.loads(data)
        except json.JSONDecodeError as e:
            raise EngineError(f"{self.llm.base_url} sent a stream event that is not JSON: {data[:200]!r}") from e
        if "error" in event:
            err = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
            raise self.llm._error(None, str(err.get("message")), err.get("code"))
        self.usage = event.get("usage") or self.usage
        delta, thought = "", ""
        for choice in event.get("choices") or []:
            part = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
            delta += part or ""
            thought += _reasoning_of(choice.get("delta") or {}) or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if delta or thought:
            self.first_text_at = self.first_text_at or time.perf_counter()
        if thought:
            self.thinking = self.thinking if self.thinking is not None else []
            self.thinking.append(thought)
        if delta:
            self.pieces.append(delta)
        return [d for d in (ReasoningDelta(thought), delta) if d]

    def completion(self) -> Completion[Any, RemoteStats]:
        end = time.perf_counter()
        stats = _usage_stats(self.usage, wall_s=end - self.sent_at)
        if self.first_text_at is not None:
            stats.ttft_s, stats.decode_s = self.first_text_at - self.sent_at, end - self.first_text_at
        thinking = None if self.thinking is None else "".join(self.thinking)
        return self.llm._finish(self.wire, "".join(self.pieces), self.finish_reason, stats, thinking)


def _reasoning_of(message: dict[str, Any]) -> str | None:
    """A message's (or delta's) thinking: `reasoning_content` (DeepSeek, vLLM, structgen), or
    `reasoning` (newer vLLM)."""
    text = message.get("reasoning_content") or message.get("reasoning")
    return text if isinstance(text, str) else None


def _usage_stats(usage: dict[str, Any] | None, wall_s: float) -> RemoteStats:
    """Stats from an OpenAI `usage` object (None where it is missing) and the wall time."""
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return RemoteStats(prompt_tokens=usage.get("prompt_tokens"), output_tokens=usage.get("completion_tokens"),
                       cached_prompt_tokens=cached, wall_s=wall_s)


def _json_schema_format(output_type: Any, schema: dict[str, Any]) -> dict[str, Any]:
    """`response_format` for a JSON schema, named after the output type."""
    name = getattr(output_type, "__name__", "output")
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in name)[:64] or "output"
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}}


def _openai_fields(output_type: Any, constraint: Constraint) -> tuple[dict[str, Any], Literal["", "json", "option"]]:
    """The request fields for a plain OpenAI server (JSON schemas with an object at the root
    only) and how to unwrap the reply: other roots, choices and scalars are wrapped as
    `{"value": ...}`; regexes and grammars cannot travel."""
    if constraint.kind == "text":
        return {}, ""
    if constraint.kind == "json_schema":
        schema = json.loads(constraint.source)
        if schema.get("type") == "object":
            return _json_schema_format(output_type, schema), ""
        return _json_schema_format(output_type, _wrapped(schema)), "json"
    options = _choice_options(output_type)
    if options is not None:
        return _json_schema_format(output_type, _wrapped({"enum": options})), "option"
    if output_type in _SCALAR_SCHEMAS:
        return _json_schema_format(output_type, _wrapped(_SCALAR_SCHEMAS[output_type])), "json"
    raise UnsupportedSchemaError(
        f"{constraint.kind} constraints need a server with structured-output extensions; this RemoteLLM uses "
        "dialect='openai' (JSON schemas, choices and scalars only): use dialect='structgen', 'vllm' or 'sglang' "
        "for a server that has them",
        keyword=constraint.kind,
    )


def _choice_options(output_type: Any) -> list[Any] | None:
    """The JSON values of a `Choice`, `Literal` or `Enum` output type (None for other types)."""
    if isinstance(output_type, Choice):
        options = list(output_type.options)
    elif typing.get_origin(output_type) is Literal:
        options = list(typing.get_args(output_type))
    elif isinstance(output_type, type) and issubclass(output_type, enum.Enum):
        options = list(output_type)
    else:
        return None
    return [o.value if isinstance(o, enum.Enum) else o for o in options]


def _wrapped(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` as the `value` property of a closed object, its `$defs` moved to the root."""
    body, defs = tool_format.hoist_defs(schema, prefix="")
    root: dict[str, Any] = {
        "type": "object",
        "properties": {"value": body},
        "required": ["value"],
        "additionalProperties": False,
    }
    if defs:
        root["$defs"] = defs
    return root


def _unwrapped_text(text: str, unwrap: str) -> str:
    """The text the constraint parses, out of a wrapped reply `{"value": ...}`: a choice
    option as written in-process (strings bare, other values as JSON), else the value's JSON."""
    try:
        value = json.loads(text)["value"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise OutputValidationError(f'reply is not the requested {{"value": ...}} object: {text[:200]!r}', text=text) from e
    if unwrap == "option" and isinstance(value, str):
        return value
    return json.dumps(value)
