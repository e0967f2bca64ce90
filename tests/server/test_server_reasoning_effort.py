"""OpenAI's `reasoning_effort` (structgen_server/planning.py): on a model that reasons, "none"
turns reasoning off and a level chooses the reasoning budget (`REASONING_EFFORT_TOKENS`); a
value outside OpenAI's set is a 400 naming the field and the values it takes. On a model that
does not reason unasked (a chat template without think tags, as the default model's), a level
and `max_reasoning_tokens` are a 400 saying so unless the request sets `reasoning`, never
silently ignored; "none" asks for what the model does anyway. Their budgets reach the engine as
`max_reasoning_tokens`: checked on a stub LLM that records its calls, then on the real model
with a chat template that thinks, and on the real server."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from structgen_server.app import create_app
from structgen_server.protocol import REASONING_EFFORT_TOKENS

STUB = "stub-model"
MESSAGES = [{"role": "user", "content": "Which city is the capital of France?"}]


class City(BaseModel):
    name: str
    country: str


class StubLLM:
    """Just enough of `structgen.LLM`: a chat template that thinks or not, every generation
    "ok", each call's keyword arguments kept."""

    model_name = STUB

    def __init__(self, thinks: bool) -> None:
        self.engine = SimpleNamespace(max_seq_len=4096, reasoner=SimpleNamespace(template_thinks=thinks))
        self.calls: list[dict[str, Any]] = []

    async def aencode_prompt(self, prompt: Any, chat: bool = False, tools: Any = None) -> list[int]:
        return [1, 2, 3]

    async def aprepare(self, output_type: Any, strict: bool = True) -> Any:
        return output_type

    async def acomplete(self, output_type: Any, prompt: Any, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        stats = SimpleNamespace(prompt_tokens=3, output_tokens=1)
        return SimpleNamespace(text="ok", finish_reason="stop", stats=stats, reasoning=None)


def post(app: Any, body: dict[str, Any]) -> httpx.Response:
    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            return await client.post("/v1/chat/completions", json=body)

    return asyncio.run(send())


def sent_to_engine(thinks: bool, **fields: Any) -> dict[str, Any]:
    """The reasoning settings a chat request with `fields` runs with (on a stub LLM)."""
    llm = StubLLM(thinks)
    r = post(create_app(llm, max_client_errors=0), {"model": STUB, "messages": MESSAGES, **fields})
    assert r.status_code == 200, r.text
    return {k: llm.calls[0][k] for k in ("reasoning", "max_reasoning_tokens")}


def refusal(thinks: bool, **fields: Any) -> dict[str, Any]:
    r = post(create_app(StubLLM(thinks), max_client_errors=0), {"model": STUB, "messages": MESSAGES, **fields})
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("effort", ["minimal", "low", "medium", "high"])
def test_a_reasoning_effort_level_is_the_reasoning_budget_of_a_model_that_thinks(effort):
    assert sent_to_engine(True, reasoning_effort=effort) == {
        "reasoning": None, "max_reasoning_tokens": REASONING_EFFORT_TOKENS[effort]}  # None: on, by the template


@pytest.mark.parametrize("thinks", [True, False])
def test_reasoning_effort_none_turns_reasoning_off(thinks):
    assert sent_to_engine(thinks, reasoning_effort="none") == {"reasoning": False, "max_reasoning_tokens": None}


def test_a_level_with_reasoning_true_makes_a_model_that_does_not_think_reason_within_its_budget():
    assert sent_to_engine(False, reasoning_effort="low", reasoning=True) == {"reasoning": True,
                                                                            "max_reasoning_tokens": 1024}


@pytest.mark.parametrize("value", ["bogus", "HIGH", "xhigh", "", 3, True, ["low"]])
def test_a_reasoning_effort_outside_openais_set_is_a_400_naming_the_accepted_values(value):
    error = refusal(True, reasoning_effort=value)
    assert error["param"] == "reasoning_effort"
    assert all(f"'{v}'" in error["message"] for v in ("none", "minimal", "low", "medium", "high")), error


@pytest.mark.parametrize(("fields", "param"), [
    ({"reasoning_effort": "medium"}, "reasoning_effort"),
    ({"max_reasoning_tokens": 64}, "max_reasoning_tokens"),
])
def test_a_reasoning_budget_for_a_model_that_does_not_think_is_a_400_not_ignored(fields, param):
    error = refusal(False, **fields)
    assert error["param"] == param and error["code"] == "unsupported_parameter", error
    assert "does not reason" in error["message"] and "reasoning=true" in error["message"], error


@pytest.mark.parametrize(("fields", "param"), [
    ({"reasoning_effort": "low", "max_reasoning_tokens": 64}, "reasoning_effort"),
    ({"reasoning_effort": "none", "reasoning": True}, "reasoning_effort"),
    ({"reasoning_effort": "high", "reasoning": False}, "reasoning_effort"),
    ({"max_reasoning_tokens": 64, "reasoning": False}, "max_reasoning_tokens"),
])
def test_reasoning_fields_that_contradict_each_other_are_a_400_naming_one(fields, param):
    error = refusal(True, **fields)
    assert error["param"] == param and error["code"] == "conflicting_parameters", error


# --------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def thinking_app(thinking_llm) -> Any:
    """The server over the default model with a chat template that thinks (tests/conftest.py)."""
    return create_app(thinking_llm, max_client_errors=0)


def _city_message(app: Any, effort: str) -> dict[str, Any]:
    schema = {"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema()}}
    r = post(app, {"model": "think-template", "messages": MESSAGES, "max_tokens": 48, "temperature": 0,
                   "response_format": schema, "reasoning_effort": effort})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    City.model_validate(json.loads(message["content"]))
    return message


def test_a_thinking_model_thinks_at_a_level_and_answers_at_once_at_none(thinking_app):
    assert _city_message(thinking_app, "minimal")["reasoning_content"]
    assert _city_message(thinking_app, "none")["reasoning_content"] is None


def test_the_default_model_refuses_a_level_through_the_real_server_and_accepts_none(server_url):
    body = {"model": "SmolLM2-135M-Instruct", "messages": MESSAGES, "max_tokens": 8}
    r = httpx.post(f"{server_url}/chat/completions", json={**body, "reasoning_effort": "high"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    r = httpx.post(f"{server_url}/chat/completions", json={**body, "reasoning_effort": "none"}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["reasoning_content"] is None, r.text
