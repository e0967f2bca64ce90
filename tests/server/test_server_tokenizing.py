"""The server's host work per request: the app in this process (httpx's ASGI transport) over the
default model on CPU, its tokenizer wrapped to count the texts it encodes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

import structgen
from structgen.engine.config import EngineConfig
from structgen.prompt_encoding import SegmentEncoder
from structgen_server.app import create_app


class CountingTokenizer:
    """The real tokenizer, counting the texts it encodes: by its `encode`, or by its Rust
    tokenizer's batch call (which `prompt_encoding.encode_texts` takes where it can)."""

    def __init__(self, inner: Any):
        self.inner, self.encoded = inner, 0
        self.backend_tokenizer = CountingBackend(inner.backend_tokenizer, self)

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        self.encoded += 1
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class CountingBackend:
    def __init__(self, inner: Any, counter: CountingTokenizer):
        self.inner, self.counter = inner, counter

    def encode_batch_fast(self, texts: list[str], **kwargs: Any) -> list[Any]:
        self.counter.encoded += len(texts)
        return self.inner.encode_batch_fast(texts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def counted(model_dir):
    llm = structgen.LLM(model_dir, config=EngineConfig(max_batch_size=2, max_seq_len=1024))
    llm.tokenizer = CountingTokenizer(llm.tokenizer)
    llm._prompt_encoder = SegmentEncoder(llm.tokenizer)  # chat prompts encode through it
    yield llm, create_app(llm)
    llm.close()


def post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            return await client.post(path, json=body)

    return asyncio.run(send())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, prompt", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}]}),
    ("/v1/completions", {"prompt": "Colours: red, green,"}),
])  # fmt: skip
def test_a_request_tokenizes_its_prompt_once(counted, path: str, prompt: dict[str, Any], stream: bool) -> None:
    llm, app = counted
    before = llm.tokenizer.encoded
    r = post(app, path, {"model": llm.model_name, **prompt, "max_tokens": 3, "temperature": 0, "stream": stream,
                         "stream_options": {"include_usage": True} if stream else None})
    assert r.status_code == 200, r.text
    last = json.loads(r.text.split("data: ")[-2]) if stream else r.json()
    assert last["usage"]["prompt_tokens"] > 0 and last["usage"]["completion_tokens"] > 0
    assert llm.tokenizer.encoded - before == 1
