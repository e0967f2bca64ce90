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
import codecs
import contextlib
import email.utils
import enum
import json
import math
import socket
import threading
import time
import typing
import weakref
from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, overload

import anyio
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
    from structgen.tools import ToolCall, ToolCalls

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

# Statuses that say "busy, ask again later": the request was not processed, so resending is safe.
_BUSY_STATUSES = (429, 503)
# Refusals of those statuses that a retry cannot cure: our server's throttle answers 429 to a
# client whose requests keep failing, and retrying would only keep it throttled.
_NOT_TRANSIENT = frozenset({"too_many_failed_requests"})
# What is read of an error reply: enough for its message, never a hostile server's gigabytes.
_ERROR_BODY_BYTES = 64 * 1024

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
    timeout:
        The most seconds one call may take, from sending the request to the last byte of the
        reply (a stream's included), retries included; past it the call raises `EngineError`.
    max_response_bytes:
        The most bytes one reply may have; a larger or endless one raises `EngineError`
        without being read further.
    max_retries:
        How many times a request the server answered "busy" (429, 503) is sent again, after
        the wait its Retry-After asks for (or 0.5 s, 1 s, 2 s, ...) where that fits `timeout`.
    max_concurrency:
        The most requests `complete_batch` / `generate_batch` have in flight at once.

    Redirects are not followed: the api key and the prompt go to `base_url`'s origin only.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        dialect: Dialect = "structgen",
        timeout: float = 600.0,
        max_response_bytes: int = 64 * 1024 * 1024,
        max_retries: int = 2,
        max_concurrency: int = 32,
    ):
        _check_limits(timeout, max_response_bytes, max_retries)
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.model_name = model
        self.dialect = dialect
        self.timeout, self.max_response_bytes, self.max_retries = timeout, max_response_bytes, max_retries
        self.max_concurrency = max_concurrency
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=self._headers, follow_redirects=False)
        # An async client belongs to one event loop: one per loop, so a loop's calls reuse its
        # connections (a TLS handshake a call otherwise); dropped with its loop.
        self._async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary())

    def close(self) -> None:
        """Close the connections (the async ones are dropped: `aclose` closes this loop's)."""
        self._client.close()
        self._async_clients.clear()

    async def aclose(self) -> None:
        """`close`, closing the running event loop's connections first."""
        client = self._async_clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()
        self.close()

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
        wire = self._generation_wire(output_type, prompt, max_tokens, temperature, top_p, top_k, seed, jump_forward,
                                     close_at_budget, loop_guards, reasoning, max_reasoning_tokens, chat, tools, strict,
                                     repair)
        sent_at = time.perf_counter()
        return self._completion(wire, self._fetch_json(wire.path, wire.body), sent_at)

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
        wire = self._generation_wire(output_type, prompt, max_tokens, temperature, top_p, top_k, seed, jump_forward,
                                     close_at_budget, loop_guards, reasoning, max_reasoning_tokens, chat, tools, strict,
                                     repair)
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
    @checked_keywords
    async def acomplete(
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
        """`complete` for asyncio, on the running loop (no worker thread): cancelling the task
        (or a `wait_for` timeout) closes the connection at once, which the server takes as a
        cancellation."""
        wire = self._generation_wire(output_type, prompt, max_tokens, temperature, top_p, top_k, seed, jump_forward,
                                     close_at_budget, loop_guards, reasoning, max_reasoning_tokens, chat, tools, strict,
                                     repair)
        sent_at = time.perf_counter()
        return self._completion(wire, await self._afetch_json(wire.path, wire.body), sent_at)

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
        listed = self._expect(self._fetch_json("/models"), dict, "a JSON object")
        ids = []
        for model in self._expect(listed.get("data"), list, '"data", a list of models'):
            ids.append(self._expect(self._expect(model, dict, "each model an object").get("id"), str, "a model id"))
        return ids

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
        from structgen.tools import ToolCalls

        by_name = {t.name: t for t in tools}
        body: dict[str, Any] = {
            "model": self.model_name,
            "messages": messages,
            "tools": [t.to_openai() for t in tools],
            "tool_choice": tool_choice,
            "parallel_tool_calls": parallel_tool_calls,
            **self._sampling(max_tokens, temperature, top_p, top_k, seed, None),
        }
        data = self._fetch_json("/chat/completions", body)
        message, text, finish_reason = self._first_choice(data, chat=True)
        if finish_reason == "length":
            if tool_choice == "none":  # a plain text answer: cut, as `str` is in-process
                return ToolCalls([], text or "", data, "length")
            raise IncompleteOutputError(f"tool call hit max_tokens={max_tokens}; raise max_tokens", partial_text=text or "")
        listed = self._expect(message.get("tool_calls") or [], list, '"tool_calls", a list')
        calls = [self._tool_call(call, by_name) for call in listed]
        return ToolCalls(calls, None if calls else text, data)

    def _tool_call(self, call: Any, by_name: dict[str, Any]) -> ToolCall:
        """One call of a reply, its arguments validated into the tool's arguments model: a
        call the model got wrong is an `OutputValidationError`, one the server garbled an
        `EngineError`."""
        from structgen.tools import ToolCall

        fn = self._expect(self._expect(call, dict, "each tool call an object").get("function"), dict,
                          'a tool call\'s "function", an object')
        name = self._expect(fn.get("name"), str, "a tool call's function name, a string")
        arguments = self._expect(fn.get("arguments"), str, "a tool call's arguments, a JSON string")
        tool = by_name.get(name)
        if tool is None:
            raise OutputValidationError(f"{self.base_url} returned a call of unknown tool {_excerpt(name, 60)}; "
                                        f"the tools offered were {sorted(by_name)}", text=json.dumps(call))
        try:
            args = json.loads(arguments)
        except (ValueError, RecursionError) as e:
            raise OutputValidationError(f"in the reply of {self.base_url}, the arguments of {name!r} are not JSON: "
                                        f"{_excerpt(arguments)}", text=arguments) from e
        if not isinstance(args, dict):
            raise OutputValidationError(f"in the reply of {self.base_url}, the arguments of {name!r} are not a JSON object: "
                                        f"{_excerpt(arguments)}", text=arguments)
        call_id = call.get("id") if isinstance(call.get("id"), str) else tool_format.new_call_id()
        return ToolCall(name, tool.validate(args), tool, call_id)

    # -- wire format ------------------------------------------------------------------------
    def _generation_wire(
        self, output_type: Any, prompt: Prompt, max_tokens: int, temperature: float, top_p: float, top_k: int,
        seed: int | None, jump_forward: bool | None, close_at_budget: bool, loop_guards: bool, reasoning: bool | None,
        max_reasoning_tokens: int | None, chat: bool | None, tools: list[dict[str, Any]] | None, strict: bool,
        repair: int,
    ) -> _WireRequest:  # fmt: skip
        """The request of one generation (`complete`, `acomplete`, `stream`), its keywords checked."""
        _no_remote_repair(repair)
        wire = self._wire_request(output_type, prompt, chat, tools, strict)
        wire.body.update(self._sampling(max_tokens, temperature, top_p, top_k, seed, jump_forward))
        wire.body.update(self._guards(close_at_budget, loop_guards))
        wire.body.update(self._reasoning(reasoning, max_reasoning_tokens))
        return wire

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

    # -- the HTTP exchange: every reply bounded in time and bytes ------------------------------
    def _fetch_json(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON reply to a POST of `body` (a GET where None), read within the limits."""
        with self._open(path, body, _Deadline(self.timeout)) as resp:
            reply = _ReplyText(self, resp)
            text = "".join([reply.text(chunk) for chunk in resp.iter_bytes()]) + reply.text(b"", final=True)
        return self._body_json(resp, text)

    async def _afetch_json(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """`_fetch_json` on the running loop: a cancelled caller closes the connection as it leaves."""
        deadline = _Deadline(self.timeout)
        async with self._aopen(self._async_client(), path, body, deadline) as resp:
            reply, chunks = _ReplyText(self, resp), resp.aiter_bytes()
            pieces: list[str] = []
            while (chunk := await _next_chunk(chunks, deadline)) is not None:
                pieces.append(reply.text(chunk))
            text = "".join(pieces) + reply.text(b"", final=True)
        return self._body_json(resp, text)

    def _body_json(self, resp: httpx.Response, text: str) -> Any:
        kind = resp.headers.get("content-type", "no content-type")
        return self._json(text, f"answered {resp.status_code} with a body that is not JSON ({kind})")

    def _async_client(self) -> httpx.AsyncClient:
        """The running event loop's client (made on its first call)."""
        loop = asyncio.get_running_loop()
        client = self._async_clients.get(loop)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, follow_redirects=False)
            self._async_clients[loop] = client
        return client

    @contextlib.contextmanager
    def _open(self, path: str, body: dict[str, Any] | None, deadline: _Deadline) -> Iterator[httpx.Response]:
        """The response to a request, its body open for reading until `deadline` (see `_send`);
        network failures and the deadline raise `EngineError`."""
        self._check_open()
        with self._network_errors(deadline):
            resp = self._send(path, body, deadline)
            try:
                with _Watchdog(resp, deadline) as watchdog:
                    yield resp
                if watchdog.fired:  # the body may look whole: one that ends at the close ends where it was cut
                    raise TimeoutError
            finally:
                resp.close()

    def _send(self, path: str, body: dict[str, Any] | None, deadline: _Deadline) -> httpx.Response:
        """The first response under 300 to a request, unread: sent again while the server is
        busy; any other status raises what it stands for."""
        attempt = 0
        while True:
            resp = self._client.send(self._request(self._client, path, body, deadline), stream=True)
            if resp.status_code < 300:
                return resp
            with _Watchdog(resp, deadline), contextlib.closing(resp):
                head = _head(resp.iter_bytes())
            time.sleep(self._retry_delay(resp, head, attempt, deadline))
            attempt += 1

    @contextlib.asynccontextmanager
    async def _aopen(self, client: httpx.AsyncClient, path: str, body: dict[str, Any] | None,
                     deadline: _Deadline) -> AsyncIterator[httpx.Response]:
        """`_open` on an async client: read its body with `_next_chunk`, which keeps to `deadline`."""
        self._check_open()
        with self._network_errors(deadline):
            resp = await self._asend(client, path, body, deadline)
            try:
                yield resp
            finally:
                await resp.aclose()

    async def _asend(self, client: httpx.AsyncClient, path: str, body: dict[str, Any] | None,
                     deadline: _Deadline) -> httpx.Response:
        attempt = 0
        while True:
            resp = await client.send(self._request(client, path, body, deadline), stream=True)
            if resp.status_code < 300:
                return resp
            try:
                with anyio.fail_after(deadline.left()):
                    head = await _ahead(resp.aiter_bytes())
            finally:
                await resp.aclose()
            await anyio.sleep(self._retry_delay(resp, head, attempt, deadline))
            attempt += 1

    def _request(self, client: httpx.Client | httpx.AsyncClient, path: str, body: dict[str, Any] | None,
                 deadline: _Deadline) -> httpx.Request:
        """A POST of `body` (a GET where None); until the headers come back, each of connecting,
        sending and waiting is bounded by the time left."""
        method = "GET" if body is None else "POST"
        return client.build_request(method, path, json=body, timeout=httpx.Timeout(max(deadline.left(), 1e-3)))

    def _retry_delay(self, resp: httpx.Response, head: bytes, attempt: int, deadline: _Deadline) -> float:
        """Seconds to wait before sending a refused request again: what a busy server's
        Retry-After asks (else a backoff), while a retry and the time are left; otherwise
        raises the error the response stands for, `head` being its body's first bytes."""
        code = _error_message(head)[1]
        if resp.status_code not in _BUSY_STATUSES or (isinstance(code, str) and code in _NOT_TRANSIENT):
            raise self._refusal(resp, head)
        delay = _retry_after(resp.headers.get("retry-after"), default=0.5 * 2**attempt)
        if attempt < self.max_retries and delay < deadline.left():
            return delay
        if attempt < self.max_retries:
            note = (f" (it asks to wait {delay:g} s, more than is left of timeout={self.timeout:g} s): try again "
                    "later, or raise timeout")
        else:
            note = (f" (answered {resp.status_code} {attempt + 1} times, max_retries={self.max_retries}): the "
                    "server is busy or limits this key's rate; send fewer requests at once (max_concurrency), "
                    "or raise max_retries")
        raise self._refusal(resp, head, note)

    def _refusal(self, resp: httpx.Response, head: bytes, note: str = "") -> StructgenError:
        """The structgen exception for a response from 300 on, `head` being its body's first
        bytes. Redirects are refused, not followed: the api key and the prompt go to base_url only."""
        if resp.status_code < 400:
            where = _clip(resp.headers.get("location", "nowhere"), 300)
            return EngineError(f"{self.base_url} returned {resp.status_code}: a redirect to {where}; redirects "
                               "are not followed (the api key and the prompt go to base_url only): set base_url "
                               "to the API's own address")
        message, code = _error_message(head)
        return self._error(resp.status_code, message, code, note)

    @contextlib.contextmanager
    def _network_errors(self, deadline: _Deadline) -> Iterator[None]:
        """httpx's failures, and the deadline passing, as `EngineError`s that say which."""
        try:
            yield
        except (httpx.HTTPError, TimeoutError) as e:
            if isinstance(e, (httpx.TimeoutException, TimeoutError)) or deadline.left() == 0:
                raise EngineError(
                    f"no complete reply from {self.base_url} within timeout={self.timeout:g} s (retries "
                    "included): the server is slow, stalled or sending slowly; raise timeout= if it is only slow"
                ) from e
            if isinstance(e, httpx.ConnectError):
                raise EngineError(f"cannot reach {self.base_url}: {e}; check base_url and that the server is up") from e
            raise EngineError(f"the connection to {self.base_url} broke off: {e}") from e

    # -- what came back -------------------------------------------------------------------------
    def _json(self, text: str, problem: str) -> Any:
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as e:
            raise EngineError(f"{self.base_url} {problem}: {_excerpt(text)}; check that base_url is the API root "
                              "of an OpenAI-compatible server (…/v1)") from e

    def _expect(self, value: Any, kind: type | tuple[type, ...], what: str) -> Any:
        """`value` where it is a `kind`; else the server does not speak OpenAI's protocol."""
        if isinstance(value, kind):
            return value
        raise EngineError(f"{self.base_url} sent something that is not an OpenAI-compatible reply: expected {what}, "
                          f"got {_excerpt(json.dumps(value))}; check that base_url is the API root of an "
                          "OpenAI-compatible server (…/v1)")

    def _first_choice(self, data: Any, chat: bool) -> tuple[dict[str, Any], str | None, str | None]:
        """(message, its text, finish_reason) of a completion's first choice (the choice itself
        is the message of a text completion)."""
        data = self._expect(data, dict, "a JSON object")
        choices = self._expect(data.get("choices"), list, '"choices", a list')
        choice = self._expect(choices[0] if choices else None, dict, "choices[0], an object")
        message = self._expect(choice.get("message"), dict, "choices[0].message, an object") if chat else choice
        text = self._expect(message.get("content" if chat else "text"), (str, type(None)), "the text, a string or null")
        finish_reason = self._expect(choice.get("finish_reason"), (str, type(None)), "finish_reason, a string or null")
        return message, text, finish_reason

    def _completion(self, wire: _WireRequest, data: Any, sent_at: float) -> Completion[Any, RemoteStats]:
        """The validated `Completion` of a whole (not streamed) reply to `wire`, sent at `sent_at`."""
        message, text, finish_reason = self._first_choice(data, chat=wire.path == "/chat/completions")
        stats = _usage_stats(data.get("usage"), wall_s=time.perf_counter() - sent_at)
        refusal = message.get("refusal")
        return self._finish(wire, text or "", finish_reason, stats, _reasoning_of(message),
                            refusal if isinstance(refusal, str) else None)

    def _finish(self, wire: _WireRequest, text: str, finish_reason: str | None, stats: RemoteStats,
                reasoning: str | None = None, refusal: str | None = None) -> Completion[Any, RemoteStats]:
        """The reply as a validated `Completion`; a refusal with no text (OpenAI's `refusal`
        field) raises `OutputValidationError` quoting it; truncation raises as in-process, except
        for free text, which comes back cut with finish_reason "length" (as OpenAI does)."""
        if refusal and not text:
            raise OutputValidationError(f"the model behind {self.base_url} refused: {_excerpt(refusal)}", stats=stats)
        if finish_reason == "length":
            if wire.constraint.kind == "text":
                return Completion(text, text, [], "length", stats, reasoning=reasoning)
            raise IncompleteOutputError(
                "generation hit max_tokens before the output was complete; raise max_tokens",
                partial_text=text,
                stats=stats,
            )
        try:
            parsed = _unwrapped_text(text, wire.unwrap) if wire.unwrap else text
            value = wire.constraint.parse(parsed)
        except OutputValidationError as e:
            why = (f"strict=False left {', '.join(wire.constraint.relaxed)} to be checked here, not by the server"
                   if wire.constraint.relaxed else "the server did not hold its output to the constraint sent: "
                   f"check that it supports structured output as dialect={self.dialect!r} sends it")
            raise OutputValidationError(f"{self.base_url} returned text that does not match the requested type "
                                        f"({_clip(str(e), 300)}); {why}. The text was {_excerpt(text)}",
                                        text=text, stats=stats) from e
        return Completion(value, parsed, [], finish_reason or "stop", stats, wire.constraint.relaxed,
                          reasoning=reasoning)

    def _error(self, status: int | None, message: str, code: Any, note: str = "") -> StructgenError:
        """The structgen exception for an error the server reported (`status` is None for an
        error event inside a stream, after the response status was sent)."""
        where = f"{self.base_url} returned {status}" if status else f"{self.base_url} stream failed"
        message = f"{where}: {_clip(message, 500)}{note}"
        cls = _ERROR_CODES.get(str(code))
        if cls is None:
            if status == 404:
                cls = ModelNotFoundError
            elif status in (401, 403):
                cls, message = InvalidParameterError, message + " (check api_key: the server refused it)"
            elif status and status < 500 and "context length" in message.lower():
                cls = PromptTooLongError
            elif status and status < 500 and status not in _BUSY_STATUSES:
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
        llm, sent_at = self._llm, time.perf_counter()
        with llm._open(self._wire.path, self._wire.body, _Deadline(llm.timeout)) as resp:
            events = _StreamEvents(llm, self._wire, _ReplyText(llm, resp), resp.headers.get("content-type"), sent_at)
            for chunk in resp.iter_bytes():
                yield from events.feed(chunk)
                if events.done:  # what follows [DONE], if anything, is not read
                    break
        yield from events.feed(b"", final=True)
        self.completion = events.completion()

    async def _aread(self) -> AsyncIterator[str]:
        llm, sent_at, deadline = self._llm, time.perf_counter(), _Deadline(self._llm.timeout)
        async with llm._aopen(llm._async_client(), self._wire.path, self._wire.body, deadline) as resp:
            reply = _ReplyText(llm, resp)
            events = _StreamEvents(llm, self._wire, reply, resp.headers.get("content-type"), sent_at)
            chunks = resp.aiter_bytes()
            while not events.done and (chunk := await _next_chunk(chunks, deadline)) is not None:
                for delta in events.feed(chunk):
                    yield delta
        for delta in events.feed(b"", final=True):
            yield delta
        self.completion = events.completion()


class _Deadline:
    """When a call must be done, on the monotonic clock."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())


class _Watchdog:
    """Shuts a sync reply's socket when its deadline passes, which ends a read that waits on a
    silent or trickling server: httpx's timeouts bound each read, not the reply."""

    def __init__(self, resp: httpx.Response, deadline: _Deadline):
        stream = resp.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        self._timer = threading.Timer(deadline.left(), self._fire, (sock,)) if sock is not None else None
        self.fired = False

    def __enter__(self) -> _Watchdog:
        if self._timer is not None:
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _fire(self, sock: socket.socket) -> None:
        self.fired = True
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class _ReplyText:
    """A reply's body as text, chunk by chunk: counted against `max_response_bytes` and decoded
    as strict UTF-8 (a server's reply is trusted to be neither small nor text), and split into
    lines for event streams."""

    def __init__(self, llm: RemoteLLM, resp: httpx.Response):
        self._llm = llm
        self._left = llm.max_response_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._line: list[str] = []  # the pieces of the line not yet ended
        if int(resp.headers.get("content-length", 0)) > self._left:
            raise self._too_big()

    def text(self, chunk: bytes, final: bool = False) -> str:
        self._left -= len(chunk)
        if self._left < 0:
            raise self._too_big()
        try:
            return self._decoder.decode(chunk, final)
        except UnicodeDecodeError as e:
            raise EngineError(f"{self._llm.base_url} sent bytes that are not UTF-8 text ({e.reason}); check the "
                              "server, or the proxy in between") from e

    def lines(self, chunk: bytes, final: bool = False) -> list[str]:
        """The lines `chunk` ends (and where `final`, the last one, ended or not)."""
        self._line.append(self.text(chunk, final))
        if "\n" not in self._line[-1] and not final:
            return []
        *lines, rest = "".join(self._line).split("\n")
        self._line = [rest]
        return [line.removesuffix("\r") for line in (lines + [rest] if final else lines)]

    def _too_big(self) -> EngineError:
        return EngineError(f"{self._llm.base_url} sent a reply of more than max_response_bytes="
                           f"{self._llm.max_response_bytes} bytes; raise max_response_bytes where replies that "
                           "long are meant (a large max_tokens), else check the server")


@dataclass
class _StreamEvents:
    """Reads a server-sent event stream: the text so far (and the thinking, from
    `reasoning_content` deltas), the finish reason, the usage chunk and the client-side times.
    A stream is whole once it says `[DONE]` or gives a finish reason. A chat stream's `refusal`
    deltas are kept apart from the text, to be reported as the whole reply's refusal is."""

    llm: RemoteLLM
    wire: _WireRequest
    reply: _ReplyText
    content_type: str | None
    sent_at: float
    pieces: list[str] = field(default_factory=list)
    thinking: list[str] | None = None
    refusal: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    first_text_at: float | None = None
    done: bool = False  # `data: [DONE]` came

    def feed(self, chunk: bytes, final: bool = False) -> list[str]:
        """The deltas of the events `chunk` ends: `ReasoningDelta`s of thinking, then the
        answer's text (none once the stream said `[DONE]`)."""
        if self.done:
            return []
        return [delta for line in self.reply.lines(chunk, final) for delta in self._event(line)]

    def _event(self, line: str) -> list[str]:
        if not line.startswith("data:") or self.done:
            return []
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self.done = True
            return []
        event = self.llm._expect(self.llm._json(data, "sent a stream event that is not JSON"), dict, "an event object")
        if "error" in event:
            err = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
            raise self.llm._error(None, str(err.get("message")), err.get("code"))
        self.usage = event.get("usage") or self.usage
        delta, thought = "", ""
        for choice in self.llm._expect(event.get("choices") or [], list, '"choices", a list'):
            part, reasoning = self._choice_delta(choice)
            delta, thought = delta + part, thought + reasoning
        if delta or thought:
            self.first_text_at = self.first_text_at or time.perf_counter()
        if thought:
            self.thinking = self.thinking if self.thinking is not None else []
            self.thinking.append(thought)
        if delta:
            self.pieces.append(delta)
        return [d for d in (ReasoningDelta(thought), delta) if d]

    def _choice_delta(self, choice: Any) -> tuple[str, str]:
        """(text, thinking) of one choice of an event: a chat `delta`, or a completion's `text`;
        notes its finish reason and its piece of a refusal."""
        expect = self.llm._expect
        choice = expect(choice, dict, "each choice an object")
        part = expect(choice["delta"], dict, "a choice's delta, an object") if "delta" in choice else choice
        if isinstance(part.get("refusal"), str):
            self.refusal.append(part["refusal"])
        text = expect(part.get("content" if "delta" in choice else "text"), (str, type(None)), "the text, a string or null")
        finish_reason = expect(choice.get("finish_reason"), (str, type(None)), "finish_reason, a string or null")
        self.finish_reason = finish_reason or self.finish_reason
        return text or "", _reasoning_of(part) or ""

    def completion(self) -> Completion[Any, RemoteStats]:
        if not (self.done or self.finish_reason):
            raise EngineError(f"the event stream from {self.llm.base_url} ended before the server finished it (no "
                              f"finish_reason, no [DONE]; content-type {self.content_type!r}): the connection was "
                              "cut, or the server does not stream")
        end = time.perf_counter()
        stats = _usage_stats(self.usage, wall_s=end - self.sent_at)
        if self.first_text_at is not None:
            stats.ttft_s, stats.decode_s = self.first_text_at - self.sent_at, end - self.first_text_at
        thinking = None if self.thinking is None else "".join(self.thinking)
        return self.llm._finish(self.wire, "".join(self.pieces), self.finish_reason, stats, thinking,
                                "".join(self.refusal))


def _reasoning_of(message: dict[str, Any]) -> str | None:
    """A message's (or delta's) thinking: `reasoning_content` (DeepSeek, vLLM, structgen), or
    `reasoning` (newer vLLM)."""
    text = message.get("reasoning_content") or message.get("reasoning")
    return text if isinstance(text, str) else None


def _usage_stats(usage: Any, wall_s: float) -> RemoteStats:
    """Stats from an OpenAI `usage` object and the wall time; a count that is missing or not a
    whole number is None (unknown: statistics are no reason to fail a reply)."""
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return RemoteStats(prompt_tokens=_count(usage.get("prompt_tokens")), output_tokens=_count(usage.get("completion_tokens")),
                       cached_prompt_tokens=_count(cached), wall_s=wall_s)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_limits(timeout: float, max_response_bytes: int, max_retries: int) -> None:
    """Refuse limits that do not bound: each names what it limits."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise InvalidParameterError(f"timeout must be a number of seconds above 0 (the most one call may take), "
                                    f"got {timeout!r}")
    if isinstance(max_response_bytes, bool) or not isinstance(max_response_bytes, int) or max_response_bytes < 1:
        raise InvalidParameterError(f"max_response_bytes must be a whole number of bytes, 1 or more, got "
                                    f"{max_response_bytes!r}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise InvalidParameterError(f"max_retries must be a whole number, 0 or more, got {max_retries!r}")


def _head(chunks: Iterator[bytes]) -> bytes:
    """The first `_ERROR_BODY_BYTES` of a body."""
    head = b""
    for chunk in chunks:
        head += chunk
        if len(head) >= _ERROR_BODY_BYTES:
            break
    return head[:_ERROR_BODY_BYTES]


async def _ahead(chunks: AsyncIterator[bytes]) -> bytes:
    head = b""
    async for chunk in chunks:
        head += chunk
        if len(head) >= _ERROR_BODY_BYTES:
            break
    return head[:_ERROR_BODY_BYTES]


async def _next_chunk(chunks: AsyncIterator[bytes], deadline: _Deadline) -> bytes | None:
    """The next chunk of an async body (None at its end), waited for until `deadline` only."""
    with anyio.fail_after(deadline.left()):
        return await anext(chunks, None)


def _retry_after(value: str | None, default: float) -> float:
    """The seconds a Retry-After header asks for (a number, or an HTTP date), else `default`."""
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return default
    return max(0.0, seconds) if math.isfinite(seconds) else default


def _error_message(head: bytes) -> tuple[str, Any]:
    """(message, code) of an error body: OpenAI's `{"error": {"message", "code"}}`, else its text."""
    text = head.decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error")
    except (ValueError, RecursionError, AttributeError):
        return text, None
    if isinstance(err, dict):
        return str(err.get("message") or text), err.get("code")
    return str(err or text), None


def _clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, its control characters escaped: a server's words,
    fit for a one-line error message."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return shown + ("…" if len(text) > limit else "")


def _excerpt(text: str, limit: int = 200) -> str:
    """`text` quoted and cut to `limit` characters (a reply can be megabytes long)."""
    return repr(text[:limit]) + (f"… ({len(text)} characters)" if len(text) > limit else "")


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
