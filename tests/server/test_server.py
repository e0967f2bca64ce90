"""The OpenAI-compatible server, end to end: a real `python -m structgen_server` process with the
default model on CPU (the `server_url` fixture), driven by the official `openai` client and by
raw HTTP where the exact wire format matters."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"
DATA = Path(__file__).resolve().parents[1] / "data" / "maskbench"  # a few records of the corpus


class Weather(BaseModel):
    city: Literal["Paris", "London", "Tokyo"]
    temperature_c: int = Field(ge=-50, le=60)
    sunny: bool


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url, api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, content: str, **kw):
    kw.setdefault("max_tokens", 48)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


# --------------------------------------------------------------------------- basics


def test_health_models_metrics(server_url: str) -> None:
    root = server_url.removesuffix("/v1")
    assert httpx.get(f"{root}/health").json()["status"] == "ok"
    assert httpx.head(f"{root}/health").status_code == 200  # a load balancer's probe
    models = httpx.get(f"{server_url}/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    text = httpx.get(f"{root}/metrics").text
    assert "# TYPE structgen_requests_total counter" in text
    assert "structgen_request_latency_seconds" in text


def test_parse_pydantic_response_format(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris today: 21 degrees and sunny. Report it as JSON."}],
        response_format=Weather,
        max_tokens=64,
        temperature=0,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather)
    assert completion.usage.prompt_tokens > 0 and completion.usage.completion_tokens > 0


def test_json_object(client: openai.OpenAI) -> None:
    r = chat(client, "Give me a JSON object describing a cat.", response_format={"type": "json_object"}, max_tokens=64)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # truncated: still the prefix of an object
        assert r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        ({"guided_regex": r"(yes|no)"}, lambda t: t in ("yes", "no")),
        ({"response_format": {"type": "regex", "regex": r"[A-Z][a-z]{2,8}"}}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}", t)),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"guided_choice": ["cat", "dog"]}, lambda t: t in ("cat", "dog")),
        ({"response_format": {"type": "choice", "choices": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"grammar": 'root ::= "answer: " [0-9] [0-9]?'}, lambda t: re.fullmatch(r"answer: [0-9]{1,2}", t)),
        ({"response_format": {"type": "grammar", "grammar": 'root ::= ("a" | "b") ("a" | "b")? "!"'}},
         lambda t: re.fullmatch(r"[ab]{1,2}!", t)),
        ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}},
         lambda t: isinstance(json.loads(t)["n"], int)),
        ({"structured_outputs": {"json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}},
         lambda t: all(isinstance(x, bool) for x in json.loads(t))),
    ],
)
def test_extension_fields(client: openai.OpenAI, extra: dict, check) -> None:
    kw = {"response_format": extra.pop("response_format")} if "response_format" in extra else {}
    r = chat(client, "Answer.", extra_body=extra, max_tokens=40, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    assert check(choice.message.content), choice.message.content


def test_text_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.choices[0].finish_reason in ("stop", "length")
    r = client.completions.create(
        model=MODEL, prompt=["1, 2, 3,", "a, b, c,"], max_tokens=6, temperature=0, extra_body={"regex": r" [0-9a-z]+"}
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert all(re.fullmatch(r" [0-9a-z]+", c.text) for c in r.choices)


def test_n_choices_and_seed(client: openai.OpenAI) -> None:
    r = chat(client, "Pick a color.", n=2, temperature=1.0, seed=7, extra_body={"choice": ["red", "green", "blue"]})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content in ("red", "green", "blue") for c in r.choices)


def test_length_returns_partial_text(client: openai.OpenAI) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}}
    r = chat(client, "Describe a city.", response_format=schema, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith("{")
    assert r.usage.completion_tokens == 3
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Weather?"}], response_format=Weather, max_tokens=3
        )


def test_stop_strings(client: openai.OpenAI) -> None:
    full = chat(client, "Count from 1 to 20, separated by commas.", max_tokens=40).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    r = chat(client, "Count from 1 to 20, separated by commas.", max_tokens=40, stop=[stop])
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_a_stop_string_that_cuts_a_constrained_output_fails_the_choice_naming_it(server_url: str) -> None:
    """A stop string ends free text anywhere, a structured output only where it is whole: one
    that cuts it (compact JSON's ",") is a 422 naming the string, streamed or not, never a
    `finish_reason: "stop"` with text that does not parse."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"], "additionalProperties": False}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Give a=1 and b='x' as JSON."}],
            "max_tokens": 48, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "ab", "schema": schema}}}
    whole = httpx.post(f"{server_url}/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]["content"]
    assert set(json.loads(whole)) == {"a", "b"} and "," in whole
    r = httpx.post(f"{server_url}/chat/completions", json={**body, "stop": [","]}, timeout=120)
    assert r.status_code == 422 and r.json()["error"]["code"] == "output_validation_failed", r.text
    assert "stop string ','" in r.json()["error"]["message"]
    with httpx.stream("POST", f"{server_url}/chat/completions", json={**body, "stop": [","], "stream": True},
                      timeout=120) as streamed:
        events = [e.removeprefix("data: ") for e in "".join(streamed.iter_text()).split("\n\n") if e]
    assert events[-1] == "[DONE]" and "stop string ','" in json.loads(events[-2])["error"]["message"], events
    assert not any(json.loads(e).get("choices", [{}])[0].get("finish_reason") for e in events[:-2])
    kept = httpx.post(f"{server_url}/chat/completions", json={**body, "stop": ["\n\n"]}, timeout=120).json()
    assert kept["choices"][0]["message"]["content"] == whole and kept["choices"][0]["finish_reason"] == "stop"


def test_a_stop_string_that_cuts_a_tool_call_is_named() -> None:
    """With tools in "auto" mode the grammar is a CFG, which parses nothing at the cut: the tool
    call's own parse fails afterwards, and that error names the stop string too."""
    from structgen.errors import OutputValidationError
    from structgen.tool_format import ToolChoice
    from structgen_server.constraints import RequestConstraint
    from structgen_server.responses import assistant_turn
    from structgen_server.serving import Generation

    rc = RequestConstraint(tools=[WEATHER_TOOL], tool_choice=ToolChoice("auto"))
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"'
    with pytest.raises(OutputValidationError, match="stop string '}' ended the output after 65 characters, before "
                                                    "it was a whole tool call"):
        assistant_turn(rc, Generation(cut, "stop", 10, 20, stopped_by="}"))
    with pytest.raises(OutputValidationError, match="^tool call is not valid JSON"):  # no stop string: as it was
        assistant_turn(rc, Generation(cut, "stop", 10, 20))


# --------------------------------------------------------------------------- streaming


def _sse_events(server_url: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{server_url}/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e.removeprefix("data: ") for e in events]


@pytest.mark.parametrize("response_format", [None, {"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema(), "strict": True}}])
def test_stream_matches_non_stream(server_url: str, client: openai.OpenAI, response_format) -> None:
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "Weather in Tokyo, as JSON please."}],
        "max_tokens": 40, "temperature": 0,
    }
    if response_format:
        body["response_format"] = response_format
    whole = httpx.post(f"{server_url}/chat/completions", json=body, timeout=120).json()
    events = _sse_events(server_url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    usage_chunk, last = chunks[-1], chunks[-2]
    stream_usage, whole_usage = usage_chunk["usage"], whole["usage"]
    # The second run of the same prompt finds its first pages in the prefix cache.
    cached = stream_usage.pop("prompt_tokens_details")["cached_tokens"]
    assert 0 < cached < stream_usage["prompt_tokens"]
    whole_usage.pop("prompt_tokens_details")
    assert usage_chunk["choices"] == [] and stream_usage == whole_usage
    assert last["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    assert text == whole["choices"][0]["message"]["content"]
    # and through the official client
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**body, stream=True)
        if c.choices
    )
    assert streamed == text


def test_stream_text_completion(server_url: str) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    whole = httpx.post(f"{server_url}/completions", json=body, timeout=120).json()
    with httpx.stream("POST", f"{server_url}/completions", json={**body, "stream": True}, timeout=120) as r:
        events = [e.removeprefix("data: ") for e in "".join(r.iter_text()).split("\n\n")[:-1]]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------- tools


def _bfcl_tools(n: int) -> list[dict]:
    tools = []
    for line in (DATA / "BFCL_simple.jsonl").read_text().splitlines()[:n]:
        schema = json.loads(line)["schema"]
        (name, params), = schema["properties"].items()
        tools.append({"type": "function", "function": {"name": name.replace(".", "_"), "description": name, "parameters": params}})
    return tools


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def _check_calls(message, tools: list[dict]) -> None:
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


def test_tool_choice_required(client: openai.OpenAI) -> None:
    tools = [WEATHER_TOOL, *_bfcl_tools(3)]
    r = chat(client, "What's the weather in Paris?", tools=tools, tool_choice="required", max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls", r
    assert r.choices[0].message.content is None
    _check_calls(r.choices[0].message, tools)


def test_tool_choice_named_and_single(client: openai.OpenAI) -> None:
    tools = [WEATHER_TOOL, *_bfcl_tools(2)]
    r = chat(client, "Weather in Rome?", tools=tools, max_tokens=80,
             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    _check_calls(r.choices[0].message, tools)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    r = chat(client, "Weather in Rome?", tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    assert len(r.choices[0].message.tool_calls) == 1
    _check_calls(r.choices[0].message, tools)


def test_tool_choice_auto_and_none(client: openai.OpenAI) -> None:
    tools = [WEATHER_TOOL]
    for prompt in ("What's the weather in Paris? Use the tool.", "Say hello."):
        r = chat(client, prompt, tools=tools, tool_choice="auto", max_tokens=60)
        msg = r.choices[0].message
        if msg.tool_calls:
            _check_calls(msg, tools)
        else:
            assert not (msg.content or "").lstrip().startswith("<tool_call>")
    r = chat(client, "Say hello.", tools=tools, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_past_tool_calls_reach_the_model_on_a_turn_without_tools(client: openai.OpenAI) -> None:
    """A final-answer turn often leaves `tools` out; the calls and results before it are still
    the conversation (they were dropped: the template rendered an empty assistant turn)."""
    def prompt_tokens(arguments: str) -> int:
        messages = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21 degrees, sunny"},
        ]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
        return r.usage.prompt_tokens

    short, long = prompt_tokens('{"city": "P"}'), prompt_tokens(json.dumps({"city": "Paris " * 100}))
    assert long - short >= 80, (short, long)


def test_tool_call_round_trip_and_stream(client: openai.OpenAI) -> None:
    tools = [WEATHER_TOOL]
    first = chat(client, "Weather in Oslo?", tools=tools, tool_choice="required", max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3, "sky": "snow"}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # streamed tool calls: one delta per call with id, name and the full arguments
    chunks = list(chat(client, "Weather in Oslo?", tools=tools, tool_choice="required", max_tokens=60, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# --------------------------------------------------------------------------- robustness


def test_concurrent_requests(client: openai.OpenAI) -> None:
    results: list = []

    def one(i: int) -> None:
        results.append(chat(client, f"Number {i}?", max_tokens=8, extra_body={"regex": "[0-9]{1,3}"}))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8
    assert all(re.fullmatch("[0-9]{1,3}", r.choices[0].message.content) for r in results)


def _in_flight(server_url: str) -> int:
    text = httpx.get(server_url.removesuffix("/v1") + "/metrics").text
    return int(float(re.search(r"^structgen_requests_in_flight\{.*\} (\S+)$", text, re.M).group(1)))


def _busy(server_url: str) -> bool:
    health = httpx.get(server_url.removesuffix("/v1") + "/health").json()
    return bool(_in_flight(server_url) or health["running"] or health["waiting"])


def _wait_idle(server_url: str) -> None:
    """No request in the HTTP layer and none holding a KV slot in the engine."""
    deadline = time.monotonic() + 20
    while _busy(server_url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _busy(server_url)


def test_client_disconnect_cancels(server_url: str, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server_url}/chat/completions", json=body, timeout=60) as r:
        for _ in r.iter_lines():
            break  # first event, then hang up
    with pytest.raises(httpx.ReadTimeout):  # non-streaming request abandoned by its client
        httpx.post(f"{server_url}/chat/completions", json={**body, "stream": False}, timeout=1.5)
    _wait_idle(server_url)
    assert chat(client, "Hi", max_tokens=4).choices[0].message.content


BAD_REQUESTS: list[tuple[str, str, object, int]] = [
    # (name, path, body: dict or raw str, status)
    ("malformed json", "chat/completions", "{not json", 400),
    ("empty body", "chat/completions", "", 400),
    ("body is a list", "chat/completions", [], 400),
    ("missing messages", "chat/completions", {"model": MODEL}, 400),
    ("empty messages", "chat/completions", {"model": MODEL, "messages": []}, 400),
    ("messages is a string", "chat/completions", {"model": MODEL, "messages": "hi"}, 400),
    ("message without role", "chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400),
    ("unknown role", "chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400),
    ("content is a number", "chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    ("image content part", "chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ("missing model", "chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400),
    ("unknown model", "chat/completions", {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("negative max_tokens", "chat/completions", {"max_tokens": -1}, 400),
    ("zero max_tokens", "chat/completions", {"max_tokens": 0}, 400),
    ("max_tokens not a number", "chat/completions", {"max_tokens": "ten"}, 400),
    ("max_tokens a boolean", "chat/completions", {"max_tokens": True}, 400),
    ("max_tokens a numeric string", "chat/completions", {"max_tokens": "10"}, 400),
    ("stream a string", "chat/completions", {"stream": "yes"}, 400),
    ("temperature a string", "chat/completions", {"temperature": "0.5"}, 400),
    ("seed beyond 64 bits", "chat/completions", {"seed": 2**64}, 400),
    ("misspelled response_format", "chat/completions", {"response_fromat": {"type": "json_object"}}, 400),
    ("misspelled guided_json", "chat/completions", {"guided_jsn": {"type": "object"}}, 400),
    ("json_schema strict not a boolean", "chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}}, 400),
    ("max_tokens beyond context", "chat/completions", {"max_tokens": 100000}, 400),
    ("negative temperature", "chat/completions", {"temperature": -0.5}, 400),
    ("temperature too high", "chat/completions", {"temperature": 5}, 400),
    ("top_p zero", "chat/completions", {"top_p": 0}, 400),
    ("n zero", "chat/completions", {"n": 0}, 400),
    ("n too large", "chat/completions", {"n": 1000}, 400),
    ("n>1 with stream", "chat/completions", {"n": 2, "stream": True}, 400),
    ("too many stop strings", "chat/completions", {"stop": ["a", "b", "c", "d", "e"]}, 400),
    ("logprobs", "chat/completions", {"logprobs": True}, 400),
    ("presence penalty", "chat/completions", {"presence_penalty": 0.5}, 400),
    ("presence penalty as text", "chat/completions", {"presence_penalty": "0"}, 400),
    ("frequency penalty as text", "completions", {"frequency_penalty": "0"}, 400),
    ("unknown response_format type", "chat/completions", {"response_format": {"type": "xml"}}, 400),
    ("json_schema without schema", "chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400),
    ("json_schema schema not an object", "chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}}, 400),
    ("invalid json schema", "chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, 400),
    ("unsupported schema keyword", "chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/s.json"}}}}, 400),
    ("bad regex", "chat/completions", {"regex": "([a-z"}, 400),
    ("bad guided_regex", "chat/completions", {"guided_regex": "a{3,1}"}, 400),
    ("invalid grammar", "chat/completions", {"grammar": "root ::= ("}, 400),
    ("grammar without root", "chat/completions", {"response_format": {"type": "grammar", "grammar": 'foo ::= "a"', "syntax": "ebnf"}}, 400),
    ("empty choice", "chat/completions", {"guided_choice": []}, 400),
    ("conflicting constraints", "chat/completions", {"response_format": {"type": "json_object"}, "regex": "a+"}, 400),
    ("tool_choice unknown function", "chat/completions",
     {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400),
    ("tool_choice bad string", "chat/completions", {"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, 400),
    ("tool_choice required without tools", "chat/completions", {"tool_choice": "required"}, 400),
    ("tool name with spaces", "chat/completions",
     {"tools": [{"type": "function", "function": {"name": "get weather", "parameters": {"type": "object"}}}]}, 400),
    ("tool parameters not a schema", "chat/completions",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], "tool_choice": "required"}, 400),
    ("duplicate tool names", "chat/completions", {"tools": [WEATHER_TOOL, WEATHER_TOOL], "tool_choice": "required"}, 400),
    ("prompt too long", "chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}]}, 400),
    ("completions missing prompt", "completions", {"model": MODEL}, 400),
    ("completions empty prompt list", "completions", {"model": MODEL, "prompt": []}, 400),
    ("completions empty prompt", "completions", {"model": MODEL, "prompt": ""}, 400),
    ("completions echo", "completions", {"model": MODEL, "prompt": "a", "echo": True}, 400),
    ("completions unknown model", "completions", {"model": "nope", "prompt": "a"}, 404),
    ("completions bad regex", "completions", {"model": MODEL, "prompt": "a", "regex": "("}, 400),
    ("completions stream with 2 prompts", "completions", {"model": MODEL, "prompt": ["a", "b"], "stream": True}, 400),
    ("unknown endpoint", "embeddings", {"model": MODEL, "input": "a"}, 404),
]


def _full_body(path: str, body: object) -> object:
    """Fill in a valid model/messages around a partial chat body, so each case has one fault."""
    if not isinstance(body, dict) or path != "chat/completions" or "model" in body or "messages" in body:
        return body
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}


def test_bad_input_corpus(server_url: str, client: openai.OpenAI) -> None:
    assert len(BAD_REQUESTS) >= 30
    failures = []
    for name, path, body, status in BAD_REQUESTS:
        body = _full_body(path, body)
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
        r = httpx.post(f"{server_url}/{path}", timeout=60, **kw)
        try:
            err = r.json()["error"]
            ok = r.status_code == status and isinstance(err["message"], str) and err["message"]
            ok = ok and {"message", "type", "param", "code"} <= set(err)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            failures.append(f"{name}: {r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)
    assert httpx.get(f"{server_url}/chat/completions").status_code == 405
    # the server is still up and serving
    r = chat(client, "Name a color.", extra_body={"choice": ["red", "blue"]})
    assert r.choices[0].message.content in ("red", "blue")


def test_a_bad_prompt_of_a_list_is_named_by_its_place(server_url: str) -> None:
    for prompts, param in ((["Say hi.", "   "], "prompt.1"), (["\ud800 lone"], "prompt")):
        r = httpx.post(f"{server_url}/completions", timeout=60,
                       content=json.dumps({"model": MODEL, "prompt": prompts, "max_tokens": 2}).encode(),
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_error_messages_name_the_problem(server_url: str) -> None:
    def error(body: dict) -> dict:
        return httpx.post(f"{server_url}/chat/completions", json=_full_body("chat/completions", body), timeout=60).json()["error"]

    assert error({"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]})["code"] == "model_not_found"
    e = error({"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}]})
    assert e["code"] == "context_length_exceeded" and "2048" in e["message"]
    e = error({"max_tokens": -1})
    assert e["param"] == "max_tokens"
    e = error({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert "nope" in e["message"] and e["param"] == "tool_choice"
    e = error({"response_fromat": {"type": "json_object"}})
    assert e["param"] == "response_fromat" and "did you mean 'response_format'" in e["message"]
    e = error({"stream": "yes"})
    assert e["param"] == "stream" and "boolean" in e["message"] and '"yes"' in e["message"]


def test_json_schema_strict_follows_openai(server_url: str) -> None:
    """strict=false relaxes keywords no backend enforces (uniqueItems: generated best effort,
    so the output may fail it: a 422); left out they are refused; strict=true closes objects
    that do not say otherwise."""
    from structgen_server.constraints import request_constraint
    from structgen_server.protocol import ChatCompletionRequest

    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "uniqueItems": True, "maxItems": 3}

    def body(strict: bool | None) -> dict:
        json_schema = {"name": "x", "schema": schema} | ({} if strict is None else {"strict": strict})
        return _full_body("chat/completions", {"response_format": {"type": "json_schema", "json_schema": json_schema}, "max_tokens": 16})

    r = httpx.post(f"{server_url}/chat/completions", json=body(None), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_schema"
    r = httpx.post(f"{server_url}/chat/completions", json=body(False), timeout=60)
    assert r.status_code == 200 or (r.status_code == 422 and r.json()["error"]["code"] == "output_validation_failed"), r.text
    closed = request_constraint(ChatCompletionRequest.model_validate(_full_body("chat/completions", {
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": Weather.model_json_schema()}},
    })))
    assert closed.output_type.schema["additionalProperties"] is False
    assert closed.strict


def histogram_metric(server_url: str, name: str = "structgen_stream_first_text_seconds") -> tuple[int, float]:
    """The count and sum of the server's histogram `name`."""
    text = httpx.get(server_url.removesuffix("/v1") + "/metrics").text
    count = re.search(rf"^{name}_count\{{.*\}} (\d+)$", text, re.M)
    total = re.search(rf"^{name}_sum\{{.*\}} ([0-9.]+)$", text, re.M)
    assert count and total, text[-2000:]
    return int(count.group(1)), float(total.group(1))


def test_a_streams_first_text_is_timed_once_from_the_servers_side(server_url: str, client: openai.OpenAI) -> None:
    count, total = histogram_metric(server_url)
    chat(client, "Hi", max_tokens=4)  # not streamed: no first text to time
    assert histogram_metric(server_url)[0] == count
    t0 = time.perf_counter()
    chunks = chat(client, "Say hi as JSON.", max_tokens=12, stream=True,
                  response_format={"type": "json_object"})
    first = next(c for c in chunks if c.choices and c.choices[0].delta.content)
    waited = time.perf_counter() - t0
    assert first.choices[0].delta.content
    list(chunks)
    after, after_total = histogram_metric(server_url)
    assert after == count + 1
    assert 0 < after_total - total <= waited  # the server's share of what the client waited


def test_a_requests_planning_is_timed_within_its_first_text(server_url: str, client: openai.OpenAI) -> None:
    plans, plan_total = histogram_metric(server_url, "structgen_request_plan_seconds")
    firsts, first_total = histogram_metric(server_url)
    chat(client, "Hi", max_tokens=4)  # not streamed: planned all the same
    assert histogram_metric(server_url, "structgen_request_plan_seconds")[0] == plans + 1
    plans, plan_total = histogram_metric(server_url, "structgen_request_plan_seconds")
    schema = {"type": "object", "properties": {"planned": {"type": "integer"}}, "required": ["planned"]}
    list(chat(client, "Say a number as JSON.", max_tokens=12, stream=True,
              response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}))
    after, after_total = histogram_metric(server_url, "structgen_request_plan_seconds")
    first_after, first_after_total = histogram_metric(server_url)
    assert after == plans + 1 and first_after == firsts + 1
    # a new schema's compile is in its plan, and the plan is part of the first text's wait
    assert 0 < after_total - plan_total < first_after_total - first_total
    bad = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
           "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "nope"}}}}
    assert httpx.post(server_url + "/chat/completions", json=bad).status_code == 400
    assert histogram_metric(server_url, "structgen_request_plan_seconds")[0] == after  # refused: never planned


def test_a_schema_or_tool_parameters_jsonschema_cannot_read_are_a_400(server_url: str) -> None:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    schema = {"$schema": True, "type": "object"}  # jsonschema's own draft lookup fails on it
    for body, param in [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}], "tool_choice": "required"},
         "tools"),
    ]:
        r = httpx.post(server_url + "/chat/completions", json={**base, **body})
        assert r.status_code == 400, r.text
        assert "$schema must be the URI of a JSON Schema draft" in r.json()["error"]["message"], param


def test_metrics_count_requests_and_tokens(server_url: str, client: openai.OpenAI) -> None:
    chat(client, "Hi", max_tokens=4)
    chat(client, "Hi", max_tokens=4)  # the same prompt again: its first pages come from the prefix cache
    text = httpx.get(server_url.removesuffix("/v1") + "/metrics").text
    assert re.search(r"structgen_cached_prompt_tokens_total\{.*\} [1-9]", text)
    assert re.search(r'structgen_requests_total\{.*endpoint="chat",status="200"\} [1-9]', text)
    assert re.search(r"structgen_output_tokens_total\{.*\} [1-9]", text)
    assert "structgen_forced_tokens_total" in text and "structgen_errors_total" in text
