"""Reasoning through the server: the body's `reasoning` / `max_reasoning_tokens` make the model
think first; the thinking comes back as `message.reasoning_content` (streamed as
`delta.reasoning_content`) apart from the content, which parses; `RemoteLLM` reads it back."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from structgen import Partial, ReasoningDelta
from structgen.remote import RemoteLLM

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Think inside <think></think> tags first. What is the capital of France?"}]
REASONING = {"reasoning": True, "max_reasoning_tokens": 12}


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url, api_key="unused", max_retries=0, timeout=120)


def test_chat_returns_reasoning_content_apart_from_the_content(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=City, max_tokens=40,
                                      temperature=0, extra_body=REASONING)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(message.parsed, City)
    assert message.reasoning_content and "</think>" not in message.reasoning_content
    assert r.usage.completion_tokens <= 40


def test_chat_without_reasoning_has_no_reasoning_content(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=City, max_tokens=40,
                                      temperature=0)
    assert r.choices[0].message.reasoning_content is None and isinstance(r.choices[0].message.parsed, City)


def test_streamed_chat_sends_reasoning_deltas_before_the_content(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, stream=True, extra_body=REASONING,
        response_format={"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema()}})
    kinds, thinking, content = [], "", ""
    for chunk in stream:
        for choice in chunk.choices:
            if getattr(choice.delta, "reasoning_content", None):
                kinds.append("reasoning")
                thinking += choice.delta.reasoning_content
            if choice.delta.content:
                kinds.append("content")
                content += choice.delta.content
    assert thinking.strip() and kinds[0] == "reasoning"
    assert "reasoning" not in kinds[kinds.index("content"):]
    City.model_validate(json.loads(content))


def test_remote_llm_reads_the_reasoning_back(server_url: str) -> None:
    with RemoteLLM(server_url, MODEL) as remote:
        c = remote.complete(City, MESSAGES, max_tokens=40, reasoning=True, max_reasoning_tokens=12)
        assert isinstance(c.value, City) and c.reasoning
        deltas = list(remote.stream(City, MESSAGES, max_tokens=40, reasoning=True, max_reasoning_tokens=12))
        assert isinstance(deltas[0], ReasoningDelta)
        answer = "".join(d for d in deltas if not isinstance(d, ReasoningDelta))
        assert City.model_validate_json(answer) == c.value
        partial = remote.stream(City, MESSAGES, max_tokens=40, reasoning=True, max_reasoning_tokens=12, partial=True)
        snapshots = list(partial)
        assert all(isinstance(s, Partial) for s in snapshots) and snapshots[-1].done
        assert partial.completion.value == c.value and partial.completion.reasoning == c.reasoning
