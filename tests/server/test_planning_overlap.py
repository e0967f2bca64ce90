"""A request's prompts are tokenized while its grammar compiles, and all at once
(structgen_server/planning.py), as `LLM.acomplete` overlaps them: a burst of new schemas waits
for compiles, and its prompts need not queue behind them. Checked on a stub LLM whose calls
wait for each other: made one after another, they would wait forever (the test times out)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx

from structgen.errors import InvalidConstraintError
from structgen_server.app import create_app

STUB = "stub-model"
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
WAIT_S = 5.0


class WaitingLLM:
    """`aprepare` returns only once every prompt of the request is being tokenized, and each
    `aencode_prompt` only once the grammar is being prepared; `bad_schema` makes `aprepare`
    fail instead (after the prompts started)."""

    model_name = STUB

    def __init__(self, prompts: int, bad_schema: bool = False) -> None:
        self.engine = SimpleNamespace(max_seq_len=4096, reasoner=SimpleNamespace(template_thinks=False))
        self.prompts, self.bad_schema = prompts, bad_schema
        self.encoding = 0
        self.cancelled = 0
        self.all_encoding = asyncio.Event()
        self.preparing = asyncio.Event()

    async def aencode_prompt(self, prompt: Any, chat: bool = False, tools: Any = None) -> list[int]:
        self.encoding += 1
        if self.encoding == self.prompts:
            self.all_encoding.set()
        try:
            await self.preparing.wait()
            if self.bad_schema:
                await asyncio.sleep(WAIT_S)  # still tokenizing when the schema is refused
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return [1, 2, 3]

    async def aprepare(self, output_type: Any, strict: bool = True) -> Any:
        self.preparing.set()
        await self.all_encoding.wait()
        if self.bad_schema:
            raise InvalidConstraintError("this schema cannot be compiled")
        return output_type

    async def acomplete(self, output_type: Any, prompt: Any, **kwargs: Any) -> Any:
        stats = SimpleNamespace(prompt_tokens=3, output_tokens=1)
        return SimpleNamespace(text='{"a": "x"}', finish_reason="stop", stats=stats, reasoning=None)


def post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            return await client.post(path, json=body)

    return asyncio.run(asyncio.wait_for(send(), WAIT_S))  # calls made one after another would wait forever


def test_a_chat_prompt_is_tokenized_while_its_grammar_is_prepared():
    llm = WaitingLLM(prompts=1)
    r = post(create_app(llm, max_client_errors=0), "/v1/chat/completions", {
        "model": STUB, "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == '{"a": "x"}'


def test_a_completions_requests_prompts_are_tokenized_at_once():
    llm = WaitingLLM(prompts=3)
    r = post(create_app(llm, max_client_errors=0), "/v1/completions", {
        "model": STUB, "prompt": ["one", "two", "three"], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3


def test_a_refused_schema_is_a_400_and_stops_the_tokenizing_it_started():
    llm = WaitingLLM(prompts=2, bad_schema=True)
    r = post(create_app(llm, max_client_errors=0), "/v1/completions", {
        "model": STUB, "prompt": ["one", "two"], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
    assert r.status_code == 400, r.text
    assert "cannot be compiled" in r.json()["error"]["message"]
    assert llm.cancelled == 2
