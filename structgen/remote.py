"""`RemoteLLM`: the `LLM` API (`generate`, `complete`, `generate_batch`, `call`) against any
OpenAI-compatible server — structgen's own, vLLM, SGLang.

The output type becomes a `Constraint` locally, exactly as in-process; JSON types travel as
`response_format={"type": "json_schema", ..., "strict": true}` (every server knows it), regexes,
grammars and choices through the extension fields of the server's dialect. The reply is parsed
and validated locally with `Constraint.parse`, so a server that ignored the constraint cannot
hand back an invalid value: it raises `OutputValidationError` instead.

    llm = structgen.LLM.remote("http://127.0.0.1:8000/v1", "SmolLM2-135M-Instruct")
    invoice = llm.generate(Invoice, "Extract the invoice: ...")
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx

from structgen.api import Completion
from structgen.engine.request import GenerationStats
from structgen.errors import (
    EngineError,
    IncompleteOutputError,
    InvalidConstraintError,
    InvalidParameterError,
    ModelNotFoundError,
    PromptTooLongError,
    StructgenError,
    UnsupportedSchemaError,
    UnsupportedTypeError,
)
from structgen.types import Choice, Constraint, to_constraint

Prompt = str | Sequence[dict[str, Any]]
Dialect = Literal["structgen", "vllm", "sglang", "openai"]

# error `code`s our server sends -> the exception the in-process API would have raised
_ERROR_CODES: dict[str, type[StructgenError]] = {
    "unsupported_schema": UnsupportedSchemaError,
    "invalid_constraint": InvalidConstraintError,
    "unsupported_type": UnsupportedTypeError,
    "invalid_parameter": InvalidParameterError,
    "context_length_exceeded": PromptTooLongError,
    "model_not_found": ModelNotFoundError,
}


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
        "sglang" (top-level `regex`/`ebnf`), "openai" (JSON schemas only).
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
        chat: bool | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> Completion:
        """Generate one output of `output_type` on the server; same contract as `LLM.complete`
        (raises `IncompleteOutputError` on truncation, returns a validated value)."""
        constraint = to_constraint(output_type)
        path, body = self._request_body(output_type, constraint, prompt, chat, tools)
        body.update(self._sampling(max_tokens, temperature, top_p, top_k, seed, jump_forward))
        t0 = time.perf_counter()
        try:
            resp = self._client.post(path, json=body)
        except httpx.HTTPError as e:
            raise EngineError(f"cannot reach {self.base_url}: {e}") from e
        return self._completion(resp, constraint, path, time.perf_counter() - t0)

    def generate(self, output_type: Any, prompt: Prompt, **kw: Any) -> Any:
        """Generate and return just the typed value."""
        return self.complete(output_type, prompt, **kw).value

    def complete_batch(self, output_type: Any, prompts: Sequence[Prompt], **kw: Any) -> list[Completion]:
        """Send the prompts concurrently (the server batches them); results in prompt order."""
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(prompts)))) as pool:
            return list(pool.map(lambda p: self.complete(output_type, p, **kw), prompts))

    def generate_batch(self, output_type: Any, prompts: Sequence[Prompt], **kw: Any) -> list[Any]:
        return [c.value for c in self.complete_batch(output_type, prompts, **kw)]

    async def acomplete(self, output_type: Any, prompt: Prompt, **kw: Any) -> Completion:
        """`complete` for asyncio (a worker thread per call; httpx's sync client is thread-safe)."""
        return await asyncio.to_thread(lambda: self.complete(output_type, prompt, **kw))

    async def agenerate(self, output_type: Any, prompt: Prompt, **kw: Any) -> Any:
        return (await self.acomplete(output_type, prompt, **kw)).value

    def call(self, prompt: Prompt, tools: Sequence[Any], **kw: Any) -> Any:
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
        resp = self._post("/chat/completions", body)
        choice = resp.json()["choices"][0]
        if choice.get("finish_reason") == "length":
            text = choice["message"].get("content") or ""
            raise IncompleteOutputError(f"tool call hit max_tokens={max_tokens}; raise max_tokens", partial_text=text)
        calls = []
        for tc in choice["message"].get("tool_calls") or []:
            fn = tc["function"]
            tool = by_name.get(fn["name"])
            if tool is None:
                raise StructgenError(f"server returned a call of unknown tool {fn['name']!r}")
            calls.append(ToolCall(fn["name"], tool.validate(json.loads(fn["arguments"])), tool, tc.get("id") or ""))
        return ToolCalls(calls, None if calls else choice["message"].get("content"), resp.json())

    # -- wire format ------------------------------------------------------------------------
    def _request_body(
        self, output_type: Any, constraint: Constraint, prompt: Prompt, chat: bool | None, tools: list[dict] | None
    ) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.model_name}
        if isinstance(prompt, str) and chat is False:
            path = "/completions"
            body["prompt"] = prompt
        else:
            path = "/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if tools:
                body["tools"], body["tool_choice"] = tools, "none"
        body.update(self._constraint_fields(output_type, constraint))
        return path, body

    def _constraint_fields(self, output_type: Any, constraint: Constraint) -> dict[str, Any]:
        """The request fields carrying `constraint` in this server's dialect."""
        if constraint.kind == "text":
            return {}
        if constraint.kind == "json_schema":
            name = getattr(output_type, "__name__", "output")
            name = "".join(c if c.isalnum() or c in "_-" else "_" for c in name)[:64] or "output"
            schema = json.loads(constraint.source)
            return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}}
        options = None  # a Choice of strings travels as a choice list, anything else as regex
        if isinstance(output_type, Choice) and all(isinstance(o, str) for o in output_type.options):
            options = list(output_type.options)
        if self.dialect == "openai":
            raise UnsupportedSchemaError(
                f"{constraint.kind} constraints need a server with structured-output extensions; "
                "this RemoteLLM uses dialect='openai' (JSON schemas only)",
                keyword=constraint.kind,
            )
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
        fields: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        if top_k:
            fields["top_k"] = top_k
        if seed is not None:
            fields["seed"] = seed
        if jump_forward is not None and self.dialect == "structgen":
            fields["jump_forward"] = jump_forward
        return fields

    def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            resp = self._client.post(path, json=body)
        except httpx.HTTPError as e:
            raise EngineError(f"cannot reach {self.base_url}: {e}") from e
        self._raise_for_error(resp)
        return resp

    def _completion(self, resp: httpx.Response, constraint: Constraint, path: str, wall_s: float) -> Completion:
        self._raise_for_error(resp)
        data = resp.json()
        choice = data["choices"][0]
        if path == "/chat/completions":
            text = choice["message"].get("content") or ""
        else:
            text = choice.get("text") or ""
        usage = data.get("usage") or {}
        stats = GenerationStats(
            prompt_tokens=usage.get("prompt_tokens", 0), output_tokens=usage.get("completion_tokens", 0), decode_s=wall_s
        )
        if choice.get("finish_reason") == "length":
            raise IncompleteOutputError(
                "generation hit max_tokens before the output was complete; raise max_tokens", partial_text=text
            )
        return Completion(constraint.parse(text), text, [], "stop", stats)

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
        message = f"{self.base_url} returned {resp.status_code}: {message}"
        cls = _ERROR_CODES.get(str(code))
        if cls is None:
            if resp.status_code == 404:
                cls = ModelNotFoundError
            elif resp.status_code < 500 and "context length" in message.lower():
                cls = PromptTooLongError
            elif resp.status_code < 500:
                cls = InvalidParameterError
            else:
                cls = EngineError
        raise cls(message)
