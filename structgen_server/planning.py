"""A request -> the jobs to run (one per choice), checked and bounded before any decoding:
the model name, parameters the server cannot honour, the reasoning fields (`reasoning_effort` as
a reasoning budget; a budget for a request that will not reason refused), misspelled constraint
fields, the number of generations, the prompt's length in characters (before tokenizing), its constraint built and
compiled and its prompt rendered and tokenized (once) in worker threads (so the event loop stays free
for other requests), then its length in tokens against the context.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from structgen import tool_format
from structgen.arguments import EncodedPrompt
from structgen.errors import StructgenError
from structgen_server import serving
from structgen_server.constraints import RequestConstraint, request_constraint
from structgen_server.engine_client import EngineClient, MetricsRelay
from structgen_server.errors import APIError, to_api_error
from structgen_server.metrics import Metrics
from structgen_server.protocol import (
    REASONING_EFFORT_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)

# a token is rarely longer than this many characters, so a prompt of more characters than the
# context's tokens times this can never fit: refused before any tokenizing
MAX_CHARS_PER_TOKEN = 32
DEFAULT_MAX_GENERATIONS = 128


@dataclass
class ServerState:
    """What every handler needs: the LLM, the names it answers to, limits and metrics."""

    llm: Any
    model_name: str
    aliases: frozenset[str]
    default_max_tokens: int
    max_generations: int
    metrics: Metrics | MetricsRelay
    # a stop signal arrived (draining.py): new requests are refused, and one cancelled from now
    # on is the drain running out, answered 503 rather than taken for a client that went away
    stopping: bool = False

    def mark_stopping(self) -> None:
        self.stopping = True

    @property
    def max_seq_len(self) -> int:
        if isinstance(self.llm, EngineClient):
            return self.llm.facts.max_seq_len
        return int(self.llm.engine.max_seq_len)

    @property
    def model_thinks(self) -> bool:
        """Whether the model reasons unasked (its chat template writes think tags); any model
        reasons when a request sets `reasoning`."""
        if isinstance(self.llm, EngineClient):
            return self.llm.facts.template_thinks
        return bool(self.llm.engine.reasoner.template_thinks)


def check_model(state: ServerState, model: str) -> None:
    if model not in state.aliases:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


_UNSUPPORTED_WHY = {
    "presence_penalty": " (only 0)", "frequency_penalty": " (only 0)",
    "logprobs": " (it returns no logprobs)", "top_logprobs": " (it needs logprobs, which this server does not return)",
}  # fmt: skip


def _check_supported(body: SamplingFields) -> None:
    """Refuse OpenAI parameters we cannot honour rather than silently ignoring them."""
    logprobs = getattr(body, "logprobs", None)
    unsupported = {
        "presence_penalty": body.presence_penalty not in (None, 0, 0.0),
        "frequency_penalty": body.frequency_penalty not in (None, 0, 0.0),
        "logit_bias": bool(body.logit_bias),
        # chat's is a bool (False asks for nothing); completions' an int (0 still asks for the
        # sampled tokens' logprobs)
        "logprobs": logprobs is True or (isinstance(body, CompletionRequest) and logprobs is not None),
        "top_logprobs": bool(getattr(body, "top_logprobs", None)),
        "echo": bool(getattr(body, "echo", False)),
        "suffix": getattr(body, "suffix", None) is not None,
        "best_of": getattr(body, "best_of", None) not in (None, 1),
    }
    for param, bad in unsupported.items():
        if bad:
            why = _UNSUPPORTED_WHY.get(param, "")
            raise APIError(400, f"{param} is not supported by this server{why}; drop {param}", param=param,
                           code="unsupported_parameter")
    n_prompts = len(body.prompts()) if isinstance(body, CompletionRequest) else 1
    if body.stream and (body.n > 1 or n_prompts > 1):
        raise APIError(400, "stream=true supports one prompt and n=1; send one prompt with n=1, or drop stream",
                       param="n" if body.n > 1 else "prompt", code="unsupported_parameter")
    _check_extras(body)
    _check_limits(body)


# fields of the other endpoint (or OpenAI's deprecated names), which this one would ignore:
# field -> the fix
_CHAT_ONLY = {name: "send the request to /v1/chat/completions (with `messages`)"
              for name in ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "messages",
                           "top_logprobs", "modalities", "audio", "web_search_options")}
_COMPLETIONS_ONLY = {name: "send the request to /v1/completions (with `prompt`)"
                     for name in ("prompt", "suffix", "echo", "best_of")}
_CHAT_UNSUPPORTED = {
    "functions": "it is OpenAI's deprecated name: send `tools` instead",
    "function_call": "it is OpenAI's deprecated name: send `tool_choice` instead",
    "audio": "this server generates text only; drop it",
    "web_search_options": "this server does not search the web; drop it",
}


def _check_extras(body: SamplingFields) -> None:
    """Refuse unknown fields that ask for something: another endpoint's fields, OpenAI's
    deprecated function-calling names and outputs other than text. Unknown fields that ask for
    nothing (vendor extras, `metadata`, `store`, null values) stay accepted."""
    chat = isinstance(body, ChatCompletionRequest)
    misplaced = _COMPLETIONS_ONLY if chat else _CHAT_ONLY
    extra = body.model_extra or {}
    for name in [*misplaced, *_CHAT_UNSUPPORTED, "modalities"]:  # in this order: `tools` before `tool_choice`
        value = extra.get(name)
        if value is None or value is False:
            continue
        message = _extra_refusal(name, value, chat, misplaced)
        if message:
            raise APIError(400, message, param=name, code="unsupported_parameter")


def _extra_refusal(name: str, value: Any, chat: bool, misplaced: dict[str, str]) -> str | None:
    """Why the unknown field `name` (sent with `value`) is refused; None: it is not."""
    if name in misplaced:
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        return f"{name} is not a field of {endpoint}, which would ignore it; {misplaced[name]}"
    if not chat:
        return None
    if name in _CHAT_UNSUPPORTED:
        return f"{name} is not supported by this server; {_CHAT_UNSUPPORTED[name]}"
    if name == "modalities" and not (isinstance(value, list) and all(m == "text" for m in value)):
        return 'modalities other than ["text"] are not supported; this server generates text only'
    return None


def _check_limits(body: SamplingFields) -> None:
    """Two budgets that disagree, and usage asked for a response that is not streamed."""
    if body.max_tokens is not None and body.max_completion_tokens not in (None, body.max_tokens):
        raise APIError(
            400,
            f"max_tokens={body.max_tokens} and max_completion_tokens={body.max_completion_tokens} disagree; "
            "send one of them (they mean the same budget here)",
            param="max_completion_tokens",
            code="conflicting_parameters",
        )
    if body.stream_options and body.stream_options.include_usage and not body.stream:
        raise APIError(
            400,
            "stream_options.include_usage needs stream=true (a response that is not streamed always "
            "carries usage); set stream or drop stream_options",
            param="stream_options.include_usage",
            code="invalid_parameter",
        )


def _check_size(state: ServerState, body: SamplingFields) -> None:
    """Refusals that need no tokenizing: a misspelled constraint field (which would silently
    give free text) and more generations than one request may ask for."""
    misspelled = body.misspelled_constraint_field()
    if misspelled:
        name, meant = misspelled
        raise APIError(
            400,
            f"unknown field {name!r}: did you mean {meant!r}? (as sent it would be ignored and "
            "the output left unconstrained)",
            param=name,
            code="unknown_field",
        )
    n_prompts = len(body.prompts()) if isinstance(body, CompletionRequest) else 1
    generations = n_prompts * body.n
    if generations > state.max_generations:
        raise APIError(
            400,
            f"this request asks for {generations} generations ({n_prompts} prompts x n={body.n}); "
            f"this server runs at most {state.max_generations} per request "
            "(--max-generations-per-request); split it into several requests",
            param="prompt" if n_prompts > 1 else "n",
            code="too_many_generations",
        )


def _check_prompt_chars(state: ServerState, prompt: str | list[dict[str, Any]], tools: Any, param: str) -> None:
    """Refuse, before rendering and tokenizing it, a prompt the context could never hold: more
    characters than `MAX_CHARS_PER_TOKEN` a token, or more messages than tokens (each message
    renders to one at least, and 250,000 empty ones cost the chat template 20 s of CPU)."""
    if isinstance(prompt, str):
        chars = len(prompt)
    else:
        if len(prompt) > state.max_seq_len:
            raise APIError(
                400,
                f"the conversation has {len(prompt)} messages, and each takes at least one token of this "
                f"model's maximum context length of {state.max_seq_len} tokens; send fewer messages",
                param=param,
                code="context_length_exceeded",
            )
        chars = sum(_message_chars(m) for m in prompt) + (len(json.dumps(tools)) if tools else 0)
    limit = state.max_seq_len * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise APIError(
            400,
            f"the prompt is {chars} characters, more than this model's maximum context length of "
            f"{state.max_seq_len} tokens can ever hold (at most {limit} characters); shorten the {param}",
            param=param,
            code="context_length_exceeded",
        )


def _message_chars(message: dict[str, Any]) -> int:
    """A message's text as the template renders it: its content and its past tool calls."""
    calls = message.get("tool_calls")
    return len(str(message.get("content") or "")) + (len(json.dumps(calls, ensure_ascii=False)) if calls else 0)


