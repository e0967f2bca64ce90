"""Request validation against careless and hostile clients, in process and without a model: the
app (httpx's ASGI transport) over a stub LLM that tokenizes by characters and records what it
was asked to run. Every bad request is a 4xx in OpenAI's error shape naming the field (`param`,
a plain field path), the fix (the message) and a `code`; a field the server cannot honour is
refused, never silently ignored."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from structgen.sampling import MAX_SEED
from structgen_server.app import create_app

MODEL = "stub-model"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON_HEADERS = {"content-type": "application/json"}


class StubLLM:
    """Just enough of `structgen.LLM` for the server: prompts are tokenized one token a
    character, every generation is the text "ok", and each call's keyword arguments are kept."""

    model_name = MODEL

    def __init__(self) -> None:
        self.engine = SimpleNamespace(max_seq_len=4096)
        self.calls: list[dict[str, Any]] = []

    async def aencode_prompt(self, prompt: Any, chat: bool = False, tools: Any = None) -> list[int]:
        text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
        return [ord(c) % 1000 for c in text]

    async def aprepare(self, output_type: Any, strict: bool = True) -> Any:
        return output_type

    async def acomplete(self, output_type: Any, prompt: Any, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        stats = SimpleNamespace(prompt_tokens=len(prompt.token_ids), output_tokens=1)
        return SimpleNamespace(text="ok", finish_reason="stop", stats=stats, reasoning=None)


@pytest.fixture(scope="module")
def stub() -> StubLLM:
    return StubLLM()


@pytest.fixture(scope="module")
def app(stub: StubLLM) -> Any:
    return create_app(stub, max_client_errors=0)  # this module sends hundreds of bad requests


def post(app: Any, path: str, body: Any = None, *, content: bytes | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    """POST `body` as JSON (or the raw `content` with `headers`) to the app in process."""
    if content is None:
        content = json.dumps(body).encode()
    headers = JSON_HEADERS if headers is None else headers

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post(path, content=content, headers=headers)

    return asyncio.run(send())


def error_of(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    """The OpenAI-shaped error of a response, checked for status and shape (a code always)."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"], err
    assert err["type"] == "invalid_request_error", err
    return err


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Say hi.", "max_tokens": 4, **fields}


def test_a_good_request_is_served(app: Any) -> None:
    assert post(app, CHAT, chat()).json()["choices"][0]["message"]["content"] == "ok"
    assert post(app, COMPLETIONS, completion()).json()["choices"][0]["text"] == "ok"


# --------------------------------------------------------------------------- the body itself

GOOD_BYTES = json.dumps(chat()).encode()


@pytest.mark.parametrize(
    "headers",
    [
        {"content-type": "application/x-www-form-urlencoded"},  # curl -d
        {"content-type": "text/plain"},
        {"content-type": "multipart/form-data; boundary=x"},
        {},
    ],
    ids=["form", "text", "multipart", "none"],
)
def test_a_body_not_sent_as_json_names_the_content_type(app: Any, headers: dict[str, str]) -> None:
    err = error_of(post(app, CHAT, content=GOOD_BYTES, headers=headers), 415)
    assert "Content-Type: application/json" in err["message"], err
    assert err["code"] == "unsupported_media_type" and err["param"] is None, err


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "application/vnd.api+json"])
def test_json_content_types_are_accepted(app: Any, content_type: str) -> None:
    assert post(app, CHAT, content=GOOD_BYTES, headers={"content-type": content_type}).status_code == 200


# (name, raw body, words the message must contain)
UNREADABLE: list[tuple[str, bytes, tuple[str, ...]]] = [
    ("syntax error", b'{"model": "x",}', ("not valid JSON", "position 14")),
    ("invalid UTF-8", b'{"model": "\xff\xfe"}', ("not UTF-8", "position 11")),
    ("nested too deep", b"[" * 100_000 + b"]" * 100_000, ("nested too deeply",)),
    ("integer of 5,000 digits", b'{"seed": ' + b"9" * 5000 + b"}", ("digits", "5000")),
    ("NaN", b'{"temperature": NaN}', ("NaN", "not valid JSON")),
    ("a JSON array", b"[1, 2]", ("JSON object", "array")),
    ("empty", b"", ("missing",)),
]


@pytest.mark.parametrize("case", UNREADABLE, ids=[c[0] for c in UNREADABLE])
def test_an_unreadable_body_names_the_problem(app: Any, case: tuple[str, bytes, tuple[str, ...]]) -> None:
    _, content, words = case
    err = error_of(post(app, CHAT, content=content))
    assert err["code"] == "invalid_json" and err["param"] is None, err
    for word in words:
        assert word.lower() in err["message"].lower(), err


# --------------------------------------------------------------------------- fields

# (name, path, body, param, code, words the message must contain)
BAD_FIELDS: list[tuple[str, str, dict[str, Any], str, str, tuple[str, ...]]] = [
    ("negative seed", CHAT, chat(seed=-1), "seed", "invalid_request", ("greater than or equal to 0",)),
    ("seed past the engine's range", COMPLETIONS, completion(seed=MAX_SEED + 1), "seed", "invalid_request",
     (str(MAX_SEED),)),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=5), "top_logprobs", "unsupported_parameter",
     ("top_logprobs", "not supported")),
    ("negative top_logprobs", CHAT, chat(top_logprobs=-1), "top_logprobs", "invalid_request", ("0",)),
    ("completions logprobs=0", COMPLETIONS, completion(logprobs=0), "logprobs", "unsupported_parameter",
     ("not supported",)),
    ("tools on completions", COMPLETIONS,
     completion(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required"),
     "tools", "unsupported_parameter", ("/v1/chat/completions",)),
    ("tool_choice on completions", COMPLETIONS, completion(tool_choice="auto"), "tool_choice",
     "unsupported_parameter", ("/v1/chat/completions",)),
    ("messages on completions", COMPLETIONS, completion(messages=[{"role": "user", "content": "x"}]),
     "messages", "unsupported_parameter", ("/v1/chat/completions",)),
    ("prompt on chat", CHAT, chat(prompt="x"), "prompt", "unsupported_parameter", ("/v1/completions",)),
    ("legacy functions", CHAT, chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter",
     ("tools",)),
    ("legacy function_call", CHAT, chat(function_call="auto"), "function_call", "unsupported_parameter",
     ("tool_choice",)),
    ("audio output", CHAT, chat(modalities=["text", "audio"]), "modalities", "unsupported_parameter",
     ("text",)),
    ("include_usage without stream", CHAT, chat(stream_options={"include_usage": True}),
     "stream_options.include_usage", "invalid_parameter", ("stream",)),
    ("max_tokens and max_completion_tokens differ", CHAT, chat(max_tokens=4, max_completion_tokens=8),
     "max_completion_tokens", "conflicting_parameters", ("max_tokens",)),
    ("image content part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]),
     "messages.0.content.0.type", "unsupported_content", ("image_url", "text")),
    ("stream with n=2", CHAT, chat(stream=True, n=2), "n", "unsupported_parameter", ("n=1",)),
    ("tool_choice without tools", CHAT, chat(tool_choice="required"), "tool_choice", "invalid_parameter",
     ("tools",)),
    ("json_schema without schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", "invalid_response_format", ("schema",)),
    ("json_object with a schema", CHAT,
     chat(response_format={"type": "json_object", "json_schema": {"schema": {"type": "integer"}}}),
     "response_format.json_schema", "invalid_response_format", ("json_schema",)),
    ("tools with response_format and tool_choice auto", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
          tool_choice="auto", response_format={"type": "json_object"}),
     "response_format", "unsupported_parameter", ("tool_choice",)),
    ("two constraints", CHAT, chat(guided_regex="a", guided_choice=["a"]), "guided_choice",
     "conflicting_parameters", ("only one",)),
    ("schema of the wrong type", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": 3}}),
     "response_format.json_schema.schema", "invalid_request", ("dictionary",)),
    ("tool_choice of the wrong type", CHAT, chat(tool_choice=3), "tool_choice", "invalid_request", ("none",)),
    ("text in the wrong place", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]),
     "messages.0.content.0.text", "invalid_request", ("string",)),
    ("empty prompt", COMPLETIONS, completion(prompt=""), "prompt", "invalid_request", ("prompt must not be empty",)),
    ("empty prompt list", COMPLETIONS, completion(prompt=[]), "prompt", "invalid_request",
     ("prompt must not be empty",)),
    ("empty messages", CHAT, chat(messages=[]), "messages", "invalid_request", ("messages must not be empty",)),
]


@pytest.mark.parametrize("case", BAD_FIELDS, ids=[c[0] for c in BAD_FIELDS])
def test_a_bad_field_is_a_400_naming_it(app: Any, case: tuple[str, str, dict[str, Any], str, str, tuple[str, ...]]) -> None:
    _, path, body, param, code, words = case
    err = error_of(post(app, path, body))
    assert err["param"] == param and err["code"] == code, err
    for word in words:
        assert word.lower() in err["message"].lower(), err


def test_max_completion_tokens_is_the_token_limit_of_a_completion(app: Any, stub: StubLLM) -> None:
    body = completion(max_completion_tokens=7)
    del body["max_tokens"]
    assert post(app, COMPLETIONS, body).status_code == 200
    assert stub.calls[-1]["max_tokens"] == 7


def test_max_tokens_equal_to_max_completion_tokens_is_accepted(app: Any, stub: StubLLM) -> None:
    assert post(app, CHAT, chat(max_tokens=5, max_completion_tokens=5)).status_code == 200
    assert stub.calls[-1]["max_tokens"] == 5


def test_harmless_extras_stay_accepted(app: Any) -> None:
    body = chat(top_logprobs=0, logprobs=False, modalities=["text"], stream_options={"include_usage": False},
                metadata={"a": "b"}, store=False, user="u", function_call=None)
    assert post(app, CHAT, body).status_code == 200, post(app, CHAT, body).text


def test_the_openapi_document_still_describes_the_request_bodies(app: Any) -> None:
    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            return await c.get("/openapi.json")

    doc = asyncio.run(get()).json()
    body = doc["paths"][CHAT]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "ChatMessage" in doc["components"]["schemas"]
