"""The server under many clients at once: every stream answered in full, kept-alive
connections that a client reuses still there, and the pre-serialized SSE chunks equal to the
chunks OpenAI's format describes."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from structgen_server.connection import HEAD_TIMEOUT_S
from structgen_server.responses import ChunkEncoder

MODEL = "SmolLM2-135M-Instruct"
STREAMS = 64  # twice the fixture server's batch: most of them wait for a slot


async def _stream(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Request {i}: is the sky blue?"}], max_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"guided_choice": ["yes", "no"]})
    text, finish = [], None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


async def _all_streams(url: str) -> list[tuple[str, str | None] | BaseException]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    http = httpx.AsyncClient(limits=limits, timeout=120)
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, http_client=http) as client:
        return await asyncio.gather(*(_stream(client, i) for i in range(STREAMS)), return_exceptions=True)


def test_many_concurrent_streams_are_all_answered_in_full(server_url: str) -> None:
    outcomes = asyncio.run(_all_streams(server_url))
    lost = [o for o in outcomes if isinstance(o, BaseException)]
    assert not lost, f"{len(lost)} of {STREAMS} streams failed, e.g. {lost[0]!r}"
    assert all(text in ("yes", "no") and finish == "stop" for text, finish in outcomes), outcomes[:5]


def _get_health(conn: socket.socket) -> bytes:
    """One whole response to GET /health on `conn` (head and body may come in separate reads)."""
    host, port = conn.getpeername()[:2]
    conn.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    conn.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = conn.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_an_idle_kept_alive_connection_outlives_the_clients_keep_alive(server_url: str) -> None:
    """httpx, under the openai client, reuses an idle connection for up to 5 s: a server that
    closed it first would lose the request the client sends on it meanwhile."""
    host, port = httpx.URL(server_url).host, httpx.URL(server_url).port
    with socket.create_connection((host, port)) as conn:
        assert _get_health(conn).startswith(b"HTTP/1.1 200")
        time.sleep(6.0)
        assert _get_health(conn).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("text", ['{"a": "x"}', "quote \" back\\slash \n newline", "é 中 😀", "\u2028\x00\t"])
@pytest.mark.parametrize("usage", [False, True])
def test_a_text_chunk_is_the_chunk_serialized_whole(text: str, usage: bool) -> None:
    for obj, template, choice in (
        ("chat.completion.chunk", ChunkEncoder.CHAT_TEXT, {"index": 0, "delta": {"content": text}}),
        ("text_completion", ChunkEncoder.COMPLETION_TEXT, {"index": 0, "text": text}),
    ):
        enc = ChunkEncoder(obj, "id-1", "m", usage, template)
        whole = enc.choice({**choice, "logprobs": None, "finish_reason": None})
        fast = enc.text(text)
        assert fast.startswith("data: ") and fast.endswith("\n\n")
        assert json.loads(fast[6:]) == json.loads(whole[6:])
        assert ("usage" in json.loads(fast[6:])) == usage


def test_a_request_head_growing_past_the_limit_is_refused_at_once(server_url: str) -> None:
    """Headers that keep coming (no blank line yet) past 64 KB: the connection is closed then,
    not at the head deadline, whichever HTTP parser uvicorn runs (h11 answers first)."""
    url = httpx.URL(server_url)
    with socket.create_connection((url.host, url.port)) as conn:
        conn.settimeout(HEAD_TIMEOUT_S + 5)
        head = f"GET /health HTTP/1.1\r\nHost: {url.host}:{url.port}\r\nX-Pad: {'a' * 100_000}\r\n"
        t0, answer = time.monotonic(), b""
        try:
            conn.sendall(head.encode())
            while chunk := conn.recv(65536):
                answer += chunk
        except (BrokenPipeError, ConnectionResetError):  # closed while it was still sending
            pass
        assert time.monotonic() - t0 < HEAD_TIMEOUT_S / 2
    assert answer == b"" or answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), answer[:100]