async def plan(state: ServerState, body: SamplingFields) -> tuple[list[serving.Job], RequestConstraint]:
    """The jobs (one per choice) a request asks for, fully validated before any decoding."""
    check_model(state, body.model)
    _check_supported(body)
    _check_size(state, body)
    reasoning = _reasoning(state, body)
    if isinstance(body, ChatCompletionRequest):
        prompts, chat, param = [_chat_messages(body)], True, "messages"
    else:
        prompts, chat, param = body.prompts(), False, "prompt"
    rc = request_constraint(body)
    for prompt in prompts:
        _check_prompt_chars(state, prompt, rc.tools, param)
    # The prompts are tokenized while the grammar compiles (as `LLM.acomplete` does): a burst of
    # new schemas waits for compiles, and its prompts need not queue behind them.
    encodes = [asyncio.ensure_future(_encode(state.llm, prompt, chat, rc.tools)) for prompt in prompts]
    try:
        output_type = await _prepare(state, rc)
        _check_partial(body, output_type, rc)
        encoded_prompts = [await _encoded(task, param, i, len(encodes)) for i, task in enumerate(encodes)]
    finally:
        await _settle(encodes)
    jobs = []
    for encoded in encoded_prompts:
        if not encoded.token_ids:
            raise APIError(400, "the prompt is empty; send at least one token of text", param=param,
                           code="empty_prompt")
        sampling = {**_sampling(state, body, len(encoded.token_ids), param), **reasoning}
        for j in range(body.n):
            # distinct but reproducible samples per choice, still a 64-bit seed
            seed = None if sampling["seed"] is None else sampling["seed"] ^ j
            job_sampling = {**sampling, "seed": seed}
            jobs.append(serving.Job(output_type, encoded, job_sampling, body.stop_strings()))
    return jobs, rc


