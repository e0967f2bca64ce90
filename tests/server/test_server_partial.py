"""Partial objects over HTTP, on a real server subprocess (the `server_url` fixture): the
`stream_options.include_partial` extension adds `partial` to each chunk's choice and changes
nothing else (the official `openai` client reads the stream as before), and
`RemoteLLM.stream(..., partial=True)` yields the same typed snapshots as in-process."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pydantic
import pytest

from structgen.remote import RemoteLLM

MODEL = "SmolLM2-135M-Instruct"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0)


PROMPT = "Oslo has 709000 inhabitants. Give the city as JSON."
BODY = {
    "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40, "temperature": 0,
    "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema(), "strict": True}},
}  # fmt: skip


def sse_chunks(server_url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server_url}/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        raw = "".join(r.iter_text())
    events = [e.removeprefix("data: ") for e in raw.split("\n\n")[:-1]]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_include_partial_adds_snapshots_and_changes_nothing_else(server_url: str) -> None:
    plain = sse_chunks(server_url, {**BODY, "stream": True})
    extended = sse_chunks(server_url, {**BODY, "stream": True, "stream_options": {"include_partial": True}})
    strip = [{k: v for k, v in c["choices"][0].items() if k != "partial"} for c in extended]
    # The same text and ending in chunks of the same shape; where chunks break follows how many
    # engine steps pass between the server's wake-ups (one event per stream per wake-up).
    assert {tuple(sorted(c)) for c in strip} == {tuple(sorted(c["choices"][0])) for c in plain}
    assert [c["finish_reason"] for c in strip if c["finish_reason"]] == [
        c["choices"][0]["finish_reason"] for c in plain if c["choices"][0]["finish_reason"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in extended)
    assert text == "".join(c["choices"][0]["delta"].get("content") or "" for c in plain)
    final = json.loads(text)
    partials = [c["choices"][0]["partial"] for c in extended if "partial" in c["choices"][0]]
    assert len(partials) > 2
    assert partials[-1] == {"value": final, "finished": [], "path": None, "done": True}
    assert extended[-1]["choices"][0]["finish_reason"] == "stop"
    finished = [tuple(p) for snapshot in partials for p in snapshot["finished"]]
    assert finished == [("name",), ("population",), ()]
    for snapshot in partials[:-1]:
        assert not snapshot["done"]
        value = snapshot["value"]
        assert set(value) <= set(final)
        assert "population" not in value or value["population"] == final["population"]
        assert final["name"].startswith(value.get("name", ""))


def test_the_official_client_reads_a_stream_with_the_extension(server_url: str) -> None:
    client = openai.OpenAI(base_url=server_url, api_key="unused", max_retries=0, timeout=120)
    extra = {k: v for k, v in BODY.items() if k not in ("model", "messages", "max_tokens", "temperature")}
    stream = client.chat.completions.create(
        model=MODEL, messages=BODY["messages"], max_tokens=40, temperature=0, stream=True,
        stream_options={"include_partial": True},  # type: ignore[typeddict-unknown-key]
        extra_body=extra,
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert City.model_validate_json(text)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body,param",
    [
        ({**BODY, "stream_options": {"include_partial": True}}, "stream_options.include_partial"),
        ({**BODY, "response_format": None, "stream": True, "stream_options": {"include_partial": True}},
         "stream_options.include_partial"),
    ],
)  # fmt: skip
def test_include_partial_is_refused_without_a_stream_or_without_json(server_url: str, body: dict, param: str) -> None:
    r = httpx.post(f"{server_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_remote_partial_stream_matches_in_process_snapshots(server_url: str) -> None:
    with RemoteLLM(server_url, MODEL) as remote:
        stream = remote.stream(City, PROMPT, max_tokens=40, partial=True)
        snapshots = list(stream)
        assert stream.completion is not None
        assert snapshots[-1].done and snapshots[-1].value == stream.completion.value
        assert isinstance(snapshots[-1].value, City)
        finished = [p for s in snapshots for p in s.finished]
        assert finished == [("name",), ("population",), ()]
        assert all(isinstance(s.value, City) for s in snapshots)

        async def collect() -> list:
            return [s.value async for s in remote.astream(City, PROMPT, max_tokens=40, partial=True)]

        assert asyncio.run(collect()) == [s.value for s in snapshots]


def test_remote_partial_stream_from_a_plain_openai_dialect(server_url: str) -> None:
    """The openai dialect sends no extension at all: the snapshots come from the text alone."""
    with RemoteLLM(server_url, MODEL, dialect="openai") as remote:
        snapshots = list(remote.stream(City, PROMPT, max_tokens=40, partial=True))
    assert snapshots[-1].done and isinstance(snapshots[-1].value, City)
    names = [s.value.name for s in snapshots if "name" in s.value.model_fields_set]
    assert len(names) > 1 and all(names[-1].startswith(n) for n in names)
