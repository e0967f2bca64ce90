"""The constraint size limits and compile time budget, as the two kinds of user set them: an
`LLM`'s caller through its keywords, a server's operator through `structgen serve` flags. A
limit's error names the setting the reader can reach: the keyword in the library, the flag over
HTTP (a client cannot call `LLM(...)`). Real default model on CPU."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

import structgen
from structgen import ConstraintLimits, ConstraintTooLargeError, InvalidParameterError, JsonSchema
from structgen.engine.config import EngineConfig
from structgen_server.app import create_app

SIX = {"enum": ["a", "b", "c", "d", "e", "f"]}
CONFIG = EngineConfig(max_batch_size=2, max_seq_len=512)


@pytest.fixture(scope="module")
def small(model_dir):
    with structgen.LLM(model_dir, config=CONFIG, limits=ConstraintLimits(max_enum_values=5)) as llm:
        yield llm


def test_an_llms_limits_refuse_a_larger_schema_naming_the_keyword_that_raises_them(small) -> None:
    with pytest.raises(ConstraintTooLargeError) as caught:
        small.generate(JsonSchema(SIX), "Pick one.", max_tokens=4)
    assert "max_enum_values=5" in str(caught.value)
    assert "LLM(..., limits=ConstraintLimits(max_enum_values=...))" in str(caught.value)
    assert small.generate(JsonSchema({"enum": ["a", "b"]}), "Pick one.", max_tokens=4) in ("a", "b")


def test_a_regex_over_the_limit_names_the_keyword_and_raising_it_takes_the_regex(model_dir) -> None:
    """Past the default 1,000,000 bytes a regex is refused by the LLM's own limit (naming the
    keyword), and a raised limit lets it through to the compile (structgen's own cap, checked
    before `re` parses it, is 64 MiB)."""
    from structgen import Regex
    from structgen.types import to_constraint

    long = Regex("(ab|cd)" * 150_000)  # 1.05 MB
    with structgen.LLM(model_dir, config=CONFIG) as llm:
        with pytest.raises(ConstraintTooLargeError, match=r"max_source_bytes=1,000,000; make it smaller or raise"):
            llm.compile(long)
    assert to_constraint(long).source == long.pattern
    with pytest.raises(ConstraintTooLargeError, match="no constraint may be larger"):
        to_constraint(Regex("a" * (64 << 20) + "b"))


def test_raised_limits_take_the_schema(model_dir) -> None:
    with structgen.LLM(model_dir, config=CONFIG, limits=ConstraintLimits(max_enum_values=6)) as llm:
        assert llm.generate(JsonSchema(SIX), "Pick one.", max_tokens=4) in SIX["enum"]


def test_an_llms_compile_time_budget_is_its_keyword(model_dir) -> None:
    with structgen.LLM(model_dir, config=CONFIG, compile_timeout=1e-9) as llm:
        with pytest.raises(ConstraintTooLargeError, match=r"LLM\(\.\.\., compile_timeout=\.\.\.\)"):
            llm.generate(structgen.CFG('root ::= "a" root | "b"'), "Go.", max_tokens=4)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"limits": {"max_enum_values": 5}}, "limits must be a ConstraintLimits, got dict"),
    ({"limits": ConstraintLimits(max_depth=0)}, "ConstraintLimits.max_depth must be between 1 and 64, got 0"),
    ({"limits": ConstraintLimits(max_depth=65)}, "ConstraintLimits.max_depth must be between 1 and 64"),
    ({"limits": ConstraintLimits(max_source_bytes=1 << 30)}, "ConstraintLimits.max_source_bytes must be between 1"),
    ({"compile_timeout": 0}, "compile_timeout (seconds) must be > 0.0"),
    ({"compile_timeout": "30"}, "compile_timeout (seconds) must be a number"),
])  # fmt: skip
def test_bad_settings_are_refused_before_the_model_loads(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        structgen.LLM("/no/such/model", **kwargs)  # a load would fail differently
    assert words in str(caught.value)


def test_a_server_client_is_told_the_flag_not_the_library_keyword(small) -> None:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(small))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post("/v1/chat/completions", json={
                "model": small.model_name, "messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": SIX}}})

    r = asyncio.run(send())
    assert r.status_code == 400 and r.json()["error"]["code"] == "constraint_too_large"
    message = r.json()["error"]["message"]
    assert "max_enum_values=5" in message and "structgen serve --max-enum-values" in message
    assert "LLM(" not in message and "ConstraintLimits" not in message