async def _encoded(task: asyncio.Future[EncodedPrompt], param: str, index: int, count: int) -> EncodedPrompt:
    """A prompt's ids; its error names which prompt (`prompt.1` of a list) and is the first
    prompt's first, as they are awaited in order."""
    try:
        return await task
    except StructgenError as exc:
        raise to_api_error(exc, param=f"{param}.{index}" if count > 1 else param) from exc


async def _prepare(state: ServerState, rc: RequestConstraint) -> Any:
    """The request's output type prepared (off the event loop, on the compiler's bounded pool,
    cancelled if the client leaves); its errors surface as a 400 before decoding."""
    if rc.output_type is None:
        return str
    try:
        return await state.llm.aprepare(rc.output_type, strict=rc.strict)
    except Exception as exc:
        raise to_api_error(exc, param=rc.param) from exc


async def _settle(tasks: list[asyncio.Future[Any]]) -> None:
    """Cancel what is left of `tasks` (the request failed before it needed them) and collect
    every outcome, so none is reported as a never-retrieved exception."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _check_partial(body: SamplingFields, output_type: Any, rc: RequestConstraint) -> None:
    """`stream_options.include_partial` needs a stream of one JSON output (no tool calls)."""
    if not (body.stream_options and body.stream_options.include_partial):
        return
    param = "stream_options.include_partial"
    if not body.stream:
        raise APIError(400, f"{param} needs stream=true; set stream or drop stream_options", param=param,
                       code="invalid_parameter")
    if getattr(output_type, "kind", None) != "json_schema" or rc.param == "tools":
        raise APIError(
            400,
            f"{param} needs a JSON output: set response_format to a json_schema or json_object "
            "(or guided_json / structured_outputs.json), or drop include_partial",
            param=param,
            code="invalid_parameter",
        )


async def _encode(llm: Any, prompt: str | list[dict[str, Any]], chat: bool,
                  tools: list[dict[str, Any]] | None) -> EncodedPrompt:
    """The prompt as the engine gets it: rendered (with the tools, if any) and tokenized, once,
    off the event loop with the other requests' prompts of the same moment (`aencode_prompt`:
    a burst of agent turns learns their shared tool catalogue once)."""
    template_tools = None
    if tools or (chat and any(m.get("tool_calls") or m.get("role") == "tool" for m in prompt)):
        # past calls and results are written out even on a turn without `tools` (a final answer)
        prompt, template_tools = tool_format.render_messages(llm.tokenizer, prompt, tools)
    try:
        return EncodedPrompt(tuple(await llm.aencode_prompt(prompt, chat=chat, tools=template_tools)))
    except TemplateError as e:  # e.g. a template that wants alternating roles
        raise APIError(400, f"the model's chat template cannot render these messages: {e}", param="messages",
                       code="invalid_messages") from e


def _chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as plain dicts for the chat template."""
    out = []
    for i, m in enumerate(body.messages):
        if (part := m.unsupported_part()) is not None:
            raise APIError(400, f"content part type {part[1]!r} is not supported by this server; send text "
                           '(parts of type "text", or a string)', param=f"messages.{i}.content.{part[0]}.type",
                           code="unsupported_content")
        content = m.text()
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls:
            msg["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


def _sampling(state: ServerState, body: SamplingFields, prompt_tokens: int, param: str) -> dict[str, Any]:
    """`SamplingParams` fields for one request; OpenAI defaults (temperature 1). `param`: the
    field the prompt came from, named when it does not fit."""
    room = state.max_seq_len - prompt_tokens
    limit = body.token_limit()
    if room < 1 or (limit is not None and limit > room):
        asked = f"{prompt_tokens} prompt tokens" + (f" + max_tokens={limit}" if limit else "")
        raise APIError(
            400,
            f"this model's maximum context length is {state.max_seq_len} tokens, but the request "
            f"needs {asked}; shorten the {param} or lower max_tokens",
            param=param,
            code="context_length_exceeded",
        )
    top_k = body.top_k if body.top_k and body.top_k > 0 else 0
    return {
        "max_tokens": limit or min(state.default_max_tokens, room),
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": top_k,
        "seed": body.seed,
        "jump_forward": body.jump_forward,
        "close_at_budget": body.close_at_budget,
        "loop_guards": body.loop_guards,
    }


def _reasoning(state: ServerState, body: SamplingFields) -> dict[str, Any]:
    """The `SamplingParams` reasoning fields: `reasoning_effort` turned into them, and refused
    where it or `max_reasoning_tokens` would be ignored (the request would not reason) or
    contradicts the other fields."""
    effort, budget = body.reasoning_effort, body.max_reasoning_tokens
    if effort is not None and budget is not None:
        raise APIError(400, "reasoning_effort and max_reasoning_tokens both set the reasoning budget; send one of them",
                       param="reasoning_effort", code="conflicting_parameters")
    if effort == "none":
        if body.reasoning:
            raise APIError(400, 'reasoning_effort "none" turns reasoning off and reasoning=true turns it on; send '
                           "one of them", param="reasoning_effort", code="conflicting_parameters")
        return {"reasoning": False, "max_reasoning_tokens": None}
    if effort is not None:
        _check_reasons(state, body.reasoning, "reasoning_effort")
        budget = REASONING_EFFORT_TOKENS[effort]
    elif budget is not None:
        _check_reasons(state, body.reasoning, "max_reasoning_tokens")
    return {"reasoning": body.reasoning, "max_reasoning_tokens": budget}


def _check_reasons(state: ServerState, reasoning: bool | None, param: str) -> None:
    """Refuse `param`, a reasoning budget, for a request that will not reason."""
    if reasoning is False:
        raise APIError(400, f"{param} sets the reasoning budget, and reasoning=false turns reasoning off; drop one "
                       "of them", param=param, code="conflicting_parameters")
    if reasoning is None and not state.model_thinks:
        raise APIError(400, f"{param} is not supported with this model: {state.model_name} does not reason (its "
                       f"chat template has no think tags); drop {param}, or send reasoning=true with it to make "
                       "the model think first anyway", param=param, code="unsupported_parameter")
