"""Budget-aware closing through the server: the official client's `parse` with no temperature
(OpenAI's default of 1) at a tight max_tokens gets a parsed object; the request body's
`close_at_budget` / `loop_guards` turn it off."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, TypeAdapter

from structgen import IncompleteOutputError
from structgen.remote import RemoteLLM

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Write a support ticket with a very long, detailed description."


class Ticket(BaseModel):
    title: str
    description: str
    priority: int


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url, api_key="unused", max_retries=0, timeout=120)


def test_parse_without_a_temperature_at_a_tight_budget_returns_the_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                      response_format=Ticket, max_tokens=30, seed=3)
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Ticket)
    assert r.usage.completion_tokens <= 30


def test_closing_turned_off_in_the_body_ends_at_length(client: openai.OpenAI) -> None:
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                      response_format=Ticket, max_tokens=30, seed=3,
                                      extra_body={"close_at_budget": False, "loop_guards": False})


def test_remote_llm_passes_the_switches(server_url: str) -> None:
    with RemoteLLM(server_url, MODEL) as remote:
        closed = remote.complete(Ticket, PROMPT, max_tokens=30, temperature=1.0, seed=3)
        assert isinstance(closed.value, Ticket) and closed.finish_reason == "stop"
        with pytest.raises(IncompleteOutputError):
            remote.complete(Ticket, PROMPT, max_tokens=30, temperature=1.0, seed=3, close_at_budget=False,
                            loop_guards=False)


class Scientist(BaseModel):
    name: str
    city: str
    country: str


SCIENTISTS_PROMPT = ("Give a JSON list of five famous people, each with name, city and country: Einstein from Ulm, "
                     "Germany; Curie from Warsaw, Poland; Newton from Woolsthorpe, England; Darwin from "
                     "Shrewsbury, England; Tesla from Smiljan, Croatia.")


def test_a_stream_that_closing_rolls_back_adds_up_to_the_final_text(server_url: str) -> None:
    """At max_tokens=40 the closer drops the item opened past the budget and closes the list
    before it; the streamed deltas held that item back, so they add up to the unstreamed text."""
    schema = TypeAdapter(list[Scientist]).json_schema()
    body = {"model": MODEL, "messages": [{"role": "user", "content": SCIENTISTS_PROMPT}], "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    whole = httpx.post(f"{server_url}/chat/completions", json=body, timeout=120).json()["choices"][0]
    with httpx.stream("POST", f"{server_url}/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(e)["choices"] for e in events]
    text = "".join(c[0]["delta"].get("content") or "" for c in chunks if c)
    assert whole["finish_reason"] == "stop" and len(json.loads(whole["message"]["content"])) >= 1
    assert text == whole["message"]["content"]
